"""The broker's side of an agent-run site (``adapters.remote``), without MQTT: a recording hub stands in for
the connection, so each rule of the protocol is checked on its own. The same classes run over a real
Mosquitto in ``tests/test_agent_mqtt.py``."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import aiomqtt
import pytest

from adapters import mqtt_protocol as proto
from adapters.base import AdapterError, EventKind, JobEvent
from adapters.remote import MqttHub, RemoteSite
from broker.clock import SystemClock
from broker.models import Health, Job, MqttSettings, SiteState, Telemetry, TenantQuota
from tests.builders import job, site

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


class RecordingHub(MqttHub):
    """Keeps what the sites publish instead of sending it."""

    def __init__(self) -> None:
        super().__init__(MqttSettings())
        self.sent: list[object] = []
        self.within: list[tuple[str, float | None]] = []  # (kind, what was left of the wait) of each command sent
        self.deadlines: list[tuple[str, tuple[str, int, float] | None]] = []  # (kind, the deadline it named)
        self.connected.set()

    async def publish(self, site: str, msg, qos: int = 1, *, within_s: float | None = None,  # noqa: ANN001
                      resend: bool = False, deadline: tuple[str, int, float] | None = None) -> bool:
        self.sent.append(msg)
        if qos == 1:
            self.within.append((msg.kind, within_s))
            self.deadlines.append((msg.kind, deadline))
        return True

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


def remote(lease_s: float = 0.5, command_timeout_s: float = 0.6, resend_s: float = 0.2) -> tuple[RemoteSite, RecordingHub]:
    spec = site("edge", adapter={"kind": "mqtt", "lease_s": lease_s, "command_timeout_s": command_timeout_s,
                                 "resend_s": resend_s})
    hub = RecordingHub()
    return RemoteSite(spec, SystemClock(), hub), hub


def heartbeat(seq: int, attempts: tuple[tuple[str, int], ...] = (), boot: str = "b1", free: int = 8) -> proto.Heartbeat:
    state = SiteState(site="edge", health=Health.HEALTHY, capacity=[{
        "model": "a100-80gb", "total_gpus": 8, "free_gpus": free, "used_gpus": 8 - free, "memory_gib_per_gpu": 80}])
    return proto.Heartbeat(site="edge", boot=boot, seq=seq, sent_at=datetime.now(UTC), lease_s=15, state=state,
                           attempts=[proto.AttemptReport(job_id=j, attempt=a, status="running") for j, a in attempts])


def a_job(job_id: str = "j1", attempt: int = 1) -> Job:
    return Job(id=job_id, spec=job(), attempt=attempt, created_at=NOW, updated_at=NOW, site="edge")


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.fixture
async def edge():
    site_, hub = remote()
    await site_.start()
    yield site_, hub
    await site_.close()


async def test_a_retained_heartbeat_shows_the_last_state_but_is_no_sign_of_life(edge) -> None:
    s, hub = edge
    s.receive(heartbeat(7), retained=True)
    with pytest.raises(AdapterError, match="no heartbeat"):
        await s.snapshot()
    assert hub.of(proto.LeaseGrant) == []  # no lease for a message that may be hours old
    s.receive(heartbeat(8))
    await settle()
    state = await s.snapshot()
    assert state.health == Health.HEALTHY and state.capacity[0].free_gpus == 8
    assert state.lease_expires_at is not None and state.last_heard_at is not None
    grant = hub.of(proto.LeaseGrant)[-1]
    assert (grant.boot, grant.seq, grant.lease_s) == ("b1", 8, 0.5)


async def test_when_the_lease_runs_out_the_site_is_unhealthy_and_its_attempts_are_lost(edge) -> None:
    s, hub = edge
    s.receive(heartbeat(1, attempts=(("j1", 1),)))
    await settle()
    adm = asyncio.create_task(s.submit(a_job("j2")))
    await asyncio.sleep(0.05)
    dispatch = hub.of(proto.Dispatch)[-1]
    s.receive(proto.Reply(site="edge", msg_id=dispatch.msg_id, ok=True, admitted=True))
    assert (await adm).admitted
    started = time.monotonic()
    events = s.events()
    first = await asyncio.wait_for(anext(events), 2)
    second = await asyncio.wait_for(anext(events), 2)
    assert time.monotonic() - started >= 0.4  # not before the lease has run out
    lost = {(e.job_id, e.attempt) for e in (first, second)}
    assert lost == {("j1", 1), ("j2", 1)} and {first.kind, second.kind} == {EventKind.LOST}
    assert "lease ran out" in first.reason
    with pytest.raises(AdapterError, match="lease ran out"):
        await s.snapshot()
    # Without a lease nothing is dispatched, and a cancel is confirmed at once (the agent has stopped).
    assert not (await s.submit(a_job("j3"))).admitted
    await asyncio.wait_for(s.cancel("j1", 1), 0.1)
    assert s.held_attempts() == set()


async def test_the_offline_will_makes_the_site_unhealthy_but_keeps_its_jobs_until_the_lease_ends(edge) -> None:
    s, _ = edge
    s.receive(heartbeat(1, attempts=(("j1", 1),)))
    s.receive(proto.Status(site="edge", boot="b1", online=False, at=datetime.now(UTC)))
    state = await s.snapshot()
    assert state.health == Health.UNHEALTHY and "went offline" in state.reason
    assert s.held_attempts() == {("j1", 1)}  # not moved before the lease ends
    s.receive(heartbeat(2, attempts=(("j1", 1),)))
    assert (await s.snapshot()).health == Health.HEALTHY


async def test_an_event_is_acknowledged_only_once_applied_and_a_repeat_is_not_applied_twice(edge) -> None:
    s, hub = edge
    s.receive(heartbeat(1))
    ev = proto.WireEvent(job_id="j1", attempt=1, kind=EventKind.RUNNING, at=NOW)
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=4, event=ev))
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=4, event=ev))  # resent before the ack
    events = s.events()
    got = await asyncio.wait_for(anext(events), 1)
    assert got == JobEvent("j1", 1, EventKind.RUNNING, NOW)
    await settle()
    assert hub.of(proto.Ack) == []  # still being applied
    s.taken(got)  # the broker has stored it: acknowledged
    await settle()
    assert [a.msg_ids for a in hub.of(proto.Ack)] == [[4]]
    pending = asyncio.create_task(anext(events))
    await settle()
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=4, event=ev))  # the ack was lost: resent
    await settle()
    assert [a.msg_ids for a in hub.of(proto.Ack)] == [[4], [4]]  # acknowledged again ...
    assert not pending.done()  # ... and not applied again
    pending.cancel()


async def test_an_event_the_broker_could_not_apply_is_not_acknowledged_and_comes_again(edge) -> None:
    # The broker goes on from an event it could not apply (an error other than the store's, logged): the agent
    # is not told it is kept, so it resends it, and the broker tries it again.
    s, hub = edge
    s.receive(heartbeat(1))
    ev = proto.WireEvent(job_id="j1", attempt=1, kind=EventKind.PREEMPTED, at=NOW, run_s=60.0)
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=7, event=ev))
    events = s.events()
    first = await asyncio.wait_for(anext(events), 1)
    pending = asyncio.create_task(anext(events))  # not taken
    await settle()
    assert hub.of(proto.Ack) == [] and not pending.done()
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=7, event=ev))  # the agent's resend
    again = await asyncio.wait_for(pending, 1)
    assert again == first
    s.taken(again)
    await settle()
    assert [a.msg_ids for a in hub.of(proto.Ack)] == [[7]]


async def test_an_attempt_whose_end_was_read_is_not_taken_for_a_stray_while_the_agent_still_lists_it(edge) -> None:
    # The agent lists an attempt until the broker acknowledges its end: for that moment it is known (a restarted
    # broker does not take it for lost) but not held (the broker does not cancel it as a stray).
    s, hub = edge
    s.receive(heartbeat(1, attempts=(("j1", 1),)))
    ev = proto.WireEvent(job_id="j1", attempt=1, kind=EventKind.SUCCEEDED, at=NOW, run_s=5.0)
    s.receive(proto.EventMsg(site="edge", boot="b1", msg_id=3, event=ev))
    events = s.events()
    got = await asyncio.wait_for(anext(events), 1)
    s.receive(heartbeat(2, attempts=(("j1", 1),)))  # sent before the ack reached the agent
    assert ("j1", 1) in await s.known_attempts()
    assert s.held_attempts() == set()
    s.taken(got)


async def test_an_attempt_given_up_when_the_lease_ran_out_is_a_stray_when_the_site_lists_it_again(edge) -> None:
    # The broker's own "lost" at the end of a lease is no end the site reported: an agent back over the site (a
    # Kubernetes Job that outlived it, or a stop that failed) that lists the attempt must have it cancelled.
    s, _ = edge  # lease 0.5 s
    s.receive(heartbeat(1, attempts=(("j1", 1),)))
    lost = await asyncio.wait_for(anext(s.events()), 2)
    assert (lost.job_id, lost.kind) == ("j1", EventKind.LOST)
    s.taken(lost)
    s.receive(heartbeat(0, attempts=(("j1", 1),), boot="b2"))  # a restarted agent adopted it: it still runs
    assert s.held_attempts() == {("j1", 1)}


async def test_a_command_is_resent_until_answered_and_times_out_with_a_clear_error() -> None:
    s, hub = remote(lease_s=30, command_timeout_s=0.5, resend_s=0.1)
    await s.start()
    try:
        s.receive(heartbeat(1))
        with pytest.raises(AdapterError, match="did not answer dispatch within 0.5 s"):
            await s.submit(a_job())
        sent = hub.of(proto.Dispatch)
        assert len(sent) >= 4 and len({d.msg_id for d in sent}) == 1  # the same command, resent
        refused = asyncio.create_task(s.submit(a_job("j2")))
        await asyncio.sleep(0.15)
        s.receive(proto.Reply(site="edge", msg_id=hub.of(proto.Dispatch)[-1].msg_id, ok=True, admitted=False,
                              reason="no room: 9 GPUs asked"))
        adm = await refused
        assert not adm.admitted and adm.reason == "no room: 9 GPUs asked"
    finally:
        await s.close()


async def test_a_command_the_broker_could_not_send_says_so_not_that_the_agent_did_not_answer() -> None:
    # The broker's own MQTT connection is down: the agent was never asked, and its operator is not sent to it.
    spec = site("edge", adapter={"kind": "mqtt", "lease_s": 30, "command_timeout_s": 0.3, "resend_s": 0.1})
    s = RemoteSite(spec, SystemClock(), MqttHub(MqttSettings(host="127.0.0.1", port=1)))  # never connected
    await s.start()
    try:
        with pytest.raises(AdapterError) as caught:
            await s.quota()
        assert "did not answer" not in str(caught.value)
        assert "could not be sent within 0.3 s: the broker is not connected to the MQTT broker 127.0.0.1:1" in str(
            caught.value)
    finally:
        await s.close()


def message(topic: str, payload: bytes, retain: bool = False) -> SimpleNamespace:
    return SimpleNamespace(topic=topic, payload=payload, retain=retain)


async def test_the_hub_counts_and_drops_malformed_payloads_and_keeps_serving(edge) -> None:
    s, hub = edge
    good = proto.encode(heartbeat(3))
    for topic, payload in [
        (proto.topic("edge", "state"), b"{not json"),
        (proto.topic("edge", "state"), b'{"v": 2, "kind": "heartbeat"}'),
        (proto.topic("edge", "up"), b'{"v": 1, "kind": "launch", "site": "edge"}'),
        (proto.topic("other", "state"), good),  # names edge on other's topic
        ("heliotrope/v1/sites/edge/state/extra", good),
        (proto.topic("edge", "state"), b'{"v": 1, "kind": "heartbeat", "site": "edge", "seq": -1}'),
    ]:
        hub._on_message(message(topic, payload))
    assert hub.malformed == {"bad-json": 1, "wrong-version": 1, "wrong-topic": 3, "invalid": 1}
    hub._on_message(message(proto.topic("edge", "state"), good))
    await settle()
    assert (await s.snapshot()).capacity[0].free_gpus == 8


async def test_a_kind_that_is_not_a_string_is_malformed_like_any_unknown_kind(edge) -> None:
    s, hub = edge
    for kind in ("[]", "{}", "7"):
        hub._on_message(message(proto.topic("edge", "up"), f'{{"v": 1, "kind": {kind}, "site": "edge"}}'.encode()))
    assert hub.malformed == {"wrong-topic": 3}


async def test_a_payload_nested_too_deeply_for_the_parser_is_one_more_malformed_message(edge) -> None:
    s, hub = edge
    hub._on_message(message(proto.topic("edge", "up"), b"[" * 100_000))
    assert hub.malformed == {"bad-json": 1}
    hub._on_message(message(proto.topic("edge", "state"), proto.encode(heartbeat(1))))
    await settle()
    assert (await s.snapshot()).health == Health.HEALTHY  # the hub carried on


async def test_an_agent_restarted_within_the_lease_gives_up_what_its_new_process_does_not_hold(edge) -> None:
    s, _ = edge
    s.receive(heartbeat(1, attempts=(("j1", 1), ("j2", 1)), boot="b1"))
    s.receive(heartbeat(2, attempts=(("j1", 1), ("j2", 1)), boot="b1"))
    s.receive(heartbeat(0, attempts=(("j2", 1),), boot="b2"))  # restarted: j2 is still running at the site
    lost = await asyncio.wait_for(anext(s.events()), 1)
    assert (lost.job_id, lost.attempt, lost.kind) == ("j1", 1, EventKind.LOST) and "restarted" in lost.reason
    assert s.held_attempts() == {("j2", 1)}


async def test_a_dispatch_answered_after_the_lease_ran_out_is_given_up_not_admitted(edge) -> None:
    s, hub = edge  # lease 0.5 s
    s.receive(heartbeat(1))
    dispatch = asyncio.create_task(s.submit(a_job("late")))
    await asyncio.sleep(0.05)
    msg_id = hub.of(proto.Dispatch)[-1].msg_id
    lost = await asyncio.wait_for(anext(s.events()), 2)  # the lease runs out while the site deliberates
    assert (lost.job_id, lost.kind) == ("late", EventKind.LOST)
    s.receive(proto.Reply(site="edge", msg_id=msg_id, ok=True, admitted=True))  # ... then it says yes
    with pytest.raises(AdapterError, match="lease ran out while the site admitted"):
        await dispatch


async def test_after_a_broker_restart_a_site_never_heard_holds_nothing_once_a_lease_has_passed(edge) -> None:
    s, _ = edge  # started just now, as after a restart; its agent is gone
    with pytest.raises(AdapterError, match="not heard from yet"):
        await s.known_attempts()  # the previous broker's lease may still run: cannot tell
    await asyncio.sleep(0.6)
    assert await s.known_attempts() == set()  # any lease granted before the restart has ended
    with pytest.raises(AdapterError, match="lease ran out: never heard"):
        await s.snapshot()


async def test_an_old_heartbeat_replayed_renews_nothing_and_restarts_nothing(edge) -> None:
    s, hub = edge
    first = heartbeat(1, attempts=(("j1", 1),), boot="b1", free=0)
    s.receive(first)
    s.receive(heartbeat(9, attempts=(("j1", 1),), boot="b1", free=4))
    grants = len(hub.of(proto.LeaseGrant))
    s.receive(first)  # the same process's seq 1 after its seq 9: no lease for it, and the state stays seq 9's
    assert len(hub.of(proto.LeaseGrant)) == grants and s.stale_heartbeats == 1
    assert (await s.snapshot()).capacity[0].free_gpus == 4
    # A heartbeat of an earlier process, sent before the one taken, is not a restart: j1 is not given up.
    earlier = heartbeat(5, attempts=(), boot="b0")
    s.receive(earlier.model_copy(update={"sent_at": first.sent_at.replace(year=2020)}))
    assert s.stale_heartbeats == 2 and s.held_attempts() == {("j1", 1)}
    # A real restart is taken, and the process it replaced cannot come back.
    s.receive(heartbeat(0, attempts=(("j1", 1),), boot="b2"))
    s.receive(heartbeat(10, attempts=(("j1", 1),), boot="b1"))
    assert s.stale_heartbeats == 3 and s.held_attempts() == {("j1", 1)}


async def test_an_agents_report_is_held_to_its_sites_spec(edge) -> None:
    s, _ = edge  # edge: 8 a100-80gb
    state = SiteState(site="edge", health=Health.HEALTHY, capacity=[
        {"model": "a100-80gb", "total_gpus": 5000, "free_gpus": 5000, "used_gpus": 0, "memory_gib_per_gpu": 80},
        {"model": "h100-80gb", "total_gpus": 1000, "free_gpus": 1000, "used_gpus": 0, "memory_gib_per_gpu": 80}])
    s.receive(heartbeat(1).model_copy(update={"state": state}))
    capacity = (await s.snapshot()).capacity
    assert [(c.model, c.total_gpus, c.free_gpus) for c in capacity] == [("a100-80gb", 8, 8)]
    # A report in another site's name is not this site's.
    other = state.model_copy(update={"site": "other", "capacity": capacity[:1]})
    s.receive(heartbeat(2, free=3).model_copy(update={"state": other}))
    assert (await s.snapshot()).capacity[0].free_gpus == 8


async def test_clock_throttling_reaches_the_broker_and_is_left_off_the_wire_where_a_site_has_none(edge) -> None:
    """A site whose agent reads clock-event reasons shows the share of its GPUs held down; a site without them
    sends the telemetry keys of the earlier release only, so an earlier broker (which forbids keys it does not
    know) still takes its heartbeats."""
    s, hub = edge
    plain = json.loads(proto.encode(heartbeat(1)))["state"]["telemetry"]
    assert set(plain) == {"gpu_utilisation_pct", "memory_used_gib", "memory_total_gib", "temperature_c_max",
                          "power_w", "queue_depth"}
    beat = heartbeat(2)
    measured = Telemetry(temperature_c_max=83.0, **Telemetry.throttle_of([("sw_power_cap", "hw_thermal"), ("idle",)]))
    beat = beat.model_copy(update={"state": beat.state.model_copy(update={"telemetry": measured})})
    hub._on_message(message(proto.topic("edge", "state"), proto.encode(beat)))
    telemetry = (await s.snapshot()).telemetry
    assert telemetry.throttled_pct == 50.0
    assert telemetry.throttle_reasons == {"hw_thermal": 1, "idle": 1, "sw_power_cap": 1}
    doc = json.loads(proto.encode(beat))
    doc["state"]["telemetry"]["throttle_reasons"] = {"Not A Reason; drop table": 1}
    hub._on_message(message(proto.topic("edge", "state"), json.dumps(doc).encode()))
    assert hub.malformed == {"invalid": 1}


@pytest.mark.parametrize("body, field", [
    ({"total_gpus": 2**31, "free_gpus": 0}, "total_gpus"),
    ({"free_gpus": 9}, "free_gpus"),
    ({"memory_gib_per_gpu": float("nan")}, "memory_gib_per_gpu"),
])
async def test_a_heartbeat_with_counts_no_site_has_is_dropped_as_invalid(edge, body, field) -> None:
    s, hub = edge
    doc = json.loads(proto.encode(heartbeat(1)))
    doc["state"]["capacity"][0].update(body)
    hub._on_message(message(proto.topic("edge", "state"), json.dumps(doc).encode()))  # (NaN as JSON's bare token)
    assert hub.malformed == {"invalid": 1}
    with pytest.raises(AdapterError, match="no heartbeat"):
        await s.snapshot()


async def test_an_event_with_a_time_or_a_run_the_store_could_not_keep_is_dropped_as_invalid(edge) -> None:
    s, hub = edge
    for event in ('{"job_id": "j1", "attempt": 1, "kind": "succeeded", "at": "2026-01-05T12:00:00"}',
                  '{"job_id": "j1", "attempt": 1, "kind": "succeeded", "at": "2026-01-05T12:00:00Z", "run_s": Infinity}'):
        hub._on_message(message(proto.topic("edge", "up"),
                                b'{"v": 1, "kind": "event", "site": "edge", "boot": "b1", "msg_id": 1, "event": '
                                + event.encode() + b"}"))
    assert hub.malformed == {"invalid": 2}


async def test_messages_of_a_site_not_registered_here_are_counted_and_named_once(edge, caplog) -> None:
    _, hub = edge
    ghost = proto.encode(heartbeat(1).model_copy(update={"site": "ghost"}))
    for _ in range(3):
        hub._on_message(message(proto.topic("ghost", "state"), ghost))
    assert hub.unknown_sites == {"ghost": 3}
    assert [r.getMessage() for r in caplog.records if "ghost" in r.getMessage()] == [
        "mqtt: a heartbeat from site ghost, which is not registered here (its messages are dropped)"]


async def test_a_heartbeat_or_status_time_without_a_zone_is_invalid(edge) -> None:
    _, hub = edge
    for kind, doc in (("state", json.loads(proto.encode(heartbeat(1)))),
                      ("status", {"v": 1, "kind": "status", "site": "edge", "boot": "b1", "online": True})):
        doc["sent_at" if kind == "state" else "at"] = "2026-01-05T12:00:00"
        hub._on_message(message(proto.topic("edge", kind), json.dumps(doc).encode()))
    assert hub.malformed == {"invalid": 2}


async def test_a_site_not_registered_is_named_at_its_first_live_message_even_after_retained_ones(edge, caplog) -> None:
    _, hub = edge
    ghost = proto.encode(heartbeat(1).model_copy(update={"site": "ghost"}))
    hub._on_message(message(proto.topic("ghost", "state"), ghost, retain=True))
    assert not [r for r in caplog.records if "ghost" in r.getMessage()]
    hub._on_message(message(proto.topic("ghost", "state"), ghost))
    hub._on_message(message(proto.topic("ghost", "state"), ghost))
    assert hub.unknown_sites == {"ghost": 3}
    assert len([r for r in caplog.records if "ghost" in r.getMessage()]) == 1


# --- a list of attempts too long for one heartbeat, in parts ---


def split(beat: proto.Heartbeat, per_part: int) -> tuple[proto.Heartbeat, list[proto.AttemptsPart]]:
    """``beat`` as the agent sends a list too long for it: the heartbeat without it, and the list in parts."""
    chunks = [beat.attempts[i:i + per_part] for i in range(0, len(beat.attempts), per_part)]
    head = beat.model_copy(update={"attempts": [], "attempt_parts": len(chunks)})
    return head, [proto.AttemptsPart(site="edge", boot=beat.boot, seq=beat.seq, part=i, parts=len(chunks),
                                     attempts=chunk) for i, chunk in enumerate(chunks)]


@pytest.fixture
async def patient():
    """A site whose lease does not run out during a test."""
    site_, hub = remote(lease_s=30)
    await site_.start()
    yield site_, hub
    await site_.close()


async def test_a_list_of_attempts_in_parts_counts_once_every_part_has_come_in_any_order(patient) -> None:
    s, hub = patient
    attempts = tuple((f"j{i}", 1) for i in range(7))
    head, parts = split(heartbeat(1, attempts=attempts), per_part=3)
    s.receive(parts[2])  # before its heartbeat
    s.receive(head)
    await settle()
    assert hub.of(proto.LeaseGrant)[-1].seq == 1  # the heartbeat renews the lease on its own
    with pytest.raises(AdapterError, match="list of attempts has not all come yet"):
        await s.known_attempts()  # a broker restarted now must not take the site's jobs for lost
    assert s.held_attempts() == set()
    s.receive(parts[0])
    s.receive(parts[0])  # a duplicate
    assert s.held_attempts() == set()
    s.receive(parts[1])
    assert await s.known_attempts() == set(attempts) == s.held_attempts()
    # A later list lost in part leaves the one held; an older one's late part changes nothing; the next whole
    # list (here one that came in the heartbeat itself) replaces it.
    head2, parts2 = split(heartbeat(2, attempts=attempts[:4]), per_part=3)
    s.receive(head2)
    s.receive(parts2[0])
    s.receive(parts[1])
    assert await s.known_attempts() == set(attempts)
    s.receive(heartbeat(3, attempts=attempts[:2]))
    assert await s.known_attempts() == set(attempts[:2])
    s.receive(parts2[1])  # seq 2 completes after seq 3 was taken: older, dropped
    assert await s.known_attempts() == set(attempts[:2])


async def test_a_restarted_agents_list_in_parts_gives_up_only_what_its_old_process_held(patient) -> None:
    """The old process's attempts that the new one does not list are lost, once its whole list is in, and not
    one dispatched to the new process meanwhile, which a list made before it cannot name."""
    s, hub = patient
    s.receive(heartbeat(1, attempts=(("old", 1), ("kept", 1)), boot="b1"))
    head, parts = split(heartbeat(0, attempts=(("kept", 1), ("adopted", 1)), boot="b2"), per_part=1)
    s.receive(head)
    await settle()
    dispatch = asyncio.create_task(s.submit(a_job("new")))
    await asyncio.sleep(0.05)
    s.receive(proto.Reply(site="edge", msg_id=hub.of(proto.Dispatch)[-1].msg_id, ok=True, admitted=True))
    assert (await dispatch).admitted
    assert s._events.empty()  # nothing given up before the new process's list is in
    for part in parts:
        s.receive(part)
    lost = await asyncio.wait_for(anext(s.events()), 1)
    assert (lost.job_id, lost.kind) == ("old", EventKind.LOST) and "restarted" in lost.reason
    assert s._events.empty()
    assert await s.known_attempts() == {("kept", 1), ("adopted", 1)}
    s.receive(proto.AttemptsPart(site="edge", boot="b1", seq=2, part=0, parts=1, attempts=[]))  # the replaced one
    assert await s.known_attempts() == {("kept", 1), ("adopted", 1)}


async def test_a_heartbeat_that_lists_its_attempts_itself_is_written_as_an_earlier_release_reads_it() -> None:
    """A broker of an earlier release refuses keys it does not know: only a split heartbeat says
    ``attempt_parts``, and a part is a kind such a broker drops on its own."""
    beat = heartbeat(1, attempts=(("j1", 1),))
    assert "attempt_parts" not in json.loads(proto.encode(beat))
    head, parts = proto.split_attempts(beat)
    assert json.loads(proto.encode(head))["attempt_parts"] == 1 and head.attempts == []
    assert proto.decode(proto.topic("edge", "state"), proto.encode(parts[0])) == parts[0]


def test_a_long_list_is_split_into_parts_each_well_under_the_payload_limit() -> None:
    attempts = tuple((f"{i:018d}", 1) for i in range(70_000))  # ids as long as the broker's
    beat = heartbeat(4, attempts=attempts)
    assert len(proto.encode(beat)) > proto.MAX_PAYLOAD_BYTES
    head, parts = proto.split_attempts(beat)
    sizes = [len(proto.encode(p)) for p in parts]
    assert len(parts) == head.attempt_parts > 1 and max(sizes) <= proto.ATTEMPT_PART_BYTES + 1024
    assert [a for p in parts for a in p.attempts] == beat.attempts


@pytest.mark.parametrize("cap", [16 << 10, 64 << 10, 128_000], ids=lambda cap: f"under a cap of {cap} bytes")
def test_a_long_list_is_split_into_parts_that_each_fit_under_the_payload_cap_set(cap: int) -> None:
    attempts = tuple((f"{i:018d}", 1) for i in range(5_000))
    beat = heartbeat(4, attempts=attempts)
    head, parts = proto.split_attempts(beat, cap)
    sizes = [len(proto.encode(p)) for p in [head, *parts]]
    assert max(sizes) <= cap and len(parts) == head.attempt_parts > 1
    assert max(sizes[1:]) > cap * 0.9  # not needlessly many parts
    assert [a for p in parts for a in p.attempts] == beat.attempts


async def test_the_hub_drops_a_payload_over_its_own_cap_as_too_large() -> None:
    hub = MqttHub(MqttSettings(max_payload_bytes=16 << 10))
    edge_ = RemoteSite(site("edge", adapter={"kind": "mqtt"}), SystemClock(), hub)
    await edge_.start()
    try:
        hub._on_message(message(proto.topic("edge", "state"),
                                proto.encode(heartbeat(1, attempts=tuple((f"{i:018d}", 1) for i in range(500))))))
        assert hub.malformed == {"too-large": 1}
        hub._on_message(message(proto.topic("edge", "state"), proto.encode(heartbeat(2))))
        await settle()
        assert (await edge_.snapshot()).health == Health.HEALTHY
    finally:
        await edge_.close()


async def test_a_job_too_large_for_the_payload_cap_is_refused_at_once_saying_why(edge) -> None:
    """Sent, the dispatch would be dropped by the MQTT broker at every resend, and the job wait out the command
    time-out for nothing: the site refuses it at once, naming the setting."""
    s, hub = edge
    hub.settings = MqttSettings(max_payload_bytes=16 << 10)
    s.receive(heartbeat(1))
    big = Job(id="big", spec=job(labels={f"k{i}": "v" * 100 for i in range(200)}), attempt=1, created_at=NOW,
              updated_at=NOW, site="edge")
    started = time.monotonic()
    admission = await s.submit(big)
    assert time.monotonic() - started < 0.1
    assert not admission.admitted and "mqtt.max_payload_bytes (16384)" in (admission.reason or "")
    assert hub.of(proto.Dispatch) == []
    small = asyncio.create_task(s.submit(a_job("small")))  # a job that fits still goes
    await asyncio.sleep(0.05)
    s.receive(proto.Reply(site="edge", msg_id=hub.of(proto.Dispatch)[-1].msg_id, ok=True, admitted=True))
    assert (await small).admitted


# --- commands expire with the wait for them (MQTT 5) ---


@pytest.mark.parametrize(("within_s", "interval_s"), [
    pytest.param(10.0, 8, id="a 10 s wait expires after 8 whole seconds, gone at the MQTT broker within 9"),
    pytest.param(12.0, 10, id="the wait for logs, 12 s, after 10"),
    pytest.param(3.0, 1, id="3 s left expire after 1 s, gone within 2"),
    pytest.param(2.5, 1, id="2.5 s left are the least that 1 s, the shortest interval, fits"),
    pytest.param(0.6, 1, id="less than that still goes with 1 s, the shortest there is"),
])
def test_a_commands_expiry_ends_within_what_is_left_of_its_wait(within_s: float, interval_s: int) -> None:
    assert proto.expiry_interval_s(within_s) == interval_s
    if within_s >= proto.EXPIRY_SLACK_S + 1:  # Mosquitto delivers until the end of the second the interval ends in
        assert interval_s + 1 <= within_s - 0.5


class FakeClient:
    """What an aiomqtt client was asked to publish."""

    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, topic: str, payload: bytes, qos: int = 0, properties=None) -> None:  # noqa: ANN001
        self.published.append((json.loads(payload)["kind"], properties))


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V5, aiomqtt.ProtocolVersion.V311],
                         ids=["mqtt 5", "mqtt 3.1.1"])
async def test_over_mqtt_5_a_command_goes_with_its_expiry_and_a_resend_too_late_for_one_is_not_sent(protocol) -> None:
    hub = MqttHub(MqttSettings())
    hub._client = client = FakeClient()  # type: ignore[assignment]
    hub.connected.set()
    hub.protocol = hub._speaking = protocol  # (a connection of that protocol)
    quota = proto.QuotaCommand(site="edge", msg_id="m-1", op="get")
    assert await hub.publish("edge", quota, within_s=10.0, deadline=("b1", 4, 9.75))
    assert await hub.publish("edge", quota, within_s=2.6, resend=True)
    late = await hub.publish("edge", quota, within_s=2.4, resend=True)
    assert await hub.publish("edge", quota, within_s=0.5)  # the first copy of a short wait goes all the same
    assert await hub.publish("edge", proto.Cancel(site="edge", msg_id="m-2", job_id="j1", attempt=1))
    intervals = [(kind, getattr(props, "MessageExpiryInterval", None)) for kind, props in client.published]
    if protocol == aiomqtt.ProtocolVersion.V5:
        assert not late and hub.skipped_late == 1
        assert intervals == [("quota", 8), ("quota", 1), ("quota", 1), ("cancel", None)]
        assert proto.command_deadline(client.published[0][1]) == ("b1", 4, 9.75)
    else:  # no expiry to give: every copy goes, as before
        assert late and hub.skipped_late == 0
        assert intervals == [("quota", None)] * 4 + [("cancel", None)]


async def test_every_command_but_cancel_goes_with_what_is_left_of_the_wait_for_it() -> None:
    s, hub = remote(lease_s=30, command_timeout_s=0.5, resend_s=0.1)
    await s.start()
    try:
        s.receive(heartbeat(1))
        with pytest.raises(AdapterError, match="did not answer quota within 0.5 s"):
            await s.set_quota(TenantQuota(tenant="vision", guaranteed_gpus=2))
        with pytest.raises(AdapterError, match="did not answer cancel within 0.5 s"):
            await s.cancel("j1", 1)
        quota = [within for kind, within in hub.within if kind == "quota"]
        assert len(quota) >= 3 and quota[0] is not None and 0.45 < quota[0] <= 0.5
        assert all(later is not None and later < earlier for earlier, later in zip(quota, quota[1:]))
        assert {within for kind, within in hub.within if kind == "cancel"} == {None}
        # and with the deadline the agent judges: the wait's end, counted from the heartbeat it received last
        named = [deadline for kind, deadline in hub.deadlines if kind == "quota"]
        assert {(boot, seq) for boot, seq, _ in named} == {("b1", 1)}
        assert all(0.45 < after <= 0.5 + 1.0 for _, _, after in named)  # (the heartbeat came moments before)
        assert {deadline for kind, deadline in hub.deadlines if kind == "cancel"} == {None}
    finally:
        await s.close()


async def test_a_command_before_the_first_heartbeat_names_no_deadline() -> None:
    # Nothing the agent could count from: the MQTT broker's expiry alone holds.
    s, hub = remote(lease_s=30, command_timeout_s=0.3, resend_s=0.1)
    await s.start()
    try:
        with pytest.raises(AdapterError, match="did not answer quota"):
            await s.quota()
        assert {deadline for _, deadline in hub.deadlines} == {None}
    finally:
        await s.close()


@pytest.mark.parametrize(("value", "read"), [
    pytest.param("b1 7 9.500", ("b1", 7, 9.5), id="the boot, the heartbeat and the seconds after it are read"),
    pytest.param("b1 7", None, id="one without its seconds is none"),
    pytest.param("b1 seven 9.5", None, id="one whose heartbeat is not a number is none"),
    pytest.param("b1 7 nan", None, id="one whose seconds are not finite is none"),
])
def test_a_commands_deadline_is_read_from_its_user_property_or_is_none(value: str, read: object) -> None:
    properties = proto.expiring(5)
    properties.UserProperty = [("other", "x"), (proto.DEADLINE_PROPERTY, value)]
    assert proto.command_deadline(properties) == read


def test_a_command_without_properties_or_a_deadline_has_none() -> None:
    assert proto.command_deadline(None) is None  # MQTT 3.1.1
    assert proto.command_deadline(proto.expiring(5)) is None  # (a broker that names none)
    assert proto.command_deadline(proto.expiring(5, ("b1", 3, 1.25))) == ("b1", 3, 1.25)
