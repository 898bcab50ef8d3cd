"""Live events (``GET /v1/events``, ``heliotrope watch``): every transition of a job, in order; filters;
resuming with Last-Event-ID; a stalled client cut off; streams ended at shutdown. Reads are bounded: each
waits for a known event with a timeout, never for the stream's end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer

from broker import events as events_module
from broker.api import create_app
from broker.client import Client
from broker.config import BrokerSettings
from broker.events import EventHub
from broker.service import Broker
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

    def __init__(self, client: TestClient, query: str = "", last_id: int | None = None) -> None:
        self.client, self.query, self.last_id = client, query, last_id
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __aenter__(self) -> Stream:
        headers = {"Last-Event-ID": str(self.last_id)} if self.last_id is not None else {}
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
        return await asyncio.wait_for(self.events.get(), timeout_s)

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
