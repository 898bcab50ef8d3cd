"""Authentication and roles against a live broker (``broker.auth``): tenant isolation and operator scoping,
endpoint by endpoint, as a table of role x endpoint x expected status; metrics scoped to an operator's sites;
tokens made, revoked and expired through the CLI's database path; secrets in a site's spec never returned."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from adapters.simulated import SimulatedSite
from broker import auth
from broker.api import ACCESS, BROKER, create_app
from broker.cli import main
from broker.config import AuthSettings, BrokerSettings
from broker.models import SimulatedAdapterConfig, SiteSpec
from broker.service import Broker

# alpha has A100s, beta L4s: a job asking for a model runs where that model is. gamma (L4s, idle) is registered
# only by the rows that need a site with nothing on it.
ALPHA = {"name": "alpha", "region": "gcp:europe-west3", "grid_zone": "DE-LU", "timezone": "Europe/Berlin",
         "latitude": 50.1, "longitude": 8.7, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}],
         "quotas": [{"tenant": "vision", "guaranteed_gpus": 4}, {"tenant": "nlp", "guaranteed_gpus": 2}],
         "adapter": {"kind": "simulated", "dispatch_delay_s": 0.005}}
BETA = {**ALPHA, "name": "beta", "gpus": [{"model": "l4", "gpus_per_node": 8, "nodes": 1}], "quotas": []}
GAMMA = {**BETA, "name": "gamma"}
KUBE_GAMMA = {**GAMMA, "adapter": {"kind": "kubernetes", "kubeconfig": "/etc/secret/gamma.kubeconfig",
                                   "context": "gamma-admin"}}


def job(tenant: str, model: str, name: str = "j") -> dict[str, Any]:
    return {"tenant": tenant, "name": name, "gpus": {"count": 1, "model": model}, "duration_s": 3600}


def with_adapter(site: dict[str, Any], **change: Any) -> dict[str, Any]:
    """``site`` with adapter settings changed, sent back as an operator reads it (without its kubeconfig,
    which the API never returns, so the stored one is kept) unless the change names the kubeconfig."""
    adapter = {k: v for k, v in site["adapter"].items() if k != "kubeconfig"} | change
    return {**site, "adapter": adapter}


class Federation:
    """A broker with auth on, its HTTP client, a token per role, and one long job per tenant."""

    def __init__(self, client: TestClient, tokens: dict[str, str], jobs: dict[str, str], db: str) -> None:
        self.client, self.tokens, self.jobs, self.db = client, tokens, jobs, db

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who in self.tokens else (
            {"Authorization": "Bearer hlt_not-a-token"} if who == "bogus" else {})

    async def call(self, who: str, method: str, path: str, body: Any = None,
                   names: dict[str, str] | None = None) -> tuple[int, Any]:
        path = path.format(**self.jobs, **(names or {}))
        if path.startswith("/v1/events"):
            async with self.client.get(path, headers=self.headers(who)) as r:
                if r.status != 200:
                    return r.status, await r.json()
                assert r.headers["Content-Type"].startswith("text/event-stream")
                await asyncio.wait_for(r.content.readline(), 5)  # a bounded read: the stream never ends
                return r.status, None
        r = await self.client.request(method, path, json=body, headers=self.headers(who), allow_redirects=False)
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    async def running(self, job_id: str, site: str) -> None:
        for _ in range(250):
            _, got = await self.call("admin", "GET", f"/v1/jobs/{job_id}")
            if got["state"] == "running":
                break
            await asyncio.sleep(0.02)
        assert got["state"] == "running" and got["site"] == site, got


def make_token(db: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["token", "create", "--db", db, *args]) == 0
    out, _ = capsys.readouterr()
    return out.splitlines()[0]


@pytest.fixture
def made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, str]]:
    """A database with a token per role, made with the CLI before the broker starts: an operator for each
    site (ghost-ops operates a site that is not registered) and a submitter for each tenant."""
    db = str(tmp_path / "auth.db")
    tokens = {"admin": make_token(db, capsys, "--role", "admin", "--name", "platform")}
    for site in ("alpha", "beta", "gamma", "ghost"):
        tokens[f"{site}-ops"] = make_token(db, capsys, "--role", "operator", "--name", f"{site}-ops", "--site", site)
    for tenant in ("vision", "nlp"):
        tokens[tenant] = make_token(db, capsys, "--role", "submitter", "--name", f"{tenant}-team", "--tenant", tenant)
    return db, tokens


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
        for key, (who, body) in {"vision_job": ("vision", job("vision", "a100-80gb")),
                                 "nlp_job": ("nlp", job("nlp", "l4")),
                                 "spare": ("vision", job("vision", "a100-80gb", "spare"))}.items():
            status, created = await f.call(who, "POST", "/v1/jobs", body)
            assert status == 201, created
            f.jobs[key] = created["id"]
        for key, site in (("vision_job", "alpha"), ("nlp_job", "beta"), ("spare", "alpha")):
            await f.running(f.jobs[key], site)
        yield f
    await broker.stop()


# --- fresh objects: what a destructive row acts on, made again before each caller's try ---

Fresh = Callable[[Federation], contextlib.AbstractAsyncContextManager[dict[str, str]]]


@contextlib.asynccontextmanager
async def running_vision_job(f: Federation) -> AsyncIterator[dict[str, str]]:
    """``{fresh}``: a vision job running on alpha (so alpha's operator sees it), cancelled afterwards."""
    status, created = await f.call("admin", "POST", "/v1/jobs", job("vision", "a100-80gb", "fresh"))
    assert status == 201, created
    await f.running(created["id"], "alpha")
    yield {"fresh": created["id"]}
    await f.call("admin", "POST", f"/v1/jobs/{created['id']}/cancel")  # 409 if the row cancelled it


@contextlib.asynccontextmanager
async def queued_vision_job(f: Federation) -> AsyncIterator[dict[str, str]]:
    """``{fresh}``: a vision job no site can take (it stays queued), cancelled afterwards."""
    status, created = await f.call("admin", "POST", "/v1/jobs", {**job("vision", "a100-80gb", "queued"),
                                                                  "gpus": {"count": 512, "model": "a100-80gb"}})
    assert status == 201, created
    yield {"fresh": created["id"]}
    await f.call("admin", "POST", f"/v1/jobs/{created['id']}/cancel")


@contextlib.asynccontextmanager
async def labelled_vision_job(f: Federation) -> AsyncIterator[dict[str, str]]:
    """A vision job labelled sweep=fresh running on alpha, for the rows that cancel by labels (the fixture's jobs
    carry no labels, so those rows leave them running), cancelled afterwards."""
    status, created = await f.call("admin", "POST", "/v1/jobs", {**job("vision", "a100-80gb", "fresh"),
                                                                  "labels": {"sweep": "fresh"}})
    assert status == 201, created
    await f.running(created["id"], "alpha")
    yield {}
    await f.call("admin", "POST", f"/v1/jobs/{created['id']}/cancel")


def idle_gamma(spec: dict[str, Any]) -> Fresh:
    """gamma registered afresh with ``spec``, nothing on it (so its adapter may be rebuilt or it removed)."""

    @contextlib.asynccontextmanager
    async def make(f: Federation) -> AsyncIterator[dict[str, str]]:
        await f.call("admin", "DELETE", "/v1/sites/gamma")  # 404 if the previous try removed it
        status, answer = await f.call("admin", "POST", "/v1/sites", spec)
        assert status == 201, answer
        yield {}

    return make


@contextlib.asynccontextmanager
async def vision_quota_at_alpha(f: Federation) -> AsyncIterator[dict[str, str]]:
    status, answer = await f.call("admin", "PUT", "/v1/sites/alpha/quota/vision", {"guaranteed_gpus": 4})
    assert status == 200, answer
    yield {}


@contextlib.asynccontextmanager
async def vision_limit_set_live(f: Federation) -> AsyncIterator[dict[str, str]]:
    status, answer = await f.call("admin", "PUT", "/v1/tenants/vision/limit", {"gpus": 100})
    assert status == 200, answer
    yield {}


@contextlib.asynccontextmanager
async def cordoned_alpha(f: Federation) -> AsyncIterator[dict[str, str]]:
    status, answer = await f.call("admin", "POST", "/v1/sites/alpha/cordon", {"reason": "maintenance"})
    assert status == 200, f"cordoning alpha (to try uncordoning it) answered {status}: {answer}"
    yield {}


@contextlib.asynccontextmanager
async def as_it_is(f: Federation) -> AsyncIterator[dict[str, str]]:
    yield {}


# --- the table ---

@dataclass(frozen=True)
class Row:
    """One route and case: the expected status for each caller, relative to the site and tenant the row is
    about (``site``, ``tenant``). ``fresh`` makes the object a destructive row acts on again before each try."""

    case: str
    route: str  # "METHOD /path"; {vision_job}, {nlp_job}, {spare}: the fixture's jobs, {fresh}: ``fresh``'s
    expect: tuple[int, int, int, int, int, int]  # nobody, admin, site's operator, other site's operator,
    #                                               tenant's submitter, other tenant's submitter
    body: Any = None
    site: str = "alpha"
    tenant: str = "vision"
    fresh: Fresh = as_it_is

    def callers(self) -> dict[str, int]:
        """Token name -> status; "nobody" sends no token, "bogus" an unknown one (answered as no token)."""
        other_site = "alpha" if self.site == "beta" else "beta"
        other_tenant = "nlp" if self.tenant == "vision" else "vision"
        nobody, admin, ops, other_ops, sub, other_sub = self.expect
        return {"nobody": nobody, "bogus": nobody, "admin": admin, f"{self.site}-ops": ops,
                f"{other_site}-ops": other_ops, self.tenant: sub, other_tenant: other_sub}


R = Row
OPEN = (200,) * 6
TABLE: list[Row] = [
    # sites                                                                   nobody admin ops ops* sub sub*
    R("only an admin registers a site", "POST /v1/sites", (401, 201, 403, 403, 403, 403), GAMMA, site="gamma"),
    R("everyone with a token lists the sites", "GET /v1/sites", (401, 200, 200, 200, 200, 200)),
    R("everyone with a token reads a site", "GET /v1/sites/alpha", (401, 200, 200, 200, 200, 200)),
    R("a site's operator changes its spec", "PUT /v1/sites/alpha", (401, 200, 200, 403, 403, 403), ALPHA),
    R("only an admin changes a site's adapter kind", "PUT /v1/sites/gamma", (401, 200, 403, 403, 403, 403),
      {**GAMMA, "adapter": {"kind": "kubernetes", "context": "gamma-admin"}}, site="gamma", fresh=idle_gamma(GAMMA)),
    R("a site's operator changes a simulated adapter's dispatch delay", "PUT /v1/sites/gamma",
      (401, 200, 200, 403, 403, 403), with_adapter(GAMMA, dispatch_delay_s=0.02), site="gamma",
      fresh=idle_gamma(GAMMA)),
    R("only an admin changes a simulated adapter's state_dir", "PUT /v1/sites/gamma", (401, 200, 403, 403, 403, 403),
      with_adapter(GAMMA, state_dir="/var/lib/heliotrope/beta"), site="gamma", fresh=idle_gamma(GAMMA)),
    R("a site's operator changes a kubernetes adapter's request timeout", "PUT /v1/sites/gamma",
      (401, 200, 200, 403, 403, 403), with_adapter(KUBE_GAMMA, request_timeout_s=30.0), site="gamma",
      fresh=idle_gamma(KUBE_GAMMA)),
    R("a site's operator changes a kubernetes adapter's image", "PUT /v1/sites/gamma", (401, 200, 200, 403, 403, 403),
      with_adapter(KUBE_GAMMA, image="pytorch/pytorch:2.3.0"), site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    # The operator picks the image, and so the user it runs as: the Pod's user and Pod Security are theirs too.
    R("a site's operator makes a kubernetes adapter's Pods meet Pod Security restricted", "PUT /v1/sites/gamma",
      (401, 200, 200, 403, 403, 403),
      with_adapter(KUBE_GAMMA, pod_security="restricted", pod_security_context={"runAsUser": 1000, "fsGroup": 1000}),
      site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's kubeconfig", "PUT /v1/sites/gamma",
      (401, 200, 403, 403, 403, 403), with_adapter(KUBE_GAMMA, kubeconfig="/home/ops/beta.kubeconfig"),
      site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's context", "PUT /v1/sites/gamma", (401, 200, 403, 403, 403, 403),
      with_adapter(KUBE_GAMMA, context="beta-admin"), site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's in_cluster", "PUT /v1/sites/gamma",
      (401, 200, 403, 403, 403, 403), with_adapter(KUBE_GAMMA, in_cluster=True), site="gamma",
      fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's host", "PUT /v1/sites/gamma", (401, 200, 403, 403, 403, 403),
      with_adapter(KUBE_GAMMA, host="https://10.0.0.1:6443"), site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's namespace_prefix", "PUT /v1/sites/gamma",
      (401, 200, 403, 403, 403, 403), with_adapter(KUBE_GAMMA, namespace_prefix="alpha-"), site="gamma",
      fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's state_dir", "PUT /v1/sites/gamma",
      (401, 200, 403, 403, 403, 403), with_adapter(KUBE_GAMMA, state_dir="/var/lib/heliotrope/beta"), site="gamma",
      fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's state_namespace", "PUT /v1/sites/gamma",
      (401, 200, 403, 403, 403, 403), with_adapter(KUBE_GAMMA, state_namespace="heliotrope"), site="gamma",
      fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin changes a kubernetes adapter's telemetry (its token_env is sent to its url)",
      "PUT /v1/sites/gamma", (401, 200, 403, 403, 403, 403),
      with_adapter(KUBE_GAMMA, telemetry={"kind": "prometheus", "url": "http://127.0.0.1:9", "token_env": "HOME"}),
      site="gamma", fresh=idle_gamma(KUBE_GAMMA)),
    R("only an admin removes a site", "DELETE /v1/sites/gamma", (401, 204, 403, 403, 403, 403), site="gamma",
      fresh=idle_gamma(GAMMA)),
    R("a site's operator cordons it", "POST /v1/sites/alpha/cordon", (401, 200, 200, 403, 403, 403),
      {"reason": "maintenance"}),
    R("a site's operator uncordons it", "POST /v1/sites/alpha/uncordon", (401, 200, 200, 403, 403, 403),
      fresh=cordoned_alpha),
    R("cordoning a site that is not registered", "POST /v1/sites/ghost/cordon", (401, 404, 404, 403, 403, 403),
      {"reason": "maintenance"}, site="ghost"),
    R("uncordoning a site that is not registered", "POST /v1/sites/ghost/uncordon", (401, 404, 404, 403, 403, 403),
      site="ghost"),
    # quotas
    R("a site's quota state: its operator, and submitters for their own tenants", "GET /v1/sites/alpha/quota",
      (401, 200, 200, 403, 200, 200)),
    R("a submitter cannot ask for another tenant's quota row", "GET /v1/sites/alpha/quota?tenant=vision",
      (401, 200, 200, 403, 200, 403)),
    R("a site's operator sets a tenant's quota", "PUT /v1/sites/alpha/quota/vision", (401, 200, 200, 403, 403, 403),
      {"guaranteed_gpus": 4}),
    R("a site's operator removes a tenant's quota", "DELETE /v1/sites/alpha/quota/vision",
      (401, 200, 200, 403, 403, 403), fresh=vision_quota_at_alpha),
    # jobs
    R("a submitter submits for its own tenant only", "POST /v1/jobs", (401, 201, 403, 403, 201, 403),
      job("vision", "l4")),
    R("a submitter previews a job of its own tenant only", "POST /v1/preview", (401, 200, 403, 403, 200, 403),
      job("vision", "l4")),
    R("a submitter previews a list of jobs of its own tenant only", "POST /v1/preview",
      (401, 200, 403, 403, 200, 403), [job("vision", "l4"), job("vision", "a100-80gb", "k")]),
    R("a list with one job of another tenant is refused to either tenant's submitter", "POST /v1/preview",
      (401, 200, 403, 403, 403, 403), [job("vision", "l4"), job("nlp", "l4")]),
    R("everyone with a token lists jobs (scoped)", "GET /v1/jobs", (401, 200, 200, 200, 200, 200)),
    R("a submitter cannot list another tenant's jobs", "GET /v1/jobs?tenant=vision", (401, 200, 200, 200, 200, 403)),
    R("an operator cannot list another site's jobs", "GET /v1/jobs?site=alpha", (401, 200, 200, 403, 200, 200)),
    R("a job is visible to its tenant and its site's operator", "GET /v1/jobs/{vision_job}",
      (401, 200, 200, 404, 200, 404)),
    R("so is a job of another tenant on another site", "GET /v1/jobs/{nlp_job}", (401, 200, 200, 404, 200, 404),
      site="beta", tenant="nlp"),
    R("a decision is visible as its job is", "GET /v1/jobs/{vision_job}/decision", (401, 200, 200, 404, 200, 404)),
    R("a job's history is visible as its job is", "GET /v1/jobs/{vision_job}/events", (401, 200, 200, 404, 200, 404)),
    R("a job's logs are readable as its job is", "GET /v1/jobs/{vision_job}/logs", (401, 200, 200, 404, 200, 404)),
    R("the tenant's submitters and admins cancel its job", "POST /v1/jobs/{fresh}/cancel",
      (401, 200, 403, 403, 200, 404), fresh=running_vision_job),
    R("the tenant's submitters and admins delete (cancel) its job", "DELETE /v1/jobs/{fresh}",
      (401, 200, 403, 403, 200, 404), fresh=running_vision_job),
    R("the tenant's submitters and admins cancel its jobs by labels", "POST /v1/cancellations",
      (401, 200, 403, 403, 200, 403), {"tenant": "vision", "labels": {"sweep": "fresh"}}, fresh=labelled_vision_job),
    R("a cancel by labels alone matches only the caller's tenants' jobs", "POST /v1/cancellations",
      (401, 200, 403, 403, 200, 200), {"labels": {"sweep": "fresh"}}, fresh=labelled_vision_job),
    R("the tenant's submitters and admins change its queued job", "PATCH /v1/jobs/{fresh}",
      (401, 200, 403, 403, 200, 404), {"priority": 3}, fresh=queued_vision_job),
    # live and other
    R("everyone with a token follows the event stream", "GET /v1/events", (401, 200, 200, 200, 200, 200)),
    R("a submitter cannot follow another tenant's events", "GET /v1/events?tenant=vision",
      (401, 200, 200, 200, 200, 403)),
    R("an operator cannot follow another site's events", "GET /v1/events?site=alpha", (401, 200, 200, 403, 200, 200)),
    R("everyone with a token reads the carbon saved", "GET /v1/carbon", (401, 200, 200, 200, 200, 200)),
    R("everyone with a token asks who it is", "GET /v1/whoami", (401, 200, 200, 200, 200, 200)),
    R("admins and submitters read the tenants' usage (operators do not)", "GET /v1/tenants",
      (401, 200, 403, 403, 200, 200)),
    R("a submitter reads only its own tenants' usage", "GET /v1/tenants?tenant=vision",
      (401, 200, 403, 403, 200, 403)),
    R("only an admin sets a tenant's limit across the federation live", "PUT /v1/tenants/vision/limit",
      (401, 200, 403, 403, 403, 403), {"gpus": 100}),
    R("only an admin removes a tenant's limit set live", "DELETE /v1/tenants/vision/limit",
      (401, 200, 403, 403, 403, 403), fresh=vision_limit_set_live),
    R("admins and submitters read GPU usage for chargeback (operators do not)", "GET /v1/usage",
      (401, 200, 403, 403, 200, 200)),
    R("a submitter reads only its own tenants' GPU usage", "GET /v1/usage?tenant=vision&by=tenant,site",
      (401, 200, 403, 403, 200, 403)),
    R("admins and operators scrape metrics", "GET /metrics", (401, 200, 200, 200, 403, 403)),
    R("liveness needs no token", "GET /healthz", OPEN),
    R("readiness needs no token", "GET /readyz", OPEN),
    R("the API's description needs no token", "GET /openapi.json", OPEN),
    # the dashboard's static files: open, whatever token is sent
    R("the root redirects to the dashboard", "GET /", (302,) * 6),
    R("the dashboard without its slash redirects", "GET /dashboard", (302,) * 6),
    R("the dashboard's page needs no token", "GET /dashboard/", OPEN),
    R("the dashboard's script needs no token", "GET /dashboard/dashboard.js", OPEN),
    R("a file the dashboard does not have is 404 to anyone", "GET /dashboard/secrets.txt", (404,) * 6),
]


@pytest.mark.parametrize("row", TABLE, ids=[row.case for row in TABLE])
async def test_who_may_call_what(fed: Federation, row: Row):
    method, path = row.route.split(" ", 1)
    expected = row.callers()
    got: dict[str, int] = {}
    for who in expected:
        async with row.fresh(fed) as names:
            status, answer = await fed.call(who, method, path, row.body, names)
        got[who] = status
        if status in (401, 403):
            assert answer["error"]["status"] == status and answer["error"]["message"], (
                f"{row.case} ({row.route}) as {who}: {answer}")
    wrong = {who: f"expected {expected[who]}, got {got[who]}" for who in expected if got[who] != expected[who]}
    assert not wrong, f"{row.case} ({row.route}): {wrong}"


def test_every_route_has_a_rule_and_a_row():
    """A route missing from ACCESS would be admin-only by default; every route the API serves, the dashboard's
    included, has a rule and at least one row in TABLE."""
    from aiohttp import web

    app = create_app(Broker(BrokerSettings(db=":memory:")))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD" and isinstance(r.resource, web.Resource)}
    api = {(m, p) for m, p in routes if not p.startswith("/dashboard") and p != "/"}
    assert api - set(ACCESS) == set(), "a route with no rule in ACCESS"

    def pattern(canonical: str) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(canonical)) + "$")

    rows = [r.route.split(" ", 1) for r in TABLE]
    untested = {(m, p) for m, p in routes
                if not any(rm == m and pattern(p).match(rp.split("?")[0]) for rm, rp in rows)}
    assert untested == set(), "a route with no row in TABLE"
    for m, p in (("POST", "/v1/sites/{name}/cordon"), ("POST", "/v1/sites/{name}/uncordon")):
        assert ACCESS.get((m, p)) == "site operator", f"{m} {p}: admins and the site's operators only"


async def test_a_submitters_cancel_by_labels_leaves_another_tenants_jobs_with_those_labels_alone(fed: Federation):
    sweep = {"sweep": "shared-name"}
    ids = {}
    for tenant, model in (("vision", "a100-80gb"), ("nlp", "l4")):
        status, created = await fed.call(tenant, "POST", "/v1/jobs", {**job(tenant, model, "swept"), "labels": sweep})
        assert status == 201, created
        ids[tenant] = created["id"]
    status, answer = await fed.call("nlp", "POST", "/v1/cancellations", {"labels": sweep})
    assert status == 200 and answer["cancelled"] == [ids["nlp"]] and answer["matched"] == 1, answer
    _, theirs = await fed.call("admin", "GET", f"/v1/jobs/{ids['vision']}")
    assert theirs["state"] != "cancelled", theirs
    status, answer = await fed.call("nlp", "POST", "/v1/cancellations", {"tenant": "vision", "labels": sweep})
    assert status == 403 and answer["error"]["fields"] == [
        {"field": "tenant", "problem": "not a tenant this token acts for"}], answer
    status, answer = await fed.call("admin", "POST", "/v1/cancellations", {"labels": sweep})
    assert status == 200 and answer["cancelled"] == [ids["vision"]], answer


async def test_an_operator_scrapes_only_its_own_sites_metrics_and_no_tenants(fed: Federation):
    async def labels(who: str) -> list[tuple[str, dict[str, str]]]:
        r = await fed.client.get("/metrics", headers=fed.headers(who))
        assert r.status == 200
        return [(s.name, s.labels) for family in text_string_to_metric_families(await r.text())
                for s in family.samples]

    everything = await labels("admin")
    assert {ls["site"] for _, ls in everything if "site" in ls} == {"alpha", "beta"}
    assert {ls["tenant"] for _, ls in everything if "tenant" in ls} == {"vision", "nlp"}
    mine = await labels("alpha-ops")
    assert ("heliotrope_site_gpus", {"site": "alpha", "model": "a100-80gb"}) in mine
    assert ("heliotrope_site_healthy", {"site": "alpha"}) in mine
    assert {ls["site"] for _, ls in mine if "site" in ls} == {"alpha"}, "another site's samples"
    assert [(n, ls) for n, ls in mine if "tenant" in ls] == [], "samples by tenant"
    theirs = await labels("beta-ops")
    assert {ls["site"] for _, ls in theirs if "site" in ls} == {"beta"}


async def test_a_cordoned_site_keeps_its_jobs_and_takes_no_new_ones_until_uncordoned(fed: Federation):
    status, site = await fed.call("alpha-ops", "POST", "/v1/sites/alpha/cordon", {"reason": "swapping a PSU"})
    assert status == 200, site
    assert site["name"] == "alpha" and site["cordoned"] is True and site["cordon_reason"] == "swapping a PSU"
    _, read = await fed.call("admin", "GET", "/v1/sites/alpha")
    assert read["cordoned"] is True
    status, created = await fed.call("vision", "POST", "/v1/jobs", job("vision", "a100-80gb", "waits"))
    assert status == 201  # only alpha has A100s
    await asyncio.sleep(0.5)  # ten scheduling passes
    _, waiting = await fed.call("vision", "GET", f"/v1/jobs/{created['id']}")
    assert waiting["state"] == "queued", "a cordoned site was given a new job"
    _, kept = await fed.call("vision", "GET", "/v1/jobs/{vision_job}")
    assert kept["state"] == "running" and kept["site"] == "alpha", "cordoning stopped a running job"
    status, site = await fed.call("alpha-ops", "POST", "/v1/sites/alpha/uncordon")
    assert status == 200 and site["cordoned"] is False, site
    await fed.running(created["id"], "alpha")


async def test_a_submitter_lists_only_its_tenants_jobs_and_an_operator_only_its_sites(fed: Federation):
    _, mine = await fed.call("vision", "GET", "/v1/jobs")
    assert {j["spec"]["tenant"] for j in mine["items"]} == {"vision"}
    _, theirs = await fed.call("nlp", "GET", "/v1/jobs")
    assert [j["id"] for j in theirs["items"]] == [fed.jobs["nlp_job"]]
    _, on_alpha = await fed.call("alpha-ops", "GET", "/v1/jobs")
    assert {j["site"] for j in on_alpha["items"]} == {"alpha"}
    assert {j["id"] for j in on_alpha["items"]} == {fed.jobs["vision_job"], fed.jobs["spare"]}
    _, everything = await fed.call("admin", "GET", "/v1/jobs")
    assert len(everything["items"]) == 3


async def test_sites_are_shown_to_each_role_as_it_may_see_them(fed: Federation):
    _, as_operator = await fed.call("alpha-ops", "GET", "/v1/sites")
    views = {s["name"]: s for s in as_operator["items"]}
    assert "adapter" in views["alpha"] and len(views["alpha"]["quotas"]) == 2  # its own site, whole
    assert "adapter" not in views["beta"] and "quotas" not in views["beta"]  # another's: the public view
    _, quota = await fed.call("vision", "GET", "/v1/sites/alpha/quota")
    assert [t["tenant"] for t in quota["tenants"]] == ["vision"]  # not nlp's guarantee or usage
    _, site = await fed.call("vision", "GET", "/v1/sites/alpha")
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


async def test_an_update_that_waits_for_a_credential_change_keeps_it_and_is_checked_against_it(fed: Federation):
    """A PUT that leaves the kubeconfig out keeps the stored one, and an operator may not change it: both were
    worked out from the spec read before the PUT waited its turn. Behind an admin's update that moved the site
    to another kubeconfig, an operator's price change put the old kubeconfig back (the admin's 200 undone, and
    an operator had changed a credential); behind one that changed its context, an operator's PUT that sends
    the old context was let through as no change."""
    status, _ = await fed.call("admin", "POST", "/v1/sites", KUBE_GAMMA)
    assert status == 201
    broker = fed.client.server.app[BROKER]
    release = asyncio.Event()

    async def one_behind_another(first: tuple[str, Any], then: tuple[str, Any]) -> tuple[Any, Any]:
        """``first``'s PUT (who, body) holds the site (its old adapter takes its time to close) while
        ``then``'s arrives and waits its turn."""
        adapter = broker.federation.get("gamma").adapter
        close = adapter.close

        async def slow_close():
            await release.wait()
            await close()

        adapter.close = slow_close
        release.clear()
        a = asyncio.ensure_future(fed.call(first[0], "PUT", "/v1/sites/gamma", first[1]))
        try:
            while not broker.site_lock("gamma").locked():
                await asyncio.sleep(0.001)
            b = asyncio.ensure_future(fed.call(then[0], "PUT", "/v1/sites/gamma", then[1]))
            while not broker.site_lock("gamma")._waiters and not b.done():  # it reaches the broker and waits
                await asyncio.sleep(0.001)
        finally:
            release.set()
        return await a, await b

    moved = {**KUBE_GAMMA, "adapter": {**KUBE_GAMMA["adapter"], "kubeconfig": "/etc/secret/gamma-2.kubeconfig"}}
    priced = {**with_adapter(KUBE_GAMMA), "usd_per_gpu_hour": {"l4": 0.9}}  # as the operator read it
    (admin, _), (operator, body) = await one_behind_another(("admin", moved), ("gamma-ops", priced))
    assert admin == 200 and operator == 200, body
    for spec in (broker.federation.get("gamma").spec, {s.name: s for s in await broker.store.list_sites()}["gamma"]):
        assert spec.adapter.kubeconfig == "/etc/secret/gamma-2.kubeconfig" and spec.usd_per_gpu_hour == {"l4": 0.9}

    # An operator's PUT that would put back a credential an admin changed meanwhile is refused.
    (admin, _), (operator, body) = await one_behind_another(
        ("admin", {**moved, "usd_per_gpu_hour": {"l4": 0.9}, "adapter": {**moved["adapter"], "context": "gamma-new"}}),
        ("gamma-ops", {**priced, "usd_per_gpu_hour": {"l4": 1.1}}))
    assert admin == 200
    assert operator == 403 and body["error"]["fields"] == [{"field": "adapter.context",
                                                            "problem": "only an admin may change it"}], body
    spec = broker.federation.get("gamma").spec
    assert (spec.adapter.context, spec.usd_per_gpu_hour) == ("gamma-new", {"l4": 0.9})


async def test_an_operators_update_that_cannot_start_the_adapter_does_not_name_the_kubeconfig(tmp_path, capsys):
    # The operator never reads the kubeconfig (its update keeps the stored one), so the 422 saying the adapter
    # could not start with the update must not name it either: the adapter's error names its path.
    kubeconfig = tmp_path / "team-gamma-prod-admin.kubeconfig"
    kubeconfig.write_text("- not: a kubeconfig\n")  # rotated into something unusable since it was registered
    db = str(tmp_path / "auth.db")
    token = await asyncio.to_thread(make_token, db, capsys, "--role", "operator", "--name", "gamma-ops", "--site",
                                    "gamma")
    broker = Broker(BrokerSettings(db=db, auth=AuthSettings(enabled=True)))
    await broker.start([SiteSpec.model_validate({**GAMMA, "adapter": {"kind": "kubernetes", "retries": 1,
                                                                        "kubeconfig": str(kubeconfig)}})])
    try:
        async with TestClient(TestServer(create_app(broker))) as client:
            headers = {"Authorization": f"Bearer {token}"}
            site = await (await client.get("/v1/sites/gamma", headers=headers)).json()
            update = {k: v for k, v in site.items() if k not in ("status", "signals")}
            update["adapter"]["request_timeout_s"] = 20.0  # a setting the operator may change: the adapter is rebuilt
            r = await client.put("/v1/sites/gamma", json=update, headers=headers)
            answer = await r.text()
    finally:
        await broker.stop()
    assert r.status == 422 and "cannot load Kubernetes credentials (<adapter.kubeconfig> holds no kubeconfig" in answer
    assert "team-gamma-prod-admin" not in answer


async def test_a_revoked_token_is_refused_within_the_refresh_interval(fed: Federation, capsys):
    status, _ = await fed.call("vision", "GET", "/v1/jobs")
    assert status == 200
    assert await asyncio.to_thread(main, ["token", "list", "--db", fed.db, "--json"]) == 0
    listed = json.loads(capsys.readouterr()[0])
    assert all("digest" not in t and "token" not in t for t in listed)
    vision = next(t["id"] for t in listed if t["name"] == "vision-team")
    assert await asyncio.to_thread(main, ["token", "revoke", vision, "--db", fed.db]) == 0
    capsys.readouterr()
    await asyncio.sleep(0.1)  # refresh_s is 0.05 here
    status, answer = await fed.call("vision", "GET", "/v1/jobs")
    assert status == 401 and "revoked" in answer["error"]["message"]


async def test_an_open_event_stream_ends_when_its_token_is_revoked(fed: Federation):
    headers = fed.headers("vision")
    async with fed.client.get("/v1/events?type=transition", headers=headers) as stream:
        assert stream.status == 200
        await asyncio.wait_for(stream.content.readline(), 5)
        broker = fed.client.server.app[BROKER]
        record = next(r for r in broker.tokens._by_digest.values() if r.name == "vision-team")
        await broker.store.update_token(record.id, record.model_copy(
            update={"revoked_at": datetime.now(UTC)}).model_dump_json())
        for _ in range(250):  # refresh_s is 0.05 here: wait until the broker refuses the token (not a fixed sleep)
            if (await fed.call("vision", "GET", "/v1/whoami"))[0] == 401:
                break
            await asyncio.sleep(0.02)
        assert (await fed.call("vision", "GET", "/v1/whoami"))[0] == 401
        status, created = await fed.call("admin", "POST", "/v1/jobs", job("vision", "l4"))  # an event it would see
        assert status == 201
        rest = await asyncio.wait_for(stream.content.read(), 5)  # the stream ends instead
    # (a transition of the fixture's jobs stored before the revocation may still come first: the job's state is
    # read from memory at once, its event published when its write lands, later under load; none of the new job's)
    assert created["id"].encode() not in rest, rest
    seen = {json.loads(line[6:])["job_id"] for line in rest.decode().splitlines() if line.startswith("data: ")}
    assert seen <= {fed.jobs["vision_job"], fed.jobs["spare"]}, seen


async def test_a_followed_log_ends_when_its_token_is_revoked_while_the_log_is_quiet(fed: Federation, monkeypatch):
    # A job that prints nothing for a long while (its simulated progress lines are 6 minutes apart): the follow must
    # not go on, holding the site's stream, for hours after its token was revoked, waiting for a line to check it at.
    from broker import api

    monkeypatch.setattr(api, "LOG_FOLLOW_CHECK_S", 0.05)
    path = f"/v1/jobs/{fed.jobs['vision_job']}/logs"
    async with fed.client.get(path, params={"follow": "true"}, headers=fed.headers("vision")) as stream:
        assert stream.status == 200
        assert b"started on" in await asyncio.wait_for(stream.content.readline(), 5)
        broker = fed.client.server.app[BROKER]
        record = next(r for r in broker.tokens._by_digest.values() if r.name == "vision-team")
        await broker.store.update_token(record.id, record.model_copy(
            update={"revoked_at": datetime.now(UTC)}).model_dump_json())
        with pytest.raises(aiohttp.ClientPayloadError):  # it is cut off, with nothing more (the attempt runs on)
            await asyncio.wait_for(stream.content.read(), 5)
    assert not fed.client.server.app[api.FOLLOWS]


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


def test_a_database_the_cli_or_the_broker_makes_is_readable_by_its_owner_only(tmp_path, capsys):
    # It holds the tokens' records and every tenant's jobs: no other user of the machine reads it.
    db = tmp_path / "t.db"
    make_token(str(db), capsys, "--role", "admin", "--name", "ops")
    assert db.stat().st_mode & 0o777 == 0o600

    async def serve_briefly() -> list[tuple[str, int]]:
        broker = Broker(BrokerSettings(db=str(tmp_path / "b.db")))
        await broker.start([])
        try:
            return [(p.name, p.stat().st_mode & 0o777) for p in tmp_path.glob("b.db*")]
        finally:
            await broker.stop()

    modes = asyncio.run(serve_briefly())
    assert {name for name, _ in modes} >= {"b.db", "b.db-wal"} and {mode for _, mode in modes} == {0o600}, modes


def test_tokens_are_listed_oldest_first(tmp_path, capsys):
    # Token ids are random; the list reads in the order the tokens were made, as the README shows it.
    db = str(tmp_path / "t.db")
    names = [f"team-{i}" for i in range(6)]
    for name in names:
        assert main(["token", "create", "--db", db, "--role", "submitter", "--name", name, "--tenant", "t"]) == 0
    capsys.readouterr()
    assert main(["token", "list", "--db", db, "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr()[0])] == names


async def test_an_operator_reads_the_logs_of_attempts_at_its_own_sites_only(fed: Federation):
    # A job that ran at alpha and then moved to beta: beta's operator sees the job (it runs there now), but what
    # its attempt printed at alpha is alpha's to show (its tenant's, an admin's), as alpha's cluster is not beta's.
    assert (await fed.call("admin", "POST", "/v1/sites/beta/cordon", {"reason": "the job starts at alpha"}))[0] == 200
    status, created = await fed.call("vision", "POST", "/v1/jobs", {**job("vision", "l4", "moves"),
                                                                     "gpus": {"count": 1}})
    assert status == 201, created
    job_id = created["id"]
    await fed.running(job_id, "alpha")
    assert (await fed.call("admin", "POST", "/v1/sites/beta/uncordon"))[0] == 200
    assert (await fed.call("admin", "POST", "/v1/sites/alpha/cordon", {"reason": "the job moves"}))[0] == 200
    await fed.client.app[BROKER].federation.get("alpha").adapter.preempt(job_id, 1, "moved for the test")
    await fed.running(job_id, "beta")
    status, text = await fed.call("beta-ops", "GET", f"/v1/jobs/{job_id}/logs")
    assert status == 200 and f"attempt 2 of job {job_id}" in text, text
    status, refused = await fed.call("beta-ops", "GET", f"/v1/jobs/{job_id}/logs?attempt=1")
    assert status == 403, refused
    assert refused["error"]["message"] == (
        f"attempt 1 of job {job_id} ran at site alpha: its logs are for tenant vision's submitters, admins and "
        "site alpha's operators")
    status, refused = await fed.call("beta-ops", "GET", f"/v1/jobs/{job_id}/logs?attempt=1&follow=true")
    assert status == 403, refused  # following a log is reading it: the same rules
    for who in ("vision", "admin"):
        status, text = await fed.call(who, "GET", f"/v1/jobs/{job_id}/logs?attempt=1")
        assert status == 200 and f"attempt 1 of job {job_id}" in text, (who, text)


async def test_a_submitter_sending_another_tenants_job_is_refused_as_such_and_not_told_that_tenants_limit(
        made: tuple[str, dict[str, str]]):
    """``broker.tenant_limits``: a job of a tenant the token does not act for is refused with 403 whatever its size,
    submitted or previewed; a 422 quoting that tenant's limit told a submitter what the platform allows another
    tenant (its own tenant's job past its own limit is still refused with 422 naming ``gpus``)."""
    db, tokens = made
    settings = BrokerSettings(db=db, shutdown_grace_s=1, auth=AuthSettings(enabled=True),
                              tenant_limits={"vision": {"gpus": 2}, "nlp": {"gpus": 2}})
    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as client:
            f = Federation(client, tokens, {}, db)
            big = {**job("vision", "a100-80gb"), "gpus": {"count": 3}}
            for path, body in (("/v1/jobs", big), ("/v1/preview", big), ("/v1/preview", [big])):
                status, answer = await f.call("nlp", "POST", path, body)
                assert status == 403 and "may hold" not in json.dumps(answer), (path, answer)
            status, answer = await f.call("vision", "POST", "/v1/jobs", big)
            assert status == 422 and answer["error"]["fields"][0]["field"] == "gpus", answer
    finally:
        await broker.stop()
