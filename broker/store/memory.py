"""In-memory store: the ``Store`` protocol kept in dicts, for the simulator and for fast tests.

It keeps nothing across restarts and never fsyncs: a write is "durable" the moment it returns. It has the
SQLite store's semantics (``broker/store/sqlite.py``): a job id and a tenant's idempotency key are unique
(``DuplicateKey``); an update names the version it read and fails with ``Conflict`` if the stored version
differs or the job does not exist; a decision given with an update is written with it or not at all;
every insert and update appends a job event; listings are newest first and page with the same cursors.

It is cheap: jobs and site specs are kept as the pydantic objects handed in (no JSON round-trips), since
they are replaced, never mutated (``Job.transition`` returns a copy). Decision records are kept as given;
callers must not mutate a record after saving it. The methods are ``async`` to satisfy the protocol but
never wait, so a write cannot interleave with another. To use SQLite instead, pass ``SQLiteStore``.

Leadership is kept in the object too (one holder, epoch and expiry by ``time.monotonic()``), with the same
semantics as the other stores, so a test can run several "replicas" on one ``MemoryStore`` and fence them.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker import usage
from broker.models import Job, SiteSpec
from broker.store import (
    EVENT_KEYS,
    QueuedUpdates,
    Conflict,
    DuplicateKey,
    JobFilter,
    LimitOverride,
    Page,
    StoredDecision,
    StoreError,
    decode_cursor,
    encode_cursor,
    ended_at,
    fence_error,
    with_attempt_prices,
)


@dataclass(slots=True)
class _Row:
    """One job as stored: the sequence number orders listings; tenant and digest are fixed at insert."""

    seq: int
    job: Job
    tenant: str
    idempotency_key: str | None
    digest: str | None


def _event(job: Job, reason: str | None) -> dict[str, Any]:
    return {"at": job.updated_at.isoformat(), "state": job.state.value, "site": job.site,
            "attempt": job.attempt, "reason": reason or job.reason, "gpu_model": job.gpu_model,
            "usd_per_gpu_hour": job.usd_per_gpu_hour}


class MemoryStore(QueuedUpdates):
    def __init__(self) -> None:
        self._open = False
        self._seq = 0
        self._rows: dict[str, _Row] = {}  # job id -> row; insertion order is seq order
        self._by_seq: list[_Row] = []  # the same rows, ascending seq (rows of pruned jobs are taken out)
        self._keys: dict[tuple[str, str], str] = {}  # (tenant, idempotency key) -> job id
        self._events: dict[str, list[dict[str, Any]]] = {}
        # (hour, tenant, site, model) -> GPU-seconds, attempts begun, priced GPU-seconds and their cost, of the jobs
        # pruned (broker.usage)
        self._hours: dict[tuple[int, str, str, str], tuple[float, int, float, float]] = {}
        self._decisions: dict[str, StoredDecision] = {}
        self._sites: dict[str, SiteSpec] = {}
        self._state: dict[str, str] = {}  # put_state: name -> JSON
        self._tokens: dict[str, tuple[str, str]] = {}  # token id -> (digest, record JSON)
        self._limits: dict[str, LimitOverride] = {}  # tenant -> its limit set through the API
        self._leader: tuple[str, int, float] | None = None  # holder, epoch, expires at (time.monotonic())
        self._fence: int | None = None

    # --- life cycle ---

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False

    def _check_open(self) -> None:
        if not self._open:
            raise StoreError("store is not open")

    def _check_fence(self) -> None:
        if self._fence is None:
            return
        leader = None if self._leader is None else (self._leader[1], self._leader[2] > time.monotonic())
        if (error := fence_error(self._fence, leader)) is not None:
            raise error

    # --- leadership ---

    async def acquire_leadership(self, holder: str, lease_s: float) -> int | None:
        self._check_open()
        now = time.monotonic()
        if self._leader is None:
            epoch = 1
        else:
            current, epoch, expires = self._leader
            if current != holder and expires > now:
                return None
            epoch += 1  # a new term, even for the same holder: writes queued in its last one stay fenced
        self._leader = (holder, epoch, now + lease_s)
        return epoch

    async def renew_leadership(self, holder: str, epoch: int, lease_s: float) -> bool:
        self._check_open()
        now = time.monotonic()
        if self._leader is None or self._leader[:2] != (holder, epoch) or self._leader[2] <= now:
            return False
        self._leader = (holder, epoch, now + lease_s)
        return True

    async def release_leadership(self, holder: str, epoch: int) -> None:
        self._check_open()
        if self._leader is not None and self._leader[:2] == (holder, epoch):
            self._leader = (holder, epoch, time.monotonic())

    async def leader(self) -> str | None:
        self._check_open()
        if self._leader is None or self._leader[2] <= time.monotonic():
            return None
        return self._leader[0]

    def fence(self, epoch: int | None) -> None:
        self._fence = epoch

    # --- jobs ---

    async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None:
        self._check_open()
        if job.id in self._rows:
            raise DuplicateKey(f"job id {job.id} is already taken")
        tenant = job.spec.tenant
        if idempotency_key is not None:
            if (tenant, idempotency_key) in self._keys:
                raise DuplicateKey(f"tenant {tenant} already used idempotency key {idempotency_key!r}")
            self._keys[(tenant, idempotency_key)] = job.id
        self._seq += 1
        self._rows[job.id] = row = _Row(self._seq, job, tenant, idempotency_key, digest)
        self._by_seq.append(row)
        self._events[job.id] = [_event(job, "submitted")]

    def enqueue_update(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> asyncio.Future[None]:
        """Apply the update now; the returned future is already resolved (or failed)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._update(job, expected_version, event_reason, decision)
        except StoreError as e:
            fut.set_exception(e)
        else:
            fut.set_result(None)
        return fut

    def _update(
        self, job: Job, expected_version: int, event_reason: str | None, decision: dict[str, Any] | None
    ) -> None:
        self._check_open()
        self._check_fence()
        row = self._rows.get(job.id)
        if row is None or row.job.version != expected_version:
            raise Conflict(f"job {job.id} changed since it was read (or does not exist)")
        row.job = job
        self._events[job.id].append(_event(job, event_reason))
        if decision is not None:
            self._decisions[job.id] = StoredDecision(job.attempt, decision)

    async def get_job(self, job_id: str) -> Job | None:
        self._check_open()
        row = self._rows.get(job_id)
        return row.job if row is not None else None

    async def find_idempotent(self, tenant: str, key: str) -> tuple[Job, str | None] | None:
        self._check_open()
        job_id = self._keys.get((tenant, key))
        if job_id is None:
            return None
        row = self._rows[job_id]
        return row.job, row.digest

    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None = None) -> Page:
        self._check_open()
        before = decode_cursor(cursor) if cursor is not None else None
        rows = list(self._rows.values())  # ascending seq
        end = len(rows) if before is None else bisect_left(rows, before, key=lambda r: r.seq)
        items: list[Job] = []
        last_seq = 0
        more = False
        for i in range(end - 1, -1, -1):
            row = rows[i]
            job = row.job
            if flt.state is not None and job.state != flt.state:
                continue
            if flt.tenant is not None and row.tenant != flt.tenant:
                continue
            if flt.site is not None and job.site != flt.site:
                continue
            if flt.tenants is not None and row.tenant not in flt.tenants:
                continue
            if flt.sites is not None and job.site not in flt.sites:
                continue
            if flt.states is not None and job.state not in flt.states:
                continue
            if flt.labels and not flt.has_labels(job):
                continue
            if len(items) == limit:
                more = True
                break
            items.append(job)
            last_seq = row.seq
        return Page(items, encode_cursor(last_seq) if more and items else None)

    async def active_jobs(self) -> list[Job]:
        self._check_open()
        return [r.job for r in self._rows.values() if not r.job.state.terminal]

    async def active_at(self, seqs: list[int]) -> list[tuple[int, Job]]:
        self._check_open()
        wanted = set(seqs)
        return [(r.seq, r.job) for r in self._rows.values() if r.seq in wanted and not r.job.state.terminal]

    async def last_seq(self) -> int:
        self._check_open()
        return self._seq

    async def active_after(self, seq: int, limit: int) -> list[tuple[int, Job]]:
        self._check_open()
        rows = self._by_seq
        out: list[tuple[int, Job]] = []
        for i in range(bisect_left(rows, seq + 1, key=lambda r: r.seq), len(rows)):
            if len(out) == limit:
                break
            if not rows[i].job.state.terminal:
                out.append((rows[i].seq, rows[i].job))
        return out

    async def job_events(self, job_id: str) -> list[dict[str, Any]]:
        self._check_open()
        return with_attempt_prices([{k: e[k] for k in EVENT_KEYS} for e in self._events.get(job_id, ())])

    def _usage_of(self, ids: Iterable[str]) -> list[usage.Held]:
        jobs, events = {}, []
        for job_id in sorted(ids):
            job = self._rows[job_id].job
            jobs[job_id] = (job.spec.tenant, job.spec.gpus.model_dump_json(), job.gpu_model)
            events += [(job_id, e["at"], e["state"], e["site"], e["attempt"], e["gpu_model"], e["usd_per_gpu_hour"])
                       for e in self._events.get(job_id, ())]
        return usage.holds(jobs, events)

    async def usage_records(self, start: float, end: float) -> usage.UsageRecords:
        self._check_open()
        kept = [r.job.id for r in self._by_seq if (ended_at(r.job) or math.inf) >= start - 86400]
        hours = [(*key, *figures) for key, figures in self._hours.items() if start <= key[0] < end]
        return usage.UsageRecords(self._usage_of(kept), hours)

    async def date_ended(self, limit: int) -> int:
        self._check_open()
        return 0  # (every row is dated as it is written: when it ended is read from the job itself)

    async def prune_ended(self, before: datetime, limit: int, keep: Collection[str] = ()) -> list[str]:
        self._check_open()
        self._check_fence()
        ended = sorted((ended_at(r.job), r.job.id) for r in self._by_seq if r.job.state.terminal)
        ids = [job_id for at, job_id in ended if at is not None and at < before.timestamp()
               and job_id not in keep][:limit]
        for key, added in usage.roll_up(self._usage_of(ids)).items():
            self._hours[key] = usage.add_hour(self._hours.get(key), added)
        for job_id in ids:
            row = self._rows.pop(job_id)
            if row.idempotency_key is not None:
                self._keys.pop((row.tenant, row.idempotency_key), None)
            self._events.pop(job_id, None)
            self._decisions.pop(job_id, None)
        if ids:
            self._by_seq = list(self._rows.values())
        return ids

    # --- decisions ---

    async def save_decision(self, job_id: str, attempt: int, record: dict[str, Any]) -> None:
        self._check_open()
        self._check_fence()
        self._decisions[job_id] = StoredDecision(attempt, record)

    async def get_decision(self, job_id: str) -> StoredDecision | None:
        self._check_open()
        return self._decisions.get(job_id)

    # --- sites ---

    async def put_site(self, spec: SiteSpec) -> None:
        self._check_open()
        self._check_fence()
        self._sites[spec.name] = spec

    async def seed_site(self, spec: SiteSpec) -> None:
        self._check_open()
        self._sites.setdefault(spec.name, spec)

    async def delete_site(self, name: str) -> None:
        self._check_open()
        self._check_fence()
        self._sites.pop(name, None)

    async def list_sites(self) -> list[SiteSpec]:
        self._check_open()
        return [self._sites[name] for name in sorted(self._sites)]

    # --- learned state ---

    async def put_state(self, name: str, doc: str) -> None:
        self._check_open()
        self._check_fence()
        self._state[name] = doc

    async def get_state(self, name: str) -> str | None:
        self._check_open()
        return self._state.get(name)

    # --- tenant limits set through the API ---

    async def list_tenant_limits(self) -> list[LimitOverride]:
        self._check_open()
        return [self._limits[t] for t in sorted(self._limits)]

    async def put_tenant_limit(self, override: LimitOverride) -> None:
        self._check_open()
        self._check_fence()
        self._limits[override.tenant] = override

    async def delete_tenant_limit(self, tenant: str) -> None:
        self._check_open()
        self._check_fence()
        self._limits.pop(tenant, None)

    # --- tokens (broker.auth) ---

    async def put_token(self, token_id: str, digest: str, doc: str) -> None:
        self._check_open()
        if token_id in self._tokens or any(d == digest for d, _ in self._tokens.values()):
            raise DuplicateKey(f"token {token_id} is already stored")
        self._tokens[token_id] = (digest, doc)

    async def update_token(self, token_id: str, doc: str) -> None:
        self._check_open()
        if token_id in self._tokens:
            self._tokens[token_id] = (self._tokens[token_id][0], doc)

    async def list_tokens(self) -> list[str]:
        self._check_open()
        return [self._tokens[k][1] for k in sorted(self._tokens)]
