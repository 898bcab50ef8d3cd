"""The routing scorers and profiles on real data: which site wins, and why, at named hours.

Sites are the demo federation's (config/demo.yaml: real GCP prices and measured RTTs); intensities are the
shipped Electricity Maps slice (data/carbon, June 2022). Every site is healthy with all its GPUs free.
"""

from __future__ import annotations

from datetime import UTC, datetime
import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from broker import ids
from broker.config import load_config
from broker.data.carbon import load_carbon
from broker.models import Health, ModelCapacity, SiteState, Telemetry
from policies import explain
from policies.profiles import ProfileError, ProfilesConfig, pipeline_for, profile_pipeline
from policies.scorers.carbon import CarbonScorer
from policies.scorers.cost import CostScorer
from policies.scorers.follow_sun import FollowSunScorer, sun_elevation_sine
from policies.scorers.latency import LatencyScorer
from policies.scorers.telemetry import TelemetryScorer
from policies.snapshot import JobRequest, build_snapshot, replace_forecast

ROOT = Path(__file__).resolve().parents[1]
SITES = load_config(ROOT / "config" / "demo.yaml").sites
CARBON = load_carbon(ROOT / "data" / "carbon")
FRIDAY_1400 = datetime(2022, 6, 10, 14, tzinfo=UTC)  # 10:00 in Toronto, 15:00 London, 23:00 Tokyo, 00:00 Sydney


def snapshot(now: datetime, temperatures: dict[str, float] | None = None,
             throttled: dict[str, list[tuple[str, ...]]] | None = None):
    """The demo sites, all free; ``throttled``: a site's GPUs' clock-event reasons, one tuple per GPU."""
    states = {
        s.name: SiteState(site=s.name, health=Health.HEALTHY, capacity=[
            ModelCapacity(model=m, total_gpus=n, free_gpus=n, used_gpus=0, memory_gib_per_gpu=ids.GPU_MODEL_BY_ID[m].memory_gib)
            for m, n in s.total_gpus().items()],
            telemetry=Telemetry(temperature_c_max=(temperatures or {}).get(s.name, 0.0),
                                **Telemetry.throttle_of((throttled or {}).get(s.name, []))))
        for s in SITES
    }
    snap = build_snapshot(now, list(SITES), states)
    hour = now.replace(minute=0, second=0, microsecond=0)
    forecast = np.vstack([CARBON.series(next(s for s in SITES if s.name == n).grid_zone, hour, 48) for n in snap.sites])
    return replace_forecast(snap, forecast)


def request(**kw) -> JobRequest:
    base = dict(job_id="j", count=8, milli=1000, model="a100-80gb", memory_gib=0.0, allowed_regions=frozenset(),
                denied_regions=frozenset(), duration_s=2 * 3600.0)
    return JobRequest(**(base | kw))


def winner(weights: dict[str, float], req: JobRequest, snap) -> str:
    placement = pipeline_for(weights).decide(req, snap)
    assert placement.placed
    return snap.sites[placement.site]


def test_carbon_prefers_the_grid_cleanest_over_the_run_and_says_by_how_much() -> None:
    snap = snapshot(FRIDAY_1400)
    raw = dict(zip(snap.sites, CarbonScorer().raw(request(), snap)))
    # Sites with A100 80GB: ashburn (PJM), toronto (Ontario), frankfurt (DE), sydney (NSW).
    on = CARBON.series("CA-ON", FRIDAY_1400, 2).mean()
    assert raw["toronto"] == pytest.approx(8 * 0.4 * 2 * on / 1000)  # 8 GPUs × 400 W × 2 h × g/kWh
    assert winner({"carbon": 1.0}, request(), snap) == "toronto"
    assert raw["sydney"] > raw["frankfurt"] > raw["toronto"]


def test_cost_prefers_the_cheapest_price_for_the_model_with_room() -> None:
    snap = snapshot(FRIDAY_1400)
    raw = dict(zip(snap.sites, CostScorer().raw(request(), snap)))
    assert raw["toronto"] == pytest.approx(5.581 * 8 * 2)  # USD/GPU-h × GPUs × h
    assert raw["sydney"] == pytest.approx(7.192 * 8 * 2)
    assert winner({"cost": 1.0}, request(), snap) == "toronto"
    # An L4 job: Toronto's L4 at 0.778 beats London's 0.805 and Sydney's 0.883.
    assert winner({"cost": 1.0}, request(model="l4", count=1), snap) == "toronto"


def test_latency_prefers_the_nearest_site_and_the_objective_filters() -> None:
    snap = snapshot(FRIDAY_1400)
    from_europe = request(model=None, count=1, origin_region="gcp:europe-west1")
    raw = dict(zip(snap.sites, LatencyScorer().raw(from_europe, snap)))
    assert min(raw, key=raw.get) in ("london", "frankfurt")
    assert winner({"latency": 1.0}, from_europe, snap) == min(raw, key=raw.get)
    tight = request(model=None, count=1, origin_region="gcp:europe-west1", latency_slo_ms=20.0)
    placement = pipeline_for({"carbon": 1.0}).decide(tight, snap)
    allowed = {s for s, ms in raw.items() if ms <= 20.0}
    assert snap.sites[placement.site] in allowed  # carbon picks only among the sites within 20 ms
    assert allowed and allowed != set(snap.sites)


def test_offpeak_prefers_sites_outside_business_hours() -> None:
    snap = snapshot(FRIDAY_1400)
    raw = dict(zip(snap.sites, FollowSunScorer("offpeak").raw(request(duration_s=3600.0), snap)))
    # Friday 14:00 UTC: 10:00 in Ashburn and Toronto, 15:00 London, 16:00 Frankfurt (business hours);
    # 07:00 Los Angeles, 23:00 Tokyo, 00:00 Saturday Sydney (outside them).
    assert {s for s, v in raw.items() if v == 1.0} == {"losangeles", "tokyo", "sydney"}
    assert {s for s, v in raw.items() if v == 0.0} == {"ashburn", "toronto", "london", "frankfurt", "saopaulo"}
    assert winner({"follow_sun_offpeak": 1.0}, request(), snap) == "sydney"


def test_solar_follows_the_sun() -> None:
    # London at its solar noon near the June solstice: elevation 90 - 51.5 + 23.4 = 61.9 degrees.
    noon = datetime(2022, 6, 21, 12, 2, tzinfo=UTC).timestamp()
    assert sun_elevation_sine(np.array([51.5]), np.array([-0.13]), np.array([noon]))[0, 0] == pytest.approx(
        np.sin(np.radians(61.9)), abs=0.01)
    snap = snapshot(FRIDAY_1400)
    raw = dict(zip(snap.sites, FollowSunScorer("solar").raw(request(duration_s=3600.0), snap)))
    assert raw["tokyo"] == 0.0 and raw["sydney"] == 0.0  # night
    assert raw["london"] > 0.5 and raw["toronto"] > 0.5


def test_telemetry_penalises_hot_gpus() -> None:
    snap = snapshot(FRIDAY_1400, temperatures={"toronto": 85.0, "ashburn": 55.0})
    raw = dict(zip(snap.sites, TelemetryScorer().raw(request(), snap)))
    assert raw["toronto"] == pytest.approx(1.0) and raw["ashburn"] == 0.0
    assert winner({"carbon": 0.5, "telemetry": 1.0}, request(), snap) != "toronto"


def test_telemetry_penalises_gpus_held_down_by_heat_or_power_not_idle_ones() -> None:
    """Two sites at the same temperature: the one whose GPUs report thermal slowdown and a power cap loses to
    the one whose GPUs are merely idle; a site that reports no reasons at all gets no penalty."""
    held = [("sw_thermal",), ("sw_power_cap", "hw_slowdown"), (), ()]  # 2 of 4 GPUs held down
    idle = [("idle",)] * 4  # low clocks because nothing runs: not throttling
    snap = snapshot(FRIDAY_1400, temperatures={"london": 70.0, "ashburn": 70.0},
                    throttled={"london": held, "ashburn": idle})
    raw = dict(zip(snap.sites, TelemetryScorer().raw(request(), snap)))
    assert raw["london"] == pytest.approx(10 / 25 + 0.5)  # heat 0.4 plus half the GPUs held down
    assert raw["ashburn"] == pytest.approx(10 / 25)
    assert raw["toronto"] == 0.0  # reports no temperature and no reasons
    job = request(model="h100-80gb", count=1, allowed_regions=frozenset({"gcp:europe-west2", "gcp:us-east4"}))
    assert winner({"telemetry": 1.0}, job, snap) == "ashburn"


def test_profiles_rank_the_same_hour_differently() -> None:
    snap = snapshot(FRIDAY_1400)
    job = request(model=None, count=1, origin_region="gcp:asia-east1", duration_s=4 * 3600.0)
    chosen = {name: snap.sites[profile_pipeline(name).decide(job, snap).site] for name in ("green", "cheap", "fast")}
    assert chosen["green"] in ("toronto", "saopaulo")  # the two cleanest grids
    assert chosen["fast"] == "tokyo"  # nearest to Taiwan
    assert chosen["cheap"] != chosen["fast"]


def test_profiles_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="unknown scorer 'carbn'"):
        ProfilesConfig(definitions={"mine": {"weights": {"carbn": 1.0}}})
    with pytest.raises(ValidationError, match="weight must be a finite number >= 0"):
        ProfilesConfig(definitions={"mine": {"weights": {"carbon": -1.0}}})
    with pytest.raises(ValidationError, match="profile 'greener' is not defined"):
        ProfilesConfig(default="greener")
    config = ProfilesConfig(job_may_choose=["green"])
    assert config.choose(None) is None and config.choose("green") == "green"
    assert ProfilesConfig(default="green").choose(None) == "green"
    with pytest.raises(ProfileError, match="may not be chosen"):
        config.choose("fast")


@pytest.mark.parametrize("name", ["balanced", "green", "cheap", "fast"])
def test_a_job_in_a_federation_with_no_sites_is_unplaceable_under_every_built_in_profile(name: str) -> None:
    # balanced (follow_sun_offpeak) raised "zero-size array to reduction operation minimum": once the last
    # site was removed, every scheduling pass with a balanced job queued failed instead of leaving it queued.
    snap = build_snapshot(FRIDAY_1400, [], {})
    assert not profile_pipeline(name).decide(request(), snap).placed


def test_offpeak_counts_the_exact_share_of_the_run_outside_business_hours() -> None:
    # Friday 16:30 UTC is 17:30 in London (BST): a 2-hour job runs 30 minutes of business hours, 75 % outside.
    snap = snapshot(datetime(2022, 6, 10, 16, 30, tzinfo=UTC))
    raw = dict(zip(snap.sites, FollowSunScorer("offpeak").raw(request(duration_s=2 * 3600.0), snap)))
    assert raw["london"] == pytest.approx(0.75)
    # Tokyo: 01:30 to 03:30 on Saturday, all outside.
    assert raw["tokyo"] == pytest.approx(1.0)


def test_an_explanation_gives_no_raw_value_where_the_scorer_only_stood_in_for_an_unknown_one() -> None:
    """Toronto has no price and its zone no forecast: the carbon and cost scorers rank it after every known site
    with a stand-in (one more than the worst known value), which is no value in kg CO2e or USD. Its explanation
    gave that stand-in as the raw value; it gives none, as for a value that is not finite, and still ranks it
    last. So does a rejected site with no room (no power, no price: every site but those with A100-80GBs)."""
    sites = [s.model_copy(update={"usd_per_gpu_hour": {}}) if s.name == "toronto" else s for s in SITES]
    states = {s.name: SiteState(site=s.name, health=Health.HEALTHY, capacity=[
        ModelCapacity(model=m, total_gpus=n, free_gpus=n, used_gpus=0,
                      memory_gib_per_gpu=ids.GPU_MODEL_BY_ID[m].memory_gib) for m, n in s.total_gpus().items()])
        for s in sites}
    snap = build_snapshot(FRIDAY_1400, sites, states)
    forecast = np.vstack([np.full(48, np.nan) if n == "toronto" else
                          CARBON.series(next(s for s in SITES if s.name == n).grid_zone, FRIDAY_1400, 48)
                          for n in snap.sites])
    snap = replace_forecast(snap, forecast)
    req = request(count=2, model="a100-80gb")
    pipeline = pipeline_for({"carbon": 1.0, "cost": 0.5})
    placement = pipeline.decide(req, snap)
    decision = explain.render(explain.record(pipeline, placement, snap), req, {f.code: f for f in pipeline.filters}, 1)
    verdicts = {v.site: v for v in decision.sites}
    assert {v.site for v in decision.sites if v.feasible} == {"ashburn", "frankfurt", "sydney", "toronto"}
    toronto = verdicts["toronto"]
    assert [(t.scorer, t.raw, t.normalised) for t in toronto.terms] == [("carbon", None, 0.0), ("cost", None, 0.0)]
    assert toronto.score == min(v.score for v in decision.sites if v.feasible)
    raw = {t.scorer: dict(zip(snap.sites, t.raw.tolist())) for t in placement.terms}
    for name in ("ashburn", "frankfurt", "sydney"):  # the known values, as the scorers gave them
        terms = {t.scorer: t for t in verdicts[name].terms}
        assert terms["carbon"].raw == raw["carbon"][name] and terms["cost"].raw == raw["cost"][name]
        assert terms["carbon"].raw < 10 and terms["cost"].raw < 100
    assert verdicts["ashburn"].score == pytest.approx(sum(t.weighted for t in verdicts["ashburn"].terms))
    assert [(t.scorer, t.raw) for t in verdicts["london"].terms] == [("carbon", None), ("cost", None)]
    assert not verdicts["london"].feasible


def test_a_decision_recorded_by_the_release_before_explains_it_as_this_release_does() -> None:
    """A job's explanation is kept with it, so records an earlier broker stored must still read. That release
    kept version 2 (``tests/data/decision-record-v2.json``, written by 649430b for this decision: the
    normalised values and totals stored, a region name per site); this one keeps version 3 (raw values
    only, worked out again when read)."""
    stored = json.loads((ROOT / "tests" / "data" / "decision-record-v2.json").read_text())
    snap = snapshot(FRIDAY_1400, temperatures={"toronto": 85.0, "ashburn": 55.0})
    req = request(model=None, count=16, origin_region="gcp:europe-west3", duration_s=4 * 3600.0,
                  denied_regions=frozenset({"gcp:australia-southeast1"}))
    pipeline = pipeline_for({"carbon": 1.0, "cost": 0.5, "latency": 0.3, "free_gpus": 0.2, "follow_sun_offpeak": 0.2,
                             "follow_sun_solar": 0.1, "telemetry": 0.4})
    filters = {f.code: f for f in pipeline.filters}
    rec = explain.record(pipeline, pipeline.decide(req, snap), snap)
    assert (stored["v"], rec["v"]) == (2, 3)
    assert "totals" not in rec and not any("normalised" in t for t in rec["terms"])
    assert len(json.dumps(rec)) < len(json.dumps(stored))
    before, now = explain.render(stored, req, filters, 1), explain.render(rec, req, filters, 1)
    # The same explanation, but for the raw values that only stood in for unknown ones: london and toronto have
    # no room for 16 GPUs, so no power and no price; version 2 kept no word of it and shows the stand-ins.
    unknown = {(v.site, t.scorer) for v in now.sites for t in v.terms if t.raw is None}
    assert unknown == {(site, scorer) for site in ("london", "toronto") for scorer in ("carbon", "cost")}
    as_then = before.model_dump()
    for v in as_then["sites"]:
        for t in v["terms"]:
            if (v["site"], t["scorer"]) in unknown:
                t["raw"] = None
    assert now.model_dump() == as_then
    assert now.site == "losangeles" and now.summary.startswith("placed on losangeles")
    feasible = [v for v in now.sites if v.feasible]
    assert len(feasible) == 5 and len(now.sites) == 8
    rejected = {v.site: v.reasons for v in now.sites if not v.feasible}
    assert rejected.keys() == {"london", "toronto", "sydney"}
    assert rejected["sydney"] == ["region-not-allowed: region gcp:australia-southeast1 is denied by the job"]
    best = next(v for v in feasible if v.site == "losangeles")
    assert best.score == max(v.score for v in feasible)
    assert best.score == pytest.approx(sum(t.weighted for t in best.terms))
    with pytest.raises(ValueError, match="version 1 is not one this release reads"):
        explain.render({**rec, "v": 1}, req, filters, 1)
