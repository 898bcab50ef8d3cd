"""How long the broker is without a leader after ``kill -9`` of the leading replica, and what that costs.

What runs:

1. A private PostgreSQL (``tests.postgres.PostgresServer``: ``initdb`` into a temporary folder, ``fsync=on``,
   127.0.0.1 only) with a fresh database, and ``--replicas`` (default 2) ``heliotrope serve`` processes on it
   with a small config: two simulated sites of 4 × 8 a100-80gb each, ``broker.cycle_interval_s: 0.2`` and
   ``broker.replicas.lease_s`` from ``--lease-s`` (default 6, the broker's default). The replicas elect a
   leader through the lease row in the store.
2. A steady stream of submissions to every live replica: one thread per replica, ``--rate`` jobs/s each
   (default 20), every job one GPU for ``--job-s`` seconds (default 0.5), all with distinct names. A 201
   is an acknowledged job (its id and the wall-clock time it was sent are kept); a refused connection (the
   killed replica, or one still starting) and any other answer are counted apart.
3. ``--rounds`` times (default 5): wait until exactly one replica leads (``GET /healthz`` →
   ``replica.leading``), let the stream run ``--settle`` seconds (default 3) plus a random part of a renew
   period (uniform in [0, lease_s / 3), seeded by ``--seed``), ``kill -9`` the leader, and measure

   - **takeover**: seconds from the kill until another replica's ``/healthz`` shows ``leading: true``
     (polled every 50 ms on every surviving replica);
   - **first job running**: seconds from the kill until the first job *sent* after the kill (the
     earliest-sent acknowledged one) reaches ``running``, read from the ``at`` of its first ``running`` item
     in ``GET /v1/jobs/{id}/events`` (the broker's wall clock, same machine). It includes the takeover, the
     new leader's reconcile with the sites, the requeue of the jobs the dead leader's simulated sites took
     with them, and the queue built up while no replica led;

   then the killed replica is started again (on a new port) so that ``--replicas`` stay up.
4. At the end the stream stops, the script waits (up to ``--drain-timeout`` s) until every acknowledged job
   has finished, and checks with asyncpg that every acknowledged job is in the store (missing: must be 0),
   and, from ``GET /v1/jobs/{id}/events`` of every acknowledged job, that no (job, attempt) was moved to
   ``dispatching`` more than once (must be 0).

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/failover.py [--replicas 2] [--rounds 5] [--lease-s 6] [--rate 20] [--job-s 0.5]

Needs PostgreSQL's server binaries (``bash scripts/test-deps`` installs them; as root the server runs as
the user ``postgres``). Everything listens on 127.0.0.1 only, and every process it starts is stopped on
exit, also on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


CONFIG_YAML = """\
broker:
  host: 127.0.0.1
  cycle_interval_s: 0.2
  shutdown_grace_s: 0.5
  replicas: {{lease_s: {lease_s}}}
sites:
  - name: fo-east
    region: gcp:us-east4
    grid_zone: US-MIDA-PJM
    timezone: America/New_York
    latitude: 39.04
    longitude: -77.49
    gpus:
      - {{model: a100-80gb, gpus_per_node: 8, nodes: 4}}
    adapter: {{kind: simulated, dispatch_delay_s: 0.01, seed: 1}}
  - name: fo-west
    region: gcp:europe-west3
    grid_zone: DE-LU
    timezone: Europe/Berlin
    latitude: 50.1
    longitude: 8.7
    gpus:
      - {{model: a100-80gb, gpus_per_node: 8, nodes: 4}}
    adapter: {{kind: simulated, dispatch_delay_s: 0.01, seed: 2}}
"""

TENANT = "failover"
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def call(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(HTTP status, JSON body); status 0 when no answer came (refused, reset, timed out)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass
class Replica:
    index: int
    heliotrope: Path
    config: Path
    dsn: str
    log: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> None:
        """Start on a new free port (a restarted replica is a new holder) and wait until /healthz answers."""
        self.port = free_port()
        self.starts += 1
        with self.log.open("ab") as out:
            out.write(f"\n=== start {self.starts} on port {self.port} ===\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [str(self.heliotrope), "serve", "--config", str(self.config), "--db", self.dsn, "--host", HOST,
                 "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.log.parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited with status {self.proc.returncode}:\n"
                                   + self.log.read_text(errors="replace")[-4000:])
            if call(self.url + "/healthz", timeout=1.0)[0] == 200:
                return
            time.sleep(0.05)
        raise RuntimeError(f"replica {self.index} did not serve /healthz within {timeout:.0f} s")

    def leading(self) -> bool | None:
        if not self.alive:
            return None
        status, body = call(self.url + "/healthz", timeout=1.0)
        try:
            return bool(body["replica"]["leading"]) if status == 200 else None
        except (KeyError, TypeError):
            return None


@dataclass
class Ack:
    job_id: str
    sent_wall: float  # time.time() when the POST was sent
    replica: int


@dataclass
class Stream:
    """One submitting thread per replica slot; follows the slot to its new port after a restart."""

    replicas: list[Replica]
    rate: float
    job_s: float
    run_id: str
    acks: list[Ack] = field(default_factory=list)
    unanswered: Counter = field(default_factory=Counter)  # per replica slot: no answer (refused, reset)
    non201: Counter = field(default_factory=Counter)  # (status, reason) from a replica that answered
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for rep in self.replicas:
            t = threading.Thread(target=self._loop, args=(rep,), name=f"submit-{rep.index}", daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _loop(self, rep: Replica) -> None:
        interval = 1.0 / self.rate
        i = 0
        due = time.monotonic()
        while not self.stop.is_set():
            if not rep.alive:  # killed and not restarted yet: nothing to send to
                self.stop.wait(0.05)
                due = time.monotonic()
                continue
            i += 1
            body = {"tenant": TENANT, "name": f"fo-{self.run_id}-{rep.index}-{i}", "gpus": {"count": 1},
                    "duration_s": self.job_s}
            sent = time.time()
            status, answer = call(rep.url + "/v1/jobs", "POST", body, timeout=10.0)
            if status == 201:
                self.acks.append(Ack(answer["id"], sent, rep.index))
            elif status == 0:
                self.unanswered[rep.index] += 1
            else:
                detail = answer.get("error", answer) if isinstance(answer, dict) else answer
                self.non201[(status, str(detail)[:80])] += 1
            due += interval
            pause = due - time.monotonic()
            if pause > 0:
                self.stop.wait(pause)
            elif pause < -1.0:  # fell behind (a slow answer): do not burst to catch up
                due = time.monotonic()


def the_leader(replicas: list[Replica], timeout: float) -> Replica:
    """The one replica that leads, once exactly one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lead = [r for r in replicas if r.leading()]
        if len(lead) == 1:
            return lead[0]
        time.sleep(0.05)
    raise RuntimeError(f"no single leader within {timeout:.0f} s")


def parse_at(at: str) -> float:
    t = datetime.fromisoformat(at)
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def first_running_at(url: str, job_id: str) -> float | None:
    """Wall-clock time of the job's first move to ``running``, from its events; None while it has none."""
    status, events = call(f"{url}/v1/jobs/{job_id}/events", timeout=5.0)
    if status != 200:
        return None
    for ev in events["items"]:
        if ev["state"] == "running":
            return parse_at(ev["at"])
    return None


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"min {min(values):.2f} s, median {statistics.median(values):.2f} s, max {max(values):.2f} s"


async def store_check(dsn: str, ids: list[str]) -> tuple[int, dict[str, int]]:
    """How many of ``ids`` are not in the store, and the states of those that are."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        rows = await conn.fetch("SELECT id, state FROM jobs WHERE id = ANY($1::text[])", ids)
    finally:
        await conn.close()
    found = {r["id"]: r["state"] for r in rows}
    return len(set(ids) - found.keys()), dict(Counter(found.values()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="replicas of heliotrope serve (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="leaders killed, one per round (default %(default)s)")
    p.add_argument("--lease-s", type=float, default=6.0, help="broker.replicas.lease_s (default %(default)s)")
    p.add_argument("--rate", type=float, default=20.0,
                   help="submissions/s sent to each live replica (default %(default)s)")
    p.add_argument("--job-s", type=float, default=0.5, help="duration of each job (default %(default)s)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds of steady stream before each kill (default %(default)s)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the random delay before each kill (default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=180.0,
                   help="seconds to wait at the end for every acknowledged job to finish (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (configs, replica logs)")
    args = p.parse_args()
    if args.replicas < 2:
        p.error("--replicas must be at least 2: someone has to take over")

    heliotrope = ROOT / ".venv" / "bin" / "heliotrope"
    if not heliotrope.exists():
        heliotrope = Path(shutil.which("heliotrope") or "")
        if not heliotrope.name:
            print("heliotrope is not installed; run: make install", file=sys.stderr)
            return 1
    from tests.postgres import PostgresMissing, PostgresServer

    # SIGTERM to this script unwinds through the finally below, so no server is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="heliotrope-failover-"))
    run_id = uuid.uuid4().hex[:8]
    pg: PostgresServer | None = None
    replicas: list[Replica] = []
    stream: Stream | None = None
    load_before = os.getloadavg()
    try:
        try:
            pg = PostgresServer()
        except PostgresMissing as e:
            print(str(e), file=sys.stderr)
            return 1
        pg.start()
        dsn = asyncio.run(pg.create_database())
        config = tmp / "failover.yaml"
        config.write_text(CONFIG_YAML.format(lease_s=args.lease_s))
        for i in range(args.replicas):
            rep = Replica(i, heliotrope, config, dsn, tmp / f"replica-{i}.log")
            rep.start()
            replicas.append(rep)
        elect_timeout = max(30.0, 4 * args.lease_s)
        the_leader(replicas, elect_timeout)

        rng = random.Random(args.seed)
        stream = Stream(replicas, args.rate, args.job_s, run_id)
        stream.start()
        rounds: list[dict[str, Any]] = []
        for n in range(1, args.rounds + 1):
            leader = the_leader(replicas, elect_timeout)
            # The random part spreads the kill over the leader's renew period: without it, each round's kill
            # would fall at the same phase of the new leader's renewals (one round's takeover starts the next
            # round's clock), and the takeover time would barely vary.
            time.sleep(args.settle + rng.uniform(0, args.lease_s / 3))
            acks_before = len(stream.acks)
            unanswered_before = sum(stream.unanswered.values())
            others = [r for r in replicas if r is not leader]
            assert leader.proc is not None
            kill_wall, kill_mono = time.time(), time.monotonic()
            leader.proc.send_signal(signal.SIGKILL)
            leader.proc.wait(10)

            # takeover: poll every surviving replica's /healthz every 50 ms
            new_leader: Replica | None = None
            takeover: float | None = None
            while time.monotonic() - kill_mono < 10 * args.lease_s + 30:
                tick = time.monotonic()
                for r in others:
                    if r.leading():
                        new_leader, takeover = r, time.monotonic() - kill_mono
                        break
                if new_leader is not None:
                    break
                time.sleep(max(0.0, 0.05 - (time.monotonic() - tick)))
            if new_leader is None:
                raise RuntimeError(f"round {n}: no replica took over within {10 * args.lease_s + 30:.0f} s")

            # the first job sent after the kill, and when it ran
            deadline = time.monotonic() + 30
            after = []
            while not after and time.monotonic() < deadline:
                after = [a for a in list(stream.acks) if a.sent_wall >= kill_wall]
                time.sleep(0.05)
            if not after:
                raise RuntimeError(f"round {n}: no submission was acknowledged after the kill")
            first = min(after, key=lambda a: a.sent_wall)
            ran_at: float | None = None
            deadline = time.monotonic() + 60 + 10 * args.lease_s
            while ran_at is None and time.monotonic() < deadline:
                ran_at = first_running_at(new_leader.url, first.job_id)
                if ran_at is None:
                    time.sleep(0.05)
            first_running = None if ran_at is None else ran_at - kill_wall

            leader.start()  # restart the killed replica so that --replicas stay up
            acks_in_round = len(stream.acks) - acks_before
            unanswered_in_round = sum(stream.unanswered.values()) - unanswered_before
            rounds.append({
                "round": n, "killed": leader.index, "new": new_leader.index, "takeover": takeover,
                "first_running": first_running, "first_sent_after": first.sent_wall - kill_wall,
                "first_via": first.replica, "acks": acks_in_round, "unanswered": unanswered_in_round,
            })
            fr = "not seen" if first_running is None else f"{first_running:.2f} s"
            print(f"round {n}: killed replica {leader.index}, replica {new_leader.index} led after {takeover:.2f} s; "
                  f"first job sent after the kill running after {fr}", flush=True)

        time.sleep(args.settle)
        stream.join()

        # wait until every acknowledged job has finished, then check the store and the events
        ids = [a.job_id for a in stream.acks]
        t_drain = time.monotonic()
        while True:
            missing, states = asyncio.run(store_check(dsn, ids))
            unfinished = sum(v for k, v in states.items() if k not in ("succeeded", "failed", "cancelled"))
            if unfinished == 0 or time.monotonic() - t_drain > args.drain_timeout:
                break
            time.sleep(1.0)
        drain_s = time.monotonic() - t_drain
        live = next(r for r in replicas if r.alive)
        dispatching: Counter[tuple[str, int]] = Counter()
        event_errors: list[tuple[str, int]] = []

        def events_of(job_id: str) -> None:
            status, body = call(f"{live.url}/v1/jobs/{job_id}/events", timeout=10.0)
            if status != 200:
                event_errors.append((job_id, status))
                return
            for ev in body["items"]:
                if ev["state"] == "dispatching":
                    dispatching[(job_id, ev["attempt"])] += 1

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(events_of, ids))
        twice = {k: v for k, v in dispatching.items() if v > 1}
        requeued = sum(1 for (_, attempt) in dispatching if attempt > 1)
        load_after = os.getloadavg()

        # --- report ---
        print()
        print(f"heliotrope failover benchmark: {args.replicas} replicas on one PostgreSQL, lease {args.lease_s:g} s, "
              f"{args.rounds} rounds, {args.rate:g} submissions/s per replica of {args.job_s:g} s jobs")
        print(f"  {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; load average before "
              f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
              f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
        print()
        print(f"  {'round':>5}  {'killed':>6}  {'new leader':>10}  {'takeover':>9}  {'first job running':>17}"
              f"  {'acked kill→restart':>18}  {'no answer kill→restart':>22}")
        for r in rounds:
            fr = "-" if r["first_running"] is None else f"{r['first_running']:.2f} s"
            print(f"  {r['round']:>5}  {r['killed']:>6}  {r['new']:>10}  {r['takeover']:>7.2f} s  {fr:>17}"
                  f"  {r['acks']:>18}  {r['unanswered']:>22}")
        takeovers = [r["takeover"] for r in rounds]
        firsts = [r["first_running"] for r in rounds if r["first_running"] is not None]
        print()
        print("=" * 78)
        print(f"takeover after kill -9 (lease {args.lease_s:g} s): {summary(takeovers)}")
        print(f"first job sent after the kill running: {summary(firsts)}"
              + (f" ({len(rounds) - len(firsts)} rounds: not seen)" if len(firsts) < len(rounds) else ""))
        print(f"acknowledged submissions (201): {len(ids)}; sent with no answer (killed or starting replica): "
              f"{sum(stream.unanswered.values())}; other answers: {sum(stream.non201.values())}")
        for (status, detail), count in stream.non201.most_common(5):
            print(f"  {count} × {status}: {detail}")
        print(f"acknowledged jobs missing from the store: {missing}")
        print(f"  their states after {drain_s:.1f} s of draining: {states}")
        print(f"(job, attempt) pairs moved to dispatching more than once: {len(twice)}"
              f"  ({len(dispatching)} pairs dispatched, {requeued} of them a retry after a leader died)")
        if event_errors:
            print(f"  WARNING: the events of {len(event_errors)} jobs could not be read: {event_errors[:3]}")
        for (job_id, attempt), count in list(twice.items())[:5]:
            print(f"  {job_id} attempt {attempt}: {count} times")
        print("=" * 78)
        return 0
    finally:
        if stream is not None:
            stream.join()
        for rep in replicas:
            try:
                stop(rep.proc, timeout=15.0)
            except Exception:  # noqa: BLE001 - best effort: never leave a process behind
                if rep.proc is not None:
                    rep.proc.kill()
        if pg is not None:
            pg.cleanup()
        if args.keep:
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
