"""The broker's durable store, behind one interface so that SQLite (embedded default) and PostgreSQL
(several replicas) are interchangeable: :func:`open_store` picks one from the ``db`` setting.

Every write resolves only once it is on disk (fsynced); the API answers ``201`` after that. Job rows carry
a ``version``: an update names the version it read and fails with ``Conflict`` if another writer moved
the job first.

Leadership: replicas sharing one database elect the one that runs the scheduling cycle through a lease on
the ``leader`` row (``acquire_leadership``/``renew_leadership``/``release_leadership``). Each new holder
gets a larger ``epoch`` (the fencing token); a store told ``fence(epoch)`` checks, in the transaction of
every scheduling write, that the row is still at that epoch and unexpired, and fails the write with
:class:`Fenced` otherwise, so a deposed leader that has not noticed yet cannot overwrite its successor.
"""

from __future__ import annotations

import base64
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Awaitable, Collection
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from broker.models import STORED, Job, JobState, SiteSpec

if TYPE_CHECKING:
    from broker.usage import UsageRecords


class StoreError(RuntimeError):
    pass


class Conflict(StoreError):
    """The row changed since it was read (optimistic concurrency)."""


class DuplicateKey(StoreError):
    """The job id, or the tenant's idempotency key, is already taken."""


class UnreadableSite(StoreError):
    """A stored site spec that this release cannot read (e.g. a NaN or an infinity an earlier release took,
    which the store's JSON wrote as null)."""


def site_from_doc(doc: str) -> SiteSpec:
    """A stored site spec, or :class:`UnreadableSite` naming the site, each field and its problem."""
    try:
        return SiteSpec.model_validate_json(doc, context=STORED)
    except ValueError as e:
        try:
            name = json.loads(doc).get("name", "?")
        except ValueError:
            name = "?"
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in getattr(e, "errors", list)())
        raise UnreadableSite(
            f"the stored spec of site {name!r} cannot be read ({problems or e}); fix or delete its row of table "
            f"sites in the database, then start again"
        ) from None


class Fenced(StoreError):
    """A scheduling write from a replica whose leadership epoch is no longer the store's (or whose lease
    expired): the write was not applied."""

    def __init__(self, epoch: int, stored: int | None, expired: bool = False) -> None:
        at = "has no leader" if stored is None else f"is at {stored}"
        if expired and stored == epoch:
            at += ", and the lease expired"
        super().__init__(f"this replica is no longer the leader (epoch {epoch}; the store {at})")
        self.epoch, self.stored = epoch, stored


LEADER = "scheduler"
"""The name of the one leader row (the scheduling cycle's)."""

EVENT_KEYS = ("at", "state", "site", "attempt", "reason", "gpu_model", "usd_per_gpu_hour")
"""A job's transition as ``Store.job_events`` gives it (``GET /v1/jobs/{id}/events``): the GPU model and the price
per GPU-hour its attempt was placed at are null where unknown (no attempt yet, an unpriced site, or stored before
migration 7 or 8); the price as :func:`with_attempt_prices` gives it."""


def with_attempt_prices(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` (a job's transitions, oldest first, as :data:`EVENT_KEYS`) with each transition of an attempt
    placed (one that names its GPU model) that names no price given its attempt's, as an earlier transition of it
    recorded it: the placement records it, but a leader that read the job back from the store since (a restart, a
    takeover) writes the later ones without it, and the usage report charges them at it all the same
    (:class:`broker.usage.Holds`)."""
    priced: dict[int, float] = {}
    for e in events:
        if e["usd_per_gpu_hour"] is not None:
            priced[e["attempt"]] = e["usd_per_gpu_hour"]
        elif e["gpu_model"] is not None and e["attempt"] in priced:
            e["usd_per_gpu_hour"] = priced[e["attempt"]]
    return events


def fence_error(epoch: int, leader: tuple[int, bool] | None) -> Fenced | None:
    """The error for a write fenced at ``epoch`` given the leader row as (epoch, lease still running), or None
    when the row is still at that epoch, unexpired."""
    if leader is None:
        return Fenced(epoch, None)
    stored, live = leader
    return None if stored == epoch and live else Fenced(epoch, stored, expired=not live)


@dataclass(frozen=True, slots=True)
class JobFilter:
    state: JobState | None = None
    tenant: str | None = None
    site: str | None = None
    tenants: tuple[str, ...] | None = None  # any of these (a submitter's scope)
    sites: tuple[str, ...] | None = None  # any of these (an operator's scope)
    states: tuple[JobState, ...] | None = None  # any of these (a bulk cancel's: the active states)
    labels: tuple[tuple[str, str | None], ...] = ()  # each (key, value) must be in ``spec.labels``; value None: the
    #                                                   key is there, with any value

    def has_labels(self, job: Job) -> bool:
        """Whether ``job``'s spec carries every label of ``labels``."""
        mine = job.spec.labels
        return all(key in mine and (value is None or mine[key] == value) for key, value in self.labels)


@dataclass(frozen=True, slots=True)
class LimitOverride:
    """A tenant's federation-wide GPU limit set through the API (``PUT /v1/tenants/{tenant}/limit``), which stands
    over the configuration's (``broker.tenant_limits``, ``broker.default_tenant_limit``) until it is deleted:
    ``gpus`` None is unlimited; ``updated_at``, when it was set (UTC)."""

    tenant: str
    gpus: float | None
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Job]
    next: str | None


@dataclass(frozen=True, slots=True)
class StoredDecision:
    attempt: int
    record: dict[str, Any]


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"s{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """Raise ValueError for a cursor this store did not hand out."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not raw.startswith("s"):
            raise ValueError
        seq = int(raw[1:])
        if not 0 <= seq < 2**63:
            raise ValueError
        return seq
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{cursor!r} is not a cursor from a previous page") from None


def ended_at(job: Job) -> float | None:
    """When ``job`` ended, in seconds since the epoch (the ``ended_at`` column); None while it is active. By the
    broker's clock: the time its end was stored (``updated_at``; a final state changes no more), not its
    ``finished_at``, which is the site's word (``JobEvent.at``, by the site's clock: one far behind would have a job
    that just ended deleted at once)."""
    if not job.state.terminal:
        return None
    return job.updated_at.timestamp()


class QueuedUpdates(ABC):
    """``update_job`` for a store that implements ``enqueue_update``: queue now, then wait."""

    @abstractmethod
    def enqueue_update(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> Awaitable[None]:
        """Queue the update at the moment of the call (see ``Store.enqueue_update``)."""

    async def update_job(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> None:
        await self.enqueue_update(job, expected_version, event_reason, decision)


class Store(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    # jobs
    async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None: ...

    async def update_job(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> None:
        """Write the job's new state (and, if given, the decision behind it, in the same transaction)."""

    def enqueue_update(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> Awaitable[None]:
        """``update_job``, queued at the moment of the call: writes are applied in the order callers made
        them, so a change made in memory and queued at once can never be overtaken by a later one."""

    async def get_job(self, job_id: str) -> Job | None: ...

    async def find_idempotent(self, tenant: str, key: str) -> tuple[Job, str | None] | None: ...

    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None = None) -> Page: ...

    async def active_jobs(self) -> list[Job]: ...

    async def job_events(self, job_id: str) -> list[dict[str, Any]]: ...

    async def date_ended(self, limit: int) -> int:
        """Write when they ended into up to ``limit`` rows of jobs in a final state that have no ``ended_at`` (they
        ended before the release that keeps it, or a replica of an earlier release ended them), from their
        documents, so that :meth:`prune_ended` finds them in their turn; return how many. The leader's (fenced)."""
        ...

    async def prune_ended(self, before: datetime, limit: int, keep: Collection[str] = ()) -> list[str]:
        """Delete up to ``limit`` jobs that ended (a final state) before ``before``, those that ended first first,
        with their transitions and decision, but those in ``keep`` (jobs that waiting jobs run after: their end
        decides those); return their ids. The leader's (fenced), as a scheduling write."""
        ...

    # decisions
    async def usage_records(self, start: float, end: float) -> UsageRecords:
        """For a usage report over [``start``, ``end``) (POSIX seconds, whole hours; :mod:`broker.usage`): the jobs
        kept that may have held GPUs since ``start``, their transitions, and the hours rolled up from jobs deleted
        since, read as one snapshot."""
        ...

    async def save_decision(self, job_id: str, attempt: int, record: dict[str, Any]) -> None: ...

    async def get_decision(self, job_id: str) -> StoredDecision | None: ...

    # sites
    async def put_site(self, spec: SiteSpec) -> None: ...

    async def seed_site(self, spec: SiteSpec) -> None:
        """Store ``spec`` unless a site of that name is stored, unfenced: a replica seeds the shared store from
        its config at start, and must not overwrite a site the leader stored meanwhile (cordoned, say)."""
        ...

    async def delete_site(self, name: str) -> None: ...

    async def list_sites(self) -> list[SiteSpec]: ...

    # API tokens (broker.auth): the record as JSON, keyed by id, its digest unique
    async def put_token(self, token_id: str, digest: str, doc: str) -> None: ...

    async def update_token(self, token_id: str, doc: str) -> None: ...

    async def list_tokens(self) -> list[str]: ...

    # what the scheduling cycle learns and a broker taking charge should not learn again (JSON by name;
    # written by the leader only, like the sites)
    async def put_state(self, name: str, doc: str) -> None: ...

    async def get_state(self, name: str) -> str | None: ...

    # federation-wide tenant limits set through the API (``tenant_limits``, a row per tenant; written by the leader
    # only, fenced, as the sites; read by every replica: a follower checks submissions against them)
    async def list_tenant_limits(self) -> list[LimitOverride]:
        """Every override stored, by tenant."""
        ...

    async def put_tenant_limit(self, override: LimitOverride) -> None:
        """Store ``override`` in place of the tenant's one, if any."""
        ...

    async def delete_tenant_limit(self, tenant: str) -> None:
        """Remove ``tenant``'s override, if it has one."""
        ...

    # leadership (one ``leader`` row; its lease is judged by the database's clock where there is one)
    async def acquire_leadership(self, holder: str, lease_s: float) -> int | None:
        """Take the lease if it is free, expired or already the caller's; return the epoch (bumped by one at
        every acquisition, the same holder's included, so the writes of its last term stay fenced), or None
        while another holder has it. ``holder`` must be unique to the process."""

    async def renew_leadership(self, holder: str, epoch: int, lease_s: float) -> bool:
        """Extend the lease by ``lease_s`` from now if it is still this holder's, at this epoch, unexpired."""

    async def release_leadership(self, holder: str, epoch: int) -> None:
        """Expire the lease now if it is still this holder's at this epoch (the next replica takes over at once)."""

    async def leader(self) -> str | None:
        """The holder of the leadership lease, if it has not expired (None: nobody leads now)."""

    async def active_after(self, seq: int, limit: int) -> list[tuple[int, Job]]:
        """Unfinished jobs stored after row ``seq`` (their order of insertion), at most ``limit``, oldest
        first, each with its row number: how the leader takes in what other replicas accepted."""

    async def active_at(self, seqs: list[int]) -> list[tuple[int, Job]]:
        """The unfinished jobs among rows ``seqs`` (rows skipped by an earlier ``active_after``)."""

    async def last_seq(self) -> int:
        """The highest row number committed so far (0 when there are none)."""

    def fence(self, epoch: int | None) -> None:
        """From now on, every scheduling write of this store object (``update_job``/``enqueue_update``,
        ``save_decision``, ``put_site``, ``delete_site``, ``put_tenant_limit``, ``delete_tenant_limit``; never
        ``insert_job``) checks in its transaction that the leader row is still at ``epoch`` and unexpired, and
        fails with :class:`Fenced` otherwise. ``None`` (the default) turns the check off."""


POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def check_db(db: str) -> str:
    """``db`` if it names a store: a PostgreSQL URL, or an SQLite file path (or ``:memory:``); a ValueError for
    another URL (``postgresq://...``, ``mysql://...``), which would otherwise become a file of that name, or
    for an empty one (``db: ""``), which SQLite would fail to open with a message naming no setting."""
    if not db.strip():
        raise ValueError("empty: name an SQLite file (var/heliotrope.db) or a postgresql:// URL")
    if "://" in db and not db.startswith(POSTGRES_SCHEMES):
        raise ValueError(f"{describe_db(db)} is not a database heliotrope can use: a URL must start with "
                         f"postgresql:// (or postgres://); anything else is an SQLite file path, which has no ://")
    return db


def describe_db(db: str) -> str:
    """The database named for a person (logs, messages): a URL without its password."""
    if "://" not in db:
        return db
    scheme, rest = db.split("://", 1)
    # user:password@host...: the last @ ends the user's part, since a password may hold @, / or ? (unencoded,
    # as people write them); what is before the first : of that part, and before any / or ?, is the user. A
    # query's password= is masked too (postgresql://u@host?password=...).
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user = re.split(r"[:/?#]", userinfo, maxsplit=1)[0]
        rest = f"{user}@{rest}" if user else rest
    return f"{scheme}://" + re.sub(r"(?i)(password=)[^&]*", r"\1***", rest)


def open_store(db: str) -> Store:
    """The store for the ``db`` setting: a ``postgresql://`` (or ``postgres://``) URL is PostgreSQL, anything
    else an SQLite file path (or ``:memory:``)."""
    check_db(db)
    if db.startswith(POSTGRES_SCHEMES):
        from broker.store.postgres import PostgresStore

        return PostgresStore(db)
    from broker.store.sqlite import SQLiteStore

    return SQLiteStore(db)
