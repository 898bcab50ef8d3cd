"""The wire protocol between the broker and site agents over MQTT, version 1.

Every message is one UTF-8 JSON object with ``"v": 1`` and a ``"kind"``; a receiver drops (and counts) a
payload that is not valid JSON, has another version, an unknown kind, a field of the wrong type or a site
that does not match its topic, and never crashes on one (:func:`decode`). Heartbeats, status, events,
commands and replies are published at QoS 1, so MQTT delivers each at least once; the application-level
acknowledgements below make them survive a restart of the MQTT broker or a lost session too, and every
handler is idempotent, so a duplicate is harmless. ``ack`` and ``lease`` go at QoS 0: a lost one is
covered by the event's resend and by the next heartbeat's grant.

Topics (``{site}`` is the site's name; ``heliotrope/v1`` changes with an incompatible protocol):

=================================== ============ ======== ================================================
topic                               direction    retained messages
=================================== ============ ======== ================================================
``heliotrope/v1/sites/{site}/state``  agent→broker yes      ``heartbeat``: capacity, telemetry, quotas, the
                                                          attempts the site holds (and those whose end
                                                          event is not acknowledged yet); renews the lease.
                                                 no       ``attempts``: a part of a heartbeat's list of
                                                          attempts too long for the heartbeat itself
``heliotrope/v1/sites/{site}/status`` agent→broker yes      ``status``: online, or offline (the last will,
                                                          published by the MQTT broker when the agent's
                                                          connection dies, so the broker sees the site
                                                          go dark at once)
``heliotrope/v1/sites/{site}/up``     agent→broker no       ``event`` (a job event, resent until ``ack``),
                                                          ``reply`` (the answer to a command),
                                                          ``log_chunk`` (a part of a followed log)
``heliotrope/v1/sites/{site}/down``   broker→agent no       ``dispatch``, ``cancel``, ``preempt``, ``quota``,
                                                          ``logs`` (commands, resent until the ``reply``),
                                                          ``ack``, ``lease``, ``logs_stop``
=================================== ============ ======== ================================================

The agent opens the only connection (to the MQTT broker), so a site behind NAT or a firewall that allows
outgoing connections only works. It connects with a persistent session (``clean_session`` false, a fixed
client id per site), so QoS 1 messages published to it while it is briefly away are kept for it, commands until
the broker's wait for them ends ("Commands expire"). Both sides speak MQTT 5 where the MQTT broker takes it, and
3.1.1 otherwise (the payloads are the same); each new connection asks for 5 first.

Both sides connect with the same options (:func:`client_options`). Over TLS (:func:`tls_context`) when
``mqtt.tls`` is true (the MQTT broker's certificate verified by the system's CA store), when ``mqtt.ca_file``
names a PEM CA bundle (a private CA; implies TLS), or when ``mqtt.cert_file`` and ``mqtt.key_file`` give a
client certificate for an MQTT broker that requires one; TLS 1.2 or later, host name checked. Leave all
four unset for plain MQTT.

Commands and replies
    A command carries a ``msg_id`` (unique per broker process and command). The agent answers each with a
    ``reply`` naming that ``msg_id``; the broker resends a command until it has the reply or gives up
    (its dispatch timeout). The agent keeps the replies it sent recently and answers a repeated ``msg_id``
    with the same reply without doing the work again (a read, ``logs`` or a quota ``get``, is read again); a
    dispatch is also keyed by (job id, attempt) in the adapter below, so the same attempt never runs twice.

Commands expire
    Every command but ``cancel`` is good only while the broker waits for its reply: the broker has told its
    caller it failed once the wait is over (a quota set answered 503), and it must not be carried out then by an
    agent that was away while its persistent session kept it. So, over MQTT 5 (the broker's hub speaks it where
    the MQTT broker takes it, :func:`client_options`), each copy of a command goes with:

    - a Message Expiry Interval (:func:`expiry_interval_s`) that ends within what is left of the wait, so the MQTT
      broker drops a copy it still holds for an agent that is away; it does so for an agent of MQTT 3.1.1 too (the
      interval is the MQTT broker's to honour; tested with Mosquitto 2.0). It counts whole seconds: a wait shorter
      than ``EXPIRY_SLACK_S + 1`` (2.5 s) is not matched, and a resend later in the wait than that is not sent;
    - the user property :data:`DEADLINE_PROPERTY`, ``"BOOT SEQ AFTER_S"``: the wait ends ``AFTER_S`` seconds after
      the broker received the heartbeat ``SEQ`` of the agent process ``BOOT``. An agent that speaks MQTT 5 (a user
      property never reaches a client of 3.1.1) and sent that heartbeat counts from when it *sent* it, on its own
      monotonic clock, so its end of the wait comes first, as with leases, with no need for the two clocks to
      agree on the time; it drops a command that comes after that end (counted in ``SiteAgent.expired``, logged)
      and carries out one naming another process or a heartbeat it no longer remembers as before (the expiry
      interval still holds for it).

    Neither touches the payload: an agent of an earlier release reads every command as before, and a broker of an
    earlier release sends them without either. A ``cancel`` does not expire: it stops exactly one attempt, which
    the broker wants gone for good and keeps asking for until the site confirms, so one carried out late does what
    the broker still wants. Over MQTT 3.1.1 (an MQTT broker that refuses 5; the hub logs a warning) no command
    expires. What remains: a command the agent takes just before the end of the wait, whose reply comes too late,
    is carried out while the broker answers that the site did not answer (as with any request with a timeout).

Logs
    ``logs`` asks for what an attempt printed (``adapters.base.LogReader``): the agent asks its site (for at most
    ``LOGS_ANSWER_S``) and answers with a ``reply`` whose ``logs`` carries the text, cut from its start (the
    tail is kept, ``truncated`` says so) to fit under ``mqtt.max_payload_bytes``; or not ok with ``no_logs``
    (``unsupported``: its site's adapter has none; ``not-found``: none of that attempt). An agent of an earlier
    release does not know the kind: it drops the request as malformed and never answers, and the broker, whose
    wait for the reply outlasts ``LOGS_ANSWER_S``, takes silence from an agent whose heartbeats keep coming for
    that (``adapters.remote``).

    Followed (``logs`` with ``follow: true``, ``adapters.base.LogFollower``): the ``reply`` carries no text, only
    whether lines before the tail were left out and where the log comes from; the text follows in ``log_chunk``
    messages named by the request's ``msg_id`` (``follow``) and numbered from 1 (``seq``), each under
    ``mqtt.max_payload_bytes`` and about ``LOG_CHUNK_CHARS`` characters at most (what the site wrote within
    ``LOG_CHUNK_WAIT_S`` goes together), until the attempt ends (the last says ``end``, with ``reason`` where the
    agent ended it sooner: its bound ``FOLLOW_MAX_S``). The broker drops a repeat (a ``seq`` it has) and ends the
    follow at a gap; it sends ``logs_stop`` when its reader leaves, and for a part of a follow it has no reader
    for (one a broker process before it began), and the agent stops reading its site. An agent
    follows at most ``FOLLOWS_MAX`` logs at once (more are answered not ok). The request's ``follow`` key is sent
    only when true: an agent of an earlier release refuses it as malformed and stays silent, as above.

Events and acknowledgements
    The agent gives each job event a ``msg_id`` (unique per agent boot) and resends it until the broker
    answers ``ack`` with that id. The broker acknowledges an event once it has applied it (stored the job's
    new state); an event for an attempt that is no longer current is acknowledged and ignored.

Leases
    Each ``heartbeat`` carries a ``seq`` (increasing per boot) and the agent's ``lease_s``. The broker answers
    every heartbeat it receives with ``lease`` (``boot``, ``seq``, ``lease_s``): the site's lease runs until
    ``lease_s`` after the broker *received* that heartbeat. The agent counts its lease from when it *sent*
    the heartbeat the grant answers, which is earlier, so the agent's view of its lease always ends first.
    An agent whose lease is about to end without a newer grant (it is partitioned from the broker) stops its
    jobs (a checkpointable job is checkpointed) before the end; the broker requeues a silent site's jobs
    only once the lease has run out. So a job never runs at two sites at once, on the usual assumption that
    the two clocks run at the same rate (not that they agree on the time: each side measures only
    durations on its own monotonic clock).

Reconciliation
    Each heartbeat lists the attempts the site holds. The broker cancels an attempt it no longer has at that
    site (requeued after a lease ran out, withdrawn, finished), and keeps those that are still current.

Long lists of attempts
    A heartbeat whose payload would be over ``mqtt.max_payload_bytes`` (``MAX_PAYLOAD_BYTES``, 4 MiB or about
    65,000 attempts, unless set lower for an MQTT broker with a smaller cap), which the MQTT broker or the
    receiver drops, lists its attempts in ``attempts`` messages instead: the heartbeat says how many
    (``attempt_parts``) and carries none, and each part (``boot``, ``seq`` of that heartbeat, ``part`` of
    ``parts``) about ``ATTEMPT_PART_BYTES`` of them (less, to fit under ``mqtt.max_payload_bytes``), published
    right after it on the same topic, not retained.
    The heartbeat renews the lease on its own, whatever becomes of its parts. The broker takes the list once
    every part of one heartbeat has come, in any order and however often (a part of an older heartbeat than
    the list it holds, or of a replaced agent process, is dropped); until then it keeps the list it had. A list
    lost in part is replaced by the next heartbeat's. A heartbeat that fits is sent as before, without
    ``attempt_parts``, so a broker of an earlier release takes it; such a broker refuses a split one (a key it
    does not know), as it dropped the oversize heartbeat before.

The size of a message
    Neither side sends a payload over its ``mqtt.max_payload_bytes`` (default ``MAX_PAYLOAD_BYTES``), nor takes
    one (dropped as ``too-large``): an MQTT broker with a smaller cap drops what is over it without a word
    (Mosquitto's ``message_size_limit``), or closes the connection that sent it (a cap on packets). Beyond the
    split list of attempts: an event's or a reply's ``reason`` (a site's own words) is cut short to fit
    (:func:`with_short_reason`); a reply still too large (a quota state of very many tenants) goes as a failed
    one saying so; a heartbeat too large without its attempts is not sent (an error, logged once), and the
    broker refuses a job whose dispatch would be too large at once, naming the setting. The cap is set, not
    learnt from the MQTT broker (MQTT 3.1.1's CONNACK announces none, and the agent may speak it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import ssl
from collections import OrderedDict
from typing import Annotated, Any, Literal

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    field_serializer,
    model_serializer,
)

from adapters.base import EventKind, JobEvent, JobLogs
from broker.models import MQTT_MAX_PAYLOAD_BYTES, Job, MqttSettings, QuotaState, SiteState, TenantQuota, UtcDatetime

MAX_RUN_S = 10 * 366 * 86400.0  # ten years: more than any attempt runs, less than a float that breaks a date

log = logging.getLogger(__name__)

VERSION = 1
ROOT = f"heliotrope/v{VERSION}/sites"
MAX_PAYLOAD_BYTES = MQTT_MAX_PAYLOAD_BYTES
"""The largest payload either side sends or takes where ``mqtt.max_payload_bytes`` is not set."""
ATTEMPT_PART_BYTES = 1 << 20
"""About how much of a split list of attempts one ``attempts`` message carries (see "Long lists of attempts")."""
MAX_ATTEMPT_PARTS = 10_000


class MqttTlsError(aiomqtt.MqttError, ValueError):
    """A TLS setting of ``mqtt`` that cannot be used (a CA bundle or client certificate that cannot be read);
    the message names the field and the file. An ``MqttError``, so the reconnect loops of the hub and the agent
    log it in one line and try again (a certificate mounted late is picked up); a ``ValueError``, so the
    broker's check at start (``broker.server.check_startup``) stops ``heliotrope serve`` with it."""


def tls_context(settings: MqttSettings) -> ssl.SSLContext | None:
    """The TLS context for ``settings``, or None for plain MQTT. It verifies the MQTT broker's certificate and
    host name against ``ca_file`` (else the system's CA store) and presents ``cert_file``/``key_file`` when
    set. :class:`MqttTlsError` names the field and the file that could not be used."""
    if not settings.uses_tls:
        return None
    try:
        context = ssl.create_default_context(cafile=settings.ca_file)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise MqttTlsError(f"mqtt.ca_file {settings.ca_file}: {_reason(e)}: give a readable PEM CA bundle") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.cert_file is not None and settings.key_file is not None:
        try:
            context.load_cert_chain(settings.cert_file, settings.key_file, password=_no_passphrase)
        except (OSError, ValueError) as e:
            raise MqttTlsError(f"mqtt.cert_file {settings.cert_file} with mqtt.key_file {settings.key_file}: "
                               f"{_reason(e)}: give a PEM certificate and its unencrypted private key") from None
    return context


def _no_passphrase() -> bytes:
    raise ValueError("the private key is encrypted (decrypt it: openssl pkey -in KEY -out KEY.plain)")


def _reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):  # without the source location OpenSSL appends, "(_ssl.c:3926)"
        return "not usable ({})".format(str(e.args[-1]).split(" (_ssl.c:")[0])
    if isinstance(e, OSError):
        return f"cannot read ({e.strerror or e})"
    return str(e)


def client_options(settings: MqttSettings, identifier: str,
                   protocol: aiomqtt.ProtocolVersion = aiomqtt.ProtocolVersion.V311) -> dict[str, Any]:
    """``aiomqtt.Client`` arguments for either side: ``protocol`` (both sides ask for MQTT 5, whose commands expire,
    and speak 3.1.1 where the MQTT broker refuses it: :func:`refuses_mqtt5`), a persistent session under a fixed
    client id (3.1.1: ``clean_session`` false; 5: ``clean_start`` false and a session that never expires, as
    3.1.1's does), the password from ``settings.password_env``, and TLS (:func:`tls_context`) when
    ``settings.tls``, ``ca_file`` or ``cert_file`` is set. Used by the broker's hub (:mod:`adapters.remote`) and
    the site agent (:mod:`adapters.agent`)."""
    password = os.environ.get(settings.password_env) if settings.password_env else None
    if settings.password_env and password is None:
        log.warning("mqtt: environment variable %s (the MQTT password) is not set; connecting without one",
                    settings.password_env)
    options: dict[str, Any] = {
        "hostname": settings.host, "port": settings.port, "identifier": identifier,
        "protocol": protocol, "keepalive": settings.keepalive_s,
        "username": settings.username, "password": password,
        "tls_context": tls_context(settings), "timeout": PUBLISH_TIMEOUT_S,
    }
    if protocol == aiomqtt.ProtocolVersion.V5:
        connect = Properties(PacketTypes.CONNECT)
        connect.SessionExpiryInterval = SESSION_NEVER_EXPIRES
        options |= {"clean_start": False, "properties": connect}
    else:
        options["clean_session"] = False
    return options


SESSION_NEVER_EXPIRES = 0xFFFFFFFF
"""MQTT 5's Session Expiry Interval for a session kept until the client ends it (3.1.1's persistent session)."""

EXPIRY_SLACK_S = 1.5
"""What a command's Message Expiry Interval leaves of the broker's wait: 1 s for the MQTT broker counting whole
seconds (Mosquitto still delivers a message in the second its interval ends), and 0.5 s for the publish's way to
the MQTT broker, which starts the count when it has the message."""


def expiry_interval_s(within_s: float) -> int:
    """The Message Expiry Interval (whole seconds, at least 1: MQTT has no shorter one, and 0 is none) that has
    the MQTT broker drop a command it still holds before ``within_s`` seconds from now have passed: what is left
    of the broker's wait for the reply, less :data:`EXPIRY_SLACK_S`. That holds where ``within_s`` is at least
    ``EXPIRY_SLACK_S + 1``; from a shorter one, the command may still be delivered up to that long after it was
    published (see "Commands and replies")."""
    return max(1, math.floor(within_s - EXPIRY_SLACK_S))


DEADLINE_PROPERTY = "heliotrope-deadline"
"""The MQTT 5 user property of a command that says when the broker's wait for it ends (see "Commands expire")."""


def expiring(interval_s: int, deadline: tuple[str, int, float] | None = None) -> Properties:
    """PUBLISH properties with the Message Expiry Interval ``interval_s`` (MQTT 5), and with ``deadline``
    (``boot``, ``seq``, ``after_s``: the broker's wait ends ``after_s`` seconds after it received the heartbeat
    ``seq`` of the agent process ``boot``) as the user property :data:`DEADLINE_PROPERTY`."""
    properties = Properties(PacketTypes.PUBLISH)
    properties.MessageExpiryInterval = interval_s
    if deadline is not None:
        boot, seq, after_s = deadline
        properties.UserProperty = [(DEADLINE_PROPERTY, f"{boot} {seq} {after_s:.3f}")]
    return properties


def command_deadline(properties: Any) -> tuple[str, int, float] | None:
    """The (``boot``, ``seq``, ``after_s``) a command's :data:`DEADLINE_PROPERTY` says, or None where it has none
    (a broker of an earlier release, or one that speaks MQTT 3.1.1) or one that cannot be read."""
    for name, value in getattr(properties, "UserProperty", None) or []:
        if name != DEADLINE_PROPERTY:
            continue
        try:
            boot, seq, after_s = str(value).split(" ")
            after = float(after_s)
            return (boot, int(seq), after) if math.isfinite(after) else None
        except ValueError:
            return None
    return None


_REFUSED_VERSION = frozenset({1, 132})
"""CONNACK codes of a protocol version refused: MQTT 3.1.1's (1, which paho reads as MQTT 5's 132 when it asked
for 5) and MQTT 5's (132)."""


def refuses_mqtt5(e: BaseException) -> bool:
    """Whether ``e`` is the MQTT broker refusing the connection for its protocol version (one that speaks 3.1.1
    only, asked for MQTT 5)."""
    rc = getattr(e, "rc", None)
    code = getattr(rc, "value", rc)
    return isinstance(e, aiomqtt.exceptions.MqttConnectError) and isinstance(code, int) and code in _REFUSED_VERSION


PUBLISH_TIMEOUT_S = 5.0
"""How long one publish or subscribe may wait for the MQTT broker."""


_REFUSED_CREDENTIALS = frozenset({4, 5, 134, 135})
"""CONNACK codes of credentials refused: MQTT 3.1.1's bad username or password (4) and not authorised (5), and
MQTT 5's (134, 135)."""


def connection_hint(e: BaseException, settings: MqttSettings) -> str:
    """What to check for an MQTT connection that failed with ``e``, as text to put after it ("" for none): the
    settings that a refusal of credentials, or a TLS client and a plain listener meeting, point at."""
    rc = getattr(e, "rc", None)
    code = getattr(rc, "value", rc)
    # (only a CONNACK's code: paho's other error codes reuse the small numbers, 4 for no connection)
    if isinstance(e, aiomqtt.exceptions.MqttConnectError) and isinstance(code, int) and code in _REFUSED_CREDENTIALS:
        return ("; the MQTT broker refused the credentials: check mqtt.username and the password in the variable "
                f"mqtt.password_env names ({settings.password_env or 'unset: no password sent'})")
    text = str(e)
    if settings.uses_tls and ("reset by peer" in text or "WRONG_VERSION_NUMBER" in text or "EOF occurred" in text):
        return f"; mqtt.tls is on: is port {settings.port} a TLS listener (Mosquitto's usual one is 8883)?"
    return ""


TLS_PROBE_TIMEOUT_S = 2.0
"""How long :func:`speaks_tls` waits for a TLS handshake."""


async def connection_advice(e: BaseException, settings: MqttSettings) -> str:
    """:func:`connection_hint`, and for a plain client (no TLS setting) whose connect timed out, whether the
    port speaks TLS (:func:`speaks_tls`): a TLS listener drops a plain client's CONNECT, and the client, which
    is not told why, says only that the operation timed out. Used by the reconnect loops of the hub and the
    agent, for the line they log."""
    hint = connection_hint(e, settings)
    if hint or settings.uses_tls or "timed out" not in str(e):
        return hint
    if not await speaks_tls(settings.host, settings.port):
        return ""
    return (f"; no MQTT answer within {PUBLISH_TIMEOUT_S:g} s, and {settings.host}:{settings.port} is a TLS "
            "listener (it completed a TLS handshake): set mqtt.tls: true (and mqtt.ca_file for a private CA), or "
            "use the MQTT broker's plain port (Mosquitto's usual one is 1883)")


async def speaks_tls(host: str, port: int, timeout_s: float = TLS_PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` answers a TLS handshake: it completes (the certificate is not checked: only the
    protocol is asked), or the server ends it with a TLS alert (one that wants a client certificate). A plain
    MQTT listener closes the connection or waits for more bytes, and anything else is False too."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
    except ssl.SSLError as e:
        return "ALERT" in str(e).upper()  # the server speaks TLS, and refused this handshake
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


def topic(site: str, channel: Literal["state", "status", "up", "down"]) -> str:
    return f"{ROOT}/{site}/{channel}"


class Bounded(OrderedDict[Any, Any]):
    """A dict that forgets its oldest entries beyond ``limit`` (what either side of the link remembers of
    recent messages and attempts)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


UP_SUBSCRIPTIONS = (f"{ROOT}/+/state", f"{ROOT}/+/status", f"{ROOT}/+/up")
"""What the broker subscribes to: every site's agent-to-broker topics."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = VERSION
    site: str


# --- agent -> broker ---------------------------------------------------------------------------------------


class AttemptReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    attempt: int = Field(ge=1)
    status: Literal["admitted", "running"]


class Heartbeat(_Msg):
    kind: Literal["heartbeat"] = "heartbeat"
    boot: str = Field(min_length=1, max_length=64, description="unique per agent start")
    seq: int = Field(ge=0)
    sent_at: UtcDatetime
    lease_s: float = Field(gt=0, le=3600)
    state: SiteState
    attempts: list[AttemptReport] = Field(default_factory=list)
    attempt_parts: int | None = Field(
        default=None, ge=1, le=MAX_ATTEMPT_PARTS,
        description="the attempts are listed in this many ``attempts`` messages, not here (None: here)")

    @field_serializer("state", mode="wrap")
    def _telemetry_as_sent(self, state: SiteState, handler: SerializerFunctionWrapHandler) -> Any:
        """The site's report with its telemetry as :meth:`Telemetry.wire` writes it: the throttle fields only
        when the site reports them, so a broker of an earlier release takes the heartbeat of a site without."""
        data = handler(state)
        data["telemetry"] = state.telemetry.wire()
        return data

    @model_serializer(mode="wrap")
    def _as_sent(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Without ``attempt_parts`` where the heartbeat lists its attempts itself, so a broker of an earlier
        release (which refuses keys it does not know) takes it."""
        data = handler(self)
        if data.get("attempt_parts", 0) is None:
            del data["attempt_parts"]
        return data


class AttemptsPart(_Msg):
    """One part of the attempts a heartbeat (``boot``, ``seq``) with ``attempt_parts`` lists."""

    kind: Literal["attempts"] = "attempts"
    boot: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0, description="the heartbeat whose list this is a part of")
    part: int = Field(ge=0, lt=MAX_ATTEMPT_PARTS)
    parts: int = Field(ge=1, le=MAX_ATTEMPT_PARTS)
    attempts: list[AttemptReport]


def split_attempts(beat: Heartbeat, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> tuple[Heartbeat, list[AttemptsPart]]:
    """``beat`` as it goes out where it is too large to go whole: without its attempts, which go in parts of
    about ``ATTEMPT_PART_BYTES`` each, or less where each would be over ``max_payload_bytes`` (by their length
    in JSON; one part at least)."""
    frame = len(encode(AttemptsPart(site=beat.site, boot=beat.boot, seq=beat.seq, part=MAX_ATTEMPT_PARTS - 1,
                                    parts=MAX_ATTEMPT_PARTS, attempts=[])))
    budget = max(1, min(ATTEMPT_PART_BYTES, max_payload_bytes - frame))
    chunks: list[list[AttemptReport]] = [[]]
    size = 0
    for report in beat.attempts:
        # (json.dumps writes every character outside ASCII as \uXXXX: never shorter than the UTF-8 sent)
        length = len(json.dumps(report.job_id)) + len(str(report.attempt)) + len(report.status) + _REPORT_FRAME
        if size + length > budget and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(report)
        size += length
    head = beat.model_copy(update={"attempts": [], "attempt_parts": len(chunks)})
    parts = [AttemptsPart(site=beat.site, boot=beat.boot, seq=beat.seq, part=i, parts=len(chunks), attempts=chunk)
             for i, chunk in enumerate(chunks)]
    return head, parts


_REPORT_FRAME = len('{"job_id":,"attempt":,"status":""},')


class Status(_Msg):
    kind: Literal["status"] = "status"
    boot: str = Field(min_length=1, max_length=64)
    online: bool
    at: UtcDatetime


class WireEvent(BaseModel):
    # Every number finite and every time zoned: they go into the job as the broker stores it (a NaN, an
    # infinity or a naive time there would make the job unreadable, and the broker unable to start again).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    job_id: str
    attempt: int = Field(ge=1)
    kind: EventKind
    at: UtcDatetime
    reason: str | None = None
    run_s: float = Field(default=0.0, ge=0, le=MAX_RUN_S, description="seconds the attempt ran")

    @classmethod
    def of(cls, ev: JobEvent) -> WireEvent:
        return cls(job_id=ev.job_id, attempt=ev.attempt, kind=ev.kind, at=ev.at, reason=ev.reason, run_s=ev.run_s)

    def job_event(self) -> JobEvent:
        return JobEvent(self.job_id, self.attempt, self.kind, self.at, self.reason, self.run_s)


class EventMsg(_Msg):
    kind: Literal["event"] = "event"
    boot: str = Field(min_length=1, max_length=64)
    msg_id: int = Field(ge=0)
    event: WireEvent


LOGS_ANSWER_S = 8.0
"""How long an agent waits for its site's logs before it answers that the site did not give them."""


class WireLogs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    truncated: bool = Field(description="lines or bytes before the text were left out")
    source: str | None = Field(default=None, max_length=500, description="where the site read it")

    @classmethod
    def of(cls, logs: JobLogs) -> WireLogs:
        return cls(text=logs.text, truncated=logs.truncated, source=(logs.source or "")[:500] or None)

    def job_logs(self) -> JobLogs:
        return JobLogs(self.text, self.truncated, self.source)


LOG_CHUNK_CHARS = 8192
"""At most this many characters of a followed log go in one ``log_chunk`` (and fewer where ``mqtt.max_payload_bytes``
is small: a character takes at most 6 bytes of JSON)."""
LOG_CHUNK_WAIT_S = 0.2
"""What a site writes within this long of the first unsent text goes in one ``log_chunk`` (fewer messages for a
job that prints many short lines)."""
FOLLOW_MAX_S = 24 * 3600.0
"""How long an agent follows one log at most (as long as the broker's own bound)."""
FOLLOWS_MAX = 32
"""How many logs one agent follows at once at most."""


class LogChunk(_Msg):
    """A part of a followed log (see "Logs" above)."""

    kind: Literal["log_chunk"] = "log_chunk"
    follow: str = Field(min_length=1, max_length=128, description="the msg_id of the logs request it answers")
    seq: int = Field(ge=1)
    text: str = ""
    end: bool = Field(default=False, description="the last: the attempt ended, or the agent stopped following")
    reason: str | None = Field(default=None, max_length=1000, description="why the agent stopped it sooner")


class Reply(_Msg):
    kind: Literal["reply"] = "reply"
    msg_id: str = Field(min_length=1, max_length=128)
    ok: bool = Field(description="false: the command failed at the site (``reason`` says why)")
    admitted: bool | None = Field(default=None, description="dispatch: whether the site admitted the attempt")
    reason: str | None = None
    quota: QuotaState | None = Field(default=None, description="quota commands: the site's quota state after it")
    not_found: bool = Field(default=False, description="quota remove: the tenant had no quota there")
    refused: str | None = Field(
        default=None, description="quota set: the field of the quota the site refuses (it asks for GPUs the site "
                                  "does not have; ``reason`` says which)",
        # Left out where unset: a broker of an earlier release, whose Reply forbids keys it does not know, reads it.
        exclude_if=lambda field: field is None)
    # (Both left out where unset, as ``refused``: only an answer to ``logs``, which only this release sends, has them.)
    logs: WireLogs | None = Field(default=None, description="logs: what the attempt printed",
                                  exclude_if=lambda field: field is None)
    no_logs: Literal["unsupported", "not-found"] | None = Field(
        default=None, description="logs: why there are none (``reason`` says more): the site cannot give logs, or "
                                  "has none of the attempt", exclude_if=lambda field: field is None)


# --- broker -> agent ---------------------------------------------------------------------------------------


class Dispatch(_Msg):
    kind: Literal["dispatch"] = "dispatch"
    msg_id: str = Field(min_length=1, max_length=128)
    job: Job

    @field_serializer("job", mode="wrap")
    def _without_routing(self, job: Job, handler: SerializerFunctionWrapHandler) -> Any:
        """The job without ``spec.deferrable``, ``spec.max_lost_attempts`` and its dependencies (``spec.after``,
        ``spec.after_any``, ``spec.after_failed``, and ``waiting``): they are the broker's to honour (no site defers
        a job, counts its losses or holds it for others), and an agent of an earlier release, whose spec forbids keys
        it does not know, would refuse the dispatch."""
        data = handler(job)
        data["spec"].pop("deferrable", None)
        data["spec"].pop("max_lost_attempts", None)
        for kind in ("after", "after_any", "after_failed"):
            data["spec"].pop(kind, None)
        data.pop("waiting", None)
        return data


class Cancel(_Msg):
    kind: Literal["cancel"] = "cancel"
    msg_id: str = Field(min_length=1, max_length=128)
    job_id: str
    attempt: int = Field(ge=1)


class Preempt(_Msg):
    """Checkpoint and stop a running attempt (``adapters.base.Preempter``): the agent has its site preempt
    it, and the site's ``preempted`` event follows as an ``event``. An agent whose site cannot replies not ok."""

    kind: Literal["preempt"] = "preempt"
    msg_id: str = Field(min_length=1, max_length=128)
    job_id: str
    attempt: int = Field(ge=1)
    reason: str = Field(max_length=1000)


class LogsRequest(_Msg):
    """What an attempt printed (see "Logs" above): its last ``tail_lines`` lines (None: all), at most its last
    ``limit_bytes`` bytes."""

    kind: Literal["logs"] = "logs"
    msg_id: str = Field(min_length=1, max_length=128)
    job_id: str
    attempt: int = Field(ge=1)
    tail_lines: int | None = Field(default=None, ge=1)
    limit_bytes: int = Field(ge=0)
    # (Left out where false: an agent of an earlier release reads a plain request as before, and refuses a follow.)
    follow: bool = Field(default=False, description="then the text as it is written, in log_chunk messages",
                         exclude_if=lambda field: not field)


class LogsStop(_Msg):
    """The broker's reader of a followed log has left: the agent stops following it."""

    kind: Literal["logs_stop"] = "logs_stop"
    follow: str = Field(min_length=1, max_length=128, description="the msg_id of the logs request")


class QuotaCommand(_Msg):
    kind: Literal["quota"] = "quota"
    msg_id: str = Field(min_length=1, max_length=128)
    op: Literal["get", "set", "remove", "forget"]
    quota: TenantQuota | None = None
    tenant: str | None = None


class Ack(_Msg):
    kind: Literal["ack"] = "ack"
    boot: str = Field(min_length=1, max_length=64, description="the agent boot whose events these are")
    msg_ids: list[int] = Field(min_length=1)


class LeaseGrant(_Msg):
    kind: Literal["lease"] = "lease"
    boot: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0, description="the heartbeat this answers")
    lease_s: float = Field(gt=0, le=3600)


UpMessage = Annotated[Heartbeat | AttemptsPart | Status | EventMsg | Reply | LogChunk, Field(discriminator="kind")]
DownMessage = Annotated[Dispatch | Cancel | Preempt | QuotaCommand | LogsRequest | Ack | LeaseGrant | LogsStop,
                        Field(discriminator="kind")]
Command = Dispatch | Cancel | Preempt | QuotaCommand | LogsRequest
_UP: TypeAdapter[Any] = TypeAdapter(UpMessage)
_DOWN: TypeAdapter[Any] = TypeAdapter(DownMessage)
_CHANNEL_KINDS = {"state": {"heartbeat", "attempts"}, "status": {"status"}, "up": {"event", "reply", "log_chunk"},
                  "down": {"dispatch", "cancel", "preempt", "quota", "logs", "ack", "lease", "logs_stop"}}


class MalformedMessage(ValueError):
    """A payload that breaks the protocol; ``reason`` is a short label for counting (``bad-json``,
    ``wrong-version``, ``invalid``, ``wrong-topic``, ``too-large``), the message says what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=False).encode()


def too_large(payload: bytes, max_payload_bytes: int, what: str) -> str | None:
    """Why ``payload`` (``what`` it is) cannot go out under ``max_payload_bytes``, or None where it fits. The
    MQTT broker would drop it (or close the connection that sent it), and the other side would refuse it."""
    if len(payload) <= max_payload_bytes:
        return None
    return (f"{what} is {len(payload)} bytes, more than mqtt.max_payload_bytes ({max_payload_bytes}), which the "
            "MQTT broker and the other side take")


_ELLIPSIS = " [...]"


def with_short_reason(msg: EventMsg | Reply, max_payload_bytes: int) -> EventMsg | Reply:
    """``msg`` with its ``reason`` (a site's own words, of any length) cut short so that it fits under
    ``max_payload_bytes`` where it is the reason that does not; ``msg`` itself where it fits, or has no reason
    to cut."""
    excess = len(encode(msg)) - max_payload_bytes
    reason = msg.event.reason if isinstance(msg, EventMsg) else msg.reason
    if excess <= 0 or not reason:
        return msg
    # Cut by characters, the excess counted in bytes as JSON writes them (at most 6 per character: \uXXXX).
    keep = max(0, len(reason) - excess - len(_ELLIPSIS))
    while True:
        short = reason[:keep] + _ELLIPSIS
        if isinstance(msg, EventMsg):
            cut: EventMsg | Reply = msg.model_copy(update={"event": msg.event.model_copy(update={"reason": short})})
        else:
            cut = msg.model_copy(update={"reason": short})
        if len(encode(cut)) <= max_payload_bytes or keep == 0:
            return cut
        keep = max(0, keep - max(1, (len(encode(cut)) - max_payload_bytes)))


def with_short_logs(reply: Reply, max_payload_bytes: int) -> Reply:
    """``reply`` with its logs' text cut from the start (the tail kept, from a line's start where one is in
    what is kept, and ``truncated`` set) so that it fits under ``max_payload_bytes``; ``reply`` itself where it
    fits or has no logs.

    A character takes 1 to 4 bytes of UTF-8, and JSON writes some as more (a quote or a newline as 2 bytes, a
    control character as 6), so no count of bytes says how many characters to leave out: the longest tail that
    fits is searched for (about 20 encodings of the reply for a 1 MiB log)."""
    logs = reply.logs
    if logs is None or len(encode(reply)) <= max_payload_bytes:
        return reply
    text = logs.text

    def cut_at(start: int) -> Reply:
        return reply.model_copy(update={"logs": logs.model_copy(update={"text": text[start:], "truncated": True})})

    fits, too_long = len(text), 0  # text[fits:] fits (or is empty: nothing shorter could), text[too_long:] does not
    while fits - too_long > 1:
        mid = (fits + too_long) // 2
        if len(encode(cut_at(mid))) <= max_payload_bytes:
            fits = mid
        else:
            too_long = mid
    if text[fits - 1:fits] != "\n":  # (inside a line: from the next line's start, where one begins in what is kept)
        newline = text.find("\n", fits)
        if 0 <= newline < len(text) - 1:
            fits = newline + 1
    return cut_at(fits)


def log_chunk_chars(max_payload_bytes: int) -> int:
    """How many characters of a followed log one ``log_chunk`` carries at most under ``max_payload_bytes`` (JSON
    writes a character as 6 bytes at most; the rest of the message takes under 512)."""
    return max(1, min(LOG_CHUNK_CHARS, (max_payload_bytes - 512) // 6))


def parse_topic(name: str) -> tuple[str, str]:
    """(site, channel) of a protocol topic; MalformedMessage for any other topic."""
    parts = name.split("/")
    if len(parts) != 5 or "/".join(parts[:3]) != ROOT or parts[4] not in _CHANNEL_KINDS or not parts[3]:
        raise MalformedMessage("wrong-topic", f"{name!r} is not a heliotrope/v{VERSION} site topic")
    return parts[3], parts[4]


def decode(topic_name: str, payload: bytes | bytearray | str, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> Any:
    """The message a payload carries on ``topic_name``, checked against the topic's site and channel.
    Raises :class:`MalformedMessage` for anything else (a payload over ``max_payload_bytes``, this side's
    ``mqtt.max_payload_bytes``, too); an empty payload (a retained message cleared) decodes to None."""
    site, channel = parse_topic(topic_name)
    if not payload:
        return None
    if len(payload) > max_payload_bytes:
        raise MalformedMessage("too-large", f"{len(payload)} bytes is more than mqtt.max_payload_bytes "
                                            f"({max_payload_bytes})")
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, or nested too deep to parse
        raise MalformedMessage("bad-json", str(e) if not isinstance(e, RecursionError) else "nested too deeply") from None
    if not isinstance(doc, dict):
        raise MalformedMessage("invalid", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("v") != VERSION:
        raise MalformedMessage("wrong-version", f"v is {doc.get('v')!r}; this side speaks {VERSION}")
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in _CHANNEL_KINDS[channel]:  # (a list or an object: not hashable)
        raise MalformedMessage("wrong-topic", f"kind {kind!r} does not belong on {channel}")
    try:
        msg = (_DOWN if channel == "down" else _UP).validate_python(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "message"
        raise MalformedMessage("invalid", f"{kind}: {where}: {first['msg']}") from None
    if msg.site != site:
        raise MalformedMessage("wrong-topic", f"message for site {msg.site!r} on the topic of {site!r}")
    return msg
