"""A usage report (``GET /v1/usage``, :mod:`broker.usage`) over a store of many jobs, and the deletion of finished
jobs that rolls their usage up.

1. **Fill:** ``--jobs`` N (default 100,000) jobs are written into a new SQLite store (the store's own statements
   and schema: each job's row with its JSON document, and its transitions as ``update_job`` writes them:
   submitted, dispatching (with the price of its site and model), admitted, running, and succeeded, or for every
   20th job still running), in transactions of 20,000 jobs. Jobs come from 50 tenants and run at 20 sites on two
   GPU models, 1 to 8 GPUs each (every 10th a MIG job of two 3g slices), submitted evenly over the 30 days before
   the report, each running a few minutes to a few hours. Timed.
2. **Report** over the 30 days, by tenant and by tenant, site and model (what ``GET /v1/usage`` does: the store's
   read of the jobs kept, their transitions and the hours rolled up, in one transaction, then the report): median
   of ``--repeat`` runs (default 3), and the peak memory Python allocated for one more (``tracemalloc``, apart).
3. **Deletion:** the finished jobs are deleted as the retention does (``prune_ended``, 1,000 per round), each
   round adding their usage into ``usage_hours`` first; timed. The report is timed again (now from the hours
   rolled up, and the running jobs), and its total GPU-hours and cost are checked to be the ones before (printed).

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/usage.py [--jobs 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker import usage  # noqa: E402
from broker.models import Job, JobSpec, JobState  # noqa: E402
from broker.store import ended_at  # noqa: E402
from broker.store import sqlite as sq  # noqa: E402
from broker.store.sql import event_row  # noqa: E402
from broker.store.sqlite import SQLiteStore  # noqa: E402

NOW = datetime(2026, 11, 30, tzinfo=UTC)
MODELS = ("a100-80gb", "h100-80gb")
PRICES = {f"site-{s:02d}": {m: 2.0 + s / 10 for m in MODELS} for s in range(20)}


def job_rows(i: int, span_s: float, n: int) -> tuple[tuple, list[tuple]]:
    """Job ``i`` of ``n``: its row and its transitions' rows."""
    submitted = NOW - timedelta(seconds=span_s * (1 - i / n))
    gpus = {"count": 2, "mig_profile": "3g.40gb"} if i % 10 == 0 else {"count": 1 + i % 8}
    spec = JobSpec(tenant=f"t-{i % 50:03d}", name=f"job-{i}", gpus=gpus, duration_s=3600)
    job = Job(id=f"job{i:08d}", spec=spec, created_at=submitted, updated_at=submitted)
    events = [event_row(job, "submitted")]
    site, model = f"site-{i % 20:02d}", MODELS[i % 2]
    run_s = 300 + (i * 7919) % (4 * 3600)
    steps = [(JobState.DISPATCHING, 5, {"site": site, "attempt": 1, "gpu_model": model,
                                        "usd_per_gpu_hour": PRICES[site][model]}),
             (JobState.ADMITTED, 6, {}), (JobState.RUNNING, 30, {})]
    if i % 20:
        steps.append((JobState.SUCCEEDED, 30 + run_s, {}))
    for state, after_s, changes in steps:
        job = job.transition(state, min(submitted + timedelta(seconds=after_s), NOW), **changes)
        events.append(event_row(job, None))
    row = (job.id, job.spec.tenant, job.state.value, job.site, job.spec.priority, None, None, job.version,
           job.model_dump_json(), ended_at(job))
    return row, events


async def fill(path: Path, n: int) -> float:
    store = SQLiteStore(path)
    await store.open()  # (the schema, by the store's own migrations)
    await store.close()
    t0 = time.perf_counter()
    with sqlite3.connect(path) as db:
        for lo in range(0, n, 20_000):
            rows, events = [], []
            for i in range(lo, min(n, lo + 20_000)):
                r, e = job_rows(i, 30 * 86400, n)
                rows.append(r)
                events += e
            db.executemany(sq._INSERT_JOB, rows)
            db.executemany(sq._INSERT_EVENT, events)
            db.commit()
    return time.perf_counter() - t0


async def report(store: SQLiteStore, by: tuple[str, ...], repeat: int) -> tuple[float, float, dict]:
    start, end = usage.window(NOW - timedelta(days=30), NOW, NOW)
    times, body = [], {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        records = await store.usage_records(start.timestamp(), end.timestamp())
        body = usage.report(records, start, end, NOW, by, PRICES)
        times.append(time.perf_counter() - t0)
        del records
    tracemalloc.start()  # (once more, apart: tracing makes every allocation several times slower)
    records = await store.usage_records(start.timestamp(), end.timestamp())
    usage.report(records, start, end, NOW, by, PRICES)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), peak, body


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "usage.db"
        print(f"fill: {args.jobs:,} jobs ({args.jobs * 5:,} transitions) in {await fill(path, args.jobs):.1f} s")
        store = SQLiteStore(path)
        await store.open()
        try:
            totals = []
            for by in (("tenant",), usage.GROUP_KEYS):
                took, peak, body = await report(store, by, args.repeat)
                totals.append(body["total"])
                print(f"report by {','.join(by)}: {len(body['items'])} rows in {took:.2f} s (median of "
                      f"{args.repeat}), peak {peak:.0f} MiB traced; {body['total']['gpu_hours']:,.1f} GPU-hours")
            t0, deleted = time.perf_counter(), 0
            while batch := await store.prune_ended(NOW, 1000):
                deleted += len(batch)
            took = time.perf_counter() - t0
            print(f"deleted {deleted:,} finished jobs, their usage rolled up, in {took:.1f} s "
                  f"({deleted / took:,.0f} jobs/s)")
            for by, before in zip((("tenant",), usage.GROUP_KEYS), totals):
                took, peak, body = await report(store, by, args.repeat)
                same = all(abs(body["total"][k] - before[k]) < 1e-3 * max(1.0, before[k])
                           for k in ("gpu_hours", "cost_usd"))
                print(f"report by {','.join(by)} after: {len(body['items'])} rows in {took:.2f} s, peak {peak:.0f} "
                      f"MiB; total {body['total']['gpu_hours']:,.1f} GPU-hours, {body['total']['cost_usd']:,.2f} USD "
                      f"({'the same' if same else 'DIFFERS'})")
        finally:
            await store.close()


if __name__ == "__main__":
    asyncio.run(main())
