"""What the SQL stores (SQLite and PostgreSQL) share: a single writer fed by one queue of writes, and the
statements each write is made of. A subclass gives its dialect's statements and runs the writer."""

from __future__ import annotations

import asyncio
import json
from abc import abstractmethod
from dataclasses import dataclass, field
from datetime import datetime
from collections.abc import Collection
from typing import Any, ClassVar

from broker import usage
from broker.models import Job, JobState
from broker.store import QueuedUpdates, StoreError, ended_at


TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in JobState if s.terminal)
"""The final states as an SQL list, as migration 5's partial index ``jobs_undated`` names them (a query must name
them alike for SQLite to use it)."""


@dataclass(slots=True)
class Write:
    """One caller's write: statements run in order inside the batch's transaction."""

    statements: list[tuple[str, tuple[Any, ...]]]
    future: asyncio.Future[None]
    checks: list[int] = field(default_factory=list)  # statement indices that must change exactly one row
    fence: int | None = None  # the leadership epoch the store must still be at (a scheduling write)
    bulk: bool = False  # an insert_job: consecutive ones may be sent together (the same statements, no checks)


def event_row(job: Job, reason: str | None) -> tuple[Any, ...]:
    return (job.id, job.updated_at.isoformat(), job.state.value, job.site, job.attempt, reason or job.reason,
            job.gpu_model, job.usd_per_gpu_hour)


class SqlWriteQueue(QueuedUpdates):
    """Writes queued in the callers' order for the subclass's writer task (``_queue``); the statements in
    the subclass's SQL."""

    INSERT_JOB: ClassVar[str]  # (id, tenant, state, site, priority, idempotency_key, request_digest, version, doc,
    #                             ended_at)
    UPDATE_JOB: ClassVar[str]  # (state, site, version, doc, priority, ended_at, id, expected version)
    INSERT_EVENT: ClassVar[str]  # (job_id, at, state, site, attempt, reason, gpu_model, usd_per_gpu_hour)
    UPSERT_DECISION: ClassVar[str]  # (job_id, attempt, doc)
    UNDATED_ENDED: ClassVar[str]  # (limit) -> (id, doc) of jobs in a final state with no ended_at, oldest first
    DATE_ENDED: ClassVar[str]  # (ended_at, id); see _date_ended
    ENDED_BEFORE: ClassVar[str]  # (before, limit) -> (id,) of jobs that ended before, first ended first
    ADD_USAGE: ClassVar[str]  # (hour, tenant, site, gpu_model, gpu_seconds, attempts, priced_gpu_seconds,
    #                            cost_usd): added into usage_hours' row
    DELETE_ENDED: ClassVar[tuple[str, ...]]  # (id) each: its transitions, its decision, the job (if it ended);
    #                                           see _delete_ended

    _queue: asyncio.Queue[Write | None]
    _fence: int | None
    _closing: bool
    _writer_task: asyncio.Task[None] | None

    def _check_writable(self) -> None:
        if self._closing or self._writer_task is None or self._writer_task.done():
            raise StoreError("store is not open")

    async def _submit(self, write: Write) -> None:
        self._check_writable()
        await self._queue.put(write)
        await write.future

    def _new_write(self, statements: list[tuple[str, tuple[Any, ...]]], checks: list[int] | None = None,
                   fenced: bool = False, bulk: bool = False) -> Write:
        return Write(statements, asyncio.get_running_loop().create_future(), checks or [],
                     self._fence if fenced else None, bulk)

    def fence(self, epoch: int | None) -> None:
        self._fence = epoch

    def _decision_row(self, job_id: str, attempt: int, record: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        return self.UPSERT_DECISION, (job_id, attempt, json.dumps(record, separators=(",", ":")))

    async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None:
        await self._submit(self._new_write([
            (self.INSERT_JOB, (job.id, job.spec.tenant, job.state.value, job.site, job.spec.priority,
                               idempotency_key, digest, job.version, job.model_dump_json(), ended_at(job))),
            *self._labels_written(job),
            (self.INSERT_EVENT, event_row(job, "submitted")),
        ], bulk=True))

    def _labels_written(self, job: Job) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements that store a new job's labels in ``job_labels`` beside its row: none where the database
        does it itself (PostgreSQL's trigger, which also covers a replica of an earlier release still writing: there a
        run of inserts is sent together, statement by statement, so every insert must have the same ones)."""
        return []

    def enqueue_update(
        self, job: Job, expected_version: int, event_reason: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> asyncio.Future[None]:
        """Queue the update now, in the caller's order; the future resolves once it is committed."""
        self._check_writable()
        statements = [
            (self.UPDATE_JOB, (job.state.value, job.site, job.version, job.model_dump_json(), job.spec.priority,
                               ended_at(job), job.id, expected_version)),
            (self.INSERT_EVENT, event_row(job, event_reason)),
        ]
        if decision is not None:
            statements.append(self._decision_row(job.id, job.attempt, decision))
        write = self._new_write(statements, checks=[0], fenced=True)
        self._queue.put_nowait(write)
        return write.future

    async def save_decision(self, job_id: str, attempt: int, record: dict[str, Any]) -> None:
        await self._submit(self._new_write([self._decision_row(job_id, attempt, record)], fenced=True))

    @abstractmethod
    async def _usage_of(self, ids: list[str]) -> list[usage.Held]:
        """The attempts of the jobs ``ids`` that held GPUs, from their transitions (:func:`broker.usage.holds`)."""

    @abstractmethod
    async def _read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """The rows ``sql`` selects, read in the subclass's dialect (``params`` bound in order)."""

    def _date_ended(self, dates: list[tuple[float | None, str]]) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements that write ``dates`` ((ended_at, id) each): one each (a store that sends one statement
        for them all, where each is a round trip, overrides it)."""
        return [(self.DATE_ENDED, d) for d in dates]

    def _delete_ended(self, ids: list[str]) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements that delete the jobs ``ids`` with their transitions and decisions: ``DELETE_ENDED`` for
        each (a store that sends one statement per table for them all overrides it)."""
        return [(sql, (job_id,)) for job_id in ids for sql in self.DELETE_ENDED]

    def _usage_added(self, rows: list[usage.HourRow]) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements that add ``rows`` (hour, tenant, site, model, GPU-seconds, attempts, priced GPU-seconds,
        their cost) into ``usage_hours``: one each (a store that sends one statement for them all overrides it)."""
        return [(self.ADD_USAGE, row) for row in rows]

    async def date_ended(self, limit: int) -> int:
        undated = await self._read(self.UNDATED_ENDED, (limit,))
        if undated:
            dates = [(ended_at(Job.model_validate_json(doc)), job_id) for job_id, doc in undated]
            await self._submit(self._new_write(self._date_ended(dates), fenced=True))
        return len(undated)

    async def prune_ended(self, before: datetime, limit: int, keep: Collection[str] = ()) -> list[str]:
        """Delete up to ``limit`` jobs that ended before ``before`` (but those in ``keep``: as many more rows are
        read, so that kept ones at the front hold up no other), their attempts' GPU-seconds added into
        ``usage_hours`` first, in the same transaction (:mod:`broker.usage`)."""
        rows = await self._read(self.ENDED_BEFORE, (before.timestamp(), limit + len(keep)))
        ids = [r[0] for r in rows if r[0] not in keep][:limit]
        if ids:
            hours = usage.roll_up(await self._usage_of(ids))
            added = self._usage_added([(*key, *figures) for key, figures in sorted(hours.items())])
            await self._submit(self._new_write(added + self._delete_ended(ids), fenced=True))
        return ids
