"""SQLite store: the embedded default. WAL journal, ``synchronous=FULL``, and group commit.

Writes from all callers go into one queue; a single writer takes everything waiting and hands it, in one
call, to the thread that owns the write connection, which runs it in one transaction and commits (one
fsync of the write-ahead log); then every caller's future is resolved. Under load
a commit carries hundreds of jobs, so durability costs one fsync per batch, not per job, and no caller is
answered before its write is on disk. Reads use a second connection and never wait for the writer.

Schema changes are numbered migrations, applied in order at open and recorded in ``schema_version``.

Leadership: the ``leader`` row's lease is judged by this process's clock (``time.time()``). A fenced write
(see ``Store.fence``) reads the row inside its batch's transaction, which ``BEGIN IMMEDIATE`` makes the only
writer, so no new leader can take over between the check and the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from broker import usage
from broker.models import Job, JobState, SiteSpec
from broker.store import (
    EVENT_KEYS,
    Conflict,
    DuplicateKey,
    JobFilter,
    Page,
    StoredDecision,
    StoreError,
    decode_cursor,
    encode_cursor,
    fence_error,
    site_from_doc,
    LEADER,
    LimitOverride,
    with_attempt_prices,
)
from broker.store.sql import TERMINAL_SQL as _TERMINAL, SqlWriteQueue, Write

T = TypeVar("T")

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
    # 2: the scheduling cycle's leader lease (expires_at: seconds since the epoch, process clock)
    """
    CREATE TABLE leader (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        expires_at REAL NOT NULL
    );
    """,
    # 3: API tokens (broker.auth): a token's SHA-256 digest and its record, never the token
    """
    CREATE TABLE tokens (id TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, doc TEXT NOT NULL);
    """,
    # 4: what the scheduling cycle learns, kept across restarts and takeovers (Store.put_state)
    """
    CREATE TABLE broker_state (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
    """,
    # 5: when a job ended (seconds since the epoch; null while it is active), for the retention of finished jobs
    # (Store.prune_ended); rows of jobs that ended before it, or that a replica of an earlier release ended, are
    # dated from their documents as they are found (jobs_undated: those rows alone, so finding them reads no other).
    # Building the two indexes reads the whole table once, and writes wait for it (seconds a million jobs).
    """
    ALTER TABLE jobs ADD COLUMN ended_at REAL;
    CREATE INDEX jobs_ended ON jobs(ended_at) WHERE ended_at IS NOT NULL;
    CREATE INDEX jobs_undated ON jobs(seq) WHERE ended_at IS NULL AND state IN ('succeeded', 'failed', 'cancelled');
    """,
    # 6: each job's labels (spec.labels, which never change), by the job's seq, so that a listing by label reads
    # the jobs carrying it, newest first, and not every job's document. Written by the job's insert (one statement,
    # from the labels alone: a trigger reading them out of the whole document made a labelled job's insert a fifth
    # slower; an SQLite file has one writer, this release, as a newer one's is refused) and deleted with the job by
    # a trigger. Filled from the documents of the jobs stored: a full read of the table, seconds a million jobs,
    # and writes wait for it.
    """
    CREATE TABLE job_labels (seq INTEGER NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (seq, key));
    INSERT INTO job_labels (seq, key, value)
        SELECT jobs.seq, l.key, l.value FROM jobs, json_each(jobs.doc, '$.spec.labels') AS l;
    CREATE INDEX job_labels_value ON job_labels(key, value, seq);
    CREATE INDEX job_labels_key ON job_labels(key, seq);
    CREATE TRIGGER job_labels_deleted AFTER DELETE ON jobs BEGIN
        DELETE FROM job_labels WHERE seq = OLD.seq;
    END;
    """,
    # 7: GPU usage (broker.usage): the GPU model of each transition's attempt, and the GPU-seconds of the jobs that
    # retention deletes, per hour (POSIX seconds of its start), tenant, site and model, added up in the deletion's
    # transaction. Transitions stored before it, or by a replica of an earlier release, have no model (null).
    """
    ALTER TABLE job_events ADD COLUMN gpu_model TEXT;
    CREATE TABLE usage_hours (
        hour INTEGER NOT NULL,
        tenant TEXT NOT NULL,
        site TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        gpu_seconds REAL NOT NULL,
        attempts INTEGER NOT NULL,
        PRIMARY KEY (hour, tenant, site, gpu_model)
    );
    """,
    # 8: the price of each transition's attempt as routing saw it when the attempt was placed (USD per GPU-hour;
    # null where unpriced, stored before it, or by a replica of an earlier release), and in usage_hours the
    # GPU-seconds of the rolled-up attempts that had one and what they cost at it. Those without one are
    # gpu_seconds less priced_gpu_seconds: what a replica of an earlier release rolls up (it adds gpu_seconds
    # alone) and the rows rolled up before it are so charged at the price of the day, as before.
    """
    ALTER TABLE job_events ADD COLUMN usd_per_gpu_hour REAL;
    ALTER TABLE usage_hours ADD COLUMN priced_gpu_seconds REAL NOT NULL DEFAULT 0;
    ALTER TABLE usage_hours ADD COLUMN cost_usd REAL NOT NULL DEFAULT 0;
    """,
    # 9: the federation-wide GPU limits of tenants set through the API (PUT /v1/tenants/{tenant}/limit), standing
    # over the configuration's until deleted: gpus null is unlimited; updated_at, seconds since the epoch
    # (broker.limits; a broker of an earlier release, which refuses to open the migrated file, never reads it).
    """
    CREATE TABLE tenant_limits (tenant TEXT PRIMARY KEY, gpus REAL, updated_at REAL NOT NULL);
    """,
)

_USAGE_PIECE = 10_000  # rows a usage report reads at a time
_USAGE_IDS = 500  # jobs read at a time by id (an SQLite before 3.32 binds at most 999 variables a statement)
_USAGE_KEPT = "SELECT id FROM jobs WHERE ended_at IS NULL OR ended_at >= ?"
_USAGE_JOBS = ("SELECT id, tenant, json_extract(doc, '$.spec.gpus'), json_extract(doc, '$.gpu_model') FROM jobs"
               " WHERE ended_at IS NULL OR ended_at >= ?")
_EVENT_COLUMNS = "job_id, at, state, site, attempt, gpu_model, usd_per_gpu_hour"  # (broker.usage.Event)
_USAGE_EVENTS = (f"SELECT {_EVENT_COLUMNS} FROM job_events WHERE job_id IN ({_USAGE_KEPT})"
                 " ORDER BY job_id, seq")
_USAGE_HOURS = ("SELECT hour, tenant, site, gpu_model, gpu_seconds, attempts, priced_gpu_seconds, cost_usd"
                " FROM usage_hours WHERE hour >= ? AND hour < ?")
_ACTIVE = tuple(s.value for s in JobState if not s.terminal)
_INSERT_JOB = (
    "INSERT INTO jobs (id, tenant, state, site, priority, idempotency_key, request_digest, version, doc, ended_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_JOB = ("UPDATE jobs SET state = ?, site = ?, version = ?, doc = ?, priority = ?, ended_at = ?"
               " WHERE id = ? AND version = ?")
_INSERT_LABELS = ("INSERT INTO job_labels (seq, key, value) SELECT jobs.seq, l.key, l.value FROM jobs, json_each(?) AS l"
                  " WHERE jobs.id = ?")
_INSERT_EVENT = ("INSERT INTO job_events (job_id, at, state, site, attempt, reason, gpu_model, usd_per_gpu_hour)"
                 " VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
_UPSERT_DECISION = (
    "INSERT INTO decisions (job_id, attempt, doc) VALUES (?, ?, ?)"
    " ON CONFLICT(job_id) DO UPDATE SET attempt = excluded.attempt, doc = excluded.doc"
)


def _leader_row(conn: sqlite3.Connection) -> tuple[int, bool] | None:
    """The leader row's epoch and whether its lease still runs (by this process's clock)."""
    row = conn.execute("SELECT epoch, expires_at FROM leader WHERE name = ?", (LEADER,)).fetchone()
    return (int(row[0]), row[1] > time.time()) if row else None


def _translate(error: BaseException) -> StoreError:
    if isinstance(error, StoreError):
        return error
    if isinstance(error, sqlite3.IntegrityError):
        return DuplicateKey(str(error))
    if isinstance(error, sqlite3.Error):
        return StoreError(f"database error: {error}")
    return StoreError(f"write failed: {error.__class__.__name__}: {error}")


class SQLiteStore(SqlWriteQueue):
    INSERT_JOB, UPDATE_JOB, INSERT_EVENT, UPSERT_DECISION = _INSERT_JOB, _UPDATE_JOB, _INSERT_EVENT, _UPSERT_DECISION

    def _labels_written(self, job: Job) -> list[tuple[str, tuple[Any, ...]]]:
        # (every insert of a batch is applied on its own here: one without labels needs no statement)
        return [(_INSERT_LABELS, (json.dumps(job.spec.labels), job.id))] if job.spec.labels else []
    UNDATED_ENDED = (f"SELECT id, doc FROM jobs INDEXED BY jobs_undated WHERE ended_at IS NULL"
                     f" AND state IN ({_TERMINAL}) ORDER BY seq LIMIT ?")
    DATE_ENDED = "UPDATE jobs SET ended_at = ? WHERE id = ? AND ended_at IS NULL"
    ENDED_BEFORE = "SELECT id FROM jobs WHERE ended_at < ? ORDER BY ended_at, id LIMIT ?"
    ADD_USAGE = ("INSERT INTO usage_hours (hour, tenant, site, gpu_model, gpu_seconds, attempts, priced_gpu_seconds,"
                 " cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (hour, tenant, site, gpu_model) DO UPDATE SET"
                 " gpu_seconds = gpu_seconds + excluded.gpu_seconds, attempts = attempts + excluded.attempts,"
                 " priced_gpu_seconds = priced_gpu_seconds + excluded.priced_gpu_seconds,"
                 " cost_usd = cost_usd + excluded.cost_usd")
    DELETE_ENDED = (
        "DELETE FROM job_events WHERE job_id = ?",
        "DELETE FROM decisions WHERE job_id = ?",
        f"DELETE FROM jobs WHERE id = ? AND ended_at IS NOT NULL AND state IN ({_TERMINAL})",
    )

    def __init__(self, path: str | Path, max_batch: int = 2048) -> None:
        self.path = Path(path)
        self.max_batch = max_batch
        self._writer: ThreadPoolExecutor | None = None  # one thread owns the write connection
        self._wconn: sqlite3.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._queue: asyncio.Queue[Write | None] = asyncio.Queue()
        self._writer_task: asyncio.Task[None] | None = None
        self._closing = False
        self._fence: int | None = None
        self.commits = 0  # batches committed (for benchmarks)

    # --- life cycle ---

    async def open(self) -> None:
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        try:
            self._wconn = await loop.run_in_executor(self._writer, self._open_writer)
            self._reader = await aiosqlite.connect(self.path, isolation_level=None)
            await self._reader.execute("PRAGMA query_only=ON")
        except BaseException:
            await self.close()
            raise
        self._closing = False
        self._writer_task = loop.create_task(self._write_loop(), name="sqlite-writer")

    def _open_writer(self) -> sqlite3.Connection:
        """On the writer thread: connect, set durability, apply migrations. A new database file is made
        readable by its owner only: it holds every tenant's jobs and the tokens' records, and SQLite gives its
        write-ahead log and shared-memory files the same mode."""
        try:
            if str(self.path) != ":memory:" and not str(self.path).startswith("file:"):
                # An existing file keeps the mode its owner gave it; one that cannot be made is sqlite's to report.
                with contextlib.suppress(OSError):
                    os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open database {self.path}: {e}") from None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._migrate(conn)
        except sqlite3.Error as e:
            conn.close()
            raise StoreError(f"cannot use database {self.path}: {e}") from None
        except BaseException:
            conn.close()
            raise
        return conn

    async def close(self) -> None:
        self._closing = True  # from now on a new write fails at once instead of waiting behind the stop
        if self._writer_task is not None:
            await self._queue.put(None)
            await self._writer_task
            self._writer_task = None
        while not self._queue.empty():  # anything queued behind the stop marker: fail it, never strand it
            leftover = self._queue.get_nowait()
            if leftover is not None and not leftover.future.done():
                leftover.future.set_exception(StoreError("store closed before this write"))
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._writer is not None:
            if self._wconn is not None:
                await asyncio.get_running_loop().run_in_executor(self._writer, self._wconn.close)
                self._wconn = None
            self._writer.shutdown(wait=True)
            self._writer = None

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        current = (row[0] if row else None) or 0
        if current > len(MIGRATIONS):
            raise StoreError(
                f"database {self.path} has schema version {current}, newer than this heliotrope "
                f"({len(MIGRATIONS)}); upgrade heliotrope"
            )
        for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
            conn.executescript(f"BEGIN; {script}; INSERT INTO schema_version VALUES ({version}); COMMIT;")

    # --- group commit ---

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
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
            try:
                errors = await loop.run_in_executor(self._writer, self._commit, batch)
            except BaseException as e:  # never leave a caller waiting forever
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(StoreError(f"write failed: {e}"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for w, error in zip(batch, errors):
                if w.future.done():
                    continue
                if error is None:
                    w.future.set_result(None)
                else:
                    w.future.set_exception(error)

    def _commit(self, batch: list[Write]) -> list[StoreError | None]:
        """On the writer thread: the whole batch in one transaction, one fsync. If it fails, each write is
        retried in a transaction of its own, so one bad write fails alone."""
        conn = self._wconn
        assert conn is not None
        errors: list[StoreError | None] = [None] * len(batch)
        try:
            conn.execute("BEGIN IMMEDIATE")
            leader = _leader_row(conn) if any(w.fence is not None for w in batch) else None
            for k, w in enumerate(batch):
                if w.fence is not None and (fenced := fence_error(w.fence, leader)) is not None:
                    errors[k] = fenced  # not applied; the rest of the batch goes on
                    continue
                for i, (sql, params) in enumerate(w.statements):
                    cur = conn.execute(sql, params)
                    if i in w.checks and cur.rowcount != 1:
                        raise Conflict(f"job {params[-2]} changed since it was read (or does not exist)")
            conn.execute("COMMIT")
        except Exception as e:  # any failure: roll back, then find the write that caused it
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if len(batch) > 1:
                return [self._commit([w])[0] for w in batch]
            return [_translate(e)]
        self.commits += 1
        return errors

    # --- leadership (on the writer thread, between batches) ---

    async def _on_writer(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one immediate transaction on the write connection, committed (or rolled back)."""
        self._check_writable()

        def run() -> T:
            conn = self._wconn
            if conn is None:
                raise StoreError("store is not open")
            try:
                conn.execute("BEGIN IMMEDIATE")
                result = fn(conn)
                conn.execute("COMMIT")
                return result
            except Exception as e:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise _translate(e) from None

        assert self._writer is not None
        return await asyncio.get_running_loop().run_in_executor(self._writer, run)

    async def acquire_leadership(self, holder: str, lease_s: float) -> int | None:
        def acquire(conn: sqlite3.Connection) -> int | None:
            now = time.time()
            row = conn.execute("SELECT holder, epoch, expires_at FROM leader WHERE name = ?", (LEADER,)).fetchone()
            if row is None:
                conn.execute("INSERT INTO leader (name, holder, epoch, expires_at) VALUES (?, ?, 1, ?)",
                             (LEADER, holder, now + lease_s))
                return 1
            current, epoch, expires = row
            if current != holder and expires > now:
                return None
            epoch += 1  # a new term, even for the same holder: writes queued in its last one stay fenced
            conn.execute("UPDATE leader SET holder = ?, epoch = ?, expires_at = ? WHERE name = ?",
                         (holder, epoch, now + lease_s, LEADER))
            return int(epoch)

        return await self._on_writer(acquire)

    async def renew_leadership(self, holder: str, epoch: int, lease_s: float) -> bool:
        def renew(conn: sqlite3.Connection) -> bool:
            now = time.time()
            cur = conn.execute(
                "UPDATE leader SET expires_at = ? WHERE name = ? AND holder = ? AND epoch = ? AND expires_at > ?",
                (now + lease_s, LEADER, holder, epoch, now))
            return cur.rowcount == 1

        return await self._on_writer(renew)

    async def release_leadership(self, holder: str, epoch: int) -> None:
        def release(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE leader SET expires_at = MIN(expires_at, ?) WHERE name = ? AND holder = ? AND epoch = ?",
                (time.time(), LEADER, holder, epoch))

        await self._on_writer(release)

    # --- jobs ---

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
        for column, values in (("tenant", flt.tenants), ("site", flt.sites),
                               ("state", None if flt.states is None else [s.value for s in flt.states])):
            if values is not None:
                where.append(f"{column} IN ({','.join('?' * len(values))})" if values else "0")
                params.extend(values)
        order = "jobs.seq"
        sql = "SELECT jobs.seq, jobs.doc FROM jobs"
        if flt.labels:
            # The jobs carrying one of the labels, newest first, read from its index (one with a value, if any:
            # the fewer rows), each job then found by its seq (CROSS JOIN: in that order) and the other labels
            # looked up alike; never a job's document.
            first = next((k for k, (_, value) in enumerate(flt.labels) if value is not None), 0)
            index = "job_labels_key" if flt.labels[first][1] is None else "job_labels_value"
            sql = (f"SELECT jobs.seq, jobs.doc FROM job_labels AS l INDEXED BY {index}"
                   " CROSS JOIN jobs ON jobs.seq = l.seq")
            order = "l.seq"
            for k, (key, value) in enumerate(flt.labels):
                alias = "l" if k == first else "m"
                match = f"{alias}.key = ?" + ("" if value is None else f" AND {alias}.value = ?")
                where.append(match if k == first else
                             f"EXISTS (SELECT 1 FROM job_labels AS m WHERE m.seq = jobs.seq AND {match})")
                params.extend([key] if value is None else [key, value])
        if cursor is not None:
            where.append(f"{order} < ?")
            params.append(decode_cursor(cursor))
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {order} DESC LIMIT ?"
        params.append(limit + 1)
        rows = await self._all(sql, tuple(params))
        items = [Job.model_validate_json(doc) for _, doc in rows[:limit]]
        nxt = encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None
        return Page(items, nxt)

    async def active_jobs(self) -> list[Job]:
        marks = ",".join("?" * len(_ACTIVE))
        rows = await self._all(f"SELECT doc FROM jobs WHERE state IN ({marks}) ORDER BY seq", _ACTIVE)
        return [Job.model_validate_json(r[0]) for r in rows]

    async def active_after(self, seq: int, limit: int) -> list[tuple[int, Job]]:
        marks = ",".join("?" * len(_ACTIVE))
        rows = await self._all(f"SELECT seq, doc FROM jobs WHERE seq > ? AND state IN ({marks}) ORDER BY seq LIMIT ?",
                               (seq, *_ACTIVE, limit))
        return [(int(r[0]), Job.model_validate_json(r[1])) for r in rows]

    async def active_at(self, seqs: list[int]) -> list[tuple[int, Job]]:
        out: list[tuple[int, Job]] = []
        marks = ",".join("?" * len(_ACTIVE))
        for i in range(0, len(seqs), 500):  # SQLite binds at most 999 parameters
            chunk = seqs[i:i + 500]
            rows = await self._all(f"SELECT seq, doc FROM jobs WHERE seq IN ({','.join('?' * len(chunk))}) "
                                   f"AND state IN ({marks}) ORDER BY seq", (*chunk, *_ACTIVE))
            out += [(int(r[0]), Job.model_validate_json(r[1])) for r in rows]
        return out

    async def last_seq(self) -> int:
        row = await self._one("SELECT COALESCE(MAX(seq), 0) FROM jobs", ())
        return int(row[0]) if row else 0

    async def leader(self) -> str | None:
        row = await self._one("SELECT holder FROM leader WHERE name = ? AND expires_at > ?", (LEADER, time.time()))
        return None if row is None else str(row[0])

    async def job_events(self, job_id: str) -> list[dict[str, Any]]:
        rows = await self._all(
            "SELECT at, state, site, attempt, reason, gpu_model, usd_per_gpu_hour FROM job_events WHERE job_id = ?"
            " ORDER BY seq", (job_id,)
        )
        return with_attempt_prices([dict(zip(EVENT_KEYS, r)) for r in rows])

    # --- usage ---

    async def usage_records(self, start: float, end: float) -> usage.UsageRecords:
        """Of the jobs kept that were active at or after ``start`` (POSIX seconds; a day before it, since a job's end
        is dated by the broker's clock and its transitions by the same), the attempts, and the hours rolled up in
        [``start``, ``end``): read in one transaction, on a connection of its own, so that a deletion of jobs (which
        rolls them up) is seen either wholly or not at all; the transitions streamed, in pieces, into the attempts
        they make (:class:`broker.usage.Holds`)."""
        if self._reader is None:
            raise StoreError("store is not open")
        since = (start - 86400,)
        reader = usage.Holds()
        async with aiosqlite.connect(self.path, isolation_level=None) as db:
            await db.execute("BEGIN")
            try:
                async with db.execute(_USAGE_JOBS, since) as cur:
                    while rows := await cur.fetchmany(_USAGE_PIECE):
                        for job_id, tenant, gpus, model in rows:
                            reader.job(job_id, tenant, gpus, model)
                async with db.execute(_USAGE_EVENTS, since) as cur:
                    while rows := await cur.fetchmany(_USAGE_PIECE):
                        reader.feed(rows)
                hours = await db.execute_fetchall(_USAGE_HOURS, (start, end))
            finally:
                await db.execute("COMMIT")
        return usage.UsageRecords(reader.done(), list(hours))

    async def _usage_of(self, ids: list[str]) -> list[usage.Held]:
        """As the base class says, read ``_USAGE_IDS`` jobs at a time: an SQLite before 3.32 binds at most 999
        variables in a statement, fewer than the retention's round of deletions (``PRUNE_BATCH``)."""
        jobs: dict[str, tuple[str, str, str | None]] = {}
        events: list[tuple[Any, ...]] = []
        for k in range(0, len(ids), _USAGE_IDS):
            chunk = tuple(ids[k:k + _USAGE_IDS])
            marks = ",".join("?" * len(chunk))
            jobs.update((r[0], (r[1], r[2], r[3])) for r in await self._all(
                f"SELECT id, tenant, json_extract(doc, '$.spec.gpus'), json_extract(doc, '$.gpu_model')"
                f" FROM jobs WHERE id IN ({marks})", chunk))
            events += await self._all(f"SELECT {_EVENT_COLUMNS} FROM job_events"
                                      f" WHERE job_id IN ({marks}) ORDER BY job_id, seq", chunk)
        return usage.holds(jobs, events)

    # --- decisions ---

    async def get_decision(self, job_id: str) -> StoredDecision | None:
        row = await self._one("SELECT attempt, doc FROM decisions WHERE job_id = ?", (job_id,))
        return StoredDecision(row[0], json.loads(row[1])) if row else None

    # --- sites ---

    async def put_site(self, spec: SiteSpec) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO sites (name, doc) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET doc = excluded.doc",
            (spec.name, spec.model_dump_json()),
        )], fenced=True))

    async def seed_site(self, spec: SiteSpec) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO sites (name, doc) VALUES (?, ?) ON CONFLICT(name) DO NOTHING",
            (spec.name, spec.model_dump_json()),
        )]))

    async def delete_site(self, name: str) -> None:
        await self._submit(self._new_write([("DELETE FROM sites WHERE name = ?", (name,))], fenced=True))

    async def list_sites(self) -> list[SiteSpec]:
        rows = await self._all("SELECT doc FROM sites ORDER BY name", ())
        return [site_from_doc(r[0]) for r in rows]

    # --- learned state ---

    async def put_state(self, name: str, doc: str) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO broker_state (name, doc) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET doc = excluded.doc",
            (name, doc),
        )], fenced=True))

    async def get_state(self, name: str) -> str | None:
        row = await self._one("SELECT doc FROM broker_state WHERE name = ?", (name,))
        return None if row is None else row[0]

    # --- tenant limits set through the API ---

    async def list_tenant_limits(self) -> list[LimitOverride]:
        rows = await self._all("SELECT tenant, gpus, updated_at FROM tenant_limits ORDER BY tenant", ())
        return [LimitOverride(r[0], r[1], datetime.fromtimestamp(r[2], UTC)) for r in rows]

    async def put_tenant_limit(self, override: LimitOverride) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO tenant_limits (tenant, gpus, updated_at) VALUES (?, ?, ?) ON CONFLICT (tenant) DO UPDATE"
            " SET gpus = excluded.gpus, updated_at = excluded.updated_at",
            (override.tenant, override.gpus, override.updated_at.timestamp()),
        )], fenced=True))

    async def delete_tenant_limit(self, tenant: str) -> None:
        await self._submit(self._new_write([("DELETE FROM tenant_limits WHERE tenant = ?", (tenant,))], fenced=True))

    # --- tokens (broker.auth) ---

    async def put_token(self, token_id: str, digest: str, doc: str) -> None:
        await self._submit(self._new_write([("INSERT INTO tokens (id, digest, doc) VALUES (?, ?, ?)",
                                             (token_id, digest, doc))]))

    async def update_token(self, token_id: str, doc: str) -> None:
        await self._submit(self._new_write([("UPDATE tokens SET doc = ? WHERE id = ?", (doc, token_id))]))

    async def list_tokens(self) -> list[str]:
        return [r[0] for r in await self._all("SELECT doc FROM tokens ORDER BY id", ())]

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

    async def _read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return await self._all(sql, params)
