"""The Mosquitto fixture the MQTT tests rely on: it carries QoS 1 messages, and after a restart on the same port
a persistent session gets what was queued for it while it was away."""

from __future__ import annotations

import asyncio
import socket

import aiomqtt

from tests.mosquitto import Mosquitto, mosquitto_fixture  # noqa: F401  (registers the fixture "mosquitto")


def client(broker: Mosquitto, identifier: str, *, clean_session: bool = True) -> aiomqtt.Client:
    return aiomqtt.Client("127.0.0.1", broker.port, identifier=identifier, clean_session=clean_session,
                          keepalive=5, timeout=5.0)


async def next_message(c: aiomqtt.Client, timeout_s: float = 5.0) -> aiomqtt.Message:
    async with asyncio.timeout(timeout_s):
        async for message in c.messages:
            return message
    raise AssertionError("the message iterator ended")


async def test_qos1_message_reaches_another_client(mosquitto: Mosquitto) -> None:
    async with client(mosquitto, "sub") as sub, client(mosquitto, "pub") as pub:
        await sub.subscribe("t/hello", qos=1)
        await pub.publish("t/hello", b"hi", qos=1)
        message = await next_message(sub)
    assert str(message.topic) == "t/hello"
    assert message.payload == b"hi"
    assert message.qos == 1


async def test_persistent_session_gets_what_was_queued_across_a_restart(mosquitto: Mosquitto) -> None:
    port = mosquitto.port
    # A persistent session subscribes, then goes away.
    async with client(mosquitto, "heliotrope-test-sub", clean_session=False) as sub:
        await sub.subscribe("t/queued", qos=1)
    # While it is away, a QoS 1 message is queued for it.
    async with client(mosquitto, "pub") as pub:
        await pub.publish("t/queued", b"while you were away", qos=1)
    await asyncio.to_thread(mosquitto.restart)
    assert mosquitto.port == port and mosquitto.starts == 2
    async with client(mosquitto, "heliotrope-test-sub", clean_session=False) as sub:
        message = await next_message(sub)
    assert str(message.topic) == "t/queued"
    assert message.payload == b"while you were away"


def test_kill_and_restart_on_the_same_port(mosquitto: Mosquitto) -> None:
    port, pid = mosquitto.port, mosquitto.pid
    mosquitto.restart(kill=True)
    assert mosquitto.port == port and mosquitto.pid != pid and mosquitto.running
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    mosquitto.stop()
    assert not mosquitto.running
    assert mosquitto.settings().port == port
