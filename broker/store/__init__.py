"""The broker's durable store, behind one interface so that SQLite (embedded default) and PostgreSQL
(several replicas) are interchangeable.

Every write resolves only once it is on disk (fsynced); the API answers ``201`` after that. Job rows carry
a ``version``: an update names the version it read and fails with ``Conflict`` if another writer moved
the job first.
"""

from __future__ import annotations

import base64
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Awaitable
from typing import Any, Protocol

from broker.models import Job, JobState, SiteSpec


class StoreError(RuntimeError):
    pass


class Conflict(StoreError):
    """The row changed since it was read (optimistic concurrency)."""


class DuplicateKey(StoreError):
    """The job id, or the tenant's idempotency key, is already taken."""


@dataclass(frozen=True, slots=True)
class JobFilter:
    state: JobState | None = None
    tenant: str | None = None
    site: str | None = None


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

    # decisions
    async def save_decision(self, job_id: str, attempt: int, record: dict[str, Any]) -> None: ...

    async def get_decision(self, job_id: str) -> StoredDecision | None: ...

    # sites
    async def put_site(self, spec: SiteSpec) -> None: ...

    async def delete_site(self, name: str) -> None: ...

    async def list_sites(self) -> list[SiteSpec]: ...
