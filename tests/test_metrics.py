"""GET /metrics: Prometheus' text format, parsed by prometheus-client's own parser, with the figures an
operator reads: jobs by state and tenant, decisions (deferrals included), preemptions, the sites' GPUs,
carbon, price and health, and the estimated carbon and cost of the work running."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from broker.api import create_app
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.data.carbon import load_carbon
from broker.models import JobState, SimulatedAdapterConfig, Telemetry
from broker.providers import FileCarbonProvider
from broker.service import Broker
from tests.builders import job, site

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2022, 6, 15, 12, 20, tzinfo=UTC)  # inside the shipped carbon slice
FAST = SimulatedAdapterConfig(dispatch_delay_s=0.5)
LONDON = site("london", region="gcp:europe-west2", grid_zone="GB", timezone="Europe/London", adapter=FAST,
              gpus={"a100-80gb": 8}, usd_per_gpu_hour={"a100-80gb": 4.0})
TOKYO = site("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=FAST,
             gpus={"h100-80gb": 8})


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, sorted labels); the parser raises on anything not in the text format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
async def running(tmp_path: Path):
    clock = ManualClock(NOW)
    carbon = FileCarbonProvider(load_carbon(ROOT / "data" / "carbon"))
    settings = BrokerSettings.model_validate({"db": str(tmp_path / "m.db"), "shutdown_grace_s": 0.1,
                                              "carbon_forecast": {"history_h": 336},  # the slice holds 3 weeks
                                              "tenant_limits": {"vision": {"gpus": 100}}})
    broker = Broker(settings, clock=clock, carbon=carbon)
    await broker.start([LONDON, TOKYO], run_loop=False)
    await asyncio.wait_for(broker.signals.wait_ready(), 10)
    async with TestClient(TestServer(create_app(broker))) as client:
        yield broker, clock, client
    await broker.stop()


async def scrape(client: TestClient) -> dict:
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
    return samples(await r.text())


async def test_metrics_show_jobs_decisions_sites_and_the_cost_and_carbon_of_running_work(running):
    broker, clock, client = running
    for i in range(3):  # 2 GPUs each on london's A100s, the only model they name
        await broker.book.submit(job(tenant="vision", name=f"train-{i}", count=2, model="a100-80gb", duration_s=600))
    for i in range(2):  # no site has 16 GPUs of one model: unplaceable, one shape
        await broker.book.submit(job(tenant="nlp", name=f"huge-{i}", count=16, duration_s=600))
    await broker.cycle.run_once()
    await asyncio.sleep(0.05)
    await clock.advance(1.0)  # the simulated site admits and starts them
    await asyncio.sleep(0.05)
    await broker.federation.collect()
    m = await scrape(client)

    assert m[("heliotrope_jobs", (("state", "running"), ("tenant", "vision")))] == 3
    assert m[("heliotrope_jobs", (("state", "queued"), ("tenant", "nlp")))] == 2
    assert m[("heliotrope_tenant_gpus_held", (("tenant", "vision"),))] == 6  # (nlp's jobs hold none: queued)
    assert m[("heliotrope_tenant_gpus_limit", (("tenant", "vision"),))] == 100
    assert [k for k in m if k[0].startswith("heliotrope_tenant_gpus")] == [
        ("heliotrope_tenant_gpus_held", (("tenant", "vision"),)),
        ("heliotrope_tenant_gpus_limit", (("tenant", "vision"),))]
    assert m[("heliotrope_decisions_total", (("outcome", "placed"),))] == 3
    # one of the two huge jobs was decided: the other, of the same group, could not run either
    assert m[("heliotrope_decisions_total", (("outcome", "unplaceable"),))] == 1
    assert m[("heliotrope_queue_groups_skipped_total", ())] == 1
    assert m[("heliotrope_decision_seconds_count", ())] == 4
    assert m[("heliotrope_job_transitions_total", (("state", "running"),))] == 3

    assert m[("heliotrope_site_gpus", (("model", "a100-80gb"), ("site", "london")))] == 8
    assert m[("heliotrope_site_free_gpus", (("model", "a100-80gb"), ("site", "london")))] == 2
    assert m[("heliotrope_site_free_gpus", (("model", "h100-80gb"), ("site", "tokyo")))] == 8
    assert m[("heliotrope_site_healthy", (("site", "london"),))] == 1
    assert m[("heliotrope_site_telemetry_age_seconds", (("site", "london"),))] == 0
    assert m[("heliotrope_site_price_usd_per_gpu_hour", (("model", "a100-80gb"), ("site", "london")))] == 4.0

    # what routing sees now, from the shipped GB slice
    snap = broker.federation.freeze(clock.now())
    gb = float(snap.carbon_g_per_kwh[snap.index["london"]])
    assert 0 < gb < 1000
    assert m[("heliotrope_site_carbon_intensity_grams_per_kwh", (("site", "london"), ("zone", "GB")))] == gb
    # 6 A100s (400 W each) at GB's intensity, and at 4 USD an hour each
    assert m[("heliotrope_running_carbon_grams_per_hour", (("site", "london"),))] == pytest.approx(6 * 0.4 * gb)
    assert m[("heliotrope_running_cost_usd_per_hour", (("site", "london"),))] == pytest.approx(24.0)
    assert m[("heliotrope_running_cost_usd_per_hour", (("site", "tokyo"),))] == 0


async def test_a_site_running_gpus_it_has_no_price_for_has_no_running_cost(running):
    """Tokyo has no price for its H100s: with work running there, its running cost is unknown, and has no
    sample, rather than 0 USD an hour (which read as free GPUs). Nothing running costs 0, priced or not."""
    broker, clock, client = running
    assert (await scrape(client))[("heliotrope_running_cost_usd_per_hour", (("site", "tokyo"),))] == 0
    await broker.book.submit(job(tenant="vision", name="unpriced", count=4, model="h100-80gb", duration_s=600))
    await broker.cycle.run_once()
    await asyncio.sleep(0.05)
    await clock.advance(1.0)
    await asyncio.sleep(0.05)
    m = await scrape(client)
    assert m[("heliotrope_jobs", (("state", "running"), ("tenant", "vision")))] == 1
    assert ("heliotrope_running_cost_usd_per_hour", (("site", "tokyo"),)) not in m
    assert m[("heliotrope_running_cost_usd_per_hour", (("site", "london"),))] == 0
    snap = broker.federation.freeze(clock.now())
    jp = float(snap.carbon_g_per_kwh[snap.index["tokyo"]])  # its carbon is known: 4 H100s (700 W each)
    assert m[("heliotrope_running_carbon_grams_per_hour", (("site", "tokyo"),))] == pytest.approx(4 * 0.7 * jp)


async def test_finished_jobs_are_counted_by_state_and_tenant_and_leave_the_levels(running):
    broker, clock, client = running
    done, _ = await broker.book.submit(job(tenant="vision", name="short", count=1, duration_s=30))
    gone, _ = await broker.book.submit(job(tenant="nlp", name="cancel-me", count=1, duration_s=3000))
    await broker.cycle.run_once()
    await asyncio.sleep(0.05)
    await clock.advance(1.0)
    await asyncio.sleep(0.05)
    await broker.lifecycle.cancel(gone.id)
    await clock.advance(40.0)
    await asyncio.sleep(0.1)
    assert (await broker.book.get(done.id)).state == JobState.SUCCEEDED
    m = await scrape(client)
    assert m[("heliotrope_jobs_finished_total", (("state", "succeeded"), ("tenant", "vision")))] == 1
    assert m[("heliotrope_jobs_finished_total", (("state", "cancelled"), ("tenant", "nlp")))] == 1
    assert not [k for k in m if k[0] == "heliotrope_jobs"]  # nothing unfinished


async def test_a_site_gone_dark_is_reported_unhealthy(running):
    broker, clock, client = running
    await clock.advance(broker.federation.stale_after_s + 1)  # nothing collected since
    m = await scrape(client)
    assert m[("heliotrope_site_healthy", (("site", "tokyo"),))] == 0
    assert m[("heliotrope_site_telemetry_age_seconds", (("site", "tokyo"),))] >= broker.federation.stale_after_s


async def test_a_preemption_is_counted_for_the_site_that_preempted(running):
    broker, clock, client = running
    preemptions = ("heliotrope_preemptions_total", (("site", "london"),))
    low, _ = await broker.book.submit(job(tenant="nlp", name="low", count=8, model="a100-80gb", duration_s=3600,
                                          preemptible=True, checkpointable=True))
    await broker.cycle.run_once()
    await asyncio.sleep(0.05)
    await clock.advance(1.0)  # london admits and starts it: all 8 of its A100s
    await asyncio.sleep(0.05)
    assert (await broker.book.get(low.id)).state == JobState.RUNNING
    assert (await scrape(client)).get(preemptions, 0) == 0
    urgent, _ = await broker.book.submit(job(tenant="vision", name="urgent", count=8, model="a100-80gb",
                                             duration_s=600, priority=10))
    await broker.cycle.run_once(full=True)
    await asyncio.sleep(0.05)
    await clock.advance(1.0)  # london admits the urgent job, preempting the low one
    await asyncio.sleep(0.1)
    assert (await broker.book.get(urgent.id)).state == JobState.RUNNING
    assert (await broker.book.get(low.id)).state == JobState.QUEUED
    m = await scrape(client)
    assert m[preemptions] == 1
    assert ("heliotrope_preemptions_total", (("site", "tokyo"),)) not in m
    assert m[("heliotrope_job_transitions_total", (("state", "preempted"),))] == 1


GREEN_AT = datetime(2022, 6, 15, 2, 10, tzinfo=UTC)  # a dirty hour in Frankfurt and Tokyo (tests/test_timeshift.py)


@pytest.fixture
async def green(tmp_path: Path):
    """Frankfurt and Tokyo at an hour when waiting for a cleaner one pays, under the shipped carbon data."""
    clock = ManualClock(GREEN_AT)
    carbon = FileCarbonProvider(load_carbon(ROOT / "data" / "carbon"))
    settings = BrokerSettings.model_validate({"db": str(tmp_path / "g.db"), "shutdown_grace_s": 0.1,
                                              "carbon_forecast": {"history_h": 336}})
    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    sites = [site("frankfurt", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin", adapter=fast),
             site("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=fast)]
    broker = Broker(settings, clock=clock, carbon=carbon)
    await broker.start(sites, run_loop=False)
    await asyncio.wait_for(broker.signals.wait_ready(), 10)
    async with TestClient(TestServer(create_app(broker))) as client:
        yield broker, clock, client
    await broker.stop()


async def test_a_deferral_is_counted_once_per_decision(green):
    broker, clock, client = green
    deferred = ("heliotrope_decisions_total", (("outcome", "deferred"),))
    placed = ("heliotrope_decisions_total", (("outcome", "placed"),))
    assert (await scrape(client))[deferred] == 0
    j, _ = await broker.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                        deadline=GREEN_AT + timedelta(hours=30)))
    await broker.cycle.run_once(full=True)
    assert broker.cycle.deferred_until(j.id) is not None and (await broker.book.get(j.id)).state == JobState.QUEUED
    m = await scrape(client)
    assert m[deferred] == 1 and m[placed] == 0
    assert m[("heliotrope_decision_seconds_count", ())] == 1
    await clock.advance(600)  # within the hour a deferred job is not decided again
    await broker.cycle.run_once(full=True)
    assert (await scrape(client))[deferred] == 1


async def test_the_transitions_counter_counts_each_submitted_job_entering_queued(running):
    """Every ``transition`` event is counted in ``heliotrope_job_transitions_total`` by the state entered,
    the first one (``new -> queued``) too: it was left out, so the counter showed no job ever queued."""
    broker, clock, client = running
    seen = broker.events.follow(lambda e: e.type == "transition", after=None)
    for i in range(3):
        await broker.book.submit(job(tenant="vision", name=f"train-{i}", count=1, duration_s=600))
    await broker.cycle.run_once()
    await asyncio.sleep(0.05)
    await clock.advance(1.0)
    await asyncio.sleep(0.05)
    m = await scrape(client)
    entered: dict[str, int] = {}
    while not seen._sub.queue.empty():
        event = seen._sub.queue.get_nowait()
        entered[event.data["state"]] = entered.get(event.data["state"], 0) + 1
    seen.close()
    assert entered["queued"] == 3
    for state, n in entered.items():
        assert m[("heliotrope_job_transitions_total", (("state", state),))] == n, state


async def test_metrics_show_each_sites_hottest_gpu_and_the_share_of_its_gpus_held_down(running):
    broker, _, client = running
    await broker.federation.collect()
    member = broker.federation.members["london"]
    member.state = member.state.model_copy(update={"telemetry": Telemetry(
        temperature_c_max=84.0, **Telemetry.throttle_of([("hw_thermal",), ("sw_power_cap",), ("idle",), ()]))})
    m = await scrape(client)
    assert m[("heliotrope_site_gpu_temperature_max_celsius", (("site", "london"),))] == 84.0
    # one GPU of four held down by heat; the one at its own power cap is busy, not held down
    assert m[("heliotrope_site_gpus_throttled_ratio", (("site", "london"),))] == 0.25
    # tokyo's simulated site reads no clock-event reasons: no sample, rather than a made-up 0
    assert ("heliotrope_site_gpus_throttled_ratio", (("site", "tokyo"),)) not in m
