"""Tenant limits changed live (``PUT|DELETE /v1/tenants/{tenant}/limit``, :mod:`broker.limits`) against a live broker
with a simulated site: a raised limit starts the tenant's queued jobs without a restart, a lowered one stops nothing,
an override outlives a restart and DELETE goes back to the configuration's; bad input is a 422 naming the field; a
replica that does not lead checks submissions against the overrides in the shared store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from broker import limits as live_limits
from broker.api import create_app
from broker.clock import SystemClock
from broker.config import BrokerSettings, ReplicaSettings
from broker.service import Broker
from broker.store import LimitOverride
from broker.store.memory import MemoryStore
from policies.tenant_limit import TenantLimits
from tests.test_api import register, site_body, wait_for

CONFIG_LIMITS = {"tenant_limits": {"t1": {"gpus": 2}}}


def settings(db: Path | str, **more: Any) -> BrokerSettings:
    # A long interval: a job that starts after a change started because the change woke the cycle, not because the
    # interval came round.
    return BrokerSettings(db=str(db), cycle_interval_s=30.0, shutdown_grace_s=1, **{**CONFIG_LIMITS, **more})


class Live:
    """A broker on an SQLite file with one simulated site of 8 GPUs, and its HTTP client; ``restart`` starts a new
    broker on the same file (the site is in the store)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.broker: Broker | None = None
        self.client: TestClient | None = None

    async def start(self, register_site: bool = True) -> TestClient:
        self.broker = Broker(settings(self.db))
        await self.broker.start([])
        self.client = TestClient(TestServer(create_app(self.broker)))
        await self.client.start_server()
        if register_site:
            await register(self.client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
        return self.client

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.broker is not None:
            await self.broker.stop()
        self.client = self.broker = None

    async def restart(self) -> TestClient:
        await self.stop()
        return await self.start(register_site=False)


@pytest.fixture
async def live(tmp_path: Path):
    h = Live(tmp_path / "limits.db")
    await h.start()
    yield h
    await h.stop()


async def submit(client: TestClient, gpus: float = 1, tenant: str = "t1", name: str = "j", status: int = 201) -> Any:
    r = await client.post("/v1/jobs", json={"tenant": tenant, "name": name, "gpus": {"count": gpus},
                                            "duration_s": 3600})
    assert r.status == status, await r.text()
    return await r.json()


async def row(client: TestClient, tenant: str) -> dict[str, Any]:
    r = await client.get(f"/v1/tenants?tenant={tenant}")
    assert r.status == 200, await r.text()
    [item] = (await r.json())["items"]
    return item


async def put_limit(client: TestClient, tenant: str, gpus: Any) -> dict[str, Any]:
    r = await client.put(f"/v1/tenants/{tenant}/limit", json={"gpus": gpus})
    assert r.status == 200, await r.text()
    return await r.json()


async def waiting_reason(client: TestClient, job_id: str) -> str:
    for _ in range(200):
        r = await client.get(f"/v1/jobs/{job_id}/decision")
        if r.status == 200:
            return (await r.json())["sites"][0]["reasons"][0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} was never decided")


async def test_a_raised_limit_starts_the_tenants_queued_job_at_once_without_a_restart(live: Live):
    c = live.client
    assert c is not None
    first = await submit(c, 2, name="first")
    await wait_for(c, first["id"], {"running"})
    second = await submit(c, 2, name="second")
    assert "may hold at most 2 (broker.tenant_limits)" in await waiting_reason(c, second["id"])
    assert (await (await c.get(f"/v1/jobs/{second['id']}")).json())["state"] == "queued"
    answer = await put_limit(c, "t1", 4)
    assert answer == {"tenant": "t1", "gpus_held": 2.0, "jobs": {"queued": 1, "running": 1}, "gpus_limit": 4.0,
                      "limit_source": "override"}
    # (the interval is 30 s: the change's own pass starts it)
    await wait_for(c, second["id"], {"running"}, timeout_s=5)
    assert (await row(c, "t1"))["gpus_held"] == 4.0


async def test_a_lowered_limit_keeps_running_jobs_running_and_holds_new_ones(live: Live):
    c = live.client
    assert c is not None
    running = [await submit(c, 1, name=f"run-{i}") for i in range(2)]
    for job in running:
        await wait_for(c, job["id"], {"running"})
    assert (await put_limit(c, "t1", 1))["gpus_limit"] == 1.0
    held = await submit(c, 1, name="held")
    why = await waiting_reason(c, held["id"])
    assert why == ("tenant-limit: tenant t1 holds 2 GPUs across the federation and may hold at most 1 (set through "
                   "PUT /v1/tenants/t1/limit); the job needs 1"), why
    too_big = await submit(c, 2, name="too-big", status=422)
    assert too_big["error"]["fields"] == [{"field": "gpus", "problem": (
        "the job holds 2 GPUs, and tenant t1 may hold at most 1 across the federation (set through PUT "
        "/v1/tenants/t1/limit)")}]
    await asyncio.sleep(0.3)  # passes go by: nothing is stopped for the lower limit
    for job in running:
        assert (await (await c.get(f"/v1/jobs/{job['id']}")).json())["state"] == "running"
    assert (await (await c.get(f"/v1/jobs/{held['id']}")).json())["state"] == "queued"
    assert (await put_limit(c, "t1", 0))["gpus_limit"] == 0.0  # none may start: still nothing stops


async def test_an_override_outlives_a_restart_and_delete_goes_back_to_the_configs_limit(live: Live):
    c = live.client
    assert c is not None
    await put_limit(c, "t1", 6.5)
    await put_limit(c, "t2", None)  # a tenant of the default (none here): unlimited, said so
    await put_limit(c, "t3", 3)
    c = await live.restart()
    assert await row(c, "t1") == {"tenant": "t1", "gpus_held": 0.0, "jobs": {}, "gpus_limit": 6.5,
                                  "limit_source": "override"}
    assert await row(c, "t2") == {"tenant": "t2", "gpus_held": 0.0, "jobs": {}, "limit_source": "override"}
    listed = (await (await c.get("/v1/tenants")).json())["items"]
    assert [t["tenant"] for t in listed] == ["t1", "t2", "t3"]  # each override names its tenant
    big = await submit(c, 6, name="fits-the-override")
    await wait_for(c, big["id"], {"running"})
    r = await c.delete("/v1/tenants/t1/limit")
    assert r.status == 200 and await r.json() == {"tenant": "t1", "gpus_held": 6.0, "jobs": {"running": 1},
                                                  "gpus_limit": 2.0, "limit_source": "config"}
    r = await c.delete("/v1/tenants/t3/limit")
    assert r.status == 200 and await r.json() == {"tenant": "t3", "gpus_held": 0.0, "jobs": {},
                                                  "limit_source": "default"}
    r = await c.delete("/v1/tenants/t3/limit")  # nothing left to delete
    assert r.status == 404 and "no limit set through the API" in (await r.json())["error"]["message"]
    c = await live.restart()  # the deletions were stored too
    assert (await row(c, "t1"))["limit_source"] == "config" and (await row(c, "t3"))["limit_source"] == "default"
    assert (await row(c, "t2"))["limit_source"] == "override"
    await submit(c, 3, name="past-the-config", status=422)


@pytest.mark.parametrize(("body", "field"), [
    pytest.param({"gpus": -1}, "gpus", id="a negative limit is refused naming gpus"),
    pytest.param({"gpus": 10_000_001}, "gpus", id="a limit above 10,000,000 GPUs is refused naming gpus"),
    pytest.param({"gpus": "4"}, "gpus", id="a limit as a string is refused naming gpus"),
    pytest.param({"gpus": True}, "gpus", id="a limit as a boolean is refused naming gpus"),
    pytest.param({}, "gpus", id="a body without gpus is refused naming gpus"),
    pytest.param({"gpus": 4, "site": "berlin"}, "site", id="a key the body does not take is refused naming it"),
    pytest.param(b'{"gpus": Infinity}', "gpus", id="an infinite limit is refused naming gpus"),
    pytest.param(b'{"gpus": NaN}', "gpus", id="a limit that is not a number is refused naming gpus"),
])
async def test_a_bad_limit_is_a_422_naming_the_field_and_changes_nothing(live: Live, body: Any, field: str):
    c = live.client
    assert c is not None
    if isinstance(body, bytes):
        r = await c.put("/v1/tenants/t1/limit", data=body, headers={"Content-Type": "application/json"})
    else:
        r = await c.put("/v1/tenants/t1/limit", json=body)
    error = (await r.json())["error"]
    assert r.status == 422 and [f["field"] for f in error["fields"]] == [field], error
    assert (await row(c, "t1"))["limit_source"] == "config"


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_a_name_that_is_not_a_tenants_is_a_422_naming_tenant(live: Live, method: str):
    c = live.client
    assert c is not None
    r = await c.request(method, "/v1/tenants/Not_A_Tenant/limit", json={"gpus": 1})
    error = (await r.json())["error"]
    assert r.status == 422 and [f["field"] for f in error["fields"]] == ["tenant"], error


def limits_scraped(text: str) -> dict[str, float]:
    return {s.labels["tenant"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "heliotrope_tenant_gpus_limit" for s in family.samples}


async def test_the_limit_metric_shows_a_limit_set_live(live: Live):
    c = live.client
    assert c is not None
    assert limits_scraped(await (await c.get("/metrics")).text()) == {"t1": 2.0}
    await put_limit(c, "t1", 12)
    await put_limit(c, "t9", 1.5)
    assert limits_scraped(await (await c.get("/metrics")).text()) == {"t1": 12.0, "t9": 1.5}
    await put_limit(c, "t1", None)  # unlimited: no sample
    assert limits_scraped(await (await c.get("/metrics")).text()) == {"t9": 1.5}


async def test_a_replica_that_does_not_lead_checks_submissions_against_the_overrides_in_the_store(
        monkeypatch: pytest.MonkeyPatch):
    """The leader stores the override; a follower, which takes submissions itself, reads it from the shared store
    (at first use, then at most every CACHE_S)."""
    monkeypatch.setattr(live_limits, "CACHE_S", 0.2)
    store = MemoryStore()
    await store.open()
    replicas = ReplicaSettings(lease_s=30.0)
    leader = Broker(BrokerSettings(db=":memory:", cycle_interval_s=0.05, shutdown_grace_s=1, replicas=replicas,
                                   **CONFIG_LIMITS), store=store)
    follower = Broker(BrokerSettings(db=":memory:", cycle_interval_s=0.05, shutdown_grace_s=1, replicas=replicas,
                                     **CONFIG_LIMITS), store=store)
    try:
        await leader.start([])
        leader.elect("http://127.0.0.1:1")
        for _ in range(100):
            if leader.in_charge:
                break
            await asyncio.sleep(0.05)
        assert leader.in_charge
        await follower.start([])
        follower.elect("http://127.0.0.1:2")
        await asyncio.sleep(0.2)
        assert not follower.in_charge
        await leader.set_tenant_limit("t1", 1)
        async with TestClient(TestServer(create_app(follower))) as c:
            refused = await submit(c, 2, name="over-the-override", status=422)
            assert "may hold at most 1 across the federation (set through PUT" in refused["error"]["message"]
            await leader.set_tenant_limit("t1", 8)
            await asyncio.sleep(0.3)  # past the follower's cache
            await submit(c, 2, name="within-the-raised-limit")
            await leader.reset_tenant_limit("t1")
            await asyncio.sleep(0.3)
            await submit(c, 3, name="past-the-config-again", status=422)
            assert limits_scraped(await (await c.get("/metrics")).text()) == {"t1": 2.0}
    finally:
        await follower.stop()
        await leader.stop()


@pytest.mark.parametrize(("limits", "tenant", "expected"), [
    pytest.param(TenantLimits({"a": 4}, 8, {"a": 2}), "a", (2, "override"), id="an override stands over the entry"),
    pytest.param(TenantLimits({"a": 4}, 8, {"a": None}), "a", (None, "override"),
                 id="a null override lifts the limit"),
    pytest.param(TenantLimits({"a": 4}, 8, {"b": 1}), "a", (4, "config"), id="another's override changes nothing"),
    pytest.param(TenantLimits({"a": 4}, 8), "c", (8, "default"), id="a tenant not named has the default"),
    pytest.param(TenantLimits({}, None), "c", (None, "default"), id="with no default, it is unlimited by default"),
])
def test_where_a_tenants_limit_comes_from(limits: TenantLimits, tenant: str, expected: tuple[Any, str]):
    assert (limits.of(tenant), limits.source(tenant)) == expected


def test_overrides_that_lift_every_limit_leave_no_limit_to_count():
    assert not TenantLimits({"a": 4}, None, {"a": None})
    assert TenantLimits({"a": 4}, None, {"b": None})
    assert TenantLimits({}, None, {"b": 0})


class GatedStore(MemoryStore):
    """A memory store whose next read of the overrides, once ``gate`` is armed, reads them and then waits for it
    to open before answering (a slow read on a loaded database)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.reading = asyncio.Event()

    async def list_tenant_limits(self) -> list[LimitOverride]:
        read = await super().list_tenant_limits()
        gate, self.gate = self.gate, None
        if gate is not None:
            self.reading.set()
            await gate.wait()
        return read


async def test_a_followers_read_that_comes_back_after_it_took_charge_and_changed_a_limit_is_not_held():
    """A submission on a replica not yet in charge reads the overrides; before the read comes back, the replica
    takes charge (loading them) and an admin raises t1's limit there. The old read must not undo the change in what
    the broker answers and enforces (GET /v1/tenants, the submission check, the next change's limits)."""
    store = GatedStore()
    await store.open()
    limits = live_limits.LiveTenantLimits(TenantLimits({"t1": 2}), store, SystemClock())
    store.gate = gate = asyncio.Event()
    follower_read = asyncio.create_task(limits.refreshed())  # (a submission while it does not lead)
    await store.reading.wait()
    await limits.load()  # it takes charge
    await limits.put("t1", 6)  # and an admin raises t1's limit
    gate.set()
    await follower_read
    assert limits.current.of("t1") == 6 and limits.current.source("t1") == "override"
    after = await limits.put("t2", 1)  # the next change keeps it
    assert after.of("t1") == 6 and after.of("t2") == 1


async def test_delete_removes_an_override_the_store_holds_though_this_broker_does_not(live: Live):
    """A PUT whose answer was lost though its write landed leaves the override in the store alone: DELETE removes it
    there (the next broker in charge would load it again otherwise) rather than answer 404."""
    c, broker = live.client, live.broker
    assert c is not None and broker is not None
    await broker.store.put_tenant_limit(LimitOverride("t1", 7.0, broker.clock.now()))
    r = await c.delete("/v1/tenants/t1/limit")
    assert r.status == 200, await r.text()
    assert (await r.json())["limit_source"] == "config"
    c = await live.restart()
    assert (await row(c, "t1"))["gpus_limit"] == 2.0 and (await row(c, "t1"))["limit_source"] == "config"


async def test_a_limit_of_minus_zero_is_stored_and_shown_as_zero(live: Live):
    c = live.client
    assert c is not None
    r = await c.put("/v1/tenants/t1/limit", data=b'{"gpus": -0.0}', headers={"Content-Type": "application/json"})
    assert r.status == 200 and '"gpus_limit": 0.0' in await r.text(), await r.text()
    c = await live.restart()
    assert '"gpus_limit": 0.0' in await (await c.get("/v1/tenants?tenant=t1")).text()


@pytest.mark.parametrize(("source", "named"), [
    ("config", "broker.tenant_limits"), ("default", "broker.default_tenant_limit"),
    ("override", "set through PUT /v1/tenants/t1/limit")])
def test_a_job_held_by_its_tenants_limit_is_told_where_that_limit_is_set(source: str, named: str) -> None:
    from types import SimpleNamespace

    from policies.filters.tenant_limit import TenantLimitFilter

    view = SimpleNamespace(tenant_limit=[4, 3.5], tenant_limit_source=source)  # (as the decision's record gives it)
    why = TenantLimitFilter().describe(SimpleNamespace(tenant="t1", charge=1.0), view, 0)  # type: ignore[arg-type]
    assert why == f"tenant t1 holds 3.5 GPUs across the federation and may hold at most 4 ({named}); the job needs 1"
