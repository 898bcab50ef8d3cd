"""The room kept for latency-bound jobs (``ShiftPolicy.latency_reserve``, :mod:`policies.latency_reserve`):
what is learned from the hours seen, where work without a latency objective may then be deferred, and
the live cycle learning it from the jobs on its sites.

Sites and forecasts are tests/test_timeshift.py's: the demo federation, Ashburn (16 A100s) clean from hour 3
to 8, Toronto (8 A100s) medium all day; a job 40 ms from gcp:us-east1 may run only at Ashburn or Toronto.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cycle import PassDecider
from policies import latency_reserve
from policies.latency_reserve import LatencyDemand
from policies.profiles import ProfilesConfig
from policies.timeshift import Deferral, ShiftPolicy
from tests.test_timeshift import A100, FLAT, NOON, explained, frankfurt_and_tokyo, green, request, snapshot

SITES = ("a", "b")


def held(hour_values: list[list[float]]) -> LatencyDemand:
    """A demand that saw, hour after hour from POSIX hour 100, sites a and b (one model) hold these GPUs."""
    demand = LatencyDemand(window_h=24)
    for k, row in enumerate(hour_values):
        demand.observe(100 + k, SITES, np.array(row, dtype=np.float32)[:, None])
    return demand


def test_the_reserve_is_a_quantile_of_the_hours_seen_the_open_hour_left_out() -> None:
    demand = held([[0, 4], [2, 4], [8, 4], [2, 4], [30, 4]])  # hour 104 (30 GPUs at a) is still open
    samples = demand.samples(SITES, 1)
    assert samples.shape == (4, 2, 1)
    assert latency_reserve.reserve(samples, 1.0)[:, 0].tolist() == [8.0, 4.0]
    assert latency_reserve.reserve(samples, 0.5)[:, 0].tolist() == [2.0, 4.0]
    demand.observe(105, SITES, np.array([[0.0], [0.0]]))  # hour 104 is complete now
    assert latency_reserve.reserve(demand.samples(SITES, 1), 1.0)[:, 0].tolist() == [30.0, 4.0]


def test_an_hour_keeps_its_largest_sample_and_hours_without_one_hold_what_the_latest_saw() -> None:
    demand = LatencyDemand(window_h=24)
    demand.observe(100, SITES, np.array([[1.0], [5.0]]))
    demand.observe(100, SITES, np.array([[6.0], [2.0]]))  # a later pass in the same hour
    demand.observe(103, SITES, np.array([[0.0], [0.0]]))  # hours 101 and 102 saw no pass
    samples = demand.samples(SITES, 1)
    # hour 100: the larger of its two samples; 101 and 102: what the latest sample saw, sorted
    assert samples[:, 0, 0].tolist() == [6.0, 6.0, 6.0] and samples[:, 1, 0].tolist() == [2.0, 2.0, 5.0]
    demand.observe(90, SITES, np.array([[50.0], [50.0]]))  # a clock that stepped back is not believed
    assert latency_reserve.reserve(demand.samples(SITES, 1), 1.0)[:, 0].tolist() == [6.0, 5.0]


def test_samples_older_than_the_window_are_forgotten() -> None:
    demand = held([[20, 0]] + [[1, 0]] * 30)
    assert latency_reserve.reserve(demand.samples(SITES, 1), 1.0)[:, 0].tolist() == [1.0, 0.0]


def test_a_site_that_joins_has_no_reserve_and_one_that_stays_keeps_its_samples() -> None:
    demand = held([[3, 7], [3, 7]])
    demand.observe(102, ("b", "c"), np.array([[7.0], [9.0]]))
    demand.observe(103, ("b", "c"), np.array([[7.0], [9.0]]))
    reserve = latency_reserve.reserve(demand.samples(("b", "c"), 1), 0.5)[:, 0]
    assert reserve.tolist() == [7.0, 0.0]  # c: two hours of 0 before it joined, one of 9


def test_the_samples_survive_a_round_trip_through_their_stored_document() -> None:
    # Hours 100-134; a window of 24 h keeps 25 slots, so hours 100-109 are gone and 110-114 are next to go.
    demand = held([[50, 50]] * 15 + [[5, 5]] * 15 + [[0, 4], [2, 4], [8, 4], [2, 4], [30, 4]])
    doc = json.loads(json.dumps(demand.state()))
    back = LatencyDemand.restore(doc, window_h=24)
    assert back.hour == 134 and back.sites == SITES
    assert np.array_equal(back.samples(SITES, 1), demand.samples(SITES, 1))
    # Hours nobody saw (the broker was down until hour 140) are no samples: neither what hour 134 saw,
    # repeated, nor what their slots held a window ago.
    back.observe(140, SITES, np.array([[1.0], [1.0]]))
    assert latency_reserve.reserve(back.samples(SITES, 1), 1.0)[:, 0].tolist() == [30.0, 5.0]  # not 50: stale
    with pytest.raises(ValueError, match="cannot be read"):
        LatencyDemand.restore(doc | {"hour": [1]}, window_h=24)
    # Laid out for a third site that a pass saw: the samples come back in that layout.
    demand.samples(("a", "b", "c"), 1)
    wider = LatencyDemand.restore(json.loads(json.dumps(demand.state())), window_h=24)
    assert np.array_equal(wider.samples(("a", "b", "c"), 1), demand.samples(("a", "b", "c"), 1))
    with pytest.raises(ValueError, match="kept over 24 hours, not 168"):
        LatencyDemand.restore(doc)
    with pytest.raises(ValueError, match="cannot be read"):
        LatencyDemand.restore(doc | {"ring": "not base64!"}, window_h=24)
    with pytest.raises(ValueError, match="version 1"):
        LatencyDemand.restore({"v": 99}, window_h=24)


async def test_a_stored_demand_that_cannot_be_read_is_ignored_and_learned_again(live, caplog) -> None:
    from broker.cycle import LATENCY_DEMAND_STATE

    b, _ = live
    await b.store.put_state(LATENCY_DEMAND_STATE, '{"v": 1, "window_h": 168, "sites": ["frankfurt"]}')
    assert await b.cycle.restore_learned() is False
    assert "ignoring the stored latency demand" in caplog.text
    assert b.cycle.latency_reserve() == {}
    await b.cycle.run_once(full=True)  # the cycle goes on, and saves what it learns over the bad document
    assert json.loads(await b.store.get_state(LATENCY_DEMAND_STATE))["sites"] == ["frankfurt", "tokyo"]


def kept(snap, gpus: float, booked: np.ndarray | None = None):
    """``snap`` where latency-bound jobs have held ``gpus`` A100s at Ashburn every hour of the last day, and
    have ``booked`` (float[hours]) of them in the plan's hours."""
    samples = np.zeros((24, snap.n_sites, snap.total_gpus.shape[1]), dtype=np.float32)
    samples[:, snap.index["ashburn"], A100] = gpus
    near_booked = np.zeros(snap.plan_free.shape)
    if booked is not None:
        near_booked[snap.index["ashburn"], A100] = booked
    return replace(snap, near_samples=samples, near_booked=near_booked)


def test_deferred_work_leaves_the_room_latency_bound_jobs_need_at_a_clean_site() -> None:
    # Latency-bound jobs held 12 of Ashburn's 16 A100s: deferred work without a latency objective may plan
    # the other 4 in each of its clean hours. A first 4-GPU job takes them in hours 3-4; a second waits for
    # hours 5-6, though hours 3-4 still have 12 free; a latency-bound job is still deferred into those.
    snap = kept(snapshot(NOON, FLAT), 12.0)
    decider = PassDecider(green(latency_reserve=0.9), snap)
    first = decider.decide(request(job_id="a"))
    assert isinstance(first, Deferral) and (snap.sites[first.site], first.slot) == ("ashburn", 3)
    decider.reserve(first)
    second = decider.decide(request(job_id="b"))
    assert isinstance(second, Deferral) and (snap.sites[second.site], second.slot) == ("ashburn", 5)
    near = decider.decide(request(job_id="c", origin_region="gcp:us-east1", latency_slo_ms=40.0))
    assert isinstance(near, Deferral) and (snap.sites[near.site], near.slot) == ("ashburn", 3)
    # Without the reserve the second job takes Ashburn's clean hours too.
    plain = PassDecider(green(), snap)
    plain.reserve(plain.decide(request(job_id="a")))
    again = plain.decide(request(job_id="b"))
    assert isinstance(again, Deferral) and (snap.sites[again.site], again.slot) == ("ashburn", 3)


def test_a_site_turned_away_for_the_reserve_is_named_in_the_decision() -> None:
    # Ashburn is the cleanest all day, but latency-bound jobs held 14 of its 16 A100s: a 4-GPU job that
    # could wait starts now at Toronto instead, and its decision says why not Ashburn.
    forecast = {"toronto": [300.0] * 48, "ashburn": [100.0] * 48, "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}
    snap = kept(snapshot(NOON, forecast), 14.0)
    pipeline, req = green(latency_reserve=0.9), request()
    outcome = PassDecider(pipeline, snap).decide(req)
    assert outcome.placed and snap.sites[outcome.site] == "toronto"
    decision, text = explained(pipeline, outcome, snap, req)
    why = "it would take the room kept for latency-bound jobs: 14 a100-80gb GPUs at latency_reserve 0.9"
    assert f"turned away 1 that ranked above it: ashburn ({why})" in decision.summary
    assert next(v for v in decision.sites if v.site == "ashburn").passed_over == why
    # When no other site has room now, the job is deferred to the first room elsewhere (Toronto, once its
    # GPUs are no longer booked at 17:00), and the deferral says Ashburn was turned away for the reserve.
    full = kept(snapshot(NOON, forecast, free={"toronto": 0, "frankfurt": 0, "sydney": 0},
                         booked={"toronto": (8, 1, 5), "frankfurt": (16, 1, 97), "sydney": (8, 1, 97)}), 14.0)
    deferred = PassDecider(pipeline, full).decide(req)
    assert isinstance(deferred, Deferral) and (full.sites[deferred.site], deferred.slot) == ("toronto", 5)
    assert deferred.reason(full.sites).endswith(f"; turned away now: ashburn ({why})")
    decision, text = explained(pipeline, deferred, full, req)
    assert decision.outcome == "deferred" and f"turned away now: ashburn ({why})" in decision.summary
    assert next(v for v in decision.sites if v.site == "ashburn").passed_over == why


def test_a_priced_reserve_is_taken_only_where_it_saves_more_than_its_price() -> None:
    # Ashburn (100 g/kWh) saves 0.64 kg on Toronto (300) for a 2-hour, 4-GPU A100 run, but latency-bound jobs
    # held 14 of its 16 GPUs: a start now there takes 2 GPUs of the room kept in each of the 3 hours it
    # touches (6 GPU-hours). Priced at 0.05 kg per GPU-hour (0.3 kg) the room is worth taking; at 0.5 (3 kg)
    # it is not, and the job starts at Toronto as with the reserve as a bar.
    forecast = {"toronto": [300.0] * 48, "ashburn": [100.0] * 48, "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}
    snap = kept(snapshot(NOON, forecast), 14.0)
    where = {}
    for price in (None, 0.05, 0.5):
        outcome = PassDecider(green(latency_reserve=0.9, latency_reserve_price=price), snap).decide(request())
        assert outcome.placed and not isinstance(outcome, Deferral)
        where[price] = snap.sites[outcome.site]
    assert where == {None: "toronto", 0.05: "ashburn", 0.5: "toronto"}
    pipeline, req = green(latency_reserve=0.9, latency_reserve_price=0.5), request()
    decision, _ = explained(pipeline, PassDecider(pipeline, snap).decide(req), snap, req)
    assert next(v for v in decision.sites if v.site == "ashburn").passed_over == (
        "it would take the room kept for latency-bound jobs: 14 a100-80gb GPUs at latency_reserve 0.9, at 0.5 per "
        "GPU-hour taken, where a start elsewhere costs less")
    # Where no other site has room now, a cheap price lets the job start at Ashburn at once instead of
    # waiting for Toronto at 17:00; a dear one keeps it waiting, as the bar does.
    full = kept(snapshot(NOON, forecast, free={"toronto": 0, "frankfurt": 0, "sydney": 0},
                         booked={"toronto": (8, 1, 5), "frankfurt": (16, 1, 97), "sydney": (8, 1, 97)}), 14.0)
    cheap = PassDecider(green(latency_reserve=0.9, latency_reserve_price=0.05), full).decide(request())
    assert cheap.placed and not isinstance(cheap, Deferral) and full.sites[cheap.site] == "ashburn"
    dear = PassDecider(green(latency_reserve=0.9, latency_reserve_price=0.5), full).decide(request())
    assert isinstance(dear, Deferral) and (full.sites[dear.site], dear.slot) == ("toronto", 5)


def test_a_policy_without_the_reserve_or_a_snapshot_without_samples_keeps_nothing() -> None:
    snap = kept(snapshot(NOON, FLAT), 16.0)
    assert not isinstance(PassDecider(green(latency_reserve=1.0), snap).decide(request()), Deferral)  # all kept
    assert isinstance(PassDecider(green(), snap).decide(request()), Deferral)
    bare = snapshot(NOON, FLAT)
    assert isinstance(PassDecider(green(latency_reserve=1.0), bare).decide(request()), Deferral)


def test_a_latency_bound_job_decided_earlier_in_the_pass_counts_toward_the_reserve() -> None:
    # Reserve 12 of Ashburn's 16. An 8-GPU latency-bound job deferred into hours 3-4 holds 8 of the 12; the
    # 4-GPU job after it in the same pass may still plan the 4 the reserve leaves (16 - max(12, 8)).
    snap = kept(snapshot(NOON, FLAT), 12.0)
    decider = PassDecider(green(latency_reserve=0.9), snap)
    near = decider.decide(request(job_id="n", count=8, origin_region="gcp:us-east1", latency_slo_ms=40.0))
    assert isinstance(near, Deferral) and (snap.sites[near.site], near.slot) == ("ashburn", 3)
    decider.reserve(near)
    assert snap.near_booked[snap.index["ashburn"], A100, 3:5].tolist() == [8.0, 8.0]
    other = decider.decide(request(job_id="o"))
    assert isinstance(other, Deferral) and (snap.sites[other.site], other.slot) == ("ashburn", 3)
    # A latency-bound job started now counts from hour 0, and stops counting when it is released.
    toronto = snap.index["toronto"]
    now = request(job_id="m", count=2, slack_h=None, origin_region="gcp:us-east1", latency_slo_ms=40.0)
    decider.snap.assume(toronto, now, A100)
    assert snap.near_booked[toronto, A100, :4].tolist() == [2.0, 2.0, 2.0, 0.0]  # 12:20 to 14:20
    decider.snap.release(toronto, now, A100)
    assert not snap.near_booked[toronto].any()


def test_the_calendar_counts_latency_bound_bookings_on_their_own() -> None:
    from policies.timeshift import Calendar, epoch_hour

    h0 = epoch_hour(NOON)
    calendar = Calendar(2, 3, h0, span_h=8)
    near = calendar.book(0, 1, 4.0, h0 + 1, h0 + 3, near=True)
    calendar.book(0, 1, 2.0, h0, h0 + 5)
    view = calendar.near_view(NOON, 6)
    assert view[0, 1].tolist() == [0.0, 4.0, 4.0, 0.0, 0.0, 0.0]
    view[0, 1, 1] = 99.0  # a pass's copy: debiting it does not touch the calendar
    assert calendar.near_view(NOON, 6)[0, 1, 1] == 4.0
    calendar.release(near, from_h=h0 + 2)
    assert calendar.near_view(NOON, 6)[0, 1].tolist() == [0.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    # Far ahead (more than the calendar's span, less than twice it): the past is dropped, nothing is kept.
    later = NOON + timedelta(hours=12)
    calendar.book(0, 1, 1.0, h0 + 12, h0 + 14, near=True)
    assert calendar.near_view(later, 4)[0, 1].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert calendar.view(later, np.zeros((2, 3)), np.full((2, 3), 8), 4)[0, 1, 1:].tolist() == [7.0, 8.0, 8.0]


@settings(max_examples=60, deadline=None)
@given(reserve=st.integers(0, 16), near=st.integers(0, 16), other=st.integers(0, 16), need=st.integers(1, 8))
def test_work_without_a_latency_objective_plans_at_most_what_neither_the_reserve_nor_latency_bound_jobs_hold(
        reserve: int, near: int, other: int, need: int) -> None:
    # Nested limits: whatever latency-bound jobs have booked of Ashburn's 16 A100s in the clean hours, work
    # without a latency objective may be planned there only while it holds at most 16 - max(reserve, booked).
    if near + other > 16:
        return
    hours = 97
    snap = snapshot(NOON, FLAT | {"toronto": [700.0] * 48},
                    booked={"ashburn": (near + other, 1, hours)})
    snap = kept(snap, float(reserve), np.r_[0.0, np.full(hours - 1, float(near))])
    outcome = PassDecider(green(latency_reserve=1.0), snap).decide(request(count=need))
    fits = other + need <= 16 - max(reserve, near)
    at_ashburn = isinstance(outcome, Deferral) and snap.sites[outcome.site] == "ashburn" and outcome.slot == 3
    assert at_ashburn == fits


def test_the_settings_are_validated_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="latency_reserve"):
        ShiftPolicy(latency_reserve=1.5)
    with pytest.raises(ValueError, match="latency_reserve_price"):
        ShiftPolicy(latency_reserve=0.9, latency_reserve_price=-1.0)
    with pytest.raises(ValueError, match="max_risk needs miss_cost"):
        ShiftPolicy(max_risk=0.05)
    with pytest.raises(ValueError, match="latency_reserve_price needs latency_reserve"):  # a price of nothing kept
        ShiftPolicy(latency_reserve_price=0.2)
    profiles = ProfilesConfig.model_validate(
        {"definitions": {"green-near": {"weights": {"carbon": 1.0},
                                        "shift": {"latency_reserve": 0.9, "miss_cost": 30, "max_risk": 0.05}}}})
    assert profiles.shift("green-near").latency_reserve == 0.9 and profiles.shift("green-near").max_risk == 0.05


LIVE_SETTINGS = dict(
    site_extra={"frankfurt": {"rtt_ms": {"gcp:europe-west3": 2.0}}, "tokyo": {"rtt_ms": {"gcp:europe-west3": 230.0}}},
    profiles={"job_may_choose": ["green", "green-near"], "definitions": {"green-near": {
        "weights": {"carbon": 1.0}, "shift": {"miss_cost": 30, "latency_reserve": 0.9}}}})


@pytest.fixture
async def live(tmp_path):
    """Frankfurt 2 ms from gcp:europe-west3, Tokyo far from it; profile green-near keeps the reserve."""
    b, clock = await frankfurt_and_tokyo(tmp_path, **LIVE_SETTINGS)
    yield b, clock
    await b.stop()


async def test_the_live_cycle_learns_what_latency_bound_jobs_hold_at_each_site(live, tmp_path) -> None:
    # A job 50 ms from Frankfurt's region may run only there; it holds 6 of Frankfurt's 8 A100s for five
    # hours. The pass's plan learns that, hour by hour, and keeps those GPUs from deferred work (a profile
    # that keeps the reserve: green-near here).
    from broker.models import JobState
    from tests.builders import job

    b, clock = live
    near, _ = await b.book.submit(job(count=6, profile="green-near", duration_s=5 * 3600,
                                      origin_region="gcp:europe-west3", latency_slo_ms=50.0))
    async def step(seconds: float) -> None:  # as tests/test_cycle.py's Harness: the clock, then the writes
        await clock.advance(seconds)
        await asyncio.sleep(0.05)
        await b.cycle.drain()

    await b.cycle.run_once(full=True)
    await step(1.0)  # the simulated site starts it after a second
    for _ in range(3):
        await b.cycle.run_once(full=True)
        await step(3600)
    placed = await b.book.get(near.id)
    assert placed.state.on_site and placed.site == "frankfurt" and placed.state != JobState.QUEUED
    snap = b.cycle._with_plan(b.federation.freeze(clock.now()))
    fra, tyo = snap.index["frankfurt"], snap.index["tokyo"]
    reserve = latency_reserve.reserve(snap.near_samples, 0.9)
    assert reserve[fra, A100] == 6.0 and reserve[tyo].sum() == 0.0
    assert snap.near_booked[fra, A100, 0] == 6.0  # it still holds them this hour
    assert snap.near_booked[fra, A100, 3] == 0.0  # it is expected to end by then: the reserve is kept free
    # Operators see it on /metrics, at each quantile a profile keeps (green-near's 0.9, green's 1.0).
    assert b.cycle.latency_reserve() == {("frankfurt", A100, 0.9): 6.0, ("frankfurt", A100, 1.0): 6.0}
    from prometheus_client import generate_latest

    scraped = generate_latest(b.metrics.registry).decode()
    assert ('heliotrope_site_latency_reserve_gpus{model="a100-80gb",quantile="0.9",site="frankfurt"} 6.0'
            in scraped)
    # A broker that restarts on the same database keeps what was learned: the reserve holds before its
    # first pass, instead of being learned again hour by hour.
    await b.stop()
    again, _ = await frankfurt_and_tokyo(tmp_path, **LIVE_SETTINGS)
    try:
        assert again.cycle.latency_reserve() == {("frankfurt", A100, 0.9): 6.0, ("frankfurt", A100, 1.0): 6.0}
    finally:
        await again.stop()


def test_in_a_replay_the_room_kept_lets_a_job_near_its_users_start_at_once(tmp_path) -> None:
    """Site a (GB, 300 g/kWh) is the only site near europe-west2; c (DE, 400) and b (FR, 500) are not. For
    two days latency-bound jobs keep a's four A100s busy. Then X (4 GPUs, 20 h, no latency objective) arrives
    when a is free and cleanest, and Q (4 GPUs, 2 h, near europe-west2, due 2 h after it arrives) an hour
    later. As shipped, green starts X at a and Q waits twenty hours past its deadline; keeping the room
    latency-bound jobs were seen to need, X runs at c and Q starts at once."""
    from dataclasses import replace as with_

    from broker.simulation import engine
    from broker.simulation.run import prepare
    from policies.profiles import BUILTIN, SHIFTS, pipeline_for
    from tests.test_migration import H, _three_sites

    stream = "".join(f"2022-06-{1 + k // 12:02d}T{2 * (k % 12):02d}:00:00,7200,4,near\n" for k in range(24))
    rows = stream + "2022-06-03T00:00:00,72000,4,x\n2022-06-03T01:00:00,7200,4,q\n"
    prep = prepare(_three_sites(tmp_path, rows))
    w = prep.workload
    n = len(w)
    near = np.array([True] * 24 + [False, True])
    deadline = w.deadline_s.copy()
    deadline[25] = w.submit_s[25] + 2 * H
    w = with_(w, latency_slo_ms=np.where(near, 20.0, np.nan), deadline_s=deadline,
              origin_region=np.full(n, w.region_names.index("gcp:europe-west2"), dtype=w.origin_region.dtype))
    runs = {}
    for label, reserve in (("as shipped", None), ("room kept", 0.9)):
        pipeline = pipeline_for(BUILTIN["green"], SHIFTS["green"].model_copy(update={"latency_reserve": reserve}))
        runs[label] = engine.replay("green", pipeline, w, prep.federation, engine.requests_of(w),
                                    np.zeros(n, dtype=bool))
    sites = prep.federation.base.sites
    shipped, kept_ = runs["as shipped"], runs["room kept"]
    assert sites[shipped.site[24]] == "a" and shipped.end_s[25] > w.deadline_s[25] + 10 * H
    assert sites[kept_.site[24]] == "c" and kept_.start_s[25] == w.submit_s[25]
    assert kept_.end_s[25] <= w.deadline_s[25]
    assert (kept_.site[:24] == shipped.site[:24]).all() and (kept_.end_s[:24] == shipped.end_s[:24]).all()
