"""Run the broker and its HTTP API until SIGINT or SIGTERM, then shut down gracefully: stop taking
requests, let dispatches in flight finish, close the sites and the store.

Before anything starts, :func:`check_startup` refuses a configuration that is unsafe or cannot work, with a
one-line error (:class:`StartupRefused`, printed by the CLI as ``heliotrope: ...``):

- **No open API beyond this machine.** With ``broker.auth.enabled`` false anyone who reaches the API may use
  it, so the broker then listens on a loopback address only (127.0.0.1, ::1, localhost) and logs a WARNING
  saying so; on any other address it refuses to start. Turn ``broker.auth.enabled`` on, or listen on
  127.0.0.1. With authentication on but plain HTTP on a non-loopback address, a WARNING says that bearer
  tokens travel in clear text.
- **HTTPS from ``broker.tls``** (:func:`server_tls_context`): TLS 1.2 or later with ``cert_file`` and
  ``key_file`` (PEM, read once at start); with ``client_ca_file`` every client must present a certificate
  signed by that CA (mutual TLS). A file that cannot be read or is not PEM, an encrypted key, or a key that
  is not the certificate's is named in the error. Leave ``broker.tls`` unset to serve plain HTTP.
- **Replicas reach their leader over the same TLS** (:func:`forwarding_tls_context`): a replica that does
  not lead passes requests on to the leader's HTTPS URL trusting ``peer_ca_file`` (else the system's CA
  store) and, where the replicas ask for client certificates (``client_ca_file``), presenting its own
  ``cert_file``: the replicas' certificates are then signed by that CA for client use too.
- **The MQTT connection's TLS files** (``broker.mqtt.ca_file``, ``cert_file``, ``key_file``;
  :func:`adapters.mqtt_protocol.tls_context`) are loaded once too, so a bad one stops the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import re
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from aiohttp import web

from adapters.mqtt_protocol import tls_context as mqtt_tls_context
from broker.api import create_app
from broker.config import BrokerSettings, ServerTlsSettings
from broker.models import SiteSpec
from broker.protocol_errors import BrokerRunner
from broker.service import Broker
from broker.store import describe_db

log = logging.getLogger("heliotrope")


class StartupRefused(ValueError):
    """The broker will not start with these settings; the message says what is wrong and what to do."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_startup(settings: BrokerSettings) -> ssl.SSLContext | None:
    """Refuse (:class:`StartupRefused`) an open API on a non-loopback address and TLS files that cannot be
    used; the server's TLS context when ``settings.tls`` is set, else None."""
    if not settings.auth.enabled and not _is_loopback(settings.host):
        raise StartupRefused(
            f"listening on {settings.host or 'every address'} without authentication is refused: set "
            "broker.auth.enabled: true (and create tokens with `heliotrope token create`) or listen on 127.0.0.1")
    if settings.mqtt is not None:
        mqtt_tls_context(settings.mqtt)  # raises MqttTlsError (a ValueError) naming the file
    if settings.tls is None:
        return None
    context = server_tls_context(settings.tls)
    forwarding_tls_context(settings.tls)  # (its files too: a bad one stops the start, not the first request)
    return context


def server_tls_context(tls: ServerTlsSettings) -> ssl.SSLContext:
    """An HTTPS server context: TLS 1.2 or later, ``cert_file`` with ``key_file``, and with
    ``client_ca_file`` a client certificate signed by that CA required. :class:`StartupRefused` names the
    setting and the file that cannot be used, and why."""
    cert = _read_pem("broker.tls.cert_file", tls.cert_file)
    key = _read_pem("broker.tls.key_file", tls.key_file)
    if "-----BEGIN CERTIFICATE-----" not in cert:
        raise StartupRefused(f"broker.tls.cert_file {tls.cert_file}: no PEM certificate in it "
                             "(a block starting -----BEGIN CERTIFICATE-----)")
    if "PRIVATE KEY-----" not in key:
        raise StartupRefused(f"broker.tls.key_file {tls.key_file}: no PEM private key in it "
                             "(a block starting -----BEGIN PRIVATE KEY-----)")
    try:  # the certificates alone first, so that an error can name the file at fault
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert)
    except ssl.SSLError as e:
        raise StartupRefused(f"broker.tls.cert_file {tls.cert_file}: not a usable PEM certificate "
                             f"({_ssl_reason(e)})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_never_prompt(tls.key_file))
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise StartupRefused(f"broker.tls.key_file {tls.key_file}: not the private key of the certificate in "
                                 f"broker.tls.cert_file {tls.cert_file}") from None
        raise StartupRefused(f"broker.tls.key_file {tls.key_file}: not a usable PEM private key "
                             f"({_ssl_reason(e)})") from None
    except OSError as e:  # removed or made unreadable since it was read above
        raise StartupRefused(f"broker.tls: cannot read {tls.cert_file} or {tls.key_file}: {e.strerror or e}") from None
    if tls.client_ca_file is not None:
        _read_pem("broker.tls.client_ca_file", tls.client_ca_file)
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise StartupRefused(f"broker.tls.client_ca_file {tls.client_ca_file}: no usable PEM CA certificate "
                                 f"in it ({_ssl_reason(e)})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def forwarding_tls_context(tls: ServerTlsSettings | None) -> ssl.SSLContext | None:
    """The context a replica passes requests on to the leader with (module docstring); None without
    ``broker.tls`` (plain HTTP). :class:`StartupRefused` names a file that cannot be used."""
    if tls is None:
        return None
    context = ssl.create_default_context()
    if tls.peer_ca_file is not None:
        _read_pem("broker.tls.peer_ca_file", tls.peer_ca_file)
        try:
            context.load_verify_locations(cafile=tls.peer_ca_file)
        except (OSError, ValueError) as e:
            raise StartupRefused(f"broker.tls.peer_ca_file {tls.peer_ca_file}: no usable PEM CA certificate in it "
                                 f"({_ssl_reason(e)})") from None
    if tls.client_ca_file is not None:  # the leader asks every client for a certificate: this replica's own
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_never_prompt(tls.key_file))
    return context


def _never_prompt(key_file: str) -> Callable[[], bytes]:
    def refuse() -> bytes:  # OpenSSL would otherwise ask on the terminal
        raise StartupRefused(f"broker.tls.key_file {key_file}: the key is encrypted and the broker cannot ask for "
                             "its passphrase: decrypt it (openssl pkey -in KEY -out PLAIN_KEY)")
    return refuse


def _ssl_reason(e: BaseException) -> str:
    """An ``ssl.SSLError``'s text without the source location OpenSSL appends (``(_ssl.c:3926)``)."""
    text = e.args[1] if isinstance(e, ssl.SSLError) and len(e.args) > 1 else str(e)
    return re.sub(r"\s*\(_ssl\.c:\d+\)", "", str(text))


def _read_pem(setting: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as e:
        raise StartupRefused(f"{setting} {path}: cannot read: {e.strerror or e}") from None


@contextlib.contextmanager
def serving_database(db: str) -> Iterator[None]:
    """While a broker serves an SQLite database it holds an advisory lock on the file: one broker serves such
    a database (replicas share a PostgreSQL one). A second ``heliotrope serve`` on it (the same config run again
    in another terminal) stops here, before it reconciles: its own simulated sites know none of the first one's
    attempts, so it would requeue and dispatch again every job the first one runs, behind its back. The
    token commands, which write the database beside a running broker, do not take the lock."""
    if "://" in db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    path = Path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # (the mode the store gives a new database)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StartupRefused(f"another broker is serving database {db}; one broker serves an SQLite database "
                                 "(replicas share a PostgreSQL one): stop that one, or give this one another "
                                 "--db") from None
        yield
    finally:
        os.close(fd)  # after the store has closed: closing a descriptor of the file drops SQLite's own locks


async def run(
    settings: BrokerSettings,
    sites: list[SiteSpec],
    feeder: Callable[[str], Awaitable[None]] | None = None,
    ready: Callable[[int], None] | None = None,
    log_jobs: bool = False,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("heliotrope.jobs").setLevel(logging.INFO if log_jobs else logging.WARNING)
    tls = check_startup(settings)
    with serving_database(settings.db):
        await _serve(settings, sites, tls, feeder, ready)


async def _serve(
    settings: BrokerSettings,
    sites: list[SiteSpec],
    tls: ssl.SSLContext | None,
    feeder: Callable[[str], Awaitable[None]] | None,
    ready: Callable[[int], None] | None,
) -> None:
    broker = Broker(settings)
    try:
        await broker.start(sites)
    except BaseException:
        # What it opened (the store's writer thread, the sites, the MQTT hub) would keep the process alive.
        with contextlib.suppress(Exception):
            await broker.stop()
        raise
    runner = BrokerRunner(create_app(broker), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024, ssl_context=tls)
    try:
        await site.start()
    except BaseException as e:  # (what start opened would keep the process alive)
        await runner.cleanup()
        await broker.stop()
        if isinstance(e, OSError):
            raise OSError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
        raise
    port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else settings.port  # type: ignore[union-attr]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    # A replica runs no site until it leads (then the database's sites, which the config's only add to): a count
    # now would read 0 whatever the config and the database hold.
    sites_run = ("sites run by whichever replica leads" if broker.replicas is not None
                 else f"{len(broker.federation.members)} sites")
    print(f"heliotrope serving on {url}  (db {describe_db(settings.db)}, {sites_run})", flush=True)
    if not settings.auth.enabled:  # only on loopback: check_startup refused it elsewhere
        log.warning("the API is open to anyone on this machine: authentication is off (broker.auth.enabled); "
                    "it listens on %s only", settings.host)
    elif tls is None and not _is_loopback(settings.host):
        log.warning("bearer tokens travel in clear text: plain HTTP on %s; set broker.tls (cert_file, key_file) "
                    "or serve behind a TLS proxy", settings.host)
    if broker.replicas is not None:
        broker.elect(broker.replicas.advertise_url or url)
        log.info("one of several replicas: competing for leadership as %s", broker.replicas.advertise_url or url)
    if ready is not None:
        ready(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    feed_task = loop.create_task(feeder(url)) if feeder else None
    try:
        await stop.wait()
    finally:
        print("heliotrope shutting down", flush=True)
        if feed_task is not None:
            feed_task.cancel()
            await asyncio.gather(feed_task, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
        await broker.stop()
