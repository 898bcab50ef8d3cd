"""Listing jobs by label (``GET /v1/jobs?label=``, ``POST /v1/cancellations``) against a store of many jobs.

1. **Fill:** ``--jobs`` N (default 1,000,000) jobs are written into a new store in transactions of 20,000 jobs
   with ``executemany``: the rows ``insert_job`` writes (the store's own statements: the job row with its JSON
   document and ``ended_at``, and its ``submitted`` event, and from migration 6 its labels: on SQLite by the insert's
   own statement, on PostgreSQL by the schema's trigger), after the store's own migrations made the schema. Jobs come from 50 tenants
   (``t-000`` .. ``t-049``, in turn); 90 % have succeeded (ended an hour before the listing: kept by the
   retention of finished jobs), 10 % are queued. Labels: every 100th job carries ``sweep=lr-search`` (1 %: the
   sweep a user lists or cancels), a third of the others carry ``sweep=s-K`` (200 other sweeps) and
   ``team=TENANT``, a third ``team=TENANT`` alone, and the rest none. Each job's document is its template's (one
   per tenant, label set and state, made by ``Job`` and ``model_dump_json``, as the store writes it) with its own
   id put in. Timed.
2. **Queries**, through ``store.list_jobs`` as the API calls it (newest first, ``limit`` 100): the first page, and
   the whole listing (every page, by cursor; the cancellations endpoint walks them so), for
   ``sweep=lr-search`` (10,000 jobs of 1M); ``sweep=lr-search`` with ``tenant=t-007`` (200); ``sweep=lr-search``
   with ``team=t-007`` (two labels: 200); ``sweep`` with any value (34 %: the first page is quick, the listing
   is long); and ``sweep=nothing-matches`` (none: the whole table is looked at, the worst case). Median of
   ``--repeat`` runs (default 3) each, fewer where they take more than ``--budget`` seconds (default 60)
   together; a whole listing still going after ``--budget`` seconds is cut short and shown as ``>``. ``--plan``
   prints the database's plan for the first page of each.

``--store sqlite`` (default) writes a new file in a temporary folder (``--path`` to keep it, and reuse it when it
exists: the fill is skipped). ``--store postgres`` uses ``--dsn`` (a database it may fill: it makes a new one,
``labels_bench_PID``, on that server, and drops it after) or, without it, a private server started as the tests
start theirs (``tests/postgres.py``: initdb into a temporary folder).

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/labels.py [--store sqlite|postgres] [--jobs 1000000] [--dsn URL] [--path FILE]
                                     [--repeat 3] [--budget 60] [--plan]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.models import Job, JobSpec, JobState  # noqa: E402
from broker.store import JobFilter, ended_at  # noqa: E402
from broker.store.sql import event_row  # noqa: E402
from broker.store.sqlite import _INSERT_LABELS as INSERT_LABELS  # noqa: E402

BATCH = 20_000
TENANTS = [f"t-{k:03d}" for k in range(50)]
SWEEP = ("sweep", "lr-search")
T0 = datetime(2026, 11, 1, tzinfo=UTC)
PLACEHOLDER = "JOBIDJOBIDJOBIDJOB"  # 18 characters, as a job id, found once in a template's document

QUERIES: list[tuple[str, JobFilter]] = [
    ("sweep=lr-search (1 %)", JobFilter(labels=(SWEEP,))),
    ("sweep=lr-search, tenant=t-007", JobFilter(tenant="t-007", labels=(SWEEP,))),
    ("sweep=lr-search, team=t-007", JobFilter(labels=(SWEEP, ("team", "t-007")))),
    ("sweep (any value, 34 %)", JobFilter(labels=(("sweep", None),))),
    ("sweep=nothing-matches", JobFilter(labels=(("sweep", "nothing-matches"),))),
]


def tenant_of(i: int) -> str:
    return TENANTS[(i + i // 100) % len(TENANTS)]  # (every tenant has sweep jobs: every 100th job)


def state_of(i: int) -> JobState:
    return JobState.QUEUED if (i + i // 100) % 10 == 9 else JobState.SUCCEEDED


def labels_of(i: int) -> tuple[tuple[str, str], ...]:
    tenant = tenant_of(i)
    if i % 100 == 0:
        return (SWEEP, ("team", tenant))
    kind = i % 3
    if kind == 0:
        return (("sweep", f"s-{i % 200}"), ("team", tenant))
    if kind == 1:
        return (("team", tenant),)
    return ()


def job_id(i: int) -> str:
    return f"J{i:017d}"


class Templates:
    """One job document per (tenant, labels, state): a job is its template's with its id put in."""

    def __init__(self) -> None:
        self._docs: dict[tuple[Any, ...], tuple[Job, str]] = {}

    def job(self, i: int) -> tuple[Job, str]:
        tenant, labels = tenant_of(i), labels_of(i)
        labels = labels if labels[:1] != (("sweep", f"s-{i % 200}"),) else (("sweep", "s-*"), *labels[1:])
        state = state_of(i)
        key = (tenant, labels, state)
        if key not in self._docs:
            at = T0 if state is JobState.QUEUED else T0 - timedelta(hours=1)
            spec = JobSpec(tenant=tenant, name="train", gpus={"count": 1, "model": "a100-80gb"}, duration_s=3600,
                           labels=dict(labels))
            job = Job(id=PLACEHOLDER, spec=spec, state=state, created_at=at - timedelta(hours=2), updated_at=at,
                      site=None if state is JobState.QUEUED else "lon-1")
            doc = job.model_dump_json()
            assert doc.count(PLACEHOLDER) == 1 and doc.count("s-*") <= 1
            self._docs[key] = (job, doc)
        return self._docs[key]


def rows(start: int, end: int, tmpl: Templates) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]],
                                                         list[tuple[Any, ...]]]:
    """The parameters of the job rows, event rows and (on SQLite, where the insert writes them) label rows
    ``insert_job`` writes, for jobs ``start`` .. ``end``."""
    jobs, events, labels = [], [], []
    for i in range(start, end):
        job, doc = tmpl.job(i)
        jid = job_id(i)
        doc = doc.replace(PLACEHOLDER, jid).replace('"s-*"', f'"s-{i % 200}"')
        jobs.append((jid, job.spec.tenant, job.state.value, job.site, job.spec.priority, None, None, job.version,
                     doc, ended_at(job)))
        events.append((jid, *event_row(job, "submitted")[1:]))
        if job.spec.labels:
            labels.append((json.dumps({k: f"s-{i % 200}" if v == "s-*" else v for k, v in job.spec.labels.items()}),
                           jid))
    return jobs, events, labels


def batches(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, BATCH):
        yield start, min(n, start + BATCH)


# --- fill ----------------------------------------------------------------------------------------------------


def fill_sqlite(store: Any, path: Path, n: int) -> None:
    tmpl = Templates()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for start, end in batches(n):
        conn.execute("BEGIN IMMEDIATE")
        for sql, params in zip((store.INSERT_JOB, store.INSERT_EVENT, INSERT_LABELS), rows(start, end, tmpl)):
            conn.executemany(sql, params)
        conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def fill_postgres(store: Any, n: int) -> None:
    tmpl = Templates()
    async with store._connection() as conn:
        for start, end in batches(n):
            async with conn.transaction():
                for sql, params in zip((store.INSERT_JOB, store.INSERT_EVENT), rows(start, end, tmpl)[:2]):
                    await conn.executemany(sql, params)  # (the labels: by the database's trigger)
        await conn.execute("VACUUM ANALYZE")


# --- queries -------------------------------------------------------------------------------------------------


async def listing(store: Any, flt: JobFilter, budget_s: float) -> tuple[float, float, int, bool]:
    """Seconds to the first page, seconds to the last (or to the page that ran past ``budget_s``), jobs listed,
    whether the listing was cut short."""
    t = time.perf_counter()
    page = await store.list_jobs(flt, 100)
    first = time.perf_counter() - t
    count = len(page.items)
    while page.next is not None:
        if time.perf_counter() - t > budget_s:
            return first, time.perf_counter() - t, count, True
        page = await store.list_jobs(flt, 100, page.next)
        count += len(page.items)
    return first, time.perf_counter() - t, count, False


async def plan(store: Any, flt: JobFilter) -> str:
    """The database's plan of the first page's query (the store's SQL, caught on its way to the database)."""
    caught: list[tuple[str, tuple[Any, ...]]] = []
    reader = store._all

    async def catch(sql: str, *params: Any) -> list[Any]:
        if len(params) == 1 and isinstance(params[0], tuple):
            params = params[0]
        caught.append((sql, params))
        return []

    store._all = catch
    try:
        await store.list_jobs(flt, 100)
    finally:
        store._all = reader
    sql, params = caught[0]
    if hasattr(store, "_pool"):
        out = await reader("EXPLAIN " + sql, *params)
        return "\n".join(r[0] for r in out)
    out = await reader("EXPLAIN QUERY PLAN " + sql, params)
    return "\n".join(str(r[-1]) for r in out)


async def measure(store: Any, repeat: int, budget_s: float, show_plan: bool) -> None:
    print(f"{'query':34} {'matched':>8} {'first page ms':>14} {'whole listing ms':>17}")
    for name, flt in QUERIES:
        runs = [await listing(store, flt, budget_s)]
        while len(runs) < repeat and not runs[0][3] and sum(r[1] for r in runs) < budget_s:
            runs.append(await listing(store, flt, budget_s))
        first = statistics.median(r[0] for r in runs) * 1000
        whole = statistics.median(r[1] for r in runs) * 1000
        count, cut = runs[0][2], runs[0][3]
        print(f"{name:34} {count:>8}{'+' if cut else ' '}{first:>14.1f} {'>' if cut else ' '}{whole:>16.1f}"
              + (f"   (cut short: {count} listed in {budget_s:.0f} s)" if cut else ""), flush=True)
        if show_plan:
            print("    " + (await plan(store, flt)).replace("\n", "\n    "))


async def run_sqlite(args: argparse.Namespace) -> None:
    from broker.store.sqlite import SQLiteStore

    folder = None
    if args.path:
        path = Path(args.path)
    else:
        folder = tempfile.TemporaryDirectory(prefix="labels-bench-")
        path = Path(folder.name) / "broker.db"
    fresh = not path.exists()
    store = SQLiteStore(path)
    t = time.perf_counter()
    await store.open()  # the store's migrations (an existing file: brought up to this release's schema)
    print(f"open (migrations): {time.perf_counter() - t:.1f} s")
    try:
        if fresh:
            t = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(None, fill_sqlite, store, path, args.jobs)
            print(f"fill: {args.jobs} jobs in {time.perf_counter() - t:.1f} s, "
                  f"{path.stat().st_size / 2**20:.0f} MiB")
        await measure(store, args.repeat, args.budget, args.plan)
    finally:
        await store.close()
        if folder is not None:
            folder.cleanup()


async def run_postgres(args: argparse.Namespace) -> None:
    import asyncpg

    from broker.store.postgres import PostgresStore

    server = None
    admin = args.dsn
    if admin is None:
        from tests.postgres import PostgresServer

        server = PostgresServer()
        server.start()
        admin = server.dsn()
    name = f"labels_bench_{os.getpid()}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    store = PostgresStore(admin.rsplit("/", 1)[0] + "/" + name, timeout_s=600)
    try:
        await store.open()
        t = time.perf_counter()
        await fill_postgres(store, args.jobs)
        size = await store._call("fetchval", "SELECT pg_database_size(current_database())")
        print(f"fill: {args.jobs} jobs in {time.perf_counter() - t:.1f} s, {size / 2**20:.0f} MiB")
        await measure(store, args.repeat, args.budget, args.plan)
    finally:
        await store.close()
        conn = await asyncpg.connect(admin)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()
        if server is not None:
            server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--dsn", help="PostgreSQL server URL (a database there is made and dropped)")
    parser.add_argument("--path", help="SQLite file to fill (kept; an existing one is not filled again)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds a whole listing may take (then cut short; repeats stop past it too)")
    parser.add_argument("--plan", action="store_true", help="print the plan of each first page's query")
    args = parser.parse_args()
    print(f"{args.store}, {args.jobs} jobs; {platform.python_version()}, sqlite {sqlite3.sqlite_version}")
    asyncio.run(run_sqlite(args) if args.store == "sqlite" else run_postgres(args))


if __name__ == "__main__":
    main()
