"""The site agent (``adapters.agent``) against a real MQTT broker (a Mosquitto this module starts on a free port).

The test plays the broker's side with a plain MQTT client on the site's topics (:class:`BrokerSide`), so
each test sees what the broker would: the retained heartbeat and status, replies, events and their resends.
Every test uses a site name of its own, so tests never see each other's retained messages, and clears them
at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import yaml

from adapters.agent import NO_LEASE, AgentConfig, SiteAgent, load_agent_config, main
from adapters.base import AdapterError, EventKind, JobEvent
from adapters.mqtt_protocol import (
    Ack,
    Cancel,
    Dispatch,
    EventMsg,
    Heartbeat,
    LeaseGrant,
    Preempt,
    QuotaCommand,
    Reply,
    Status,
    decode,
    encode,
    topic,
)
from broker.config import ConfigError
from adapters.nvml import NvmlCollector
from adapters.telemetry import nvml_feed
from adapters.simulated import SimulatedSite
from broker.clock import SystemClock
from broker.models import Job, MqttSettings, NvmlTelemetryConfig, SimulatedAdapterConfig, TenantQuota
from tests.builders import job, site
from tests.conftest import ROOT
from tests.mosquitto import Mosquitto, MosquittoMissing, mosquitto_fixture  # noqa: F401
from tests.services import missing
from tests.test_nvml import FakeNvml, a100_in_mig_mode, h100_throttled

MQTT_HOST = "127.0.0.1"
HEARTBEAT_S = 0.2
LEASE_S = 2.0
_PORT: list[int] = []  # the port of this module's Mosquitto, once it runs


def mqtt_port() -> int:
    assert _PORT, "the module's Mosquitto is not running"
    return _PORT[0]


@pytest.fixture(scope="module", autouse=True)
def _module_mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """One Mosquitto for this module's tests (each uses a site of its own); the tests that kill an MQTT
    broker start their own."""
    try:
        broker = Mosquitto(tmp_path_factory.mktemp("mosquitto"))
    except MosquittoMissing as e:
        missing("MQTT", str(e))
        raise
    broker.start()
    _PORT[:] = [broker.port]
    try:
        yield broker
    finally:
        _PORT.clear()
        broker.cleanup()


def unique_site() -> str:
    return f"agent-test-{uuid.uuid4().hex[:10]}"


def site_spec(name: str, **adapter: Any) -> Any:
    return site(name, gpus={"a100-80gb": 8},
                adapter=SimulatedAdapterConfig(dispatch_delay_s=0.01, **adapter).model_dump())


def a_job(job_id: str, *, duration_s: float = 0.4, attempt: int = 1, **more: Any) -> Job:
    now = datetime.now(UTC)
    return Job(id=job_id, spec=job(duration_s=duration_s, **more), created_at=now, updated_at=now, attempt=attempt)


class BrokerSide:
    """The central broker's side of one site's topics: records every message the agent publishes (with the
    monotonic time it arrived), answers heartbeats with a lease while ``lease_s`` is set, and acknowledges
    events while ``auto_ack`` is true."""

    def __init__(self, site_name: str, port: int | None = None, lease_s: float | None = LEASE_S,
                 auto_ack: bool = True) -> None:
        self.site = site_name
        self.port = port or mqtt_port()
        self.lease_s = lease_s
        self.auto_ack = auto_ack
        self.received: list[tuple[float, Any]] = []
        self.grants: list[tuple[int, float]] = []  # (heartbeat seq, when its heartbeat arrived)
        self._changed = asyncio.Condition()
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> BrokerSide:
        self._client = aiomqtt.Client(MQTT_HOST, self.port, identifier=f"test-broker-{uuid.uuid4().hex[:10]}")
        await self._client.__aenter__()
        for channel in ("state", "status", "up"):
            await self._client.subscribe(topic(self.site, channel), qos=1)
        self._reader = asyncio.create_task(self._read(self._client))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._client is not None and self._reader is not None
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        # aiomqtt waits for the MQTT broker's answer to a disconnect with no time limit: bounded here, so that a
        # lost answer fails nothing and stalls nothing (the test's checks are all made by now)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._client.__aexit__(None, None, None)

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            msg = decode(message.topic.value, message.payload)
            if msg is None:
                continue
            now = time.monotonic()
            if isinstance(msg, Heartbeat) and self.lease_s is not None:
                self.grants.append((msg.seq, now))
                await self.send(LeaseGrant(site=self.site, boot=msg.boot, seq=msg.seq, lease_s=self.lease_s))
            if isinstance(msg, EventMsg) and self.auto_ack:
                await self.send(Ack(site=self.site, boot=msg.boot, msg_ids=[msg.msg_id]))
            async with self._changed:
                self.received.append((now, msg))
                self._changed.notify_all()

    async def send(self, msg: Any) -> None:
        await self.send_raw(encode(msg))

    async def send_raw(self, payload: bytes) -> None:
        assert self._client is not None
        await self._client.publish(topic(self.site, "down"), payload, qos=1)

    def seen(self, pred: Callable[[Any], bool]) -> list[Any]:
        return [m for _, m in self.received if pred(m)]

    async def wait_for(self, pred: Callable[[Any], bool], timeout: float = 5.0,
                       since: float = -1.0) -> tuple[float, Any]:
        """The first message (and when it arrived) that ``pred`` accepts, of those that arrived after
        ``since`` (monotonic), waiting up to ``timeout`` seconds."""
        async def first() -> tuple[float, Any]:
            async with self._changed:
                while True:
                    for at, m in self.received:
                        if at > since and pred(m):
                            return at, m
                    await self._changed.wait()
        return await asyncio.wait_for(first(), timeout)

    async def reply(self, msg_id: str, timeout: float = 5.0) -> Reply:
        return (await self.wait_for(lambda m: isinstance(m, Reply) and m.msg_id == msg_id, timeout))[1]

    async def event(self, job_id: str, kind: EventKind, timeout: float = 5.0) -> tuple[float, EventMsg]:
        return await self.wait_for(
            lambda m: isinstance(m, EventMsg) and m.event.job_id == job_id and m.event.kind == kind, timeout)

    def events_of(self, job_id: str, kind: EventKind | None = None) -> list[EventMsg]:
        return self.seen(lambda m: isinstance(m, EventMsg) and m.event.job_id == job_id
                         and (kind is None or m.event.kind == kind))


async def clear_retained(site_name: str, port: int | None = None) -> None:
    """Clear the site's retained messages, and the persistent session its agent left in the MQTT broker
    (connecting with the agent's client id and a clean session ends it). Tidying only (every test's site name
    is its own), so bounded: aiomqtt waits for a disconnect's answer with no time limit."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            async with aiomqtt.Client(MQTT_HOST, port or mqtt_port(), identifier=f"heliotrope-agent-{site_name}",
                                      clean_session=True, protocol=aiomqtt.ProtocolVersion.V311) as client:
                for channel in ("state", "status"):
                    await client.publish(topic(site_name, channel), b"", qos=1, retain=True, timeout=5)


async def retained(site_name: str, channel: str, port: int | None = None, timeout: float = 3.0) -> Any:
    """What a client subscribing now gets on a retained topic (None when nothing is retained)."""
    async with aiomqtt.Client(MQTT_HOST, port or mqtt_port()) as client:
        await client.subscribe(topic(site_name, channel), qos=1)
        try:
            async with asyncio.timeout(timeout):
                async for message in client.messages:
                    assert message.retain, "the first message on a retained topic must be the retained one"
                    return decode(message.topic.value, message.payload)
        except TimeoutError:
            return None


def agent_config(name: str, port: int | None = None, **more: Any) -> AgentConfig:
    return AgentConfig(site=site_spec(name), mqtt=MqttSettings(port=port or mqtt_port(), reconnect_max_s=0.5),
                       heartbeat_s=HEARTBEAT_S, resend_s=0.3, **more)


@pytest.fixture
async def agent_and_broker() -> AsyncIterator[tuple[SiteAgent, BrokerSide]]:
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    async with BrokerSide(name) as side:
        await agent.start()
        try:
            await until(lambda: agent.connected, what="the agent to connect")
            yield agent, side
        finally:
            await agent.stop()
    await clear_retained(name)


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def leased(agent: SiteAgent, side: BrokerSide) -> None:
    """Wait until the agent holds a lease it may admit work under."""
    await until(lambda: (agent.lease_remaining_s() or 0) > LEASE_S * 0.7, what="a lease")


# --- heartbeat and status ------------------------------------------------------------------------------------


async def test_heartbeat_is_retained_with_capacity_and_status_goes_offline_on_stop():
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    try:
        async with BrokerSide(name) as side:
            await agent.start()
            _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat))
            assert beat.boot == agent.boot and beat.lease_s == 15.0  # before any grant: the default
            [cap] = beat.state.capacity
            assert (cap.model, cap.total_gpus, cap.free_gpus) == ("a100-80gb", 8, 8)
            assert beat.attempts == []
            # a broker that subscribes later still finds the site's state and status
            later = await retained(name, "state")
            assert isinstance(later, Heartbeat) and later.site == name
            status = await retained(name, "status")
            assert isinstance(status, Status) and status.online and status.boot == agent.boot
            # heartbeats keep coming, with increasing seq, and the lease granted is what they ask for next
            await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.seq >= 3 and m.lease_s == LEASE_S)
            await agent.stop()
            _, bye = await side.wait_for(lambda m: isinstance(m, Status) and not m.online)
            assert bye.boot == agent.boot
        status = await retained(name, "status")
        assert isinstance(status, Status) and not status.online
    finally:
        await agent.stop()
        await clear_retained(name)


async def test_heartbeats_carry_the_gpus_the_agent_measures_through_nvml():
    """An agent on a GPU node (``telemetry: {kind: nvml}``) sends what NVML reads: the hottest GPU and the
    share held down by heat or power, with its site's own queue depth."""
    name = unique_site()
    config = agent_config(name, telemetry=NvmlTelemetryConfig(every_s=1))
    fake = FakeNvml([h100_throttled(), a100_in_mig_mode()])
    agent = SiteAgent(config, telemetry=nvml_feed(name, config.telemetry, collector=NvmlCollector(fake)))
    try:
        async with BrokerSide(name) as side:
            await agent.start()  # the first reading goes out with the heartbeat after it
            _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.state.telemetry.throttled_pct
                                          is not None)
            telemetry = beat.state.telemetry
            assert (telemetry.temperature_c_max, telemetry.throttled_pct) == (83.0, 50.0)
            assert telemetry.throttle_reasons == {"hw_thermal": 1, "power_brake": 1, "sw_power_cap": 1}
            assert telemetry.queue_depth == 0
            await agent.stop()
        assert not fake.initialised  # NVML shut down with the agent
    finally:
        await agent.stop()
        await clear_retained(name)


def test_an_agent_config_asks_for_nvml_telemetry_by_kind(tmp_path):
    path = tmp_path / "agent.yaml"
    doc = {"site": json.loads(site_spec("lab").model_dump_json()), "telemetry": {"kind": "nvml", "every_s": 5}}
    path.write_text(yaml.safe_dump(doc))
    config = load_agent_config(path)
    assert config.telemetry == NvmlTelemetryConfig(every_s=5)
    assert SiteAgent(config).telemetry is not None
    doc["telemetry"] = {"kind": "nvml", "every_s": 0}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="every_s"):
        load_agent_config(path)


@pytest.mark.parametrize("stop_after_s", [0.0, 0.002, 0.005, 0.01, 0.02, 0.05])
async def test_an_agent_stopped_while_it_connects_is_never_left_online(stop_after_s):
    """SIGTERM can land at any point of the connect: before the "online" status, or while it is in flight.
    Whatever the moment, what a broker finds retained afterwards must not say the site is online."""
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    try:
        await agent.start()
        await asyncio.sleep(stop_after_s)
        await agent.stop()
        status = await retained(name, "status", timeout=1.0)
        assert status is None or (isinstance(status, Status) and not status.online), status
    finally:
        await agent.stop()
        await clear_retained(name)


async def test_a_task_that_holds_on_through_its_first_cancel_is_cancelled_again_and_the_agent_stops(monkeypatch, caplog):
    """Leaving an MQTT connection, aiomqtt waits for the broker's answer to DISCONNECT without a bound: a task
    cancelled there holds on. The agent cancels what is still running after STOP_GRACE_S once more, so SIGTERM
    ends it at once rather than after STOP_WAIT_S (and without leaving the task behind)."""
    from adapters import agent as agent_module

    monkeypatch.setattr(agent_module, "STOP_GRACE_S", 0.05)
    monkeypatch.setattr(agent_module, "STOP_WAIT_S", 0.5)
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    never = asyncio.get_running_loop().create_future()

    async def holds_on() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await never  # as aiomqtt's __aexit__ waits for the DISCONNECT answer

    try:
        await agent.start()
        stubborn = asyncio.get_running_loop().create_task(holds_on())
        agent._background.add(stubborn)
        await asyncio.sleep(0)
        await agent.stop()
        assert stubborn.cancelled()
        assert "did not end" not in caplog.text
    finally:
        await agent.stop()
        await clear_retained(name)


# --- dispatch, events, acks ------------------------------------------------------------------------------------


async def test_dispatch_is_admitted_then_running_and_succeeded_events_arrive(agent_and_broker):
    agent, side = agent_and_broker
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=0.3)))
    reply = await side.reply("d1")
    assert reply.ok and reply.admitted
    _, running = await side.event("j1", EventKind.RUNNING)
    _, done = await side.event("j1", EventKind.SUCCEEDED)
    assert running.msg_id < done.msg_id and done.event.attempt == 1
    await until(lambda: not agent.held, what="the finished attempt to be let go")


async def finished_unacknowledged(agent: SiteAgent, side: BrokerSide) -> tuple[float, EventMsg]:
    """j1 dispatched and run to its end while the broker's side acknowledges nothing: when its end arrived,
    and the end."""
    side.auto_ack = False
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=0.1)))
    return await side.event("j1", EventKind.SUCCEEDED)


async def test_an_event_is_resent_until_acknowledged(agent_and_broker):
    agent, side = agent_and_broker
    _, done = await finished_unacknowledged(agent, side)
    await until(lambda: len(side.events_of("j1", EventKind.SUCCEEDED)) >= 3, what="resends")  # resend_s 0.3
    assert {m.msg_id for m in side.events_of("j1", EventKind.SUCCEEDED)} == {done.msg_id}  # the same message
    await side.send(Ack(site=agent.site, boot="another-boot", msg_ids=[done.msg_id]))  # not ours: ignored
    await asyncio.sleep(0.7)
    before = len(side.events_of("j1"))
    assert before > 3
    await side.send(Ack(site=agent.site, boot=agent.boot, msg_ids=[m.msg_id for m in side.events_of("j1")]))
    await asyncio.sleep(0.4)  # a resend already on its way may still arrive
    settled = len(side.events_of("j1"))
    await asyncio.sleep(1.0)
    assert len(side.events_of("j1")) == settled, "events kept coming after the ack"


async def test_the_sites_adapter_hears_an_event_is_taken_only_once_the_broker_acknowledges_it(agent_and_broker):
    # An adapter that keeps what it must report across restarts (the Kubernetes adapter's stops) forgets it
    # when told the event is taken (EventReceipts). The agent's outbox lives in memory, so it tells the adapter
    # only once the broker has acknowledged the event, not when it has merely queued or sent it.
    agent, side = agent_and_broker
    taken: list[Any] = []
    agent.inner.taken = taken.append  # type: ignore[attr-defined]
    await finished_unacknowledged(agent, side)
    await until(lambda: len(side.events_of("j1", EventKind.SUCCEEDED)) >= 2, what="a resend")
    assert taken == []
    await side.send(Ack(site=agent.site, boot=agent.boot, msg_ids=[m.msg_id for m in side.events_of("j1")]))
    await until(lambda: {e.kind for e in taken} == {EventKind.RUNNING, EventKind.SUCCEEDED}, what="both taken")
    assert [e.job_id for e in taken] == ["j1", "j1"]


async def test_an_attempt_is_listed_in_heartbeats_until_the_broker_acknowledges_its_end(agent_and_broker):
    # A broker that restarts asks which attempts the site knows before the agent's resend of an end reaches
    # it: the attempt must still be listed then, or the broker takes it for lost and runs it again from scratch.
    agent, side = agent_and_broker
    ended, _ = await finished_unacknowledged(agent, side)
    _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat), since=ended)
    assert [(a.job_id, a.attempt) for a in beat.attempts] == [("j1", 1)]
    acked = time.monotonic()
    await side.send(Ack(site=agent.site, boot=agent.boot, msg_ids=[m.msg_id for m in side.events_of("j1")]))
    await asyncio.sleep(0.2)
    _, later = await side.wait_for(lambda m: isinstance(m, Heartbeat), since=acked + 0.2)
    assert later.attempts == []


async def test_a_repeated_dispatch_does_not_run_the_job_twice(agent_and_broker):
    agent, side = agent_and_broker
    await leased(agent, side)
    the_job = a_job("j1", duration_s=0.5)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=the_job))
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=the_job))  # the broker resent it
    first = await side.reply("d1")
    await side.event("j1", EventKind.RUNNING)
    await side.send(Dispatch(site=agent.site, msg_id="d2", job=the_job))  # a new command, the same attempt
    again = await side.reply("d2")
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=the_job))  # and the first, once more
    await side.event("j1", EventKind.SUCCEEDED)
    await until(lambda: len(side.seen(lambda m: isinstance(m, Reply) and m.msg_id == "d1")) == 3,
                what="three replies to d1")
    replies = side.seen(lambda m: isinstance(m, Reply) and m.msg_id == "d1")
    assert all(r == first for r in replies) and first.admitted
    assert again.ok and again.admitted
    await asyncio.sleep(0.3)
    assert len(side.events_of("j1", EventKind.RUNNING)) == 1
    assert len(side.events_of("j1", EventKind.SUCCEEDED)) == 1


async def test_cancel_stops_the_job_and_forgets_it(agent_and_broker):
    agent, side = agent_and_broker
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=60)))
    await side.event("j1", EventKind.RUNNING)
    await until(lambda: agent.held == {("j1", 1): "running"}, what="the attempt to be held as running")
    _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.attempts)
    assert [(a.job_id, a.attempt, a.status) for a in beat.attempts] == [("j1", 1, "running")]
    await side.send(Cancel(site=agent.site, msg_id="c1", job_id="j1", attempt=1))
    assert (await side.reply("c1")).ok
    assert agent.held == {}
    _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat), since=time.monotonic())
    assert beat.attempts == [] and beat.state.running_jobs == 0


async def test_preempt_checkpoints_and_stops_the_job_and_the_site_says_so(agent_and_broker):
    agent, side = agent_and_broker
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=60, checkpointable=True)))
    await side.event("j1", EventKind.RUNNING)
    await asyncio.sleep(0.3)
    await side.send(Preempt(site=agent.site, msg_id="p1", job_id="j1", attempt=1, reason="moved to b"))
    assert (await side.reply("p1")).ok
    _, stopped = await side.event("j1", EventKind.PREEMPTED)
    assert stopped.event.reason == "moved to b" and 0.2 < stopped.event.run_s < 5
    await until(lambda: not agent.held, what="the stopped attempt to be let go")


async def test_quota_commands_are_answered(agent_and_broker):
    agent, side = agent_and_broker
    await side.send(QuotaCommand(site=agent.site, msg_id="q1", op="set",
                                 quota=TenantQuota(tenant="t1", guaranteed_gpus=2)))
    set_reply = await side.reply("q1")
    assert set_reply.ok and set_reply.quota is not None and set_reply.quota.tenant("t1").guaranteed_gpus == 2
    await side.send(QuotaCommand(site=agent.site, msg_id="q2", op="remove", tenant="nobody"))
    missing = await side.reply("q2")
    assert missing.ok and missing.not_found and missing.quota is not None
    await side.send(QuotaCommand(site=agent.site, msg_id="q3", op="get"))
    got = await side.reply("q3")
    assert got.ok and got.quota.enforced


async def test_an_agent_asked_for_its_quotas_again_and_again_keeps_no_copy_of_each_answer():
    # A quota read answers with the site's whole quota state (tens of kilobytes in memory for some forty tenants):
    # an agent whose quotas a dashboard polls must not keep one per request for the last 10,000 of them.
    name = unique_site()
    spec = site(name, gpus={"a100-80gb": 64}, adapter=SimulatedAdapterConfig(dispatch_delay_s=0.01).model_dump())
    agent = SiteAgent(AgentConfig(site=spec, mqtt=MqttSettings(port=mqtt_port()), heartbeat_s=HEARTBEAT_S))
    await agent.inner.start()  # (not connected: its answers go nowhere, as those of a link that is down)
    try:
        for i in range(40):
            await agent.inner.set_quota(TenantQuota(tenant=f"tenant-{i}", guaranteed_gpus=1))
        first = QuotaCommand(site=name, msg_id="q-first", op="get")
        await agent._answer(first)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(200):
                await agent._answer(QuotaCommand(site=name, msg_id=f"q{i}", op="get"))
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 2_000_000, f"200 quota reads left {grown / 1e6:.1f} MB behind"
    finally:
        await agent.inner.close()


# --- leases ------------------------------------------------------------------------------------------------


async def _cut_off_while_running(agent: SiteAgent, side: BrokerSide, the_job: Job) -> tuple[float, float, EventMsg]:
    """Run ``the_job``, then stop granting leases; returns (when the broker's view of the lease ends, when the
    agent's stop event arrived, that event)."""
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=the_job))
    assert (await side.reply("d1")).admitted
    await side.event(the_job.id, EventKind.RUNNING)
    await asyncio.sleep(0.3)
    side.lease_s = None  # the broker stops hearing the site
    _, last_received = side.grants[-1]
    broker_lease_end = last_received + LEASE_S
    at, stopped = await side.wait_for(
        lambda m: isinstance(m, EventMsg) and m.event.job_id == the_job.id
        and m.event.kind in (EventKind.LOST, EventKind.PREEMPTED), timeout=LEASE_S + 2)
    return broker_lease_end, at, stopped


async def test_a_cut_off_agent_stops_its_job_before_the_lease_ends_and_refuses_work(agent_and_broker):
    agent, side = agent_and_broker
    broker_lease_end, at, stopped = await _cut_off_while_running(agent, side, a_job("j1", duration_s=60))
    assert stopped.event.kind == EventKind.LOST
    assert "lease running out" in stopped.event.reason
    assert at < broker_lease_end, f"stopped {at - broker_lease_end:.2f} s after the broker's lease ended"
    assert agent.held == {}
    remaining = agent.lease_remaining_s()
    assert remaining is not None and remaining < 0.4 + 0.2  # it stopped within its margin of the end
    # until a new grant it refuses work
    await side.send(Dispatch(site=agent.site, msg_id="d2", job=a_job("j2")))
    refused = await side.reply("d2")
    assert refused.ok and refused.admitted is False and refused.reason == NO_LEASE
    _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat), since=at)
    assert beat.attempts == []
    # the broker hears it again: it grants, and the site takes work once more
    side.lease_s = LEASE_S
    await leased(agent, side)
    await side.send(Dispatch(site=agent.site, msg_id="d3", job=a_job("j3", duration_s=0.2)))
    assert (await side.reply("d3")).admitted
    await side.event("j3", EventKind.SUCCEEDED)


async def test_a_checkpointable_job_cut_off_is_preempted_with_its_run_time(agent_and_broker):
    agent, side = agent_and_broker
    started = time.monotonic()
    _, at, stopped = await _cut_off_while_running(agent, side, a_job("j1", duration_s=60, checkpointable=True))
    assert stopped.event.kind == EventKind.PREEMPTED
    assert "checkpointed" in stopped.event.reason
    assert 0.3 < stopped.event.run_s <= at - started


async def test_an_agent_whose_heartbeats_come_too_seldom_for_its_lease_says_so_in_one_error(caplog):
    """heartbeat_s 5 against the broker's default 15 s lease: the default stop margin (two heartbeats) leaves
    the lease 5 s after each heartbeat, which the next grant reaches only just after, so the agent stopped its
    jobs between two heartbeats, the link healthy, and nothing said why (only a margin as long as the lease
    was named). Here at a fifth of the scale: heartbeat_s 1, lease 3 s."""
    name = unique_site()
    agent = SiteAgent(AgentConfig(site=site_spec(name), mqtt=MqttSettings(port=mqtt_port(), reconnect_max_s=0.5),
                                  heartbeat_s=1.0, resend_s=0.3))
    try:
        async with BrokerSide(name, lease_s=3.0) as side:
            with caplog.at_level("ERROR", logger="adapters.agent"):
                await agent.start()
                await until(lambda: len(side.grants) >= 2, what="two grants")
            errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert len(errors) == 1, errors
            assert "between two heartbeats" in errors[0] and "lower heartbeat_s or stop_margin_s" in errors[0]
    finally:
        await agent.stop()
        await clear_retained(name)


async def test_a_heartbeat_that_cannot_be_made_is_logged_and_the_next_ones_go_out(caplog):
    """A heartbeat that failed to be made (a state it could not carry) ended the heartbeat task without a word:
    the MQTT link stayed up, the site went quiet and its lease ran out."""
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    listed = agent._attempts_listed
    failures = [RuntimeError("a state no heartbeat can carry")]

    def once_broken() -> Any:
        if failures:
            raise failures.pop()
        return listed()

    agent._attempts_listed = once_broken  # type: ignore[method-assign]
    try:
        async with BrokerSide(name) as side:
            with caplog.at_level("ERROR", logger="adapters.agent"):
                await agent.start()
                await until(lambda: len(side.grants) >= 3, what="heartbeats after the one that failed")
            assert not failures
            assert "could not make a heartbeat; trying again at the next one" in caplog.text
    finally:
        await agent.stop()
        await clear_retained(name)


# --- bad input ---------------------------------------------------------------------------------------------


async def test_malformed_commands_are_counted_and_dropped(agent_and_broker):
    agent, side = agent_and_broker
    await leased(agent, side)
    good = json.loads(encode(Dispatch(site=agent.site, msg_id="bad", job=a_job("jx"))))
    await side.send_raw(b"{not json")
    await side.send_raw(json.dumps({**good, "v": 2}).encode())
    await side.send_raw(json.dumps({**good, "kind": "explode"}).encode())
    await side.send_raw(json.dumps({**good, "site": "someone-else"}).encode())
    await side.send_raw(json.dumps({k: v for k, v in good.items() if k != "job"}).encode())
    await side.send_raw(b"[1, 2]")
    await side.send_raw(b"")  # a cleared retained message: nothing, and not an error
    await side.send(QuotaCommand(site=agent.site, msg_id="q1", op="get"))
    assert (await side.reply("q1")).ok  # it keeps answering
    assert agent.malformed == {"bad-json": 1, "wrong-version": 1, "wrong-topic": 2, "invalid": 2}
    assert not side.seen(lambda m: isinstance(m, Reply) and m.msg_id == "bad")
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=0.1)))
    assert (await side.reply("d1")).admitted


async def test_an_adapter_failure_becomes_a_failed_reply():
    name = unique_site()
    agent = SiteAgent(agent_config(name))
    try:
        async with BrokerSide(name) as side:
            await agent.start()
            await leased(agent, side)
            agent.inner.set_reachable(False)  # the cluster's API is down
            await side.send(Dispatch(site=name, msg_id="d1", job=a_job("j1")))
            failed = await side.reply("d1")
            assert not failed.ok and "unreachable" in failed.reason
            _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.state.health == "unhealthy")
            assert "cannot reach" in beat.state.reason
            agent.inner.set_reachable(True)
            await side.send(Dispatch(site=name, msg_id="d2", job=a_job("j2", duration_s=0.1)))
            assert (await side.reply("d2")).admitted
    finally:
        await agent.stop()
        await clear_retained(name)


class HangingSnapshots(SimulatedSite):
    """A site whose reports hang while ``hang`` is set (a cluster API that stops answering without refusing);
    everything else, the jobs included, goes on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hang = False

    async def snapshot(self) -> Any:
        while self.hang:
            await asyncio.sleep(0.05)
        return await super().snapshot()


@pytest.mark.parametrize("heartbeat_s", [HEARTBEAT_S, 0.55], ids=[
    "heartbeats well inside the lease",
    # the lease holds 0.9 s after each heartbeat (2 s less a margin of 2 x 0.55): a wait of heartbeat_s after the
    # sleep of heartbeat_s let it lapse, with no error at the grant (as heartbeat_s 4 against a 15 s lease)
    "heartbeats a little more than half of what the lease holds apart"])
async def test_a_site_whose_reports_hang_is_reported_unhealthy_and_its_running_job_keeps_its_lease(heartbeat_s):
    """A cluster API that hangs (packets dropped, not refused) held the agent's heartbeat for as long as the
    report took: the lease ran out and the agent stopped a job the site was still running, for the broker to
    run it again elsewhere. A site that does not answer is one the agent cannot reach: say so, keep the lease."""
    name = unique_site()
    spec = site_spec(name)
    inner = HangingSnapshots(spec, SystemClock())
    agent = SiteAgent(agent_config(name).model_copy(update={"heartbeat_s": heartbeat_s}), adapter=inner)
    try:
        async with BrokerSide(name) as side:
            await agent.start()
            await leased(agent, side)
            await side.send(Dispatch(site=name, msg_id="d1", job=a_job("j1", duration_s=60)))
            assert (await side.reply("d1")).admitted
            await side.event("j1", EventKind.RUNNING)
            inner.hang = True
            since = time.monotonic()
            _, beat = await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.state.health == "unhealthy",
                                          timeout=LEASE_S, since=since)
            assert "not answered" in beat.state.reason
            assert [(a.job_id, a.status) for a in beat.attempts] == [("j1", "running")]
            await asyncio.sleep(LEASE_S * 1.5)  # past the lease: the job would have been stopped by now
            assert agent.held == {("j1", 1): "running"}
            assert not side.events_of("j1", EventKind.LOST)
            inner.hang = False
            at, _ = await side.wait_for(lambda m: isinstance(m, Heartbeat) and m.state.health == "healthy",
                                        since=time.monotonic())
            assert agent.held == {("j1", 1): "running"}
    finally:
        await agent.stop()
        await clear_retained(name)


class UnstoppableSite(SimulatedSite):
    """A site whose cancel fails while ``stuck`` is set (a cluster API that refuses the delete)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stuck = True

    async def cancel(self, job_id: str, attempt: int) -> None:
        if self.stuck:
            raise AdapterError("the cluster's API refused the delete")
        await super().cancel(job_id, attempt)


async def test_a_dispatch_admitted_as_the_lease_ends_that_cannot_be_stopped_is_not_answered_as_refused():
    """The site admits a job slowly, the lease ends meanwhile, and the agent cannot stop it: the site runs it. The
    reply must not say it was refused (the broker would run it elsewhere at once); it is admitted, and its stop
    is reported, as any stop for the lease, once the site lets the agent make it."""
    name = unique_site()
    spec = site(name, gpus={"a100-80gb": 8}, adapter=SimulatedAdapterConfig(dispatch_delay_s=2.5).model_dump())
    inner = UnstoppableSite(spec, SystemClock())
    agent = SiteAgent(agent_config(name), adapter=inner)
    try:
        async with BrokerSide(name) as side:
            await agent.start()
            await leased(agent, side)
            await side.send(Dispatch(site=name, msg_id="d1", job=a_job("j1", duration_s=60)))
            side.lease_s = None  # cut off while the site admits it
            reply = await side.reply("d1", timeout=5)
            assert agent.held.get(("j1", 1)) is not None  # the site runs it: the agent could not stop it
            assert reply.ok and reply.admitted, reply.reason
            inner.stuck = False
            _, lost = await side.event("j1", EventKind.LOST, timeout=3)
            assert "lease running out" in lost.event.reason
            assert agent.held == {}
    finally:
        await agent.stop()
        await clear_retained(name)


# --- surviving the MQTT broker ----------------------------------------------------------------------------


async def test_the_agent_carries_on_across_an_mqtt_broker_restart(mosquitto: Mosquitto):
    port = mosquitto.port
    name = unique_site()
    agent = SiteAgent(agent_config(name, port=port))
    try:
        async with BrokerSide(name, port=port, lease_s=10.0) as side:
            await agent.start()
            await until(lambda: (agent.lease_remaining_s() or 0) > 5, what="a lease")
            await side.send(Dispatch(site=name, msg_id="d1", job=a_job("j1", duration_s=0.5)))
            await side.event("j1", EventKind.RUNNING)
            mosquitto.kill()
            await until(lambda: not agent.connected, what="the agent to notice")
            await asyncio.sleep(1.0)  # the job ends while the MQTT broker is away
            assert not agent.held
        mosquitto.start()
        async with BrokerSide(name, port=port, lease_s=10.0) as side:
            # its event went nowhere before: it comes now, and the site takes new work
            _, done = await side.event("j1", EventKind.SUCCEEDED, timeout=5)
            assert done.boot == agent.boot
            await side.wait_for(lambda m: isinstance(m, Heartbeat))
            await side.send(Dispatch(site=name, msg_id="d2", job=a_job("j2", duration_s=0.1)))
            assert (await side.reply("d2")).admitted
            await side.event("j2", EventKind.SUCCEEDED)
    finally:
        await agent.stop()


@pytest.mark.slow
async def test_a_killed_agent_process_goes_offline_at_once(tmp_path):
    name = unique_site()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"site": json.loads(site_spec(name).model_dump_json()), "heartbeat_s": 0.5,
                                   "mqtt": {"port": mqtt_port()}}))
    async with BrokerSide(name) as side:
        proc = subprocess.Popen([sys.executable, "-m", "adapters.agent", "--config", str(cfg)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _, online = await side.wait_for(lambda m: isinstance(m, Status) and m.online, timeout=15)
            await side.wait_for(lambda m: isinstance(m, Heartbeat))
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
            _, gone = await side.wait_for(lambda m: isinstance(m, Status) and not m.online, timeout=5)
            assert gone.boot == online.boot  # the last will, published by the MQTT broker
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    await clear_retained(name)


@pytest.mark.slow
async def test_an_agent_process_stopped_with_sigterm_says_goodbye_and_exits_0(tmp_path):
    name = unique_site()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"site": json.loads(site_spec(name).model_dump_json()), "heartbeat_s": 0.5,
                                   "mqtt": {"port": mqtt_port()}}))
    log = tmp_path / "agent.log"
    async with BrokerSide(name) as side:
        proc = subprocess.Popen([sys.executable, "-m", "adapters.agent", "--config", str(cfg), "--log-level", "DEBUG"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        try:
            _, online = await side.wait_for(lambda m: isinstance(m, Status) and m.online, timeout=15)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the agent did not exit 10 s after SIGTERM:\n{log.read_text()[-4000:]}") from None
            err = log.read_bytes()
            assert proc.returncode == 0, err.decode()
            _, gone = await side.wait_for(lambda m: isinstance(m, Status) and not m.online, timeout=5)
            assert gone.boot == online.boot
            assert b"Traceback" not in err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    await clear_retained(name)


# --- configuration and command line -------------------------------------------------------------------------


def _write_config(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def _site_doc(**adapter: Any) -> dict[str, Any]:
    doc = json.loads(site_spec("lyon").model_dump_json())
    if adapter:
        doc["adapter"] = adapter
    return doc


def test_a_good_config_loads_with_defaults(tmp_path):
    config = load_agent_config(_write_config(tmp_path, {"site": _site_doc(), "heartbeat_s": 1}))
    assert config.site.name == "lyon" and config.mqtt.port == 1883 and config.resend_s == 2.0
    assert config.stop_margin(15) == 3.0 and config.stop_margin(4) == 2.0  # max(2 * heartbeat_s, 0.2 * lease)
    margin = load_agent_config(_write_config(tmp_path, {"site": _site_doc(), "stop_margin_s": 5}))
    assert margin.stop_margin(15) == 5


@pytest.mark.parametrize("doc, field, problem", [
    ({"site": _site_doc(kind="mqtt")}, "site.adapter.kind", "simulated or kubernetes"),
    ({"site": _site_doc(), "heartbeat_s": 0}, "heartbeat_s", "greater than 0"),
    ({"site": _site_doc(), "mqtt": {"port": 0}}, "mqtt.port", "greater than or equal to 1"),
    ({"site": _site_doc(), "heartbeat": 2}, "heartbeat", "unknown field"),
    ({"mqtt": {}}, "site", "required field is missing"),
    ({"site": {**_site_doc(), "gpus": []}}, "site.gpus", "at least 1"),
])
def test_config_errors_name_the_field(tmp_path, doc, field, problem):
    path = _write_config(tmp_path, doc)
    with pytest.raises(ConfigError) as e:
        load_agent_config(path)
    assert f"{path}: {field}: " in str(e.value) and problem in str(e.value)


@pytest.mark.parametrize("text, problem", [
    ("site: [unclosed", "not valid YAML (line 1"),
    ("- just\n- a list\n", "the top level must be a mapping"),
])
def test_config_files_that_are_not_a_config(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        load_agent_config(_write_config(tmp_path, text))


def test_main_with_a_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = _write_config(tmp_path, {"site": _site_doc(kind="mqtt")})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"heliotrope agent: {path}: site.adapter.kind: ") and err.count("\n") == 1
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_dispatch_leaves_out_what_only_the_broker_reads_so_earlier_agents_accept_it():
    # deferrable and max_lost_attempts are the broker's to honour; an agent of an earlier release forbids keys it
    # does not know
    at_once = Job(id="j1", spec=job(deferrable=False, max_lost_attempts=2), created_at=datetime(2026, 1, 1, tzinfo=UTC),
                  updated_at=datetime(2026, 1, 1, tzinfo=UTC))
    payload = encode(Dispatch(site="edge", msg_id="m1", job=at_once))
    assert {"deferrable", "max_lost_attempts"}.isdisjoint(json.loads(payload)["job"]["spec"])
    got = decode(topic("edge", "down"), payload)
    assert got.job.spec == at_once.spec.model_copy(update={"deferrable": True, "max_lost_attempts": None})


async def test_a_lease_the_broker_shortens_holds_at_once_so_a_cut_off_agent_stops_in_time(agent_and_broker):
    """The site's lease_s lowered at the broker: from the next grant the broker requeues a silent site's jobs
    after the shorter lease, so the agent must count that one, not the longer lease it was granted before."""
    agent, side = agent_and_broker
    side.lease_s = 6.0
    await until(lambda: (agent.lease_remaining_s() or 0) > 5, what="a long lease")
    await side.send(Dispatch(site=agent.site, msg_id="d1", job=a_job("j1", duration_s=60)))
    assert (await side.reply("d1")).admitted
    side.lease_s = 1.0  # the operator lowers the site's lease_s
    await asyncio.sleep(0.5)
    side.lease_s = None  # ... and then the broker stops hearing the site
    _, last_received = side.grants[-1]
    at, stopped = await side.wait_for(
        lambda m: isinstance(m, EventMsg) and m.event.job_id == "j1" and m.event.kind == EventKind.LOST, timeout=8)
    assert at < last_received + 1.0, f"stopped {at - last_received - 1.0:.2f} s after the broker's lease ended"


async def test_a_command_retained_on_the_down_topic_is_not_carried_out_at_each_connect():
    """A dispatch published with retain (by hand, or by a tool other than the broker) is delivered again to
    every new subscription: the agent carried it out each time it connected, however old it was."""
    name = unique_site()
    async with BrokerSide(name) as side:
        assert side._client is not None
        stale = Dispatch(site=name, msg_id="old", job=a_job("j-old", duration_s=30))
        await side._client.publish(topic(name, "down"), encode(stale), qos=1, retain=True)
        agent = SiteAgent(agent_config(name))
        await agent.start()
        try:
            await until(lambda: agent.connected, what="the agent to connect")
            await leased(agent, side)
            await until(lambda: agent.malformed["retained"] == 1, what="the retained dispatch to be dropped")
            await side.send(Dispatch(site=name, msg_id="new", job=a_job("j-new", duration_s=0.2)))
            assert (await side.reply("new")).admitted  # commands sent as the broker sends them are carried out
            assert not side.seen(lambda m: isinstance(m, Reply) and m.msg_id == "old")
            assert {a[0] for a in agent.held} <= {"j-new"}
        finally:
            await agent.stop()
            await side._client.publish(topic(name, "down"), b"", qos=1, retain=True)
    await clear_retained(name)


async def test_credentials_the_mqtt_broker_refuses_are_named_with_the_settings_to_check(tmp_path, monkeypatch,
                                                                                        caplog):
    """A wrong password gave only '[code:135] Not authorized' (or 'Connection refused: Not authorised'), naming
    no setting; the warning now says which to check."""
    import shutil
    import subprocess

    from tests.mosquitto import Mosquitto

    passwd = shutil.which("mosquitto_passwd")
    assert passwd, "mosquitto_passwd comes with mosquitto"
    users = tmp_path / "passwd"
    subprocess.run([passwd, "-b", "-c", str(users), "agent", "right"], check=True, capture_output=True)
    users.chmod(0o600)
    monkeypatch.setenv("HELIOTROPE_TEST_MQTT_PASSWORD", "wrong")
    name = unique_site()
    with Mosquitto(tmp_path / "mosquitto", extra_config=[f"password_file {users}"]) as server:
        mqtt = server.settings(username="agent", password_env="HELIOTROPE_TEST_MQTT_PASSWORD", reconnect_max_s=0.5)
        agent = SiteAgent(AgentConfig(site=site_spec(name), mqtt=mqtt, heartbeat_s=HEARTBEAT_S))
        try:
            with caplog.at_level("WARNING", logger="adapters.agent"):
                await agent.start()
                await until(lambda: "refused the credentials" in caplog.text, what="the refusal, named")
            assert ("check mqtt.username and the password in the variable mqtt.password_env names "
                    "(HELIOTROPE_TEST_MQTT_PASSWORD)") in caplog.text
        finally:
            await agent.stop()


SMALL_CAP = 16 << 10


async def test_a_reply_or_event_reason_too_long_for_the_mqtt_brokers_cap_is_cut_short_and_still_arrives(tmp_path):
    """A site's own words (an adapter's error, a failed job's reason) can be of any length: sent whole over an
    MQTT broker with a 16 KiB cap, the reply would be dropped (the broker's command times out, not saying why)
    and the event dropped at every resend (the job never ends at the broker). Cut to fit, both arrive."""
    name = unique_site()
    words = "the site said: " + "x" * 50_000

    class Wordy(SimulatedSite):
        async def cancel(self, job_id: str, attempt: int) -> None:
            raise RuntimeError(words)

    with Mosquitto(tmp_path / "mosquitto", extra_config=[f"message_size_limit {SMALL_CAP}"]) as mosq:
        spec = site_spec(name)
        agent = SiteAgent(AgentConfig(site=spec, mqtt=MqttSettings(port=mosq.port, reconnect_max_s=0.5,
                                                                   max_payload_bytes=SMALL_CAP),
                                      heartbeat_s=HEARTBEAT_S, resend_s=0.3),
                          adapter=Wordy(spec, SystemClock()))
        try:
            async with BrokerSide(name, port=mosq.port) as side:
                await agent.start()
                await side.wait_for(lambda m: isinstance(m, Heartbeat))
                await side.send(Cancel(site=name, msg_id="c1", job_id="j1", attempt=1))
                reply = await side.reply("c1")
                assert not reply.ok and reply.reason is not None
                assert reply.reason.startswith("the site said: xxx") and reply.reason.endswith(" [...]")
                assert len(encode(reply)) <= SMALL_CAP
                agent._on_event(JobEvent("j2", 1, EventKind.FAILED, datetime.now(UTC), reason=words))
                _, event = await side.event("j2", EventKind.FAILED)
                assert event.event.reason.startswith("the site said: xxx") and event.event.reason.endswith(" [...]")
        finally:
            await agent.stop()


async def test_a_quota_reply_too_large_for_the_cap_is_answered_not_ok_saying_so(tmp_path):
    """A site's quota state of very many tenants cannot be cut short: the agent answers not ok, naming the
    setting, so the broker's quota command fails at once with the reason, not after its time-out."""
    name = unique_site()
    with Mosquitto(tmp_path / "mosquitto", extra_config=[f"message_size_limit {SMALL_CAP}"]) as mosq:
        spec = site(name, gpus={"a100-80gb": 8}, adapter=SimulatedAdapterConfig(dispatch_delay_s=0.01).model_dump(),
                    quotas=[{"tenant": f"tenant-{i:04d}", "guaranteed_gpus": 0, "burst_gpus": 1} for i in range(300)])
        agent = SiteAgent(AgentConfig(site=spec, mqtt=MqttSettings(port=mosq.port, reconnect_max_s=0.5,
                                                                   max_payload_bytes=SMALL_CAP),
                                      heartbeat_s=HEARTBEAT_S, resend_s=0.3))
        try:
            async with BrokerSide(name, port=mosq.port) as side:
                await agent.start()
                await side.wait_for(lambda m: isinstance(m, Status) and m.online)  # (subscribed by then)
                await side.send(QuotaCommand(site=name, msg_id="q1", op="get"))
                reply = await side.reply("q1")
                assert not reply.ok and reply.quota is None
                assert "mqtt.max_payload_bytes" in (reply.reason or "") and f"({SMALL_CAP})" in reply.reason
        finally:
            await agent.stop()
