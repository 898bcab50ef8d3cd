"""TLS from configuration, as a user meets it: the broker serves HTTPS (and, with ``broker.tls.client_ca_file``,
asks every client for a certificate), a bad certificate or key stops ``heliotrope serve`` with one line naming
the file, an open API is refused beyond loopback, and the broker's hub and a site agent talk over a real
Mosquitto's TLS listener. Every certificate comes from throwaway CAs made by ``trustme``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest
import trustme
import yaml
from cryptography.hazmat.primitives import serialization

from adapters import mqtt_protocol as proto
from adapters.agent import AgentConfig, SiteAgent
from adapters.remote import MqttHub
from adapters.simulated import SimulatedSite
from broker import cli
from broker.client import ApiClientError, Client
from broker.clock import SystemClock
from broker.config import AuthSettings, BrokerSettings, ServerTlsSettings
from broker.models import Health, JobState, MqttSettings
from broker.server import run
from broker.service import Broker
from tests.builders import job, site
from tests.mosquitto import Mosquitto, MosquittoMissing, MosquittoTls
from tests.services import missing


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA and the certificate it signed for 127.0.0.1 and localhost (the servers); a client CA
    and a client certificate it signed; a client certificate signed by the server CA (for Mosquitto, which
    checks clients against the CA it serves under); and a stranger's, signed by a CA nobody trusts."""

    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    ca_client_cert: Path
    ca_client_key: Path
    stranger_cert: Path
    stranger_key: Path


def _write(cert: trustme.LeafCert, folder: Path, name: str) -> tuple[Path, Path]:
    cert.cert_chain_pems[0].write_to_path(folder / f"{name}.pem")
    cert.private_key_pem.write_to_path(folder / f"{name}.key")
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, client_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    client_ca.cert_pem.write_to_path(d / "client-ca.pem")
    server = _write(ca.issue_cert("127.0.0.1", "localhost"), d, "server")
    client = _write(client_ca.issue_cert("operator@example.org"), d, "client")
    ca_client = _write(ca.issue_cert("agent.example.org"), d, "ca-client")
    stranger = _write(stranger_ca.issue_cert("stranger@example.org"), d, "stranger")
    return Pki(d, d / "ca.pem", *server, d / "client-ca.pem", *client, *ca_client, *stranger)


# --- HTTPS ------------------------------------------------------------------------------------------------


@asynccontextmanager
async def serving(settings: BrokerSettings) -> AsyncIterator[int]:
    """``broker.server.run`` in a task of this loop, as ``heliotrope serve`` runs it; yields the port."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    task = loop.create_task(run(settings, [], ready=started.set_result))
    done, _ = await asyncio.wait({task, started}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if started not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise AssertionError(f"the broker did not start: {task.exception() if task.done() else 'timed out'}")
    try:
        yield started.result()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def https_settings(tmp_path: Path, pki: Pki, client_ca: bool = False, **more: object) -> BrokerSettings:
    tls = ServerTlsSettings(cert_file=str(pki.server_cert), key_file=str(pki.server_key),
                            client_ca_file=str(pki.client_ca) if client_ca else None)
    return BrokerSettings(port=0, db=str(tmp_path / "h.db"), tls=tls, **more)


async def test_the_broker_serves_https_and_a_client_given_its_ca_file_gets_healthz(tmp_path, pki, capsys) -> None:
    async with serving(https_settings(tmp_path, pki)) as port:
        async with Client(f"https://127.0.0.1:{port}", ca_file=str(pki.ca)) as c:
            health = await c.request("GET", "/healthz")
    assert health["status"] == "ok"
    assert f"heliotrope serving on https://127.0.0.1:{port}" in capsys.readouterr().out


async def test_a_client_without_the_brokers_ca_fails_with_a_certificate_error(tmp_path, pki) -> None:
    async with serving(https_settings(tmp_path, pki)) as port:
        async with Client(f"https://127.0.0.1:{port}") as c:  # the system's CA store does not know this CA
            with pytest.raises(ApiClientError) as e:
                await c.request("GET", "/healthz")
    assert "could not be verified" in str(e.value) and "--ca-file" in str(e.value)


async def test_the_cli_verifies_an_https_broker_with_ca_file(tmp_path, pki, capsys) -> None:
    async with serving(https_settings(tmp_path, pki)) as port:
        url = f"https://127.0.0.1:{port}"
        capsys.readouterr()  # the "serving on" line
        with_ca = await asyncio.to_thread(cli.main, ["--server", url, "--ca-file", str(pki.ca), "sites", "list"])
        trusting_ca = capsys.readouterr()
        without_ca = await asyncio.to_thread(cli.main, ["--server", url, "sites", "list"])
        not_trusting = capsys.readouterr()
    assert with_ca == 0 and trusting_ca.out.strip() == "(none)", trusting_ca.err
    assert without_ca == 1 and "could not be verified" in not_trusting.err


MUTUAL_TLS = [
    pytest.param(lambda p: (p.client_cert, p.client_key), True,
                 id="with mutual TLS a client presenting a certificate signed by the client CA is served"),
    pytest.param(lambda p: (None, None), False,
                 id="with mutual TLS a client presenting no certificate is refused"),
    pytest.param(lambda p: (p.stranger_cert, p.stranger_key), False,
                 id="with mutual TLS a client presenting a certificate from another CA is refused"),
]


@pytest.mark.parametrize(("client_cert", "served"), MUTUAL_TLS)
async def test_mutual_tls(tmp_path, pki, client_cert: Callable[[Pki], tuple[Path | None, Path | None]],
                          served: bool) -> None:
    cert, key = client_cert(pki)
    async with serving(https_settings(tmp_path, pki, client_ca=True)) as port:
        async with Client(f"https://127.0.0.1:{port}", ca_file=str(pki.ca), timeout_s=5,
                          cert_file=str(cert) if cert else None, key_file=str(key) if key else None) as c:
            if served:
                assert (await c.request("GET", "/healthz"))["status"] == "ok"
            else:
                with pytest.raises(ApiClientError, match="if it asks for client certificates"):
                    await c.request("GET", "/healthz")


async def test_a_replica_passes_requests_on_to_a_leader_that_asks_for_client_certificates(tmp_path, pki) -> None:
    """Replicas behind mutual TLS: a follower passed requests on to the leader with aiohttp's defaults, the
    system's CA store and no certificate of its own, so every forwarded write answered 503. Here the
    replicas' certificates come from one private CA (``ca``), which the leader also asks clients to be
    signed by; the follower's connection is the one ``forwarding_tls_context`` makes."""
    import aiohttp

    from broker.server import forwarding_tls_context

    def replica(**tls: str) -> ServerTlsSettings:
        return ServerTlsSettings(cert_file=str(pki.server_cert), key_file=str(pki.server_key),
                                 client_ca_file=str(pki.ca), **tls)

    async def healthz(port: int, tls: ServerTlsSettings) -> str:
        connector = aiohttp.TCPConnector(ssl=forwarding_tls_context(tls))
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(f"https://127.0.0.1:{port}/healthz") as answer:
                return (await answer.json())["status"]

    leader = BrokerSettings(port=0, db=str(tmp_path / "h.db"), tls=replica())
    async with serving(leader) as port:
        assert await healthz(port, replica(peer_ca_file=str(pki.ca))) == "ok"
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # the private CA, not in the system's store
            await healthz(port, replica())
        with pytest.raises(aiohttp.ClientError):  # a stranger's certificate: refused by the leader
            await healthz(port, ServerTlsSettings(cert_file=str(pki.stranger_cert), key_file=str(pki.stranger_key),
                                                  client_ca_file=str(pki.ca), peer_ca_file=str(pki.ca)))


# --- files that cannot be used: one line naming the file ---------------------------------------------------


def _encrypted_key(pki: Pki) -> Path:
    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    path = pki.folder / "encrypted.key"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"secret")))
    return path


def _not_pem(pki: Pki) -> Path:
    path = pki.folder / "garbage.key"
    path.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    return path


BAD_FILES = [
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_cert), "key_file": str(_not_pem(p))}},
                 lambda p: f"broker.tls.key_file {p.folder / 'garbage.key'}: not a usable PEM private key",
                 id="a key file that is not a key names the key file"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_cert), "key_file": str(p.client_key)}},
                 lambda p: f"broker.tls.key_file {p.client_key}: not the private key of the certificate in "
                           f"broker.tls.cert_file {p.server_cert}",
                 id="a key that is not the certificate's names both files"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_cert), "key_file": str(_encrypted_key(p))}},
                 lambda p: f"broker.tls.key_file {p.folder / 'encrypted.key'}: the key is encrypted",
                 id="an encrypted key names the key file and says to decrypt it"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.folder / "missing.pem"), "key_file": str(p.server_key)}},
                 lambda p: f"broker.tls.cert_file {p.folder / 'missing.pem'}: cannot read: No such file or directory",
                 id="a missing certificate file names the certificate file"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_key), "key_file": str(p.server_key)}},
                 lambda p: f"broker.tls.cert_file {p.server_key}: no PEM certificate in it",
                 id="a key given as the certificate names the certificate file"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_cert), "key_file": str(p.server_key),
                                    "client_ca_file": str(p.server_key)}},
                 lambda p: f"broker.tls.client_ca_file {p.server_key}: no usable PEM CA certificate in it",
                 id="a client CA file without a certificate names the client CA file"),
    pytest.param(lambda p: {"tls": {"cert_file": str(p.server_cert), "key_file": str(p.server_key),
                                    "peer_ca_file": str(p.folder / "missing-peer-ca.pem")}},
                 lambda p: f"broker.tls.peer_ca_file {p.folder / 'missing-peer-ca.pem'}: cannot read",
                 id="a missing peer CA file names it"),
    pytest.param(lambda p: {"mqtt": {"ca_file": str(p.folder / "missing-ca.pem")}},
                 lambda p: f"mqtt.ca_file {p.folder / 'missing-ca.pem'}: cannot read",
                 id="a missing MQTT CA file names it"),
]


@pytest.mark.parametrize(("broker", "message"), BAD_FILES)
def test_serve_with_a_file_that_cannot_be_used_exits_with_one_line_naming_it(
        tmp_path, pki, capsys, monkeypatch, broker: Callable[[Pki], dict], message: Callable[[Pki], str]) -> None:
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump({"broker": broker(pki)}))
    code = cli.main(["serve", "--config", str(config), "--db", str(tmp_path / "h.db"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"heliotrope: {message(pki)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "h.db").exists()  # refused before anything started


# --- an open API only on loopback --------------------------------------------------------------------------


def test_serve_on_every_address_without_authentication_is_refused(tmp_path, capsys) -> None:
    code = cli.main(["serve", "--host", "0.0.0.0", "--port", "0", "--db", str(tmp_path / "h.db")])
    err = capsys.readouterr().err
    assert code == 1
    assert err == ("heliotrope: listening on 0.0.0.0 without authentication is refused: set broker.auth.enabled: "
                   "true (and create tokens with `heliotrope token create`) or listen on 127.0.0.1\n")


STARTS = [
    pytest.param("127.0.0.1", False, False, "the API is open to anyone on this machine",
                 id="without authentication on loopback it starts and warns that anyone on this machine may use it"),
    pytest.param("0.0.0.0", True, False, "bearer tokens travel in clear text",
                 id="with authentication on every address over plain HTTP it starts and warns of clear-text tokens"),
    pytest.param("0.0.0.0", True, True, None,
                 id="with authentication and TLS on every address it starts without a warning"),
]


@pytest.mark.parametrize(("host", "auth", "tls", "warning"), STARTS)
async def test_starting(tmp_path, pki, caplog, host: str, auth: bool, tls: bool, warning: str | None) -> None:
    settings = (https_settings(tmp_path, pki) if tls else BrokerSettings(port=0, db=str(tmp_path / "h.db")))
    settings = settings.model_copy(update={"host": host, "auth": AuthSettings(enabled=auth)})
    with caplog.at_level(logging.WARNING, logger="heliotrope"):
        async with serving(settings) as port:
            assert port > 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "heliotrope" and r.levelno == logging.WARNING]
    if warning is None:
        assert warnings == []
    else:
        assert len([w for w in warnings if warning in w]) == 1, warnings


# --- MQTT over TLS -----------------------------------------------------------------------------------------


@asynccontextmanager
async def tls_mosquitto(tmp_path: Path, pki: Pki, require_certificate: bool = False) -> AsyncIterator[Mosquitto]:
    """A Mosquitto with a TLS listener (``tls_port``) serving the server certificate; with
    ``require_certificate`` it asks clients for a certificate signed by the server CA."""
    try:
        mosq = Mosquitto(tmp_path / "mosquitto", persistence=False,
                         tls=MosquittoTls(pki.ca, pki.server_cert, pki.server_key, require_certificate))
    except MosquittoMissing as e:
        missing("MQTT", str(e))
        raise
    try:
        mosq.start()
        yield mosq
    finally:
        mosq.cleanup()


def over_tls(mosq: Mosquitto, **more: object) -> MqttSettings:
    assert mosq.tls_port is not None
    return mosq.settings(port=mosq.tls_port, **more)


async def test_a_site_agent_and_the_brokers_hub_exchange_a_job_over_mqtt_with_tls(tmp_path, pki) -> None:
    async with tls_mosquitto(tmp_path, pki) as mosq:
        mqtt = over_tls(mosq, ca_file=str(pki.ca))  # ca_file alone turns TLS on
        broker = Broker(BrokerSettings(db=str(tmp_path / "h.db"), mqtt=mqtt, cycle_interval_s=0.1,
                                       shutdown_grace_s=0.2))
        await broker.start([site("edge", adapter={"kind": "mqtt", "lease_s": 5, "resend_s": 0.3})])
        spec = site("edge", adapter={"kind": "simulated", "dispatch_delay_s": 0.01})
        agent = SiteAgent(AgentConfig(site=spec, mqtt=mqtt, heartbeat_s=0.2, resend_s=0.3),
                          adapter=SimulatedSite(spec, SystemClock()))
        await agent.start()
        try:
            deadline = time.monotonic() + 10
            while (state := broker.federation.get("edge").state) is None or state.health != Health.HEALTHY:
                assert time.monotonic() < deadline, f"no heartbeat over TLS:\n{mosq.log_tail()}"
                await asyncio.sleep(0.05)
            j, _ = await broker.book.submit(job(name="over-tls", duration_s=0.2))
            broker.wake()
            while (j := await broker.book.get(j.id)).state != JobState.SUCCEEDED:
                assert time.monotonic() < deadline, f"job {j.id} is {j.state} ({j.reason}):\n{mosq.log_tail()}"
                await asyncio.sleep(0.05)
            assert j.site == "edge"
        finally:
            await agent.stop()
            await broker.stop()


async def connect_once(settings: MqttSettings) -> None:
    options = proto.client_options(settings, "heliotrope-test-tls") | {"timeout": 1.0}
    async with aiomqtt.Client(**options) as client:
        await client.publish("heliotrope/test", b"hello", qos=1)


MQTT_CLIENTS = [
    pytest.param(False, lambda p: {"ca_file": str(p.ca)}, None, None,
                 id="a client given the CA file connects"),
    pytest.param(False, lambda p: {"tls": True}, "certificate verify failed", None,
                 id="a client verifying with the system CA store only fails on the certificate"),
    pytest.param(True, lambda p: {"ca_file": str(p.ca), "cert_file": str(p.ca_client_cert),
                                  "key_file": str(p.ca_client_key)}, None, None,
                 id="a client presenting a certificate connects to a broker that requires one"),
    pytest.param(True, lambda p: {"ca_file": str(p.ca)}, "timed out", "peer did not return a certificate",
                 id="a client presenting no certificate is refused by a broker that requires one"),
]


@pytest.mark.parametrize(("require_certificate", "tls", "error", "mosquitto_logs"), MQTT_CLIENTS)
async def test_connecting_to_mqtt_over_tls(tmp_path, pki, require_certificate: bool, tls: Callable[[Pki], dict],
                                           error: str | None, mosquitto_logs: str | None) -> None:
    async with tls_mosquitto(tmp_path, pki, require_certificate) as mosq:
        settings = over_tls(mosq, **tls(pki))
        if error is None:
            await connect_once(settings)
        else:
            with pytest.raises(aiomqtt.MqttError) as e:  # TLS 1.3: a refused certificate is a closed connection
                await connect_once(settings)
            assert error in str(e.value)
        if mosquitto_logs is not None:
            assert mosquitto_logs in mosq.log_tail()


def test_an_mqtt_client_certificate_needs_its_key() -> None:
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        MqttSettings(cert_file="client.pem")


def test_an_unreadable_mqtt_ca_file_is_an_mqtt_error_naming_it(tmp_path) -> None:
    """The hub's and the agent's reconnect loops log an MqttError in one line and try again."""
    with pytest.raises(proto.MqttTlsError, match=f"mqtt.ca_file {tmp_path / 'nope.pem'}: cannot read"):
        proto.client_options(MqttSettings(ca_file=str(tmp_path / "nope.pem")), "x")


async def test_a_plain_client_meeting_a_tls_listener_is_told_to_set_mqtt_tls(tmp_path, pki, caplog,
                                                                             monkeypatch) -> None:
    """A TLS listener drops a plain client's CONNECT, and the client hears only that its operation timed out:
    the hub's and the agent's reconnect lines say the port is a TLS listener and name the setting. The
    plain listener of the same Mosquitto is not taken for one."""
    monkeypatch.setattr(proto, "PUBLISH_TIMEOUT_S", 1.0)  # the connect's wait for CONNACK
    async with tls_mosquitto(tmp_path, pki) as mosq:
        plain = over_tls(mosq)  # the TLS port, without any TLS setting
        assert not plain.uses_tls
        hub = MqttHub(plain)
        spec = site("edge", adapter={"kind": "simulated"})
        agent = SiteAgent(AgentConfig(site=spec, mqtt=plain), adapter=SimulatedSite(spec, SystemClock()))
        with caplog.at_level(logging.WARNING):
            await hub.start()
            await agent.start()
            try:
                deadline = time.monotonic() + 15
                while len([r for r in caplog.records if "is a TLS listener" in r.getMessage()]) < 2:
                    assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                    await asyncio.sleep(0.1)
            finally:
                await agent.stop()
                await hub.close()
        said = [r.getMessage() for r in caplog.records if "is a TLS listener" in r.getMessage()]
        assert any(s.startswith("mqtt: connection to") for s in said), said
        assert any(s.startswith("site agent edge: MQTT broker") for s in said), said
        for s in said:
            assert f"127.0.0.1:{mosq.tls_port} is a TLS listener" in s and "set mqtt.tls: true" in s, s
        assert await proto.speaks_tls("127.0.0.1", mosq.tls_port)
        assert not await proto.speaks_tls("127.0.0.1", mosq.port)  # the plain listener: no such hint there
