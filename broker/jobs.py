"""The job book: active jobs in memory, every change written through the store before it counts.

One asyncio loop owns the book. A transition is checked against the state machine and applied to memory
in one synchronous step (no await between reading and writing the job), then written through the store,
whose single writer applies changes in the order they were made. Terminal jobs leave memory; reads fall
back to the store.

Idempotency: a submission with an ``Idempotency-Key`` returns the job first created with that key by the
same tenant (the body must match: a different body with the same key is a conflict). The bodies are
compared as JSON, not as bytes: a client that sends the same request again with other whitespace or its
keys in another order is retrying, not changing it. Concurrent duplicates wait for the first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from broker.after import conditions, dependencies, never_reason, released_reason, unmet, waiting_reason
from broker.clock import Clock
from broker.metrics import Metrics
from broker.models import IllegalTransition, Job, JobChange, JobSpec, JobState
from broker.queue import QueueIndex
from broker.events import EventHub
from broker.store import Conflict, DuplicateKey, Fenced, Store, StoreError
from policies.snapshot import NO_SITES, gpus_charged

log = logging.getLogger(__name__)
transitions_log = logging.getLogger("heliotrope.jobs")  # one line per transition; `heliotrope demo` shows it

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


_last_id = 0  # the last id new_job_id made in this process, as a number


def new_job_id() -> str:
    """A sortable id: 48 bits of milliseconds then 40 random bits, in Crockford base32 (18 characters). Monotonic
    within the process, as ULID's monotonic generator is: an id made within the same millisecond as the last one
    (or while the clock stepped back) is the last one plus one, so ids sort in the order they were made. The
    queue orders jobs of the same priority and age by id, so jobs submitted within one millisecond keep their
    order rather than take a random one."""
    global _last_id
    value = (int(time.time() * 1000) << 40) | int.from_bytes(os.urandom(5), "big")
    if value >> 40 <= _last_id >> 40:
        value = _last_id + 1
    _last_id = value
    out = []
    for _ in range(18):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def _in_order(jobs: Iterable[Job]) -> list[Job]:
    """Scheduling order: highest priority first, then oldest first."""
    return sorted(jobs, key=lambda j: (-j.spec.priority, j.created_at, j.id))


GAP_TTL_S = 60.0
"""How long a row number skipped by ``pull_new`` is looked for again: an insert that started before a later
one committed has committed (or failed) well within this (the stores time a statement out after 10 s)."""
TAKEOVER_GAP_ROWS = 10_000
"""At a load, the rows just below the last one that may still be committing (more than any writer batches)."""
MAX_GAP_ROWS = 100_000
"""A larger jump between row numbers is not tracked row by row (the first read after a load, say)."""
GAP_CHECK_S = 1.0
"""How often skipped rows are looked up again (a submission may wait this much longer to be taken in)."""
LOAD_PAGE = 10_000
"""Jobs read per query when the book loads: the whole queue is never held twice, as documents and as jobs."""


def _number(text: str) -> int | float:
    """A JSON number with a fraction or an exponent, as the canonical body writes it: a whole one as an integer
    (``60.0`` and ``6e1`` are the number ``60``), within the integers a float holds exactly."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) <= 2**53 else value


def _digests(body: bytes) -> tuple[str, ...]:
    """The digest a new job keeps for its idempotency key first, then the others a retry may match: the body's
    canonical JSON (keys sorted, no whitespace, each number as its value: ``60.0`` is ``60``), the same
    without the numbers made so (which releases before 2026-11-30 kept), and the digest of the body's bytes
    (kept before 2026-11-29). A body that is not JSON (a caller's own bytes) is digested as it is."""
    raw = hashlib.sha256(body).hexdigest()

    def digest(**parse: object) -> str:
        canonical = json.dumps(json.loads(body, **parse), sort_keys=True, separators=(",", ":"),  # type: ignore[arg-type]
                               ensure_ascii=False, allow_nan=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    try:
        return digest(parse_float=_number), digest(), raw
    except ValueError:  # (not JSON, or NaN in it)
        return (raw,)


class IdempotencyConflict(ValueError):
    """The idempotency key was used before with a different request body."""


class PastDeadline(ValueError):
    """A new job's deadline has already passed: no placement could meet it, and the broker would only record
    a miss. (A replay of a job accepted earlier, whose deadline has passed since, is no new job: it replays.)"""


def check_deadline(deadline: datetime | None, now: datetime) -> None:
    """PastDeadline where ``deadline`` (a new job's, a preview's or a changed one) has passed at ``now``."""
    if deadline is not None and deadline < now:
        raise PastDeadline(f"deadline {deadline.isoformat()} has passed: it is {now.isoformat()} at the broker; give "
                           "a later deadline, or none")


class JobNotFound(KeyError):
    pass


class NotQueued(ValueError):
    """A change asked of a job that is no longer queued (placed, running or ended)."""


class ActiveJobs(MutableMapping[str, Job]):
    """The book's unfinished jobs by id. Queued jobs, nearly all of them in a long queue, are kept as their
    compact JSON document (the fields that differ from their defaults: about 250 bytes, against some 4 KB
    for a pydantic ``Job``) and rebuilt when read; each is also in :attr:`queue`, the index a scheduling
    pass walks. Jobs on sites, or on their way to one, are kept as they are.

    Reading a queued job costs a parse (some 15 µs): hot paths over many jobs go through :attr:`queue`
    (queued) or :meth:`unqueued` (the rest) instead of :meth:`values`.

    A queued job that waits for the jobs it runs after (``Job.waiting``; ``JobSpec.after``, ``after_any``,
    ``after_failed``: ``broker.after``) is kept as the other queued jobs are, but out of :attr:`queue`: no
    scheduling pass walks it, so a pass pays nothing for the jobs that wait. :attr:`dependents` indexes them by
    the jobs they wait for (in any of the three lists), which is how the end of one finds them."""

    __slots__ = ("_jobs", "_queued", "queue", "_waiting", "dependents")

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._queued: dict[str, bytes] = {}
        self.queue = QueueIndex()
        self._waiting: dict[str, tuple[str, tuple[str, ...]]] = {}  # waiting job id -> (its tenant, what it waits for)
        self.dependents: dict[str, set[str]] = {}  # job id -> the waiting jobs that run after it

    def _hold(self, job: Job) -> None:
        self._unhold(job.id)
        self._waiting[job.id] = (job.spec.tenant, deps := tuple(dependencies(job.spec)))
        for dep in deps:
            self.dependents.setdefault(dep, set()).add(job.id)

    def _unhold(self, job_id: str) -> None:
        held = self._waiting.pop(job_id, None)
        if held is None:
            return
        for dep in held[1]:
            waiters = self.dependents.get(dep)
            if waiters is not None:
                waiters.discard(job_id)
                if not waiters:
                    del self.dependents[dep]

    def __getitem__(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        return Job.model_validate_json(self._queued[job_id])

    def __setitem__(self, job_id: str, job: Job) -> None:
        if job.state == JobState.QUEUED:
            self._jobs.pop(job_id, None)
            self._queued[job_id] = _COMPACT(job, exclude_defaults=True)
            if job.waiting:
                self.queue.discard(job_id)
                self._hold(job)
            else:
                self._unhold(job_id)
                self.queue.add(job)
        else:
            if self._queued.pop(job_id, None) is not None:
                self.queue.discard(job_id)
                self._unhold(job_id)
            self._jobs[job_id] = job

    def __delitem__(self, job_id: str) -> None:
        if self._queued.pop(job_id, None) is not None:
            self.queue.discard(job_id)
            self._unhold(job_id)
        else:
            del self._jobs[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs or job_id in self._queued

    def __iter__(self) -> Iterator[str]:
        return iter([*self._jobs, *self._queued])  # both taken now: a caller may await between items

    def __len__(self) -> int:
        return len(self._jobs) + len(self._queued)

    def clear(self) -> None:
        self._jobs.clear()
        self._queued.clear()
        self.queue.clear()
        self._waiting.clear()
        self.dependents.clear()

    def unqueued(self) -> Iterator[Job]:
        """The jobs that are not queued (on a site, on the way to one, or preempted), without reading the queue."""
        return iter(list(self._jobs.values()))

    def queued_count(self) -> int:
        return len(self._queued)

    def waiting_ids(self) -> list[str]:
        """The queued jobs that wait for the jobs they run after (out of :attr:`queue`)."""
        return list(self._waiting)

    def by_tenant(self) -> dict[str, TenantUsage]:
        """Per tenant with unfinished jobs: how many are in each state, and the GPUs those on sites or on their way
        to one hold (:func:`policies.snapshot.gpus_charged`: a fractional job its share), as federation-wide tenant
        limits count them (preempted ones too, until they are back in the queue)."""
        out: dict[str, TenantUsage] = {}
        for key, group in self.queue.groups.items():  # (priority, tenant, ...): queued jobs are not parsed
            usage = out.setdefault(key[1], TenantUsage())
            usage.jobs[JobState.QUEUED.value] = usage.jobs.get(JobState.QUEUED.value, 0) + len(group)
        for tenant, _ in self._waiting.values():  # queued too, though out of the queue: they hold nothing
            usage = out.setdefault(tenant, TenantUsage())
            usage.jobs[JobState.QUEUED.value] = usage.jobs.get(JobState.QUEUED.value, 0) + 1
        for job in self._jobs.values():
            usage = out.setdefault(job.spec.tenant, TenantUsage())
            usage.jobs[job.state.value] = usage.jobs.get(job.state.value, 0) + 1
            usage.gpus_held += gpus_charged(job.spec.gpus)
        return out


@dataclass(slots=True)
class TenantUsage:
    """One tenant's unfinished jobs by state, and the GPUs they hold across the federation."""

    jobs: dict[str, int] = field(default_factory=dict)
    gpus_held: float = 0.0


_COMPACT = Job.__pydantic_serializer__.to_json


@dataclass(slots=True)
class Refusal:
    reason: str
    until: datetime


class JobBook:
    def __init__(
        self, store: Store, clock: Clock, refusal_ttl_s: float = 30.0, new_id: Callable[[], str] = new_job_id
    ) -> None:
        """``new_id`` makes job ids; the simulator passes a deterministic one so replays repeat exactly
        (ties in scheduling order are broken by id)."""
        self._store = store
        self._new_id = new_id
        self._clock = clock
        self.refusal_ttl_s = refusal_ttl_s
        self.active = ActiveJobs()
        self._refusals: dict[str, dict[str, Refusal]] = {}
        self._next_expiry: datetime | None = None
        self._inflight_keys: dict[tuple[str, str], asyncio.Future[tuple[Job, str | None]]] = {}
        self.changed = asyncio.Event()  # set whenever work may have become schedulable
        self.fresh: list[str] = []  # jobs submitted since the scheduling cycle last took them
        self.capacity_freed = False  # a job left a site since the last full scheduling pass
        self.seq = 0  # counts transitions; orders admissions against site reports
        self.admitted_seq: dict[str, int] = {}  # job id -> seq of its current attempt's admission
        self._changes: dict[str, int] = {}  # job id -> changes made in memory (see mark, undo, resync)
        # job id -> monotonic time its end reached the store, for GAP_TTL_S: a read pull_new or take_in began
        # before that write may still answer with the job queued, and must not bring it back
        self._ended: dict[str, float] = {}
        self.suspect: set[str] = set()  # jobs whose stored state could not be read back after a failed write
        self._writing: dict[str, set[asyncio.Future[None]]] = {}  # job id -> its writes queued (see resync)
        self.tracking = True  # false on a replica that does not lead: it only stores what it is sent
        self.refusals_changed = 0  # counts refusals made and expiries: the sites a job may use changed
        self._pulled_seq = 0  # the newest job row this book has seen in the store (see pull_new)
        self._gaps: dict[int, float] = {}  # row numbers skipped below it, and when that was noticed
        self._gaps_checked = -math.inf  # monotonic time they were last looked up
        self.metrics = Metrics()  # the broker passes its own
        self.events: EventHub | None = None  # live events (broker.events); the broker passes its own
        # Called with (before, after) once a change that takes an attempt off its site (from an on-site state to
        # any other: succeeded, failed, cancelled, preempted, requeued however) or ends a job has reached the
        # store: every end of an attempt passes through here (the carbon ledger corrects its figures to the
        # time it ran). Not called for a change that did not land.
        self.on_attempt_end: Callable[[Job, Job], None] | None = None
        # Jobs that waiting jobs run after whose end (or stored state) is still to be acted on: settle_waiting.
        self._to_settle: set[str] = set()

    async def load(self) -> int:
        """Load every non-terminal job from the store (at start-up), a page at a time; returns how many."""
        last = await self._store.last_seq()  # before the jobs: a row committed meanwhile is read by pull_new
        self.active.clear()
        after = 0
        while True:
            rows = await self._store.active_after(after, LOAD_PAGE)
            for seq, job in rows:
                if seq <= last:
                    self.active[job.id] = job
            if len(rows) < LOAD_PAGE or rows[-1][0] >= last:
                break
            after = rows[-1][0]
        self._pulled_seq = last
        # Jobs waited for that are not active ended before the load (perhaps while no broker ran, or under the
        # leader before): settle_waiting reads how they ended.
        self._to_settle = {dep for dep in self.active.dependents if dep not in self.active}
        # Inserts that took a row number below ``last`` but had not committed: looked up for a while.
        noticed = time.monotonic()
        self._gaps = dict.fromkeys(range(max(1, last - TAKEOVER_GAP_ROWS + 1), last + 1), noticed)
        return len(self.active)

    # --- submit ---

    async def submit(self, spec: JobSpec, idempotency_key: str | None = None, body: bytes | None = None,
                     check: Callable[[], Awaitable[None] | None] | None = None) -> tuple[Job, bool]:
        """Store a new job durably; return (job, created). With a repeated key, return the first job. ``check``
        is called (and awaited, where it returns an awaitable) before a new job is made (not for a replay, nor
        for a duplicate sent while the first is being stored, which waits for its outcome), and may raise to
        refuse it."""
        if idempotency_key is None:
            return await self._create(spec, None, None, check), True
        digests = _digests(body if body is not None else spec.model_dump_json().encode())
        digest = digests[0]
        slot = (spec.tenant, idempotency_key)
        pending = self._inflight_keys.get(slot)
        if pending is not None:  # the same key is being submitted right now: share its outcome
            job, first_digest = await asyncio.shield(pending)
            return self._replay(job, digests, first_digest), False
        # Claim the key before the first await, so a concurrent duplicate waits instead of racing.
        fut: asyncio.Future[tuple[Job, str | None]] = asyncio.get_running_loop().create_future()
        self._inflight_keys[slot] = fut
        try:
            found = await self._store.find_idempotent(*slot)
            if found is not None:
                job, first_digest = self.active.get(found[0].id, found[0]), found[1]
                created = False
            else:
                try:
                    job, first_digest = await self._create(spec, idempotency_key, digest, check), digest
                    created = True
                except DuplicateKey:
                    # Another replica stored a job under this key between the lookup and the insert.
                    found = await self._store.find_idempotent(*slot)
                    if found is None:
                        raise
                    job, first_digest, created = self.active.get(found[0].id, found[0]), found[1], False
            fut.set_result((job, first_digest))
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved: waiters, if any, re-raise it themselves
            raise
        finally:
            del self._inflight_keys[slot]
        return self._replay(job, digests, first_digest), created

    @staticmethod
    def _replay(job: Job, digests: tuple[str, ...], first_digest: str | None) -> Job:
        if first_digest is not None and first_digest not in digests:
            raise IdempotencyConflict(
                f"Idempotency-Key was first used for job {job.id} with a different body; use a new key"
            )
        return job

    async def _create(self, spec: JobSpec, key: str | None, digest: str | None,
                      check: Callable[[], Awaitable[None] | None] | None = None) -> Job:
        now = self._clock.now()
        check_deadline(spec.deadline, now)
        if check is not None and (checking := check()) is not None:
            await checking
        waiting, reason = False, "waiting for a placement"
        if deps := dependencies(spec):
            states = {dep: await self.state_of(dep) for dep in deps}
            waits = unmet(spec, states)
            if waits:  # (one that can no longer be met since it was checked: settle_waiting fails the job)
                waiting, reason = True, waiting_reason(waits, states)
        job = Job(id=self._new_id(), spec=spec, created_at=now, updated_at=now, reason=reason, waiting=waiting)
        try:
            await self._store.insert_job(job, key, digest)
        except DuplicateKey:
            raise
        except StoreError as e:
            # The answer may have been lost after the commit (the connection dropped, the answer timed out). A job
            # in the store is accepted and will run: answering "not accepted, try again" would have the client
            # submit it twice. The id is this call's own, so a row that has it is this very job.
            try:
                stored = await self._store.get_job(job.id)
            except StoreError:
                stored = None
            if stored is None:
                raise
            log.warning("job %s: its insert was reported failed (%s) but is in the store; taken as accepted",
                        job.id, e)
        # Not when the job is already known: while this call waited for the insert's answer, a pass of the leader
        # may have taken the committed row in (``pull_new``, ``take_in``) and changed the job; putting the queued
        # copy back over that would have the next pass place it again, and leave its first placement undispatched.
        if self.tracking and not self._known(job.id):
            self._take(job)
            self.changed.set()
        return job

    def _take(self, job: Job) -> None:
        """Take in a new queued job (submitted here or through another replica)."""
        self.announce(job, None)
        self.active[job.id] = job
        self.fresh.append(job.id)
        if job.waiting:  # one it waits for may have ended before it was taken in: nothing else would tell
            self._to_settle.update(dep for dep in dependencies(job.spec) if dep not in self.active)

    def _known(self, job_id: str) -> bool:
        """Whether this book holds the job, or changed it (its end or change may still be on its way to the store):
        a queued copy of it read from the store, or made before it was stored, must not be taken in."""
        return job_id in self.active or job_id in self._changes or job_id in self._ended

    async def pull_new(self, limit: int = 10_000) -> int:
        """Take in the jobs other replicas stored since the last call (the leader calls this every cycle);
        returns how many were new to this book.

        Only queued jobs this book never touched are taken: every other replica only ever inserts queued
        jobs, and a job this book changed (say, finished, its write still on the way, or landed while the read
        was under way) must not come back from a read older than that change. Row numbers are handed out when an insert starts, not when it
        commits, so a lower one can appear after a higher one was read: the numbers skipped are looked up
        again, apart from the forward read, for :data:`GAP_TTL_S`, longer than any insert may take to
        commit. ``load`` starts the count at the store's last row, with the rows just below it that the
        load did not see counted as skipped, so a takeover in the middle of a burst loses nothing."""
        now = time.monotonic()
        for seq in [q for q, noticed in self._gaps.items() if now - noticed > GAP_TTL_S]:
            del self._gaps[seq]
        rows = await self._store.active_after(self._pulled_seq, limit)
        if self._gaps and now - self._gaps_checked >= GAP_CHECK_S:
            self._gaps_checked = now
            rows = await self._store.active_at(sorted(self._gaps)) + rows
        new = 0
        for seq, job in rows:
            self._gaps.pop(seq, None)
            if seq > self._pulled_seq:
                if seq - self._pulled_seq <= MAX_GAP_ROWS:
                    self._gaps.update(dict.fromkeys(range(self._pulled_seq + 1, seq), now))
                self._pulled_seq = seq
            if job.state == JobState.QUEUED and not self._known(job.id):
                self._take(job)
                new += 1
        if new:
            self.changed.set()
        return new

    async def take_in(self, job_id: str) -> Job | None:
        """The job ``job_id`` if this book holds it, else taken in now when another replica stored it queued
        and ``pull_new`` has not taken it in yet (a cancel sent to the leader just after a follower accepted the
        job must not wait for the next pass, nor take the job for one that is ending). None when the store has
        no such queued job, when this book changed the job itself (say, ended it: that write is on its way), or
        when its replica stopped leading meanwhile."""
        job = self.active.get(job_id)
        if job is not None or not self.tracking or job_id in self._changes:
            return job
        stored = await self._store.get_job(job_id)
        # (no longer tracking: its replica stopped leading during the read, and emptied the book, as it must stay)
        if stored is None or stored.state != JobState.QUEUED or self._known(job_id) or not self.tracking:
            return self.active.get(job_id)
        self._take(stored)
        self.changed.set()
        return stored

    # --- dependencies (broker.after) ---

    async def state_of(self, job_id: str) -> JobState | None:
        """A job's state as this book holds it, else as stored; None where the store has no such job."""
        job = self.active.get(job_id)
        if job is None:
            job = await self._store.get_job(job_id)
        return None if job is None else job.state

    async def settle_waiting(self) -> int:
        """Act on the ends of the jobs that waiting jobs run after (noted as they land, at a load and as waiting
        jobs are taken in): release each waiting job all of whose conditions hold (``broker.after.met``) into the
        queue, fail each one that can no longer run (a dependency in its ``after`` failed, was cancelled or is gone
        from the store, one in its ``after_failed`` succeeded or is gone: ``broker.after.never_reason``), and, down a
        chain, those waiting for it. The leader's loop calls this before each pass; it costs nothing while no such
        end is pending. Returns how many jobs it released or failed. A write that fails leaves
        its job waiting, and the end is acted on again at the next call; StoreError where a state cannot be read."""
        done = 0
        while self._to_settle and self.tracking:
            todo, self._to_settle = self._to_settle, set()
            states: dict[str, JobState | None] = {}
            writes: list[tuple[str, Awaitable[None]]] = []
            try:
                for dep in sorted(todo):
                    for waiter in sorted(self.active.dependents.get(dep, ())):
                        job = self.active.get(waiter)
                        if job is None or not job.waiting:
                            continue
                        for other in dependencies(job.spec):
                            if other not in states:
                                states[other] = await self.state_of(other)
                        write = self._settle_one(waiter, states)
                        if write is not None:
                            writes.append((dep, write))
            except BaseException:
                self._to_settle |= todo  # (acted on again at the next call; those settled already are not waiting)
                raise
            finally:  # the changes made are on their way to the store: their answers are awaited, whatever came
                results = await asyncio.gather(*(w for _, w in writes), return_exceptions=True)
            for (dep, _), result in zip(writes, results):
                if isinstance(result, BaseException):
                    log.warning("a job waiting for job %s was not released or failed (%s); trying again", dep, result)
                    self._to_settle.add(dep)
                else:
                    done += 1
            if any(isinstance(r, BaseException) for r in results):
                break  # (at the next call: not in a loop against a store that refuses)
        return done

    def _settle_one(self, job_id: str, states: Mapping[str, JobState | None]) -> Awaitable[None] | None:
        """Release or fail one waiting job by its dependencies' ``states`` (in memory now; the write is returned);
        None while one of them may still succeed, or where it no longer waits."""
        job = self.active.get(job_id)
        if job is None or not job.waiting:  # cancelled while its dependencies' states were read (a cancel of many)
            return None
        for dep, kind in conditions(job.spec):
            never = never_reason(dep, states[dep], kind)
            if never is not None:
                new, version = self.apply(job_id, JobState.FAILED, reason=never)
                return self.write_soon(job, new, version)
        waits = unmet(job.spec, states)
        reason = waiting_reason(waits, states) if waits else released_reason(job.spec)
        if waits and reason == job.reason:
            return None
        new = job.model_copy(update={"waiting": bool(waits), "version": job.version + 1,
                                     "updated_at": self._clock.now(), "reason": reason})
        transitions_log.info("%s %s/%s: %s", job_id, job.spec.tenant, job.spec.name, reason)
        self.seq += 1
        self._touch(job_id)
        self.active[job_id] = new  # (released: in the queue now, as a new job)
        if not waits:
            self.fresh.append(job_id)
            self.changed.set()
        return self.write_soon(job, new, job.version, event_reason=reason)

    # --- reads ---

    async def get(self, job_id: str) -> Job:
        job = self.active.get(job_id)
        if job is None:
            job = await self._store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    async def history(self, job_id: str) -> list[dict[str, Any]]:
        """The job's stored transitions, oldest first (``Store.job_events``); raises StoreError."""
        return await self._store.job_events(job_id)

    def take_fresh(self) -> list[Job]:
        """The jobs submitted since the last call that are still queued, in scheduling order."""
        fresh, self.fresh = self.fresh, []
        return _in_order(j for j in map(self.active.get, fresh)
                         if j is not None and j.state == JobState.QUEUED and not j.waiting)

    def on_site(self, site: str) -> list[Job]:
        return [j for j in self.active.unqueued() if j.site == site and j.state.on_site]

    # --- changes ---

    def apply(self, job_id: str, dst: JobState, **changes: Any) -> tuple[Job, int]:
        """Check and apply a transition in memory; return (new job, version it replaced). No await.

        The caller writes it through the store and, if that fails, calls ``undo``.
        """
        job = self.active.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        new = job.transition(dst, self._clock.now(), **changes)
        transitions_log.info("%s %s/%s: %s -> %s (%s)", job_id, job.spec.tenant, job.spec.name, job.state, dst, new.reason)
        self.seq += 1
        self._touch(job_id)
        if job.state.on_site and not new.state.on_site or job.state == JobState.PREEMPTED:
            # (a preempted job leaving that state gives its tenant's room under its limit back, and one back in the
            # queue is to be decided again: a pass run between the preemption and the requeue must not leave both
            # to the next full pass, up to cycle_interval_s later)
            self.capacity_freed = True
        if job.state == JobState.DISPATCHING and dst == JobState.ADMITTED:
            self.admitted_seq[job_id] = self.seq
            self._refusals.pop(job_id, None)  # a site took it: earlier refusals no longer matter
        if new.state.terminal:
            del self.active[job_id]
            self._refusals.pop(job_id, None)
            self.admitted_seq.pop(job_id, None)
        else:
            self.active[job_id] = new
        if dst in (JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED):
            self.changed.set()
        return new, job.version

    def _remember_ended(self, job_id: str) -> None:
        """Note that ``job_id``'s end reached the store (``_ended``), and forget the ends older than
        ``GAP_TTL_S``: the dict is in the order they were noted, so those are at its front (a lone broker, which
        never pulls, keeps no more than a minute's worth either)."""
        now = time.monotonic()
        self._ended.pop(job_id, None)
        self._ended[job_id] = now
        while (oldest := next(iter(self._ended.items()))) and now - oldest[1] > GAP_TTL_S:
            del self._ended[oldest[0]]

    def _touch(self, job_id: str) -> int:
        self._changes[job_id] = self._changes.get(job_id, 0) + 1
        return self._changes[job_id]

    def mark(self, job_id: str) -> int:
        """How many times the job changed in memory: a stale ``undo`` or ``resync`` checks it."""
        return self._changes.get(job_id, 0)

    def undo(self, before: Job, mark: int) -> bool:
        """Put ``before`` back after its successor failed to reach the store, unless the job changed again
        in memory since (``mark``), in which case the later change settles it."""
        if self._changes.get(before.id, 0) != mark:
            return False
        self._settle_memory(before)
        return True

    def _settle_memory(self, job: Job | None, job_id: str | None = None) -> None:
        """Make ``job`` (what is durable) the job in memory, with the bookkeeping that follows from it."""
        if not self.tracking:
            # Its replica stopped leading while the write that failed was on its way, and emptied the book: a
            # follower reads jobs from the store, which the new leader keeps current, and a copy put back now would
            # be what this replica answers with, unchanged, for as long as it follows.
            return
        job_id = job.id if job is not None else job_id
        assert job_id is not None
        if job is None or job.state.terminal:
            self.active.pop(job_id, None)
            if self._changes.pop(job_id, None) is not None:
                self._remember_ended(job_id)
            self.admitted_seq.pop(job_id, None)
            if job_id in self.active.dependents:
                self._to_settle.add(job_id)
        else:
            self.active[job_id] = job
            self._touch(job_id)
            if job.state in (JobState.ADMITTED, JobState.RUNNING):
                # Count it as admitted now: placements are debited until a site report newer than this.
                self.admitted_seq[job_id] = self.seq
            else:
                self.admitted_seq.pop(job_id, None)
        self.capacity_freed = True
        self.changed.set()

    async def resync(self, job_id: str) -> Job | None:
        """After a failed write, take the job as the store has it, if memory did not move meanwhile.

        Writes queued behind the failed one carry versions the store no longer expects; they fail too,
        and resync again, so memory settles on what is durable. If the store cannot be read either, the
        ``undo`` already made stands. While a write of the job is on its way, memory is left to its answer
        (the job as read is returned all the same, to tell whether the failed write landed).
        """
        mark = self.mark(job_id)
        # A write queued before the read (behind the failed one, whose answer was lost after its commit, say) may
        # commit after it: memory, which holds that change, must not be set to what the store held before it.
        on_its_way = any(not w.done() for w in self._writing.get(job_id, ()))
        try:
            stored = await self._store.get_job(job_id)
        except Exception as e:
            log.error("job %s: cannot read it back after a failed write (%s); will read it again", job_id, e)
            self.suspect.add(job_id)
            return None
        self.suspect.discard(job_id)
        if self.mark(job_id) != mark:
            return None  # changed while we read: that change's own write settles the job
        if on_its_way:
            return stored
        self._settle_memory(stored, job_id)
        log.warning("job %s: a write failed; memory now holds the stored state %s", job_id,
                    stored.state if stored else "(none)")
        return stored

    async def resync_suspects(self) -> None:
        """Read again the jobs whose read-back failed: memory may hold a state that never reached the store."""
        for job_id in list(self.suspect):
            if self.mark(job_id) == 0 and job_id not in self.active:
                self.suspect.discard(job_id)
            else:
                await self.resync(job_id)

    async def transition(self, job_id: str, dst: JobState, **changes: Any) -> Job:
        """Apply a transition and wait until it is on disk. If the write fails, memory goes back to the
        state before (then to what the store holds) and a StoreError is raised."""
        before = self.active.get(job_id)
        new, version = self.apply(job_id, dst, **changes)
        await self.write_soon(before, new, version)
        return new

    async def amend(self, job_id: str, change: JobChange) -> tuple[Job, str | None]:
        """Apply ``change`` to a queued job's spec and wait until it is on disk (its transitions record it,
        state ``queued``, with what changed as the reason). Returns the job and what changed in words (None:
        nothing did). NotQueued once it has left the queue; PastDeadline for a new deadline already passed."""
        job = self.active.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        if job.state != JobState.QUEUED:
            raise NotQueued(f"job {job_id} is {job.state}: only a queued job's priority, deadline or profile can "
                            "change (cancel it and submit it again)")
        spec = change.applied_to(job.spec)
        now = self._clock.now()
        if spec.deadline != job.spec.deadline:  # (one kept as it was may have passed since: it stays)
            check_deadline(spec.deadline, now)
        said = [f"{k} {_said(getattr(job.spec, k))} -> {_said(getattr(spec, k))}" for k in sorted(change.model_fields_set)
                if getattr(job.spec, k) != getattr(spec, k)]
        if not said:
            return job, None
        what = "changed by request: " + ", ".join(said)
        # (a waiting job keeps saying what it waits for: the change is in its transitions, and it is not released)
        new = job.model_copy(update={"spec": spec, "version": job.version + 1, "updated_at": now,
                                     "reason": job.reason if job.waiting else what})
        transitions_log.info("%s %s/%s: %s", job_id, job.spec.tenant, job.spec.name, what)
        self.seq += 1
        self._touch(job_id)
        self.active[job_id] = new  # (in its new queue group: priority first)
        self.fresh.append(job_id)  # decided at the next pass, as a new job is
        self.changed.set()
        await self.write_soon(job, new, job.version, event_reason=what)
        return new, what

    def write_soon(self, before: Job | None, new: Job, version: int, **extra: Any) -> Awaitable[None]:
        """Queue the store write of ``new`` (applied in memory over ``before``) right now, so the store
        applies changes in the order memory made them; await the result to learn whether it landed. On
        failure the change is undone in memory and StoreError is raised."""
        mark = self.mark(new.id)
        try:
            landed = self._store.enqueue_update(new, version, **extra)
        except Exception as e:
            landed = asyncio.get_running_loop().create_future()
            landed.set_exception(e)
        announced = isinstance(landed, asyncio.Future)
        if isinstance(landed, asyncio.Future):
            # On its way until the store answers, whoever awaits the answer (resync reads the job meanwhile).
            self._writing.setdefault(new.id, set()).add(landed)
            landed.add_done_callback(lambda f: self._answered(new.id, f))
            # Whoever awaits the result sees a failure; if nobody does (a pass cut short when its broker
            # stopped leading), the failure is not reported again as "never retrieved".
            landed.add_done_callback(lambda f: f.cancelled() or f.exception())
            # Published as the write lands, not when someone awaits it: the store resolves its writes in
            # the order they were queued, so a job's events go out in the order they were stored.
            landed.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.announce(new, before))
        return self._landed(landed, before, new, mark, announced)

    def writes_pending(self) -> int:
        """Writes queued (``write_soon``) whose store answer has not come yet."""
        return sum(len(writes) for writes in self._writing.values())

    def _answered(self, job_id: str, landed: asyncio.Future[None]) -> None:
        """The store answered one of the job's writes (``write_soon``)."""
        writes = self._writing.get(job_id)
        if writes is not None:
            writes.discard(landed)
            if not writes:
                del self._writing[job_id]

    async def _landed(self, landed: Awaitable[None], before: Job | None, new: Job, mark: int,
                      announced: bool = False) -> None:
        try:
            await landed
        except Exception as e:
            if before is not None:
                self.undo(before, mark)
            stored = await self.resync(new.id)
            # A write the store refused (another writer's version, a newer leader's term) did not land, whatever
            # the store holds now; of one whose answer was lost, the store holds this very document if it did.
            if isinstance(e, Conflict | Fenced | DuplicateKey) or stored is None or stored != new:
                if isinstance(e, StoreError):
                    raise
                raise StoreError(f"write failed: {e.__class__.__name__}: {e}") from e
            # It did land: the error came after the commit (the connection dropped, or the answer timed out), and
            # the store holds this very change. So it goes on as written (a placement is dispatched), rather
            # than be left in a state nobody acts on.
            log.warning("job %s: its write was reported failed (%s) but is in the store; taken as written",
                        new.id, e)
            announced = False  # (the callback saw the failure, and announced nothing)
        self.metrics.transitions.labels(new.state.value).inc()
        if not announced:
            self.announce(new, before)
        if (self.on_attempt_end is not None and before is not None
                and (before.state.on_site and not new.state.on_site or new.state.terminal)):
            try:
                self.on_attempt_end(before, new)
            except Exception:  # the change is stored all the same: its caller must not take it for failed
                log.exception("job %s: the end of attempt %d was not accounted", new.id, before.attempt)
        if new.state.terminal:
            self.metrics.finished.labels(new.state.value, new.spec.tenant).inc()
            self._changes.pop(new.id, None)
            self._remember_ended(new.id)
            if self.tracking and new.id in self.active.dependents:  # jobs wait for it: the next pass settles them
                self._to_settle.add(new.id)
                self.changed.set()

    def announce(self, job: Job, before: Job | None) -> None:
        """Publish a stored transition of ``job`` from ``before`` (None: the broker just took it in). The
        event's site is the one the job left when it left one, so that site's operator sees it go.

        A job taken in (``before`` None) entered ``queued`` without a stored transition, so it is counted in
        ``heliotrope_job_transitions_total{state="queued"}`` here, as every later change is in ``_landed``: the
        counter then agrees with the stream's ``transition`` events."""
        if before is None:
            self.metrics.transitions.labels(job.state.value).inc()
        if self.events is not None:
            site = job.site or (before.site if before is not None else None)
            self.events.publish("transition", {
                "job_id": job.id, "tenant": job.spec.tenant, "site": job.site, "state": job.state.value,
                "previous": before.state.value if before is not None else None, "attempt": job.attempt,
                "reason": job.reason, "at": job.updated_at.isoformat(),
            }, tenant=job.spec.tenant, site=site, job_id=job.id)

    async def transition_if(self, job_id: str, states: Iterable[JobState], attempt: int | None, dst: JobState,
                            **changes: Any) -> Job | None:
        """Transition only if the job is still in one of ``states`` (and at ``attempt``); else None."""
        job = self.active.get(job_id)
        if job is None or job.state not in states or (attempt is not None and job.attempt != attempt):
            return None
        try:
            return await self.transition(job_id, dst, **changes)
        except IllegalTransition:
            return None

    # --- refusals ---

    def refuse(self, job_id: str, site: str, reason: str, ttl_s: float | None = None) -> None:
        """Skip ``site`` for the job for ``ttl_s`` (default ``refusal_ttl_s``), or until a site admits it."""
        until = self._clock.now() + timedelta(seconds=self.refusal_ttl_s if ttl_s is None else ttl_s)
        self._refusals.setdefault(job_id, {})[site] = Refusal(reason, until)
        self.refusals_changed += 1
        if self._next_expiry is None or until < self._next_expiry:
            self._next_expiry = until

    def forgive(self, job_id: str, site: str) -> None:
        """Take back a refusal (the reason for it did not happen)."""
        refusals = self._refusals.get(job_id)
        if refusals is not None and refusals.pop(site, None) is not None:
            self.refusals_changed += 1
            if not refusals:
                del self._refusals[job_id]

    def refusal_expired(self, now: datetime) -> bool:
        """True (once) when some refusal has run out, so its site may take a job again."""
        if self._next_expiry is None or self._next_expiry > now:
            return False
        for job_id in list(self._refusals):
            refusals = self._refusals[job_id]
            for site in [s for s, r in refusals.items() if r.until <= now]:
                del refusals[site]
            if not refusals:
                del self._refusals[job_id]
        self._next_expiry = min((r.until for rs in self._refusals.values() for r in rs.values()), default=None)
        self.refusals_changed += 1
        return True

    def refusal_reasons(self, job_id: str) -> dict[str, str]:
        """Why each site that still refuses the job's current attempt refused it."""
        now = self._clock.now()
        return {site: r.reason for site, r in self._refusals.get(job_id, {}).items() if r.until > now}

    def refused_sites(self, job_id: str) -> frozenset[str]:
        refusals = self._refusals.get(job_id)
        if not refusals:
            return NO_SITES
        now = self._clock.now()
        return frozenset(site for site, r in refusals.items() if r.until > now)


def _said(value: Any) -> str:
    """A spec field's value in a change's words."""
    if value is None:
        return "none"
    return value.isoformat() if isinstance(value, datetime) else str(value)
