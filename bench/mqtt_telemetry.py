"""Telemetry of many site agents over MQTT, ingested by the broker: is it under 1 s stale?

The acceptance: "1,000 simulated agents, each on its own MQTT connection, sending telemetry at 1 message/s,
are ingested with under 1 s of staleness".

What runs (every process on this machine, everything on 127.0.0.1):

1. **Mosquitto**, started by this script (``tests.mosquitto.Mosquitto``: persistence on, autosave every
   second, a free port), or an existing one with ``--host``/``--port``. The soft limit on open files is raised
   to the hard limit first (Mosquitto needs one descriptor per connection; the agents' processes one each).
2. **The broker side**, in its own process (multiprocessing "spawn", so the publishers do not share its event
   loop): one real ``adapters.remote.MqttHub`` and one real ``RemoteSite`` per agent, built from a
   ``SiteSpec`` with ``adapter: {kind: mqtt, lease_s: 15}`` on a ``SystemClock`` and started as the broker
   starts them (``await site.start()`` attaches the site to the hub). Each site is a thin subclass that only
   notes, after ``RemoteSite.receive`` has taken a live heartbeat, the wall time and the heartbeat's
   ``sent_at``. So the broker does all its real work: decode and validate every payload, update the site,
   answer each heartbeat with a lease grant (QoS 0), run every site's lease watcher.
3. **The agents**: ``--agents`` (default 1000) publishers spread over ``--procs`` (default 4) processes, each
   on its OWN ``aiomqtt.Client`` connection (client id ``heliotrope-agent-SITE``, persistent session, a last
   will, as the real agent connects). Once all are connected, each publishes an
   ``adapters.mqtt_protocol.Heartbeat`` (a realistic ``SiteState``: capacity, telemetry, running jobs, the
   attempts it holds; ``seq`` increasing; ``sent_at`` = now) retained, QoS 1, on its state topic every
   ``--interval`` s (default 1.0), starting at a random phase, for ``--seconds`` (default 60). They answer
   nothing (they do not subscribe; the lease grants go to topics no one listens to). They run at niceness
   ``--agents-nice`` (default 10): the load generator stands for a thousand other machines, so on a small
   machine it yields the CPU to the broker process and Mosquitto rather than starving them (0: it competes).

Figures (all clocks are this machine's wall clock, so the differences are exact):

- (a) **ingest delay** per heartbeat: the time the broker had applied it − its ``sent_at``; p50/p99/max over
  every heartbeat sent in the window.
- (b) **state age**: every 0.25 s, for every site, now − ``sent_at`` of the state the broker holds for it
  (the latest heartbeat it took); p50/p99/max over all samples, from one interval and one sampling step
  after the start. With a 1 s interval this is about 0.5 s on average and below interval + delay at worst:
  it is the interval, not the delay, that dominates it.
- heartbeats ingested per second, malformed payloads (should be 0), heartbeats lost (published and acknowledged
  by Mosquitto but never taken by the broker), sites never heard, the peak of the hub's lease grants waiting
  for Mosquitto's PUBACK, CPU of the broker process (and the share of the time it was runnable but waiting
  for a CPU, from /proc: on a shared machine this says whether it was starved), of Mosquitto and of the
  agents' processes (% of one core), and the agents' schedule slip (how late a heartbeat left after its due
  time: a loaded machine shows up here, and in (b), not in (a)). The 1-minute load average at the start and
  the end says how busy the machine was.

**Verdict** "staleness under 1 s": yes when the p99 of (a) is below 1 s AND the p99 of (b) minus the send
interval is below 1 s (at the 99th percentile, the state a site shows is less than 1 s older than the
agent's sending rate makes unavoidable), and every site was heard.

Prints figures; asserts nothing. Usage::

    .venv/bin/python bench/mqtt_telemetry.py [--agents 1000] [--procs 4] [--interval 1.0] [--seconds 60]
                                             [--host H --port P] [--seed 1] [--agents-nice 10]
                                             [--mosquitto-conf 'set_tcp_nodelay true' ...]

A smoke run: ``--agents 50 --seconds 5``. Needs ``mosquitto`` (``bash scripts/test-deps`` installs it) unless
``--host``/``--port`` name a running MQTT broker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import random
import sys
import time
import uuid
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiomqtt  # noqa: E402

from adapters import mqtt_protocol as proto  # noqa: E402
from adapters.remote import MqttHub, RemoteSite  # noqa: E402
from broker.clock import SystemClock  # noqa: E402
from broker.models import Health, ModelCapacity, MqttSettings, SiteSpec, SiteState, Telemetry  # noqa: E402

SAMPLE_EVERY_S = 0.25
LEASE_S = 15.0
GRACE_S = 3.0  # the broker keeps listening this long after the window for heartbeats still on their way


def site_names(n: int) -> list[str]:
    return [f"agent-{i:04d}" for i in range(n)]


def site_spec(name: str) -> SiteSpec:
    return SiteSpec(name=name, region="gcp:us-east1", grid_zone="US-MIDA-PJM", timezone="America/New_York",
                    latitude=33.2, longitude=-80.0, gpus=[{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}],
                    usd_per_gpu_hour={"a100-80gb": 5.0}, adapter={"kind": "mqtt", "lease_s": LEASE_S})


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return float("nan"), float("nan"), float("nan")
    s = sorted(values)
    return s[len(s) // 2], s[min(len(s) - 1, int(0.99 * len(s)))], s[-1]


def run_queue_wait_s() -> float | None:
    """How long this process's main thread has waited for a CPU while runnable (/proc/self/schedstat, Linux)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process from /proc (Linux), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# --- the broker side ---------------------------------------------------------------------------------------


class MeasuredSite(RemoteSite):
    """A real RemoteSite that notes when it took each live heartbeat and when the agent sent it."""

    def __init__(self, spec: SiteSpec, clock: SystemClock, hub: MqttHub, delays: list[tuple[float, float]]) -> None:
        super().__init__(spec, clock, hub)
        self.delays = delays  # shared: (sent_at, taken - sent_at) of every live heartbeat
        self.held_sent: float | None = None  # sent_at of the state the site holds now
        self.retained_seen = 0

    def receive(self, msg: Any, retained: bool = False) -> None:
        super().receive(msg, retained)
        if isinstance(msg, proto.Heartbeat):
            if retained:
                self.retained_seen += 1
                return
            taken = time.time()
            sent = msg.sent_at.timestamp()
            self.held_sent = sent
            self.delays.append((sent, taken - sent))


def broker_main(settings: dict[str, Any], names: list[str], conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format="broker: %(levelname)s %(name)s: %(message)s")
    # aiomqtt warns on every publish while more than 10 are unacknowledged; the run reports their peak instead.
    logging.getLogger("mqtt").setLevel(logging.ERROR)
    asyncio.run(_broker(MqttSettings(**settings), names, conn))


async def _broker(settings: MqttSettings, names: list[str], conn: Connection) -> None:
    hub = MqttHub(settings)
    clock = SystemClock()
    delays: list[tuple[float, float]] = []
    sites = [MeasuredSite(site_spec(n), clock, hub, delays) for n in names]
    await hub.start()
    for site in sites:
        await site.start()
    connected = await hub.wait_connected(20)
    conn.send(("ready", connected))
    if not connected:
        await hub.close()
        return
    _, t0, t_end, interval = await asyncio.to_thread(conn.recv)

    await asyncio.sleep(max(0.0, t0 - time.time()))
    cpu0, wall0, received0, wait0 = time.process_time(), time.time(), hub.received, run_queue_wait_s()
    ages: list[float] = []
    lags: list[float] = []
    missing = pending = 0
    due = t0 + interval + SAMPLE_EVERY_S  # every site has sent once by then
    while due < t_end:
        await asyncio.sleep(max(0.0, due - time.time()))
        now = time.time()
        lags.append(now - due)
        client = hub._client  # the hub's lease grants waiting for Mosquitto's PUBACK (aiomqtt internals)
        pending = max(pending, len(getattr(client, "_pending_publishes", ()) or ()))
        for site in sites:
            if site.held_sent is None:
                missing += 1
            else:
                ages.append(now - site.held_sent)
        due += SAMPLE_EVERY_S
    await asyncio.sleep(max(0.0, t_end - time.time()))
    cpu1, wall1, received1, wait1 = time.process_time(), time.time(), hub.received, run_queue_wait_s()
    await asyncio.sleep(GRACE_S)

    in_window = [d for sent, d in delays if sent >= t0]  # the agents send their last ones just before t_end
    no_lease = 0
    for site in sites:
        try:
            state = await site.snapshot()
            if state.health == Health.UNHEALTHY:
                no_lease += 1
        except Exception:
            no_lease += 1
    result = {
        "delays": in_window, "ages": ages, "sampler_lag": lags, "missing_samples": missing,
        "received_in_window": received1 - received0, "window_s": wall1 - wall0,
        "cpu_pct": 100 * (cpu1 - cpu0) / (wall1 - wall0),
        "wait_pct": None if wait0 is None or wait1 is None else 100 * (wait1 - wait0) / (wall1 - wall0),
        "malformed": dict(hub.malformed),
        "never_heard": sum(1 for s in sites if s.held_sent is None), "no_lease": no_lease,
        "retained_seen": sum(s.retained_seen for s in sites), "connects": hub.connects,
        "pending_peak": pending,
    }
    for site in sites:
        await site.close()
    await hub.close()
    conn.send(("result", result))


# --- the agents --------------------------------------------------------------------------------------------


def site_state(name: str, rng: random.Random) -> tuple[SiteState, list[proto.AttemptReport]]:
    used = rng.randint(0, 8)
    jobs = min(used, rng.randint(0, 3))
    state = SiteState(
        site=name, health=Health.HEALTHY, running_jobs=jobs,
        capacity=[ModelCapacity(model="a100-80gb", total_gpus=8, free_gpus=8 - used, used_gpus=used,
                                memory_gib_per_gpu=80.0)],
        telemetry=Telemetry(gpu_utilisation_pct=round(rng.uniform(0, 100), 1),
                            memory_used_gib=round(used * rng.uniform(10, 80), 1), memory_total_gib=640.0,
                            temperature_c_max=round(rng.uniform(35, 85), 1), power_w=round(rng.uniform(400, 5600), 0),
                            queue_depth=rng.randint(0, 20)),
    )
    attempts = [proto.AttemptReport(job_id=f"job-{name}-{k}", attempt=1, status="running") for k in range(jobs)]
    return state, attempts


def agents_main(settings: dict[str, Any], names: list[str], conn: Connection, interval: float, seed: int,
                nice: int) -> None:
    if nice:
        os.nice(nice)  # the load generator stands for other machines: it yields the CPU to the broker and Mosquitto
    logging.basicConfig(level=logging.WARNING, format="agents: %(levelname)s %(name)s: %(message)s")
    asyncio.run(_agents(MqttSettings(**settings), names, conn, interval, seed))


async def _agents(settings: MqttSettings, names: list[str], conn: Connection, interval: float, seed: int) -> None:
    rng = random.Random(seed)
    boot = uuid.uuid4().hex[:12]
    stats = {"published": 0, "errors": 0, "slip": [], "puback": []}
    gate = asyncio.Semaphore(32)  # connects at once

    async def connect(stack: contextlib.AsyncExitStack, name: str) -> aiomqtt.Client:
        will = aiomqtt.Will(proto.topic(name, "status"), proto.encode(proto.Status(
            site=name, boot=boot, online=False, at=datetime.now(UTC))), qos=1, retain=True)
        client = aiomqtt.Client(**proto.client_options(settings, f"heliotrope-agent-{name}"), will=will)
        async with gate:
            return await stack.enter_async_context(client)

    async def agent(client: aiomqtt.Client, name: str, t0: float, t_end: float) -> None:
        own = random.Random(f"{seed}-{name}")
        due = t0 + own.random() * interval
        seq = 0
        state_topic = proto.topic(name, "state")
        while due < t_end:
            await asyncio.sleep(max(0.0, due - time.time()))
            stats["slip"].append(time.time() - due)
            state, attempts = site_state(name, own)
            hb = proto.Heartbeat(site=name, boot=boot, seq=seq, sent_at=datetime.now(UTC), lease_s=LEASE_S,
                                 state=state, attempts=attempts)
            sent = time.perf_counter()
            try:
                await client.publish(state_topic, proto.encode(hb), qos=1, retain=True)
                stats["published"] += 1
                stats["puback"].append(time.perf_counter() - sent)
            except aiomqtt.MqttError:
                stats["errors"] += 1
            seq += 1
            due += interval

    rng.shuffle(names)
    async with contextlib.AsyncExitStack() as stack:
        started = time.perf_counter()
        try:
            clients = await asyncio.gather(*(connect(stack, n) for n in names))
        except Exception as e:  # reported to the parent, which stops the run
            conn.send(("failed", f"{type(e).__name__}: {e}"))
            return
        conn.send(("connected", len(clients), time.perf_counter() - started))
        _, t0, t_end, _ = await asyncio.to_thread(conn.recv)
        cpu0, wall0 = time.process_time(), time.time()
        await asyncio.gather(*(agent(c, n, t0, t_end) for c, n in zip(clients, names)))
        cpu1, wall1 = time.process_time(), time.time()
        stats["cpu_pct"] = 100 * (cpu1 - cpu0) / max(1e-9, wall1 - wall0)
        # Stay connected (silent) until the broker has looked at every site's lease after the grace period.
        await asyncio.sleep(max(0.0, t_end + GRACE_S + 2.0 - time.time()))
        # aiomqtt may log a harmless race while 1,000 connections close at once (a writer on a closed socket).
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    conn.send(("result", stats))


# --- the run -----------------------------------------------------------------------------------------------


def expect(conn: Connection, what: str, timeout_s: float, who: str) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise SystemExit(f"{who}: no '{what}' within {timeout_s:g} s")
    msg = conn.recv()
    if msg[0] != what:
        raise SystemExit(f"{who}: expected '{what}', got {msg!r}")
    return msg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=4, help="processes the agents are spread over")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between an agent's heartbeats")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long they publish once all are connected")
    ap.add_argument("--host", default=None, help="an MQTT broker already running (default: start a Mosquitto)")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--agents-nice", type=int, default=10,
                    help="niceness of the agents' processes (default %(default)s; 0: compete with the broker)")
    ap.add_argument("--mosquitto-conf", action="append", default=[], metavar="LINE",
                    help="an extra line for the Mosquitto this script starts, e.g. 'set_tcp_nodelay true' (repeatable)")
    args = ap.parse_args()

    from tests.mosquitto import Mosquitto, raise_nofile_limit

    needed = 2 * args.agents + 256
    soft, hard = raise_nofile_limit(needed)
    note = "" if soft >= needed else f"  WARNING: below the {needed} needed; raise the hard limit (ulimit -Hn)"
    print(f"open files: soft limit {soft}, hard {hard} (needs about {needed}){note}")

    mosq: Mosquitto | None = None
    procs: list[mp.process.BaseProcess] = []
    try:
        if args.host is None:
            mosq = Mosquitto(log_connections=False, extra_config=args.mosquitto_conf)
            mosq.start()
            settings = MqttSettings(host="127.0.0.1", port=mosq.port)
            extra = f"; extra: {'; '.join(args.mosquitto_conf)}" if args.mosquitto_conf else ""
            print(f"mosquitto: {mosq.binary} on 127.0.0.1:{mosq.port} (persistence on, autosave 1 s{extra}), "
                  f"pid {mosq.pid}")
        else:
            settings = MqttSettings(host=args.host, port=args.port)
            print(f"mqtt broker: {args.host}:{args.port} (not started here)")
        ctx = mp.get_context("spawn")
        names = site_names(args.agents)
        wire = settings.model_dump()

        broker_conn, child = ctx.Pipe()
        broker = ctx.Process(target=broker_main, args=(wire, names, child), name="broker", daemon=True)
        broker.start()
        procs.append(broker)
        if not expect(broker_conn, "ready", 60, "broker")[1]:
            raise SystemExit("broker: the hub did not connect to the MQTT broker")

        workers: list[Connection] = []
        for i in range(args.procs):
            part = names[i::args.procs]
            if not part:
                continue
            parent, child = ctx.Pipe()
            p = ctx.Process(target=agents_main, name=f"agents-{i}", daemon=True,
                            args=(wire, part, child, args.interval, args.seed + i, args.agents_nice))
            p.start()
            procs.append(p)
            workers.append(parent)
        connect_s = 0.0
        for i, w in enumerate(workers):
            msg = expect(w, "connected", 120, f"agents-{i}")
            connect_s = max(connect_s, msg[2])
        print(f"agents: {args.agents} connections in {len(workers)} processes, connected in {connect_s:.1f} s; "
              f"1 heartbeat per {args.interval:g} s each for {args.seconds:g} s")

        t0 = time.time() + 1.0
        t_end = t0 + args.seconds
        go = ("go", t0, t_end, args.interval)
        broker_conn.send(go)
        for w in workers:
            w.send(go)
        load0 = os.getloadavg()
        time.sleep(max(0.0, t0 - time.time()))
        mosq_cpu0 = proc_cpu_s(mosq.pid) if mosq and mosq.pid else None
        time.sleep(max(0.0, t_end - time.time()))
        mosq_cpu1 = proc_cpu_s(mosq.pid) if mosq and mosq.pid else None
        load1 = os.getloadavg()

        agent_results = [expect(w, "result", 60, f"agents-{i}")[1] for i, w in enumerate(workers)]
        res = expect(broker_conn, "result", GRACE_S + 120, "broker")[1]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        if mosq is not None:
            mosq.cleanup()

    published = sum(r["published"] for r in agent_results)
    errors = sum(r["errors"] for r in agent_results)
    slip = [s for r in agent_results for s in r["slip"]]
    puback = [s for r in agent_results for s in r["puback"]]
    delays, ages = res["delays"], res["ages"]
    d50, d99, dmax = percentiles(delays)
    a50, a99, amax = percentiles(ages)
    s50, s99, smax = percentiles(slip)
    p50, p99, pmax = percentiles(puback)
    l50, l99, lmax = percentiles(res["sampler_lag"])
    malformed = sum(res["malformed"].values())
    mosq_cpu = (f"{100 * (mosq_cpu1 - mosq_cpu0) / args.seconds:.0f}%"
                if mosq_cpu0 is not None and mosq_cpu1 is not None else "n/a")

    print()
    print(f"machine: {os.cpu_count()} CPUs; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end "
          f"(1 min)")
    print(f"{'':38} {'p50':>8} {'p99':>8} {'max':>8}")
    print(f"{'(a) ingest delay, s':38} {d50:8.3f} {d99:8.3f} {dmax:8.3f}   {len(delays):,} heartbeats")
    print(f"{'(b) state age, s':38} {a50:8.3f} {a99:8.3f} {amax:8.3f}   {len(ages):,} samples "
          f"(every {SAMPLE_EVERY_S:g} s x {args.agents} sites)")
    print(f"{'agents: schedule slip, s':38} {s50:8.3f} {s99:8.3f} {smax:8.3f}")
    print(f"{'agents: publish to PUBACK, s':38} {p50:8.3f} {p99:8.3f} {pmax:8.3f}")
    print(f"{'broker: sampler lateness, s':38} {l50:8.3f} {l99:8.3f} {lmax:8.3f}")
    print()
    print(f"ingested: {res['received_in_window'] / res['window_s']:,.1f} messages/s "
          f"(expected {args.agents / args.interval:,.1f}); published {published:,} (errors {errors}), "
          f"taken by the broker {len(delays):,}, lost {published - len(delays):,}")
    print(f"malformed: {malformed} {res['malformed'] or ''}; sites never heard: {res['never_heard']}; "
          f"without a healthy lease at the end: {res['no_lease']}; samples of sites not yet heard: "
          f"{res['missing_samples']}; hub connects: {res['connects']}; lease grants awaiting PUBACK at "
          f"most: {res['pending_peak']}")
    agents_cpu = " + ".join(f"{r['cpu_pct']:.0f}%" for r in agent_results)
    wait = "n/a" if res["wait_pct"] is None else f"{res['wait_pct']:.0f}%"
    print(f"CPU (% of one core): broker process {res['cpu_pct']:.0f}% (and runnable but waiting for a CPU {wait} of "
          f"the time), mosquitto {mosq_cpu}, agents {agents_cpu}")
    ok = d99 < 1.0 and a99 - args.interval < 1.0 and res["never_heard"] == 0
    print(f"staleness under 1 s: {'yes' if ok else 'no'}  (p99 ingest delay {d99:.3f} s < 1 s; "
          f"p99 state age - interval {a99 - args.interval:.3f} s < 1 s; every site heard)")


if __name__ == "__main__":
    main()
