"""Site quotas through the live broker: the site reports them, its operator changes them through the API and
the CLI, the site keeps the changes across a restart, the broker routes around a site whose quota refuses,
and a tenant reclaiming its guarantee gets its GPUs back from the tenant that borrowed them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker.api import create_app
from broker.cli import show_quota
from broker.config import BrokerSettings
from broker.models import SiteSpec
from broker.service import Broker
from tests.test_api import register, site_body, wait_for


def job_body(tenant: str, gpus: int, **more: Any) -> dict[str, Any]:
    return {"tenant": tenant, "name": f"{tenant}-job", "gpus": {"count": gpus}, "duration_s": 3600, **more}


@pytest.fixture
async def broker_at(tmp_path: Path):
    """Start a broker on ``tmp_path``'s database (again after a stop, as a restart would)."""
    running: list[tuple[Broker, TestClient]] = []

    async def start() -> TestClient:
        settings = BrokerSettings(db=str(tmp_path / "quota.db"), cycle_interval_s=0.05, shutdown_grace_s=1)
        broker = Broker(settings)
        await broker.start([])
        client = TestClient(TestServer(create_app(broker)))
        await client.start_server()
        running.append((broker, client))
        return client

    async def stop() -> None:
        broker, client = running.pop()
        await client.close()
        await broker.stop()

    yield start, stop
    while running:
        await stop()


async def reported(client: TestClient, site: str, check, timeout_s: float = 5.0) -> dict[str, Any]:
    """The site's first reported capacity (of its one model) that passes ``check``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        capacity = (await (await client.get(f"/v1/sites/{site}")).json())["status"]["capacity"][0]
        if check(capacity) or loop.time() > deadline:
            assert check(capacity), capacity
            return capacity
        await asyncio.sleep(0.05)


QUOTAS = [
    {"tenant": "vision", "guaranteed_gpus": 8, "burst_gpus": 8, "fair_share_weight": 1},
    {"tenant": "nlp", "guaranteed_gpus": 8, "burst_gpus": 8, "fair_share_weight": 1},
]


async def test_the_site_reports_its_quotas_and_its_operator_changes_them_across_a_restart(broker_at):
    start, stop = broker_at
    client = await start()
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))

    q = await (await client.get("/v1/sites/berlin/quota")).json()
    assert q["site"] == "berlin" and q["enforced"] is True and q["capacity_gpus"] == 16
    vision = next(t for t in q["tenants"] if t["tenant"] == "vision")
    assert (vision["guaranteed_gpus"], vision["burst_gpus"], vision["in_use_gpus"]) == (8, 8, 0)

    r = await client.put("/v1/sites/berlin/quota/vision", json={"guaranteed_gpus": 12, "burst_gpus": 4})
    assert r.status == 200, await r.text()
    changed = await r.json()
    assert [(t["tenant"], t["guaranteed_gpus"], t["burst_gpus"]) for t in changed["tenants"]] == [("vision", 12, 4)]
    r = await client.delete("/v1/sites/berlin/quota/nlp")
    assert r.status == 200 and [t["tenant"] for t in (await r.json())["tenants"] if t["listed"]] == ["vision"]

    await stop()
    client = await start()  # the site is rebuilt from the broker's store; its own file holds the changes
    q = await (await client.get("/v1/sites/berlin/quota?tenant=vision")).json()
    assert [(t["tenant"], t["guaranteed_gpus"], t["burst_gpus"]) for t in q["tenants"]] == [("vision", 12, 4)]
    site = await (await client.get("/v1/sites/berlin")).json()
    assert site["status"]["quota"]["tenants"][0]["guaranteed_gpus"] == 12  # the broker shows what the site reports
    text = show_quota(q)
    assert "fair share time" in text and "vision" in text


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        pytest.param("/v1/sites/berlin/quota/vision", {"guaranteed_gpus": -1}, 422, "guaranteed_gpus",
                     id="a negative guarantee names the field"),
        pytest.param("/v1/sites/berlin/quota/vision", {"tenant": "nlp"}, 422, "tenant",
                     id="a body naming another tenant than the path is refused"),
        pytest.param("/v1/sites/berlin/quota/vision", {"fair_share_weight": 0}, 422, "fair_share_weight",
                     id="a zero weight names the field"),
        pytest.param("/v1/sites/berlin/quota/vision", {"guaranteed_gpus": 8, "model": "h100-80gb"}, 422, "model",
                     id="a quota for a GPU model the site does not have names the field"),
        pytest.param("/v1/sites/berlin/quota/speech", {"guaranteed_gpus": 17}, 422, "guaranteed_gpus",
                     id="a guarantee larger than the site names the field"),
        pytest.param("/v1/sites/berlin/quota/vision", {"burst_gpus": 1e12}, 422, "burst_gpus",
                     id="a burst of absurdly many GPUs names the field"),
        pytest.param("/v1/sites/berlin/quota/vision", {"guaranteed_gpus": 1e12}, 422, "guaranteed_gpus",
                     id="a guarantee of absurdly many GPUs names the field"),
        pytest.param("/v1/sites/nowhere/quota/vision", {}, 404, None, id="an unknown site is 404"),
        pytest.param("/v1/sites/berlin/quota/speech", None, 404, None,
                     id="removing the quota of a tenant the site does not list is 404"),
    ],
)
async def test_a_bad_quota_change_is_a_clear_error_and_changes_nothing(broker_at, path, body, status, field):
    start, _ = broker_at
    client = await start()
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))
    r = await (client.put(path, json=body) if body is not None else client.delete(path))
    assert r.status == status
    error = (await r.json())["error"]
    if field is not None:
        assert error["fields"][0]["field"] == field
    q = await (await client.get("/v1/sites/berlin/quota")).json()
    assert [(t["tenant"], t["guaranteed_gpus"]) for t in q["tenants"]] == [("nlp", 8), ("vision", 8)]


async def test_an_empty_tenant_filter_on_a_sites_quota_is_a_400_not_an_empty_report(broker_at):
    # As on the job list: no tenant has an empty name, so ?tenant= (a script's unset variable) is a mistake,
    # not a filter that matches nobody; a submitter was told it does not act for tenant ''.
    start, _ = broker_at
    client = await start()
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))
    r = await client.get("/v1/sites/berlin/quota?tenant=")
    assert r.status == 400, await r.text()
    assert (await r.json())["error"]["fields"] == [{"field": "tenant", "problem": "empty"}]


@pytest.mark.parametrize(
    ("quota", "field"),
    [
        pytest.param({"tenant": "nlp", "guaranteed_gpus": 4, "model": "h100-80gb"}, "quotas[1].model",
                     id="a quota for a GPU model the site does not have"),
        pytest.param({"tenant": "nlp", "guaranteed_gpus": 20}, "quotas[1].guaranteed_gpus",
                     id="a guarantee larger than the site"),
        pytest.param({"tenant": "nlp", "burst_gpus": 10**12}, "quotas[1].burst_gpus",
                     id="a burst of absurdly many GPUs"),
    ],
)
async def test_a_site_spec_whose_quota_asks_for_gpus_the_site_lacks_is_refused(broker_at, quota, field):
    start, _ = broker_at
    client = await start()
    quotas = [{"tenant": "vision", "guaranteed_gpus": 8}, quota]
    r = await client.post("/v1/sites", json=site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=quotas))
    assert r.status == 422
    assert [f["field"] for f in (await r.json())["error"]["fields"]] == [field]
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=quotas[:1]))
    r = await client.put("/v1/sites/berlin", json=site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16},
                                                             quotas=quotas))
    assert r.status == 422
    assert [f["field"] for f in (await r.json())["error"]["fields"]] == [field]
    q = await (await client.get("/v1/sites/berlin/quota")).json()
    assert [t["tenant"] for t in q["tenants"]] == ["vision"]


async def test_the_broker_routes_around_a_site_whose_quota_refuses_the_tenant(broker_at):
    start, _ = broker_at
    client = await start()
    strict = {"mode": "time", "unlisted_tenants": "refuse"}
    # alpha has more free GPUs (the default profile's choice) but quotas for vision only
    await register(client, site_body("alpha", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS[:1],
                                     fair_share=strict))
    await register(client, site_body("beta", "gcp:europe-west3", {"a100-80gb": 8}))
    job = await (await client.post("/v1/jobs", json=job_body("speech", 2))).json()
    job = await wait_for(client, job["id"], {"running"})
    assert job["site"] == "beta"
    decision = await (await client.get(f"/v1/jobs/{job['id']}/decision")).json()
    alpha = next(s for s in decision["sites"] if s["site"] == "alpha")
    assert not alpha["feasible"]
    assert any("quota-refuses" in r and "not in the site's quota list" in r for r in alpha["reasons"]), alpha


async def test_a_tenant_reclaims_its_guarantee_from_the_tenant_that_borrowed_it(broker_at):
    start, _ = broker_at
    client = await start()
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))
    # nlp borrows vision's idle guarantee with preemptible work: 4 jobs of 4 GPUs fill the site
    borrowed = []
    for i in range(4):
        body = job_body("nlp", 4, name=f"nlp-{i}", preemptible=True, checkpointable=True)
        borrowed.append((await (await client.post("/v1/jobs", json=body)).json())["id"])
        await wait_for(client, borrowed[-1], {"running"})
    q = await (await client.get("/v1/sites/berlin/quota?tenant=nlp")).json()
    assert q["tenants"][0]["in_use_gpus"] == 16 and q["tenants"][0]["borrowed_gpus"] == 8

    # vision comes back for 8 non-preemptible GPUs of its guarantee: the site is full, yet the broker sends
    # it there, and the site preempts nlp's newest borrowed jobs to admit it
    owner = (await (await client.post("/v1/jobs", json=job_body("vision", 8))).json())["id"]
    await wait_for(client, owner, {"running"})
    states = {}
    for job_id in borrowed:
        states[job_id] = await wait_for(client, job_id, {"running", "queued", "preempted"})
    requeued = [j for j in borrowed if states[j]["state"] != "running"]
    assert requeued == borrowed[2:], "the newest borrowed jobs are preempted first, and only as many as needed"
    events = await (await client.get(f"/v1/jobs/{borrowed[3]}/events")).json()
    preempted = [e for e in events["items"] if e["state"] == "preempted"]
    assert preempted and "reclaims its guarantee" in preempted[0]["reason"], events
    q = await (await client.get("/v1/sites/berlin/quota")).json()
    by = {t["tenant"]: t for t in q["tenants"]}
    assert by["vision"]["in_use_gpus"] == 8 and by["nlp"]["in_use_gpus"] == 8 and by["nlp"]["borrowed_gpus"] == 0
    # the preempted jobs wait: the site is full and nlp holds its guarantee
    await asyncio.sleep(0.3)
    for job_id in requeued:
        job = await (await client.get(f"/v1/jobs/{job_id}")).json()
        assert job["state"] == "queued" and job["run_s"] >= 0, job


async def test_mig_slices_and_shared_gpus_are_routed_to_sites_that_can_hold_them(broker_at):
    start, _ = broker_at
    client = await start()
    mig = site_body("alpha", "gcp:europe-west3", {"a100-80gb": 8})
    mig["gpus"][0]["mig_profiles"] = ["1g.10gb", "3g.40gb"]
    await register(client, mig)
    await register(client, site_body("beta", "gcp:europe-west3", {"a100-80gb": 16}))
    status = (await (await client.get("/v1/sites/alpha")).json())["status"]["capacity"][0]
    assert status["free_gpus"] == 0 and status["mig_free_slices"] == {"1g.10gb": 56, "3g.40gb": 16}

    sliced = await (await client.post("/v1/jobs", json={**job_body("vision", 2), "gpus": {
        "count": 2, "mig_profile": "3g.40gb"}})).json()
    whole = await (await client.post("/v1/jobs", json=job_body("vision", 4))).json()
    shared = await (await client.post("/v1/jobs", json={**job_body("nlp", 1), "gpus": {
        "shared": True, "memory_gib": 20}})).json()
    assert (await wait_for(client, sliced["id"], {"running"}))["site"] == "alpha"
    assert (await wait_for(client, whole["id"], {"running"}))["site"] == "beta"
    assert (await wait_for(client, shared["id"], {"running"}))["site"] == "beta"
    # what the sites report next: 14 = 8 GPUs x 2 slices less the two taken; 16 - 4 whole - 1 shared
    alpha = await reported(client, "alpha", lambda c: c["mig_free_slices"]["3g.40gb"] == 14)
    assert alpha["mig_free_slices"]["1g.10gb"] == 49  # one GPU holds 6 of 7 compute slices now
    beta = await reported(client, "beta", lambda c: c["free_gpus"] == 11)
    assert beta["shared_free_milli"] == 750  # the shared GPU has three quarters of its memory left


async def test_a_gang_the_site_cannot_keep_on_one_node_is_refused_there_and_placed_elsewhere(broker_at):
    start, _ = broker_at
    client = await start()
    await register(client, site_body("alpha", "gcp:europe-west3", {"a100-80gb": 8}) | {
        "gpus": [{"model": "a100-80gb", "gpus_per_node": 4, "nodes": 2}]})
    await register(client, site_body("beta", "gcp:europe-west3", {"a100-80gb": 8}))
    body = job_body("vision", 8)
    body["gpus"]["topology"] = "node"
    job = await (await client.post("/v1/jobs", json=body)).json()
    job = await wait_for(client, job["id"], {"running"})
    assert job["site"] == "beta"  # alpha (first by name) has 8 free, but on two nodes of 4
    events = await (await client.get(f"/v1/jobs/{job['id']}/events")).json()
    refusal = [e["reason"] for e in events["items"] if e["reason"] and "alpha refused" in e["reason"]]
    assert refusal and "alpha refused it: no room: 8 a100-80gb on one node needed; nodes here have at most 4; routing again" == refusal[0], events
    # the decision that placed it on beta says why alpha was skipped, in alpha's words
    decision = await (await client.get(f"/v1/jobs/{job['id']}/decision")).json()
    alpha = next(s for s in decision["sites"] if s["site"] == "alpha")
    assert alpha["reasons"] == ["site-refused: earlier, the site refused it: no room: 8 a100-80gb on "
                                "one node needed; nodes here have at most 4; it is skipped until conditions change"]


# --- the broker's view of quota state (pure: the site's own admission, its report, the pipeline) --------

from broker.models import GpuRequest, JobSpec, SiteState, TenantQuota  # noqa: E402
from policies.admission import Admitted, Refused, SiteAdmission  # noqa: E402
from policies.pipeline import choose_model, default_pipeline  # noqa: E402
from policies.snapshot import MODEL_INDEX, JobRequest, build_snapshot  # noqa: E402
from tests.builders import NOW, site  # noqa: E402

T0 = NOW.timestamp()


def spec_of(tenant: str, count: int, model: str | None = None, **more: Any) -> JobSpec:
    return JobSpec(tenant=tenant, name=f"{tenant}-{count}", gpus=GpuRequest(count=count, model=model),
                   duration_s=3600, **more)


def running(spec, jobs: list[tuple[str, JobSpec]]) -> tuple[SiteAdmission, SiteState]:
    """The site ``spec`` after admitting ``jobs`` in order (each must be admitted without victims), and what it
    reports to the broker."""
    admission = SiteAdmission(spec)
    for job_id, job in jobs:
        verdict = admission.admit(job_id, job, T0)
        assert isinstance(verdict, Admitted) and not verdict.victims, verdict
        admission.start(job_id, verdict, T0)
    capacity = [f.capacity() for _, f in sorted(admission.inventory.free().items())]
    return admission, SiteState(site=spec.name, health="healthy", last_heard_at=NOW, capacity=capacity,
                                quota=admission.report(T0))


def test_gpus_a_tenant_may_reclaim_count_as_free_for_it_once_per_pass():
    spec = site("alpha", gpus={"a100-80gb": 8}, quotas=[TenantQuota(tenant="x", guaranteed_gpus=8),
                                                      TenantQuota(tenant="y", burst_gpus=8)])
    admission, state = running(spec, [("y0", spec_of("y", 4, preemptible=True)),
                                      ("y1", spec_of("y", 4, preemptible=True))])
    snap = build_snapshot(NOW, [spec], {"alpha": state}).working_copy(NOW)
    pipeline = default_pipeline()
    x4 = JobRequest.from_spec("x4", spec_of("x", 4))
    first = pipeline.decide(x4, snap)
    assert first.placed  # 0 free, but 8 x's guarantee would reclaim from y
    assert len(admission.admit("x4", spec_of("x", 4), T0).victims) == 1  # and the site agrees: one of y's jobs
    snap.assume(first.site, x4, first.model)
    second = pipeline.decide(JobRequest.from_spec("x4b", spec_of("x", 4)), snap)
    assert second.placed  # the first took 4 of the 8, not all of them
    snap.assume(second.site, JobRequest.from_spec("x4b", spec_of("x", 4)), second.model)
    assert not pipeline.decide(JobRequest.from_spec("x1", spec_of("x", 1)), snap).placed
    # y may reclaim nothing (no guarantee); z is not listed: neither is sent to the full site
    assert not pipeline.decide(JobRequest.from_spec("y", spec_of("y", 1, preemptible=True)), snap).placed
    assert choose_model(JobRequest.from_spec("x", spec_of("x", 4)), build_snapshot(NOW, [spec], {"alpha": state}),
                        0) == MODEL_INDEX["a100-80gb"]  # the model choice counts reclaim like the filter does


def test_a_job_larger_than_the_guarantee_it_lacks_is_not_sent_to_reclaim():
    spec = site("alpha", gpus={"a100-80gb": 8}, quotas=[TenantQuota(tenant="x", guaranteed_gpus=4, burst_gpus=4),
                                                      TenantQuota(tenant="y", burst_gpus=8)])
    admission, state = running(spec, [("x0", spec_of("x", 2)), ("y0", spec_of("y", 4, preemptible=True))])
    snap = build_snapshot(NOW, [spec], {"alpha": state})
    pipeline = default_pipeline()
    # x holds 2 of its 4: 2 free + 2 it could reclaim = 4, but a 4-GPU job would take x past its guarantee,
    # which no reclaim may do; the site would refuse it, so the broker does not send it
    assert isinstance(admission.admit("x4", spec_of("x", 4), T0), Refused)
    assert not pipeline.decide(JobRequest.from_spec("x4", spec_of("x", 4)), snap).placed
    assert pipeline.decide(JobRequest.from_spec("x2", spec_of("x", 2)), snap).placed


def test_a_quota_on_one_model_does_not_limit_the_tenants_jobs_on_another():
    spec = site("alpha", gpus={"a100-80gb": 8, "h100-80gb": 8},
                quotas=[TenantQuota(tenant="vision", guaranteed_gpus=4, model="h100-80gb")])
    admission, state = running(spec, [("v0", spec_of("vision", 4, "h100-80gb"))])
    snap = build_snapshot(NOW, [spec], {"alpha": state})
    pipeline = default_pipeline()
    on_a100 = spec_of("vision", 2, "a100-80gb")
    assert isinstance(admission.admit("a", on_a100, T0), Admitted)
    assert pipeline.decide(JobRequest.from_spec("a", on_a100), snap).placed
    on_h100 = spec_of("vision", 2, "h100-80gb")
    assert isinstance(admission.admit("h", on_h100, T0), Refused)
    assert not pipeline.decide(JobRequest.from_spec("h", on_h100), snap).placed


def test_an_unreadable_overrides_file_is_set_aside_and_the_site_starts_from_its_config(tmp_path, caplog):
    from adapters.quota_store import QuotaOverrides

    path = tmp_path / "berlin" / "quota.json"
    path.parent.mkdir()
    path.write_text("{not json")
    overrides = QuotaOverrides(path)
    configured = [TenantQuota(tenant="vision", guaranteed_gpus=8)]
    assert overrides.apply(configured) == configured
    assert (tmp_path / "berlin" / "quota.json.unreadable").read_text() == "{not json"
    assert "cannot read the quota overrides" in caplog.text
    overrides.set(TenantQuota(tenant="vision", guaranteed_gpus=2))  # and it keeps changes again
    assert QuotaOverrides(path).apply(configured)[0].guaranteed_gpus == 2


def test_an_overrides_file_whose_key_names_another_tenant_is_set_aside_and_the_site_starts(tmp_path, caplog):
    from adapters.simulated import SimulatedSite
    from broker.clock import SystemClock
    from broker.models import SiteSpec

    spec = SiteSpec.model_validate(site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16},
                                             quotas=[{"tenant": "nlp", "guaranteed_gpus": 8}]))
    path = tmp_path / "berlin" / "quota.json"
    path.parent.mkdir()
    path.write_text('{"vision": {"tenant": "nlp", "guaranteed_gpus": 4}}')  # copied for nlp, key left as it was
    site = SimulatedSite(spec, SystemClock(), state_dir=tmp_path)
    assert [(t.tenant, t.guaranteed_gpus) for t in site._admission.report(0).tenants] == [("nlp", 8)]
    assert (tmp_path / "berlin" / "quota.json.unreadable").exists() and not path.exists()
    assert "entry 'vision' holds a quota for tenant 'nlp'" in caplog.text


async def test_quotas_changed_in_the_site_spec_apply_at_once_and_a_removed_site_forgets_its_changes(broker_at):
    start, _ = broker_at
    client = await start()
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS)
    await register(client, body)
    await client.put("/v1/sites/berlin/quota/vision", json={"guaranteed_gpus": 2})  # the operator's change
    changed = body | {"quotas": [{"tenant": "vision", "guaranteed_gpus": 6, "burst_gpus": 2}]}
    r = await client.put("/v1/sites/berlin", json=changed)
    assert r.status == 200, await r.text()
    q = await (await client.get("/v1/sites/berlin/quota")).json()
    assert [(t["tenant"], t["guaranteed_gpus"], t["burst_gpus"]) for t in q["tenants"] if t["listed"]] == [
        ("vision", 6, 2)]  # the latest change wins; nlp left the spec, so it left the site

    assert (await client.delete("/v1/sites/berlin")).status == 204
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))
    q = await (await client.get("/v1/sites/berlin/quota")).json()
    assert [(t["tenant"], t["guaranteed_gpus"]) for t in q["tenants"]] == [("nlp", 8), ("vision", 8)]


async def test_quotas_changed_in_the_config_file_while_the_broker_was_down_win_over_older_api_changes(tmp_path):
    async def start(vision: int, nlp: int) -> tuple[Broker, TestClient]:
        broker = Broker(BrokerSettings(db=str(tmp_path / "quota.db"), cycle_interval_s=0.05, shutdown_grace_s=1))
        await broker.start([SiteSpec.model_validate(site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=[
            {"tenant": "vision", "guaranteed_gpus": vision}, {"tenant": "nlp", "guaranteed_gpus": nlp}]))])
        client = TestClient(TestServer(create_app(broker)))
        await client.start_server()
        return broker, client

    async def guarantees(client: TestClient) -> dict[str, float]:
        q = await (await client.get("/v1/sites/berlin/quota")).json()
        return {t["tenant"]: t["guaranteed_gpus"] for t in q["tenants"]}

    broker, client = await start(vision=4, nlp=4)
    for tenant in ("vision", "nlp"):  # the operator's changes through the API, kept by the site
        assert (await client.put(f"/v1/sites/berlin/quota/{tenant}", json={"guaranteed_gpus": 6})).status == 200
    await client.close()
    await broker.stop()
    broker, client = await start(vision=4, nlp=4)  # the file as it was: the API's changes stay
    assert await guarantees(client) == {"nlp": 6, "vision": 6}
    await client.close()
    await broker.stop()
    broker, client = await start(vision=10, nlp=4)  # vision's edited in the file since: the latest change wins
    try:
        assert await guarantees(client) == {"nlp": 6, "vision": 10}
        spec = await (await client.get("/v1/sites/berlin")).json()
        assert {q["tenant"]: q["guaranteed_gpus"] for q in spec["quotas"]} == {"nlp": 4, "vision": 10}
    finally:
        await client.close()
        await broker.stop()


async def test_an_urgent_job_is_sent_to_a_full_site_where_it_preempts_lower_priority_work(broker_at):
    start, _ = broker_at
    client = await start()
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))  # no quotas at all
    low = (await (await client.post("/v1/jobs", json=job_body("a", 8, preemptible=True, checkpointable=True)))
           .json())["id"]
    await wait_for(client, low, {"running"})
    await reported(client, "berlin", lambda c: c["free_gpus"] == 0)
    urgent = (await (await client.post("/v1/jobs", json=job_body("b", 8, priority=10))).json())["id"]
    assert (await wait_for(client, urgent, {"running"}))["site"] == "berlin"
    low_job = await wait_for(client, low, {"queued", "preempted"})
    events = (await (await client.get(f"/v1/jobs/{low}/events")).json())["items"]
    assert any(e["state"] == "preempted" and "priority 10: preempts 1 job" in e["reason"] for e in events), events
    assert low_job["state"] in ("queued", "preempted")
    # a job of any priority is not sent there now: nothing there is preemptible
    peer = (await (await client.post("/v1/jobs", json=job_body("c", 4, priority=50))).json())["id"]
    await asyncio.sleep(0.3)
    assert (await (await client.get(f"/v1/jobs/{peer}")).json())["state"] == "queued"


def test_in_one_pass_a_low_priority_failure_does_not_fail_an_urgent_job_of_the_same_shape():
    from broker.cycle import PassDecider

    spec = site("alpha", gpus={"a100-80gb": 8})
    _, state = running(spec, [("low", spec_of("a", 8, preemptible=True))])
    decider = PassDecider(default_pipeline(), build_snapshot(NOW, [spec], {"alpha": state}).working_copy(NOW))
    first = decider.decide(JobRequest.from_spec("b0", spec_of("b", 4)))
    assert not getattr(first, "placed", False)  # nothing below priority 0 to preempt
    urgent = decider.decide(JobRequest.from_spec("b1", spec_of("b", 4, priority=5)))
    assert urgent.placed and urgent.site == 0


def test_a_site_built_with_a_quota_for_gpus_it_lacks_logs_it_and_starts(caplog):
    # A spec an earlier release stored (the API now refuses such a quota): the site says so in the log, once,
    # and counts the guarantee at what it has (the book names it: QuotaBook.beyond_site).
    from adapters.simulated import SimulatedSite
    from broker.clock import SystemClock
    from broker.models import SiteSpec

    spec = SiteSpec.model_validate(site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16},
                                             quotas=[{"tenant": "nlp", "guaranteed_gpus": 8, "model": "h100-80gb"}]))
    site = SimulatedSite(spec, SystemClock())
    assert [(t.tenant, t.guaranteed_gpus) for t in site._admission.report(0).tenants] == [("nlp", 0)]
    assert caplog.text.count("site berlin: tenant nlp's quota asks for GPUs this site does not have "
                             "(model: the site has no h100-80gb GPUs") == 1


def test_a_model_guarantee_counts_gpus_held_outside_the_book_as_taken_before_reclaiming_from_any_model_work():
    """A Kubernetes site holds the GPUs of Pods outside heliotrope in its inventory only, not in the quota
    book. A model guarantee may take an any-model tenant below its own guarantee only where that tenant could
    hold it on idle GPUs of other models: GPUs such Pods hold there are not idle."""
    spec = site("alpha", gpus={"h100-80gb": 8, "a100-80gb": 16},
                quotas=[TenantQuota(tenant="a", guaranteed_gpus=8, model="h100-80gb"),
                        TenantQuota(tenant="b", guaranteed_gpus=4)])

    def with_b_on_the_h100s() -> SiteAdmission:
        admission, _ = running(spec, [("b0", spec_of("b", 4, "h100-80gb", preemptible=True))])
        return admission

    admission = with_b_on_the_h100s()
    verdict = admission.admit("a0", spec_of("a", 8, "h100-80gb"), T0 + 3600)
    assert isinstance(verdict, Admitted) and verdict.victims == ("b0",)  # b can hold its 4 on the idle A100s
    admission = with_b_on_the_h100s()
    foreign = admission.inventory.find(GpuRequest(count=8), "a100-80gb")
    admission.inventory.commit("pod:ml/notebook-0", foreign)  # as adapters.kubernetes holds such Pods' GPUs
    admission.inventory.commit("pod:ml/notebook-1", admission.inventory.find(GpuRequest(count=8), "a100-80gb"))
    verdict = admission.admit("a0", spec_of("a", 8, "h100-80gb"), T0 + 3600)
    assert isinstance(verdict, Refused), verdict  # every A100 is held: b could not get its guarantee back


def test_weights_whose_sum_is_past_the_largest_number_still_divide_the_site_by_their_ratios() -> None:
    # Two tenants weighing 1e308 each summed to infinity, so each share beyond the guarantees came out 0.
    from broker.models import QuotaState
    from policies.fair_order import standings
    from policies.fairshare import Claim, divide

    claims = [Claim(0, 16, 1e308, 16), Claim(0, 16, 1e308, 16), Claim(0, 16, 0.5e308, 16)]
    assert divide(15, claims, k=1.0) == pytest.approx([6.0, 6.0, 3.0])
    report = QuotaState.model_validate({
        "enforced": True, "capacity_gpus": 16, "fair_share": {"mode": "time"},
        "tenants": [{"tenant": t, "fair_share_weight": 1e308} for t in ("nlp", "vision")]})
    assert {t: s.entitled for t, s in standings([report]).items()} == {"nlp": 8.0, "vision": 8.0}


def test_a_site_an_earlier_release_stored_with_a_fair_share_now_refused_still_loads() -> None:
    # The bound on reweight periods applies to what comes in; the broker must start on what it stored before.
    import json

    from broker.models import SiteSpec
    from broker.store import site_from_doc

    doc = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS,
                    fair_share={"window_h": 720, "reweight_h": 0.05})
    with pytest.raises(ValueError, match="14,400 periods, more than 10,000"):
        SiteSpec.model_validate(doc)
    assert site_from_doc(json.dumps(doc)).fair_share.reweight_h == 0.05


async def test_a_quotas_gpus_are_bounded_in_the_api_schema_and_an_earlier_releases_stored_burst_still_loads(
        broker_at) -> None:
    import json

    from broker.models import SiteSpec
    from broker.store import site_from_doc

    start, _ = broker_at
    client = await start()
    schema = (await (await client.get("/openapi.json")).json())["components"]["schemas"]["TenantQuota"]
    assert schema["properties"]["burst_gpus"]["maximum"] == 1_000_000
    assert schema["properties"]["guaranteed_gpus"]["maximum"] == 1_000_000
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS))
    r = await client.put("/v1/sites/berlin/quota/vision", json={"burst_gpus": 1_000_001})
    assert r.status == 422
    assert (await r.json())["error"]["fields"] == [
        {"field": "burst_gpus", "problem": "1,000,001 GPUs is more than the 1,000,000 a quota may give; a burst of the "
                                          "site's GPUs or more already sets no limit but the site"}]
    r = await client.put("/v1/sites/berlin/quota/vision", json={"burst_gpus": 1_000_000})
    assert r.status == 200, await r.text()
    doc = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16},
                    quotas=[{"tenant": "vision", "burst_gpus": 10**12}])
    with pytest.raises(ValueError, match="more than the 1,000,000 a quota may give"):
        SiteSpec.model_validate(doc)
    assert site_from_doc(json.dumps(doc)).quotas[0].burst_gpus == 10**12


async def test_a_fair_share_recomputed_so_often_it_would_stall_the_site_is_refused_naming_reweight_h(broker_at):
    # A recomputation walks the window's usage period by period: 2,160 h in periods of 0.36 s is 21.6 million.
    start, _ = broker_at
    client = await start()
    body = site_body("berlin", "gcp:europe-west3", {"a100-80gb": 16}, quotas=QUOTAS,
                     fair_share={"window_h": 2160, "reweight_h": 0.0001})
    r = await client.post("/v1/sites", json=body)
    assert r.status == 422
    (field,) = (await r.json())["error"]["fields"]
    assert field["field"] == "fair_share.reweight_h"  # (was fair_share: the model's check of its two fields)
    problem = field["problem"]
    assert "0.0001 h divides window_h (2160 h) into 21,600,000 periods, more than 10,000" in problem
    assert "(reweight_h at least 0.216 h)" in problem
    body["fair_share"]["reweight_h"] = 0.25
    assert (await client.post("/v1/sites", json=body)).status == 201


async def test_a_restarted_site_still_counts_the_usage_its_tenants_had_before(tmp_path, caplog):
    """The time-based fair share weighs each tenant's past usage: a restart of the broker (or of the site's
    agent) must not give the tenant that used the site all night a clean slate over the one that waited."""
    from datetime import UTC, datetime

    from adapters.simulated import SimulatedSite
    from broker.clock import ManualClock
    from broker.models import Job, SimulatedAdapterConfig
    from tests.builders import job, site

    clock = ManualClock(datetime(2026, 11, 30, tzinfo=UTC))
    spec = site("berlin", gpus={"a100-80gb": 16}, quotas=QUOTAS, adapter=SimulatedAdapterConfig(dispatch_delay_s=0))

    def vision(tenant: str, job_id: str, hours: float) -> Job:
        now = clock.now()
        return Job(id=job_id, spec=job(tenant=tenant, count=8, duration_s=hours * 3600), attempt=1, created_at=now,
                   updated_at=now)

    def usage(state) -> dict[str, float]:  # noqa: ANN001
        return {t.tenant: t.decayed_usage_gpu_h for t in state.quota.tenants}

    first = SimulatedSite(spec, clock, state_dir=tmp_path)
    await first.start()
    assert (await first.submit(vision("vision", "v-night", 6))).admitted
    await clock.advance(6 * 3600 + 60)
    assert (await first.submit(vision("vision", "v-morning", 4))).admitted
    await clock.advance(1800)
    before = usage(await first.snapshot())
    assert before["vision"] > 30 and before["nlp"] == 0
    await first.close()  # the broker stops (its running job is lost with the process, as a simulated site's is)

    second = SimulatedSite(spec, clock, state_dir=tmp_path)
    await second.start()
    assert usage(await second.snapshot()) == pytest.approx(before)
    await second.forget_quotas()  # the site leaves the federation: a new site of its name starts afresh
    await second.close()
    third = SimulatedSite(spec, clock, state_dir=tmp_path)
    assert usage(await third.snapshot()) == {"nlp": 0, "vision": 0}

    (tmp_path / "berlin" / "usage.json").write_text("{not json")  # edited by hand: set aside, the site starts
    fourth = SimulatedSite(spec, clock, state_dir=tmp_path)
    assert usage(await fourth.snapshot())["vision"] == 0
    assert (tmp_path / "berlin" / "usage.json.unreadable").exists() and "cannot read the usage history" in caplog.text


def test_a_site_preempts_a_checkpointable_job_before_newer_work_that_would_lose_its_whole_run():
    """Site admission hands the job spec's ``checkpointable`` to the quota book: of two preemptible jobs of the
    same priority, the one that writes a checkpoint as it stops goes, though it is the older."""
    from broker.models import SiteSpec
    from policies.admission import SiteAdmission
    from tests.builders import job

    spec = SiteSpec.model_validate(site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}, quotas=[
        {"tenant": "vision", "guaranteed_gpus": 0, "burst_gpus": 8}, {"tenant": "nlp", "guaranteed_gpus": 4}]))
    site = SiteAdmission(spec)
    t0 = 1_800_000_000.0
    for job_id, spec_, at in (("v-ckpt", job(tenant="vision", count=4, preemptible=True, checkpointable=True), t0),
                              ("v-plain", job(tenant="vision", count=4, preemptible=True), t0 + 3600)):
        admitted = site.admit(job_id, spec_, at)
        site.start(job_id, admitted, at)
    verdict = site.admit("n-1", job(tenant="nlp", count=4), t0 + 7200)
    assert verdict.victims == ("v-ckpt",) and verdict.reason.startswith("reclaims its guarantee")


async def test_the_files_quota_changes_wait_for_an_agents_site_that_answers_not_one_gone_silent(tmp_path):
    """An agent's site that reported once and then went silent was taken as able to take the config file's quota
    changes: each round of housekeeping then waited out the quota command's timeout for it."""
    from broker.federation import Member
    from broker.models import Health, SiteState, TenantQuota
    from tests.builders import site

    broker = Broker(BrokerSettings(db=str(tmp_path / "b.db")))
    spec = site("edge", adapter={"kind": "mqtt"}, quotas=[{"tenant": "vision", "guaranteed_gpus": 8}])
    broker._quota_passes = {"edge": {"vision": TenantQuota(tenant="vision", guaranteed_gpus=4)}}
    asked: list[str] = []

    async def pass_quotas(name, was):  # noqa: ANN001, ANN202
        asked.append(name)

    broker.federation.pass_quotas = pass_quotas
    broker._save_quota_passes = lambda: asyncio.sleep(0)
    heard = SiteState(site="edge", health=Health.HEALTHY)
    member = Member(spec=spec, adapter=None, state=heard, error="report failed: no heartbeat from the site's agent")
    await broker._pass_file_quotas(member)  # silent since its last report: not asked
    assert asked == [] and "edge" in broker._quota_passes
    member.error = None
    await broker._pass_file_quotas(member)  # it answers again
    assert asked == ["edge"] and broker._quota_passes == {}
