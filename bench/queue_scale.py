"""Broker memory and scheduling-cycle time against the length of the queue (10k, 100k, 1M queued jobs).

For each queue length N in ``--sizes``, in fresh processes (so memory figures are clean):

1. **Insert** (a process of its own, SQLite): N queued jobs are written straight into a new database in a
   temporary folder, the rows ``SQLiteStore.insert_job`` writes (the job row with its JSON document, and its
   ``submitted`` event), with ``executemany`` in transactions of 20,000 jobs. Jobs come from 100 tenants
   (``t-000`` .. ``t-099``), priorities 0/10/50/100, 1, 2, 4 or 8 whole GPUs, one hour each, created a
   millisecond apart. Timed. With ``--store memory`` there is no file: the jobs are inserted with
   ``MemoryStore.insert_job`` in the measuring process (each a ``Job`` parsed from its JSON, as a submission
   is), and the insert is counted in the memory figures, since that store *is* memory.
2. **Load** (a second fresh process): a ``Broker`` on a ``ManualClock`` with two simulated sites of
   8 a100-80gb each, ``await broker.start(sites, run_loop=False)``, which opens the store and loads every
   unfinished job into ``JobBook.active`` (``broker.jobs.ActiveJobs``: a queued job is kept as its compact
   JSON document plus its entry in the queue index, ``broker.queue``), a page of 10,000 at a time. Timed (the whole start, and ``book.load``
   on its own). RSS (``VmRSS`` of ``/proc/self/status``) is read before and after; the difference divided
   by N is *bytes per queued job*. Peak RSS (``VmHWM``) shows what the load needed on the way.
3. **Full sites:** 16 one-GPU jobs of tenant ``filler`` at priority 1000 running for ~115 days are
   submitted and placed by the first full pass, and the clock is moved on until the sites run them, so
   both sites report 0 free GPUs and every one of the N queued jobs cannot run.
4. **First full pass** (the one that placed the fillers): it walks the queue group by group (a group: one
   request shape, tenant, priority and profile; 1,600 here) and decides each group's first job, which finds
   no site, so the group's other jobs are not decided (``broker.queue``); it records those decisions.
   Timed, with RSS after. ``decided`` per pass is in the table.
5. **Steady full passes:** ``await broker.cycle.run_once(full=True)`` ``--passes`` times (default 5), each
   after marking capacity as freed (as when a job leaves a site), so each walks the queue again against
   full sites (nothing placed, nothing recorded). Median and max. Then one *quiet*
   full pass, as the periodic pass runs when nothing changed since the last one (same reports, same hour,
   no job moved): it decides only new jobs, so it should not grow with the queue.
6. **Listing:** ``store.list_jobs`` with ``limit=100``, as ``GET /v1/jobs`` does: the first page with no
   filter; the first page filtered by ``state=queued, tenant=t-042``; and the same filter from a deep
   cursor (one pointing halfway back through the queue, as a client gets after paging far back). Median
   of 5 calls each.

The parent prints one table, and with ``--plot FILE`` writes a PNG of cycle time and RSS against queue
length (log-log; needs matplotlib). A size whose process fails or runs past ``--timeout`` is reported as
such, and its figures are extrapolated (linearly in N from the largest two sizes measured), clearly marked.

``--diagnose N`` runs one more measuring process at N with ``tracemalloc`` on (one frame per allocation;
snapshots after the load and after the first pass, top 10 by line) and ``cProfile`` over two steady full
passes (top 15 by own time). Tracing slows the load about 2-3x and adds memory: its timings are not the
table's.

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/queue_scale.py [--sizes 10000,100000,1000000] [--store sqlite|memory]
                                          [--passes 5] [--plot FILE] [--diagnose N] [--timeout 1800]
                                          [--distinct-shapes]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.clock import ManualClock  # noqa: E402
from broker.config import BrokerSettings  # noqa: E402
from broker.models import Job, JobSpec, JobState, SimulatedAdapterConfig  # noqa: E402
from broker.service import Broker  # noqa: E402
from broker.store import JobFilter, encode_cursor, ended_at  # noqa: E402
from broker.store.memory import MemoryStore  # noqa: E402
from broker.store.sql import event_row  # noqa: E402
from broker.store.sqlite import _INSERT_EVENT, _INSERT_JOB, _INSERT_LABELS, SQLiteStore  # noqa: E402
from tests.builders import site  # noqa: E402

T0 = datetime(2026, 7, 30, 12, tzinfo=UTC)
TENANTS = tuple(f"t-{i:03d}" for i in range(100))
PRIORITIES = (0, 10, 50, 100)
GPU_COUNTS = (1, 2, 4, 8)
BATCH = 20_000
FILLERS = 16
_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def job_id(i: int) -> str:
    """A sortable id like ``broker.jobs.new_job_id``: milliseconds then a counter, in Crockford base32."""
    value = ((int(T0.timestamp() * 1000) - 10_000_000) << 40) | i
    out = []
    for _ in range(18):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def templates() -> list[Job]:
    """One queued job per (tenant, priority, GPU count): queued job ``i`` is a copy of template
    ``i % len``, with its own id and creation time."""
    out = []
    for tenant in TENANTS:
        for priority in PRIORITIES:
            for count in GPU_COUNTS:
                spec = JobSpec(tenant=tenant, name=f"train-{count}g", gpus={"count": count, "model": "a100-80gb"},
                               duration_s=3600, priority=priority, labels={"team": tenant})
                out.append(Job(id="x", spec=spec, created_at=T0, updated_at=T0, reason="waiting for a placement"))
    # spread shapes over the sequence so every stretch of the queue has every tenant, priority and size
    step = 7919  # prime, coprime with len(out) = 1600
    return [out[(k * step) % len(out)] for k in range(len(out))]


DISTINCT_SHAPES = False
"""``--distinct-shapes``: every queued job asks for its own minimum GPU memory, so no two share a queue
group (the worst case for ``broker.queue``: a pass decides every job again)."""


def queued_job(i: int, n: int, tmpl: list[Job]) -> Job:
    at = T0 - timedelta(milliseconds=n - i)
    job = tmpl[i % len(tmpl)]
    update: dict[str, Any] = {"id": job_id(i), "created_at": at, "updated_at": at}
    if DISTINCT_SHAPES:
        gpus = job.spec.gpus.model_copy(update={"memory_gib": 1.0 + i * 1e-5})
        update["spec"] = job.spec.model_copy(update={"gpus": gpus})
    return job.model_copy(update=update)


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def mib(kib: float) -> float:
    return kib / 1024


# --- phase 1: insert (SQLite, own process) -------------------------------------------------------------------


async def _migrate(path: Path) -> None:
    store = SQLiteStore(str(path))
    await store.open()
    await store.close()


def insert_sqlite(path: Path, n: int) -> dict[str, Any]:
    """The rows ``SQLiteStore.insert_job`` writes, in big transactions (the migrations come from the store)."""
    asyncio.run(_migrate(path))
    tmpl = templates()
    t = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    for start in range(0, n, BATCH):
        jobs = [queued_job(i, n, tmpl) for i in range(start, min(n, start + BATCH))]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(_INSERT_JOB, [
            (j.id, j.spec.tenant, j.state.value, j.site, j.spec.priority, None, None, j.version, j.model_dump_json(),
             ended_at(j))
            for j in jobs])
        conn.executemany(_INSERT_LABELS, [(json.dumps(j.spec.labels), j.id) for j in jobs if j.spec.labels])
        conn.executemany(_INSERT_EVENT, [event_row(j, "submitted") for j in jobs])
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    elapsed = time.perf_counter() - t
    return {"insert_s": elapsed, "db_mib": path.stat().st_size / 2**20}


# --- phase 2..6: load, cycle, listing (own process) ----------------------------------------------------------


def _top_lines(snap: tracemalloc.Snapshot, n: int = 10) -> list[str]:
    stats = snap.statistics("lineno")
    total = sum(s.size for s in stats)
    out = [f"total traced {total / 2**20:,.1f} MiB in {sum(s.count for s in stats):,} blocks"]
    for s in stats[:n]:
        frame = s.traceback[0]
        out.append(f"{s.size / 2**20:9.1f} MiB {s.count:>11,} blocks  {frame.filename}:{frame.lineno}")
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n, diagnose = args.worker, args.diag
    out: dict[str, Any] = {"n": n, "store": args.store}
    clock = ManualClock(T0)
    adapter = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    sites = [site("alpha", gpus={"a100-80gb": 8}, adapter=adapter),
             site("beta", gpus={"a100-80gb": 8}, region="gcp:europe-west4", grid_zone="NL",
                  timezone="Europe/Amsterdam", adapter=adapter)]
    if args.store == "memory":
        store: Any = MemoryStore()
        settings = BrokerSettings(db=":memory:", shutdown_grace_s=0.1)
    else:
        store = None
        settings = BrokerSettings(db=args.db, shutdown_grace_s=0.1)
    broker = Broker(settings, store=store, clock=clock)
    if diagnose:
        tracemalloc.start(1)
    rss0 = rss_kib()
    out["rss_base_mib"] = mib(rss0)
    if args.store == "memory":
        await broker.store.open()
        tmpl = templates()
        t = time.perf_counter()
        for i in range(n):
            j = queued_job(i, n, tmpl)
            await broker.store.insert_job(Job.model_validate_json(j.model_dump_json()))
        out["insert_s"] = time.perf_counter() - t

    load_s = 0.0
    real_load = broker.book.load

    async def timed_load() -> list[Job]:
        nonlocal load_s
        t = time.perf_counter()
        try:
            return await real_load()
        finally:
            load_s = time.perf_counter() - t

    broker.book.load = timed_load  # type: ignore[method-assign]
    t = time.perf_counter()
    await broker.start(sites, run_loop=False)
    out["start_s"] = time.perf_counter() - t
    out["load_s"] = load_s
    out["active"] = len(broker.book.active)
    rss1 = rss_kib()
    out["rss_load_mib"] = mib(rss1)
    out["hwm_load_mib"] = mib(rss_kib("VmHWM"))
    out["bytes_per_job"] = (rss1 - rss0) * 1024 / n
    if diagnose:
        out["trace_load"] = _top_lines(tracemalloc.take_snapshot())

    # fill the sites, then the first full pass (places the fillers, decides and records every queued job)
    for k in range(FILLERS):
        spec = JobSpec(tenant="filler", name=f"filler-{k}", gpus={"count": 1}, duration_s=1e7, priority=1000)
        await broker.book.submit(spec)
    t = time.perf_counter()
    report = await broker.cycle.run_once(full=True)
    out["first_pass_ms"] = (time.perf_counter() - t) * 1000
    out["first_pass"] = {"decided": report.decided, "placed": report.placed}
    await asyncio.sleep(0.05)
    await clock.advance(2.0)
    await asyncio.sleep(0.05)
    await broker.cycle.drain()
    running = sum(1 for j in broker.book.active.unqueued() if j.state == JobState.RUNNING)
    out["fillers_running"] = running
    out["rss_pass_mib"] = mib(rss_kib())
    out["hwm_pass_mib"] = mib(rss_kib("VmHWM"))
    if diagnose:
        out["trace_pass"] = _top_lines(tracemalloc.take_snapshot())
        tracemalloc.stop()

    # steady full passes against full sites
    times = []
    prof = cProfile.Profile() if diagnose else None
    for _ in range(2 if diagnose else args.passes):
        if prof is not None:
            prof.enable()
        broker.book.capacity_freed = True  # as when a job leaves a site: the whole queue is walked again
        t = time.perf_counter()
        report = await broker.cycle.run_once(full=True)
        times.append((time.perf_counter() - t) * 1000)
        if prof is not None:
            prof.disable()
        assert report.full and report.placed == 0, report
    out["pass_decided"] = report.decided
    out["pass_ms"] = times
    await broker.cycle.run_once(full=True)  # the periodic pass, nothing changed: remembered as quiet
    t = time.perf_counter()
    quiet = await broker.cycle.run_once(full=True)
    out["quiet_pass_ms"] = (time.perf_counter() - t) * 1000
    out["quiet_decided"] = quiet.decided
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        out["profile"] = buf.getvalue()

    # listing, as GET /v1/jobs does it
    async def timed(flt: JobFilter, cursor: str | None = None) -> tuple[float, int]:
        samples, got = [], 0
        for _ in range(5):
            t = time.perf_counter()
            page = await broker.store.list_jobs(flt, 100, cursor)
            samples.append((time.perf_counter() - t) * 1000)
            got = len(page.items)
        return statistics.median(samples), got

    flt = JobFilter(state=JobState.QUEUED, tenant="t-042")
    out["list_first_ms"], _ = await timed(JobFilter())
    out["list_filtered_ms"], got = await timed(flt)
    deep = encode_cursor(n // 2 + 1)  # halfway back through the queue (seq numbers start at 1)
    out["list_deep_ms"], deep_got = await timed(flt, deep)
    out["list_pages"] = [got, deep_got]
    await broker.stop()
    out["hwm_mib"] = mib(rss_kib("VmHWM"))
    return out


# --- parent ---------------------------------------------------------------------------------------------------


def run_size(n: int, args: argparse.Namespace, diagnose: bool = False) -> dict[str, Any]:
    me = [sys.executable, str(Path(__file__).resolve())]
    deadline = time.monotonic() + args.timeout
    shapes = ["--distinct-shapes"] if args.distinct_shapes else []
    with tempfile.TemporaryDirectory(prefix="queue-scale-") as tmp:
        db = Path(tmp) / "bench.db"
        result: dict[str, Any] = {"n": n}
        try:
            if args.store == "sqlite":
                done = subprocess.run([*me, "--insert-worker", str(n), "--db", str(db), *shapes], capture_output=True,
                                      text=True, timeout=args.timeout)
                if done.returncode != 0:
                    return {"n": n, "error": f"insert failed: {done.stderr.strip()[-2000:]}"}
                result.update(json.loads(done.stdout.strip().splitlines()[-1]))
            cmd = [*me, "--worker", str(n), "--db", str(db), "--store", args.store, "--passes", str(args.passes),
                   *shapes]
            if diagnose:
                cmd.append("--diag")
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"n": n, "error": f"ran past --timeout {args.timeout:.0f} s"}
        if done.returncode != 0:
            return {"n": n, "error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
        insert_s = result.get("insert_s")
        result.update(json.loads(done.stdout.strip().splitlines()[-1]))
        if insert_s is not None:
            result["insert_s"] = insert_s
        return result


COLUMNS = (
    ("queued", "n", "{:,.0f}"),
    ("insert s", "insert_s", "{:.1f}"),
    ("load s", "load_s", "{:.1f}"),
    ("RSS after load MiB", "rss_load_mib", "{:,.0f}"),
    ("peak RSS MiB", "hwm_mib", "{:,.0f}"),
    ("B/queued job", "bytes_per_job", "{:,.0f}"),
    ("1st full pass ms", "first_pass_ms", "{:,.0f}"),
    ("full pass ms median/max", "pass", "{}"),
    ("jobs decided per full pass", "pass_decided", "{:,.0f}"),
    ("quiet periodic pass ms", "quiet_pass_ms", "{:,.1f}"),
    ("list 1st page ms", "list_first_ms", "{:.1f}"),
    ("list state+tenant ms", "list_filtered_ms", "{:.1f}"),
    ("... from mid-queue cursor ms", "list_deep_ms", "{:.1f}"),
)


def cells(r: dict[str, Any]) -> list[str]:
    row = []
    for _, key, fmt in COLUMNS:
        if key == "pass":
            ms = r.get("pass_ms")
            v = f"{statistics.median(ms):,.0f} / {max(ms):,.0f}" if ms else None
            if ms and r.get("extrapolated"):
                v = f"{ms[0]:,.0f} (median)"
            row.append(v or "-")
            continue
        v = r.get(key)
        row.append("-" if v is None else fmt.format(v))
    if r.get("extrapolated"):
        row[0] += " (extrapolated)"
    return row


def extrapolate(n: int, done: list[dict[str, Any]]) -> dict[str, Any]:
    """Linear in N through the largest two sizes measured (every figure here grows about linearly)."""
    a, b = done[-2], done[-1]
    out: dict[str, Any] = {"n": n, "extrapolated": True}
    for key in ("insert_s", "load_s", "rss_load_mib", "hwm_mib", "first_pass_ms"):
        if a.get(key) is not None and b.get(key) is not None:
            slope = (b[key] - a[key]) / (b["n"] - a["n"])
            out[key] = b[key] + slope * (n - b["n"])
    out["bytes_per_job"] = b.get("bytes_per_job")
    pa, pb = statistics.median(a["pass_ms"]), statistics.median(b["pass_ms"])
    out["pass_ms"] = [pb + (pb - pa) / (b["n"] - a["n"]) * (n - b["n"])]
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax1 = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in rows if not r.get("extrapolated")]
    extra = [r for r in rows if r.get("extrapolated")]
    for subset, style, tag in ((measured, "-o", ""), (extra, "--x", " (extrapolated)")):
        if not subset:
            continue
        xs = [r["n"] for r in subset]
        ax1.plot(xs, [statistics.median(r["pass_ms"]) for r in subset], style, color="tab:blue",
                 label="full pass, median ms" + tag)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("queued jobs (none can run)")
    ax1.set_ylabel("full scheduling pass (ms)", color="tab:blue")
    ax2 = ax1.twinx()
    for subset, style, tag in ((measured, "-s", ""), (extra, "--+", " (extrapolated)")):
        if subset:
            ax2.plot([r["n"] for r in subset], [r["rss_load_mib"] for r in subset], style, color="tab:red",
                     label="RSS after load, MiB" + tag)
    ax2.axhline(1.5 * 1024, color="tab:red", linestyle=":", linewidth=1, label="1.5 GiB target")
    ax2.set_yscale("log")
    ax2.set_ylabel("broker RSS (MiB)", color="tab:red")
    lines = ax1.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax1.set_title("heliotrope: cost against queue length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parent(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    load0 = os.getloadavg()
    print(f"queue_scale: store {args.store}; {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start")
    rows: list[dict[str, Any]] = []
    for n in sizes:
        t = time.perf_counter()
        r = run_size(n, args)
        wall = time.perf_counter() - t
        if "error" in r:
            print(f"  N={n:,}: not measured ({r['error']}) after {wall:.0f} s")
            done = [x for x in rows if not x.get("extrapolated")]
            if len(done) >= 2:
                rows.append(extrapolate(n, done))
            continue
        print(f"  N={n:,}: {wall:.0f} s; active {r['active']:,}, first pass decided {r['first_pass']['decided']:,} "
              f"placed {r['first_pass']['placed']}, fillers running {r['fillers_running']}, steady passes decided "
              f"{r['pass_decided']:,}; RSS base {r['rss_base_mib']:.0f} MiB, after first pass "
              f"{r['rss_pass_mib']:,.0f} MiB; pages {r['list_pages']}"
              + (f"; database {r['db_mib']:,.0f} MiB" if "db_mib" in r else ""))
        rows.append(r)
    load1 = os.getloadavg()
    print()
    head = [c[0] for c in COLUMNS]
    body = [cells(r) for r in rows]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in body:
        print("| " + " | ".join(row) + " |")
    print(f"\nload average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end")
    if any(r.get("extrapolated") for r in rows):
        print("rows marked (extrapolated) were not measured: linear in N from the largest two sizes measured")
    if args.plot and rows:
        plot(rows, args.plot)
    if args.diagnose:
        print(f"\n--- diagnose at N={args.diagnose:,} (tracemalloc + cProfile on: timings not comparable) ---")
        r = run_size(args.diagnose, args, diagnose=True)
        if "error" in r:
            print(f"failed: {r['error']}")
            return
        print(f"load {r['load_s']:.1f} s (traced), RSS after load {r['rss_load_mib']:,.0f} MiB (with tracing)")
        print("\ntracemalloc after load, top 10 by line:")
        print("\n".join(r["trace_load"]))
        print("\ntracemalloc after the first full pass (fillers placed, every job decided once), top 10 by line:")
        print("\n".join(r["trace_pass"]))
        print(f"\ncProfile of 2 steady full passes ({', '.join(f'{x:,.0f}' for x in r['pass_ms'])} ms with the "
              "profiler on), top 15 by own time:")
        print(r["profile"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    p.add_argument("--passes", type=int, default=5, help="steady full passes timed per size")
    p.add_argument("--plot", help="write a PNG of cycle time and RSS against queue length here")
    p.add_argument("--diagnose", type=int, help="also run tracemalloc and cProfile at this size")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per size (insert and measure)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--insert-worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--diag", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--distinct-shapes", action="store_true",
                   help="give every queued job a shape of its own (no two in one queue group): the worst case")
    args = p.parse_args()
    global DISTINCT_SHAPES
    DISTINCT_SHAPES = args.distinct_shapes
    if args.insert_worker is not None:
        print(json.dumps(insert_sqlite(Path(args.db), args.insert_worker)))
    elif args.worker is not None:
        print(json.dumps(asyncio.run(measure(args))))
    else:
        parent(args)


if __name__ == "__main__":
    main()
