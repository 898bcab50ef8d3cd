"""PostgreSQL store: several broker replicas on one database. Same semantics as ``SQLiteStore``.

``db`` is a URL, ``postgresql://user[:password]@host[:port]/database`` (``postgres://`` too); the store keeps
a small connection pool (1 to ``max_connections``) and gives every call ``timeout_s``.

Writes go through group commit, as on SQLite: every caller's write joins one queue; a single writer task
takes everything waiting and applies it in one transaction on one pooled connection, in the order the
callers made their calls, then resolves each caller's future once the commit returned (``synchronous_commit``
is left at the server's default, ``on``: the commit is flushed to the write-ahead log). If the batch fails,
it is applied again in one transaction with a savepoint around each write, so that the write that broke it
fails alone (``DuplicateKey``, ``Conflict``) and the others still land. Reads go straight to the pool.

Schema changes are numbered migrations (``MIGRATIONS``), applied in order at open inside one transaction
that first takes a transaction-scoped advisory lock, so replicas starting together migrate once; they are
recorded in ``schema_version``, and a database migrated by a newer heliotrope is refused.

Documents are stored as the same text as on SQLite (``Job.model_dump_json()``, compact JSON for decisions).

Leadership: the ``leader`` row's lease is judged by the database's clock (``clock_timestamp()``), so replicas
on hosts with drifting clocks agree on it. A fenced write (see ``Store.fence``) reads the row ``FOR SHARE`` in
its batch's transaction, just before the commit: a replica taking over must wait for that transaction to end,
so a write that passed the check commits before the new leader's epoch exists, and the leader's own renewal
waits for the commit only, not for the whole batch.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from broker import usage
from broker.models import Job, JobState, SiteSpec
from broker.store import (
    EVENT_KEYS,
    LEADER,
    Conflict,
    DuplicateKey,
    JobFilter,
    LimitOverride,
    Page,
    StoredDecision,
    StoreError,
    decode_cursor,
    encode_cursor,
    fence_error,
    site_from_doc,
    with_attempt_prices,
)
from broker.store.sql import TERMINAL_SQL as _TERMINAL, SqlWriteQueue, Write

MIGRATIONS: tuple[str, ...] = (
    # 1: jobs, their transitions, decisions, sites
    """
    CREATE TABLE jobs (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        site TEXT,
        priority BIGINT NOT NULL,
        idempotency_key TEXT,
        request_digest TEXT,
        version BIGINT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE UNIQUE INDEX jobs_idempotency ON jobs(tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
    CREATE INDEX jobs_state ON jobs(state, seq);
    CREATE INDEX jobs_tenant ON jobs(tenant, seq);
    CREATE INDEX jobs_site ON jobs(site, seq);
    CREATE TABLE job_events (
        seq BIGSERIAL PRIMARY KEY,
        job_id TEXT NOT NULL,
        at TEXT NOT NULL,
        state TEXT NOT NULL,
        site TEXT,
        attempt BIGINT NOT NULL,
        reason TEXT
    );
    CREATE INDEX job_events_job ON job_events(job_id, seq);
    CREATE TABLE decisions (job_id TEXT PRIMARY KEY, attempt BIGINT NOT NULL, doc TEXT NOT NULL);
    CREATE TABLE sites (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
    """,
    # 2: the scheduling cycle's leader lease
    """
    CREATE TABLE leader (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
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
    ALTER TABLE jobs ADD COLUMN ended_at DOUBLE PRECISION;
    CREATE INDEX jobs_ended ON jobs(ended_at) WHERE ended_at IS NOT NULL;
    CREATE INDEX jobs_undated ON jobs(seq) WHERE ended_at IS NULL AND state IN ('succeeded', 'failed', 'cancelled');
    """,
    # 6: each job's labels (spec.labels, which never change), by the job's seq, so that a listing by label reads
    # the jobs carrying it, newest first, and not every job's document. A trigger writes a job's labels in its
    # insert's transaction and deletes them with it, whoever writes the row (a replica of an earlier release still
    # running too). Filled from the documents of the jobs stored: a full read of the table, seconds a million
    # jobs, and writes wait for it: the table is locked against them first (a job such a replica inserted during
    # the fill, committed before the trigger was made, would otherwise have no labels). A document is read as
    # json, not jsonb, which refuses one holding an escaped NUL (as a spec's text may); json refuses it too as soon
    # as anything is taken out of it, so each \u0000 escape is read as U+FFFD (an escaped backslash, \\, set aside
    # as chr(1) meanwhile: "\\u0000" is no NUL; chr(1) cannot be in a JSON document unescaped), as the listing
    # read labels before.
    r"""
    LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE;
    CREATE TABLE job_labels (seq BIGINT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (seq, key));
    CREATE FUNCTION job_labels_of(doc TEXT) RETURNS TABLE (key TEXT, value TEXT) LANGUAGE sql IMMUTABLE AS $$
        SELECT * FROM json_each_text(
            replace(replace(replace(doc, '\\', chr(1)), '\u0000', '\ufffd'), chr(1), '\\')::json -> 'spec' -> 'labels')
    $$;
    INSERT INTO job_labels (seq, key, value) SELECT jobs.seq, l.key, l.value FROM jobs, job_labels_of(jobs.doc) AS l;
    CREATE INDEX job_labels_value ON job_labels(key, value, seq);
    CREATE INDEX job_labels_key ON job_labels(key, seq);
    CREATE FUNCTION job_labels_kept() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO job_labels (seq, key, value) SELECT NEW.seq, l.key, l.value FROM job_labels_of(NEW.doc) AS l;
            RETURN NEW;
        END IF;
        DELETE FROM job_labels WHERE seq = OLD.seq;
        RETURN OLD;
    END
    $$;
    CREATE TRIGGER job_labels_kept AFTER INSERT OR DELETE ON jobs FOR EACH ROW EXECUTE FUNCTION job_labels_kept();
    """,
    # 7: GPU usage (broker.usage): the GPU model of each transition's attempt, and the GPU-seconds of the jobs that
    # retention deletes, per hour (POSIX seconds of its start), tenant, site and model, added up in the deletion's
    # transaction. Transitions stored before it, or by a replica of an earlier release, have no model (null).
    """
    ALTER TABLE job_events ADD COLUMN gpu_model TEXT;
    CREATE TABLE usage_hours (
        hour BIGINT NOT NULL,
        tenant TEXT NOT NULL,
        site TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        gpu_seconds DOUBLE PRECISION NOT NULL,
        attempts BIGINT NOT NULL,
        PRIMARY KEY (hour, tenant, site, gpu_model)
    );
    """,
    # 8: as SQLite's migration 8: each transition's attempt's price at its placement (null where none was
    # recorded), and the priced GPU-seconds of the rolled-up hours and their cost (an earlier release's replica,
    # adding gpu_seconds alone, adds unpriced ones). Adding a column with a constant default rewrites nothing.
    """
    ALTER TABLE job_events ADD COLUMN usd_per_gpu_hour DOUBLE PRECISION;
    ALTER TABLE usage_hours ADD COLUMN priced_gpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
        ADD COLUMN cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0;
    """,
    # 9: as SQLite's migration 9: the federation-wide GPU limits of tenants set through the API, standing over the
    # configuration's until deleted (gpus null: unlimited; updated_at: seconds since the epoch)
    """
    CREATE TABLE tenant_limits (tenant TEXT PRIMARY KEY, gpus DOUBLE PRECISION, updated_at DOUBLE PRECISION NOT NULL);
    """,
)

# A document read as json with each \u0000 escape read as U+FFFD, as migration 6 reads labels (json refuses one as
# soon as anything is taken out of the document), and the GPU request and current attempt's model taken out of it.
_DOC_JSON = r"replace(replace(replace(doc, '\\', chr(1)), '\u0000', '\ufffd'), chr(1), '\\')::json"


def _usage_jobs(where: str) -> str:
    """The jobs ``where`` selects as usage reads them: id, tenant, the GPU request's JSON, the current attempt's
    model (each document parsed once)."""
    return (f"SELECT id, tenant, (d -> 'spec' -> 'gpus')::text, d ->> 'gpu_model'"
            f" FROM (SELECT id, tenant, {_DOC_JSON} AS d FROM jobs WHERE {where}) AS j")


_USAGE_PIECE = 10_000  # rows a usage report reads at a time
_USAGE_KEPT = "SELECT id FROM jobs WHERE ended_at IS NULL OR ended_at >= $1"
_USAGE_JOBS = _usage_jobs("ended_at IS NULL OR ended_at >= $1")
_EVENT_COLUMNS = "job_id, at, state, site, attempt, gpu_model, usd_per_gpu_hour"  # (broker.usage.Event)
_USAGE_EVENTS = (f"SELECT {_EVENT_COLUMNS} FROM job_events WHERE job_id IN ({_USAGE_KEPT})"
                 " ORDER BY job_id, seq")
_USAGE_HOURS = ("SELECT hour, tenant, site, gpu_model, gpu_seconds, attempts, priced_gpu_seconds, cost_usd"
                " FROM usage_hours WHERE hour >= $1 AND hour < $2")

MIGRATION_LOCK = 0x68656C696F74  # pg_advisory_xact_lock key ("heliot"): one replica migrates at a time

_ACTIVE = [s.value for s in JobState if not s.terminal]
_INSERT_JOB = (
    "INSERT INTO jobs (id, tenant, state, site, priority, idempotency_key, request_digest, version, doc, ended_at)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
)
_UPDATE_JOB = ("UPDATE jobs SET state = $1, site = $2, version = $3, doc = $4, priority = $5, ended_at = $6"
               " WHERE id = $7 AND version = $8")
_INSERT_EVENT = ("INSERT INTO job_events (job_id, at, state, site, attempt, reason, gpu_model, usd_per_gpu_hour)"
                 " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")
_UPSERT_DECISION = (
    "INSERT INTO decisions (job_id, attempt, doc) VALUES ($1, $2, $3)"
    " ON CONFLICT (job_id) DO UPDATE SET attempt = excluded.attempt, doc = excluded.doc"
)
_LEADER_FOR_SHARE = "SELECT epoch, expires_at > clock_timestamp() FROM leader WHERE name = $1 FOR SHARE"
IDLE_IN_TRANSACTION_MS = 2000
"""How long the server lets a session sit in an open transaction without sending anything (this store's
transactions are single batches, milliseconds long)."""

_ACQUIRE = """
    INSERT INTO leader AS l (name, holder, epoch, expires_at)
    VALUES ($1, $2, 1, clock_timestamp() + make_interval(secs => $3))
    ON CONFLICT (name) DO UPDATE SET
        holder = excluded.holder,
        epoch = l.epoch + 1,
        expires_at = excluded.expires_at
    WHERE l.holder = excluded.holder OR l.expires_at <= clock_timestamp()
    RETURNING epoch
"""
_RENEW = (
    "UPDATE leader SET expires_at = clock_timestamp() + make_interval(secs => $4)"
    " WHERE name = $1 AND holder = $2 AND epoch = $3 AND expires_at > clock_timestamp()"
)
_RELEASE = (
    "UPDATE leader SET expires_at = LEAST(expires_at, clock_timestamp())"
    " WHERE name = $1 AND holder = $2 AND epoch = $3"
)


def _rowcount(status: str) -> int:
    """The row count of a command status such as ``UPDATE 1`` or ``INSERT 0 1``."""
    try:
        return int(status.rsplit(" ", 1)[-1])
    except ValueError:
        return -1


def _unstorable(value: str) -> bool:
    """Whether a value looked up holds a NUL, which PostgreSQL's text refuses as a parameter, so that no row can
    hold it: left out of a list of values to match (a lone one is answered by ``_has_nul``: nothing found)."""
    return "\x00" in value


def server_name(dsn: str) -> str:
    """The DSN without its password, to name the server in messages."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        port = parts.port or 5432
    except ValueError:
        return "the PostgreSQL server (unparsable URL)"
    user = f"{parts.username}@" if parts.username else ""
    return f"postgresql://{user}{host}:{port}{parts.path or '/'}"


class PostgresStore(SqlWriteQueue):
    INSERT_JOB, UPDATE_JOB, INSERT_EVENT, UPSERT_DECISION = _INSERT_JOB, _UPDATE_JOB, _INSERT_EVENT, _UPSERT_DECISION
    UNDATED_ENDED = f"SELECT id, doc FROM jobs WHERE ended_at IS NULL AND state IN ({_TERMINAL}) ORDER BY seq LIMIT $1"
    # (Each statement is a round trip, and the writer's batch waits for it: a round's dates and deletions are one
    # statement per table, over arrays, not one per job.)
    DATE_ENDED = ("UPDATE jobs SET ended_at = d.ended_at FROM unnest($1::double precision[], $2::text[])"
                  " AS d(ended_at, id) WHERE jobs.id = d.id AND jobs.ended_at IS NULL")
    ENDED_BEFORE = "SELECT id FROM jobs WHERE ended_at < $1 ORDER BY ended_at, id LIMIT $2"
    ADD_USAGE = ("INSERT INTO usage_hours AS u (hour, tenant, site, gpu_model, gpu_seconds, attempts,"
                 " priced_gpu_seconds, cost_usd)"
                 " SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::double precision[],"
                 " $6::bigint[], $7::double precision[], $8::double precision[])"
                 " ON CONFLICT (hour, tenant, site, gpu_model) DO UPDATE SET"
                 " gpu_seconds = u.gpu_seconds + excluded.gpu_seconds, attempts = u.attempts + excluded.attempts,"
                 " priced_gpu_seconds = u.priced_gpu_seconds + excluded.priced_gpu_seconds,"
                 " cost_usd = u.cost_usd + excluded.cost_usd")
    DELETE_ENDED = (
        "DELETE FROM job_events WHERE job_id = ANY($1::text[])",
        "DELETE FROM decisions WHERE job_id = ANY($1::text[])",
        f"DELETE FROM jobs WHERE id = ANY($1::text[]) AND ended_at IS NOT NULL AND state IN ({_TERMINAL})",
    )

    def __init__(self, dsn: str, *, max_batch: int = 2048, min_connections: int = 1, max_connections: int = 8,
                 timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self.server = server_name(dsn)
        self.max_batch = max_batch
        self.min_connections, self.max_connections = min_connections, max_connections
        self.timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None
        self._queue: asyncio.Queue[Write | None] = asyncio.Queue()
        self._writer_task: asyncio.Task[None] | None = None
        self._closing = False
        self._fence: int | None = None
        self.commits = 0  # batches committed (for benchmarks)

    # --- life cycle ---

    async def open(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=self.min_connections, max_size=self.max_connections,
                timeout=self.timeout_s, command_timeout=self.timeout_s,
                # A process paused inside a transaction (SIGSTOP, a long GC) must not hold its locks for ever:
                # a fenced batch holds the leader row, and the next leader could not take it over. The
                # server ends such a session, and its uncommitted batch with it.
                server_settings={"idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_MS)},
            )
        except Exception as e:  # refused, unknown host, no such database, bad password, timeout
            raise StoreError(f"cannot connect to PostgreSQL at {self.server}: {_describe(e)}") from None
        try:
            await self._migrate()
        except BaseException:
            await self.close()
            raise
        self._closing = False
        self._writer_task = asyncio.get_running_loop().create_task(self._write_loop(), name="postgres-writer")

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
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), self.timeout_s)
            except (TimeoutError, OSError, asyncpg.PostgresError):
                pool.terminate()

    async def _migrate(self) -> None:
        """Apply the migrations this database lacks, in one transaction under an advisory lock: a replica that
        opens at the same moment waits for it, then finds them applied."""
        try:
            async with self._connection() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
                await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
                current = await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_version")
                if current > len(MIGRATIONS):
                    raise StoreError(
                        f"database {self.server} has schema version {current}, newer than this heliotrope "
                        f"({len(MIGRATIONS)}); upgrade heliotrope"
                    )
                for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
                    await conn.execute(script)
                    await conn.execute("INSERT INTO schema_version VALUES ($1)", version)
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"cannot migrate database {self.server}: {_describe(e)}") from None

    def _connection(self) -> Any:
        if self._pool is None:
            raise StoreError("store is not open")
        return self._pool.acquire(timeout=self.timeout_s)

    # --- group commit ---

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
            try:
                errors = await self._commit(batch)
            except BaseException as e:  # never leave a caller waiting forever
                error = e if isinstance(e, StoreError) else StoreError(
                    f"write to {self.server} failed: {_describe(e)}")
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(error)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for w, err in zip(batch, errors):
                if w.future.done():
                    continue
                if err is None:
                    w.future.set_result(None)
                else:
                    w.future.set_exception(err)

    async def _commit(self, batch: list[Write]) -> list[StoreError | None]:
        """The whole batch in one transaction. If a write fails, the batch is applied again, in one
        transaction still, with a savepoint around each write, so that the failing write fails alone.

        The fenced writes' check of the leader row is made at the end, just before the commit, and holds the
        row (``FOR SHARE``) only through the commit: held from the start of a long batch, it would keep the
        leader's own renewal of its lease waiting until the leader stepped down. Where the check finds a
        fenced write out of its term, the batch is applied again with the row read first, so that only those
        writes are refused."""
        async with self._connection() as conn:
            try:
                errors = await self._apply(conn, batch, isolate=False, check_first=False)
            except (WriteFailed, _OutOfTerm):
                # Again with the row read first and a savepoint around each write: a failing write fails
                # alone, and a write out of its term is refused alone.
                errors = await self._apply(conn, batch, isolate=True, check_first=True)
        self.commits += 1
        return errors

    async def _apply(self, conn: asyncpg.Connection, batch: list[Write], isolate: bool,
                     check_first: bool) -> list[StoreError | None]:
        errors: list[StoreError | None] = [None] * len(batch)
        fenced_writes = any(w.fence is not None for w in batch)
        async with conn.transaction():
            leader: tuple[int, bool] | None = None
            if check_first and fenced_writes:
                row = await conn.fetchrow(_LEADER_FOR_SHARE, LEADER)
                leader = (row[0], row[1]) if row is not None else None
            k = 0
            while k < len(batch):
                w = batch[k]
                if check_first and w.fence is not None and (fenced := fence_error(w.fence, leader)) is not None:
                    errors[k] = fenced  # not applied; the rest of the batch goes on
                    k += 1
                    continue
                if isolate:
                    try:
                        async with conn.transaction():  # a savepoint: a failing write is undone alone
                            await _run(conn, w)
                    except _WRITE_ERRORS as e:
                        errors[k] = _translate(e)
                    k += 1
                    continue
                end = k + 1
                while w.bulk and end < len(batch) and batch[end].bulk:
                    end += 1
                try:
                    if end - k > 1:  # a run of inserts: each statement for all of them at once, in call order
                        for i, (sql, _) in enumerate(w.statements):
                            await conn.executemany(sql, [b.statements[i][1] for b in batch[k:end]])
                    else:
                        await _run(conn, w)
                except _WRITE_ERRORS as e:
                    raise WriteFailed from e
                k = end
            if fenced_writes and not check_first:  # the check, held through the commit only
                row = await conn.fetchrow(_LEADER_FOR_SHARE, LEADER)
                leader = (row[0], row[1]) if row is not None else None
                if any(w.fence is not None and fence_error(w.fence, leader) is not None for w in batch):
                    raise _OutOfTerm  # (rolls the transaction back)
        return errors

    # --- jobs ---

    async def get_job(self, job_id: str) -> Job | None:
        row = await self._one("SELECT doc FROM jobs WHERE id = $1", job_id)
        return Job.model_validate_json(row[0]) if row else None

    async def find_idempotent(self, tenant: str, key: str) -> tuple[Job, str | None] | None:
        row = await self._one(
            "SELECT doc, request_digest FROM jobs WHERE tenant = $1 AND idempotency_key = $2", tenant, key
        )
        return (Job.model_validate_json(row[0]), row[1]) if row else None

    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None = None) -> Page:
        where: list[str] = []
        params: list[Any] = []

        def param(value: Any) -> str:
            params.append(value)
            return f"${len(params)}"

        if flt.state is not None:
            where.append(f"state = {param(flt.state.value)}")
        if flt.tenant is not None:
            where.append(f"tenant = {param(flt.tenant)}")
        if flt.site is not None:
            where.append(f"site = {param(flt.site)}")
        if flt.tenants is not None:
            where.append(f"tenant = ANY({param([t for t in flt.tenants if not _unstorable(t)])}::text[])")
        if flt.sites is not None:
            where.append(f"site = ANY({param([t for t in flt.sites if not _unstorable(t)])}::text[])")
        if flt.states is not None:
            where.append(f"state = ANY({param([s.value for s in flt.states])}::text[])")
        order = "jobs.seq"
        sql = "SELECT jobs.seq, jobs.doc FROM jobs"
        if flt.labels:
            # The jobs carrying one of the labels, newest first, read from its index (one with a value, if any:
            # the fewer rows), the other labels looked up by the job's seq; never a job's document. A value
            # holding a NUL matches nothing (_has_nul): no row holds one (migration 6).
            first = next((k for k, (_, value) in enumerate(flt.labels) if value is not None), 0)
            sql = "SELECT jobs.seq, jobs.doc FROM job_labels AS l JOIN jobs ON jobs.seq = l.seq"
            order = "l.seq"
            for k, (key, value) in enumerate(flt.labels):
                alias = "l" if k == first else "m"
                match = f"{alias}.key = {param(key)}"
                match += "" if value is None else f" AND {alias}.value = {param(value)}"
                where.append(match if k == first else
                             f"EXISTS (SELECT 1 FROM job_labels AS m WHERE m.seq = jobs.seq AND {match})")
        if cursor is not None:
            # (on the jobs' side of a join too: a merge join's scan of jobs would otherwise start at the newest job)
            below = param(decode_cursor(cursor))
            where += [f"{order} < {below}"] + (["jobs.seq < " + below] if flt.labels else [])
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {order} DESC LIMIT {param(limit + 1)}"
        rows = await self._all(sql, *params)
        items = [Job.model_validate_json(r[1]) for r in rows[:limit]]
        nxt = encode_cursor(rows[limit - 1][0]) if len(rows) > limit else None
        return Page(items, nxt)

    async def active_jobs(self) -> list[Job]:
        rows = await self._all("SELECT doc FROM jobs WHERE state = ANY($1::text[]) ORDER BY seq", _ACTIVE)
        return [Job.model_validate_json(r[0]) for r in rows]

    async def active_after(self, seq: int, limit: int) -> list[tuple[int, Job]]:
        rows = await self._all("SELECT seq, doc FROM jobs WHERE seq > $1 AND state = ANY($2::text[]) ORDER BY seq"
                               " LIMIT $3", seq, _ACTIVE, limit)
        return [(int(r[0]), Job.model_validate_json(r[1])) for r in rows]

    async def active_at(self, seqs: list[int]) -> list[tuple[int, Job]]:
        rows = await self._all("SELECT seq, doc FROM jobs WHERE seq = ANY($1::bigint[]) AND state = ANY($2::text[])"
                               " ORDER BY seq", seqs, _ACTIVE)
        return [(int(r[0]), Job.model_validate_json(r[1])) for r in rows]

    async def last_seq(self) -> int:
        return int(await self._call("fetchval", "SELECT COALESCE(MAX(seq), 0) FROM jobs") or 0)

    async def leader(self) -> str | None:
        return await self._call("fetchval", "SELECT holder FROM leader WHERE name = $1 AND expires_at > clock_timestamp()",
                                LEADER)

    async def job_events(self, job_id: str) -> list[dict[str, Any]]:
        rows = await self._all(
            "SELECT at, state, site, attempt, reason, gpu_model, usd_per_gpu_hour FROM job_events WHERE job_id = $1"
            " ORDER BY seq", job_id
        )
        return with_attempt_prices([dict(zip(EVENT_KEYS, r)) for r in rows])

    # --- usage ---

    async def usage_records(self, start: float, end: float) -> usage.UsageRecords:
        """As :meth:`broker.store.sqlite.SQLiteStore.usage_records`: the reads in one read-only transaction that
        sees one snapshot (repeatable read), so a deletion of jobs is seen wholly or not at all; the transitions
        streamed through a cursor."""
        if self._pool is None:
            raise StoreError("store is not open")
        since = start - 86400
        reader = usage.Holds()
        try:
            async with self._pool.acquire(timeout=self.timeout_s) as conn, conn.transaction(
                    isolation="repeatable_read", readonly=True):
                async for job_id, tenant, gpus, model in conn.cursor(_USAGE_JOBS, since, prefetch=_USAGE_PIECE):
                    reader.job(job_id, tenant, gpus, model)
                piece: list[tuple[Any, ...]] = []
                async for row in conn.cursor(_USAGE_EVENTS, since, prefetch=_USAGE_PIECE):
                    piece.append(tuple(row))
                    if len(piece) == _USAGE_PIECE:
                        reader.feed(piece)
                        piece = []
                reader.feed(piece)
                hours = await conn.fetch(_USAGE_HOURS, int(start), int(end), timeout=self.timeout_s)
        except (TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            raise _translate(e, self.server) from None
        return usage.UsageRecords(reader.done(), [tuple(r) for r in hours])

    async def _usage_of(self, ids: list[str]) -> list[usage.Held]:
        jobs = await self._all(_usage_jobs("id = ANY($1::text[])"), ids)
        events = await self._all(f"SELECT {_EVENT_COLUMNS} FROM job_events"
                                 " WHERE job_id = ANY($1::text[]) ORDER BY job_id, seq", ids)
        return usage.holds({r[0]: (r[1], r[2], r[3]) for r in jobs}, [tuple(r) for r in events])

    def _usage_added(self, rows: list[usage.HourRow]) -> list[tuple[str, tuple[Any, ...]]]:
        return [(self.ADD_USAGE, tuple(list(column) for column in zip(*rows)))] if rows else []

    # --- decisions ---

    async def get_decision(self, job_id: str) -> StoredDecision | None:
        row = await self._one("SELECT attempt, doc FROM decisions WHERE job_id = $1", job_id)
        return StoredDecision(row[0], json.loads(row[1])) if row else None

    # --- sites ---

    async def put_site(self, spec: SiteSpec) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO sites (name, doc) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET doc = excluded.doc",
            (spec.name, spec.model_dump_json()),
        )], fenced=True))

    async def seed_site(self, spec: SiteSpec) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO sites (name, doc) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            (spec.name, spec.model_dump_json()),
        )]))

    async def delete_site(self, name: str) -> None:
        await self._submit(self._new_write([("DELETE FROM sites WHERE name = $1", (name,))], fenced=True))

    async def list_sites(self) -> list[SiteSpec]:
        # Byte order, as SQLite sorts: the database's own collation (en_US, say) would order "a-c" after "ab".
        rows = await self._all('SELECT doc FROM sites ORDER BY name COLLATE "C"')
        return [site_from_doc(r[0]) for r in rows]

    # --- leadership ---

    async def acquire_leadership(self, holder: str, lease_s: float) -> int | None:
        self._check_writable()
        return await self._call("fetchval", _ACQUIRE, LEADER, holder, float(lease_s))

    async def renew_leadership(self, holder: str, epoch: int, lease_s: float) -> bool:
        self._check_writable()
        status = await self._call("execute", _RENEW, LEADER, holder, epoch, float(lease_s))
        return _rowcount(status) == 1

    async def release_leadership(self, holder: str, epoch: int) -> None:
        self._check_writable()
        await self._call("execute", _RELEASE, LEADER, holder, epoch)

    # --- learned state ---

    async def put_state(self, name: str, doc: str) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO broker_state (name, doc) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET doc = excluded.doc",
            (name, doc),
        )], fenced=True))

    async def get_state(self, name: str) -> str | None:
        row = await self._one("SELECT doc FROM broker_state WHERE name = $1", name)
        return None if row is None else row[0]

    # --- tenant limits set through the API ---

    async def list_tenant_limits(self) -> list[LimitOverride]:
        rows = await self._all("SELECT tenant, gpus, updated_at FROM tenant_limits ORDER BY tenant")
        return [LimitOverride(r[0], r[1], datetime.fromtimestamp(r[2], UTC)) for r in rows]

    async def put_tenant_limit(self, override: LimitOverride) -> None:
        await self._submit(self._new_write([(
            "INSERT INTO tenant_limits (tenant, gpus, updated_at) VALUES ($1, $2, $3) ON CONFLICT (tenant) DO UPDATE"
            " SET gpus = excluded.gpus, updated_at = excluded.updated_at",
            (override.tenant, override.gpus, override.updated_at.timestamp()),
        )], fenced=True))

    async def delete_tenant_limit(self, tenant: str) -> None:
        await self._submit(self._new_write([("DELETE FROM tenant_limits WHERE tenant = $1", (tenant,))], fenced=True))

    # --- tokens (broker.auth) ---

    async def put_token(self, token_id: str, digest: str, doc: str) -> None:
        await self._submit(self._new_write([("INSERT INTO tokens (id, digest, doc) VALUES ($1, $2, $3)",
                                             (token_id, digest, doc))]))

    async def update_token(self, token_id: str, doc: str) -> None:
        await self._submit(self._new_write([("UPDATE tokens SET doc = $1 WHERE id = $2", (doc, token_id))]))

    async def list_tokens(self) -> list[str]:
        return [r[0] for r in await self._all("SELECT doc FROM tokens ORDER BY id")]

    # --- reads ---

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        """One statement on a pooled connection (its own transaction), errors as ``StoreError``."""
        if self._pool is None:
            raise StoreError("store is not open")
        try:
            return await getattr(self._pool, method)(sql, *args, timeout=self.timeout_s)
        except (TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            raise _translate(e, self.server) from None

    async def _one(self, sql: str, *args: Any) -> asyncpg.Record | None:
        if _has_nul(args):
            return None
        return await self._call("fetchrow", sql, *args)

    async def _all(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        if _has_nul(args):
            return []
        return await self._call("fetch", sql, *args)

    async def _read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self._all(sql, *params)]

    def _date_ended(self, dates: list[tuple[float | None, str]]) -> list[tuple[str, tuple[Any, ...]]]:
        return [(self.DATE_ENDED, ([at for at, _ in dates], [job_id for _, job_id in dates]))]

    def _delete_ended(self, ids: list[str]) -> list[tuple[str, tuple[Any, ...]]]:
        return [(sql, (ids,)) for sql in self.DELETE_ENDED]


def _has_nul(args: tuple[Any, ...]) -> bool:
    """Whether a text argument holds NUL, which PostgreSQL's text cannot store (it refuses the query). Every
    read matches its text arguments by equality, so such a value (from a request's path or query, as in
    ``GET /v1/jobs/a%00b``) finds nothing, as on SQLite, rather than failing as a store error: a 503 that no
    retry cures."""
    return any(isinstance(a, str) and "\x00" in a for a in args)


_WRITE_ERRORS = (StoreError, asyncpg.PostgresError, ValueError)
"""What fails one write alone: the server refused it, or asyncpg could not encode a value (its client-side
``DataError`` is a ``ValueError``). Anything else (a lost connection, a timeout) fails the whole batch."""


class WriteFailed(Exception):
    """A write of the batch failed on the first, unisolated, attempt."""


class _OutOfTerm(Exception):
    """The leader row, read before the commit, refuses a fenced write of the batch: apply it again with the row
    read first."""


async def _run(conn: asyncpg.Connection, w: Write) -> None:
    for i, (sql, params) in enumerate(w.statements):
        status = await conn.execute(sql, *params)
        if i in w.checks and _rowcount(status) != 1:
            raise Conflict(f"job {params[-2]} changed since it was read (or does not exist)")


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    text = str(error).strip()
    return f"{error.__class__.__name__}: {text}" if text else error.__class__.__name__


def _translate(error: BaseException, server: str = "PostgreSQL") -> StoreError:
    if isinstance(error, StoreError):
        return error
    if isinstance(error, asyncpg.UniqueViolationError):
        return DuplicateKey(str(error))
    if isinstance(error, asyncpg.PostgresError):
        return StoreError(f"database error: {_describe(error)}")
    if isinstance(error, ValueError):
        return StoreError(f"invalid value: {_describe(error)}")
    return StoreError(f"cannot use {server}: {_describe(error)}")
