"""Durable job submissions per second through the HTTP API (POST /v1/jobs), driven by wrk.

What runs:

1. A bare aiohttp server (one POST handler: read the body, answer 201 with a small JSON body) in its own
   process, driven by the same wrk command: the framework's ceiling on this machine.
2. The real broker, ``heliotrope serve``, in its own process, on a fresh SQLite database (WAL,
   ``synchronous=FULL``, group commit) with two small simulated sites, so that almost every job stays
   queued and the scheduling cycle has real work while the submissions arrive. wrk sends distinct jobs
   (``job-<run>-<thread>-<counter>``) and counts the 201 answers; anything else is reported.
3. Durability: the broker is stopped with SIGTERM, the database is opened with ``sqlite3`` and the jobs of
   tenant ``bench`` are counted and printed next to the 201s wrk counted.

With ``--postgres`` step 2 runs the broker on PostgreSQL instead: a private server started for the run
(``tests.postgres.PostgresServer``: ``initdb`` into a temporary folder, ``fsync=on``) and a fresh database on
it, or, with ``--db-url URL``, an existing database. The broker is then a replica: the load starts once its
``GET /healthz`` shows ``replica.leading: true``. Step 3 counts this run's jobs (tenant ``bench``, names
``job-<run>-...``) with asyncpg.

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/submit_throughput.py [--duration 10] [--connections 64] [--threads 1]
    .venv/bin/python bench/submit_throughput.py --postgres [--skip-reference]
    .venv/bin/python bench/submit_throughput.py --db-url postgresql://user@host:5432/db

Needs ``wrk`` on PATH (``bash scripts/bench-deps`` installs it). Everything listens on 127.0.0.1 only, and
every process it starts is stopped on exit, also on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

# Two small simulated sites: 8 + 4 GPUs, so the first dozen jobs run (for an hour) and every later one
# stays queued and is decided again by each scheduling cycle.
CONFIG_YAML = """\
broker:
  host: 127.0.0.1
  cycle_interval_s: 1.0
sites:
  - name: bench-east
    region: gcp:us-east4
    grid_zone: US-MIDA-PJM
    timezone: America/New_York
    latitude: 39.04
    longitude: -77.49
    gpus:
      - {model: a100-80gb, gpus_per_node: 8, nodes: 1}
    usd_per_gpu_hour: {a100-80gb: 5.708}
    adapter: {kind: simulated, dispatch_delay_s: 0.2, seed: 1}
  - name: bench-west
    region: gcp:us-west1
    grid_zone: US-CAL-CISO
    timezone: America/Los_Angeles
    latitude: 45.6
    longitude: -121.2
    gpus:
      - {model: l4, gpus_per_node: 4, nodes: 1}
    usd_per_gpu_hour: {l4: 0.85}
    adapter: {kind: simulated, dispatch_delay_s: 0.2, seed: 2}
"""

# The reference: the same framework, no validation, no store, no scheduling.
BARE_SERVER = """\
import sys
from aiohttp import web

async def submit(request):
    await request.read()
    return web.json_response({"id": "0123456789abcdefgh", "state": "queued"}, status=201)

app = web.Application()
app.router.add_post("/v1/jobs", submit)
app.router.add_get("/healthz", lambda request: web.json_response({"status": "ok"}))
print("bare aiohttp serving", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

# wrk script: distinct job names per request (run id, thread id, counter); counts 201s and everything
# else per thread, and prints one machine-readable line from done().
WRK_LUA = """\
local threads = {}
local next_tid = 0

function setup(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
  table.insert(threads, thread)
end

function init(args)
  run_id = args[1] or "run"
  counter = 0
  ok201 = 0
  non201 = 0
  statuses = ""
  seen = {}
end

function request()
  counter = counter + 1
  local body = string.format(
    '{"tenant": "bench", "name": "job-%s-%d-%d", "gpus": {"count": 1}, "duration_s": 3600}',
    run_id, tid, counter)
  return wrk.format("POST", "/v1/jobs", {["Content-Type"] = "application/json"}, body)
end

function response(status, headers, body)
  if status == 201 then
    ok201 = ok201 + 1
  else
    non201 = non201 + 1
    if not seen[status] then
      seen[status] = true
      statuses = statuses .. tostring(status) .. " "
    end
  end
end

function done(summary, latency, requests)
  local ok, bad, codes = 0, 0, ""
  for _, t in ipairs(threads) do
    ok = ok + t:get("ok201")
    bad = bad + t:get("non201")
    codes = codes .. t:get("statuses")
  end
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d ok201=%d non201=%d statuses=[%s] p50_us=%d p90_us=%d p99_us=%d " ..
    "max_us=%d mean_us=%.1f connect_err=%d read_err=%d write_err=%d timeout_err=%d\\n",
    summary.requests, summary.duration, ok, bad, codes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean,
    e.connect, e.read, e.write, e.timeout))
end
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_ready(proc: subprocess.Popen, log: Path, marker: str, url: str, timeout: float = 60.0) -> None:
    """Wait for ``marker`` on the process's stdout (captured in ``log``) and for ``url`` to answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was ready:\n"
                               + log.read_text(errors="replace")[-4000:])
        if marker in log.read_text(errors="replace") and http_get(url) is not None:
            return
        time.sleep(0.05)
    raise RuntimeError(f"server not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen | None, timeout: float = 30.0) -> int | None:
    """SIGTERM, wait, then SIGKILL: return the exit status (None when it had to be killed)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_wrk(url: str, lua: Path, args: argparse.Namespace, run_id: str) -> dict:
    cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{args.duration}s", "--latency",
           "--timeout", "10s", "-s", str(lua), url, "--", run_id]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=args.duration + 120)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()}")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary line:\n{out.stdout}\n{out.stderr}")
    fields: dict = {"cmd": " ".join(cmd), "raw": out.stdout}
    for part in line[len("BENCH "):].split(" "):
        if "=" in part:
            key, value = part.split("=", 1)
            fields[key] = value
    if "statuses" in fields:  # may hold spaces: re-read it from the line
        fields["statuses"] = line.split("statuses=[", 1)[1].split("]", 1)[0].strip()
    for key in ("requests", "duration_us", "ok201", "non201", "p50_us", "p90_us", "p99_us", "max_us",
                "connect_err", "read_err", "write_err", "timeout_err"):
        fields[key] = int(fields[key])
    fields["mean_us"] = float(fields["mean_us"])
    seconds = fields["duration_us"] / 1e6
    fields["rps"] = fields["requests"] / seconds
    fields["ok_per_s"] = fields["ok201"] / seconds
    return fields


def wait_leading(proc: subprocess.Popen, url: str, timeout: float) -> float:
    """Poll ``url`` (``/healthz``) every 50 ms until ``replica.leading`` is true; the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with status {proc.returncode} before it led")
        h = http_get(url)
        if h is not None and (h.get("replica") or {}).get("leading"):
            return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"the broker did not lead within {timeout:.0f} s (does another replica hold the lease?)")


def count_postgres(dsn: str, run_id: str) -> tuple[int, int, dict]:
    """This run's jobs in PostgreSQL: how many, how many distinct names, how many per state."""
    import asyncpg

    async def go() -> tuple[int, int, dict]:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            where = "tenant = 'bench' AND (doc::jsonb #>> '{spec,name}') LIKE $1"
            pattern = f"job-{run_id}-%"
            total = await conn.fetchval(f"SELECT COUNT(*) FROM jobs WHERE {where}", pattern)
            names = await conn.fetchval(
                f"SELECT COUNT(DISTINCT doc::jsonb #>> '{{spec,name}}') FROM jobs WHERE {where}", pattern)
            rows = await conn.fetch(f"SELECT state, COUNT(*) AS n FROM jobs WHERE {where} GROUP BY state", pattern)
            return total, names, {r["state"]: r["n"] for r in rows}
        finally:
            await conn.close()

    return asyncio.run(go())


def fmt_ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def print_run(title: str, r: dict) -> None:
    errors = r["connect_err"] + r["read_err"] + r["write_err"] + r["timeout_err"]
    print(f"  {title}")
    print(f"    {r['requests']} responses in {r['duration_us'] / 1e6:.2f} s = {r['rps']:.0f} req/s"
          f"  (201: {r['ok201']} = {r['ok_per_s']:.0f}/s, non-201: {r['non201']}"
          + (f" [{r['statuses']}]" if r["non201"] else "") + ")")
    print(f"    latency p50 {fmt_ms(r['p50_us'])}, p90 {fmt_ms(r['p90_us'])}, p99 {fmt_ms(r['p99_us'])},"
          f" max {fmt_ms(r['max_us'])}, mean {fmt_ms(r['mean_us'])}")
    if errors:
        print(f"    socket errors: connect {r['connect_err']}, read {r['read_err']}, write {r['write_err']},"
              f" timeout {r['timeout_err']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=10, help="seconds of load per server (default %(default)s)")
    p.add_argument("--connections", type=int, default=64, help="wrk connections (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="wrk threads (default %(default)s: a 2-core box, the server needs the other core)")
    p.add_argument("--skip-reference", action="store_true", help="do not measure the bare aiohttp server")
    p.add_argument("--py-spy", metavar="FILE",
                   help="also record the broker with py-spy during the load (speedscope JSON to FILE)")
    p.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="seconds the broker gets to exit after SIGTERM before SIGKILL (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (db, logs)")
    p.add_argument("--postgres", action="store_true",
                   help="run the broker on a private PostgreSQL started for the run (initdb/pg_ctl) instead of SQLite")
    p.add_argument("--db-url", metavar="URL",
                   help="run the broker on this existing PostgreSQL database (postgresql://...) instead of SQLite")
    args = p.parse_args()
    if args.postgres and args.db_url:
        p.error("--postgres and --db-url exclude each other")

    if shutil.which("wrk") is None:
        print("wrk is not installed; run: bash scripts/bench-deps", file=sys.stderr)
        return 1
    heliotrope = ROOT / ".venv" / "bin" / "heliotrope"
    if not heliotrope.exists():
        heliotrope = Path(shutil.which("heliotrope") or "")
        if not heliotrope.name:
            print("heliotrope is not installed; run: make install", file=sys.stderr)
            return 1

    # SIGTERM to this script unwinds through the finally below, so no server is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="heliotrope-bench-"))
    procs: list[subprocess.Popen] = []
    run_id = uuid.uuid4().hex[:8]
    bare: dict | None = None
    pg = None  # tests.postgres.PostgresServer, with --postgres
    try:
        lua = tmp / "submit.lua"
        lua.write_text(WRK_LUA)

        # 1. reference: bare aiohttp
        if not args.skip_reference:
            port = free_port()
            script = tmp / "bare_server.py"
            script.write_text(BARE_SERVER)
            log = tmp / "bare.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen([sys.executable, str(script), str(port)], stdout=fh,
                                        stderr=subprocess.STDOUT, cwd=tmp)
            procs.append(proc)
            wait_ready(proc, log, "bare aiohttp serving", f"http://{HOST}:{port}/healthz")
            bare = run_wrk(f"http://{HOST}:{port}/v1/jobs", lua, args, run_id + "ref")
            stop(proc)

        # 2. the broker
        config = tmp / "bench.yaml"
        config.write_text(CONFIG_YAML)
        db: Path | str = tmp / "bench.db"
        store_name = "SQLite WAL synchronous=FULL, group commit"
        if args.postgres:
            sys.path.insert(0, str(ROOT))
            from tests.postgres import PostgresServer

            pg = PostgresServer()
            pg.start()
            db = asyncio.run(pg.create_database())
            store_name = "PostgreSQL fsync=on, private server on 127.0.0.1"
        elif args.db_url:
            db = args.db_url
            store_name = "PostgreSQL at --db-url"
        port = free_port()
        log = tmp / "broker.out"
        errlog = tmp / "broker.err"
        with log.open("wb") as out, errlog.open("wb") as err:
            broker = subprocess.Popen(
                [str(heliotrope), "serve", "--config", str(config), "--db", str(db), "--host", HOST,
                 "--port", str(port)],
                stdout=out, stderr=err, cwd=tmp,
            )
        procs.append(broker)
        base = f"http://{HOST}:{port}"
        wait_ready(broker, log, "heliotrope serving on", f"{base}/healthz")
        led_after: float | None = None
        if isinstance(db, str):  # PostgreSQL: a replica; drive load only once it leads
            led_after = wait_leading(broker, f"{base}/healthz", timeout=60.0)
        spy: subprocess.Popen | None = None
        if args.py_spy:
            spy_bin = Path(sys.executable).parent / "py-spy"
            if not spy_bin.exists():
                raise RuntimeError(f"--py-spy needs py-spy: {Path(sys.executable).parent}/pip install py-spy")
            spy = subprocess.Popen([str(spy_bin), "record", "-p", str(broker.pid), "-d", str(args.duration),
                                    "-r", "200", "-f", "speedscope", "-o", str(Path(args.py_spy).resolve())],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(spy)
        # Once a second during the load: active jobs and cycles, from GET /healthz (one light request).
        series: list[tuple[float, int, int]] = []
        done = threading.Event()

        def sample() -> None:
            start = time.monotonic()
            while not done.wait(1.0):
                h = http_get(f"{base}/healthz", timeout=5.0)
                if h is not None:
                    series.append((time.monotonic() - start, h["active_jobs"], h["cycles"]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = run_wrk(f"{base}/v1/jobs", lua, args, run_id)
        finally:
            done.set()
            sampler.join()
        after = http_get(f"{base}/healthz", timeout=30.0) or {}
        if spy is not None:
            spy.wait(60)

        # 3. durability: stop, then count what is on disk
        t_stop = time.monotonic()
        status = stop(broker, timeout=args.shutdown_timeout)
        stop_s = time.monotonic() - t_stop
        if isinstance(db, str):
            on_disk, names, states = count_postgres(db, run_id)
        else:
            conn = sqlite3.connect(db)
            try:
                on_disk = conn.execute("SELECT COUNT(*) FROM jobs WHERE tenant = 'bench'").fetchone()[0]
                names = conn.execute(
                    "SELECT COUNT(DISTINCT json_extract(doc, '$.spec.name')) FROM jobs WHERE tenant = 'bench'"
                ).fetchone()[0]
                states = dict(conn.execute(
                    "SELECT state, COUNT(*) FROM jobs WHERE tenant = 'bench' GROUP BY state").fetchall())
            finally:
                conn.close()
        err_lines = [ln for ln in errlog.read_text(errors="replace").splitlines()
                     if " ERROR " in ln or "Traceback" in ln]

        # --- report ---
        print()
        print(f"heliotrope submit benchmark: wrk -t{args.threads} -c{args.connections} -d{args.duration}s, "
              f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
        print(f"  command: {result['cmd']}")
        print(f"  store: {store_name}")
        if led_after is not None:
            print(f"  the broker (a replica) led {led_after:.2f} s after it served /healthz; load started then")
        if bare is not None:
            print_run("bare aiohttp POST (reference)", bare)
        print_run("heliotrope POST /v1/jobs", result)
        print(f"    broker after the load: {after.get('active_jobs', '?')} active jobs, "
              f"{after.get('cycles', '?')} scheduling cycles since start")
        if len(series) > 1:
            rates = [f"{b[1] - a[1]:.0f}" for a, b in zip(series, series[1:])]
            cycles = [f"{b[2] - a[2]}" for a, b in zip(series, series[1:])]
            print(f"    per second during the load (GET /healthz once a second): new jobs {', '.join(rates)}")
            print(f"      scheduling cycles {', '.join(cycles)}; queue at the end {series[-1][1]} active jobs")
        if status is None:
            print(f"    broker did NOT exit within {args.shutdown_timeout:g} s of SIGTERM: killed with SIGKILL "
                  f"(the count below is then also a crash-durability check)")
        else:
            print(f"    broker exited with status {status} {stop_s:.2f} s after SIGTERM")
        if err_lines:
            print(f"    {len(err_lines)} error lines in the broker's log")
        in_flight = on_disk - result["ok201"]
        print()
        print("=" * 78)
        print(f"durable submissions/s (heliotrope, {store_name}): {result['ok_per_s']:.0f}")
        print(f"  latency p50 {fmt_ms(result['p50_us'])}, p99 {fmt_ms(result['p99_us'])}; "
              f"non-201 responses: {result['non201']}")
        if bare is not None:
            print(f"bare aiohttp POST reference: {bare['rps']:.0f} req/s "
                  f"(p50 {fmt_ms(bare['p50_us'])}, p99 {fmt_ms(bare['p99_us'])}); "
                  f"heliotrope reaches {100 * result['ok_per_s'] / bare['rps']:.0f}% of it")
        print(f"201s counted by wrk: {result['ok201']}, jobs on disk after shutdown: {on_disk} "
              f"({names} distinct names; states {states})")
        if in_flight > args.connections:
            print(f"  WARNING: {in_flight} more jobs on disk than 201s counted, more than the {args.connections} "
                  f"requests that can be in flight")
        elif in_flight > 0:
            print(f"  {in_flight} more on disk than 201s counted: requests still in flight when wrk stopped "
                  f"(at most {args.connections}, one per connection) were committed, but wrk did not wait "
                  f"for their answers")
        elif in_flight < 0:
            print(f"  WARNING: {-in_flight} jobs answered 201 are NOT on disk")
        print("=" * 78)
        if err_lines:
            print("broker log errors (first 5):")
            for ln in err_lines[:5]:
                print("  " + ln)
        return 0
    finally:
        for proc in reversed(procs):
            try:
                stop(proc, timeout=15.0)
            except Exception:  # noqa: BLE001 - best effort: never leave a process behind
                proc.kill()
        if pg is not None:
            if args.keep:
                pg.stop()
                print(f"(kept the PostgreSQL data folder {pg.workdir})")
            else:
                pg.cleanup()
        if args.keep:
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
