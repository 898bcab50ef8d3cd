"""A command the broker stopped waiting for is never carried out by an agent that comes back later, over a real
Mosquitto of the test's own: the broker's commands go with an MQTT 5 Message Expiry Interval that ends within the
wait for their reply, and Mosquitto drops one it still holds for an agent that is away (an agent of 3.1.1, as every
agent is, included). A command the agent takes in time is carried out as before. An MQTT broker that refuses
MQTT 5 is spoken to in 3.1.1, with a warning that commands cannot expire there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import pytest
from aiohttp.test_utils import TestClient, TestServer

from adapters import mqtt_protocol as proto
from adapters.agent import AgentConfig, SiteAgent
from adapters.simulated import SimulatedSite
from broker.api import create_app
from broker.clock import SystemClock
from broker.models import MqttSettings
from broker.service import Broker
from tests.builders import site
from tests.mosquitto import Mosquitto, mosquitto_fixture  # noqa: F401 - the fixture
from tests.test_agent_mqtt import FAST, remote_broker, started_agent, until_edge_reports

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)


def edge(command_timeout_s: float) -> object:
    return site("edge", gpus={"a100-80gb": 16},
                adapter={"kind": "mqtt", "lease_s": 30.0, "command_timeout_s": command_timeout_s, "resend_s": 0.3})


def published_event(b: Broker, kind: str) -> asyncio.Event:
    """Set once the broker's hub has published a command of ``kind`` (to an agent that is away, Mosquitto holds
    it)."""
    assert b.hub is not None
    event = asyncio.Event()
    publish = b.hub.publish

    async def recording(site: str, msg, qos: int = 1, **more) -> bool:  # noqa: ANN001, ANN003
        sent = await publish(site, msg, qos, **more)
        if sent and getattr(msg, "kind", None) == kind:
            event.set()
        return sent

    b.hub.publish = recording  # type: ignore[method-assign]
    return event


async def vision_quota(agent: SiteAgent) -> float | None:
    """The guarantee the agent's site enforces for tenant vision (None: it has no quota for vision)."""
    state = await agent.inner.quota()  # type: ignore[attr-defined]
    return next((t.guaranteed_gpus for t in state.tenants if t.tenant == "vision"), None)


async def test_a_quota_set_the_broker_gave_up_on_is_not_applied_when_the_agent_comes_back(
        tmp_path: Path, mosquitto: Mosquitto) -> None:  # noqa: F811
    # The operator set a quota while the site's agent was away: 503, "did not answer". Mosquitto kept the command
    # in the agent's persistent session, and the agent carried it out when it came back, minutes later, against
    # what the operator was told.
    b = await remote_broker(tmp_path, mosquitto, [edge(command_timeout_s=3.0)], run_loop=False)
    assert b.hub is not None and await b.hub.wait_connected(5) and b.hub.commands_expire
    agent = await started_agent(mosquitto, site("edge", gpus={"a100-80gb": 16}, adapter=FAST))
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    back: SiteAgent | None = None
    try:
        await until_edge_reports(b, collect=True)  # (its persistent session is there: it subscribed)
        await agent.stop()  # away: its session, and what is sent to it, stay at Mosquitto
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6})
        assert r.status == 503, await r.text()
        assert "did not answer quota within 3 s" in (await r.json())["error"]["message"]
        back = await started_agent(mosquitto, site("edge", gpus={"a100-80gb": 16}, adapter=FAST))  # the same session
        # Mosquitto hands a session what it holds for it before anything published after the agent is back: the
        # answer to this read comes after the quota set, had it still been there.
        r = await client.get("/v1/sites/edge/quota")
        assert r.status == 200, await r.text()
        assert [t["tenant"] for t in (await r.json())["tenants"]] == []
        assert await vision_quota(back) is None
        assert (await (await client.get("/healthz")).json())["mqtt"]["commands_expire"] is True
    finally:
        await client.close()
        if back is not None:
            await back.stop()
        await b.stop()


async def test_a_command_the_agent_takes_within_the_wait_is_carried_out(
        tmp_path: Path, mosquitto: Mosquitto) -> None:  # noqa: F811
    # Expiry must not drop a command in time: the agent, away when the operator set the quota, is back within the
    # wait; Mosquitto hands it the command it held, the agent carries it out, and the operator reads 200.
    b = await remote_broker(tmp_path, mosquitto, [edge(command_timeout_s=8.0)], run_loop=False)
    agent = await started_agent(mosquitto, site("edge", gpus={"a100-80gb": 16}, adapter=FAST))
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    back: SiteAgent | None = None
    try:
        await until_edge_reports(b, collect=True)
        await agent.stop()
        published = published_event(b, "quota")
        asked = asyncio.create_task(client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6}))
        await asyncio.wait_for(published.wait(), 5)  # held at Mosquitto for the agent, which is away
        back = await started_agent(mosquitto, site("edge", gpus={"a100-80gb": 16}, adapter=FAST))
        r = await asked
        assert r.status == 200, await r.text()
        assert await vision_quota(back) == 6
    finally:
        await client.close()
        if back is not None:
            await back.stop()
        await b.stop()


class Proxy:
    """A TCP proxy in front of Mosquitto. ``mqtt5=False``: it speaks for an MQTT broker of 3.1.1 only (a CONNECT of
    MQTT 5 is answered "unacceptable protocol version", CONNACK code 1, and closed). :meth:`cut` closes what
    goes through it and refuses new connections until :meth:`mend`: a network that drops one client."""

    def __init__(self, port: int, mqtt5: bool = True) -> None:
        self.upstream = port
        self.mqtt5 = mqtt5
        self.refused = 0
        self.open = True
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def cut(self) -> None:
        self.open = False
        for writer in self._writers:
            writer.close()

    def mend(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        self._writers.add(writer)
        # A side hanging up (the test cutting the connection, Mosquitto or the client closing) ends this connection:
        # what is left is to close the client's side, in ``finally``.
        try:
            head = await reader.readexactly(2)  # the CONNECT's type and (the first byte of) its length
            length, shift, more = head[1] & 0x7F, 7, head[1] & 0x80
            while more:
                byte = (await reader.readexactly(1))[0]
                head += bytes([byte])
                length, shift, more = length | (byte & 0x7F) << shift, shift + 7, byte & 0x80
            body = await reader.readexactly(length)
            if body[6] == 5 and not self.mqtt5:  # (after the protocol name "MQTT" and its length: the level)
                self.refused += 1
                writer.write(b"\x20\x02\x00\x01")
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
            self._writers.add(up_writer)
            up_writer.write(head + body)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            log.debug("proxy: a connection ended (a side hung up)")
        finally:
            writer.close()

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Copy ``source`` to ``sink`` until ``source`` ends or either side fails; then close ``sink``."""
        try:
            with contextlib.suppress(OSError):  # (a side hung up: the copy is over either way)
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
        finally:  # (also when the test cancels it)
            sink.close()


async def behind_an_mqtt_3_1_1_server(
        tmp_path: Path, mosquitto: Mosquitto) -> tuple[Proxy, SiteAgent, Broker]:  # noqa: F811
    """Mosquitto behind a proxy that speaks for an MQTT broker of 3.1.1 only, and the site edge's agent and a broker
    (its loop not run) connected through it."""
    proxy = Proxy(mosquitto.port, mqtt5=False)
    await proxy.start()
    settings = mosquitto.settings().model_copy(update={"port": proxy.port})
    agent = await agent_through(settings, site("edge", gpus={"a100-80gb": 16}, adapter=FAST))
    b = await remote_broker(tmp_path, mosquitto, [edge(command_timeout_s=5.0)], run_loop=False, mqtt=settings)
    return proxy, agent, b


async def test_an_mqtt_broker_that_refuses_mqtt_5_is_spoken_to_in_3_1_1_with_a_warning(
        tmp_path: Path, mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    caplog.set_level(logging.WARNING)
    proxy, agent, b = await behind_an_mqtt_3_1_1_server(tmp_path, mosquitto)
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    try:
        assert b.hub is not None and await b.hub.wait_connected(5)
        await until(lambda: agent.connected, "the agent connects")
        assert proxy.refused == 2  # the broker's hub and the agent asked for MQTT 5 once each
        assert b.hub.protocol == agent.protocol == aiomqtt.ProtocolVersion.V311 and not b.hub.commands_expire
        said = [(r.name, r.levelname) for r in caplog.records if "refuses MQTT 5" in r.getMessage()]
        assert sorted(said) == [("adapters.agent", "WARNING"), ("adapters.remote", "WARNING")]
        assert "commands cannot expire at the MQTT broker" in caplog.text
        await until_edge_reports(b, collect=True)
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6})  # commands work as before
        assert r.status == 200, await r.text()
        assert await vision_quota(agent) == 6
        r = await client.get("/healthz")
        assert (await r.json())["mqtt"]["commands_expire"] is False
    finally:
        await client.close()
        await agent.stop()
        await b.stop()
        await proxy.close()


async def test_a_command_that_reaches_the_agent_after_the_wait_is_dropped_by_the_agent_itself(
        tmp_path: Path, mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Mosquitto still holds the command when the agent comes back: it counts whole seconds (a wait of 1 s is not
    # matched), or an MQTT broker keeps it longer than its expiry says; here its interval is a minute. The agent,
    # the same process whose connection dropped, judges it by the deadline it names, against its own heartbeat.
    monkeypatch.setattr(proto, "expiry_interval_s", lambda within_s: 60)
    proxy = Proxy(mosquitto.port)
    await proxy.start()
    b = await remote_broker(tmp_path, mosquitto, [edge(command_timeout_s=1.0)], run_loop=False)
    spec = site("edge", gpus={"a100-80gb": 16}, adapter=FAST)
    agent = await agent_through(mosquitto.settings().model_copy(update={"port": proxy.port}), spec)
    client = TestClient(TestServer(create_app(b)))
    await client.start_server()
    try:
        await until_edge_reports(b, collect=True)
        assert agent.protocol == aiomqtt.ProtocolVersion.V5
        r = await client.put("/v1/sites/edge/quota/nlp", json={"guaranteed_gpus": 2})  # in time: carried out
        assert r.status == 200, await r.text()
        proxy.cut()  # the agent's network drops; its session, and what is sent to it, stay at Mosquitto
        await until(lambda: not agent.connected, "the agent sees its connection go")
        r = await client.put("/v1/sites/edge/quota/vision", json={"guaranteed_gpus": 6})
        assert r.status == 503, await r.text()
        proxy.mend()
        await until(lambda: agent.connected, "the agent connects again")
        r = await client.get("/v1/sites/edge/quota")  # (answered after what Mosquitto held for the agent)
        assert r.status == 200, await r.text()
        assert [t["tenant"] for t in (await r.json())["tenants"]] == ["nlp"]
        assert await vision_quota(agent) is None and agent.expired == 1
    finally:
        await client.close()
        await agent.stop()
        await b.stop()
        await proxy.close()


async def agent_through(mqtt: MqttSettings, spec: object) -> SiteAgent:
    """The agent of the simulated site ``spec``, started, reaching the MQTT broker through ``mqtt`` (it connects
    again 0.2 s after its connection drops)."""
    config = AgentConfig(site=spec, mqtt=mqtt.model_copy(update={"reconnect_max_s": 0.2}), heartbeat_s=0.2,
                         resend_s=0.3)
    agent = SiteAgent(config, adapter=SimulatedSite(spec, SystemClock()))
    await agent.start()
    return agent


async def until(what: Callable[[], bool], why: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {why}"
        await asyncio.sleep(0.02)


async def test_after_falling_back_to_3_1_1_each_new_connection_asks_for_mqtt_5_again(
        tmp_path: Path, mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The MQTT broker upgraded (or replaced) behind the same address: the broker's hub and the agent speak MQTT 5
    again once their connection of 3.1.1 ends, and commands expire again; while it still refuses 5, each
    reconnection falls back at once, warned about once."""
    caplog.set_level(logging.INFO)
    proxy, agent, b = await behind_an_mqtt_3_1_1_server(tmp_path, mosquitto)
    try:
        assert b.hub is not None and await b.hub.wait_connected(5)
        await until(lambda: agent.connected, "the agent connects")
        assert not b.hub.commands_expire and agent.protocol == aiomqtt.ProtocolVersion.V311
        connects = b.hub.connects
        proxy.cut()  # the connections drop; the MQTT broker still refuses 5
        proxy.mend()
        await until(lambda: b.hub.connects > connects and agent.connected and proxy.refused >= 4,
                    "both reconnect, asking for 5 first")
        assert not b.hub.commands_expire and agent.protocol == aiomqtt.ProtocolVersion.V311
        refusals = [r.levelname for r in caplog.records if "refuses MQTT 5" in r.getMessage()]
        assert refusals.count("WARNING") == 2 and refusals.count("INFO") >= 2  # (warned once each)
        proxy.mqtt5 = True  # the MQTT broker now speaks 5
        connects = b.hub.connects
        proxy.cut()
        proxy.mend()
        await until(lambda: b.hub.connects > connects and b.hub.commands_expire and agent.connected
                    and agent.protocol == aiomqtt.ProtocolVersion.V5, "both speak MQTT 5 again")
        await until_edge_reports(b, collect=True)
    finally:
        await agent.stop()
        await b.stop()
        await proxy.close()
