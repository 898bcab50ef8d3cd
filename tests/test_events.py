"""Live events (``GET /v1/events``, ``heliotrope watch``): every transition of a job, in order; filters;
what each role receives with auth on (its tenants' jobs, its sites' jobs and health); deferrals, preemptions
and site health changes on the stream; resuming with Last-Event-ID; a stalled client cut off; streams ended
at shutdown. Reads are bounded: each waits for a known event with a timeout, never for the stream's end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer

from broker import auth
from broker import events as events_module
from broker.api import BROKER, create_app
from broker.client import ApiClientError, Client
from broker.clock import ManualClock
from broker.config import AuthSettings, BrokerSettings
from broker.events import EventHub
from broker.models import SimulatedAdapterConfig, SiteSpec
from broker.service import Broker
from tests.builders import site as site_spec
from tests.conftest import HELIOTROPE, ROOT

SITE = {"name": "alpha", "region": "gcp:europe-west3", "grid_zone": "DE-LU", "timezone": "Europe/Berlin",
        "latitude": 50.1, "longitude": 8.7, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}],
        "adapter": {"kind": "simulated", "dispatch_delay_s": 0.005}}


def job(tenant: str = "vision", duration_s: float = 0.3, **more: Any) -> dict[str, Any]:
    return {"tenant": tenant, "name": "j", "gpus": {"count": 1}, "duration_s": duration_s, **more}


@pytest.fixture
async def client(tmp_path: Path):
    broker = Broker(BrokerSettings(db=str(tmp_path / "ev.db"), cycle_interval_s=0.05, shutdown_grace_s=1))
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        assert (await c.post("/v1/sites", json=SITE)).status == 201
        yield c
    await broker.stop()


class Stream:
    """An open event stream, read one event at a time with a timeout."""

    def __init__(self, client: TestClient, query: str = "", last_id: int | None = None,
                 token: str | None = None) -> None:
        self.client, self.query, self.last_id, self.token = client, query, last_id, token
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.seen: list[dict[str, Any]] = []  # every event read so far, in order

    async def __aenter__(self) -> Stream:
        headers = {"Last-Event-ID": str(self.last_id)} if self.last_id is not None else {}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        self._resp = await self.client.get("/v1/events" + self.query, headers=headers)
        assert self._resp.status == 200, await self._resp.text()
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        frame: dict[str, str] = {}
        async for raw in self._resp.content:
            line = raw.decode().rstrip("\n")
            if not line:
                if "data" in frame:
                    await self.events.put({"id": int(frame["id"]) if "id" in frame else None,
                                           "type": frame.get("event"), "data": json.loads(frame["data"])})
                frame = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                frame[name] = value

    async def next(self, timeout_s: float = 10) -> dict[str, Any]:
        event = await asyncio.wait_for(self.events.get(), timeout_s)
        self.seen.append(event)
        return event

    async def saw(self, done, timeout_s: float = 10) -> dict[str, Any]:
        """The first event, read already or from now on, for which ``done`` holds."""
        for event in self.seen:
            if done(event):
                return event
        return (await self.until(done, timeout_s))[-1]

    async def until(self, done, timeout_s: float = 10) -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        while True:
            seen.append(await self.next(timeout_s))
            if done(seen[-1]):
                return seen

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self._resp.close()


async def test_the_stream_delivers_every_transition_of_a_job_in_order(client: TestClient):
    async with Stream(client, "?tenant=vision") as stream:
        r = await client.post("/v1/jobs", json=job(duration_s=0.3))
        job_id = (await r.json())["id"]
        seen = await stream.until(lambda e: e["type"] == "transition" and e["data"]["state"] == "succeeded")
    mine = [e for e in seen if e["data"].get("job_id") == job_id]
    transitions = [(e["data"]["previous"], e["data"]["state"]) for e in mine if e["type"] == "transition"]
    assert transitions == [(None, "queued"), ("queued", "dispatching"), ("dispatching", "admitted"),
                           ("admitted", "running"), ("running", "succeeded")]
    stored = await (await client.get(f"/v1/jobs/{job_id}/events")).json()
    assert [s for _, s in transitions] == [e["state"] for e in stored["items"]]  # the same story as the store's
    placed = next(i for i, e in enumerate(mine) if e["type"] == "decision")
    assert mine[placed]["data"]["outcome"] == "placed" and mine[placed]["data"]["site"] == "alpha"
    assert mine[placed + 1]["data"]["state"] == "dispatching"  # the decision comes before its dispatch
    ids = [e["id"] for e in seen]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_filters_keep_only_the_tenant_job_and_types_asked_for(client: TestClient):
    async with Stream(client, "?tenant=nlp&type=transition") as stream:
        await client.post("/v1/jobs", json=job("vision"))
        r = await client.post("/v1/jobs", json=job("nlp"))
        nlp_id = (await r.json())["id"]
        seen = await stream.until(lambda e: e["data"]["state"] == "succeeded")
    assert {e["data"]["tenant"] for e in seen} == {"nlp"} and {e["type"] for e in seen} == {"transition"}
    assert {e["data"]["job_id"] for e in seen} == {nlp_id}
    bad = await client.get("/v1/events?type=everything")
    assert bad.status == 400 and (await bad.json())["error"]["fields"][0]["field"] == "type"
    unknown = await client.get("/v1/events?tenants=nlp")
    assert unknown.status == 400 and "tenants" in (await unknown.json())["error"]["message"]


async def test_a_client_that_reconnects_with_last_event_id_gets_what_it_missed_once(client: TestClient):
    async with Stream(client, "?type=transition") as stream:
        r = await client.post("/v1/jobs", json=job(duration_s=5))
        job_id = (await r.json())["id"]
        first = await stream.until(lambda e: e["data"]["state"] == "running")
    await client.post(f"/v1/jobs/{job_id}/cancel")
    await asyncio.sleep(0.2)
    async with Stream(client, "?type=transition", last_id=first[-1]["id"]) as again:
        missed = await again.next()
    assert missed["data"]["job_id"] == job_id and missed["data"]["state"] == "cancelled"
    assert missed["id"] > first[-1]["id"]


async def test_a_site_joining_and_leaving_is_announced(client: TestClient):
    async with Stream(client, "?type=site") as stream:
        assert (await client.post("/v1/sites", json={**SITE, "name": "beta"})).status == 201
        joined = await stream.until(lambda e: e["data"]["site"] == "beta")
        assert (await client.delete("/v1/sites/beta")).status == 204
        left = await stream.until(lambda e: e["data"]["site"] == "beta")
    assert joined[-1]["data"]["health"] == "healthy" and joined[-1]["data"]["previous"] is None
    assert left[-1]["data"]["health"] == "removed" and left[-1]["data"]["previous"] == "healthy"


async def test_a_subscriber_that_falls_behind_is_cut_off_with_where_to_resume(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(events_module, "QUEUE", 3)
    hub = EventHub()
    stream = hub.follow(lambda e: True, heartbeat_s=5)
    first = hub.publish("site", {"site": "a"})
    for i in range(10):  # nobody reads meanwhile
        hub.publish("site", {"site": f"s{i}"})
    got = [await stream.__anext__() for _ in range(4)]
    assert [e.type for e in got] == ["site", "site", "site", "lost"] and got[0].id == first.id
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert hub.subscribers == set()
    assert b"resume_after" in events_module.frame(got[-1], got[-2].id)


async def test_the_held_events_are_bounded_and_a_gap_is_reported():
    hub = EventHub(keep=5)
    published = [hub.publish("site", {"n": i}) for i in range(12)]
    assert len(hub.recent) == 5
    stream = hub.follow(lambda e: True, after=published[2].id, heartbeat_s=5)
    gap = await stream.__anext__()
    assert gap.type == "gap" and gap.data["oldest_held"] == published[7].id
    assert (await stream.__anext__()).id == published[7].id


async def test_no_gap_is_reported_where_nothing_is_gone():
    # Ids follow the clock, so held ids jump; a client asking for everything held (Last-Event-ID 0), or
    # resuming after a held event, is told of no gap. One resuming after an id this hub never handed out
    # (another replica's, an earlier process') is, as events after it may be gone.
    hub = EventHub(keep=5)
    published = [hub.publish("site", {"n": i}) for i in range(3)]
    for after in (0, published[0].id):
        stream = hub.follow(lambda e: True, after=after, heartbeat_s=5)
        first = await stream.__anext__()
        assert first.type == "site" and first.id == (published[0].id if after == 0 else published[1].id)
        stream.close()
    stream = hub.follow(lambda e: True, after=hub._start - 10, heartbeat_s=5)
    assert (await stream.__anext__()).type == "gap"
    stream.close()


async def test_stopping_the_server_ends_open_streams_promptly(tmp_path: Path):
    broker = Broker(BrokerSettings(db=str(tmp_path / "stop.db"), cycle_interval_s=0.05, shutdown_grace_s=1))
    await broker.start([])
    server = TestServer(create_app(broker))
    await server.start_server()
    async with ClientSession() as session:
        async with session.get(server.make_url("/v1/events")) as resp:
            assert resp.status == 200
            await resp.content.readline()
            started = time.monotonic()
            closing = asyncio.create_task(server.close())
            rest = await asyncio.wait_for(resp.content.read(), 10)  # ends: the stream is closed, not left open
            await asyncio.wait_for(closing, 10)
    await broker.stop()
    assert time.monotonic() - started < 5 and b"event:" not in rest


@pytest.mark.slow
def test_heliotrope_watch_prints_a_jobs_life_as_it_happens(server, tmp_path: Path):
    body = json.dumps(job("vision", 0.3)).encode()
    req = urllib.request.Request(server.url + "/v1/jobs", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        job_id = json.loads(r.read())["id"]
    # --after 0: from the first event the broker holds, so what happened before it connected is there too
    watch = subprocess.Popen([*HELIOTROPE, "--server", server.url, "watch", "--type", "transition", "--job", job_id,
                              "--after", "0", "--count", "5"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    lines = [line for line in out.splitlines() if job_id in line]
    assert [line.split()[4:7] for line in lines] == [
        ["new", "->", "queued:"], ["queued", "->", "dispatching"], ["dispatching", "->", "admitted"],
        ["admitted", "->", "running"], ["running", "->", "succeeded"]]


async def test_the_client_follows_the_stream_and_reports_a_refusal(client: TestClient):
    url = str(client.make_url("")).rstrip("/")
    async with Client(url) as c:
        got: list[dict[str, Any]] = []

        async def follow() -> None:
            async for event in c.events({"type": "transition"}):
                got.append(event)
                if event["data"]["state"] == "running":
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.2)
        await client.post("/v1/jobs", json=job(duration_s=5))
        await asyncio.wait_for(task, 10)
        assert [e["data"]["state"] for e in got] == ["queued", "dispatching", "admitted", "running"]
        with pytest.raises(Exception, match="unknown event type"):
            async for _ in c.events({"type": "nonsense"}):
                pass


async def test_the_client_never_sends_its_token_to_another_server_a_redirect_names():
    # A heliotrope replica relays the leader's stream itself; a redirect elsewhere (a proxy, a server that is
    # not the one the user named, https to http) must not carry the bearer token there.
    tokens_seen: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        tokens_seen.append(request.headers.get("Authorization"))
        return web.Response(text="data: {}\n\n", content_type="text/event-stream")

    other = web.Application()
    other.router.add_get("/v1/events", elsewhere)
    async with TestServer(other) as there:
        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(str(there.make_url("/v1/events")))  # the same host, another port

        app = web.Application()
        app.router.add_get("/v1/events", redirect)
        async with TestServer(app) as here, Client(str(here.make_url("")), token="hlt_secret") as c:
            with pytest.raises(ApiClientError, match="redirected to another server"):
                await anext(aiter(c.events()))  # the first event: the redirect is refused before any
    assert tokens_seen == []


# --- what each role receives, with auth on ------------------------------------------------------------------------

BETA = {**SITE, "name": "beta", "gpus": [{"model": "l4", "gpus_per_node": 8, "nodes": 1}]}
A100 = {"count": 1, "model": "a100-80gb"}  # only alpha has them
L4 = {"count": 1, "model": "l4"}  # only beta has them
LIFE = [(None, "queued"), ("queued", "dispatching"), ("dispatching", "admitted"), ("admitted", "running"),
        ("running", "succeeded")]
AT_THE_SITE = LIFE[1:]  # a queued job is at no site yet: its site's operator hears of it from its placement on


def ended(job_id: str):
    return lambda e: e["type"] == "transition" and e["data"]["job_id"] == job_id and e["data"]["state"] == "succeeded"


def health(site: str, state: str):
    return lambda e: e["type"] == "site" and e["data"]["site"] == site and e["data"]["health"] == state


def story(events: list[dict[str, Any]], job_id: str) -> list[tuple[str | None, str]]:
    return [(e["data"]["previous"], e["data"]["state"]) for e in events
            if e["type"] == "transition" and e["data"]["job_id"] == job_id]


class Guarded:
    """A broker with auth on, alpha (A100s) and beta (L4s), and a token per role."""

    def __init__(self, client: TestClient, tokens: dict[str, str]) -> None:
        self.client, self.tokens = client, tokens
        self.broker: Broker = client.server.app[BROKER]

    def stream(self, who: str, query: str = "") -> Stream:
        return Stream(self.client, query, token=self.tokens[who])

    async def submit(self, tenant: str, gpus: dict[str, Any], duration_s: float = 0.3) -> str:
        r = await self.client.post("/v1/jobs", json=job(tenant, duration_s, gpus=gpus),
                                   headers={"Authorization": f"Bearer {self.tokens['admin']}"})
        assert r.status == 201, await r.text()
        return (await r.json())["id"]

    def reachable(self, site: str, up: bool) -> None:
        """Make ``site`` answer the broker's reports, or not (its telemetry stops: it turns unhealthy)."""
        self.broker.federation.get(site).adapter.set_reachable(up)


@pytest.fixture
async def guarded(tmp_path: Path):
    settings = BrokerSettings(db=str(tmp_path / "auth.db"), cycle_interval_s=0.05, shutdown_grace_s=1,
                              auth=AuthSettings(enabled=True, refresh_s=0.05))
    broker = Broker(settings)
    await broker.start([SiteSpec.model_validate(SITE), SiteSpec.model_validate(BETA)])
    tokens = {}
    for name, role, sites, tenants in (("admin", "admin", [], []), ("alpha-ops", "operator", ["alpha"], []),
                                       ("beta-ops", "operator", ["beta"], []), ("vision", "submitter", [], ["vision"]),
                                       ("nlp", "submitter", [], ["nlp"])):
        tokens[name], record = auth.make_record(name, role, sites, tenants, datetime.now(UTC))
        await broker.store.put_token(record.id, record.digest, record.model_dump_json())
    await broker.tokens.refresh(force=True)
    async with TestClient(TestServer(create_app(broker))) as c:
        yield Guarded(c, tokens)
    await broker.stop()


async def test_a_submitter_receives_its_tenants_jobs_and_nothing_of_another_tenants(guarded: Guarded):
    g = guarded
    async with g.stream("vision") as vision, g.stream("nlp") as nlp:
        nlp_job = await g.submit("nlp", L4)
        vision_job = await g.submit("vision", A100)
        await vision.saw(ended(vision_job))
        await nlp.saw(ended(nlp_job))
        g.reachable("beta", False)  # a site's health is no tenant's business
        # Both jobs' events, and beta's, are published by now: a later event of each tenant marks the end of what
        # its stream could have been sent.
        await asyncio.sleep(0.2)
        marks = {"vision": await g.submit("vision", A100), "nlp": await g.submit("nlp", L4)}
        await vision.saw(lambda e: e["data"].get("job_id") == marks["vision"])
        await nlp.saw(lambda e: e["data"].get("job_id") == marks["nlp"])
        g.reachable("beta", True)
    assert story(vision.seen, vision_job) == LIFE
    assert story(nlp.seen, nlp_job) == LIFE
    assert {e["data"].get("tenant") for e in vision.seen} == {"vision"}, "another tenant's events"
    assert {e["data"].get("tenant") for e in nlp.seen} == {"nlp"}, "another tenant's events"
    assert {e["type"] for e in vision.seen + nlp.seen} <= {"transition", "decision"}  # no site events


async def test_an_operator_receives_its_sites_jobs_and_health_and_nothing_of_another_sites(guarded: Guarded):
    g = guarded
    async with g.stream("alpha-ops") as ops, g.stream("admin") as admin:
        nlp_job = await g.submit("nlp", L4)  # runs on beta
        vision_job = await g.submit("vision", A100)  # runs on alpha
        await admin.saw(ended(nlp_job))
        await ops.saw(ended(vision_job))
        g.reachable("beta", False)
        await admin.saw(health("beta", "unhealthy"))
        g.reachable("alpha", False)  # published after beta's: if beta's reached the operator, it came before
        unhealthy = await ops.saw(health("alpha", "unhealthy"))
        g.reachable("alpha", True)
        await ops.until(health("alpha", "healthy"))
        g.reachable("beta", True)
    assert story(ops.seen, vision_job) == AT_THE_SITE
    placed = next(e for e in ops.seen if e["type"] == "decision" and e["data"]["job_id"] == vision_job)
    assert placed["data"]["outcome"] == "placed" and placed["data"]["site"] == "alpha"
    assert {e["data"]["site"] for e in ops.seen} == {"alpha"}, "events of another site"
    assert nlp_job not in json.dumps([e["data"] for e in ops.seen])
    assert [e["data"]["health"] for e in ops.seen if e["type"] == "site"][-2:] == ["unhealthy", "healthy"]
    assert unhealthy["data"]["previous"] == "healthy" and "unreachable" in unhealthy["data"]["reason"]
    assert story(admin.seen, nlp_job) == LIFE and story(admin.seen, vision_job) == LIFE  # the admin sees all


async def test_a_stream_filtered_to_another_tenant_or_site_is_refused(guarded: Guarded):
    g = guarded
    r = await g.client.get("/v1/events?tenant=nlp", headers={"Authorization": f"Bearer {g.tokens['vision']}"})
    assert r.status == 403 and (await r.json())["error"]["fields"][0]["field"] == "tenant"
    r = await g.client.get("/v1/events?site=beta", headers={"Authorization": f"Bearer {g.tokens['alpha-ops']}"})
    assert r.status == 403 and (await r.json())["error"]["fields"][0]["field"] == "site"
    r = await g.client.get("/v1/events?site=alpha", headers={"Authorization": f"Bearer {g.tokens['nlp']}"})
    assert r.status == 200  # a submitter may narrow its own stream by site
    r.close()


async def test_an_admins_site_filter_keeps_that_sites_jobs_and_health_only(guarded: Guarded):
    g = guarded
    async with g.stream("admin", "?site=beta") as beta, g.stream("admin") as everything:
        vision_job = await g.submit("vision", A100)  # on alpha
        await everything.saw(ended(vision_job))
        g.reachable("alpha", False)
        await everything.saw(health("alpha", "unhealthy"))
        nlp_job = await g.submit("nlp", L4)  # on beta
        await beta.saw(ended(nlp_job))
        g.reachable("beta", False)
        await beta.saw(health("beta", "unhealthy"))
        g.reachable("alpha", True), g.reachable("beta", True)
    assert story(beta.seen, nlp_job) == AT_THE_SITE
    assert {e["data"]["site"] for e in beta.seen} == {"beta"}
    assert vision_job not in json.dumps([e["data"] for e in beta.seen])


# --- deferrals, preemptions and site health on the stream ---------------------------------------------------------

GREEN_AT = datetime(2022, 6, 15, 2, 10, tzinfo=UTC)  # a dirty hour in Frankfurt and Tokyo (tests/test_timeshift.py)


@pytest.fixture
async def green(tmp_path: Path):
    """A broker on a manual clock with the shipped carbon data, frankfurt and tokyo, whose cycle the test runs."""
    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    sites = [site_spec("frankfurt", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin",
                       adapter=fast),
             site_spec("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=fast)]
    settings = BrokerSettings.model_validate({
        "db": str(tmp_path / "green.db"), "shutdown_grace_s": 0.1,
        "carbon": {"kind": "files", "path": str(ROOT / "data" / "carbon")}, "carbon_forecast": {"history_h": 336}})
    clock = ManualClock(GREEN_AT)
    broker = Broker(settings, clock=clock)
    await broker.start(sites, run_loop=False)
    await broker.signals.wait_ready()
    async with TestClient(TestServer(create_app(broker))) as c:
        yield broker, clock, c
    await broker.stop()


async def test_a_deferral_and_the_placement_that_ends_it_are_on_the_stream(green):
    broker, clock, client = green
    deadline = GREEN_AT + timedelta(hours=30)
    # Eight GPUs for four hours (enough carbon at stake for green to wait); green waits at most four times
    # the estimate, 16 h, which comes before deadline - 1.5 x the estimate.
    latest = GREEN_AT + timedelta(hours=16)
    async with Stream(client, "?type=deferral,decision,transition") as stream:
        body = job(duration_s=4 * 3600, profile="green", deadline=deadline.isoformat())
        body["gpus"] = {**body["gpus"], "count": 8}
        r = await client.post("/v1/jobs", json=body)
        job_id = (await r.json())["id"]
        await broker.cycle.run_once(full=True)
        deferral = await stream.saw(lambda e: e["type"] == "deferral")
        for _ in range(30):  # each whole hour it is decided again, until it starts
            if any(e["type"] == "decision" for e in stream.seen):
                break
            await clock.advance(3600)
            await broker.cycle.run_once(full=True)
            await asyncio.sleep(0.01)
        placed = await stream.saw(lambda e: e["type"] == "decision")
        await stream.saw(lambda e: e["type"] == "transition" and e["data"]["state"] == "dispatching")
    data = deferral["data"]
    assert data["job_id"] == job_id and data["tenant"] == "vision" and data["outcome"] == "deferred"
    assert data["site"] in ("frankfurt", "tokyo") and data["summary"].startswith("deferred until ")
    until = datetime.fromisoformat(data["deferred_until"])
    assert GREEN_AT < until <= latest
    assert placed["data"]["outcome"] == "placed" and datetime.fromisoformat(placed["data"]["at"]) <= latest
    kinds = [(e["type"], e["data"].get("state")) for e in stream.seen if e["data"]["job_id"] == job_id]
    assert kinds[:2] == [("transition", "queued"), ("deferral", None)]  # held, not dispatched
    assert kinds[-2:] == [("decision", None), ("transition", "dispatching")]


async def test_a_site_that_stops_answering_turns_unhealthy_on_the_stream_and_back(client: TestClient):
    alpha = client.server.app[BROKER].federation.get("alpha").adapter
    async with Stream(client, "?type=site", last_id=0) as stream:  # from the first event held: alpha's joining
        await stream.saw(health("alpha", "healthy"))
        alpha.set_reachable(False)
        down = await stream.saw(health("alpha", "unhealthy"))
        alpha.set_reachable(True)
        up = (await stream.until(health("alpha", "healthy")))[-1]
    assert down["data"]["previous"] == "healthy" and "unreachable" in down["data"]["reason"]
    assert up["data"]["previous"] == "unhealthy" and up["id"] > down["id"]


async def test_a_preemption_is_on_the_stream_before_the_job_is_requeued(client: TestClient):
    async with Stream(client, "?type=preemption,transition") as stream:
        low = await client.post("/v1/jobs", json=job("nlp", 3600, gpus={"count": 8}, preemptible=True,
                                                     checkpointable=True))
        low_id = (await low.json())["id"]
        await stream.saw(lambda e: e["data"]["job_id"] == low_id and e["data"]["state"] == "running")
        await asyncio.sleep(0.2)  # the site has reported itself full
        urgent = await client.post("/v1/jobs", json=job("vision", 3600, gpus={"count": 8}, priority=10))
        urgent_id = (await urgent.json())["id"]
        await stream.saw(lambda e: e["data"]["job_id"] == urgent_id and e["data"].get("state") == "running")
        await stream.saw(lambda e: e["data"]["job_id"] == low_id and e["data"].get("state") == "queued"
                         and e["data"]["previous"] == "preempted")
    preemption = next(e for e in stream.seen if e["type"] == "preemption")
    assert preemption["data"]["job_id"] == low_id and preemption["data"]["site"] == "alpha"
    assert preemption["data"]["tenant"] == "nlp" and urgent_id in preemption["data"]["reason"]
    # told once the preemption is stored (a store write retried must not tell it twice), before the requeue
    at = stream.seen.index(preemption)
    states = [(i, e["data"]["state"]) for i, e in enumerate(stream.seen)
              if e["type"] == "transition" and e["data"]["job_id"] == low_id]
    assert [s for i, s in states if i > at] == ["queued"]
    assert [s for i, s in states if i < at][-1] == "preempted"


async def test_cordoning_a_site_is_on_the_stream_and_so_is_giving_it_back(client: TestClient):
    name = SITE["name"]
    async with Stream(client, "?type=site", last_id=0) as stream:
        await stream.saw(health(name, "healthy"))
        assert (await client.post(f"/v1/sites/{name}/cordon", json={"reason": "rack move"})).status == 200
        cordoned = await stream.saw(health(name, "cordoned"))
        assert (await client.post(f"/v1/sites/{name}/uncordon")).status == 200
        back = (await stream.until(health(name, "healthy")))[-1]
    assert cordoned["data"]["previous"] == "healthy" and cordoned["data"]["reason"] == "rack move"
    assert back["data"]["previous"] == "cordoned" and back["id"] > cordoned["id"]
