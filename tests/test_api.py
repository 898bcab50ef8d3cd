"""The HTTP API against a live broker with simulated sites (system clock, fast dispatch)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from broker.api import create_app
from broker.config import BrokerSettings
from broker.protocol_errors import BrokerRunner
from broker.service import Broker

MINIMAL = {"tenant": "t1", "name": "train-1", "gpus": {"count": 1}, "duration_s": 60}


def site_body(name: str, region: str, gpus: dict[str, int], **more: Any) -> dict[str, Any]:
    return {
        "name": name, "region": region, "grid_zone": "DE-LU", "timezone": "Europe/Berlin",
        "latitude": 50.1, "longitude": 8.7,
        "gpus": [{"model": m, "gpus_per_node": min(n, 8), "nodes": max(1, n // 8)} for m, n in gpus.items()],
        "adapter": {"kind": "simulated", "dispatch_delay_s": 0.005},
        **more,
    }


@pytest.fixture
async def client(tmp_path: Path):
    settings = BrokerSettings(db=str(tmp_path / "api.db"), cycle_interval_s=0.05, max_body_bytes=64 * 1024,
                              shutdown_grace_s=1)
    broker = Broker(settings)
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        c.broker = broker  # type: ignore[attr-defined]
        yield c
    await broker.stop()


async def wait_for(client: TestClient, job_id: str, states: set[str], timeout_s: float = 10) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        job = await (await client.get(f"/v1/jobs/{job_id}")).json()
        if job["state"] in states:
            return job
        if loop.time() > deadline:
            raise AssertionError(f"job {job_id} stayed {job['state']}, expected one of {states}")
        await asyncio.sleep(0.02)


async def register(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post("/v1/sites", json=body)
    assert r.status == 201, await r.text()
    return await r.json()


# --- sites ---


async def test_a_site_is_registered_listed_updated_and_removed(client: TestClient):
    created = await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}))
    assert created["status"]["health"] == "healthy"
    assert created["status"]["capacity"][0]["free_gpus"] == 16

    again = await client.post("/v1/sites", json=site_body("berlin", "gcp:europe-west3", {"l4": 8}))
    assert again.status == 409
    assert (await again.json())["error"]["fields"][0]["field"] == "name"

    listed = await (await client.get("/v1/sites")).json()
    assert [s["name"] for s in listed["items"]] == ["berlin"] and listed["next"] is None

    priced = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, usd_per_gpu_hour={"a100-80gb": 6.5})
    r = await client.put("/v1/sites/berlin", json=priced)
    assert r.status == 200 and (await r.json())["usd_per_gpu_hour"] == {"a100-80gb": 6.5}

    wrong = await client.put("/v1/sites/berlin", json=site_body("paris", "gcp:europe-west9", {"l4": 8}))
    assert wrong.status == 422

    assert (await client.delete("/v1/sites/berlin")).status == 204
    gone = await client.get("/v1/sites/berlin")
    assert gone.status == 404 and "no site named berlin" in (await gone.json())["error"]["message"]


async def test_names_of_sites_registered_and_removed_do_not_pile_up_in_the_brokers_site_locks(client: TestClient):
    # One lock per site orders its changes; a platform that registers and removes short-lived sites (or a
    # script that retries refused registrations under fresh names) must not grow the broker's table for ever.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}))
    for i in range(60):
        await register(client, site_body(f"burst-{i}", "gcp:europe-west3", {"a100-80gb": 8}))
        assert (await client.delete(f"/v1/sites/burst-{i}")).status == 204
        refused = await client.post("/v1/sites", json=site_body(f"bad-{i}", "nowhere:region", {"a100-80gb": 8}))
        assert refused.status == 422
    locks = client.broker._site_locks
    assert len(locks) <= 2 * 1 + 16 and "berlin" in locks
    # the site still there keeps its lock, and its changes still work
    assert (await client.put("/v1/sites/berlin", json=site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))).status == 200


async def test_a_finished_job_past_the_retention_is_gone_and_its_404_says_why(client: TestClient):
    from broker.models import Job, JobSpec, JobState
    long_ago = datetime.now(UTC) - timedelta(days=31)
    old = Job(id="01old0000000000000", spec=JobSpec(tenant="t1", name="old", gpus={"count": 1}, duration_s=60),
              created_at=long_ago, updated_at=long_ago)
    await client.broker.store.insert_job(old)
    await client.broker.store.update_job(old.transition(JobState.CANCELLED, long_ago), old.version)
    assert (await client.get(f"/v1/jobs/{old.id}")).status == 200
    await client.broker.prune_ended()  # (unless the loop's housekeeping came first) ended 31 days ago; 30 are kept
    assert client.broker.metrics.registry.get_sample_value("heliotrope_jobs_pruned_total") == 1
    r = await client.get(f"/v1/jobs/{old.id}")
    assert r.status == 404
    assert "deleted 720 h after it ended: broker.job_retention_h" in (await r.json())["error"]["message"]
    assert (await client.get("/v1/jobs")).status == 200 and (await (await client.get("/v1/jobs")).json())["items"] == []


async def test_a_site_sent_back_as_read_is_refused_naming_the_brokers_keys_not_as_misspellings(client: TestClient):
    # The README: PUT takes "a site as read, less its status and signals, which are the broker's and refused in
    # a spec". Whoever sends the whole site back must learn to leave those out, not to check their spelling.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}))
    read = await (await client.get("/v1/sites/berlin")).json()
    for method in (client.put, client.post):
        r = await method("/v1/sites/berlin" if method == client.put else "/v1/sites", json={**read, "typo": 1})
        assert r.status == 422
        problems = {f["field"]: f["problem"] for f in (await r.json())["error"]["fields"]}
        assert set(problems) == {"status", "signals", "typo"}
        assert problems["typo"] == "unknown field (check the spelling)"
        for key in ("status", "signals"):
            assert "the broker's: leave it out of a spec" in problems[key] and "spelling" not in problems[key]
    spec = {k: v for k, v in read.items() if k not in ("status", "signals")}
    assert (await client.put("/v1/sites/berlin", json=spec)).status == 200


async def test_a_site_with_active_jobs_cannot_be_removed(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 600})).json()
    await wait_for(client, job["id"], {"running"})
    r = await client.delete("/v1/sites/berlin")
    assert r.status == 409 and "1 active jobs" in (await r.json())["error"]["message"]


async def test_a_site_update_that_would_rebuild_under_running_jobs_is_refused_naming_the_fields(client: TestClient):
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16})
    await register(client, body)
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 600, "gpus": {"count": 8}})).json()
    await wait_for(client, job["id"], {"running"})
    fewer = {**site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}),
             "fair_share": {"mode": "instant"}}
    r = await client.put("/v1/sites/berlin", json=fewer)
    assert r.status == 409
    assert [f["field"] for f in (await r.json())["error"]["fields"]] == ["gpus", "fair_share"]
    # what routing alone reads changes under running jobs; the job runs on where it ran
    moved = {**body, "region": "gcp:europe-west4", "grid_zone": "NL", "timezone": "Europe/Amsterdam",
             "usd_per_gpu_hour": {"a100-80gb": 2.0}}
    assert (await client.put("/v1/sites/berlin", json=moved)).status == 200
    again = await (await client.get(f"/v1/jobs/{job['id']}")).json()
    assert (again["state"], again["site"], again["attempt"]) == ("running", "berlin", 1)


async def test_a_site_update_whose_quotas_the_site_does_not_take_changes_nothing(client: TestClient):
    """A site that does not answer the quota changes of a PUT: 503 naming ``quotas``, and neither the broker
    nor its store takes the spec (a refused spec must not come back at the next start); sent again once the
    site answers, it is taken."""
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=[{"tenant": "t1", "guaranteed_gpus": 4}])
    await register(client, body)
    member = client.broker.federation.get("berlin")
    member.adapter.set_reachable(False)
    changed = {**body, "quotas": [{"tenant": "t1", "guaranteed_gpus": 8}], "usd_per_gpu_hour": {"a100-80gb": 3.0}}
    r = await client.put("/v1/sites/berlin", json=changed)
    assert r.status == 503, await r.text()
    error = (await r.json())["error"]
    assert error["fields"] == [{"field": "quotas", "problem": "the site did not take them"}]
    assert "the site's spec is unchanged" in error["message"] and "adapter could not start" not in error["message"]
    stored = {s.name: s for s in await client.broker.store.list_sites()}["berlin"]
    for spec in (member.spec, stored):
        assert [q.guaranteed_gpus for q in spec.quotas] == [4] and spec.usd_per_gpu_hour == {}

    member.adapter.set_reachable(True)
    r = await client.put("/v1/sites/berlin", json=changed)
    assert r.status == 200 and (await r.json())["quotas"][0]["guaranteed_gpus"] == 8
    stored = {s.name: s for s in await client.broker.store.list_sites()}["berlin"]
    assert [q.guaranteed_gpus for q in stored.quotas] == [4 * 2] and stored.usd_per_gpu_hour == {"a100-80gb": 3.0}


async def test_a_cordon_made_while_an_update_is_under_way_keeps_the_update(client: TestClient):
    """A cordon copied the site's spec before it waited for an update under way (here the site takes its time
    over the quota change), then wrote that copy back: the update was answered 200 and then undone, its
    prices gone and the old quota passed to the site again."""
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=[{"tenant": "t1", "guaranteed_gpus": 4}])
    await register(client, body)
    adapter = client.broker.federation.get("berlin").adapter
    release = asyncio.Event()
    set_quota = adapter.set_quota

    async def slow_set_quota(quota):
        await release.wait()
        return await set_quota(quota)

    adapter.set_quota = slow_set_quota
    changed = {**body, "usd_per_gpu_hour": {"a100-80gb": 3.0}, "quotas": [{"tenant": "t1", "guaranteed_gpus": 8}]}
    update = asyncio.ensure_future(client.put("/v1/sites/berlin", json=changed))
    while not client.broker.site_lock("berlin").locked():
        await asyncio.sleep(0)
    cordon = asyncio.ensure_future(client.post("/v1/sites/berlin/cordon", json={"reason": "driver upgrade"}))
    while not client.broker.site_lock("berlin")._waiters:  # the cordon's request reaches the broker and waits for the update
        await asyncio.sleep(0)
    release.set()
    assert (await update).status == 200 and (await cordon).status == 200
    site = await (await client.get("/v1/sites/berlin")).json()
    assert site["cordoned"] is True and site["cordon_reason"] == "driver upgrade"
    assert site["usd_per_gpu_hour"] == {"a100-80gb": 3.0} and site["quotas"][0]["guaranteed_gpus"] == 8
    quota = await (await client.get("/v1/sites/berlin/quota")).json()
    assert {t["tenant"]: t["guaranteed_gpus"] for t in quota["tenants"]}["t1"] == 8


async def test_a_site_change_made_while_the_files_quotas_are_passed_is_not_undone_by_them(client: TestClient):
    """The housekeeping passes the quotas the config file changed while the broker was down (the site could not
    take them at start) beside the API: a PUT made while it waited on the site was answered 200, and then the
    file's older quota for the same tenant reached the site after it, which enforced that while its spec said
    the PUT's."""
    from broker.models import TenantQuota

    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=[
        {"tenant": "t1", "guaranteed_gpus": 4}, {"tenant": "t2", "guaranteed_gpus": 4}])
    await register(client, body)
    broker = client.broker
    adapter = broker.federation.get("berlin").adapter
    entered, release = asyncio.Event(), asyncio.Event()
    set_quota = adapter.set_quota

    async def slow_set_quota(quota):
        if not entered.is_set():  # (the first: the file's change, which the site takes its time over)
            entered.set()
            await release.wait()
        return await set_quota(quota)

    adapter.set_quota = slow_set_quota
    # the file raised both guarantees from 2 while the broker was down, and the site has not taken them yet
    broker._quota_passes = {"berlin": {t: TenantQuota(tenant=t, guaranteed_gpus=2) for t in ("t1", "t2")}}
    passing = asyncio.ensure_future(broker._settle())
    await asyncio.wait_for(entered.wait(), 5)
    changed = {**body, "quotas": [{"tenant": "t1", "guaranteed_gpus": 4}, {"tenant": "t2", "guaranteed_gpus": 8}]}
    update = asyncio.ensure_future(client.put("/v1/sites/berlin", json=changed))
    await asyncio.sleep(0.2)
    release.set()
    assert (await asyncio.wait_for(update, 10)).status == 200
    await asyncio.wait_for(passing, 10)
    quota = await (await client.get("/v1/sites/berlin/quota")).json()
    assert {t["tenant"]: t["guaranteed_gpus"] for t in quota["tenants"]} == {"t1": 4, "t2": 8}


async def test_a_cordoned_site_takes_no_new_job_keeps_what_runs_and_takes_work_again_when_uncordoned(
        client: TestClient, tmp_path: Path):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    running = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "before", "duration_s": 600})).json()
    await wait_for(client, running["id"], {"running"})

    r = await client.post("/v1/sites/berlin/cordon", json={"reason": "driver upgrade"})
    assert r.status == 200, await r.text()
    site = await r.json()
    assert site["cordoned"] is True and site["cordon_reason"] == "driver upgrade"
    waiting = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "after"})).json()
    await asyncio.sleep(0.3)  # several passes
    assert (await (await client.get(f"/v1/jobs/{waiting['id']}")).json())["state"] == "queued"
    decision = await (await client.get(f"/v1/jobs/{waiting['id']}/decision")).json()
    reasons = {s["site"]: s["reasons"] for s in decision["sites"]}
    assert reasons["berlin"] == ["site-cordoned: its operator cordoned the site: it takes no new jobs until "
                                 "uncordoned"], reasons
    assert (await (await client.get(f"/v1/jobs/{running['id']}")).json())["state"] == "running"  # runs on

    # Kept in the stored spec: a restarted broker still holds the site out of routing.
    assert (await client.get("/v1/sites/berlin")).status == 200
    stored = await client.broker.store.list_sites()  # type: ignore[attr-defined]
    assert [s.cordoned for s in stored if s.name == "berlin"] == [True]

    r = await client.post("/v1/sites/berlin/uncordon")
    assert r.status == 200 and (await r.json())["cordoned"] is False
    await wait_for(client, waiting["id"], {"running", "succeeded"})

    assert (await client.post("/v1/sites/nowhere/cordon")).status == 404
    bad = await client.post("/v1/sites/berlin/cordon", json={"reason": 7})
    assert bad.status == 422 and (await bad.json())["error"]["fields"][0]["field"] == "reason"


@pytest.mark.parametrize(("raw", "status", "field", "problem"), [
    pytest.param(b'{"reason": "upgrade done"}', 422, "reason", "an uncordon takes no reason",
                 id="a reason sent to uncordon is refused by name, not dropped without a word"),
    pytest.param(b'{"reasn": "x"}', 422, "reasn", "unknown field", id="a misspelt key is named"),
    pytest.param(b'{x', 400, "(body)", "", id="a body that is no JSON is a 400, as for every other route"),
])
async def test_an_uncordon_with_a_body_it_does_not_take_changes_nothing_and_says_why(
        client: TestClient, raw: bytes, status: int, field: str, problem: str):
    # Uncordon never read its body: '{x' and {"reason": ...} answered 200 and uncordoned the site.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    assert (await client.post("/v1/sites/berlin/cordon", json={"reason": "driver upgrade"})).status == 200
    r = await client.post("/v1/sites/berlin/uncordon", data=raw, headers={"Content-Type": "application/json"})
    error = (await r.json())["error"]
    assert r.status == status and error["fields"][0]["field"] == field and problem in error["fields"][0]["problem"]
    assert (await (await client.get("/v1/sites/berlin")).json())["cordoned"] is True  # still cordoned
    r = await client.post("/v1/sites/berlin/uncordon", json={})  # an empty object is no change of meaning
    assert r.status == 200 and (await r.json())["cordoned"] is False


async def test_a_site_from_the_configuration_file_stays_cordoned_across_a_restart(tmp_path: Path):
    # The file's spec is written to the store at each start, but a cordon is the operator's act: a broker that
    # restarts must not send jobs to a site under maintenance. The file's other settings still win.
    from broker.config import BrokerSettings
    from broker.service import Broker
    from tests.builders import site

    settings = BrokerSettings(db=str(tmp_path / "b.db"), shutdown_grace_s=0.1)
    configured = site("berlin", usd_per_gpu_hour={"a100-80gb": 2.0})
    broker = Broker(settings)
    await broker.start([configured], run_loop=False)
    try:
        member = broker.federation.get("berlin")
        await broker.update_site(member.spec.model_copy(update={"cordoned": True, "cordon_reason": "driver upgrade"}))
    finally:
        await broker.stop()
    edited = site("berlin", usd_per_gpu_hour={"a100-80gb": 3.0})  # the file changed meanwhile
    again = Broker(settings)
    await again.start([edited], run_loop=False)
    try:
        spec = again.federation.get("berlin").spec
        assert (spec.cordoned, spec.cordon_reason) == (True, "driver upgrade")
        assert spec.usd_per_gpu_hour == {"a100-80gb": 3.0}
        uncordoned = await again.update_site(spec.model_copy(update={"cordoned": False, "cordon_reason": None}))
        assert not uncordoned.spec.cordoned
    finally:
        await again.stop()
    third = Broker(settings)
    await third.start([edited], run_loop=False)
    try:
        assert not third.federation.get("berlin").spec.cordoned  # uncordoned stays so
    finally:
        await third.stop()


async def test_a_hundred_jobs_land_on_sites_that_have_the_model_they_asked_for(client: TestClient):
    inventories = {
        "ashburn": ("gcp:us-east4", {"h100-80gb": 16, "a100-80gb": 8}),
        "tokyo": ("gcp:asia-northeast1", {"a100-40gb": 16}),
        "sydney": ("gcp:australia-southeast1", {"l4": 16}),
    }
    for name, (region, gpus) in inventories.items():
        await register(client, site_body(name, region, gpus))
    models = [None, "h100-80gb", "a100-80gb", "a100-40gb", "l4"]
    ids = []
    for i in range(100):
        model = models[i % len(models)]
        gpus = {"count": 1 + i % 2} | ({"model": model} if model else {})
        r = await client.post("/v1/jobs", json={"tenant": "t1", "name": f"job-{i}", "gpus": gpus, "duration_s": 0.2})
        assert r.status == 201
        ids.append((await r.json())["id"])

    jobs = [await wait_for(client, job_id, {"succeeded"}, timeout_s=30) for job_id in ids]
    for job in jobs:
        model = job["spec"]["gpus"]["model"]
        owned = inventories[job["site"]][1]
        assert model is None or model in owned, f"{job['id']} asked for {model} and ran on {job['site']}"
    # And no site ever ran more GPUs of a model than it has: every decision saw the GPUs free.
    per_site = defaultdict(int)
    for job in jobs:
        decision = await (await client.get(f"/v1/jobs/{job['id']}/decision")).json()
        assert decision["outcome"] == "placed" and decision["site"] == job["site"]
        per_site[job["site"]] += 1
    assert set(per_site) == set(inventories)


async def test_a_job_no_site_can_fit_stays_queued_and_its_decision_names_every_sites_reason(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    await register(client, site_body("oregon", "gcp:us-west1", {"l4": 8}))
    r = await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 4, "model": "h100-80gb"}})
    job = await r.json()
    decision = None
    for _ in range(200):
        d = await client.get(f"/v1/jobs/{job['id']}/decision")
        if d.status == 200:
            decision = await d.json()
            break
        await asyncio.sleep(0.02)
    assert decision is not None
    assert (await (await client.get(f"/v1/jobs/{job['id']}")).json())["state"] == "queued"
    assert decision["outcome"] == "unplaceable"
    assert {s["site"]: s["reasons"] for s in decision["sites"]} == {
        "berlin": ["gpus-do-not-fit: site has no h100-80gb"],
        "oregon": ["gpus-do-not-fit: site has no h100-80gb"],
    }


async def test_a_job_whose_latency_objective_no_site_meets_is_told_each_sites_round_trip(client: TestClient):
    # The reason used to be the same at every site, "the RTT from gcp:us-east1 is over the job's latency objective
    # of 5 ms (or not measured)": neither how far over, nor whether it was measured at all.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, rtt_ms={"gcp:us-east1": 96.3}))
    await register(client, site_body("oregon", "gcp:us-west1", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "latency_slo_ms": 5,
                                                     "origin_region": "gcp:us-east1"})).json()
    for _ in range(200):
        if (d := await client.get(f"/v1/jobs/{job['id']}/decision")).status == 200:
            break
        await asyncio.sleep(0.02)
    decision = await d.json()
    assert decision["outcome"] == "unplaceable"
    assert {s["site"]: s["reasons"] for s in decision["sites"]} == {
        "berlin": ["latency-objective: the RTT from gcp:us-east1 is 96.3 ms, over the job's latency objective of 5 ms"],
        "oregon": ["latency-objective: no RTT from gcp:us-east1 to this site is measured, so it cannot show that it "
                   "meets the job's latency objective of 5 ms"],
    }


async def test_a_site_with_no_price_is_explained_with_what_it_was_ranked_as_so_the_normalised_values_add_up(
        client: TestClient):
    # An unknown raw value is given as null, but the decision ranked the site as one more than the worst known
    # value, and normalised every site's value with it: from the raw values given (3 and 5 USD), berlin's 1 and
    # paris's 0.333 could not be worked out again.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, usd_per_gpu_hour={"a100-80gb": 3.0}))
    await register(client, site_body("oslo", "gcp:europe-north1", {"a100-80gb": 8}))
    await register(client, site_body("paris", "gcp:europe-west9", {"a100-80gb": 8}, usd_per_gpu_hour={"a100-80gb": 5.0}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 3600, "profile": "cheap"})).json()
    await wait_for(client, job["id"], {"running"})  # (dispatching: its decision may still be on its way to disk)
    decision = await (await client.get(f"/v1/jobs/{job['id']}/decision")).json()
    cost = {s["site"]: next(t for t in s["terms"] if t["scorer"] == "cost") for s in decision["sites"]}
    assert {site: (t["raw"], t.get("ranked_as")) for site, t in cost.items()} == {
        "berlin": (3.0, None), "oslo": (None, 6.0), "paris": (5.0, None)}
    ranked = {site: t["raw"] if t["raw"] is not None else t["ranked_as"] for site, t in cost.items()}
    for site, t in cost.items():  # lower is better: (worst - value) / (worst - best)
        assert t["normalised"] == pytest.approx((6.0 - ranked[site]) / (6.0 - 3.0))
    assert "ranked_as" not in next(t for t in cost.values() if t["raw"] is not None)  # only where it was unknown



async def test_a_price_no_gpu_could_cost_is_refused_naming_it_rather_than_make_every_score_nan(client: TestClient):
    # 1e308 USD per GPU-hour was taken: a job's cost there (price x GPUs x seconds) came out infinite, every
    # site's score NaN ("placed on london (h100-80gb, score nan)"), and the job went to whichever site came first.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8},
                                     usd_per_gpu_hour={"a100-80gb": 3.0}))
    huge = site_body("paris", "gcp:europe-west9", {"a100-80gb": 8}, usd_per_gpu_hour={"a100-80gb": 1e308})
    r = await client.post("/v1/sites", json=huge)
    assert r.status == 422, await r.text()
    fields = (await r.json())["error"]["fields"]
    assert fields[0]["field"] == "usd_per_gpu_hour" and "a100-80gb: 1e+308 USD per GPU-hour is more than" in \
        fields[0]["problem"], fields
    r = await client.put("/v1/sites/berlin", json={**huge, "name": "berlin"})
    assert r.status == 422 and (await r.json())["error"]["fields"][0]["field"] == "usd_per_gpu_hour"
    assert (await (await client.get("/v1/sites/berlin")).json())["usd_per_gpu_hour"] == {"a100-80gb": 3.0}
    await register(client, site_body("paris", "gcp:europe-west9", {"a100-80gb": 8},
                                     usd_per_gpu_hour={"a100-80gb": 1_000_000.0}))  # the most a site may charge
    preview = await (await client.post("/v1/preview", json={**MINIMAL, "duration_s": 3600, "profile": "cheap"})).json()
    assert preview["decision"]["site"] == "berlin", preview["decision"]["summary"]
    assert all(s["score"] is not None for s in preview["decision"]["sites"] if s["feasible"])

async def test_a_job_cancelled_while_no_site_could_take_it_is_not_explained_as_still_queued(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 4, "model": "h100-80gb"}})).json()
    for _ in range(200):
        if (await client.get(f"/v1/jobs/{job['id']}/decision")).status == 200:
            break
        await asyncio.sleep(0.02)
    assert (await client.post(f"/v1/jobs/{job['id']}/cancel")).status == 200
    decision = await (await client.get(f"/v1/jobs/{job['id']}/decision")).json()
    assert decision["outcome"] == "unplaceable"
    assert decision["summary"] == ("no site can take the job now (1 gpus-do-not-fit); it waited, and then ended "
                                   "(cancelled: cancelled by request): it is decided no more")


async def test_a_job_cancelled_before_any_cycle_decided_it_is_not_promised_a_decision(tmp_path: Path):
    # Its 404 used to say that the next scheduling cycle decides it: no cycle decides a cancelled job.
    broker = Broker(BrokerSettings(db=str(tmp_path / "api.db"), shutdown_grace_s=1))
    await broker.start([], run_loop=False)
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            job = await (await c.post("/v1/jobs", json=MINIMAL)).json()
            r = await c.get(f"/v1/jobs/{job['id']}/decision")
            assert r.status == 404
            assert "the next scheduling cycle decides it" in (await r.json())["error"]["message"]
            assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status == 200
            r = await c.get(f"/v1/jobs/{job['id']}/decision")
            assert r.status == 404
            assert (await r.json())["error"]["message"] == (
                f"job {job['id']} was never decided: it ended before a scheduling cycle reached it "
                "(cancelled: cancelled by request)")
    finally:
        await broker.stop()


async def test_a_decision_a_later_release_recorded_is_refused_by_name_not_with_a_server_error(client: TestClient):
    # Replicas share the database, so during an upgrade an older one may read a record a newer one wrote.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json=MINIMAL)).json()
    await wait_for(client, job["id"], {"running", "succeeded"})
    store = client.broker.store  # type: ignore[attr-defined]
    stored = await store.get_decision(job["id"])
    await store.save_decision(job["id"], stored.attempt, {**stored.record, "v": 99})
    r = await client.get(f"/v1/jobs/{job['id']}/decision")
    assert r.status == 501
    message = (await r.json())["error"]["message"]
    assert "decision record version 99 is not one this release reads (2, 3)" in message
    assert "upgrade this replica" in message
    await store.save_decision(job["id"], stored.attempt, {**stored.record, "v": 1})  # no release still writes it
    r = await client.get(f"/v1/jobs/{job['id']}/decision")
    assert r.status == 501
    message = (await r.json())["error"]["message"]
    assert "decision record version 1 is not one this release reads" in message and "upgrade" not in message
    await store.save_decision(job["id"], stored.attempt, stored.record)  # what it wrote itself still explains
    assert (await (await client.get(f"/v1/jobs/{job['id']}/decision")).json())["site"] == "berlin"


async def test_a_cancelled_running_job_stops_and_gives_its_gpus_back(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 8}, "duration_s": 600})).json()
    await wait_for(client, job["id"], {"running"})
    r = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status == 200 and (await r.json())["state"] == "cancelled"
    again = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status == 409 and "already cancelled" in (await again.json())["error"]["message"]
    # The GPUs are free again: the next 8-GPU job runs.
    nxt = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "next", "gpus": {"count": 8}})).json()
    assert (await wait_for(client, nxt["id"], {"running", "succeeded"}))["site"] == "berlin"
    events = await (await client.get(f"/v1/jobs/{job['id']}/events")).json()
    assert [e["state"] for e in events["items"]][-1] == "cancelled"


async def test_a_job_that_asks_to_start_at_once_keeps_saying_so(client: TestClient):
    r = await client.post("/v1/jobs", json={**MINIMAL, "deferrable": False})
    assert r.status == 201, await r.text()
    job_id = (await r.json())["id"]
    got = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert got["spec"]["deferrable"] is False
    # the default is left out, so a spec that does not use it reads as earlier releases wrote it
    plain = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "plain"})).json()
    assert "deferrable" not in plain["spec"]


# --- bad input ---


@pytest.mark.parametrize(
    ("body", "status", "field", "problem"),
    [
        pytest.param({**MINIMAL, "gpus": {"count": "two"}}, 422, "gpus.count", "valid integer",
                     id="a GPU count that is not a number is refused"),
        pytest.param({**MINIMAL, "gpus": {"count": -1}}, 422, "gpus.count", "greater than or equal to 1",
                     id="a negative GPU count is refused"),
        pytest.param({**MINIMAL, "gpus": {"count": 1, "model": "a1000"}}, 422, "gpus.model", "unknown GPU model",
                     id="an unknown GPU model is refused"),
        pytest.param({**MINIMAL, "gpus": {"count": 1, "milli": 1500}}, 422, "gpus.milli", "less than or equal to 1000",
                     id="more than a whole GPU as a fraction is refused"),
        pytest.param({k: v for k, v in MINIMAL.items() if k != "tenant"}, 422, "tenant", "required",
                     id="a missing tenant is refused"),
        pytest.param({**MINIMAL, "gpu": {"count": 1}}, 422, "gpu", "unknown field",
                     id="a misspelt field is refused"),
        pytest.param({**MINIMAL, "duration_s": 0}, 422, "duration_s", "greater than 0",
                     id="a zero duration is refused"),
        pytest.param({**MINIMAL, "deadline": "2030-01-01T00:00:00"}, 422, "deadline", "timezone",
                     id="a deadline without a time zone is refused"),
        pytest.param([MINIMAL], 422, "(body)", "should be an object",
                     id="a list instead of one job is refused"),
        pytest.param({**MINIMAL, "deferrable": "later"}, 422, "deferrable", "valid boolean",
                     id="a deferrable that is not true or false is refused"),
        pytest.param({**MINIMAL, "max_lost_attempts": -1}, 422, "max_lost_attempts", "greater than or equal to 0",
                     id="a negative bound on lost attempts is refused"),
        pytest.param({**MINIMAL, "max_lost_attempts": 1001}, 422, "max_lost_attempts", "less than or equal to 1000",
                     id="a bound on lost attempts over 1000 is refused"),
        pytest.param({**MINIMAL, "max_lost_attempts": "ten"}, 422, "max_lost_attempts", "valid integer",
                     id="a bound on lost attempts that is not a number is refused"),
        # Checks of two fields together (the model's own validator) name the field to change, not "(body)"
        pytest.param({**MINIMAL, "latency_slo_ms": 50}, 422, "origin_region", "latency_slo_ms needs origin_region",
                     id="a latency objective without its origin region names origin_region"),
        pytest.param({**MINIMAL, "allowed_regions": ["gcp:us-east1"], "denied_regions": ["gcp:us-east1"]}, 422,
                     "denied_regions", "regions both allowed and denied: gcp:us-east1",
                     id="a region both allowed and denied names denied_regions"),
        pytest.param({**MINIMAL, "gpus": {"count": 2, "milli": 500}}, 422, "gpus.count", "count must be 1",
                     id="a fraction of a GPU asked of two GPUs names gpus.count"),
        pytest.param({**MINIMAL, "gpus": {"count": 1, "shared": True}}, 422, "gpus.memory_gib",
                     "shared needs memory_gib", id="a shared GPU without the memory it takes names gpus.memory_gib"),
        pytest.param({**MINIMAL, "gpus": {"count": 1, "milli": 500, "mig_profile": "1g.10gb"}}, 422,
                     "gpus.mig_profile", "do not combine it with milli",
                     id="a MIG slice with a fraction names gpus.mig_profile"),
    ],
)
async def test_an_invalid_job_spec_gets_a_4xx_naming_the_field(client, body, status, field, problem):
    r = await client.post("/v1/jobs", json=body)
    assert r.status == status
    err = (await r.json())["error"]
    assert err["status"] == status
    assert any(f["field"] == field and problem in f["problem"] for f in err["fields"]), err


@pytest.mark.parametrize(
    ("more", "field", "problem"),
    [
        pytest.param({"quotas": [{"tenant": "t1"}, {"tenant": "t1"}]}, "quotas[1].tenant",
                     "each tenant may appear once; t1 appears at quotas[0] and quotas[1]",
                     id="a tenant's second quota names quotas[1].tenant"),
        pytest.param({"usd_per_gpu_hour": {"h100-80gb": 3.0}}, "usd_per_gpu_hour",
                     "prices h100-80gb, which no node group of this site has",
                     id="a price of a model the site lacks names usd_per_gpu_hour"),
        pytest.param({"fair_share": {"window_h": 2000, "reweight_h": 0.001}}, "fair_share.reweight_h",
                     "divides window_h (2000 h) into 2,000,000 periods", id="a reweight too often names reweight_h"),
        pytest.param({"adapter": {"kind": "kubernetes", "tolerations": [{"key": "a", "operator": "Exists",
                                                                         "value": "b"}]}},
                     "adapter.tolerations[0].value", "operator Exists takes no value",
                     id="a toleration's value with operator Exists names its value"),
        pytest.param({"adapter": {"kind": "kubernetes",
                                  "telemetry": {"kind": "prometheus", "url": "http://p:9090", "every_s": 60,
                                                "stale_after_s": 30}}},
                     "adapter.telemetry.stale_after_s", "is not longer than every_s",
                     id="telemetry stale before its next reading names stale_after_s"),
    ],
)
async def test_a_site_spec_whose_fields_disagree_gets_a_422_naming_the_field_to_change(client, more, field, problem):
    r = await client.post("/v1/sites", json=site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, **more))
    assert r.status == 422, await r.text()
    err = (await r.json())["error"]
    assert [f["field"] for f in err["fields"]] == [field], err
    assert problem in err["fields"][0]["problem"] and f"{field}: " in err["message"]


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        pytest.param(b'{"tenant": "t1", "name": ', 400, "malformed JSON", id="truncated JSON is a 400"),
        pytest.param(b"", 400, "must be a JSON job spec", id="an empty body is a 400"),
        pytest.param(b"\xff\xfe", 400, "malformed JSON", id="bytes that are not JSON are a 400"),
        pytest.param(b'{"pad": "' + b"x" * 70_000 + b'"}', 413, "larger than the limit", id="an oversized body is a 413"),
    ],
)
async def test_a_body_that_is_not_a_job_gets_a_clear_error_and_the_server_keeps_serving(client, raw, status, message):
    r = await client.post("/v1/jobs", data=raw, headers={"Content-Type": "application/json"})
    assert r.status == status
    assert message in (await r.json())["error"]["message"]
    assert (await client.get("/healthz")).status == 200
    ok = await client.post("/v1/jobs", json=MINIMAL)
    assert ok.status == 201


async def raw_exchange(port: int, request: bytes) -> tuple[int, str, bytes]:
    """``request`` sent as bytes to the server on ``port``: its status, content type and body (the connection
    ends after it: every request here asks for that or is refused)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("Content-Type", ""), body


def with_header(name: bytes, value: bytes) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + name + b": " + value + b"\r\n\r\n"


TOKEN = b"Bearer hlt_" + b"s3cret" * 1500  # 9,011 bytes, over aiohttp's 8,190 a header value


@pytest.mark.parametrize(
    ("request_bytes", "field", "problem"),
    [
        pytest.param(with_header(b"Authorization", TOKEN), "Authorization", "value longer than the limit of 8190 bytes",
                     id="an over-long bearer token is a JSON 400 naming Authorization"),
        pytest.param(with_header(b"X-Foo", b"x" * 9000), "X-Foo", "value longer than the limit of 8190 bytes",
                     id="any over-long header value is a JSON 400 naming its header"),
        pytest.param(with_header(b"X-" + b"F" * 9000, b"1"), "X-" + "F" * 62 + "...",
                     "name longer than the limit of 8190 bytes",
                     id="an over-long header name is a JSON 400 showing the start of the name"),
        pytest.param(b"GET /healthz?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "(request line)",
                     "longer than the limit of 8190 bytes", id="an over-long path and query is a JSON 400"),
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
                     + b"\r\n", "(headers)", "more than 128 headers", id="too many headers is a JSON 400"),
    ],
)
async def test_a_request_head_over_aiohttps_limits_gets_a_json_400_naming_the_header_and_one_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes, field: str, problem: str):
    broker = Broker(BrokerSettings(db=str(tmp_path / "api.db"), cycle_interval_s=0.05, shutdown_grace_s=1))
    await broker.start([])
    runner = BrokerRunner(create_app(broker), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            status, content_type, body = await raw_exchange(port, request_bytes)
        assert (status, content_type) == (400, "application/json; charset=utf-8"), body[:200]
        error = json.loads(body)["error"]
        assert error["status"] == 400
        assert error["fields"] == [{"field": field, "problem": ANY}]
        assert problem in error["fields"][0]["problem"] and problem in error["message"]
        refused = [r for r in caplog.records if "refused a request" in r.getMessage() or r.name == "aiohttp.server"]
        assert len(refused) == 1 and refused[0].exc_info is None and "\n" not in refused[0].getMessage(), refused
        assert b"s3cret" not in body and "s3cret" not in caplog.text  # the token is neither echoed nor logged
        # aiohttp's limits stay as they were: a header value of 8,190 bytes is taken
        status, _, _ = await raw_exchange(port, with_header(b"X-Foo", b"x" * 8190))
        assert status == 200
    finally:
        await runner.cleanup()
        await broker.stop()


@pytest.mark.parametrize(
    ("query", "field"),
    [
        pytest.param("state=sleeping", "state", id="an unknown state filter is a 400 naming state"),
        pytest.param("limit=0", "limit", id="a zero page size is a 400 naming limit"),
        pytest.param("limit=many", "limit", id="a page size that is not a number is a 400 naming limit"),
        pytest.param("cursor=bogus", "cursor", id="a made-up cursor is a 400 naming cursor"),
    ],
)
async def test_a_bad_list_query_gets_a_400_naming_the_parameter(client, query, field):
    r = await client.get(f"/v1/jobs?{query}")
    assert r.status == 400
    assert (await r.json())["error"]["fields"][0]["field"] == field


async def test_unknown_jobs_endpoints_and_methods_answer_json_errors(client: TestClient):
    r = await client.get("/v1/jobs/nope")
    assert r.status == 404 and "no job with id nope" in (await r.json())["error"]["message"]
    r = await client.get("/v1/nothing-here")
    assert r.status == 404 and (await r.json())["error"]["status"] == 404
    r = await client.patch("/v1/jobs")
    assert r.status == 405 and "allowed" in (await r.json())["error"]["message"]


# --- idempotency, pagination, documents ---


async def test_a_repeated_idempotency_key_returns_the_first_job(client: TestClient):
    first = await client.post("/v1/jobs", json=MINIMAL, headers={"Idempotency-Key": "abc"})
    again = await client.post("/v1/jobs", json=MINIMAL, headers={"Idempotency-Key": "abc"})
    assert first.status == again.status == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert (await first.json())["id"] == (await again.json())["id"]
    listed = await (await client.get("/v1/jobs?tenant=t1")).json()
    assert len(listed["items"]) == 1


async def test_concurrent_submissions_with_one_key_create_one_job(client: TestClient):
    rs = await asyncio.gather(*(client.post("/v1/jobs", json=MINIMAL, headers={"Idempotency-Key": "k"}) for _ in range(20)))
    ids = {(await r.json())["id"] for r in rs}
    assert len(ids) == 1
    assert len((await (await client.get("/v1/jobs")).json())["items"]) == 1


async def test_a_retry_with_the_same_json_in_another_order_or_spacing_is_a_replay_not_a_conflict(
        client: TestClient):
    """A client that builds the body again for its retry (a map with another key order, another JSON
    library's spacing) was answered 409, "a different body", and could not learn whether its job was taken."""
    import json as _json

    body = {**MINIMAL, "name": "retried"}
    first = await client.post("/v1/jobs", data=_json.dumps(body), headers={
        "Idempotency-Key": "r1", "Content-Type": "application/json"})
    reordered = _json.dumps(dict(reversed(list(body.items()))), indent=2)
    again = await client.post("/v1/jobs", data=reordered, headers={
        "Idempotency-Key": "r1", "Content-Type": "application/json"})
    assert first.status == again.status == 201, await again.text()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert (await first.json())["id"] == (await again.json())["id"]


async def test_a_retry_that_writes_a_number_another_way_is_a_replay_not_a_conflict(client: TestClient):
    """A client whose serialiser writes 60 as 60.0 (or 6e1) on its retry sent the same job, and was answered
    409; a different number is still a different body."""
    import json as _json

    def post(duration: str, key: str = "n1"):
        text = _json.dumps({**MINIMAL, "name": "numbers", "duration_s": 0}).replace('"duration_s": 0',
                                                                                    f'"duration_s": {duration}')
        return client.post("/v1/jobs", data=text, headers={"Idempotency-Key": key, "Content-Type": "application/json"})

    first = await post("60")
    replays = [await post(written) for written in ("60.0", "6e1", "60.00")]
    assert first.status == 201 and all(r.status == 201 for r in replays), [await r.text() for r in replays]
    assert {(await r.json())["id"] for r in replays} == {(await first.json())["id"]}
    assert all(r.headers["Idempotent-Replayed"] == "true" for r in replays)
    assert (await post("60.5")).status == 409


async def test_a_key_stored_by_the_release_before_still_matches_a_retry_of_the_same_json(client: TestClient):
    """The release before kept the digest of the canonical JSON with its numbers as written."""
    import hashlib
    import json as _json

    from broker.models import JobSpec

    raw = _json.dumps({**MINIMAL, "name": "old", "duration_s": 60.0}).encode()
    canonical = _json.dumps(_json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    book = client.broker.book  # type: ignore[attr-defined]
    old = await book._create(JobSpec.model_validate_json(raw), "k-before",
                             hashlib.sha256(canonical.encode()).hexdigest())
    again = await client.post("/v1/jobs", data=_json.dumps(dict(reversed(_json.loads(raw).items()))),  # reordered
                              headers={"Idempotency-Key": "k-before", "Content-Type": "application/json"})
    assert again.status == 201 and (await again.json())["id"] == old.id


async def test_a_key_stored_by_an_earlier_release_still_matches_a_retry_of_the_same_bytes(client: TestClient):
    """Releases before this one kept the digest of the body's bytes; a retry across the upgrade is a replay."""
    import hashlib
    import json as _json

    from broker.models import JobSpec

    raw = _json.dumps({**MINIMAL, "name": "old"}).encode()
    book = client.broker.book  # type: ignore[attr-defined]
    old = await book._create(JobSpec.model_validate_json(raw), "k-old", hashlib.sha256(raw).hexdigest())
    again = await client.post("/v1/jobs", data=raw, headers={"Idempotency-Key": "k-old",
                                                            "Content-Type": "application/json"})
    assert again.status == 201 and (await again.json())["id"] == old.id


async def test_an_idempotency_key_reused_with_another_body_is_a_conflict(client: TestClient):
    await client.post("/v1/jobs", json=MINIMAL, headers={"Idempotency-Key": "abc"})
    r = await client.post("/v1/jobs", json={**MINIMAL, "name": "other"}, headers={"Idempotency-Key": "abc"})
    assert r.status == 409
    assert (await r.json())["error"]["fields"][0]["field"] == "Idempotency-Key"


async def test_job_lists_page_with_cursors_and_filter_by_tenant_and_state(client: TestClient):
    for i in range(25):
        await client.post("/v1/jobs", json={**MINIMAL, "tenant": "a" if i % 2 else "b", "name": f"j{i}",
                                            "gpus": {"count": 1, "model": "h100-80gb"}})
    seen, url = [], "/v1/jobs?limit=10"
    while url:
        page = await (await client.get(url)).json()
        seen += [j["spec"]["name"] for j in page["items"]]
        url = f"/v1/jobs?limit=10&cursor={page['next']}" if page["next"] else None
    assert seen == [f"j{i}" for i in reversed(range(25))]
    only_a = await (await client.get("/v1/jobs?tenant=a&state=queued&limit=100")).json()
    assert len(only_a["items"]) == 12 and {j["spec"]["tenant"] for j in only_a["items"]} == {"a"}


async def test_the_minimal_job_body_is_accepted_and_the_job_json_has_id_state_and_site(client: TestClient):
    r = await client.post("/v1/jobs", json=MINIMAL)
    assert r.status == 201
    job = await r.json()
    assert {"id", "state", "site"} <= set(job)
    assert job["state"] == "queued" and job["site"] is None
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"


async def test_the_openapi_document_describes_the_jobs_api_from_the_models(client: TestClient):
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/decision", "/v1/sites", "/v1/sites/{name}"} <= set(doc["paths"])
    spec = doc["components"]["schemas"]["JobSpec"]
    assert set(spec["required"]) == {"tenant", "name", "gpus", "duration_s"}
    # a rule a 422 answers for that the schema cannot state is named (a client told only the schema would send it)
    assert "within its tenant's federation-wide limit (broker.tenant_limits)" in spec["description"]
    assert "milli" in doc["components"]["schemas"]["GpuRequest"]["properties"]
    quota = doc["paths"]["/v1/sites/{name}/quota/{tenant}"]
    assert set(quota) >= {"put", "delete"} and "guaranteed_gpus" in doc["components"]["schemas"]["TenantQuota"]["properties"]
    assert "borrowed_gpus" in doc["components"]["schemas"]["TenantQuotaState"]["properties"]


async def test_the_openapi_document_says_what_every_field_of_a_decision_means(client: TestClient):
    # A script reading GET /v1/jobs/{id}/decision had no word on what attempt means for a job that waits, nor
    # that a site's score is the sum of its terms' weighted values (normalised × weight).
    schemas = (await (await client.get("/openapi.json")).json())["components"]["schemas"]
    undescribed = [f"{name}.{field}" for name in ("Decision", "SiteVerdict", "ScoreTerm", "DeferralPlan", "DeadlineRisk")
                   for field, prop in schemas[name]["properties"].items() if not prop.get("description")]
    assert undescribed == []
    assert "sum of the terms' weighted values" in schemas["SiteVerdict"]["properties"]["score"]["description"]
    assert set(schemas["Decision"]["required"]) == {"job_id", "attempt", "decided_at", "outcome", "summary", "sites"}


# --- regressions from review: races and hostile input never give a 500 ---


async def test_concurrent_cancels_of_one_job_answer_200_once_and_409_otherwise(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 600})).json()
    await wait_for(client, job["id"], {"running"})
    rs = await asyncio.gather(*(client.post(f"/v1/jobs/{job['id']}/cancel") for _ in range(4)))
    assert sorted(r.status for r in rs) == [200, 409, 409, 409]
    for r in rs:
        if r.status == 409:
            assert "cannot be cancelled" in (await r.json())["error"]["message"]


async def test_concurrent_registrations_of_one_site_name_give_one_201_and_one_409(client: TestClient):
    a = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8})
    b = site_body("berlin", "gcp:europe-west3", {"h100-80gb": 8})
    rs = await asyncio.gather(client.post("/v1/sites", json=a), client.post("/v1/sites", json=b))
    assert sorted(r.status for r in rs) == [201, 409]
    served = (await (await client.get("/v1/sites/berlin")).json())["gpus"][0]["model"]
    stored = [s.gpus[0].model for s in await client.broker.store.list_sites()]  # type: ignore[attr-defined]
    assert stored == [served]


@pytest.mark.parametrize(
    ("deadline",),
    [
        pytest.param("0001-01-01T00:00:00+01:00", id="a deadline before year 1 in UTC is refused"),
        pytest.param("9999-12-31T23:59:59-01:00", id="a deadline after year 9999 in UTC is refused"),
    ],
)
async def test_a_deadline_out_of_range_is_a_422_naming_deadline(client: TestClient, deadline: str):
    r = await client.post("/v1/jobs", json={**MINIMAL, "deadline": deadline})
    assert r.status == 422
    assert (await r.json())["error"]["fields"][0]["field"] == "deadline"


async def test_a_cursor_beyond_any_row_is_a_400(client: TestClient):
    import base64

    cursor = base64.urlsafe_b64encode(b"s" + str(10**20).encode()).decode().rstrip("=")
    r = await client.get(f"/v1/jobs?cursor={cursor}")
    assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == "cursor"


async def test_a_deadline_already_past_is_a_422_naming_deadline_and_nothing_is_stored(client: TestClient):
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    r = await client.post("/v1/jobs", json={**MINIMAL, "deadline": past})
    body = await r.json()
    assert r.status == 422, body
    assert body["error"]["fields"] == [{"field": "deadline", "problem": "in the past"}]
    assert "has passed" in body["error"]["message"]
    assert (await (await client.get("/v1/jobs")).json())["items"] == []


async def test_a_retry_of_a_job_accepted_before_its_deadline_passed_replays_it(client: TestClient):
    """The deadline is checked for new jobs only: a client retrying a submission the broker accepted (its answer
    lost) gets that job back, though the deadline has passed since."""
    spec = {**MINIMAL, "deadline": (datetime.now(UTC) + timedelta(seconds=1)).isoformat()}
    first = await client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "retry-1"})
    assert first.status == 201
    await asyncio.sleep(1.2)
    again = await client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "retry-1"})
    assert again.status == 201 and again.headers.get("Idempotent-Replayed") == "true"
    assert (await again.json())["id"] == (await first.json())["id"]
    fresh = await client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "retry-2"})
    assert fresh.status == 422


async def test_an_idempotency_key_that_is_not_printable_ascii_is_a_400(client: TestClient):
    r = await client.post("/v1/jobs", json=MINIMAL, headers={"Idempotency-Key": "clé-1"})
    assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == "Idempotency-Key"


async def test_a_body_that_claims_gzip_but_is_not_is_a_400(client: TestClient):
    r = await client.post("/v1/jobs", data=b"not gzip at all",
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status == 400 and "could not be read" in (await r.json())["error"]["message"]


async def test_a_site_with_more_gpus_than_any_cluster_is_refused(client: TestClient):
    body = site_body("huge", "gcp:us-east1", {"a100-80gb": 8})
    body["gpus"] = [{"model": "a100-80gb", "gpus_per_node": 64, "nodes": 100_000}]
    r = await client.post("/v1/sites", json=body)
    assert r.status == 422 and "more than 200,000" in (await r.json())["error"]["message"]


# --- routing profiles ---


async def test_a_job_may_choose_a_profile_and_is_routed_by_it(client: TestClient) -> None:
    await register(client, site_body("alpha", "gcp:europe-west3", {"a100-80gb": 8},
                                     usd_per_gpu_hour={"a100-80gb": 9.0}))
    await register(client, site_body("bravo", "gcp:europe-west3", {"a100-80gb": 4},
                                     usd_per_gpu_hour={"a100-80gb": 3.0}))
    base = {"tenant": "t1", "gpus": {"count": 2}, "duration_s": 600}
    # No profile: the default most-free-GPUs placement takes alpha (8 free against 4).
    r = await client.post("/v1/jobs", json=base | {"name": "plain"})
    assert r.status == 201
    assert (await wait_for(client, (await r.json())["id"], {"running"}))["site"] == "alpha"
    # The cheap profile takes bravo, the cheaper site; its explanation names the cost term.
    r = await client.post("/v1/jobs", json=base | {"name": "thrifty", "profile": "cheap"})
    assert r.status == 201
    job = await wait_for(client, (await r.json())["id"], {"running"})
    assert job["site"] == "bravo" and job["spec"]["profile"] == "cheap"
    explained = await (await client.get(f"/v1/jobs/{job['id']}/decision")).text()
    assert "cost" in explained


@pytest.mark.parametrize("profile, words", [
    ("greener", "profile 'greener' may not be chosen by a job here"),
    ("Green!", "profile"),
])
async def test_an_unknown_profile_is_refused_naming_the_field(client: TestClient, profile: str, words: str) -> None:
    r = await client.post("/v1/jobs", json={"tenant": "t1", "name": "j", "gpus": {"count": 1}, "duration_s": 60,
                                            "profile": profile})
    assert r.status == 422
    body = await r.json()
    assert words in body["error"]["message"]
    assert [f["field"] for f in body["error"]["fields"]] == ["profile"]


async def test_nan_and_infinity_are_refused_by_field_and_nothing_of_them_is_stored(client: TestClient):
    # Python's JSON parser takes the bare tokens NaN and Infinity; the store would write them back as null, and
    # a site spec with a null RTT could not be read at the next start.
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    headers = {"Content-Type": "application/json"}
    site = '{"name": "paris", "region": "gcp:europe-west9", "grid_zone": "FR", "timezone": "Europe/Paris", ' \
           '"latitude": 48.9, "longitude": 2.3, "gpus": [{"model": "l4", "gpus_per_node": 8, "nodes": 1}], ' \
           '"adapter": {"kind": "simulated"}, "rtt_ms": {"gcp:europe-west9": NaN}, "usd_per_gpu_hour": {"l4": Infinity}}'
    r = await client.post("/v1/sites", data=site, headers=headers)
    assert r.status == 422
    fields = {f["field"]: f["problem"] for f in (await r.json())["error"]["fields"]}
    assert fields == {"rtt_ms.gcp:europe-west9": "Input should be a finite number",
                      "usd_per_gpu_hour.l4": "Input should be a finite number"}
    r = await client.put("/v1/sites/berlin/quota/t1", data='{"guaranteed_gpus": 2, "fair_share_weight": Infinity}',
                         headers=headers)
    assert r.status == 422
    assert [f["field"] for f in (await r.json())["error"]["fields"]] == ["fair_share_weight"]
    r = await client.post("/v1/jobs", data='{"tenant": "t1", "name": "n", "gpus": {"count": 1}, "duration_s": 60, '
                                           '"latency_slo_ms": Infinity}', headers=headers)
    assert r.status == 422
    assert (await r.json())["error"]["fields"] == [{"field": "latency_slo_ms", "problem": "Input should be a finite number"}]
    sites = await (await client.get("/v1/sites")).json()
    assert [s["name"] for s in sites["items"]] == ["berlin"]
    assert (await (await client.get("/v1/jobs")).json())["items"] == []


async def test_a_misspelt_quota_filter_is_a_400_not_every_tenants_row(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, quotas=[
        {"tenant": "t1", "guaranteed_gpus": 2}, {"tenant": "t2", "guaranteed_gpus": 2}]))
    r = await client.get("/v1/sites/berlin/quota", params={"tenants": "t1"})
    assert r.status == 400
    assert (await r.json())["error"]["fields"] == [{"field": "tenants", "problem": "unknown parameter"}]
    r = await client.get("/v1/sites/berlin/quota", params={"tenant": "t1"})
    assert r.status == 200 and [t["tenant"] for t in (await r.json())["tenants"]] == ["t1"]


async def test_requests_that_could_never_mean_what_they_say_are_refused_by_field(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json=MINIMAL)).json()
    # A misspelt filter would otherwise list every job, as if every job had matched it.
    r = await client.get("/v1/jobs", params={"status": "queued"})
    assert r.status == 400
    assert (await r.json())["error"]["fields"] == [{"field": "status", "problem": "unknown parameter"}]
    assert [j["id"] for j in (await (await client.get("/v1/jobs", params={"tenant": "t1"})).json())["items"]] == [job["id"]]
    # A MIG slice larger than any GPU a site may have would wait for ever.
    r = await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 1, "mig_profile": "1g.999999gb"}})
    assert r.status == 422 and "more than any GPU a site may have (4096 GiB)" in (await r.text())
    # So would a MIG slice of a model that has none.
    r = await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 1, "model": "l4", "mig_profile": "1g.6gb"}})
    assert r.status == 422
    assert (await r.json())["error"]["fields"] == [{"field": "gpus.mig_profile", "problem": (
        "mig_profile: l4 GPUs cannot be partitioned into MIG slices; ask for a model that can (a100-40gb, "
        "a100-80gb, h100-80gb, h100-94gb, h200-141gb, b200-180gb, rtx-pro-6000), or leave model out")}]
    assert (await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 1, "model": "a100-80gb",
                                                                       "mig_profile": "7g.80gb"}})).status == 201
    # Cordoning a cordoned site again without a reason keeps the reason it was cordoned for.
    await client.post("/v1/sites/berlin/cordon", json={"reason": "driver upgrade"})
    again = await (await client.post("/v1/sites/berlin/cordon")).json()
    assert again["cordoned"] is True and again["cordon_reason"] == "driver upgrade"


async def test_a_bad_adapter_setting_is_named_by_the_field_a_user_writes(client: TestClient):
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8},
                     adapter={"kind": "kubernetes", "request_timeout_s": -1})
    r = await client.post("/v1/sites", json=body)
    assert r.status == 422
    assert [f["field"] for f in (await r.json())["error"]["fields"]] == ["adapter.request_timeout_s"]


@pytest.mark.parametrize(("adapter", "field", "problem"), [
    ({"pod_security": "restricted", "pod_security_context": {"runAsUser": 0}}, "adapter.pod_security_context",
     "runAsUser 0 is root, which pod_security restricted forbids"),
    ({"pod_security_context": {"privileged": True}}, "adapter.pod_security_context", "privileged: not taken here"),
    ({"pod_security": "baseline"}, "adapter.pod_security", "meets the baseline profile as it is"),
], ids=["runAsUser 0 under restricted", "a securityContext key not taken", "a profile that needs nothing"])
async def test_a_kubernetes_sites_pod_security_the_profile_forbids_is_a_422_naming_the_field(
        client: TestClient, adapter: dict[str, Any], field: str, problem: str):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, adapter={"kind": "kubernetes", **adapter})
    for r in (await client.post("/v1/sites", json={**body, "name": "paris"}),
              await client.put("/v1/sites/berlin", json=body)):
        assert r.status == 422
        [found] = (await r.json())["error"]["fields"]
        assert found["field"] == field and problem in found["problem"], found


async def test_a_store_that_fails_a_read_is_a_503_that_says_it_could_not_read(client: TestClient,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """A failed read changes nothing, and its answer said the broker "could not write to its store"."""
    from broker.store import StoreError

    async def down(*_: Any, **__: Any) -> None:
        raise StoreError("connection reset by peer")

    monkeypatch.setattr(client.broker.store, "get_job", down)  # type: ignore[attr-defined]
    r = await client.get("/v1/jobs/no-such-job")
    body = await r.json()
    assert r.status == 503 and "could not read its store" in body["error"]["message"], body


async def test_a_job_list_filter_holds_for_what_it_shows_and_an_empty_tenant_or_site_is_a_400(client: TestClient):
    """The page is read from the store and each job shown as the leader holds it now: a job that moved on
    between the two (a queued job dispatched, cancelled) was shown under a filter it no longer matched."""
    from broker.models import Job, JobState

    made = await (await client.post("/v1/jobs", json=MINIMAL)).json()
    book = client.broker.book  # type: ignore[attr-defined]
    held = book.active[made["id"]]
    book.active[made["id"]] = held.transition(JobState.DISPATCHING, held.updated_at, site="a", attempt=1)
    queued = await (await client.get("/v1/jobs?state=queued")).json()
    assert queued["items"] == []
    everything = await (await client.get("/v1/jobs")).json()
    assert [Job.model_validate(j).state for j in everything["items"]] == [JobState.DISPATCHING]
    book.active[made["id"]] = held
    for name in ("tenant", "site"):
        r = await client.get(f"/v1/jobs?{name}=")
        assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == name


async def test_a_replica_not_sure_it_leads_changes_no_sites_quota(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    """Dispatches and withdrawals ask whether this replica surely leads; quota changes, also calls to a site,
    did not: a leader that had lost its lease without knowing yet set a quota behind the new leader."""
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, quotas=[
        {"tenant": "t1", "guaranteed_gpus": 2}]))
    broker = client.broker  # type: ignore[attr-defined]
    monkeypatch.setattr(broker, "may_act", lambda: False)
    r = await client.put("/v1/sites/berlin/quota/t2", json={"guaranteed_gpus": 2})
    assert r.status == 503 and r.headers["Retry-After"] == "2"
    assert (await client.delete("/v1/sites/berlin/quota/t1")).status == 503
    monkeypatch.setattr(broker, "may_act", lambda: True)
    state = await (await client.get("/v1/sites/berlin/quota")).json()
    assert [t["tenant"] for t in state["tenants"] if t["guaranteed_gpus"]] == ["t1"]  # nothing changed


async def test_readyz_says_ready_while_the_store_answers_and_503_while_it_does_not(client: TestClient,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """/healthz says the process serves, whatever its database does: a broker whose store was down looked
    healthy, and kept being sent submissions it could not store."""
    from broker.store import StoreError

    r = await client.get("/readyz")
    assert r.status == 200 and await r.json() == {"status": "ready"}

    async def down(*_: Any) -> None:
        raise StoreError("connection refused")

    monkeypatch.setattr(client.broker.store, "get_state", down)  # type: ignore[attr-defined]
    r = await client.get("/readyz")
    body = await r.json()
    assert r.status == 503 and "connection refused" in body["error"]["message"] and r.headers["Retry-After"] == "5"
    assert (await client.get("/healthz")).status == 200  # alive all the same: not a reason to restart it


async def test_a_site_update_made_while_a_job_is_dispatched_there_neither_loses_nor_doubles_the_job(
        client: TestClient):
    """A PUT made while the site is slow to admit a job: what routing alone reads (prices, quotas, a cordon)
    changes at once and the job goes on to run there, dispatched once; a change that would rebuild the site's
    adapter is refused (409 naming the fields) rather than made under the attempt being admitted."""
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=[{"tenant": "t1", "guaranteed_gpus": 4}])
    await register(client, body)
    adapter = client.broker.federation.get("berlin").adapter
    release, submitted = asyncio.Event(), []
    submit = adapter.submit

    async def slow_submit(job):
        submitted.append((job.id, job.attempt))
        await release.wait()
        return await submit(job)

    adapter.submit = slow_submit
    try:
        job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 600})).json()
        await wait_for(client, job["id"], {"dispatching"})
        while not submitted:
            await asyncio.sleep(0.01)
        changed = {**body, "usd_per_gpu_hour": {"a100-80gb": 3.0}, "quotas": [{"tenant": "t1", "guaranteed_gpus": 8}],
                   "cordoned": True, "cordon_reason": "driver upgrade"}
        r = await client.put("/v1/sites/berlin", json=changed)
        assert r.status == 200, await r.text()
        for rebuild, fields in (({"gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}]}, ["gpus"]),
                                ({"adapter": {"kind": "simulated", "dispatch_delay_s": 0.01}}, ["adapter"])):
            r = await client.put("/v1/sites/berlin", json={**changed, **rebuild})
            assert r.status == 409, await r.text()
            error = (await r.json())["error"]
            assert "1 active jobs" in error["message"] and [f["field"] for f in error["fields"]] == fields
        assert client.broker.federation.get("berlin").adapter is adapter
        assert "berlin" not in client.broker.federation.leaving
    finally:
        release.set()
    running = await wait_for(client, job["id"], {"running"})
    assert (running["site"], running["attempt"]) == ("berlin", 1) and submitted == [(job["id"], 1)]
    site = await (await client.get("/v1/sites/berlin")).json()
    assert site["cordoned"] is True and site["usd_per_gpu_hour"] == {"a100-80gb": 3.0}
    assert [(g["gpus_per_node"], g["nodes"]) for g in site["gpus"]] == [(8, 2)]
    assert site["adapter"]["dispatch_delay_s"] == 0.005


@pytest.mark.parametrize("change", ["rebuild", "remove"])
async def test_a_site_rebuilt_or_removed_after_a_job_was_cancelled_mid_dispatch_takes_the_late_attempt_back(
        client: TestClient, change: str):
    """A job cancelled while its site is slow to admit it, then a PUT that rebuilds the site's adapter (or a
    DELETE): the withdrawal may reach the site before the attempt does (a Kubernetes delete that finds nothing,
    then the create lands). The attempt that lands late is taken back through the adapter that sent it, before
    that adapter is replaced or dropped, so nothing is left running at the site that no broker knows of."""
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16})
    await register(client, body)
    adapter = client.broker.federation.get("berlin").adapter
    release, submitted, withdrawn = asyncio.Event(), asyncio.Event(), []
    submit, cancel = adapter.submit, adapter.cancel

    async def slow_submit(job):
        submitted.set()
        await release.wait()
        return await submit(job)

    async def cancel_that_can_come_first(job_id, attempt):
        withdrawn.append((job_id, attempt, release.is_set()))
        if release.is_set():  # before the attempt lands, the site has nothing to withdraw (as a 404 would say)
            await cancel(job_id, attempt)

    adapter.submit, adapter.cancel = slow_submit, cancel_that_can_come_first
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 600})).json()
    await asyncio.wait_for(submitted.wait(), 10)
    assert (await client.post(f"/v1/jobs/{job['id']}/cancel")).status == 200
    if change == "rebuild":
        made = asyncio.ensure_future(client.put("/v1/sites/berlin", json={
            **body, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}]}))
    else:
        made = asyncio.ensure_future(client.delete("/v1/sites/berlin"))
    await asyncio.sleep(0.2)
    assert not made.done()  # waiting for the dispatch under way to be answered
    # ... which holds up no other site's change: paris is registered and cordoned meanwhile
    await register(client, site_body("paris", "gcp:europe-west9", {"a100-80gb": 8}))
    r = await asyncio.wait_for(client.post("/v1/sites/paris/cordon", json={"reason": "an incident"}), 5)
    assert r.status == 200 and not made.done()
    release.set()
    r = await asyncio.wait_for(made, 10)
    assert r.status == (200 if change == "rebuild" else 204), await r.text()
    assert (job["id"], 1, True) in withdrawn  # taken back from the old adapter once it had landed
    assert not adapter._runs  # nothing left running there
    assert (await (await client.get(f"/v1/jobs/{job['id']}")).json())["state"] == "cancelled"


async def test_a_preview_tells_where_a_job_would_go_and_why_and_submits_nothing(client: TestClient):
    """``POST /v1/preview`` (``heliotrope submit --dry-run``): what the broker would decide for the job now,
    as ``GET /v1/jobs/{id}/decision`` explains a decision, with nothing stored: the submitter sees the site, or
    why it would wait, before sending it."""
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}))
    await register(client, site_body("paris", "gcp:europe-west9", {"a100-80gb": 8}))
    r = await client.post("/v1/preview", json={**MINIMAL, "gpus": {"count": 4}})
    assert r.status == 200, await r.text()
    preview = await r.json()
    d = preview["decision"]
    assert d["outcome"] == "placed" and d["site"] == "berlin" and d["job_id"] == "preview"
    assert sorted(s["site"] for s in d["sites"]) == ["berlin", "paris"]
    assert "at its place in the queue" in preview["note"]
    assert preview["ahead"] == 0  # no job queued before it
    assert (await (await client.get("/v1/jobs")).json())["items"] == []  # nothing was submitted

    # the GPUs a running job holds are not offered: 16 held at berlin, so paris
    blocker = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "blocker", "gpus": {"count": 16},
                                                         "duration_s": 600})).json()
    await wait_for(client, blocker["id"], {"running"})
    d = (await (await client.post("/v1/preview", json={**MINIMAL, "gpus": {"count": 4}})).json())["decision"]
    assert d["outcome"] == "placed" and d["site"] == "paris"
    d = (await (await client.post("/v1/preview", json={**MINIMAL, "gpus": {"count": 12}})).json())["decision"]
    assert d["outcome"] == "unplaceable" and d["site"] is None
    assert {s["site"]: s["reasons"] for s in d["sites"]} == {
        "berlin": ["gpus-do-not-fit: job needs 12 GPUs of any model; 0 free"],
        "paris": ["gpus-do-not-fit: job needs 12 GPUs of any model; 8 free"]}

    # a spec a submission would refuse is refused the same way, naming the field
    r = await client.post("/v1/preview", json={**MINIMAL, "gpus": {"count": 0}})
    assert r.status == 422 and (await r.json())["error"]["fields"][0]["field"] == "gpus.count"
    r = await client.post("/v1/preview", json={**MINIMAL, "deadline": "2020-01-01T00:00:00Z"})
    assert r.status == 422 and (await r.json())["error"]["fields"] == [{"field": "deadline", "problem": "in the past"}]
    assert [j["id"] for j in (await (await client.get("/v1/jobs")).json())["items"]] == [blocker["id"]]


async def test_a_queued_jobs_priority_deadline_and_profile_change_and_it_is_placed_by_its_new_priority(
        client: TestClient):
    """``PATCH /v1/jobs/{id}`` (as Armada's reprioritize, Slurm's ``scontrol update``): a queued job moves up the
    queue; the change is stored and in its transitions; a job that left the queue, or a key that cannot change,
    is refused naming why."""
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    blocker = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "blocker", "gpus": {"count": 8},
                                                         "duration_s": 1.5})).json()
    await wait_for(client, blocker["id"], {"running"})
    older = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "older", "gpus": {"count": 8}})).json()
    newer = await (await client.post("/v1/jobs", json={**MINIMAL, "name": "newer", "gpus": {"count": 8}})).json()
    r = await client.patch(f"/v1/jobs/{newer['id']}", json={"priority": 5, "deadline": "2099-01-01T00:00:00Z"})
    assert r.status == 200, await r.text()
    changed = await r.json()
    assert changed["spec"]["priority"] == 5 and changed["spec"]["deadline"] == "2099-01-01T00:00:00Z"
    assert changed["state"] == "queued" and changed["reason"].startswith("changed by request: ")
    told = [e for e in client.broker.events.recent if e.type == "transition" and e.job_id == newer["id"]]
    assert told[-1].data["reason"] == changed["reason"]  # the event stream hears what changed
    await wait_for(client, newer["id"], {"running"})  # the blocker ends: the newer job goes first now
    assert (await (await client.get(f"/v1/jobs/{older['id']}")).json())["state"] == "queued"
    history = (await (await client.get(f"/v1/jobs/{newer['id']}/events")).json())["items"]
    assert any(e["state"] == "queued" and e["reason"] == "changed by request: deadline none -> 2099-01-01T00:00:00+00:00, "
               "priority 0 -> 5" for e in history), history
    stored = await client.broker.store.get_job(newer["id"])
    assert stored.spec.priority == 5  # on disk

    r = await client.patch(f"/v1/jobs/{older['id']}", json={"deadline": None, "profile": "green"})
    assert r.status == 200 and (await r.json())["spec"]["profile"] == "green"
    r = await client.patch(f"/v1/jobs/{newer['id']}", json={"priority": 6})  # running: no longer queued
    assert r.status == 409 and "is running: only a queued job" in (await r.json())["error"]["message"]
    for body, field in (({"gpus": {"count": 1}}, "gpus"), ({}, "(body)"), ({"priority": 5000}, "priority"),
                        ({"priority": None}, "priority"),  # (was named "(body)": the key a client must mend is this)
                        ({"deadline": "2020-01-01T00:00:00Z"}, "deadline"), ({"profile": "nope"}, "profile")):
        r = await client.patch(f"/v1/jobs/{older['id']}", json=body)
        error = (await r.json())["error"]
        assert r.status == 422, (body, error)
        assert field in [f["field"] for f in error["fields"]] or (body == {} and "give at least one of priority"
                                                                  in error["message"]), (body, error)
    assert (await (await client.get(f"/v1/jobs/{older['id']}")).json())["spec"]["priority"] == 0


async def test_a_job_another_replica_just_accepted_can_be_changed_at_once(client: TestClient):
    # Stored by another replica's API, not taken in by this (leading) one's book yet: a cancel takes it in
    # (Lifecycle.cancel), a change answered 409 "job ... is queued: only a queued job's priority ... can change".
    from broker.models import Job, JobSpec

    now = client.broker.clock.now()
    job = Job(id="job-elsewhere", spec=JobSpec.model_validate(MINIMAL), created_at=now, updated_at=now,
              reason="waiting for a placement")
    await client.broker.store.insert_job(job)
    r = await client.patch(f"/v1/jobs/{job.id}", json={"priority": 7})
    assert r.status == 200, await r.text()
    assert (await r.json())["spec"]["priority"] == 7
    assert (await client.broker.store.get_job(job.id)).spec.priority == 7



async def test_a_quota_set_while_the_site_is_rebuilt_reaches_the_rebuilt_site(client: TestClient):
    # The quota PUT waits for the site's lock while a PUT of the site rebuilds its adapter (more GPUs); it then
    # asked the adapter it had read before waiting, the one the rebuild closed: answered 200 with the quota,
    # which the site (its new adapter) never had.
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16})
    await register(client, body)
    federation = client.broker.federation
    factory = federation._factory
    release = asyncio.Event()

    def slow_factory(spec):  # noqa: ANN001, ANN202
        adapter = factory(spec)
        start = adapter.start

        async def slow_start() -> None:
            await release.wait()
            await start()

        adapter.start = slow_start
        return adapter

    federation._factory = slow_factory
    rebuild = asyncio.ensure_future(client.put("/v1/sites/berlin", json=site_body("berlin", "gcp:europe-west3", {"a100-80gb": 24})))
    while not client.broker.site_lock("berlin").locked() and not rebuild.done():
        await asyncio.sleep(0)
    quota = asyncio.ensure_future(client.put("/v1/sites/berlin/quota/t2", json={"guaranteed_gpus": 4}))
    while not client.broker.site_lock("berlin")._waiters and not quota.done():
        await asyncio.sleep(0)
    release.set()
    assert (await rebuild).status == 200, await (await rebuild).text()
    r = await quota
    assert r.status == 200, await r.text()
    now = await (await client.get("/v1/sites/berlin/quota")).json()
    assert {t["tenant"]: t["guaranteed_gpus"] for t in now["tenants"]}.get("t2") == 4, now


async def test_a_quota_set_while_the_site_is_removed_is_not_answered_as_set(client: TestClient):
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16})
    await register(client, body)
    lock = client.broker.site_lock("berlin")
    await lock.acquire()  # (as a removal waiting for a cancelled job's dispatch holds it)
    try:
        quota = asyncio.ensure_future(client.put("/v1/sites/berlin/quota/t2", json={"guaranteed_gpus": 4}))
        while not lock._waiters:
            await asyncio.sleep(0)
        await client.broker._remove_site("berlin")
    finally:
        lock.release()
    r = await quota
    assert r.status == 404, await r.text()


# --- by label: listing, and cancelling many at once ---


async def submit(client: TestClient, **more: Any) -> str:
    r = await client.post("/v1/jobs", json={**MINIMAL, **more})
    assert r.status == 201, await r.text()
    return (await r.json())["id"]


async def test_a_query_on_a_route_that_takes_none_is_refused_naming_it(client: TestClient):
    """``GET /v1/sites?region=gcp:us-east4`` listed every site, as if the filter had been applied (the routes that take
    parameters refuse one they do not know)."""
    await register(client, site_body("london", "gcp:europe-west2", {"a100-80gb": 8}))
    job = await submit(client)
    await wait_for(client, job, {"running"})  # (decided: its decision is there)
    for path in ("/v1/sites", "/v1/sites/london", f"/v1/jobs/{job}", f"/v1/jobs/{job}/decision",
                 f"/v1/jobs/{job}/events", "/v1/carbon", "/v1/whoami"):
        r = await client.get(f"{path}?region=gcp:us-east4")
        body = await r.json()
        assert r.status == 400 and body["error"]["fields"] == [{"field": "region", "problem": "unknown parameter"}], \
            (path, body)
        assert (await client.get(path)).status == 200, path


async def test_jobs_are_listed_in_any_of_the_states_named_and_a_filter_given_twice_is_refused(client: TestClient):
    """``state=queued&state=cancelled`` lists the jobs in either (only the last was read); ``tenant=a&tenant=b``
    read one of them and listed its jobs as if that were all that was asked: now a 400 naming it."""
    queued, cancelled = await submit(client, name="q"), await submit(client, name="c")
    assert (await client.post(f"/v1/jobs/{cancelled}/cancel")).status == 200

    async def listed(query: str) -> list[str]:
        r = await client.get(f"/v1/jobs?{query}")
        assert r.status == 200, await r.text()
        return [j["id"] for j in (await r.json())["items"]]

    assert await listed("state=cancelled&state=queued") == [cancelled, queued]
    assert await listed("state=cancelled&state=cancelled") == [cancelled]
    for query, field in (("tenant=t1&tenant=t2", "tenant"), ("limit=1&limit=5", "limit"), ("state=queued&state=x",
                                                                                            "state")):
        r = await client.get(f"/v1/jobs?{query}")
        assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == field, await r.text()


async def test_jobs_are_listed_by_label_every_one_named_must_match_and_a_key_alone_matches_any_value(
        client: TestClient):
    s1 = [await submit(client, name=f"s1-{i}", labels={"sweep.id": "s1", "lr": f"0.{i}"}) for i in range(3)]
    s2 = await submit(client, name="s2", labels={"sweep.id": "s2", "lr": "0.1"})
    await submit(client, name="plain")

    async def listed(query: str) -> list[str]:
        r = await client.get(f"/v1/jobs?{query}")
        assert r.status == 200, await r.text()
        return [j["id"] for j in (await r.json())["items"]]

    assert await listed("label=sweep.id=s1") == s1[::-1]
    assert await listed("label=sweep.id=s1&label=lr=0.1") == [s1[1]]
    assert await listed("label=lr=0.1") == [s2, s1[1]]
    assert await listed("label=sweep.id") == [s2, *s1[::-1]]
    assert await listed("label=sweep.id=s3") == [] and await listed("label=sweep.id=s1&tenant=t2") == []
    first = await (await client.get("/v1/jobs?label=sweep.id=s1&limit=2")).json()
    rest = await (await client.get(f"/v1/jobs?label=sweep.id=s1&limit=2&cursor={first['next']}")).json()
    assert [j["id"] for j in first["items"] + rest["items"]] == s1[::-1] and rest["next"] is None
    r = await client.get("/v1/jobs?label==s1")
    body = await r.json()
    assert r.status == 400 and body["error"]["fields"][0]["field"] == "label", body
    assert "names no key" in body["error"]["message"]


@pytest.mark.parametrize("labels, words", [
    ({"run": "a" * 257}, "value of label 'run' is 257 characters; at most 256"),
    ({"k" * 257: "v"}, "is 257 characters; at most 256"),
    ({"dir": "C:\x00"}, "value of label 'dir' holds the control character '\\x00'"),
    ({"a\nb": "v"}, "key of label 'a\\nb' holds the control character '\\n'"),
    ({"a=b": "v"}, "holds '='"),
    ({"": "v"}, "may not be empty"),
    ({f"k{i}": "v" for i in range(65)}, "65 labels; a job carries at most 64"),
])
async def test_labels_a_listing_could_not_name_or_an_index_could_not_hold_are_refused_and_nothing_stored(
        client: TestClient, labels: dict[str, str], words: str):
    """A label is checked at submission and in a preview: a value of 3,000 characters that do not compress failed
    PostgreSQL's insert into the labels' index (so the job was not stored, with a store error for an answer); a NUL
    was read back differently by each store; a key holding '=' could never be listed by ``label=KEY=VALUE``."""
    for path, body in (("/v1/jobs", {**MINIMAL, "labels": labels}), ("/v1/preview", [{**MINIMAL, "labels": labels}])):
        r = await client.post(path, json=body)
        error = (await r.json())["error"]
        at = "[0]." if path == "/v1/preview" else ""
        assert r.status == 422 and error["fields"] == [{"field": f"{at}labels", "problem": ANY}], error
        assert words in error["fields"][0]["problem"], error
    assert (await (await client.get("/v1/jobs")).json())["items"] == []
    longest = {"k" * 256: "\u00e9" * 256, **{f"k{i}": "v" for i in range(63)}}  # at the bounds: taken
    taken = await submit(client, labels=longest)
    assert (await (await client.get(f"/v1/jobs/{taken}")).json())["spec"]["labels"] == longest


async def test_a_job_larger_than_its_tenants_federation_limit_is_refused_naming_gpus(tmp_path: Path):
    """It could never start (``broker.tenant_limits``): refused at submission and in a preview, rather than queued
    for ever; within the limit, or for a tenant without one, it is taken."""
    settings = BrokerSettings(db=str(tmp_path / "api.db"), shutdown_grace_s=1, tenant_limits={"t1": {"gpus": 4}})
    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            problem = ("the job holds 5 GPUs, and tenant t1 may hold at most 4 across the federation "
                       "(broker.tenant_limits)")
            for path, body, at in (("/v1/jobs", {**MINIMAL, "gpus": {"count": 5}}, ""),
                                   ("/v1/preview", [{**MINIMAL, "gpus": {"count": 5}}], "[0].")):
                r = await c.post(path, json=body)
                error = (await r.json())["error"]
                assert r.status == 422 and error["fields"] == [{"field": f"{at}gpus", "problem": problem}], error
            assert (await c.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 4}})).status == 201
            assert (await c.post("/v1/jobs", json={**MINIMAL, "tenant": "t2", "gpus": {"count": 5}})).status == 201
            assert len((await (await c.get("/v1/jobs")).json())["items"]) == 2
            r = await c.get("/v1/tenants")  # (no site: both queued, holding nothing)
            assert r.status == 200 and (await r.json())["items"] == [
                {"tenant": "t1", "gpus_held": 0.0, "jobs": {"queued": 1}, "gpus_limit": 4.0, "limit_source": "config"},
                {"tenant": "t2", "gpus_held": 0.0, "jobs": {"queued": 1}, "limit_source": "default"}]
            r = await c.get("/v1/tenants?tenant=t3")  # named, though it has nothing
            assert (await r.json())["items"] == [{"tenant": "t3", "gpus_held": 0.0, "jobs": {},
                                                  "limit_source": "default"}]
            r = await c.get("/v1/tenants?state=queued")
            assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == "state"
    finally:
        await broker.stop()


async def test_a_cancel_by_labels_stops_the_sweeps_queued_and_running_jobs_and_leaves_the_rest(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    sweep = {"sweep": "lr-search"}
    done = await submit(client, name="done", labels=sweep, duration_s=0.05)
    await wait_for(client, done, {"succeeded"})
    running = [await submit(client, name=f"run-{i}", labels=sweep, gpus={"count": 4}, duration_s=600)
               for i in range(2)]
    for job_id in running:
        await wait_for(client, job_id, {"running"})
    queued = [await submit(client, name=f"wait-{i}", labels=sweep, gpus={"count": 4}) for i in range(2)]
    other_sweep = await submit(client, name="other", labels={"sweep": "other"}, gpus={"count": 8})
    other_tenant = await submit(client, tenant="t2", name="theirs", labels=sweep, gpus={"count": 8})
    berlin = client.broker.federation.get("berlin").adapter  # type: ignore[attr-defined]
    assert {job_id for job_id, _ in await berlin.known_attempts()} == set(running)

    r = await client.post("/v1/cancellations", json={"tenant": "t1", "labels": sweep, "reason": "wrong learning rate"})
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert sorted(answer["cancelled"]) == sorted(running + queued)
    assert answer["skipped"] == [] and answer["matched"] == 4 and answer["more"] is False
    for job_id in running + queued:
        job = await (await client.get(f"/v1/jobs/{job_id}")).json()
        assert job["state"] == "cancelled" and job["reason"] == "cancelled by request: wrong learning rate", job
    assert (await (await client.get(f"/v1/jobs/{done}")).json())["state"] == "succeeded"
    # The running ones were withdrawn from the site. (A pass may already have placed the other sweep's job in the
    # GPUs they freed, as it must: the site then holds that attempt alone.)
    assert {job_id for job_id, _ in await berlin.known_attempts()} <= {other_sweep}
    # Their GPUs are free: the other sweep's 8-GPU job runs there (and t2's, the same labels, was not touched).
    assert (await wait_for(client, other_sweep, {"running"}))["site"] == "berlin"
    assert (await (await client.get(f"/v1/jobs/{other_tenant}")).json())["state"] == "queued"
    again = await (await client.post("/v1/cancellations", json={"tenant": "t1", "labels": sweep})).json()
    assert again == {"cancelled": [], "skipped": [], "matched": 0, "more": False}


async def test_a_cancel_dry_run_lists_a_job_whose_move_to_running_is_still_being_stored(
        client: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``heliotrope cancel --dry-run`` listed state by state, and a list by one state leaves out a job the broker
    holds in another state now: a job held as running while its 'running' write was still on its way to the store
    (stored as dispatching) was in no list, and the dry run said nothing would be cancelled that the cancel then
    cancelled (seen under load). It lists the states a job can still leave in one request, as the cancel reads them."""
    from broker import cli
    from broker.models import JobState

    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    store = client.broker.store  # type: ignore[attr-defined]
    real = store.enqueue_update
    release = asyncio.Event()
    held: list[asyncio.Task[None]] = []

    def enqueue(job: Any, expected_version: int, *args: Any, **kw: Any) -> asyncio.Future[None]:
        if job.state != JobState.RUNNING:
            return real(job, expected_version, *args, **kw)
        landed = asyncio.get_running_loop().create_future()

        async def later() -> None:  # the write is queued once released, and answers as it lands
            await release.wait()
            try:
                await real(job, expected_version, *args, **kw)
                landed.set_result(None)
            except Exception as e:  # noqa: BLE001
                landed.set_exception(e)
        held.append(asyncio.create_task(later()))
        return landed

    monkeypatch.setattr(store, "enqueue_update", enqueue)
    job_id = await submit(client, name="lr-1", labels={"lr": "0.1"}, duration_s=600)
    await wait_for(client, job_id, {"running"})  # as the broker holds it; the store still says dispatching
    assert held and not release.is_set()
    url = str(client.make_url("")).rstrip("/")
    selector = ("--tenant", "t1", "--label", "lr=0.1")
    code = await asyncio.to_thread(cli.main, ["--server", url, "--json", "cancel", *selector, "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and [(j["id"], j["state"]) for j in json.loads(out)] == [(job_id, "running")], out
    release.set()
    await asyncio.gather(*held)
    code = await asyncio.to_thread(cli.main, ["--server", url, "--json", "cancel", *selector])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["cancelled"] == [job_id], out


async def test_a_cancel_by_tenant_and_state_cancels_only_that_tenants_jobs_in_that_state(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    running = await submit(client, tenant="t2", name="running", gpus={"count": 8}, duration_s=600)
    await wait_for(client, running, {"running"})
    queued = [await submit(client, tenant="t2", name=f"q{i}") for i in range(3)]
    mine = await submit(client, name="mine")
    r = await client.post("/v1/cancellations", json={"tenant": "t2", "state": "queued"})
    answer = await r.json()
    assert r.status == 200 and sorted(answer["cancelled"]) == sorted(queued), answer
    assert (await (await client.get(f"/v1/jobs/{running}")).json())["state"] == "running"
    assert (await (await client.get(f"/v1/jobs/{mine}")).json())["state"] == "queued"
    answer = await (await client.post("/v1/cancellations", json={"tenant": "t2"})).json()
    assert answer["cancelled"] == [running]


async def test_a_cancel_of_queued_jobs_leaves_alone_a_job_placed_while_the_ones_before_it_were_cancelled(
        client: TestClient, monkeypatch: pytest.MonkeyPatch):
    """The jobs are listed first and cancelled a batch at a time, each batch waiting for its writes (and its sites'
    withdrawals): a job the pass placed meanwhile is no longer what the request asked for, and must not be cancelled
    (it was: a tenant that cancelled its waiting jobs lost one that had started, its attempt withdrawn)."""
    from broker import api
    from broker.models import JobState

    monkeypatch.setattr(api, "CANCEL_TOGETHER", 1)
    older, newer = [await submit(client, tenant="t2", name=f"q{i}") for i in range(2)]  # listed newest first
    broker = client.broker  # type: ignore[attr-defined]
    cancel = broker.lifecycle.cancel

    async def placed_meanwhile(job_id: str, why: str | None = None, **kw: Any):
        done = await cancel(job_id, why, **kw)
        if job_id == newer:  # while the first batch's cancel was being stored, a pass placed the other job
            await broker.book.transition(older, JobState.DISPATCHING, site="berlin", attempt=1, reason="placed")
        return done

    monkeypatch.setattr(broker.lifecycle, "cancel", placed_meanwhile)
    r = await client.post("/v1/cancellations", json={"tenant": "t2", "state": "queued"})
    answer = await r.json()
    assert r.status == 200 and answer["cancelled"] == [newer], answer
    assert answer["skipped"] == [{"id": older, "reason": f"job {older} is dispatching on berlin now, which the "
                                                         "cancellation does not select"}], answer
    assert (await (await client.get(f"/v1/jobs/{older}")).json())["state"] == "dispatching"


async def test_a_cancel_of_many_answers_at_most_its_bound_and_says_there_is_more(client: TestClient,
                                                                              monkeypatch: pytest.MonkeyPatch):
    from broker import api

    monkeypatch.setattr(api, "CANCEL_AT_MOST", 3)
    monkeypatch.setattr(api, "CANCEL_TOGETHER", 2)
    ids = [await submit(client, name=f"j{i}", labels={"batch": f"b{i}"}) for i in range(5)]
    first = await (await client.post("/v1/cancellations", json={"labels": {"batch": None}})).json()  # any value
    assert first["cancelled"] == ids[:1:-1] and first["matched"] == 3 and first["more"] is True, first
    second = await (await client.post("/v1/cancellations", json={"labels": {"batch": None}})).json()
    assert second["cancelled"] == ids[1::-1] and second["more"] is False, second


async def test_a_job_ending_while_it_is_cancelled_with_others_is_skipped_not_an_error(client: TestClient,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    from broker.lifecycle import AlreadyEnded

    ids = [await submit(client, name=f"j{i}", labels={"batch": "b"}) for i in range(3)]
    lifecycle = client.broker.lifecycle  # type: ignore[attr-defined]
    cancel = lifecycle.cancel

    async def ended_meanwhile(job_id: str, why: str | None = None, **kw: Any):
        if job_id == ids[1]:
            job = await cancel(job_id)  # as if its site had just reported its end
            raise AlreadyEnded(job)
        return await cancel(job_id, why, **kw)

    monkeypatch.setattr(lifecycle, "cancel", ended_meanwhile)
    r = await client.post("/v1/cancellations", json={"labels": {"batch": "b"}})
    answer = await r.json()
    assert r.status == 200 and answer["cancelled"] == [ids[2], ids[0]] and answer["matched"] == 3, answer
    assert answer["skipped"] == [{"id": ids[1], "reason": f"job {ids[1]} is already cancelled; it cannot be cancelled"}]


async def test_a_cancel_of_many_answers_within_its_bound_when_a_site_is_slow_to_confirm_withdrawals(
        client: TestClient, monkeypatch: pytest.MonkeyPatch):
    """A site that does not answer (the usual reason to cancel its jobs in bulk) must not hold the answer for a
    withdrawal's timeout after the bound: the jobs are cancelled, and their withdrawals retried later."""
    from broker import api

    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    running = [await submit(client, name=f"run-{i}", labels={"batch": "b"}, gpus={"count": 4}, duration_s=600)
               for i in range(2)]
    for job_id in running:
        await wait_for(client, job_id, {"running"})
    berlin = client.broker.federation.get("berlin").adapter  # type: ignore[attr-defined]

    async def unanswered(job_id: str, attempt: int) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(berlin, "cancel", unanswered)
    monkeypatch.setattr(client.broker.lifecycle, "cancel_timeout_s", 5.0)  # type: ignore[attr-defined]
    monkeypatch.setattr(api, "CANCEL_FOR_AT_MOST_S", 0.5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    r = await client.post("/v1/cancellations", json={"labels": {"batch": "b"}})
    took = loop.time() - began
    answer = await r.json()
    assert r.status == 200 and sorted(answer["cancelled"]) == sorted(running), answer
    assert took < 2.5, f"answered after {took:.1f} s, beyond its bound of 0.5 s"
    withdrawals = client.broker.lifecycle.withdrawals  # type: ignore[attr-defined]
    assert {job_id for job_id, _ in withdrawals} == set(running)  # to be retried until berlin confirms


@pytest.mark.parametrize("body, field", [
    ({}, "tenant"),
    ({"state": "queued", "site": "berlin"}, "tenant"),
    ({"labels": {}, "reason": "oops"}, "labels"),
    ({"tenant": "t1", "state": "succeeded"}, "state"),
    ({"labels": {"": "x"}}, "labels"),
    ({"tenant": "t1", "everything": True}, "everything"),
], ids=["an empty selector", "a state and a site without a tenant or labels", "empty labels",
        "a final state", "an empty label key", "an unknown key"])
async def test_a_cancel_of_many_that_names_no_tenant_or_labels_or_a_bad_field_is_refused(
        client: TestClient, body: dict[str, Any], field: str):
    job_id = await submit(client)
    r = await client.post("/v1/cancellations", json=body)
    answer = await r.json()
    assert r.status == 422 and field in [f["field"] for f in answer["error"]["fields"]], answer
    assert (await (await client.get(f"/v1/jobs/{job_id}")).json())["state"] == "queued"


async def test_a_cancel_of_many_that_the_store_fails_part_way_says_what_it_did_and_that_there_is_more(
        client: TestClient, monkeypatch: pytest.MonkeyPatch):
    """A 503 saying "nothing was changed" would be untrue once some jobs are cancelled: the answer lists them, the
    one whose write failed is skipped with the reason, and ``more`` says to call again."""
    from broker import api
    from broker.store import StoreError

    monkeypatch.setattr(api, "CANCEL_TOGETHER", 1)
    ids = [await submit(client, name=f"j{i}", labels={"batch": "b"}) for i in range(3)]
    lifecycle = client.broker.lifecycle  # type: ignore[attr-defined]
    cancel = lifecycle.cancel

    async def store_fails_at_the_second(job_id: str, why: str | None = None, **kw: Any):
        if job_id == ids[1]:
            raise StoreError("connection reset by peer")
        return await cancel(job_id, why, **kw)

    monkeypatch.setattr(lifecycle, "cancel", store_fails_at_the_second)
    r = await client.post("/v1/cancellations", json={"labels": {"batch": "b"}})
    answer = await r.json()
    assert r.status == 200 and answer["cancelled"] == [ids[2]] and answer["more"] is True, answer
    assert answer["skipped"] == [{"id": ids[1], "reason": "the store could not record the cancel; call again"}]
    monkeypatch.setattr(lifecycle, "cancel", cancel)
    again = await (await client.post("/v1/cancellations", json={"labels": {"batch": "b"}})).json()
    assert again["cancelled"] == [ids[1], ids[0]] and again["more"] is False, again


async def test_a_retry_of_a_job_accepted_before_its_tenants_limit_was_lowered_gets_that_job_back(tmp_path: Path):
    """As with a deadline passed since: the limit is checked of a new job, not of the replay of one accepted (a
    retry after a restart that lowered broker.tenant_limits); a new job over the limit is still refused."""
    big = {**MINIMAL, "gpus": {"count": 5}}
    for limit in (None, 4):
        limits = {"t1": {"gpus": limit}} if limit is not None else {}
        broker = Broker(BrokerSettings(db=str(tmp_path / "api.db"), shutdown_grace_s=1, tenant_limits=limits))
        await broker.start([])
        try:
            async with TestClient(TestServer(create_app(broker))) as c:
                r = await c.post("/v1/jobs", json=big, headers={"Idempotency-Key": "k1"})
                assert r.status == 201, await r.text()
                if limit is None:
                    first = (await r.json())["id"]
                else:
                    assert (await r.json())["id"] == first and r.headers["Idempotent-Replayed"] == "true"
                    r = await c.post("/v1/jobs", json=big, headers={"Idempotency-Key": "k2"})
                    assert r.status == 422 and (await r.json())["error"]["fields"][0]["field"] == "gpus"
        finally:
            await broker.stop()
