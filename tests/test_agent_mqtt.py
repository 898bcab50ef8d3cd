"""A broker and site agents over a real Mosquitto of the test's own: telemetry, dispatch and events, and the
faults the protocol promises to survive (a restarted MQTT broker, a partitioned agent, ``kill -9`` of an
agent, an agent holding an attempt the broker no longer has). Every test also checks, from what the sites
really ran, that no job ever ran two attempts at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from adapters import mqtt_protocol as proto
from adapters.base import AdapterError, JobLogs, LogFollow, LogsNotFound, LogsUnsupported
from adapters.agent import AgentConfig, SiteAgent
from adapters.remote import MqttHub, RemoteSite
from adapters.simulated import SimulatedSite
from broker.api import _site_json, create_app
from broker.auth import ANONYMOUS_ADMIN
from broker.cli import _site_row
from broker.clock import Clock, SystemClock
from broker.config import BrokerSettings
from broker.models import Health, Job, JobState, MqttSettings, SiteState
from broker.service import Broker
from tests.builders import job, site
from tests.conftest import ROOT
from tests.mosquitto import Mosquitto, mosquitto_fixture  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

FAST = {"kind": "simulated", "dispatch_delay_s": 0.01}


@dataclass
class Timeline:
    """What the sites really ran: (job id, attempt, site, start, end) on the monotonic clock."""

    spans: list[list] = field(default_factory=list)

    def begin(self, job_id: str, attempt: int, where: str) -> list:
        span = [job_id, attempt, where, time.monotonic(), None]
        self.spans.append(span)
        return span

    def of(self, job_id: str) -> list[list]:
        return sorted((s for s in self.spans if s[0] == job_id), key=lambda s: s[3])

    def assert_never_twice(self) -> None:
        for job_id in {s[0] for s in self.spans}:
            spans = self.of(job_id)
            for before, after in zip(spans, spans[1:]):
                assert before[4] is not None and before[4] <= after[3], (
                    f"job {job_id} ran attempt {before[1]} at {before[2]} and attempt {after[1]} at {after[2]} "
                    "at the same time")


class RecordingSite(SimulatedSite):
    """A simulated site that writes down when each attempt really starts and stops running."""

    def __init__(self, spec, clock: Clock, timeline: Timeline) -> None:  # noqa: ANN001
        super().__init__(spec, clock)
        self.timeline = timeline

    async def _run(self, run) -> None:  # noqa: ANN001
        span = self.timeline.begin(run.job.id, run.job.attempt, self.name)
        try:
            await super()._run(run)
        finally:
            span[4] = time.monotonic()


def edge_spec(kind: dict) -> object:
    """The agent-run site: 16 GPUs, so the broker's default (most free GPUs) prefers it to ``home``."""
    return site("edge", gpus={"a100-80gb": 16}, adapter=kind)


@dataclass
class World:
    broker: Broker
    mosq: Mosquitto
    timeline: Timeline
    tmp: Path
    holder: dict[str, Broker]
    agents: list[SiteAgent] = field(default_factory=list)

    async def agent(self, heartbeat_s: float = 0.2) -> SiteAgent:
        spec = edge_spec(FAST)
        config = AgentConfig(site=spec, mqtt=self.mosq.settings(), heartbeat_s=heartbeat_s, resend_s=0.3)
        a = SiteAgent(config, adapter=RecordingSite(spec, SystemClock(), self.timeline))
        await a.start()
        self.agents.append(a)
        return a

    def rebind(self, broker: Broker) -> None:
        """Carry on with a broker started afresh (after a restart); the factory's sites use its hub."""
        self.broker = broker
        self.holder["broker"] = broker

    async def until(self, what: Callable[[], bool], timeout_s: float, why: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s} s: {why}\n{self.mosq.log_tail()}")
            await asyncio.sleep(0.05)

    async def state(self, job_id: str) -> Job:
        return await self.broker.book.get(job_id)

    async def until_state(self, job_id: str, states: set[JobState], timeout_s: float) -> Job:
        deadline = time.monotonic() + timeout_s
        while True:
            j = await self.state(job_id)
            if j.state in states:
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {j.state} ({j.reason}), not {states} within {timeout_s} s")
            await asyncio.sleep(0.05)

    def edge_health(self) -> Health | None:
        m = self.broker.federation.get("edge")
        return None if m is None or m.state is None else m.state.health


@pytest.fixture
async def world(tmp_path: Path, mosquitto: Mosquitto):  # noqa: F811
    worlds: list[World] = []

    async def make(lease_s: float = 2.0, command_timeout_s: float = 5.0) -> World:
        timeline = Timeline()
        clock = SystemClock()
        settings = BrokerSettings(db=str(tmp_path / "h.db"), mqtt=mosquitto.settings(), cycle_interval_s=0.1,
                                  collect_timeout_s=1.0, dispatch_timeout_s=command_timeout_s + 1,
                                  shutdown_grace_s=0.2, refusal_ttl_s=1.0)
        holder: dict[str, Broker] = {}

        def factory(spec):  # noqa: ANN001, ANN202
            if spec.adapter.kind == "mqtt":
                return RemoteSite(spec, clock, holder["broker"].hub)
            return RecordingSite(spec, clock, timeline)

        b = Broker(settings, clock=clock, factory=factory)
        holder["broker"] = b
        remote = {"kind": "mqtt", "lease_s": lease_s, "command_timeout_s": command_timeout_s, "resend_s": 0.3}
        await b.start([edge_spec(remote), site("home", gpus={"a100-80gb": 8}, adapter=FAST)])
        w = World(b, mosquitto, timeline, tmp_path, holder)
        worlds.append(w)
        return w

    yield make
    for w in worlds:
        for a in w.agents:
            await a.stop()
        await w.broker.stop()
        for w_ in worlds:
            w_.timeline.assert_never_twice()


def site_row(w: World, name: str) -> dict:
    """The site's line in `heliotrope sites list`, from the API's JSON for it."""
    return _site_row(json.loads(json.dumps(_site_json(w.broker.federation.get(name), ANONYMOUS_ADMIN))))


async def submit(w: World, name: str, duration_s: float, **more) -> str:  # noqa: ANN003
    j, _ = await w.broker.book.submit(job(name=name, duration_s=duration_s, **more))
    w.broker.wake()
    return j.id


async def running_at_edge(world: Callable, name: str, duration_s: float) -> tuple[World, SiteAgent, Job]:
    """The log tests' set-up: a world whose site edge is run by an agent and healthy, and a job of tenant t1
    (``name``, ``duration_s`` seconds long) running; the world, the agent and the job as running."""
    w = await world(lease_s=6.0)
    agent = await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, name, duration_s)
    running = await w.until_state(job_id, {JobState.RUNNING}, 10)
    return w, agent, running


async def test_telemetry_reaches_the_broker_and_a_job_runs_on_the_agents_site(world) -> None:
    # A lease long enough that a CI machine's stall of a second or two cannot end it mid-job (CI once saw the
    # 2 s lease run out, the agent stop the job, and the rerun land on home): the lease is tested below.
    w = await world(lease_s=6.0)
    assert w.edge_health() != Health.HEALTHY  # no agent yet
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "the agent's heartbeat makes edge healthy")
    state = w.broker.federation.get("edge").state
    assert state.capacity[0].total_gpus == 16 and state.lease_expires_at is not None
    row = site_row(w, "edge")  # what `heliotrope sites list` prints
    assert row["health"] == "healthy" and row["lease"].endswith("s left") and row["last heard"] == "0 s ago"
    assert site_row(w, "home")["lease"] == "-"  # a local site holds no lease
    job_id = await submit(w, "over-mqtt", 0.5)
    done = await w.until_state(job_id, {JobState.SUCCEEDED}, 10)
    assert (done.site, done.attempt) == ("edge", 1)
    assert [(s[1], s[2]) for s in w.timeline.of(job_id)] == [(1, "edge")]  # it ran there, once


async def test_the_broker_asking_an_agent_to_stop_a_job_requeues_it_with_its_work_kept(world) -> None:
    # What a move does (policies.migration): the remote site's preempt goes to the agent as a command, the
    # agent's site checkpoints and stops the attempt, and its "preempted" event requeues the job with the
    # work done kept; the job then runs again (attempt 2), never at once with attempt 1.
    w = await world(lease_s=6.0)
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "moving", 30.0, checkpointable=True)
    running = await w.until_state(job_id, {JobState.RUNNING}, 10)
    assert (running.site, running.attempt) == ("edge", 1)
    await asyncio.sleep(0.5)
    await w.broker.federation.get("edge").adapter.preempt(job_id, 1, "moved from edge to home")
    await w.until(lambda: (j := w.broker.book.active.get(job_id)) is not None and j.attempt == 2, 10,
                  "the job is placed again")
    assert (await w.state(job_id)).run_s >= 0.4
    history = [e["reason"] for e in await w.broker.store.job_events(job_id)]
    assert "preempted on edge: moved from edge to home" in history, history
    assert w.timeline.of(job_id)[0][4] is not None  # attempt 1 stopped
    w.timeline.assert_never_twice()


async def test_restarting_mosquitto_mid_run_loses_no_dispatch_and_no_event(world) -> None:
    w = await world(lease_s=8.0, command_timeout_s=8.0)
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    first = await submit(w, "running-through", 2.0)
    await w.until_state(first, {JobState.RUNNING}, 10)
    w.mosq.kill()
    second = await submit(w, "sent-while-down", 0.5)  # dispatched while the MQTT broker is down
    await asyncio.sleep(1.5)  # the first job ends while the link is down: its event must wait
    w.mosq.start()
    for job_id in (first, second):
        done = await w.until_state(job_id, {JobState.SUCCEEDED}, 15)
        assert done.attempt == 1, f"{done.name} was requeued: {done.reason}"
        assert done.site == "edge"
        assert len(w.timeline.of(job_id)) == 1


async def test_a_partitioned_agent_stops_its_job_before_the_broker_moves_it(world) -> None:
    w = await world(lease_s=2.0, command_timeout_s=1.5)
    agent = await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "long", 30.0)
    await w.until_state(job_id, {JobState.RUNNING}, 10)
    w.mosq.kill()  # agent and broker lose each other (the broker still runs its local site)
    await w.until(lambda: (j := w.broker.book.active[job_id]).site == "home" and j.state == JobState.RUNNING, 10,
                  "the job runs at home once the lease has run out")
    spans = w.timeline.of(job_id)
    assert [(s[1], s[2]) for s in spans][:2] == [(1, "edge"), (2, "home")]
    edge_run, home_run = spans[0], spans[1]
    assert edge_run[4] is not None and edge_run[4] <= home_run[3]  # stopped at the edge before it started home
    assert agent.held == {}
    assert w.edge_health() == Health.UNHEALTHY
    w.mosq.start()  # the partition heals: the agent comes back and its stale report changes nothing
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 10, "edge healthy again")
    await asyncio.sleep(1.0)
    now = w.broker.book.active[job_id]
    assert (now.site, now.attempt, now.state) == ("home", 2, JobState.RUNNING)


async def test_an_attempt_the_broker_no_longer_has_is_cancelled_at_the_site(world, mosquitto) -> None:  # noqa: F811
    w = await world(lease_s=3.0)
    agent = await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    # A dispatch the broker never made (a stale one from before a restart) reaches the agent.
    import aiomqtt

    ghost = Job(id="ghost-1", spec=job(name="ghost", duration_s=60), attempt=3,
                created_at=w.broker.clock.now(), updated_at=w.broker.clock.now(), site="edge")
    async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier=f"old-{uuid.uuid4().hex[:6]}") as c:
        await c.publish(proto.topic("edge", "down"), proto.encode(proto.Dispatch(site="edge", msg_id="old-1", job=ghost)),
                        qos=1)
    await w.until(lambda: ("ghost-1", 3) in agent.held, 5, "the agent runs the stray attempt")
    await w.until(lambda: ("ghost-1", 3) not in agent.held, 5, "the broker has it cancelled")
    span = w.timeline.of("ghost-1")[0]
    assert span[4] is not None and span[4] - span[3] < 5  # stopped long before its 60 s


def agent_process(tmp: Path, mosq: Mosquitto, log: Path) -> subprocess.Popen[bytes]:
    config = tmp / f"agent-{uuid.uuid4().hex[:6]}.yaml"
    spec = edge_spec(FAST).model_dump(mode="json")
    config.write_text(yaml.safe_dump({"site": spec, "mqtt": mosq.settings().model_dump(mode="json"),
                                      "heartbeat_s": 0.2, "resend_s": 0.3}))
    return subprocess.Popen([sys.executable, "-m", "adapters.agent", "--config", str(config)], cwd=ROOT,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def test_kill_9_of_an_agent_moves_its_jobs_once_the_lease_has_run_out(world) -> None:
    w = await world(lease_s=2.0, command_timeout_s=1.5)
    log = w.tmp / "agent.log"
    proc = agent_process(w.tmp, w.mosq, log)
    try:
        await w.until(lambda: w.edge_health() == Health.HEALTHY, 15, "the agent process makes edge healthy")
        job_id = await submit(w, "doomed-there", 30.0)
        await w.until(lambda: (j := w.broker.book.active.get(job_id)) is not None and j.state == JobState.RUNNING,
                      10, f"the job runs at edge\n{log.read_text()}")
        assert w.broker.book.active[job_id].site == "edge"
        last_heard = w.broker.federation.get("edge").adapter._heard_mono
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await w.until(lambda: w.broker.book.active[job_id].site == "home", 10, "the job moves home")
        moved_after = time.monotonic() - last_heard
        assert moved_after >= 2.0  # not before the lease ran out
        assert w.edge_health() == Health.UNHEALTHY
        assert "lease ran out" in w.broker.federation.get("edge").state.reason
        row = site_row(w, "edge")
        assert row["health"].startswith("unhealthy (report failed: lease ran out") and "ran out" in row["lease"]
        proc = agent_process(w.tmp, w.mosq, log)  # the agent comes back: nothing runs twice
        await w.until(lambda: w.edge_health() == Health.HEALTHY, 15, "edge healthy again")
        await asyncio.sleep(0.5)
        now = w.broker.book.active[job_id]
        assert (now.site, now.attempt) == ("home", 2)
        assert [(s[1], s[2]) for s in w.timeline.of(job_id)] == [(2, "home")]  # attempt 1 ran in the killed process
    finally:
        proc.kill()
        proc.wait()


async def test_a_restarted_agent_reports_what_its_site_still_runs_and_the_broker_cancels_the_stale(world) -> None:
    """A Kubernetes site's Jobs outlive its agent; here a simulated site stands in, already running an
    attempt the broker moved elsewhere long ago when the agent starts over it."""
    w = await world(lease_s=3.0)
    spec = edge_spec(FAST)
    inner = RecordingSite(spec, SystemClock(), w.timeline)
    await inner.start()
    old = Job(id="left-behind", spec=job(name="left-behind", duration_s=60), attempt=1,
              created_at=w.broker.clock.now(), updated_at=w.broker.clock.now(), site="edge")
    assert (await inner.submit(old)).admitted
    await w.until(lambda: bool(w.timeline.of("left-behind")), 2, "the old attempt runs")
    agent = SiteAgent(AgentConfig(site=spec, mqtt=w.mosq.settings(), heartbeat_s=0.2, resend_s=0.3), adapter=inner)
    await agent.start()
    w.agents.append(agent)
    assert ("left-behind", 1) in agent.held  # adopted, so its heartbeat lists it
    # (the site's run ends as its cancelled task next runs, a moment after the agent let the attempt go)
    await w.until(lambda: ("left-behind", 1) not in agent.held and w.timeline.of("left-behind")[0][4] is not None, 5,
                  "the broker has the stale attempt cancelled")
    span = w.timeline.of("left-behind")[0]
    assert span[4] is not None and span[4] - span[3] < 5


async def test_an_attempt_the_broker_gave_up_at_its_lease_and_a_restarted_agent_still_runs_is_cancelled(world) -> None:
    """A Kubernetes site's Job outlives its killed agent (a simulated site kept across the two agents stands in):
    the lease runs out, the broker moves the job home, and the agent started again over the site adopts the old
    attempt. The broker read its own "lost" for that attempt, not an end the site reported: it must have the
    attempt cancelled, not leave it running beside the job's new attempt (which it does for a while: the
    site's own timeline, as the world's would fail its check that no job runs twice at once)."""
    w = await world(lease_s=2.0, command_timeout_s=1.5)
    spec = edge_spec(FAST)
    edge_ran = Timeline()
    inner = RecordingSite(spec, SystemClock(), edge_ran)
    config = AgentConfig(site=spec, mqtt=w.mosq.settings(), heartbeat_s=0.2, resend_s=0.3)
    first = SiteAgent(config, adapter=inner)
    await first.start()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "outlives-its-agent", 60.0)
    running = await w.until_state(job_id, {JobState.RUNNING}, 10)
    assert (running.site, running.attempt) == ("edge", 1)
    # kill -9 of the agent: its tasks end where they are, and the site's run goes on without it
    tasks = [*first._tasks, *first._background]
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5)
    await w.until(lambda: (j := w.broker.book.active[job_id]).site == "home" and j.state == JobState.RUNNING, 10,
                  "the job runs at home once the lease has run out")
    assert edge_ran.of(job_id)[0][4] is None  # attempt 1 still runs at edge
    again = SiteAgent(config, adapter=inner)
    await again.start()
    w.agents.append(again)
    assert (job_id, 1) in again.held  # adopted, so its heartbeats list it
    await w.until(lambda: (job_id, 1) not in again.held and edge_ran.of(job_id)[0][4] is not None, 5,
                  "the broker has the attempt it gave up cancelled at edge")
    now = w.broker.book.active[job_id]
    assert (now.site, now.attempt, now.state) == ("home", 2, JobState.RUNNING)  # the cancel moved nothing


async def test_a_broker_restart_within_the_lease_keeps_the_agents_job_where_it_runs(world) -> None:
    """The broker goes down and comes back (same database, a new process's state) while a job runs at the
    agent's site: the retained heartbeat is no sign of life, the first live one is, the restart's
    reconciliation finds the attempt at the site, and the job finishes there, once."""
    w = await world(lease_s=6.0)
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "outlives-the-broker", 3.0)
    await w.until_state(job_id, {JobState.RUNNING}, 10)
    settings, factory = w.broker.settings, w.broker.federation._factory
    await w.broker.stop()
    await asyncio.sleep(0.5)
    again = Broker(settings, clock=SystemClock(), factory=factory)
    w.rebind(again)
    await again.start()
    done = await w.until_state(job_id, {JobState.SUCCEEDED}, 15)
    assert (done.site, done.attempt) == ("edge", 1)
    assert len(w.timeline.of(job_id)) == 1


async def test_a_restarted_broker_takes_what_the_mqtt_broker_kept_for_it_as_its_sites_messages(world, caplog) -> None:
    """While no broker is in charge, the MQTT broker keeps the agents' heartbeats for the broker's session and
    hands them over the moment a broker connects: they are messages of a registered site, not a stranger's."""
    w = await world(lease_s=6.0)
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    settings, factory = w.broker.settings, w.broker.federation._factory
    await w.broker.stop()
    await asyncio.sleep(1.0)  # about five heartbeats wait in the MQTT broker for the broker's session
    again = Broker(settings, clock=SystemClock(), factory=factory)
    w.rebind(again)
    with caplog.at_level("WARNING", logger="adapters.remote"):
        await again.start()
        await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy again")
    assert again.hub is not None and "edge" not in again.hub.unknown_sites
    assert not [r for r in caplog.records if "site edge, which is not registered here" in r.getMessage()]


async def test_a_site_holding_70000_attempts_keeps_its_lease_and_the_broker_takes_its_whole_list(mosquitto) -> None:  # noqa: F811
    """70,000 attempts make a heartbeat of about 4.4 MB, over the 4 MiB every receiver drops: sent whole, the
    site would go unhealthy and its jobs be taken for lost while they run. Its list goes in parts, and the broker
    holds the whole of it while the lease is renewed."""
    held = {(f"{i:018d}", 1) for i in range(70_000)}  # ids as long as the broker's

    class Crowded(SimulatedSite):
        async def known_attempts(self) -> set[tuple[str, int]]:
            return set(held)

    hub = MqttHub(mosquitto.settings())
    remote = RemoteSite(site("edge", gpus={"a100-80gb": 16}, adapter={"kind": "mqtt", "lease_s": 10}),
                        SystemClock(), hub)
    spec = edge_spec(FAST)
    agent = SiteAgent(AgentConfig(site=spec, mqtt=mosquitto.settings(), heartbeat_s=0.5),
                      adapter=Crowded(spec, SystemClock()))
    await hub.start()
    await remote.start()
    await agent.start()
    try:
        assert len(agent.held) == 70_000  # adopted: its heartbeats list them all
        deadline = time.monotonic() + 8
        while True:  # after two heartbeats at least, the broker holds the whole list
            with contextlib.suppress(AdapterError):
                if remote._seq >= 2 and await remote.known_attempts() == held:
                    break
            assert time.monotonic() < deadline, f"no whole list; dropped: {dict(hub.malformed)}\n{mosquitto.log_tail()}"
            await asyncio.sleep(0.05)
        assert (await remote.snapshot()).health == Health.HEALTHY
        assert hub.malformed == {}
        remaining = agent.lease_remaining_s()
        assert remaining is not None and remaining > 0 and len(agent.held) == 70_000
    finally:
        await agent.stop()
        await remote.close()
        await hub.close()


CAP = 64 << 10
"""The MQTT broker's cap on a message in the tests below (Mosquitto's ``message_size_limit``)."""


async def heard(mosq: Mosquitto, remote: RemoteSite, timeout_s: float = 8) -> None:
    """Until the broker's side of site edge has heard the agent's first heartbeat (then it may ask for logs)."""
    deadline = time.monotonic() + timeout_s
    while remote._heard_mono is None:
        assert time.monotonic() < deadline, f"no heartbeat\n{mosq.log_tail()}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def capped_edge(tmp_path, adapter: type[SimulatedSite], told: bool):  # noqa: ANN201
    """A Mosquitto that caps messages at ``CAP``, and site ``edge``'s agent (its inner site an ``adapter``) with
    the broker's side of it, both told the cap where ``told`` (``mqtt.max_payload_bytes``); yields (mosquitto,
    hub, remote site, agent), all started, and stops them after."""
    with Mosquitto(tmp_path / "mosquitto", extra_config=[f"message_size_limit {CAP}"]) as mosq:
        settings = mosq.settings(max_payload_bytes=CAP) if told else mosq.settings()
        hub = MqttHub(settings)
        remote = RemoteSite(site("edge", gpus={"a100-80gb": 16}, adapter={"kind": "mqtt", "lease_s": 10}),
                            SystemClock(), hub)
        spec = edge_spec(FAST)
        agent = SiteAgent(AgentConfig(site=spec, mqtt=settings, heartbeat_s=0.2), adapter=adapter(spec, SystemClock()))
        await hub.start()
        await remote.start()
        await agent.start()
        try:
            yield mosq, hub, remote, agent
        finally:
            await agent.stop()
            await remote.close()
            await hub.close()


@pytest.mark.parametrize(("told", "heard"), [
    pytest.param(True, True, id="an agent told the MQTT broker's cap splits its heartbeat to fit and keeps its lease"),
    pytest.param(False, False, id="an agent not told the cap sends its heartbeat whole, and the MQTT broker drops it"),
])
async def test_a_heartbeat_over_the_mqtt_brokers_cap_on_a_message_is_split_to_fit_when_the_cap_is_set(
        tmp_path, told: bool, heard: bool) -> None:
    """An MQTT broker with a smaller cap than 4 MiB (EMQX's 1 MB, AWS IoT's 128 KB, Mosquitto's
    message_size_limit) drops a heartbeat over it without a word: the site would go unhealthy and its jobs be
    taken for lost while they run. With ``mqtt.max_payload_bytes`` set to the cap, the list of 3,000 attempts
    (about 170 KB) goes in parts that fit, and the broker holds the whole of it."""
    held = {(f"{i:018d}", 1) for i in range(3_000)}  # ids as long as the broker's

    class Crowded(SimulatedSite):
        async def known_attempts(self) -> set[tuple[str, int]]:
            return set(held)

    async with capped_edge(tmp_path, Crowded, told=told) as (mosq, hub, remote, agent):
        assert len(agent.held) == 3_000
        assert len(proto.encode(proto.Heartbeat(  # the list alone is over the cap
            site="edge", boot="b", seq=1, sent_at=SystemClock().now(), lease_s=10, state=SiteState(site="edge"),
            attempts=[proto.AttemptReport(job_id=j, attempt=a, status="running") for j, a in held]))) > CAP
        deadline = time.monotonic() + (8 if heard else 2)
        got = None
        while time.monotonic() < deadline:  # after two heartbeats at least, the broker holds the whole list
            with contextlib.suppress(AdapterError):
                if remote._seq >= 2 and (got := await remote.known_attempts()) == held:
                    break
            await asyncio.sleep(0.05)
        if heard:
            assert got == held, f"no whole list; dropped: {dict(hub.malformed)}\n{mosq.log_tail()}"
            assert (await remote.snapshot()).health == Health.HEALTHY
            remaining = agent.lease_remaining_s()
            assert remaining is not None and remaining > 0 and hub.malformed == {}
        else:
            assert remote._seq == -1 and got is None  # not one heartbeat came through
            with pytest.raises(AdapterError, match="no heartbeat"):
                await remote.snapshot()


REMOTE = {"kind": "mqtt", "lease_s": 2.0, "command_timeout_s": 5.0, "resend_s": 0.3}


async def remote_broker(tmp_path: Path, mosquitto: Mosquitto, sites: list, run_loop: bool = True,  # noqa: F811
                        mqtt: MqttSettings | None = None) -> Broker:
    """A broker on ``tmp_path``'s database whose ``mqtt`` sites go through its hub to their agents (through
    ``mqtt``, where given, rather than straight to ``mosquitto``)."""
    settings = BrokerSettings(db=str(tmp_path / "h.db"), mqtt=mqtt or mosquitto.settings(), cycle_interval_s=0.1,
                              collect_timeout_s=1.0, dispatch_timeout_s=6.0, shutdown_grace_s=0.2)
    holder: dict[str, Broker] = {}
    b = Broker(settings, factory=lambda spec: RemoteSite(spec, SystemClock(), holder["b"].hub))
    holder["b"] = b
    await b.start(sites, run_loop=run_loop)
    return b


async def started_agent(mosquitto: Mosquitto, spec: object) -> SiteAgent:  # noqa: F811
    """The agent of the simulated site ``spec``, started."""
    agent = SiteAgent(AgentConfig(site=spec, mqtt=mosquitto.settings(), heartbeat_s=0.2, resend_s=0.3),
                      adapter=SimulatedSite(spec, SystemClock()))
    await agent.start()
    return agent


async def until_edge_reports(b: Broker, collect: bool = False) -> None:
    """Until the broker has a healthy report of site edge (``collect``: asking for it, with no loop running)."""
    deadline = time.monotonic() + 10
    while b.federation.get("edge").public_state().health != Health.HEALTHY:
        assert time.monotonic() < deadline, "the agent's site did not report"
        if collect:
            await b.federation.collect()
        await asyncio.sleep(0.1)


async def test_quotas_the_config_file_changed_reach_an_agents_site_once_its_agent_reports(
        tmp_path: Path, mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The operator raised vision's guarantee in the broker's config file while the broker was down, and the
    site's agent was not connected when the broker started again (or started after it): the change was logged
    and dropped, and the site went on enforcing the old guarantee while the broker's spec said the new one."""
    caplog.set_level(logging.INFO, logger="broker.service")

    def edge(vision: int, kind: dict) -> object:
        return site("edge", gpus={"a100-80gb": 16}, adapter=kind, quotas=[
            {"tenant": "vision", "guaranteed_gpus": vision}, {"tenant": "nlp", "guaranteed_gpus": 4}])

    async def broker(vision: int) -> Broker:
        return await remote_broker(tmp_path, mosquitto, [edge(vision, REMOTE)])

    async def guarantees(b: Broker) -> dict[str, float]:
        member = b.federation.get("edge")
        return {t.tenant: t.guaranteed_gpus for t in (await member.adapter.quota()).tenants}

    b = await broker(vision=4)  # the site as it was
    await b.stop()
    b = await broker(vision=8)  # the file edited while the broker was down; no agent yet
    assert "its quotas changed in the config file (vision)" in caplog.text
    await b.stop()
    b = await broker(vision=8)  # started again before the agent came: the change is still to be passed
    agent = await started_agent(mosquitto, edge(4, FAST))  # the agent's site, with the quotas it had
    try:
        deadline = time.monotonic() + 10
        while (got := await guarantees(b) if b.federation.get("edge").started and
               b.federation.get("edge").public_state().health == Health.HEALTHY else None) != {"nlp": 4, "vision": 8}:
            assert time.monotonic() < deadline, f"the site enforces {got}, not the file's vision 8"
            await asyncio.sleep(0.1)
        while "the quotas its config file changed are passed to it (vision)" not in caplog.text:  # (its answer)
            assert time.monotonic() < deadline, "the broker did not hear the site take them"
            await asyncio.sleep(0.05)
    finally:
        await agent.stop()
        await b.stop()
    b = await broker(vision=8)  # passed once: nothing is left to pass
    try:
        assert b._quota_passes == {}
    finally:
        await b.stop()


async def test_an_operators_quota_change_after_the_restart_wins_over_the_files_change_not_yet_passed(
        tmp_path: Path, mosquitto: Mosquitto) -> None:  # noqa: F811
    def edge(vision: int, kind: dict) -> object:
        return site("edge", gpus={"a100-80gb": 16}, adapter=kind, quotas=[{"tenant": "vision", "guaranteed_gpus": vision}])

    async def broker(vision: int) -> Broker:  # (no housekeeping but what the test runs)
        return await remote_broker(tmp_path, mosquitto, [edge(vision, REMOTE)], run_loop=False)

    await (await broker(vision=4)).stop()
    b = await broker(vision=8)  # the file's change, not passed: no agent yet
    agent = await started_agent(mosquitto, edge(4, FAST))
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    try:
        await until_edge_reports(b, collect=True)
        # the operator sets vision's guarantee before the housekeeping passes the file's: theirs is the latest
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6})
        assert r.status == 200, await r.text()
        await b._settle()
        state = await b.federation.get("edge").adapter.quota()
        assert [(t.tenant, t.guaranteed_gpus) for t in state.tenants] == [("vision", 6)]
    finally:
        await client.close()
        await agent.stop()
        await b.stop()


async def test_a_quota_the_agents_site_refuses_for_its_own_gpus_is_a_422_naming_the_field(
        tmp_path: Path, mosquitto: Mosquitto) -> None:  # noqa: F811
    # The broker's spec says 16 GPUs; the agent's site has 8 (its config is its own). A guarantee of 12 passes the
    # broker's check, and the site refused it: the operator read "503: the site did not answer".
    b = await remote_broker(tmp_path, mosquitto, [site("edge", gpus={"a100-80gb": 16}, adapter=REMOTE)])
    agent = await started_agent(mosquitto, site("edge", gpus={"a100-80gb": 8}, adapter=FAST))
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    try:
        await until_edge_reports(b)
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 12})
        error = (await r.json())["error"]
        assert r.status == 422, error
        assert [f["field"] for f in error["fields"]] == ["guaranteed_gpus"]
        assert "12 is more than the site's 8 GPUs" in error["fields"][0]["problem"]
        assert "site edge refuses it" in error["message"]
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6})  # one it can give
        assert r.status == 200, await r.text()
        # the same through the site's spec: refused, naming the quota's field; the spec is not taken
        body = b.federation.get("edge").spec.model_dump(mode="json") | {"quotas": [
            {"tenant": "nlp", "guaranteed_gpus": 2}, {"tenant": "vision", "guaranteed_gpus": 12}]}
        r = await client.put("/v1/sites/edge", json=body)
        error = (await r.json())["error"]
        assert r.status == 422, error
        assert [f["field"] for f in error["fields"]] == ["quotas[1].guaranteed_gpus"]
        assert b.federation.get("edge").spec.quotas == []
    finally:
        await client.close()
        await agent.stop()
        await b.stop()


# --- logs ---


async def test_a_jobs_logs_come_from_the_agents_site_through_the_api(world) -> None:
    w, _, running = await running_at_edge(world, "printing", 30.0)
    job_id = running.id
    assert (running.site, running.attempt) == ("edge", 1)
    async with TestClient(TestServer(create_app(w.broker))) as client:
        r = await client.get(f"/v1/jobs/{job_id}/logs", params={"tail": "5"})
        assert r.status == 200, await r.text()
        assert f"attempt 1 of job {job_id} (tenant t1) started on" in await r.text()
        assert r.headers["X-Heliotrope-Site"] == "edge" and r.headers["X-Heliotrope-Log-Source"] == (
            "simulated run at site edge")
    with pytest.raises(LogsNotFound, match="site edge has no log of attempt 1 of job nobody"):
        await w.broker.federation.get("edge").adapter.logs("nobody", 1, None, 1000)


async def test_a_jobs_log_is_followed_at_an_agents_site_through_the_api_until_it_ends(world) -> None:
    w, agent, running = await running_at_edge(world, "printing", 3.0)
    job_id = running.id
    async with TestClient(TestServer(create_app(w.broker))) as client:
        async with client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true", "tail": "1"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Heliotrope-Site"] == "edge" and r.headers["X-Heliotrope-Log-Source"] == (
                "simulated run at site edge")
            first = (await r.content.readline()).decode()
            assert (await w.state(job_id)).state == JobState.RUNNING  # streamed, not held to the end
            rest = (await r.content.read()).decode()
        whole = await (await client.get(f"/v1/jobs/{job_id}/logs")).text()
    assert "started on" in first or " progress " in first
    assert rest.splitlines()[-1].split(" ", 1)[1] == "attempt 1 succeeded after 3 s" and " progress 90%" in rest
    assert whole.endswith(first + rest)
    await w.until(lambda: not agent._follows, 5, "the agent lets go of the follow once its last part is out")


async def test_a_reader_that_leaves_a_followed_log_stops_the_agents_follow(world) -> None:
    w, agent, running = await running_at_edge(world, "long", 600.0)
    job_id = running.id
    async with TestClient(TestServer(create_app(w.broker))) as client:
        r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
        assert "started on" in (await r.content.readline()).decode()
        assert len(agent._follows) == 1
        r.close()  # the reader leaves while the job runs on
        await w.until(lambda: not agent._follows, 5, "the agent stops following the log")
    assert not w.broker.federation.get("edge").adapter._follows


async def test_a_follow_a_restarted_broker_knows_nothing_of_is_stopped_at_the_agent(world) -> None:
    """The broker stops while it follows a log at the agent's site, its reader never closing the follow (a crash,
    or a leader that lost its lease). The broker that comes back has no reader for it: at the next part the agent
    sends, it tells the agent to stop, so the agent does not read its site's log, send it to nobody and hold one of
    its FOLLOWS_MAX follows until the job ends."""
    w, agent, running = await running_at_edge(world, "followed-across-a-restart", 30.0)  # (a line every 3 s)
    job_id = running.id
    followed = await w.broker.federation.get("edge").adapter.follow_logs(job_id, 1, None, 1 << 20)
    assert "started on" in await anext(followed.chunks)
    assert len(agent._follows) == 1
    settings, factory = w.broker.settings, w.broker.federation._factory
    await w.broker.stop()
    again = Broker(settings, clock=SystemClock(), factory=factory)
    w.rebind(again)
    await again.start()
    await w.until(lambda: not agent._follows, 10, "the agent stops following a log nobody reads")
    assert (await w.state(job_id)).state == JobState.RUNNING  # (the job itself runs on)


def test_a_followed_logs_chunks_are_taken_once_in_order_and_a_gap_ends_it() -> None:
    from adapters.remote import _Follow

    def chunk(seq: int, text: str, end: bool = False) -> proto.LogChunk:
        return proto.LogChunk(site="edge", follow="m1", seq=seq, text=text, end=end)

    async def read(follow: _Follow) -> list[str | None]:
        return [await follow.next() for _ in range(2)]

    follow = _Follow()
    for msg in (chunk(1, "a\n"), chunk(1, "a\n"), chunk(2, "b\n", end=True)):  # (QoS 1: a repeat)
        follow.take(msg)
    assert asyncio.run(read(follow)) == ["a\n", "b\n"] and follow.ended
    broken = _Follow()
    broken.take(chunk(1, "a\n"))
    broken.take(chunk(3, "c\n"))  # part 2 was lost
    with pytest.raises(AdapterError, match="part 2 of the log was lost on the way"):
        asyncio.run(read(broken))


async def test_logs_too_large_for_one_message_keep_their_tail_and_say_they_were_cut(tmp_path) -> None:
    """An MQTT broker's cap on a message (here 64 KiB, set as ``mqtt.max_payload_bytes`` on both sides) bounds a
    reply: the agent cuts a long log from its start, at a line, so the newest lines come through."""
    lines = [f"line {i:06d} " + "x" * 80 for i in range(5_000)]  # about 450 KB

    class Chatty(SimulatedSite):
        async def logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
            return JobLogs("".join(line + "\n" for line in lines), False, "pod heliotrope-t1/p container job")

    async with capped_edge(tmp_path, Chatty, told=True) as (mosq, hub, remote, agent):
        await heard(mosq, remote)
        got = await remote.logs("j-1", 1, None, 1 << 20)
        assert got.truncated and got.source == "pod heliotrope-t1/p container job"
        kept = got.text.splitlines()
        assert kept[-1] == lines[-1] and kept == lines[-len(kept):]  # the tail, whole lines
        assert 40_000 < len(got.text) < CAP and hub.malformed == {}


async def test_a_followed_log_longer_than_a_message_comes_whole_in_parts_that_fit(tmp_path) -> None:
    """A site that writes far more at once than a message may carry (64 KiB here): the agent sends it in parts
    under the cap, and the broker gives them back whole and in order, then the end."""
    lines = [f"line {i:06d} " + "\u00e9" * 80 for i in range(3_000)]  # about 500 KB of UTF-8
    written = "".join(line + "\n" for line in lines)

    class Chatty(SimulatedSite):
        async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
            async def chunks() -> AsyncIterator[str]:
                yield written[:1000]
                yield written[1000:]
            return LogFollow(True, "pod heliotrope-t1/p container job", chunks())

    async with capped_edge(tmp_path, Chatty, told=True) as (mosq, hub, remote, agent):
        await heard(mosq, remote)
        followed = await remote.follow_logs("j-1", 1, None, 1 << 20)
        assert followed.truncated and followed.source == "pod heliotrope-t1/p container job"
        parts = [chunk async for chunk in followed.chunks]
        assert "".join(parts) == written and len(parts) > len(written.encode()) // CAP
        assert hub.malformed == {}
        deadline = time.monotonic() + 5
        while agent._follows:  # (the agent lets go of it once its last part is out)
            assert time.monotonic() < deadline, "the agent still follows the log"
            await asyncio.sleep(0.05)


async def test_an_agents_follows_being_begun_count_against_its_bound(tmp_path, monkeypatch) -> None:
    """The agent's bound on the logs it follows holds for those whose site has not answered yet (up to 8 s): two
    requests at once for an agent with room for one must not both begin."""
    from adapters import agent as agent_module

    monkeypatch.setattr(agent_module, "FOLLOWS_MAX", 1)
    asked, answer = asyncio.Event(), asyncio.Event()

    class Slow(SimulatedSite):
        async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
            async def chunks() -> AsyncIterator[str]:
                yield "epoch 1\n"
            if not asked.is_set():
                asked.set()
                await answer.wait()
            return LogFollow(False, "pod p", chunks())

    async with capped_edge(tmp_path, Slow, told=True) as (mosq, hub, remote, agent):
        await heard(mosq, remote)
        first = asyncio.ensure_future(remote.follow_logs("j-1", 1, None, 1 << 20))
        await asyncio.wait_for(asked.wait(), 5)
        with pytest.raises(AdapterError, match="the site's agent follows 1 logs already"):
            await remote.follow_logs("j-2", 1, None, 1 << 20)
        answer.set()
        followed = await first
        assert [chunk async for chunk in followed.chunks] == ["epoch 1\n"]


async def test_an_agent_of_an_earlier_release_that_drops_the_logs_request_is_a_501_saying_so(
        world, monkeypatch) -> None:
    # An agent of the release before this one decodes a "logs" command as a kind it does not know on its down
    # topic: it drops it (counted as wrong-topic) and never answers, while its heartbeats go on.
    from adapters import remote as remote_module

    monkeypatch.setitem(proto._CHANNEL_KINDS, "down", proto._CHANNEL_KINDS["down"] - {"logs"})
    monkeypatch.setattr(remote_module, "LOGS_WAIT_S", 1.5)
    w = await world(lease_s=6.0)
    agent = await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "older", 30.0)
    await w.until_state(job_id, {JobState.RUNNING}, 10)
    async with TestClient(TestServer(create_app(w.broker))) as client:
        r = await client.get(f"/v1/jobs/{job_id}/logs")
        assert r.status == 501, await r.text()
        message = (await r.json())["error"]["message"]
    assert "site edge cannot give logs: its agent did not answer the request for logs within 1.5 s while its " \
           "heartbeats kept coming: the agent is of an earlier release, which cannot give logs (upgrade it)" in message
    assert agent.malformed["wrong-topic"] >= 1


async def test_an_agent_of_an_earlier_release_asked_to_follow_a_log_is_a_501_naming_follow(world, monkeypatch) -> None:
    # An agent of the release before this one knows "logs" but not its "follow" key, which its message forbids: it
    # drops the request as invalid and never answers, while its heartbeats go on.
    from adapters import agent as agent_module
    from adapters import remote as remote_module

    def earlier(topic_name: str, payload: bytes | bytearray | str, max_payload_bytes: int) -> object:
        if b'"follow":true' in bytes(payload if not isinstance(payload, str) else payload.encode()):
            raise proto.MalformedMessage("invalid", "logs: follow: Extra inputs are not permitted")
        return proto.decode(topic_name, payload, max_payload_bytes)

    monkeypatch.setattr(agent_module, "decode", earlier)
    monkeypatch.setattr(remote_module, "LOGS_WAIT_S", 1.5)
    w = await world(lease_s=6.0)
    agent = await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "older", 30.0)
    await w.until_state(job_id, {JobState.RUNNING}, 10)
    async with TestClient(TestServer(create_app(w.broker))) as client:
        r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
        assert r.status == 501, await r.text()
        body = (await r.json())["error"]
        assert (await client.get(f"/v1/jobs/{job_id}/logs")).status == 200  # reading it still works
    assert "the agent is of an earlier release, which cannot follow logs (upgrade it)" in body["message"]
    assert body["fields"] == [{"field": "follow", "problem": "site edge cannot follow logs"}]
    assert agent.malformed["invalid"] >= 1


async def test_an_agent_whose_site_cannot_give_logs_says_so(world) -> None:
    w = await world(lease_s=6.0)
    spec = edge_spec(FAST)

    class NoLogs:
        def __init__(self, inner: SimulatedSite) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name == "logs":
                raise AttributeError(name)
            return getattr(self.inner, name)

    agent = SiteAgent(AgentConfig(site=spec, mqtt=w.mosq.settings(), heartbeat_s=0.2, resend_s=0.3),
                      adapter=NoLogs(RecordingSite(spec, SystemClock(), w.timeline)))
    await agent.start()
    w.agents.append(agent)
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    with pytest.raises(LogsUnsupported, match=r"the site's adapter \(simulated\) cannot give logs"):
        await w.broker.federation.get("edge").adapter.logs("j-1", 1, None, 1000)


@pytest.mark.parametrize("line", [
    "日本語のログ行です。" * 4,
    "é" * 40,
    '\x1b[32mok\x1b[0m "quoted" ' * 4,
    "x" * 40,
], ids=["Japanese (3 bytes a character)", "accented (2 bytes a character)",
        "colour codes and quotes (JSON writes them longer)", "plain ASCII"])
def test_a_long_log_is_cut_to_the_longest_tail_of_whole_lines_that_fits_a_message_logs(line: str) -> None:
    # A 1 MiB log cut to fit a 64 KiB message: the excess, counted in bytes, was dropped as as many characters,
    # so a log of characters wider than a byte lost its whole text, and an ASCII one a third of what fits.
    text = "".join(f"{i:05d} {line}\n" for i in range(20_000))
    reply = proto.Reply(site="edge", msg_id="m1", ok=True, logs=proto.WireLogs(text=text, truncated=False))
    cap = 64 * 1024
    cut = proto.with_short_logs(reply, cap)
    assert cut.logs is not None and cut.logs.truncated
    size = len(proto.encode(cut))
    assert cap - 2 * len(proto.encode(proto.WireLogs(text=line + "\n", truncated=True))) < size <= cap
    assert text.endswith(cut.logs.text) and cut.logs.text[:5].isdigit()  # its end, from a line's start
    assert proto.decode(proto.topic("edge", "up"), proto.encode(cut)) == cut


async def test_a_logs_request_in_flight_when_its_site_is_removed_is_a_409_saying_so(world, monkeypatch) -> None:
    # The agent drops the request for logs (as one of an earlier release does), so the request is still waiting for
    # its answer when the site, whose job has ended, is removed: the reader gets the house JSON error, not a dropped
    # connection (the request's wait was cancelled with the site's adapter).
    from adapters import remote as remote_module

    monkeypatch.setitem(proto._CHANNEL_KINDS, "down", proto._CHANNEL_KINDS["down"] - {"logs"})
    monkeypatch.setattr(remote_module, "LOGS_WAIT_S", 30.0)
    w = await world(lease_s=6.0)
    await w.agent()
    await w.until(lambda: w.edge_health() == Health.HEALTHY, 5, "edge healthy")
    job_id = await submit(w, "short", 0.5)
    await w.until_state(job_id, {JobState.SUCCEEDED}, 10)
    remote = w.broker.federation.get("edge").adapter
    async with TestClient(TestServer(create_app(w.broker))) as client:
        reading = asyncio.ensure_future(client.get(f"/v1/jobs/{job_id}/logs"))
        await w.until(lambda: bool(remote._pending), 5, "the request for logs sent")
        assert (await client.delete("/v1/sites/edge")).status == 204
        r = await asyncio.wait_for(reading, 10)
        assert r.status == 409, await r.text()
        message = (await r.json())["error"]["message"]
    assert message == ("site edge was removed, or its adapter rebuilt by a change, while its logs were being read; "
                       "ask again if the site is still registered")
