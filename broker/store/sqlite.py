"""SQLite store: the embedded default. WAL journal, ``synchronous=FULL``, and group commit.

Writes from all callers go into one queue; a single writer takes everything waiting, runs it in one
transaction and commits (one fsync of the write-ahead log), then resolves every caller's future. Under load
a commit carries hundreds of jobs, so durability costs one fsync per batch, not per job, and no caller is
answered before its write is on disk. Reads use a second connection and never wait for the writer.

Schema changes are numbered migrations, applied in order at open and recorded in ``schema_version``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite

from broker.models import Job, JobState, SiteSpec
from broker.store import (
    Conflict,
    DuplicateKey,
    JobFilter,
    Page,
    StoredDecision,
    StoreError,
    decode_cursor,
    encode_cursor,
)

MIGRATIONS: tuple[str, ...] = (
    # 1: jobs, their transitions, decisions, sites
    """
    CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        site TEXT,
        priority INTEGER NOT NULL,
        idempotency_key TEXT,
        request_digest TEXT,
        version INTEGER NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE UNIQUE INDEX jobs_idempotency ON jobs(tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
    CREATE INDEX jobs_state ON jobs(state, seq);
    CREATE INDEX jobs_tenant ON jobs(tenant, seq);
    CREATE INDEX jobs_site ON jobs(site, seq);
    CREATE TABLE job_events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL,
        at TEXT NOT NULL,
        state TEXT NOT NULL,
        site TEXT,
        attempt INTEGER NOT NULL,
        reason TEXT
    );
    CREATE INDEX job_events_job ON job_events(job_id, seq);
    CREATE TABLE decisions (job_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL, doc TEXT NOT NULL);
    CREATE TABLE sites (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
    """,
)

_ACTIVE = tuple(s.value for s in JobState if not s.terminal)
_INSERT_JOB = (
    "INSERT INTO jobs (id, tenant, state, site, priority, idempotency_key, request_digest, version, doc)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_JOB = "UPDATE jobs SET state = ?, site = ?, version = ?, doc = ? WHERE id = ? AND version = ?"
_INSERT_EVENT = "INSERT INTO job_events (job_id, at, state, site, attempt, reason) VALUES (?, ?, ?, ?, ?, ?)"


@dataclass(slots=True)
class _Write:
    """One caller's write: statements run in order inside the batch's transaction."""

    statements: list[tuple[str, tuple[Any, ...]]]
    future: asyncio.Future[None]
    checks: list[int] = field(default_factory=list)  # statement indices that must change exactly one row


def _event_row(job: Job, reason: str | None) -> tuple[Any, ...]:
    return (job.id, job.updated_at.isoformat(), job.state.value, job.site, job.attempt, reason or job.reason)


def _translate(error: BaseException) -> StoreError:
    if isinstance(error, StoreError):
        return error
    if isinstance(error, sqlite3.IntegrityError):
        return DuplicateKey(str(error))
    return StoreError(f"database error: {error}")


class SQLiteStore:
    def __init__(self, path: str | Path, max_batch: int = 1024) -> None:
        self.path = Path(path)
        self.max_batch = max_batch
        self._writer_conn: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._queue: asyncio.Queue[_Write | None] = asyncio.Queue()
        self._writer_task: asyncio.Task[None] | None = None
        self.commits = 0  # batches committed (for benchmarks)

    # --- life cycle ---

    async def open(self) -> None:
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = await aiosqlite.connect(self.path, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open database {self.path}: {e}") from e
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=FULL")
            await conn.execute("PRAGMA foreign_keys=ON")
            await self._migrate(conn)
        except sqlite3.Error as e:
            await conn.close()
            raise StoreError(f"cannot use database {self.path}: {e}") from None
        except BaseException:
            await conn.close()
            raise
        self._writer_conn = conn
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        await self._reader.execute("PRAGMA query_only=ON")
        self._writer_task = asyncio.get_running_loop().create_task(self._write_loop(), name="sqlite-writer")

    async def close(self) -> None:
        if self._writer_task is not None:
            await self._queue.put(None)
            await self._writer_task
            self._writer_task = None
        for conn in (self._writer_conn, self._reader):
            if conn is not None:
                await conn.close()
        self._writer_conn = self._reader = None

    async def _migrate(self, conn: aiosqlite.Connection) -> None:
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        async with conn.execute("SELECT MAX(version) FROM schema_version") as cur:
            row = await cur.fetchone()
        current = (row[0] if row else None) or 0
        if current > len(MIGRATIONS):
            raise StoreError(
                f"database {self.path} has schema version {current}, newer than this heliotrope "
                f"({len(MIGRATIONS)}); upgrade heliotrope"
            )
        for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
            await conn.executescript(f"BEGIN; {script}; INSERT INTO schema_version VALUES ({version}); COMMIT;")

    # --- group commit ---

    async def _submit(self, write: _Write) -> None:
        if self._writer_task is None:
            raise StoreError("store is not open")
        await self._queue.put(write)
        await write.future

    def _new_write(self, statements: list[tuple[str, tuple[Any, ...]]], checks: list[int] | None = None) -> _Write:
        return _Write(statements, asyncio.get_running_loop().create_future(), checks or [])

    async def _write_loop(self) -> None:
        stop = False
        while not stop:
            first = await self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self.max_batch and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            await self._commit(batch)

    async def _commit(self, batch: list[_Write]) -> None:
        conn = self._writer_conn
        assert conn is not None
        try:
            await conn.execute("BEGIN IMMEDIATE")
            if any(w.checks for w in batch):
                for w in batch:
                    await self._apply(conn, w)
            else:
                await self._apply_grouped(conn, batch)
            await conn.commit()
            self.commits += 1
        except (sqlite3.Error, Conflict) as e:
            await conn.rollback()
            if len(batch) > 1:
                # Isolate the failing write: commit each on its own, so one bad write fails alone.
                for w in batch:
                    await self._commit([w])
                return
            self._settle(batch, _translate(e))
            return
        except BaseException as e:  # never leave a caller waiting forever
            self._settle(batch, StoreError(f"write failed: {e}"))
            raise
        self._settle(batch, None)

    async def _apply(self, conn: aiosqlite.Connection, w: _Write) -> None:
        for i, (sql, params) in enumerate(w.statements):
            cur = await conn.execute(sql, params)
            if i in w.checks and cur.rowcount != 1:
                raise Conflict(f"job {params[-2]} changed since it was read (or does not exist)")

    async def _apply_grouped(self, conn: aiosqlite.Connection, batch: list[_Write]) -> None:
        """Run consecutive statements of the same SQL as one executemany (one thread hop each)."""
        run_sql: str | None = None
        run: list[tuple[Any, ...]] = []
        for w in batch:
            for sql, params in w.statements:
                if sql != run_sql and run:
                    await conn.executemany(run_sql, run)  # type: ignore[arg-type]
                    run = []
                run_sql = sql
                run.append(params)
        if run:
            await conn.executemany(run_sql, run)  # type: ignore[arg-type]

    @staticmethod
    def _settle(batch: list[_Write], error: BaseException | None) -> None:
        for w in batch:
            if not w.future.done():
                if error is None:
                    w.future.set_result(None)
                else:
                    w.future.set_exception(error)

    # --- jobs ---

    async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None:
        doc = job.model_dump_json()
        await self._submit(self._new_write([
            (_INSERT_JOB, (job.id, job.spec.tenant, job.state.value, job.site, job.spec.priority,
                           idempotency_key, digest, job.version, doc)),
            (_INSERT_EVENT, _event_row(job, "submitted")),
        ]))

    async def update_job(self, job: Job, expected_version: int, event_reason: str | None = None) -> None:
        await self._submit(self._new_write(
            [
                (_UPDATE_JOB, (job.state.value, job.site, job.version, job.model_dump_json(), job.id,
                               expected_version)),
                (_INSERT_EVENT, _event_row(job, event_reason)),
            ],
            checks=[0],
        ))

    async def get_job(self, job_id: str) -> Job | None:
        row = await self._one("SELECT doc FROM jobs WHERE id = ?", (job_id,))
        return Job.model_validate_json(row[0]) if row else None

    async def find_idempotent(self, tenant: str, key: str) -> tuple[Job, str | None] | None:
        row = await self._one(
            "SELECT doc, request_digest FROM jobs WHERE tenant = ? AND idempotency_key = ?", (tenant, key)
        )
        return (Job.model_validate_json(row[0]), row[1]) if row else None

    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None = None) -> Page:
        where, params = [], []
        if flt.state is not None:
            where.append("state = ?")
            params.append(flt.state.value)
        if flt.tenant is not None:
            where.append("tenant = ?")
            params.append(flt.tenant)
        if flt.site is not None:
            where.append("site = ?")
            params.append(flt.site)
        if cursor is not None:
            where.append("seq < ?")
            params.append(decode_cursor(cursor))
        sql = "SELECT seq, doc FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        params.append(limit + 1)
        rows = await self._all(sql, tuple(params))
        items = [Job.model_validate_json(doc) for _, doc in rows[:limit]]
        nxt = encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None
        return Page(items, nxt)

    async def active_jobs(self) -> list[Job]:
        marks = ",".join("?" * len(_ACTIVE))
        rows = await self._all(f"SELECT doc FROM jobs WHERE state IN ({marks}) ORDER BY seq", _ACTIVE)
        return [Job.model_validate_json(r[0]) for r in rows]

    async def job_events(self, job_id: str) -> list[dict[str, Any]]:
        rows = await self._all(
            "SELECT at, state, site, attempt, reason FROM job_events WHERE job_id = ? ORDER BY seq", (job_id,)
        )
        return [dict(zip(("at", "state", "site", "attempt", "reason"), r)) for r in rows]

    # --- decisions ---

    async def save_decision(self, job_id: str, attempt: int, record: dict[str, Any]) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO decisions (job_id, attempt, doc) VALUES (?, ?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET attempt = excluded.attempt, doc = excluded.doc",
            (job_id, attempt, json.dumps(record, separators=(",", ":"))),
        )]))

    async def get_decision(self, job_id: str) -> StoredDecision | None:
        row = await self._one("SELECT attempt, doc FROM decisions WHERE job_id = ?", (job_id,))
        return StoredDecision(row[0], json.loads(row[1])) if row else None

    # --- sites ---

    async def put_site(self, spec: SiteSpec) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO sites (name, doc) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET doc = excluded.doc",
            (spec.name, spec.model_dump_json()),
        )]))

    async def delete_site(self, name: str) -> None:
        await self._submit(self._new_write([("DELETE FROM sites WHERE name = ?", (name,))]))

    async def list_sites(self) -> list[SiteSpec]:
        rows = await self._all("SELECT doc FROM sites ORDER BY name", ())
        return [SiteSpec.model_validate_json(r[0]) for r in rows]

    # --- reads ---

    async def _one(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._reader is None:
            raise StoreError("store is not open")
        async with self._reader.execute(sql, params) as cur:
            return await cur.fetchone()

    async def _all(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._reader is None:
            raise StoreError("store is not open")
        async with self._reader.execute(sql, params) as cur:
            return list(await cur.fetchall())
