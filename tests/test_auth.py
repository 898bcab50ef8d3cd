"""Authentication and roles against a live broker (``broker.auth``): tenant isolation and operator scoping,
endpoint by endpoint, as a table of role x endpoint x expected status; tokens made, revoked and expired
through the CLI's database path; secrets in a site's spec never returned."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from adapters.simulated import SimulatedSite
from broker import auth
from broker.api import ACCESS, BROKER, create_app
from broker.cli import main
from broker.config import AuthSettings, BrokerSettings
from broker.models import SimulatedAdapterConfig, SiteSpec
from broker.service import Broker

# alpha has A100s, beta L4s: a job asking for a model runs where that model is.
ALPHA = {"name": "alpha", "region": "gcp:europe-west3", "grid_zone": "DE-LU", "timezone": "Europe/Berlin",
         "latitude": 50.1, "longitude": 8.7, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}],
         "quotas": [{"tenant": "vision", "guaranteed_gpus": 4}, {"tenant": "nlp", "guaranteed_gpus": 2}],
         "adapter": {"kind": "simulated", "dispatch_delay_s": 0.005}}
BETA = {**ALPHA, "name": "beta", "gpus": [{"model": "l4", "gpus_per_node": 8, "nodes": 1}], "quotas": []}
GAMMA = {**BETA, "name": "gamma"}


def job(tenant: str, model: str, name: str = "j") -> dict[str, Any]:
    return {"tenant": tenant, "name": name, "gpus": {"count": 1, "model": model}, "duration_s": 3600}


class Federation:
    """A broker with auth on, its HTTP client, a token per role, and one long job per tenant."""

    def __init__(self, client: TestClient, tokens: dict[str, str], jobs: dict[str, str], db: str) -> None:
        self.client, self.tokens, self.jobs, self.db = client, tokens, jobs, db

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who in self.tokens else (
            {"Authorization": "Bearer hlt_not-a-token"} if who == "bogus" else {})

    async def call(self, who: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        path = path.format(**self.jobs)
        if path == "/v1/events":
            async with self.client.get(path, headers=self.headers(who)) as r:
                if r.status != 200:
                    return r.status, await r.json()
                assert r.headers["Content-Type"].startswith("text/event-stream")
                await asyncio.wait_for(r.content.readline(), 5)  # a bounded read: the stream never ends
                return r.status, None
        r = await self.client.request(method, path, json=body, headers=self.headers(who))
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def make_token(db: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["token", "create", "--db", db, *args]) == 0
    out, _ = capsys.readouterr()
    return out.splitlines()[0]


@pytest.fixture
def made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, str]]:
    """A database with a token per role, made with the CLI before the broker starts."""
    db = str(tmp_path / "auth.db")
    return db, {
        "admin": make_token(db, capsys, "--role", "admin", "--name", "platform"),
        "operator": make_token(db, capsys, "--role", "operator", "--name", "alpha-ops", "--site", "alpha"),
        "submitter": make_token(db, capsys, "--role", "submitter", "--name", "vision-team", "--tenant", "vision"),
        "other tenant": make_token(db, capsys, "--role", "submitter", "--name", "nlp-team", "--tenant", "nlp"),
    }


@pytest.fixture
async def fed(made: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch):
    db, tokens = made
    monkeypatch.setenv("TEST_ADMIN_TOKEN", "hlt_from-the-environment")
    settings = BrokerSettings(db=db, cycle_interval_s=0.05, shutdown_grace_s=1,
                              auth=AuthSettings(enabled=True, refresh_s=0.05, admin_token_env="TEST_ADMIN_TOKEN"))
    # Every site runs simulated, whatever its adapter kind says (a Kubernetes site's secrets are tested here,
    # not its cluster).
    simulated = SimulatedAdapterConfig(dispatch_delay_s=0.005)
    broker = Broker(settings, factory=lambda spec: SimulatedSite(spec.model_copy(update={"adapter": simulated}),
                                                                 broker.clock))
    await broker.start([SiteSpec.model_validate(ALPHA), SiteSpec.model_validate(BETA)])
    async with TestClient(TestServer(create_app(broker))) as client:
        f = Federation(client, tokens, {}, db)
        for key, (who, body) in {"vision_job": ("submitter", job("vision", "a100-80gb")),
                                 "nlp_job": ("other tenant", job("nlp", "l4")),
                                 "spare": ("submitter", job("vision", "a100-80gb", "spare"))}.items():
            status, created = await f.call(who, "POST", "/v1/jobs", body)
            assert status == 201, created
            f.jobs[key] = created["id"]
        for key, site in (("vision_job", "alpha"), ("nlp_job", "beta"), ("spare", "alpha")):
            for _ in range(200):
                _, got = await f.call("admin", "GET", f"/v1/jobs/{f.jobs[key]}")
                if got["state"] == "running":
                    break
                await asyncio.sleep(0.02)
            assert got["state"] == "running" and got["site"] == site
        yield f
    await broker.stop()


ROLES = ("admin", "operator", "submitter", "other tenant", "nobody", "bogus")

# (method, path, body, {role: status}); "operator" operates alpha, "submitter" acts for vision, "other tenant"
# for nlp; the vision job runs on alpha, the nlp job on beta. "nobody" sends no token, "bogus" an unknown one.
A, O, S, T = "admin", "operator", "submitter", "other tenant"
DENIED = {"nobody": 401, "bogus": 401}
TABLE: list[tuple[str, str, str, Any, dict[str, int]]] = [
    ("only an admin registers a site", "POST", "/v1/sites", GAMMA, {A: 201, O: 403, S: 403, T: 403}),
    ("everyone with a token lists the sites", "GET", "/v1/sites", None, {A: 200, O: 200, S: 200, T: 200}),
    ("everyone with a token reads a site", "GET", "/v1/sites/beta", None, {A: 200, O: 200, S: 200, T: 200}),
    ("a site's operator changes its spec", "PUT", "/v1/sites/alpha", ALPHA, {A: 200, O: 200, S: 403, T: 403}),
    ("an operator cannot change another site", "PUT", "/v1/sites/beta", BETA, {A: 200, O: 403, S: 403, T: 403}),
    ("an operator cannot change its site's adapter (it picks credentials)", "PUT", "/v1/sites/alpha",
     {**ALPHA, "adapter": {"kind": "kubernetes", "context": "beta-admin"}}, {O: 403, S: 403}),
    ("nobody but an admin removes a site", "DELETE", "/v1/sites/beta", None, {O: 403, S: 403, T: 403}),
    ("a site's operator reads its quota state", "GET", "/v1/sites/alpha/quota", None,
     {A: 200, O: 200, S: 200, T: 200}),
    ("an operator cannot read another site's quotas", "GET", "/v1/sites/beta/quota", None, {O: 403}),
    ("a site's operator sets a tenant's quota", "PUT", "/v1/sites/alpha/quota/vision", {"guaranteed_gpus": 4},
     {A: 200, O: 200, S: 403, T: 403}),
    ("an operator cannot set quotas at another site", "PUT", "/v1/sites/beta/quota/vision", {"guaranteed_gpus": 1},
     {O: 403, S: 403}),
    ("a submitter cannot remove a quota", "DELETE", "/v1/sites/alpha/quota/nlp", None, {S: 403, T: 403}),
    ("an operator cannot remove another site's quota", "DELETE", "/v1/sites/beta/quota/nlp", None, {O: 403}),
    ("a submitter submits for its own tenant only", "POST", "/v1/jobs", job("vision", "l4"),
     {A: 201, O: 403, S: 201, T: 403}),
    ("everyone with a token lists jobs (scoped)", "GET", "/v1/jobs", None, {A: 200, O: 200, S: 200, T: 200}),
    ("a submitter cannot list another tenant's jobs", "GET", "/v1/jobs?tenant=nlp", None, {A: 200, S: 403, T: 200}),
    ("an operator cannot list another site's jobs", "GET", "/v1/jobs?site=beta", None, {A: 200, O: 403}),
    ("a job is visible to its tenant and its site's operator", "GET", "/v1/jobs/{vision_job}", None,
     {A: 200, O: 200, S: 200, T: 404}),
    ("a job on another site is hidden from an operator", "GET", "/v1/jobs/{nlp_job}", None,
     {A: 200, O: 404, S: 404, T: 200}),
    ("a decision is visible as its job is", "GET", "/v1/jobs/{vision_job}/decision", None,
     {A: 200, O: 200, S: 200, T: 404}),
    ("a job's history is visible as its job is", "GET", "/v1/jobs/{nlp_job}/events", None,
     {A: 200, O: 404, S: 404, T: 200}),
    ("only the tenant's submitters cancel its job", "POST", "/v1/jobs/{vision_job}/cancel", None,
     {O: 403, T: 404}),
    ("only the tenant's submitters delete its job", "DELETE", "/v1/jobs/{vision_job}", None, {O: 403, T: 404}),
    ("a submitter cancels its own job", "POST", "/v1/jobs/{spare}/cancel", None, {S: 200}),
    ("everyone with a token follows the event stream", "GET", "/v1/events", None,
     {A: 200, O: 200, S: 200, T: 200}),
    ("everyone with a token reads the carbon saved", "GET", "/v1/carbon", None, {A: 200, O: 200, S: 200, T: 200}),
    ("everyone with a token asks who it is", "GET", "/v1/whoami", None, {A: 200, O: 200, S: 200, T: 200}),
    ("admins and operators scrape metrics", "GET", "/metrics", None, {A: 200, O: 200, S: 403, T: 403}),
    ("liveness needs no token", "GET", "/healthz", None, {r: 200 for r in ROLES}),
    ("the API's description needs no token", "GET", "/openapi.json", None, {r: 200 for r in ROLES}),
]


@pytest.mark.parametrize("case", TABLE, ids=[row[0] for row in TABLE])
async def test_who_may_call_what(fed: Federation, case):
    _, method, path, body, expected = case
    expected = {**DENIED, **expected} if (method, path.split("?")[0]) not in (("GET", "/healthz"),
                                                                             ("GET", "/openapi.json")) else expected
    got = {}
    for who in expected:
        status, answer = await fed.call(who, method, path, body)
        got[who] = status
        if status in (401, 403):
            assert answer["error"]["status"] == status and answer["error"]["message"]
    assert got == expected


def test_every_route_is_in_the_table_of_rules():
    """A route missing from ACCESS would be admin-only by default; every route the API serves is listed."""
    from aiohttp import web

    app = create_app(Broker(BrokerSettings(db=":memory:")))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD" and isinstance(r.resource, web.Resource)
              and not r.resource.canonical.startswith("/dashboard") and r.resource.canonical != "/"}
    assert routes - set(ACCESS) == set()
    tested = {(m, p.split("?")[0].replace("{vision_job}", "{id}").replace("{nlp_job}", "{id}")
               .replace("{spare}", "{id}").replace("/alpha", "/{name}").replace("/beta", "/{name}")
               .replace("/quota/vision", "/quota/{tenant}").replace("/quota/nlp", "/quota/{tenant}"))
              for _, m, p, _, _ in TABLE}
    assert routes - tested == set(), "a route with no row in TABLE"


async def test_a_submitter_lists_only_its_tenants_jobs_and_an_operator_only_its_sites(fed: Federation):
    _, mine = await fed.call("submitter", "GET", "/v1/jobs")
    assert {j["spec"]["tenant"] for j in mine["items"]} == {"vision"}
    _, theirs = await fed.call("other tenant", "GET", "/v1/jobs")
    assert [j["id"] for j in theirs["items"]] == [fed.jobs["nlp_job"]]
    _, on_alpha = await fed.call("operator", "GET", "/v1/jobs")
    assert {j["site"] for j in on_alpha["items"]} == {"alpha"}
    assert {j["id"] for j in on_alpha["items"]} == {fed.jobs["vision_job"], fed.jobs["spare"]}
    _, everything = await fed.call("admin", "GET", "/v1/jobs")
    assert len(everything["items"]) == 3


async def test_sites_are_shown_to_each_role_as_it_may_see_them(fed: Federation):
    _, as_operator = await fed.call("operator", "GET", "/v1/sites")
    views = {s["name"]: s for s in as_operator["items"]}
    assert "adapter" in views["alpha"] and len(views["alpha"]["quotas"]) == 2  # its own site, whole
    assert "adapter" not in views["beta"] and "quotas" not in views["beta"]  # another's: the public view
    _, quota = await fed.call("submitter", "GET", "/v1/sites/alpha/quota")
    assert [t["tenant"] for t in quota["tenants"]] == ["vision"]  # not nlp's guarantee or usage
    _, site = await fed.call("submitter", "GET", "/v1/sites/alpha")
    assert "quotas" not in site and all(t["tenant"] == "vision" for t in site["status"]["quota"]["tenants"])


async def test_a_kubeconfig_is_never_returned_and_an_update_without_it_keeps_it(fed: Federation):
    secret = {**GAMMA, "adapter": {"kind": "kubernetes", "kubeconfig": "/etc/secret/gamma.kubeconfig",
                                   "context": "gamma-admin"}}
    status, created = await fed.call("admin", "POST", "/v1/sites", secret)
    assert status == 201 and "kubeconfig" not in created["adapter"] and created["adapter"]["context"] == "gamma-admin"
    _, read = await fed.call("admin", "GET", "/v1/sites/gamma")
    assert "kubeconfig" not in read["adapter"] and "gamma.kubeconfig" not in str(read)
    read.pop("status"), read.pop("signals")
    status, _ = await fed.call("admin", "PUT", "/v1/sites/gamma", read)  # sent back as read
    assert status == 200
    broker = fed.client.server.app[BROKER]
    assert broker.federation.get("gamma").spec.adapter.kubeconfig == "/etc/secret/gamma.kubeconfig"
    stored = {s.name: s for s in await broker.store.list_sites()}
    assert stored["gamma"].adapter.kubeconfig == "/etc/secret/gamma.kubeconfig"


async def test_a_revoked_token_is_refused_within_the_refresh_interval(fed: Federation, capsys):
    status, _ = await fed.call("submitter", "GET", "/v1/jobs")
    assert status == 200
    assert await asyncio.to_thread(main, ["token", "list", "--db", fed.db, "--json"]) == 0
    listed = json.loads(capsys.readouterr()[0])
    assert all("digest" not in t and "token" not in t for t in listed)
    vision = next(t["id"] for t in listed if t["name"] == "vision-team")
    assert await asyncio.to_thread(main, ["token", "revoke", vision, "--db", fed.db]) == 0
    capsys.readouterr()
    await asyncio.sleep(0.1)  # refresh_s is 0.05 here
    status, answer = await fed.call("submitter", "GET", "/v1/jobs")
    assert status == 401 and "revoked" in answer["error"]["message"]


async def test_an_open_event_stream_ends_when_its_token_is_revoked(fed: Federation):
    headers = fed.headers("submitter")
    async with fed.client.get("/v1/events?type=transition", headers=headers) as stream:
        assert stream.status == 200
        await asyncio.wait_for(stream.content.readline(), 5)
        broker = fed.client.server.app[BROKER]
        record = next(r for r in broker.tokens._by_digest.values() if r.name == "vision-team")
        await broker.store.update_token(record.id, record.model_copy(
            update={"revoked_at": datetime.now(UTC)}).model_dump_json())
        await asyncio.sleep(0.1)  # refresh_s is 0.05 here
        status, _ = await fed.call("admin", "POST", "/v1/jobs", job("vision", "l4"))  # an event it would see
        assert status == 201
        rest = await asyncio.wait_for(stream.content.read(), 5)  # the stream ends instead
    assert b"event: transition" not in rest


async def test_an_expired_token_is_refused_and_the_environments_admin_token_is_accepted(fed: Federation):
    token, record = auth.make_record("old", "admin", [], [], datetime.now(UTC) - timedelta(days=2),
                                     expires_at=datetime.now(UTC) - timedelta(seconds=1))
    store = fed.client.server.app[BROKER].store
    await store.put_token(record.id, record.digest, record.model_dump_json())
    await asyncio.sleep(0.1)
    fed.tokens["expired"] = token
    status, answer = await fed.call("expired", "GET", "/v1/whoami")
    assert status == 401 and "expired" in answer["error"]["message"]
    fed.tokens["env"] = "hlt_from-the-environment"
    status, me = await fed.call("env", "GET", "/v1/whoami")
    assert status == 200 and me["role"] == "admin" and me["name"] == "$TEST_ADMIN_TOKEN"


async def test_a_401_asks_for_a_bearer_token_and_never_echoes_the_one_sent(fed: Federation):
    r = await fed.client.get("/v1/jobs", headers={"Authorization": "Bearer hlt_secret-value"})
    assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "hlt_secret-value" not in await r.text()
    r = await fed.client.get("/v1/jobs", headers={"Authorization": "Basic dXNlcjpwdw=="})
    assert r.status == 401 and "Bearer" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("args, problem", [
    (["--role", "operator", "--name", "x"], "names at least one site"),
    (["--role", "submitter", "--name", "x"], "names at least one tenant"),
    (["--role", "admin", "--name", "x", "--tenant", "t"], "not scoped"),
    (["--role", "submitter", "--name", "x", "--tenant", "t", "--site", "s"], "scoped to tenants"),
    (["--role", "submitter", "--name", "x", "--tenant", ""], "tenants[0]: must be"),
    (["--role", "admin", "--name", "x", "--expires-in", "0"], "above 0"),
    (["--role", "admin", "--name", "x", "--expires-in", "inf"], "above 0"),
    (["--role", "admin", "--name", "x", "--db", "mysql://u@h/db"], "postgresql:// URL"),
], ids=["an operator token without a site", "a submitter token without a tenant", "a scoped admin token",
        "a submitter token with a site", "an empty tenant", "a token that expires at once",
        "a token that expires after infinity", "a database that is not SQLite or PostgreSQL"])
def test_a_token_with_the_wrong_scope_is_refused_with_a_message(tmp_path, capsys, args, problem):
    assert main(["token", "create", "--db", str(tmp_path / "t.db"), *args]) == 1
    _, err = capsys.readouterr()
    assert problem in err and "Traceback" not in err


def test_listing_the_tokens_of_a_database_that_is_not_there_says_so(tmp_path, capsys):
    assert main(["token", "list", "--db", str(tmp_path / "typo" / "t.db")]) == 1
    _, err = capsys.readouterr()
    assert "no database at" in err and not (tmp_path / "typo").exists()


def test_the_store_keeps_only_a_digest_of_each_token(tmp_path, capsys):
    db = str(tmp_path / "t.db")
    token = make_token(db, capsys, "--role", "admin", "--name", "ops")
    assert token.startswith(auth.TOKEN_PREFIX) and len(token) > 40
    raw = Path(db).read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("t.db-*"))
    assert token.encode() not in raw and auth.digest(token).encode() in raw
