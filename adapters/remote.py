"""A site run by a site agent (``heliotrope agent``), seen from the broker through MQTT.

:class:`MqttHub` is the broker's one MQTT connection: it subscribes to every site's agent-to-broker topics
(``adapters.mqtt_protocol``), hands each message to the :class:`RemoteSite` of its site, and publishes what
the sites send down. It reconnects by itself (backoff up to ``reconnect_max_s``) and never crashes on a
payload: a malformed one is counted in ``malformed`` by reason, logged and dropped.

:class:`RemoteSite` is a :class:`~adapters.base.SiteAdapter` like any other, so the scheduling cycle and the
lifecycle treat it as they treat a local site:

- ``snapshot`` returns the latest heartbeat's state. A site never heard live, or silent past its lease, is
  an error (the federation marks it unhealthy); a site whose agent's connection died (the last will) but
  whose lease still runs is reported unhealthy: it takes no new work, and its jobs stay where they are.
- ``submit``, ``cancel`` and the quota calls are commands, resent every ``resend_s`` until the agent's reply
  arrives or ``command_timeout_s`` passes (then :class:`~adapters.base.AdapterError`). Every one but ``cancel``
  expires with that wait (``mqtt_protocol``, "Commands expire"): the hub speaks MQTT 5 where the MQTT broker
  takes it, and an agent that was away never carries out what the broker told its caller had failed.
- ``events`` yields the agent's job events; each is acknowledged to the agent once the broker has applied
  it (when the consumer asks for the next one), so an event is resent until the broker has it. A repeated
  event is acknowledged again and not applied twice.
- The lease: every live heartbeat is answered with a grant of ``lease_s``, counted from when the broker
  received it. When a lease runs out, the site yields a ``lost`` event for every attempt it holds, so the
  lifecycle requeues them elsewhere; from then on a cancel is confirmed at once, since an agent that could
  not renew its lease has stopped its jobs by then (the protocol's promise), and refuses new ones until it
  holds a lease again.
- ``known_attempts`` is what the latest live heartbeat listed: the lifecycle cancels the attempts a site
  holds that the broker no longer has there (a site back from a partition, an agent restarted). A list too
  long for the heartbeat comes in parts (``mqtt_protocol``, "Long lists of attempts") and counts once all
  have come; until then the site cannot tell (an ``AdapterError``: a restarted broker asks again).

- ``logs`` is a command too (``mqtt_protocol``, "Logs"), waited for ``LOGS_WAIT_S`` (longer than the agent's own
  wait for its site, so a current agent always answers). No answer while the agent's heartbeats kept coming is an
  agent of an earlier release, which drops the request it does not know: :class:`~adapters.base.LogsUnsupported`,
  saying so; no answer and no heartbeat either is an ``AdapterError`` (the site is not heard from).
  ``follow_logs`` (``LogFollower``) asks the same with ``follow``, and relays the agent's ``log_chunk`` messages as
  they come, holding at most ``FOLLOW_BUFFER_BYTES`` of them (a reader slower than that ends the follow), until the
  last; it ends with an ``AdapterError`` at a lost chunk, or where the agent restarted or is no longer heard from;
  it sends ``logs_stop`` when its reader leaves first, and for a ``log_chunk`` it has no reader for (of a follow
  begun by a broker process before this one, which stopped without saying so).

A retained heartbeat delivered when the broker subscribes is the site's last known state, not a sign of
life: it fills in capacity for display but renews no lease.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import aiomqtt
from pydantic import BaseModel

from adapters.base import (Admission, AdapterError, EventKind, JobEvent, JobLogs, LogFollow, LogsNotFound,
                           LogsUnsupported)
from adapters import mqtt_protocol as proto
from policies.quota import QuotaBeyondSite
from broker.clock import Clock
from broker.models import Health, Job, MqttSettings, QuotaState, RemoteAdapterConfig, SiteSpec, SiteState, TenantQuota

log = logging.getLogger(__name__)

LOGS_WAIT_S = proto.LOGS_ANSWER_S + 4.0
"""How long the broker waits for an agent's answer to ``logs``: the agent's own wait for its site, and a margin."""

FOLLOW_BUFFER_BYTES = 4 << 20
"""How much of a followed log (characters of its ``log_chunk`` messages) the broker holds for a reader at most."""
FOLLOW_CHECK_S = 5.0
"""How often a quiet followed log looks whether its agent is still heard from (and the same process)."""

PARTS_KEPT = 4
"""Split lists of attempts (of as many heartbeats) a site keeps while their parts come in; an older one is
dropped, and a later heartbeat's list stands in for it."""


class MqttHub:
    """The broker's MQTT connection, shared by every remote site."""

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = settings
        self.identifier = settings.client_id or "heliotrope-broker"
        self.malformed: Counter[str] = Counter()
        self.received = 0
        self.connected = asyncio.Event()
        self._sites: dict[str, RemoteSite] = {}
        # (site, kind) -> the retained heartbeat or status, for a site that attaches later (bounded: retained
        # messages of sites never registered here would otherwise pile up)
        self._retained: proto.Bounded = proto.Bounded(100_000)
        self.unknown_sites: proto.Bounded = proto.Bounded(1_000)  # site -> messages for it while not registered
        self._named: proto.Bounded = proto.Bounded(1_000)  # unknown sites whose live message was logged
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.connects = 0
        # Each connection asks for MQTT 5, and falls back to 3.1.1 where the MQTT broker refuses it: only an MQTT 5
        # publish carries the Message Expiry Interval that keeps a command from outliving the wait for it.
        self.protocol = aiomqtt.ProtocolVersion.V5  # what the next (or current) connection asks for
        self._speaking = aiomqtt.ProtocolVersion.V5  # what the current (or last) connection speaks
        self._refused_mqtt5 = False  # an MQTT broker refused MQTT 5 once (the warning is then said once)
        self.skipped_late = 0  # resends not sent: too late in the wait for any whole-second expiry to hold

    def attach(self, site: RemoteSite) -> None:
        self._sites[site.name] = site
        for kind in ("heartbeat", "status"):  # what the MQTT broker kept for it: its last known state
            retained = self._retained.get((site.name, kind))
            if retained is not None:
                site.receive(retained, retained=True)

    def detach(self, site: RemoteSite) -> None:
        if self._sites.get(site.name) is site:
            del self._sites[site.name]

    async def start(self) -> None:
        if self._task is None:
            self._closed = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mqtt-hub")

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.connected.wait()
        return self.connected.is_set()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.connected.clear()

    def oversize(self, msg: BaseModel) -> str | None:
        """Why ``msg`` cannot go down to an agent (its payload is over ``mqtt.max_payload_bytes``), or None."""
        kind = getattr(msg, "kind", "message")
        return proto.too_large(proto.encode(msg), self.settings.max_payload_bytes, f"the {kind}")

    @property
    def commands_expire(self) -> bool:
        """Whether the connection is MQTT 5, whose commands the MQTT broker drops once their wait is over (the
        last connection's, while none is up)."""
        return self._speaking == aiomqtt.ProtocolVersion.V5

    async def publish(self, site: str, msg: BaseModel, qos: int = 1, *, within_s: float | None = None,
                      resend: bool = False, deadline: tuple[str, int, float] | None = None) -> bool:
        """Send ``msg`` down to ``site``'s agent. False when not connected (the caller's resend covers it), or
        when ``msg`` is over ``mqtt.max_payload_bytes`` (logged: the MQTT broker would drop it, or close the
        connection for it; :meth:`RemoteSite.submit` refuses such a job before it comes to that).

        ``within_s``: seconds from now after which the message must not reach the agent (what is left of the wait
        for its reply). Over MQTT 5 it goes with a Message Expiry Interval (:func:`proto.expiry_interval_s`), so
        the MQTT broker drops it where it still holds it for an agent that is away; a ``resend`` (a copy went out
        already) too late in the wait for that to hold is not sent (False); ``deadline`` goes with it as the
        user property an agent of MQTT 5 judges (``proto.expiring``). Over MQTT 3.1.1 it cannot expire."""
        client = self._client
        if client is None or not self.connected.is_set():
            return False
        payload = proto.encode(msg)
        kind = getattr(msg, "kind", "message")
        why = proto.too_large(payload, self.settings.max_payload_bytes, f"a {kind} for site {site}")
        if why is not None:
            log.error("mqtt: %s: not sent", why)
            return False
        properties = None
        if within_s is not None and self.commands_expire:
            if resend and within_s < proto.EXPIRY_SLACK_S + 1:
                self.skipped_late += 1
                return False
            properties = proto.expiring(proto.expiry_interval_s(within_s), deadline)
        try:
            await client.publish(proto.topic(site, "down"), payload, qos=qos, properties=properties)
            return True
        except aiomqtt.MqttError as e:
            log.debug("mqtt: publish to %s failed: %s", site, e)
            return False

    async def _run(self) -> None:
        delay = 0.1
        while not self._closed:
            failed: aiomqtt.MqttError | None = None
            try:
                options = proto.client_options(self.settings, self.identifier, self.protocol)
                async with aiomqtt.Client(**options) as client:
                    for sub in proto.UP_SUBSCRIPTIONS:
                        await client.subscribe(sub, qos=1)
                    self._client = client
                    self._speaking = self.protocol
                    self.connected.set()
                    self.connects += 1
                    delay = 0.1
                    log.info("mqtt: connected to %s:%d (MQTT %s)", self.settings.host, self.settings.port,
                             "5" if self.commands_expire else "3.1.1")
                    async for message in client.messages:
                        self._on_message(message)
            except aiomqtt.MqttError as e:
                if self.protocol == aiomqtt.ProtocolVersion.V5 and proto.refuses_mqtt5(e):
                    self.protocol = aiomqtt.ProtocolVersion.V311
                    # (said at WARNING the first time; again at INFO, as each later connection asks for 5 first)
                    log.log(logging.INFO if self._refused_mqtt5 else logging.WARNING,
                            "mqtt: the MQTT broker %s:%d refuses MQTT 5 (%s); connecting with MQTT 3.1.1, over "
                            "which commands cannot expire at the MQTT broker: one an agent receives after the "
                            "broker stopped waiting for it (the agent was away) is still carried out. Use an "
                            "MQTT broker that speaks MQTT 5 (Mosquitto 1.6 or later)", self.settings.host,
                            self.settings.port, e)
                    self._refused_mqtt5 = True
                    continue  # (at once: the MQTT broker answered)
                failed = e
            except Exception:  # whatever it was, the connection must come back
                log.exception("mqtt: the connection failed; reconnecting in %.1f s", delay)
            finally:
                self._client = None
                self.connected.clear()
            # A connection of 3.1.1 that ended: the next one asks for MQTT 5 again (the MQTT broker may have been
            # upgraded or replaced meanwhile), and falls back at once where it is still refused.
            self.protocol = aiomqtt.ProtocolVersion.V5
            if failed is not None:  # (said once the connection is marked down: the advice may take a probe)
                advice = await proto.connection_advice(failed, self.settings)
                log.warning("mqtt: connection to %s:%d lost or refused (%s%s); reconnecting in %.1f s",
                            self.settings.host, self.settings.port, failed, advice, delay)
            await asyncio.sleep(delay)
            delay = min(self.settings.reconnect_max_s, delay * 2)

    def _on_message(self, message: aiomqtt.Message) -> None:
        self.received += 1
        name = str(message.topic)
        try:
            msg = proto.decode(name, message.payload if isinstance(message.payload, bytes | bytearray) else b"",
                               self.settings.max_payload_bytes)
        except proto.MalformedMessage as e:
            self.malformed[e.reason] += 1
            log.warning("mqtt: dropped a malformed message on %s: %s", name, e)
            return
        except Exception as e:  # a payload that broke the decoder itself: still only that payload is lost
            self.malformed["undecodable"] += 1
            log.warning("mqtt: dropped a message on %s that could not be decoded: %r", name, e)
            return
        if msg is None:
            return  # a retained message cleared
        retained = bool(message.retain)
        if retained and isinstance(msg, proto.Heartbeat | proto.Status):
            self._retained[(msg.site, msg.kind)] = msg  # for a site that attaches later (at start-up)
        site = self._sites.get(msg.site)
        if site is None:  # an agent of a site not (or no longer) registered here
            self.unknown_sites[msg.site] = self.unknown_sites.get(msg.site, 0) + 1
            if not retained and msg.site not in self._named:
                self._named[msg.site] = True
                log.warning("mqtt: a %s from site %s, which is not registered here (its messages are dropped)",
                            msg.kind, msg.site)
            return
        try:
            site.receive(msg, retained=retained)
        except Exception:  # a site's bug must not take the connection down
            log.exception("mqtt: site %s could not take a %s message", msg.site, msg.kind)


class _Follow:
    """The chunks of one followed log as they come (``RemoteSite.receive``), in order: a repeat dropped, a gap or an
    overflow of ``FOLLOW_BUFFER_BYTES`` ending it with an error."""

    def __init__(self) -> None:
        self._chunks: collections.deque[str] = collections.deque()
        self._held = 0  # characters in _chunks
        self._seq = 0  # the latest taken
        self._came = asyncio.Event()
        self.ended = False  # the last chunk came (or the follow broke): nothing to stop at the agent
        self._error: str | None = None

    def take(self, msg: proto.LogChunk) -> None:
        if msg.seq <= self._seq or self.ended:
            return  # a repeat (QoS 1 delivers at least once)
        if msg.seq != self._seq + 1:
            self._error = f"part {self._seq + 1} of the log was lost on the way (part {msg.seq} came)"
        elif self._held + len(msg.text) > FOLLOW_BUFFER_BYTES:
            self._error = f"the reader took the log slower than the site wrote it ({FOLLOW_BUFFER_BYTES} held)"
        else:
            self._chunks.append(msg.text)
            self._held += len(msg.text)
            if msg.end and msg.reason:
                self._error = msg.reason
        self._seq = msg.seq
        self.ended = msg.end or self._error is not None
        self._came.set()

    async def next(self) -> str | None:
        """The next chunk; None after the last. AdapterError where the follow broke."""
        while not self._chunks and not self.ended:
            self._came.clear()
            await self._came.wait()
        if self._chunks:
            text = self._chunks.popleft()
            self._held -= len(text)
            return text
        if self._error is not None:
            raise AdapterError(self._error)
        return None


class RemoteSite:
    """A :class:`~adapters.base.SiteAdapter` whose site is run by an agent over MQTT (see the module doc)."""

    def __init__(self, spec: SiteSpec, clock: Clock, hub: MqttHub) -> None:
        assert isinstance(spec.adapter, RemoteAdapterConfig)
        self.spec = spec
        self.name = spec.name
        self.config: RemoteAdapterConfig = spec.adapter
        self._clock = clock
        self._hub = hub
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]
        self._pending: dict[str, asyncio.Future[proto.Reply]] = {}
        self._follows: dict[str, _Follow] = {}  # logs followed, by the msg_id of their request
        self._unread: proto.Bounded = proto.Bounded(1000)  # follows told to stop with no reader here -> monotonic s
        self._events: asyncio.Queue[tuple[str, int, JobEvent]] = asyncio.Queue()
        self._queued: set[tuple[str, int]] = set()  # (boot, msg id) waiting in _events
        self._applied: proto.Bounded = proto.Bounded(100_000)  # recently acknowledged events
        self._current: tuple[str, int, JobEvent] | None = None  # the event the consumer reads, until taken
        self._state: SiteState | None = None  # the latest heartbeat's state
        self._boot: str | None = None
        self._seq = -1  # the latest live heartbeat's sequence number, in self._boot
        self._sent_at: datetime | None = None  # ... and when the agent sent it
        self._replaced: proto.Bounded = proto.Bounded(64)  # boots a newer one replaced: their heartbeats are old
        self.stale_heartbeats = 0  # heartbeats dropped as older than one already taken (replays, duplicates)
        self._said: set[str] = set()  # what _checked has logged once already (every heartbeat would say it again)
        self._heard_mono: float | None = None  # monotonic s of the latest live heartbeat
        self._heard_at: datetime | None = None
        # Until the first live heartbeat, a lease the previous broker process granted may still run: it ends
        # at the latest one lease after this one started (start() sets it).
        self._lease_end = math.inf
        self._lapsed = False  # the lease ran out and its attempts were given up; a heartbeat renews it
        self._attempts: set[tuple[str, int]] = set()  # what the latest live heartbeat listed
        # Whose list _attempts is: (boot, seq) of its heartbeat (a list split in parts is taken in seq order);
        # _list_held: the list is of the agent process now heard, and no lease ran out since.
        self._listed_by: tuple[str, int] | None = None
        self._list_held = False
        self._parts: proto.Bounded = proto.Bounded(PARTS_KEPT)  # (boot, seq) -> (parts, {part: [(job, attempt)]})
        # What a replaced agent process may have held: given up, less what its successor lists, once that list
        # is in (at once where it comes whole with the heartbeat).
        self._orphans: set[tuple[str, int]] = set()
        self._ours: set[tuple[str, int]] = set()  # attempts admitted, being dispatched, or listed; not ended
        # Attempts whose end, as their agent reported it, the broker has read: an agent lists one until the broker
        # acknowledges its end, and such a listing must not make it ours again.
        self._ended: proto.Bounded = proto.Bounded(100_000)
        self._offline_at: datetime | None = None
        self._watch: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[bool]] = set()
        self._closed = False

    # --- life ---

    async def start(self) -> None:
        self._lease_end = time.monotonic() + self.config.lease_s
        self._hub.attach(self)
        self._watch = asyncio.get_running_loop().create_task(self._watch_lease(), name=f"lease-{self.name}")

    async def close(self) -> None:
        self._closed = True
        self._hub.detach(self)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for fut in self._pending.values():
            fut.cancel()

    # --- what the hub hands over ---

    def receive(self, msg: Any, retained: bool = False) -> None:
        match msg:
            case proto.Heartbeat():
                self._on_heartbeat(msg, retained)
            case proto.AttemptsPart():
                if not retained:  # (the agent never retains one; one left there by hand says nothing of now)
                    self._on_part(msg)
            case proto.Status():
                if retained and msg.online:
                    return  # an old "online" says nothing about now
                if not msg.online:
                    self._offline_at = msg.at if retained else self._clock.now()
                elif msg.boot == self._boot or self._offline_at is not None:
                    self._offline_at = None
            case proto.EventMsg():
                key = (msg.boot, msg.msg_id)
                if key in self._applied:
                    self._send(proto.Ack(site=self.name, boot=msg.boot, msg_ids=[msg.msg_id]))
                elif key not in self._queued:
                    self._queued.add(key)
                    self._events.put_nowait((msg.boot, msg.msg_id, msg.event.job_event()))
            case proto.Reply():
                fut = self._pending.get(msg.msg_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case proto.LogChunk():
                follow = self._follows.get(msg.follow)
                if follow is not None:
                    follow.take(msg)
                elif not msg.end:
                    self._stop_unread(msg.follow)

    def _on_heartbeat(self, hb: proto.Heartbeat, retained: bool) -> None:
        state = self._checked(hb.state)
        if state is None:
            return
        if retained:
            if self._state is None:  # the last known state, for display; no lease
                self._state = state
            return
        if self._stale(hb):
            self.stale_heartbeats += 1
            log.warning("site %s: dropped a heartbeat older than one already taken (boot %s, seq %d, sent %s): a "
                        "replay or a duplicate", self.name, hb.boot, hb.seq, hb.sent_at.isoformat())
            return
        if self._boot is not None and hb.boot != self._boot:
            # A new agent process holds only what it found still running at its site: whatever else the old
            # one ran is gone (and the new one refuses work until this broker grants it a lease).
            self._orphans |= self._ours
            self._replaced[self._boot] = True
        self._state = state
        self._boot = hb.boot
        self._seq, self._sent_at = hb.seq, hb.sent_at
        self._heard_mono = time.monotonic()
        self._heard_at = self._clock.now()
        self._lease_end = self._heard_mono + self.config.lease_s
        self._offline_at = None
        if self._lapsed:
            log.info("site %s: heard from its agent (boot %s); it holds a lease again", self.name, hb.boot)
        self._lapsed = False
        if hb.attempt_parts is None:
            self._take_list(hb.boot, hb.seq, {(a.job_id, a.attempt) for a in hb.attempts})
        else:
            self._take_parts(hb.boot)  # where its parts came first
        self._send(proto.LeaseGrant(site=self.name, boot=hb.boot, seq=hb.seq, lease_s=self.config.lease_s))

    def _on_part(self, part: proto.AttemptsPart) -> None:
        """Keep one part of a split list of attempts, and take the list once all its parts are in. A part of a
        replaced agent process, or of a heartbeat no newer than the list held, is dropped; a repeated part
        replaces itself."""
        if part.boot in self._replaced or part.part >= part.parts:
            return
        if self._listed_by is not None and part.boot == self._listed_by[0] and part.seq <= self._listed_by[1]:
            return
        key = (part.boot, part.seq)
        entry = self._parts.get(key)
        if entry is None or entry[0] != part.parts:
            entry = (part.parts, {})
        entry[1][part.part] = [(a.job_id, a.attempt) for a in part.attempts]
        self._parts[key] = entry
        if part.boot == self._boot:
            self._take_parts(part.boot)

    def _take_parts(self, boot: str) -> None:
        """Take the newest list of ``boot`` (the agent process heard live) whose parts are all in, if it is newer
        than the one held. Nothing while the lease has run out: the heartbeat that renews it takes it."""
        if self._lapsed or self._expired:
            return
        complete = [seq for (b, seq), (parts, got) in self._parts.items() if b == boot and len(got) == parts]
        if not complete:
            return
        seq = max(complete)
        if self._listed_by is not None and self._listed_by[0] == boot and seq <= self._listed_by[1]:
            return
        parts, got = self._parts[(boot, seq)]
        self._take_list(boot, seq, {key for i in range(parts) for key in got[i]})

    def _take_list(self, boot: str, seq: int, listed: set[tuple[str, int]]) -> None:
        """The attempts the agent process ``boot`` listed with its heartbeat ``seq``: what the site holds now."""
        if self._orphans:
            why = f"the site's agent restarted (boot {boot}) without it"
            self._give_up((self._orphans & self._ours) - listed, why)
            self._orphans = set()
        self._listed_by = (boot, seq)
        self._list_held = True
        self._attempts = listed
        self._ours |= {key for key in listed if key not in self._ended}
        for key in [k for k in self._parts if k[0] != boot or k[1] <= seq]:
            del self._parts[key]

    def _stale(self, hb: proto.Heartbeat) -> bool:
        """Whether a live heartbeat is older than one already taken: of the same agent process with no higher
        sequence number, of a process a newer one replaced, or of another process but sent before the latest
        one taken while that one's lease runs (so a replayed heartbeat of an earlier process does not pass for
        a restart; an agent restarted with its clock set back is taken once the old process's lease ran out)."""
        if hb.boot == self._boot:
            return hb.seq <= self._seq
        if hb.boot in self._replaced:
            return True
        return self._sent_at is not None and hb.sent_at <= self._sent_at and not self._expired

    def _checked(self, state: SiteState) -> SiteState | None:
        """An agent's report as the broker takes it: None (dropped, with a log line) where it speaks for another
        site; GPU models the site's spec does not have left out, and counts above the spec's cut to it."""
        if state.site != self.name:
            self._once(f"site {self.name}: dropped a heartbeat whose state is of site {state.site!r} (and will "
                       "drop each one that is)")
            return None
        totals = self.spec.total_gpus()
        capacity = []
        changed = False
        for c in state.capacity:
            most = totals.get(c.model)
            if most is None:
                changed = True
                self._once(f"site {self.name}: its agent reports {c.model} GPUs, a model its spec does not have; "
                           "they are left out")
                continue
            if c.total_gpus > most:
                self._once(f"site {self.name}: its agent reports more {c.model} GPUs than its spec has ({most}); "
                           f"counted as {most}")
                c = c.model_copy(update={"total_gpus": most, "free_gpus": min(c.free_gpus, most),
                                         "used_gpus": min(c.used_gpus, most)})
                changed = True
            capacity.append(c)
        return state.model_copy(update={"capacity": capacity}) if changed else state

    def _once(self, text: str) -> None:
        if text not in self._said and len(self._said) < 100:
            self._said.add(text)
            log.warning("%s", text)

    def _stop_unread(self, follow: str) -> None:
        """A part of a followed log no reader here waits for: one this broker stopped (its ``logs_stop`` crossed
        it), or one a broker process before this one began (it stopped, or lost the lead, with the follow open).
        The agent is told to stop it (again at most every ``FOLLOW_CHECK_S`` while its parts keep coming), so it
        does not read its site's log for nobody, holding one of its ``FOLLOWS_MAX``, until the attempt ends."""
        now = time.monotonic()
        told = self._unread.get(follow)
        if told is not None and now - told < FOLLOW_CHECK_S:
            return
        self._unread[follow] = now
        self._send(proto.LogsStop(site=self.name, follow=follow), qos=1)

    def _send(self, msg: BaseModel, qos: int = 0) -> None:
        """Publish without waiting, at QoS 0 by default: acknowledgements and lease grants, whose loss the agent's
        resends and next heartbeat cover (half the MQTT round trips of QoS 1, at 1,000 sites that counts)."""
        task = asyncio.get_running_loop().create_task(self._hub.publish(self.name, msg, qos=qos))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _give_up(self, attempts: set[tuple[str, int]], why: str) -> None:
        """Report ``attempts`` lost (the lifecycle requeues the current ones and ignores the rest)."""
        now = self._clock.now()
        for job_id, attempt in sorted(attempts):
            self._events.put_nowait(("", 0, JobEvent(job_id, attempt, EventKind.LOST, now, reason=why)))
        self._ours -= attempts

    # --- lease ---

    @property
    def _expired(self) -> bool:
        """The lease has run out: an agent that could not renew it has stopped its jobs by now."""
        return time.monotonic() >= self._lease_end

    async def _watch_lease(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(0.5, self.config.lease_s / 10))
            if self._lapsed or not self._expired:
                continue
            self._lapsed = True
            silent = "never heard since the broker started" if self._heard_mono is None else \
                f"silent for {time.monotonic() - self._heard_mono:.1f} s"
            log.warning("site %s: lease ran out (%s); %d attempts there are given up", self.name, silent,
                        len(self._ours))
            self._give_up(set(self._ours), f"the site's lease ran out ({self.config.lease_s:g} s without a heartbeat)")
            self._attempts.clear()
            self._list_held = False
            self._orphans = set()

    # --- SiteAdapter ---

    async def snapshot(self) -> SiteState:
        if self._expired:
            silent = "never heard" if self._heard_mono is None else f"no heartbeat for {time.monotonic() - self._heard_mono:.0f} s"
            raise AdapterError(f"lease ran out: {silent} (lease {self.config.lease_s:g} s)")
        if self._heard_mono is None:
            raise AdapterError("no heartbeat from the site's agent yet")
        assert self._state is not None and self._heard_at is not None
        expires = self._heard_at + timedelta(seconds=self.config.lease_s)
        update: dict[str, Any] = {"last_heard_at": self._heard_at, "lease_expires_at": expires}
        if self._offline_at is not None:
            update |= {"health": Health.UNHEALTHY,
                       "reason": f"its agent went offline at {self._offline_at.isoformat(timespec='seconds')}; its "
                                 f"jobs move elsewhere if it is not back by {expires.isoformat(timespec='seconds')}"}
        return self._state.model_copy(update=update)

    async def _command(self, make: Any, timeout_s: float | None = None, expires: bool = True,
                       msg_id: str | None = None) -> proto.Reply:
        """Send a command (``make(msg_id)``), resending until the reply comes; AdapterError after ``timeout_s``
        (None: the site's ``command_timeout_s``). ``expires``: each copy goes with what is left of that wait, so
        that the MQTT broker drops one it still holds for an agent that is away once the wait is over
        (:meth:`MqttHub.publish`): the broker has told its caller the command failed, and an agent that came back
        must not carry it out then."""
        msg_id = msg_id or self._msg_id()
        msg = make(msg_id)
        fut: asyncio.Future[proto.Reply] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        wait_s = self.config.command_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        sent = False
        try:
            while True:
                within_s = deadline - time.monotonic() if expires else None
                sent = await self._hub.publish(self.name, msg, within_s=within_s, resend=sent,
                                               deadline=self._deadline(deadline) if expires else None) or sent
                left = deadline - time.monotonic()
                if left <= 0:
                    if not sent and not self._hub.connected.is_set():
                        # The agent was never asked: "it did not answer" would send the operator to the agent.
                        settings = self._hub.settings
                        raise AdapterError(f"site {self.name}: the {msg.kind} could not be sent within {wait_s:g} s: "
                                           f"the broker is not connected to the MQTT broker {settings.host}:"
                                           f"{settings.port} (it connects again by itself)")
                    raise AdapterError(f"site {self.name}: its agent did not answer {msg.kind} within {wait_s:g} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.config.resend_s, left)):
                        return await asyncio.shield(fut)
        finally:
            self._pending.pop(msg_id, None)

    def _deadline(self, deadline_mono: float) -> tuple[str, int, float] | None:
        """``deadline_mono`` (this side's monotonic clock) as the agent can judge it: seconds after this side
        received the latest live heartbeat, named by its agent process and ``seq`` (``mqtt_protocol``, "Commands
        expire"). None before the first live heartbeat: the MQTT broker's expiry alone holds then."""
        if self._boot is None or self._heard_mono is None:
            return None
        return self._boot, self._seq, deadline_mono - self._heard_mono

    async def submit(self, job: Job) -> Admission:
        if self._expired or self._heard_mono is None:
            return Admission.rejected("the site holds no lease (its agent is not heard from)")
        why = self._hub.oversize(proto.Dispatch(site=self.name, msg_id=f"{self._prefix}-{10**12}", job=job))
        if why is not None:  # the MQTT broker would drop it, and the dispatch time out: refused at once, saying why
            return Admission.rejected(f"{why}: the job is too large to send to a site agent; raise "
                                      "mqtt.max_payload_bytes at the broker and the agents as far as the MQTT "
                                      "broker allows")
        key = (job.id, job.attempt)
        self._ours.add(key)  # from now: a lease that runs out during the dispatch gives this attempt up too
        try:
            reply = await self._command(lambda i: proto.Dispatch(site=self.name, msg_id=i, job=job))
        except BaseException:
            self._ours.discard(key)
            raise
        if not reply.ok or not reply.admitted:
            self._ours.discard(key)
            if not reply.ok:
                raise AdapterError(f"site {self.name}: {reply.reason or 'dispatch failed'}")
            return Admission.rejected(reply.reason or "refused")
        if self._expired:
            # Admitted, but the lease ran out meanwhile: the agent has stopped it (or will before its own
            # lease ends). Say so, and the dispatch is withdrawn and the job routed again.
            raise AdapterError(f"site {self.name}: the lease ran out while the site admitted the job")
        return Admission.ok()

    async def cancel(self, job_id: str, attempt: int) -> None:
        self._ours.discard((job_id, attempt))
        if self._expired:
            # An agent without a lease has stopped its jobs and refuses new ones: the attempt cannot be
            # running. Tell it anyway, for when it comes back.
            self._send(proto.Cancel(site=self.name, msg_id=f"{self._prefix}-{next(self._ids)}", job_id=job_id,
                                    attempt=attempt))
            return
        # The one command that does not expire: it stops exactly this attempt, which the broker wants gone for good
        # (no attempt is dispatched twice: a new one has a new number), and where the wait for it ends first the
        # broker keeps asking (Lifecycle.withdraw, then settle; a heartbeat listing it makes it a stray). So a cancel
        # carried out late does what the broker still asks for, the sooner the better.
        reply = await self._command(lambda i: proto.Cancel(site=self.name, msg_id=i, job_id=job_id, attempt=attempt),
                                    expires=False)
        if not reply.ok:
            raise AdapterError(f"site {self.name}: cancel failed: {reply.reason}")

    async def preempt(self, job_id: str, attempt: int, reason: str) -> None:
        """Have the agent's site checkpoint and stop a running attempt (``Preempter``); its ``preempted``
        event comes back as any event does. Raises ``AdapterError`` when the agent cannot (its site's adapter
        has no such request) or does not answer in time."""
        if self._expired:
            raise AdapterError(f"site {self.name}: its lease has run out; its jobs are being stopped anyway")
        reply = await self._command(lambda i: proto.Preempt(site=self.name, msg_id=i, job_id=job_id, attempt=attempt,
                                                            reason=reason[:1000]))
        if not reply.ok:
            raise AdapterError(f"site {self.name}: preempt failed: {reply.reason}")

    def _msg_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        """What the attempt printed, from the agent's site (``LogReader``; see the module doc for an agent of an
        earlier release). The agent cuts the text from its start to fit a message: ``truncated`` says so."""
        reply = await self._logs_request(self._msg_id(), job_id, attempt, tail_lines, limit_bytes, False)
        assert reply.logs is not None
        return reply.logs.job_logs()

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        """The attempt's log followed at the agent's site (``LogFollower``; ``mqtt_protocol``, "Logs"): the tail,
        then what the attempt prints, as the agent's ``log_chunk`` messages bring it."""
        msg_id = self._msg_id()
        follow = self._follows[msg_id] = _Follow()  # (before the request: a chunk may come before the reply)
        try:
            reply = await self._logs_request(msg_id, job_id, attempt, tail_lines, limit_bytes, True)
        except BaseException:
            del self._follows[msg_id]
            raise
        assert reply.logs is not None
        chunks = self._relay(msg_id, follow)
        await anext(chunks)  # (started: closing it now tells the agent to stop)
        return LogFollow(reply.logs.truncated, reply.logs.source, chunks)

    async def _relay(self, msg_id: str, follow: _Follow) -> AsyncGenerator[str, None]:
        """A followed log's chunks as they come, until the last; ``logs_stop`` to the agent if its reader leaves
        first. AdapterError where a chunk was lost, the buffer overflowed, or the agent is gone or restarted."""
        boot = self._boot
        try:
            yield ""
            while True:
                try:
                    async with asyncio.timeout(FOLLOW_CHECK_S):
                        chunk = await follow.next()
                except TimeoutError:
                    if self._expired or self._boot != boot:
                        raise AdapterError(f"site {self.name}: its agent is no longer heard from, or was restarted; "
                                           "the log is no longer followed") from None
                    continue
                if chunk is None:
                    return
                if chunk:
                    yield chunk
        finally:
            del self._follows[msg_id]
            if not follow.ended:
                self._unread[msg_id] = time.monotonic()  # (parts already on their way need no stop of their own)
                await self._hub.publish(self.name, proto.LogsStop(site=self.name, follow=msg_id))

    async def _logs_request(self, msg_id: str, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int,
                            follow: bool) -> proto.Reply:
        """The agent's ok reply to ``logs`` (followed or not); the errors of :class:`~adapters.base.LogReader`."""
        if self._expired or self._heard_mono is None:
            raise AdapterError(f"site {self.name}: its agent is not heard from (no lease); its logs cannot be read")
        asked = time.monotonic()
        try:
            reply = await self._command(lambda i: proto.LogsRequest(
                site=self.name, msg_id=i, job_id=job_id, attempt=attempt, tail_lines=tail_lines,
                limit_bytes=limit_bytes, follow=follow), timeout_s=LOGS_WAIT_S, msg_id=msg_id)
        except AdapterError:
            if self._heard_mono is not None and self._heard_mono > asked and not self._expired:
                what = "follow logs" if follow else "give logs"
                raise LogsUnsupported(
                    f"its agent did not answer the request for logs within {LOGS_WAIT_S:g} s while its heartbeats "
                    f"kept coming: the agent is of an earlier release, which cannot {what} (upgrade it)") from None
            raise
        except asyncio.CancelledError:
            # The wait was cancelled with this adapter (the site removed, or its adapter rebuilt), not the reader's
            # own task: the reader is told so, rather than its connection dropped.
            task = asyncio.current_task()
            if self._closed and not (task is not None and task.cancelling()):
                raise LogsNotFound(f"site {self.name} was removed, or its adapter rebuilt by a change, while its logs "
                                   "were being read; ask again if the site is still registered") from None
            raise
        if reply.no_logs == "unsupported":
            raise LogsUnsupported(reply.reason or "the site cannot give logs")
        if reply.no_logs == "not-found":
            raise LogsNotFound(reply.reason or f"site {self.name} has no log of attempt {attempt} of job {job_id}")
        if not reply.ok or reply.logs is None:
            raise AdapterError(f"site {self.name}: {reply.reason or 'reading the logs failed'}")
        return reply

    async def events(self) -> AsyncIterator[JobEvent]:
        """The agent's events, each acknowledged to it once the consumer says it is kept (:meth:`taken`); one the
        consumer goes on from without that (it could not apply it) is left to the agent's resend."""
        while not self._closed:
            boot, msg_id, event = await self._events.get()
            if event.kind not in (EventKind.RUNNING,):
                self._ours.discard((event.job_id, event.attempt))
                if boot:
                    # Only an end the agent reported: this side's own "lost" at the end of a lease says nothing of
                    # the site, whose agent may still run the attempt (its stop failed, or a restarted agent adopted
                    # a Kubernetes Job that outlived it), and must find it a stray when it is listed again.
                    self._ended[(event.job_id, event.attempt)] = None
            self._current = (boot, msg_id, event)
            resumed = False
            try:
                yield event
                resumed = True
            finally:
                current, self._current = self._current, None
                if current is not None:  # not taken: the consumer went away mid-event, or could not apply it
                    if boot:
                        self._queued.discard((boot, msg_id))  # the agent's resend brings it back
                    elif not resumed:
                        self._events.put_nowait((boot, msg_id, event))

    def taken(self, event: JobEvent) -> None:
        """``EventReceipts``: the broker has applied the event it is reading: acknowledge it to the agent (not
        the lease-expiry events, which are this side's own), which then stops resending it and tells its
        site's adapter."""
        if self._current is None or self._current[2] is not event:
            return
        boot, msg_id, _ = self._current
        self._current = None
        if boot:
            key = (boot, msg_id)
            self._queued.discard(key)
            self._applied[key] = None
            self._send(proto.Ack(site=self.name, boot=boot, msg_ids=[msg_id]))

    async def known_attempts(self) -> set[tuple[str, int]]:
        if self._expired:
            return set()  # an agent without a lease holds nothing that runs
        if self._heard_mono is None:
            raise AdapterError(f"site {self.name}: its agent is not heard from yet; it cannot list its attempts")
        if not self._listing_now:
            raise AdapterError(f"site {self.name}: its agent's list of attempts has not all come yet (sent in "
                               "parts, it is too long for one message)")
        return set(self._attempts)

    @property
    def _listing_now(self) -> bool:
        """Whether ``_attempts`` is a list of the agent process heard now, taken since the lease last ran out."""
        return self._list_held and self._listed_by is not None and self._listed_by[0] == self._boot

    def held_attempts(self) -> set[tuple[str, int]]:
        """What the latest live heartbeat listed (empty while the site holds no lease, or while the list of a
        restarted agent's process has not all come), less the attempts whose end the broker has read: the agent
        lists those until it has the broker's acknowledgement."""
        if self._expired or not self._listing_now:
            return set()
        return {key for key in self._attempts if key not in self._ended}

    # --- QuotaAdmin ---

    async def _quota(self, op: str, quota: TenantQuota | None = None, tenant: str | None = None) -> QuotaState:
        reply = await self._command(lambda i: proto.QuotaCommand(site=self.name, msg_id=i, op=op, quota=quota,
                                                                 tenant=tenant))
        if reply.refused is not None and quota is not None:  # the site's own GPUs refuse it, not a failure
            raise QuotaBeyondSite(quota.tenant, reply.refused, reply.reason or "the site refuses it")
        if not reply.ok or reply.quota is None:
            raise AdapterError(f"site {self.name}: {reply.reason or 'quota command failed'}")
        if reply.not_found:
            raise KeyError(tenant)
        return reply.quota

    async def quota(self) -> QuotaState:
        return await self._quota("get")

    async def set_quota(self, quota: TenantQuota) -> QuotaState:
        return await self._quota("set", quota=quota)

    async def remove_quota(self, tenant: str) -> QuotaState:
        return await self._quota("remove", tenant=tenant)

    async def forget_quotas(self) -> None:
        with contextlib.suppress(AdapterError):
            await self._quota("forget")
