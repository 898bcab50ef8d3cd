"""The site agent: runs one site next to its cluster and reaches the broker over MQTT only.

``python -m adapters.agent --config site.yaml`` runs one site adapter (simulated or Kubernetes; the site's
own admission, its inventory and quotas, happens inside that adapter's ``submit``) and speaks the wire
protocol of :mod:`adapters.mqtt_protocol` with the broker through an MQTT broker (Mosquitto). The agent
opens the only connection, so a site behind NAT or an outgoing-only firewall works. A config file::

    site: {name: lyon, region: ..., gpus: [...], adapter: {kind: simulated}}
    mqtt: {host: mqtt.example.org, port: 8883, tls: true, username: lyon, password_env: LYON_MQTT_PASSWORD}
    heartbeat_s: 2          # how often the agent publishes its state (and asks for its lease to be renewed)
    resend_s: 2             # how often an unacknowledged event is published again
    stop_margin_s: null     # see "Leases" below
    state_dir: var/sites    # where the site keeps its operator's quota changes and its usage history
    telemetry: {kind: prometheus, url: http://prometheus:9090}  # measured GPUs in each heartbeat (adapters.dcgm;
                            # {kind: nvml} on the GPU node itself); unset: the adapter's own telemetry

What it does
    - Connects with a persistent MQTT session (MQTT 5, or 3.1.1 where the MQTT broker refuses 5, with a
      warning; ``clean_session`` false or a session that never expires, client id ``heliotrope-agent-SITE``)
      and a retained last will ``status: offline``, publishes ``status: online`` (retained) and subscribes
      to its ``down`` topic. When the MQTT connection dies (the MQTT broker restarts, the network drops) it
      reconnects with exponential backoff up to ``mqtt.reconnect_max_s``, for ever; everything below keeps
      going meanwhile, and the events it could not deliver go out once it is back.
    - Every ``heartbeat_s`` publishes a retained ``heartbeat``: the site's snapshot (capacity, telemetry,
      quotas) and the attempts it holds (``admitted``, or ``running`` once the site said so); a list too
      long for one message (over 4 MiB) follows in ``attempts`` parts. A site the agent cannot reach is
      reported unhealthy, with the reason.
    - Answers every command (``dispatch``, ``cancel``, ``preempt``, ``quota``, ``logs``) with a ``reply``, and a repeated command
      (the same ``msg_id``) with the same reply, without doing the work again (a read, ``logs`` or a quota
      ``get``, is read again; a followed ``logs`` is not begun again). A failure inside the site
      becomes ``ok: false`` with the reason; the agent itself never stops on one. A command that comes after
      the broker's wait for it ended (its MQTT 5 deadline: ``mqtt_protocol``, "Commands expire") is dropped
      unanswered and counted in :attr:`SiteAgent.expired`: the broker has told its caller it failed.
    - Follows a log where the broker asks (``logs`` with ``follow``): its site's ``LogFollower``, relayed in
      ``log_chunk`` messages until the attempt ends or the broker sends ``logs_stop`` (``mqtt_protocol``, "Logs";
      at most ``FOLLOWS_MAX`` at once, each for ``FOLLOW_MAX_S`` at most).
    - Forwards every job event of the site as an ``event`` with its own ``msg_id`` and publishes it again
      every ``resend_s`` until the broker acknowledges it.
    - Drops (and counts, by reason, in :attr:`SiteAgent.malformed`) any payload that breaks the protocol,
      and any retained message on its ``down`` topic (``retained``): the broker never retains a command, a
      lease or an acknowledgement, so a retained one was left there by hand or by another tool, and would be
      carried out again, however old, each time the agent connects.

Leases
    The broker answers each heartbeat with a lease grant. The agent counts the lease from when it *sent*
    that heartbeat (its own monotonic clock), so its view of the lease ends before the broker's; the grant of
    its latest heartbeat holds, also where it is shorter than an earlier one (``lease_s`` lowered). When the
    lease is within ``stop_margin_s`` of its end with no newer grant (the agent is cut off from the broker),
    the agent stops every attempt it holds and reports it: a checkpointable job as ``preempted`` with the
    seconds it ran (its checkpoint counts), any other as ``lost``; from then until a new grant it refuses
    every dispatch. The broker requeues a silent site's jobs only once its own, later, end of the lease has
    passed, so a job never runs at two sites at once. ``stop_margin_s`` unset means
    ``max(2 * heartbeat_s, 0.2 * lease_s)``: two missed heartbeats, and a fifth of the lease for stopping
    jobs. A margin as long as the lease stops jobs as soon as they start: keep it well below ``lease_s``. The
    lease holds for ``lease_s`` less the margin after each heartbeat, so that must be longer than ``heartbeat_s``
    (``heartbeat_s`` 5 against the default 15 s lease is not: its jobs would stop between two heartbeats); the
    agent logs an error at the first grant that leaves less.

What survives a crash
    Nothing of the agent's own state is on disk: the event outbox, the replies it remembers and the lease
    live in memory, and a restarted agent is a new ``boot`` that holds nothing and has no lease until the
    broker grants one. After a ``kill -9``, a simulated site's jobs die with the process; the broker hears
    nothing more from the site (the MQTT broker publishes the last will at once) and requeues its jobs when
    the lease runs out. A Kubernetes site's Jobs are objects on the cluster: they keep running while no
    agent is there and nothing stops them when the lease runs out, so a job the broker requeued may for a
    while run both there and at its new site. A restarted agent adopts what the site still holds
    (``known_attempts``) and lists it in its heartbeats: the broker keeps the attempts still current there
    and has the others cancelled at once, and events for attempts that are no longer current are ignored. Operator quota changes
    survive (``state_dir``), as in the adapters, and so do the stops a Kubernetes site began whose end the broker
    has not acknowledged (the adapter hears of the acknowledgement: ``EventReceipts``). An attempt whose end
    event is not acknowledged yet stays listed in the heartbeats, so a broker that restarts meanwhile does not
    take it for lost before that event reaches it. While the agent cannot reach the MQTT broker its outbox
    grows with the site's events (a few hundred bytes each), without a limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import math
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiomqtt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.base import (
    AdapterError,
    AttemptLookup,
    EventKind,
    EventReceipts,
    JobEvent,
    LogFollow,
    LogFollower,
    LogReader,
    LogsNotFound,
    LogsUnsupported,
    Preempter,
    QuotaAdmin,
    SiteAdapter,
)
from adapters.telemetry import TelemetryFeed, telemetry_feed
from policies.quota import QuotaBeyondSite
from adapters.mqtt_protocol import (
    PUBLISH_TIMEOUT_S,
    Ack,
    AttemptReport,
    Bounded,
    Cancel,
    Preempt,
    Dispatch,
    EventMsg,
    Heartbeat,
    FOLLOW_MAX_S,
    FOLLOWS_MAX,
    LOG_CHUNK_WAIT_S,
    LOGS_ANSWER_S,
    LeaseGrant,
    LogChunk,
    LogsRequest,
    LogsStop,
    MalformedMessage,
    MqttTlsError,
    QuotaCommand,
    Reply,
    Status,
    WireEvent,
    WireLogs,
    client_options,
    command_deadline,
    connection_advice,
    decode,
    encode,
    log_chunk_chars,
    refuses_mqtt5,
    split_attempts,
    tls_context,
    too_large,
    topic,
    with_short_logs,
    with_short_reason,
)
from broker.clock import Clock, SystemClock
from broker.config import ConfigError, load_yaml_model
from broker.errors import at
from broker.models import Health, Job, MqttSettings, SiteSpec, SiteState, TelemetrySourceConfig

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 15.0
"""The lease the agent asks for before the broker has granted one (the broker's default ``lease_s``)."""
NO_LEASE = "site agent holds no lease (cut off from the broker)"
REPLIES_KEPT = 10_000
HEARTBEATS_KEPT = 1_000
ATTEMPTS_KEPT = 10_000
STOP_WAIT_S = 10.0
"""How long :meth:`SiteAgent.stop` waits for its connection (a connect or a publish under way) and for its
tasks to end, each, before it goes on without them: an agent told to stop (SIGTERM) stops."""
STOP_GRACE_S = 2.0
"""How long :meth:`SiteAgent.stop` waits for its cancelled tasks before it cancels again those still running (then
up to :data:`STOP_WAIT_S` more): leaving an MQTT connection, aiomqtt waits for the broker's answer to DISCONNECT
without a bound, and only a second cancel ends that wait."""
TERMINAL = frozenset({EventKind.SUCCEEDED, EventKind.FAILED, EventKind.PREEMPTED, EventKind.LOST})


# --- configuration -----------------------------------------------------------------------------------------


class AgentConfig(BaseModel):
    """One site agent: the site it runs, where the MQTT broker is, and its timings."""

    model_config = ConfigDict(extra="forbid")

    site: SiteSpec
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    heartbeat_s: float = Field(default=2.0, gt=0, le=600, description="how often the agent publishes its state")
    resend_s: float = Field(default=2.0, gt=0, le=600, description="how often an unacknowledged event is resent")
    stop_margin_s: float | None = Field(
        default=None, ge=0, le=3600,
        description="stop the jobs this long before the lease ends (None: max(2 * heartbeat_s, 0.2 * lease_s))")
    state_dir: str | None = Field(
        default=None, description="where the site keeps what must outlive a restart (its operator's quota changes, "
                                  "the usage history its fair share weighs)")
    telemetry: TelemetrySourceConfig | None = Field(
        default=None,
        description="measure the site's GPUs (temperature, power, utilisation, clock throttling) and send that "
                    "in each heartbeat instead of the adapter's own telemetry (None: the adapter's): "
                    "{kind: nvml} reads the GPUs of the node the agent runs on, {kind: prometheus, url: ...} "
                    "reads what a Prometheus server scrapes from the cluster's dcgm-exporter")

    @field_validator("site")
    @classmethod
    def _runs_a_site(cls, site: SiteSpec) -> SiteSpec:
        if site.adapter.kind not in ("simulated", "kubernetes"):
            raise at(("adapter", "kind"), f"{site.adapter.kind!r} is how the broker reaches a site through an "
                                          "agent; the agent runs the site itself: use simulated or kubernetes")
        problems = site.quota_problems()
        if len(problems) == 1:  # (its field, e.g. quotas[1].model, below site)
            raise at(problems[0]["field"], problems[0]["problem"])
        if problems:
            raise ValueError("; ".join(f"{p['field']}: {p['problem']}" for p in problems))
        return site

    @model_validator(mode="after")
    def _one_telemetry(self) -> AgentConfig:
        if self.telemetry is not None and getattr(self.site.adapter, "telemetry", None) is not None:
            raise at("telemetry", "telemetry is set twice, here and in site.adapter.telemetry (both would read the "
                             "same GPUs, and this one would win): keep one")
        return self

    def stop_margin(self, lease_s: float) -> float:
        if self.stop_margin_s is not None:
            return self.stop_margin_s
        return max(2 * self.heartbeat_s, 0.2 * lease_s)


# What a site's spec given as the agent's config is told.
SITE_SPEC_FOR_AGENT = ("this is one site's spec, not an agent config: an agent's config holds the site under "
                       "'site:', beside 'mqtt:' and its timings (config/agent-example.yaml)")


def load_agent_config(path: str | Path) -> AgentConfig:
    """The agent's YAML config; :class:`ConfigError` names the file, the field and the problem."""
    return load_yaml_model(path, AgentConfig, "'site' (and 'mqtt', 'heartbeat_s', ...)", SITE_SPEC_FOR_AGENT)


# --- the agent ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    job: Job | None  # None: adopted at start-up from the site, which knew the attempt but not its spec
    status: Literal["admitted", "running"] = "admitted"
    running_since: float | None = None  # monotonic


@dataclass(slots=True)
class _Outgoing:
    msg: EventMsg
    event: JobEvent  # as the site's adapter reported it: said to be taken once the broker acknowledges it
    sent: float = -math.inf  # monotonic; -inf: not yet published on this connection


class SiteAgent:
    def __init__(self, config: AgentConfig, clock: Clock | None = None, adapter: SiteAdapter | None = None,
                 telemetry: TelemetryFeed | None = None) -> None:
        """``adapter``: an already-built site adapter (tests); by default one is built from ``config.site``.
        ``telemetry``: a feed of measured GPU telemetry (tests); by default one from ``config.telemetry``."""
        from broker.service import adapter_factory  # the broker's service module only where it is used

        self.config = config
        self.site = config.site.name
        self.clock = clock or SystemClock()
        self.inner: SiteAdapter = adapter or adapter_factory(self.clock, config.state_dir)(config.site)
        self.telemetry = telemetry
        if telemetry is None and config.telemetry is not None:
            self.telemetry = telemetry_feed(self.site, config.telemetry, self.clock)
        self.boot = uuid.uuid4().hex[:16]
        self.malformed: Counter[str] = Counter()
        self.expired = 0  # commands dropped as come after the broker's wait for them ended (see _too_late)
        # Each connection asks for MQTT 5, and falls back to 3.1.1 where the MQTT broker refuses it: only over 5 do
        # commands carry the end of the broker's wait
        self.protocol = aiomqtt.ProtocolVersion.V5
        self._refused_mqtt5 = False  # an MQTT broker refused MQTT 5 once (the warning is then said once)
        self._held: dict[tuple[str, int], _Held] = {}
        self._last_event: Bounded = Bounded(ATTEMPTS_KEPT)  # (job id, attempt) -> last EventKind seen
        self._stopped: Bounded = Bounded(ATTEMPTS_KEPT)  # attempts the agent stopped itself (lease) -> True
        self._replies: Bounded = Bounded(REPLIES_KEPT)  # msg_id -> Reply
        self._working: dict[str, asyncio.Future[Reply]] = {}  # commands being carried out, by msg_id
        self._follows: dict[str, asyncio.Task[None]] = {}  # logs being followed, by the request's msg_id
        self._beginning = 0  # follows asked of the site, not answered yet (they count against FOLLOWS_MAX)
        self._followed: Bounded = Bounded(1000)  # msg_id of a follow begun -> its reply (a repeat is answered so)
        self._outbox: dict[int, _Outgoing] = {}
        self._event_ids = itertools.count(1)
        self._seq = itertools.count(0)
        self._sent_at: Bounded = Bounded(HEARTBEATS_KEPT)  # heartbeat seq -> monotonic send time
        self._lease_end: float | None = None  # monotonic
        self._granted_seq = -1  # the heartbeat whose grant set _lease_end
        self._lease_s = DEFAULT_LEASE_S
        self._stop_failed: set[tuple[str, int]] = set()
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closing = False
        # Held while the online status goes out and the client is published, and while stop() says goodbye, so
        # a stop that lands mid-connect never leaves a retained "online" behind (or skips the "offline").
        self._status_lock = asyncio.Lock()
        self._margin_warned = False
        self._oversize_said: str | None = None  # why the heartbeat could not be sent, as logged
        self._started_mono = time.monotonic()
        self._done = asyncio.Event()

    # --- what tests and operators look at ---

    @property
    def held(self) -> dict[tuple[str, int], str]:
        """The attempts the agent holds: (job id, attempt) -> ``admitted`` or ``running``."""
        return {key: h.status for key, h in self._held.items()}

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def lease_remaining_s(self) -> float | None:
        """Seconds until the lease ends as the agent counts it (negative: ended); None: never granted."""
        return None if self._lease_end is None else self._lease_end - time.monotonic()

    # --- life cycle ---

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._started_mono = time.monotonic()
        await self.inner.start()
        await self._adopt()
        if self.telemetry is not None:
            # Read in the background only: a source that hangs (a Prometheus that drops packets) must not hold
            # up the start, nor the reports; the first reading goes out with the report after it.
            self.telemetry.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._events_loop(), name=f"agent-{self.site}-events"),
            loop.create_task(self._watchdog_loop(), name=f"agent-{self.site}-lease"),
            loop.create_task(self._connection_loop(), name=f"agent-{self.site}-mqtt"),
        ]
        log.info("site agent %s started (boot %s)", self.site, self.boot)

    async def stop(self) -> None:
        """Say goodbye (``status: offline``, retained), disconnect and close the site adapter. The jobs the
        site runs are left to the lease: the broker requeues them once it runs out."""
        if not self._started or self._done.is_set():
            return
        self._closing = True  # from here the connection loop publishes no "online"
        try:
            async with asyncio.timeout(STOP_WAIT_S):  # (a connect that hangs holds the lock)
                await self._status_lock.acquire()
        except TimeoutError:
            log.warning("site agent %s: its MQTT connection did not settle within %.0f s; stopping without "
                        "saying goodbye (the last will says it)", self.site, STOP_WAIT_S)
        else:
            try:
                client = self._client
                if client is not None:
                    try:
                        await client.publish(topic(self.site, "status"), encode(self._status(False)), qos=1,
                                             retain=True, timeout=PUBLISH_TIMEOUT_S)
                    except aiomqtt.MqttError as e:
                        log.warning("site agent %s: could not publish its offline status: %s", self.site, e)
            finally:
                self._status_lock.release()
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            for task in stuck:
                task.cancel()
            if stuck:
                _, stuck = await asyncio.wait(stuck, timeout=STOP_WAIT_S)
            if stuck:
                log.warning("site agent %s: %d of its tasks did not end within %.0f s of being cancelled (%s); "
                            "stopping without them", self.site, len(stuck), STOP_GRACE_S + STOP_WAIT_S,
                            ", ".join(sorted(t.get_name() for t in stuck)))
        self._client = None
        self._connected.clear()
        if self.telemetry is not None:
            try:
                async with asyncio.timeout(STOP_WAIT_S):
                    await self.telemetry.stop()
            except Exception as e:  # (NVML's shutdown failing must not keep the site open)
                log.warning("site agent %s: its GPU telemetry did not stop cleanly: %s", self.site, e)
        try:
            await self.inner.close()
        finally:
            self._done.set()
            log.info("site agent %s stopped", self.site)

    async def run_forever(self) -> None:
        """Run until :meth:`stop` is called (the CLI calls it on SIGINT or SIGTERM)."""
        await self.start()
        await self._done.wait()

    # --- MQTT connection ---

    def _make_client(self) -> aiomqtt.Client:
        options = client_options(self.config.mqtt, self.config.mqtt.client_id or f"heliotrope-agent-{self.site}",
                                 self.protocol)
        will = aiomqtt.Will(topic(self.site, "status"), encode(self._status(False)), qos=1, retain=True)
        return aiomqtt.Client(**options, will=will)

    async def _connection_loop(self) -> None:
        mqtt = self.config.mqtt
        first_wait = min(0.5, mqtt.reconnect_max_s)
        wait = first_wait
        while not self._closing:  # aiomqtt may turn a cancellation into an MqttError: the flag ends the loop
            try:
                async with self._make_client() as client:
                    await client.subscribe(topic(self.site, "down"), qos=1)
                    async with self._status_lock:
                        if self._closing:
                            break
                        await client.publish(topic(self.site, "status"), encode(self._status(True)), qos=1,
                                             retain=True)
                        self._client = client
                    for out in self._outbox.values():
                        out.sent = -math.inf  # what went out on the last connection may be lost
                    self._connected.set()
                    wait = first_wait
                    log.info("site agent %s: connected to MQTT broker %s:%d", self.site, mqtt.host, mqtt.port)
                    beats = asyncio.create_task(self._heartbeat_loop(client))
                    resends = asyncio.create_task(self._resend_loop(client))
                    try:
                        async for message in client.messages:
                            self._on_message(message.topic.value, message.payload, bool(message.retain),
                                             message.properties)
                    finally:
                        self._client = None
                        self._connected.clear()
                        beats.cancel()
                        resends.cancel()
                        await asyncio.gather(beats, resends, return_exceptions=True)
            except aiomqtt.MqttError as e:
                if self.protocol == aiomqtt.ProtocolVersion.V5 and refuses_mqtt5(e):
                    self.protocol = aiomqtt.ProtocolVersion.V311
                    # (said at WARNING the first time; again at INFO, as each later connection asks for 5 first)
                    log.log(logging.INFO if self._refused_mqtt5 else logging.WARNING,
                            "site agent %s: the MQTT broker %s:%d refuses MQTT 5 (%s); connecting with MQTT 3.1.1, "
                            "over which commands cannot expire: one the broker stopped waiting for is carried out "
                            "when it comes. Use an MQTT broker that speaks MQTT 5 (Mosquitto 1.6 or later)",
                            self.site, mqtt.host, mqtt.port, e)
                    self._refused_mqtt5 = True
                    continue  # (at once: the MQTT broker answered)
                log.warning("site agent %s: MQTT broker %s:%d: %s%s; connecting again in %.1f s", self.site,
                            mqtt.host, mqtt.port, e, await connection_advice(e, mqtt), wait)
            except Exception:  # never give up on the connection
                log.exception("site agent %s: MQTT connection failed; connecting again in %.1f s", self.site, wait)
            if self._closing:
                break
            # (a connection of 3.1.1 that ended: the next asks for MQTT 5 again, the MQTT broker may have been upgraded)
            self.protocol = aiomqtt.ProtocolVersion.V5
            await asyncio.sleep(wait)
            wait = min(wait * 2, mqtt.reconnect_max_s)

    async def _publish(self, client: aiomqtt.Client | None, channel: Literal["state", "up"], msg: BaseModel,
                       retain: bool = False) -> bool:
        return await self._publish_payload(client, channel, encode(msg), retain)

    async def _publish_payload(self, client: aiomqtt.Client | None, channel: Literal["state", "up"],
                               payload: bytes, retain: bool = False) -> bool:
        if client is None:
            return False
        try:
            await client.publish(topic(self.site, channel), payload, qos=1, retain=retain,
                                 timeout=PUBLISH_TIMEOUT_S)
            return True
        except aiomqtt.MqttError as e:
            log.debug("site agent %s: publish on %s failed: %s", self.site, channel, e)
            return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _status(self, online: bool) -> Status:
        return Status(site=self.site, boot=self.boot, online=online, at=self.clock.now())

    # --- heartbeats and the lease ---

    def _report_wait_s(self) -> float:
        """How long a heartbeat waits for the site's report, so that a site that does not answer (an API that
        drops packets) never holds the heartbeats back until the lease has run out and the agent stops jobs the
        site still runs. The lease holds ``lease_s`` less the stop margin after each heartbeat, and a heartbeat
        after a report that came sleeps ``heartbeat_s`` first: the wait is half of what that leaves (at least a
        tenth of ``heartbeat_s``, where nothing is left: a setting the agent names in an error at its first
        lease)."""
        held = self._lease_s - self.config.stop_margin(self._lease_s)
        return max(0.1 * self.config.heartbeat_s, (held - self.config.heartbeat_s) / 2)

    async def _heartbeat_loop(self, client: aiomqtt.Client) -> None:
        report: asyncio.Task[SiteState] | None = None  # the site's report being taken (kept across heartbeats)
        asked = time.monotonic()
        try:
            while True:
                if report is None:
                    report, asked = asyncio.ensure_future(self.inner.snapshot()), time.monotonic()
                done, _ = await asyncio.wait({report}, timeout=self._report_wait_s())
                if done:
                    finished, report = report, None
                    try:
                        state = finished.result()
                    except Exception as e:  # the site is unreachable: say so (and keep the lease: its jobs still run)
                        log.warning("site agent %s: snapshot failed: %s", self.site, e)
                        state = SiteState(site=self.site, health=Health.UNHEALTHY, last_heard_at=self.clock.now(),
                                          reason=f"the site agent cannot reach the site: {e}")
                else:  # the same: the site does not answer (the report goes on, for the next heartbeat)
                    waited = time.monotonic() - asked
                    log.warning("site agent %s: the site has not answered its report for %.0f s", self.site, waited)
                    state = SiteState(site=self.site, health=Health.UNHEALTHY, last_heard_at=self.clock.now(),
                                      reason=f"the site agent cannot reach the site: it has not answered for "
                                             f"{waited:.0f} s")
                    if waited > self._lease_s:  # one that never returns is asked again, not awaited for ever
                        report.cancel()
                        report.add_done_callback(lambda task: task.cancelled() or task.exception())
                        report = None
                await self._beat(client, state)
                if done:  # (one that waited for the site has waited long enough already)
                    await asyncio.sleep(self.config.heartbeat_s)
        finally:
            if report is not None:
                report.cancel()
                # (one that failed since the last heartbeat: its error was never read, and asyncio would log it)
                report.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _beat(self, client: aiomqtt.Client, state: SiteState) -> None:
        """Publish one heartbeat with ``state``: the site's report, with the attempts it holds. One that cannot
        be made is logged and skipped: the loop goes on (a heartbeat task that ended would leave the site
        silent, its lease running out, with the link up and nothing said)."""
        try:
            if self.telemetry is not None:
                state = self.telemetry.overlay(state)
            seq = next(self._seq)
            beat = Heartbeat(
                site=self.site, boot=self.boot, seq=seq, sent_at=self.clock.now(), lease_s=self._lease_s,
                state=state, attempts=self._attempts_listed(),
            )
        except Exception:
            log.exception("site agent %s: could not make a heartbeat; trying again at the next one", self.site)
            return
        self._sent_at[seq] = time.monotonic()
        payload = encode(beat)
        cap = self.config.mqtt.max_payload_bytes
        if len(payload) <= cap:
            self._oversize_said = None
            await self._publish_payload(client, "state", payload, retain=True)
            return
        # Too large for the MQTT broker or the receiver (either drops it, and the lease would run out with the
        # site at work): the attempts go in parts after it (mqtt_protocol, "Long lists of attempts"); the
        # heartbeat alone renews the lease, and a part that does not go out is sent afresh with the next list.
        head, parts = split_attempts(beat, cap)
        head_payload = encode(head)
        why = too_large(head_payload, cap, "its heartbeat without its attempts (capacity, telemetry, quota state)")
        if why is not None:  # sent, the MQTT broker would drop it, or close the connection for it
            if self._oversize_said is None:  # (said once, until one fits again)
                self._oversize_said = why
                log.error("site agent %s: %s: not sent, so its lease runs out and its jobs are stopped; raise "
                          "mqtt.max_payload_bytes here and at the broker as far as the MQTT broker allows", self.site,
                          why)
            return
        self._oversize_said = None
        if not await self._publish_payload(client, "state", head_payload, retain=True):
            return
        for part in parts:
            if not await self._publish(client, "state", part):
                return

    def _attempts_listed(self) -> list[AttemptReport]:
        """The attempts the site holds, and those whose end the broker has not acknowledged yet (listed as the
        last the broker heard of them): a broker that restarted and asks what the site knows must not take
        such an attempt for lost, and requeue it from scratch, before its end (a stop with its run) comes."""
        listed = {key: h.status for key, h in self._held.items()}
        for out in self._outbox.values():
            key = (out.event.job_id, out.event.attempt)
            if out.event.kind != EventKind.RUNNING and key not in listed:
                listed[key] = "running"
        return [AttemptReport(job_id=j, attempt=a, status=status) for (j, a), status in listed.items()]

    def _on_lease(self, grant: LeaseGrant) -> None:
        sent = self._sent_at.get(grant.seq)
        if grant.boot != self.boot or sent is None:
            return
        end = sent + grant.lease_s
        margin = self.config.stop_margin(grant.lease_s)
        if grant.lease_s - margin <= self.config.heartbeat_s and not self._margin_warned:
            # The lease holds for lease_s - margin after each heartbeat: the next one's grant must come before that.
            self._margin_warned = True
            log.error("site agent %s: the broker grants %.1f s leases, which with the agent's stop margin (%.1f s) "
                      "hold no longer than heartbeat_s (%.1f s): %s; lower heartbeat_s or stop_margin_s, or raise "
                      "the site's lease_s at the broker", self.site, grant.lease_s, margin, self.config.heartbeat_s,
                      "it would stop every job at once and refuse all work" if margin >= grant.lease_s else
                      "it would stop its jobs between two heartbeats")
        if grant.seq > self._granted_seq:
            # The grant of the latest heartbeat holds, even where it ends before an earlier one: the broker counts
            # only its latest (a site whose lease_s was lowered is requeued after the shorter lease).
            self._granted_seq = grant.seq
            self._lease_end = end
            self._lease_s = grant.lease_s

    def _lease_valid(self) -> bool:
        if self._lease_end is None:
            return False
        return time.monotonic() < self._lease_end - self.config.stop_margin(self._lease_s)

    async def _adopt(self) -> None:
        """Hold what the site still runs from before this start (a Kubernetes site's Jobs outlive the agent),
        so the first heartbeats list it: the broker keeps the attempts that are still current there and has
        the others cancelled. Until a first lease is granted they are given one default lease from start-up
        (the broker answers the first heartbeat within moments when it is reachable), then stopped."""
        if not isinstance(self.inner, AttemptLookup):
            return
        try:
            known = await self.inner.known_attempts()
        except Exception as e:
            log.warning("site agent %s: cannot list the attempts the site still holds (%s); the broker will "
                        "cancel any it sees later that it no longer has there", self.site, e)
            return
        for key in known:
            self._held.setdefault(key, _Held(None))
        if known:
            log.info("site agent %s: the site still holds %d attempt(s) from before; reporting them to the "
                     "broker", self.site, len(known))

    def _must_stop(self) -> bool:
        """Whether the jobs it holds must stop now: its lease is about to end, or, never granted one since
        start-up (only adopted attempts can be held then), a default lease has passed."""
        if self._lease_end is None:
            margin = self.config.stop_margin(DEFAULT_LEASE_S)
            return time.monotonic() >= self._started_mono + DEFAULT_LEASE_S - margin
        return not self._lease_valid()

    async def _watchdog_loop(self) -> None:
        period = min(0.2, self.config.heartbeat_s / 2)
        while True:
            await asyncio.sleep(period)
            if self._held and self._must_stop():
                try:
                    await self._stop_held()
                except Exception:  # never let the watchdog die
                    log.exception("site agent %s: stopping jobs failed", self.site)

    async def _stop_held(self) -> None:
        remaining = self.lease_remaining_s()
        if any(key not in self._stop_failed for key in self._held):  # not again for each retry of a failed stop
            log.warning("site agent %s: lease %s without a newer grant: stopping the %d attempt(s) it holds",
                        self.site, "not granted" if remaining is None else f"ends in {max(remaining, 0):.1f} s",
                        len(self._held))
        # All at once: a site with many jobs must be done within the margin, not one API call after another.
        await asyncio.gather(*(self._stop(key, held) for key, held in list(self._held.items())))

    async def _stop(self, key: tuple[str, int], held: _Held) -> None:
        """Stop one attempt because the lease is ending, and report it: checkpointed (``preempted``, with the
        seconds it ran) when its job can resume from a checkpoint, else ``lost``."""
        try:
            await self.inner.cancel(*key)
        except Exception as e:
            if key not in self._stop_failed:
                log.error("site agent %s: could not stop job %s attempt %d: %s", self.site, key[0], key[1], e)
                self._stop_failed.add(key)
            return
        self._stop_failed.discard(key)
        if self._held.pop(key, None) is None:
            return  # it ended (or was cancelled) while we stopped it
        self._stopped[key] = True
        now = time.monotonic()
        if held.job is not None and held.job.spec.checkpointable:
            ran = now - held.running_since if held.running_since is not None else 0.0
            event = JobEvent(key[0], key[1], EventKind.PREEMPTED, self.clock.now(),
                             "lease running out: checkpointed and stopped before the broker may move it",
                             run_s=max(ran, 0.0))
        else:
            event = JobEvent(key[0], key[1], EventKind.LOST, self.clock.now(),
                             "lease running out: stopped before the broker may move it")
        self._last_event[key] = event.kind
        self._emit(event)

    # --- events ---

    async def _events_loop(self) -> None:
        while True:
            try:
                async for event in self.inner.events():
                    self._on_event(event)
                log.warning("site agent %s: the site's event stream ended; opening it again", self.site)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("site agent %s: reading the site's events failed: %s; trying again", self.site, e)
            await asyncio.sleep(1.0)

    def _on_event(self, event: JobEvent) -> None:
        key = (event.job_id, event.attempt)
        if key in self._stopped:
            log.debug("site agent %s: %s of %s/%d, which it stopped itself, not forwarded", self.site, event.kind,
                      *key)
            self._taken(event)  # the agent reported the attempt's end itself
            return
        self._last_event[key] = event.kind
        held = self._held.get(key)
        if held is not None:
            if event.kind == EventKind.RUNNING:
                held.status = "running"
                held.running_since = time.monotonic()
            elif event.kind in TERMINAL:
                del self._held[key]
        self._emit(event)

    def _taken(self, event: JobEvent) -> None:
        """The broker has the event (or needs it no more): the site's adapter may forget what it kept for it."""
        if isinstance(self.inner, EventReceipts):
            self.inner.taken(event)

    def _emit(self, event: JobEvent) -> None:
        msg = EventMsg(site=self.site, boot=self.boot, msg_id=next(self._event_ids), event=WireEvent.of(event))
        # A reason too long for one message is cut short: sent whole, the event would be dropped at every resend
        # and the job never end at the broker.
        msg = with_short_reason(msg, self.config.mqtt.max_payload_bytes)
        out = _Outgoing(msg, event)
        self._outbox[msg.msg_id] = out
        if self._client is not None:
            out.sent = time.monotonic()
            self._spawn(self._publish(self._client, "up", msg))

    async def _resend_loop(self, client: aiomqtt.Client) -> None:
        resend = self.config.resend_s
        while True:
            now = time.monotonic()
            for out in list(self._outbox.values()):
                if now - out.sent >= resend and out.msg.msg_id in self._outbox:
                    out.sent = now
                    await self._publish(client, "up", out.msg)
            await asyncio.sleep(min(resend, 0.5) / 2)

    # --- commands ---

    def _on_message(self, topic_name: str, payload: Any, retained: bool = False, properties: Any = None) -> None:
        """Take one message from the ``down`` topic; ``properties``: its MQTT 5 properties (None over 3.1.1)."""
        if retained:
            if payload:  # (an empty one is a retained message cleared)
                self.malformed["retained"] += 1
                log.warning("site agent %s: dropped a retained message on %s: the broker never retains what it "
                            "sends a site; clear it with an empty retained publish", self.site, topic_name)
            return
        try:
            msg = decode(topic_name, payload if isinstance(payload, bytes | bytearray | str) else b"",
                         self.config.mqtt.max_payload_bytes)
        except MalformedMessage as e:
            self.malformed[e.reason] += 1
            log.warning("site agent %s: dropped a malformed message on %s: %s", self.site, topic_name, e)
            return
        except Exception as e:  # whatever a payload does, the agent goes on
            self.malformed["invalid"] += 1
            log.warning("site agent %s: dropped a message on %s it could not read: %s", self.site, topic_name, e)
            return
        match msg:
            case None:
                return
            case Ack():
                if msg.boot == self.boot:
                    for msg_id in msg.msg_ids:
                        if (out := self._outbox.pop(msg_id, None)) is not None:
                            self._taken(out.event)
            case LeaseGrant():
                self._on_lease(msg)
            case LogsStop():
                task = self._follows.get(msg.follow)
                if task is not None:
                    task.cancel()
            case Dispatch() | Cancel() | Preempt() | QuotaCommand() | LogsRequest():
                if not self._too_late(msg, properties):
                    self._spawn(self._answer(msg))

    def _too_late(self, cmd: Dispatch | Cancel | Preempt | QuotaCommand | LogsRequest, properties: Any) -> bool:
        """Whether ``cmd`` came after the broker's wait for its reply ended (``mqtt_protocol``, "Commands expire"):
        the broker has told its caller it failed, so carrying it out now would do the opposite. Counted from when
        this agent *sent* the heartbeat the deadline names, on its own monotonic clock: earlier than when the
        broker received it, so this end of the wait comes first, whatever the two clocks say the time is. A
        command without a deadline (a broker of an earlier release, or of MQTT 3.1.1), or naming another process
        of this agent or a heartbeat it no longer remembers, is carried out as before (the MQTT broker's expiry
        still holds for it)."""
        deadline = command_deadline(properties)
        if deadline is None:
            return False
        boot, seq, after_s = deadline
        sent = self._sent_at.get(seq) if boot == self.boot else None
        if sent is None:
            return False
        late_s = time.monotonic() - (sent + after_s)
        if late_s < 0:
            return False
        self.expired += 1
        log.warning("site agent %s: dropped a %s (msg_id %s) that came %.1f s after the broker's wait for it ended "
                    "(as this agent counts it); not carried out: the broker has given it up", self.site, cmd.kind,
                    cmd.msg_id, late_s)
        return True

    async def _answer(self, cmd: Dispatch | Cancel | Preempt | QuotaCommand | LogsRequest) -> None:
        reply = self._replies.get(cmd.msg_id) or self._followed.get(cmd.msg_id)
        if reply is None:
            working = self._working.get(cmd.msg_id)
            if working is not None:  # the same command again while we carry it out: the same answer
                reply = await asyncio.shield(working)
            else:
                working = asyncio.get_running_loop().create_future()
                self._working[cmd.msg_id] = working
                try:
                    reply = await self._carry_out(cmd)
                except Exception as e:  # the adapter failed: the broker hears why
                    reply = Reply(site=self.site, msg_id=cmd.msg_id, ok=False, reason=str(e) or type(e).__name__)
                except BaseException:
                    working.cancel()
                    raise
                finally:
                    self._working.pop(cmd.msg_id, None)
                reply = self._fitted(reply)
                # A read (logs, a quota get) is not kept: a repeat reads again. Kept for 10,000 commands, the logs
                # would take megabytes each, and the whole quota state each quota read carries about 100 KB in
                # memory for some forty tenants: an agent whose quotas are polled grew by a gigabyte.
                if not isinstance(cmd, LogsRequest) and not (isinstance(cmd, QuotaCommand) and cmd.op == "get"):
                    self._replies[cmd.msg_id] = reply
                working.set_result(reply)
        await self._publish(self._client, "up", reply)

    def _fitted(self, reply: Reply) -> Reply:
        """``reply`` as it can go out under ``mqtt.max_payload_bytes``: its reason cut short, or, where it is still
        too large (a quota state of very many tenants), a failed reply that says so: the broker hears why at
        once, not the silence of a command that times out."""
        cap = self.config.mqtt.max_payload_bytes
        fitted = with_short_reason(with_short_logs(reply, cap), cap)
        assert isinstance(fitted, Reply)
        why = too_large(encode(fitted), cap, "the site's reply")
        if why is None:
            return fitted
        log.error("site agent %s: %s: answered not ok instead", self.site, why)
        return Reply(site=self.site, msg_id=reply.msg_id, ok=False, admitted=reply.admitted,
                     reason=f"{why}: raise mqtt.max_payload_bytes at the site agent and the broker")

    async def _carry_out(self, cmd: Dispatch | Cancel | Preempt | QuotaCommand | LogsRequest) -> Reply:
        match cmd:
            case Dispatch():
                return await self._dispatch(cmd)
            case Cancel():
                await self.inner.cancel(cmd.job_id, cmd.attempt)
                self._held.pop((cmd.job_id, cmd.attempt), None)
                return Reply(site=self.site, msg_id=cmd.msg_id, ok=True)
            case Preempt():
                if not isinstance(self.inner, Preempter):
                    return Reply(site=self.site, msg_id=cmd.msg_id, ok=False,
                                 reason="this site's adapter cannot checkpoint and stop a job on request")
                await self.inner.preempt(cmd.job_id, cmd.attempt, cmd.reason)
                return Reply(site=self.site, msg_id=cmd.msg_id, ok=True)
            case QuotaCommand():
                return await self._quota(cmd)
            case LogsRequest():
                return await self._logs(cmd)

    async def _logs(self, cmd: LogsRequest) -> Reply:
        """What the attempt printed, as the site gives it within ``LOGS_ANSWER_S`` (the broker waits longer, so
        it hears this answer, not silence: silence it takes for an agent of an earlier release)."""
        inner = self.inner
        if cmd.follow:
            return await self._follow(cmd)
        if not isinstance(inner, LogReader):
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, no_logs="unsupported",
                         reason=f"the site's adapter ({getattr(self.config.site.adapter, 'kind', '?')}) cannot give logs")
        logs = await self._site_logs(cmd, inner.logs(cmd.job_id, cmd.attempt, cmd.tail_lines, cmd.limit_bytes))
        if isinstance(logs, Reply):
            return logs
        return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, logs=WireLogs.of(logs))

    async def _site_logs(self, cmd: LogsRequest, read: Awaitable[T]) -> T | Reply:
        """What the site's ``read`` of an attempt's log gives within ``LOGS_ANSWER_S``, or the failed reply that says
        why it gave none (the site cannot give logs, has none for the attempt, or did not answer in time)."""
        try:
            async with asyncio.timeout(LOGS_ANSWER_S):
                return await read
        except LogsUnsupported as e:
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, no_logs="unsupported", reason=str(e))
        except LogsNotFound as e:
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, no_logs="not-found", reason=str(e))
        except TimeoutError:
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False,
                         reason=f"the site did not give the logs within {LOGS_ANSWER_S:g} s")

    async def _follow(self, cmd: LogsRequest) -> Reply:
        """Begin following the attempt's log (``mqtt_protocol``, "Logs"): the reply says whether its start was left
        out and where it comes from; the text goes in ``log_chunk`` messages (:meth:`_pump`)."""
        inner = self.inner
        if not isinstance(inner, LogFollower):
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, no_logs="unsupported",
                         reason=f"the site's adapter ({getattr(self.config.site.adapter, 'kind', '?')}) cannot "
                                "follow logs")
        if len(self._follows) + self._beginning >= FOLLOWS_MAX:  # (those whose site has not answered yet count)
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False,
                         reason=f"the site's agent follows {FOLLOWS_MAX} logs already; try again later")
        self._beginning += 1
        try:
            followed = await self._site_logs(
                cmd, inner.follow_logs(cmd.job_id, cmd.attempt, cmd.tail_lines, cmd.limit_bytes))
        finally:
            self._beginning -= 1
        if isinstance(followed, Reply):
            return followed
        source = (followed.source or "")[:500] or None
        reply = Reply(site=self.site, msg_id=cmd.msg_id, ok=True,
                      logs=WireLogs(text="", truncated=followed.truncated, source=source))
        self._followed[cmd.msg_id] = reply
        task = asyncio.get_running_loop().create_task(self._pump(cmd.msg_id, followed), name=f"follow-{cmd.msg_id}")
        self._follows[cmd.msg_id] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: self._follows.pop(cmd.msg_id, None))
        return reply

    async def _pump(self, follow: str, followed: LogFollow) -> None:
        """Send a followed log's text as it comes, in ``log_chunk`` messages (what comes within ``LOG_CHUNK_WAIT_S``
        together, at most ``log_chunk_chars`` characters each), until it ends, the broker says stop (the task is
        cancelled), or ``FOLLOW_MAX_S`` have passed. A chunk that cannot go out (the connection is down) is sent
        again once it is back; the site's stream waits meanwhile, so no more than a chunk is held."""
        limit = log_chunk_chars(self.config.mqtt.max_payload_bytes)
        seq, text, pending, reason = 0, "", None, None
        chunks = followed.chunks

        async def send(part: str, end: bool = False) -> None:
            nonlocal seq
            seq += 1
            msg = LogChunk(site=self.site, follow=follow, seq=seq, text=part, end=end, reason=reason if end else None)
            while not await self._publish(self._client, "up", msg):
                await self._connected.wait()
                await asyncio.sleep(0.1)  # (the client is set just after the event)

        loop = asyncio.get_running_loop()
        since = 0.0  # loop time of the first text not sent yet
        try:
            async with asyncio.timeout(FOLLOW_MAX_S):
                while True:
                    pending = pending or asyncio.ensure_future(anext(chunks, None))
                    wait = None if not text else max(0.0, since + LOG_CHUNK_WAIT_S - loop.time())
                    done, _ = await asyncio.wait({pending}, timeout=wait)
                    if done:
                        chunk, pending = pending.result(), None
                        if chunk is None:
                            break
                        if chunk and not text:
                            since = loop.time()
                        text += chunk
                    while len(text) >= limit:
                        await send(text[:limit])
                        text, since = text[limit:], loop.time()
                    if text and loop.time() >= since + LOG_CHUNK_WAIT_S:
                        await send(text)
                        text = ""
        except TimeoutError:
            reason = f"the agent follows a log for {FOLLOW_MAX_S:g} s at most"
        except AdapterError as e:
            reason = f"the site stopped giving the log: {e}"
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await chunks.aclose()
        await send(text, end=True)

    async def _dispatch(self, cmd: Dispatch) -> Reply:
        if not self._lease_valid():
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, admitted=False, reason=NO_LEASE)
        job = cmd.job
        key = (job.id, job.attempt)
        fresh = key not in self._held and key not in self._stopped and key not in self._last_event
        if fresh:
            # Held from before the site is asked: a heartbeat sent while the site admits it lists it, so the
            # broker never takes it for gone (and requeues it elsewhere) while it is being started here.
            self._held[key] = _Held(job)
        try:
            admission = await self.inner.submit(job)
        except BaseException:
            if fresh and self._last_event.get(key) is None:
                self._held.pop(key, None)
            raise
        if not admission.admitted:
            if fresh and self._last_event.get(key) is None:
                self._held.pop(key, None)
        elif not self._lease_valid() and key in self._held:
            # The site took a while and the lease is ending meanwhile: the broker may move the job any moment,
            # so it must not run here.
            await self._stop(key, self._held[key])
            if key not in self._held:
                return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, admitted=False, reason=NO_LEASE)
            # Its stop failed: the site runs it. Refused, the broker would run it elsewhere at once; admitted, it
            # stays the site's until the watchdog's next try stops it and reports that (or the broker's lease ends).
        return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, admitted=admission.admitted, reason=admission.reason)

    async def _quota(self, cmd: QuotaCommand) -> Reply:
        inner = self.inner
        if not isinstance(inner, QuotaAdmin):
            return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, reason="site has no quotas")
        match cmd.op:
            case "get":
                state = await inner.quota()
            case "set":
                if cmd.quota is None:
                    return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, reason="quota set needs a quota")
                try:
                    state = await inner.set_quota(cmd.quota)
                except QuotaBeyondSite as e:  # (the broker answers 422 naming the field, not 503)
                    return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, reason=e.problem, refused=e.field)
            case "remove":
                if cmd.tenant is None:
                    return Reply(site=self.site, msg_id=cmd.msg_id, ok=False, reason="quota remove needs a tenant")
                try:
                    state = await inner.remove_quota(cmd.tenant)
                except KeyError:
                    return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, not_found=True,
                                 quota=await inner.quota())
            case "forget":
                await inner.forget_quotas()
                state = await inner.quota()
        return Reply(site=self.site, msg_id=cmd.msg_id, ok=True, quota=state)


# --- command line ------------------------------------------------------------------------------------------


class AgentStartError(RuntimeError):
    """The site the agent runs could not be started (its adapter's settings, a kubeconfig, a state folder)."""


async def _run(config: AgentConfig) -> None:
    agent: SiteAgent | None = None
    try:
        agent = SiteAgent(config)
        await agent.start()
    except Exception as e:  # the site's adapter could not start: a message, not a traceback
        log.debug("site agent %s: start failed", config.site.name, exc_info=True)  # (--log-level DEBUG)
        if agent is not None:
            with contextlib.suppress(Exception):
                await agent.inner.close()
        kind = getattr(config.site.adapter, "kind", "?")
        raise AgentStartError(f"site {config.site.name} ({kind} adapter) could not start: "
                              f"{e.__class__.__name__}: {e}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await agent.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="heliotrope agent", description="Run one site and connect it to the broker "
                                                                     "over MQTT.")
    p.add_argument("--config", required=True, metavar="FILE", help="the agent's YAML config (site, mqtt, ...)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="DEBUG, INFO, WARNING or ERROR, in any case (default %(default)s)")
    args = p.parse_args(argv)
    try:
        config = load_agent_config(args.config)
    except ConfigError as e:
        print(f"heliotrope agent: {e}", file=sys.stderr)
        return 2
    try:  # TLS files that cannot be used stop the start, as they stop `heliotrope serve`, not a retry for ever
        tls_context(config.mqtt)
    except MqttTlsError as e:
        print(f"heliotrope agent: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(config))
    except AgentStartError as e:
        print(f"heliotrope agent: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
