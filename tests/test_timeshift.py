"""Time-shifting: which jobs are deferred, to which site and hour, and why; the plan that keeps deferred
jobs from being promised the same GPUs; and the live cycle deferring a job and deciding it again.

Sites are the demo federation's (config/demo.yaml: real prices and RTTs); forecasts are either the shipped
Electricity Maps slice (data/carbon, June 2022) or stated here, so the expected winner can be read off.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import load_config
from broker.cli import show_decision
from broker.cycle import PassDecider
from broker.data.carbon import load_carbon
from broker.models import Health, ModelCapacity, SiteState
from broker import ids
from policies import explain
from policies.profiles import BUILTIN, pipeline_for
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest, build_snapshot, replace_forecast
from policies.timeshift import Calendar, Deferral, ShiftPolicy, epoch_hour, run_slots

ROOT = Path(__file__).resolve().parents[1]
SITES = load_config(ROOT / "config" / "demo.yaml").sites
CARBON = load_carbon(ROOT / "data" / "carbon")
NOON = datetime(2022, 6, 10, 12, 20, tzinfo=UTC)
A100 = MODEL_INDEX["a100-80gb"]  # at ashburn (16), toronto (8), frankfurt (16) and sydney (8)


def snapshot(now: datetime, forecast: dict[str, list[float]] | None = None, plan_hours: int = 97,
             free: dict[str, int] | None = None, booked: dict[str, tuple[int, int, int]] | None = None):
    """The demo federation with every GPU free (or ``free`` A100s per site), the given hourly forecasts
    (default: the real data from now's hour), and a plan in which ``booked`` site -> (gpus, first hour
    offset, end hour offset) is already promised."""
    states = {
        s.name: SiteState(site=s.name, health=Health.HEALTHY, capacity=[
            ModelCapacity(model=m, total_gpus=n, free_gpus=(free or {}).get(s.name, n) if m == "a100-80gb" else n,
                          used_gpus=0, memory_gib_per_gpu=ids.GPU_MODEL_BY_ID[m].memory_gib)
            for m, n in s.total_gpus().items()])
        for s in SITES
    }
    snap = build_snapshot(now, list(SITES), states)
    hour = now.replace(minute=0, second=0, microsecond=0)
    rows = []
    for name in snap.sites:
        if forecast is not None and name in forecast:
            rows.append(np.asarray(forecast[name], dtype=np.float64))
        else:
            zone = next(s for s in SITES if s.name == name).grid_zone
            rows.append(CARBON.series(zone, hour, 48))
    snap = replace_forecast(snap, np.vstack(rows))
    calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(now))
    for name, (gpus, lo, hi) in (booked or {}).items():
        calendar.book(snap.index[name], A100, gpus, epoch_hour(now) + lo, epoch_hour(now) + hi)
    return replace(snap, plan_free=calendar.view(now, snap.free_gpus, snap.total_gpus, plan_hours))


def request(hours: float = 2.0, slack_h: float | None = 24.0, count: int = 4, **kw) -> JobRequest:
    deadline = None if slack_h is None else NOON.timestamp() + (hours + slack_h) * 3600.0
    base = dict(job_id="j", count=count, milli=1000, model="a100-80gb", memory_gib=0.0, allowed_regions=frozenset(),
                denied_regions=frozenset(), duration_s=hours * 3600.0, deadline_ts=deadline)
    return JobRequest(**(base | kw))


def green(**shift) -> PassDecider:
    return pipeline_for(BUILTIN["green"], ShiftPolicy(**shift))


def decide(pipeline, req, snap):
    return PassDecider(pipeline, snap).decide(req)


# Ashburn is dirty now and clean from hour 3 to 8; Toronto is medium all day; the others are dirty.
FLAT = {"toronto": [300.0] * 48, "ashburn": [500.0] * 3 + [100.0] * 5 + [500.0] * 40,
        "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}


@pytest.mark.parametrize(
    ("case", "req", "shift", "expected"),
    [
        ("a flexible job waits three hours for ashburn's clean hours", request(), {}, ("ashburn", 3)),
        ("a job without a deadline starts now", request(slack_h=None), {}, ("toronto", 0)),
        ("a job whose latest start is before the next hour starts now", request(slack_h=1.5), {}, ("toronto", 0)),
        ("deferral stops at the latest start: deadline - 1.5 × the estimate",
         request(hours=2.0, slack_h=3.5), {}, ("toronto", 0)),
        ("a saving below min_saving is not worth the wait", request(), {"min_saving": 0.7}, ("toronto", 0)),
        ("a job submitted two weeks ago is not deferred again, however much it would save",
         request(submitted_ts=NOON.timestamp() - 336 * 3600.0 + 1800.0), {}, ("toronto", 0)),
        ("the cost objective does not wait when prices do not change", request(), {"objective": "cost"},
         ("toronto", 0)),
        ("a wait within max_wait_factor × the estimate (2 × 2 h) is taken",
         request(submitted_ts=NOON.timestamp()), {"max_wait_factor": 2.0}, ("ashburn", 3)),
        ("a wait past max_wait_factor × the estimate (1 × 2 h: 14:20, before ashburn's 15:00) is not",
         request(submitted_ts=NOON.timestamp()), {"max_wait_factor": 1.0}, ("toronto", 0)),
        ("a saving of 0.64 kg clears min_saving_abs 0.5 kg", request(), {"min_saving_abs": 0.5}, ("ashburn", 3)),
        ("a saving of 0.64 kg is not worth a wait below min_saving_abs 1 kg", request(), {"min_saving_abs": 1.0},
         ("toronto", 0)),
        ("a job that asks to start at once starts now, whatever its deadline leaves",
         request(slack_h=72.0, deferrable=False), {}, ("toronto", 0)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_who_is_deferred_where_and_until_when(case, req, shift, expected) -> None:
    snap = snapshot(NOON, FLAT)
    outcome = decide(green(**shift), req, snap)
    site, slot = expected
    if slot == 0:
        assert outcome.placed and snap.sites[outcome.site] == site, case
    else:
        assert isinstance(outcome, Deferral), case
        assert (snap.sites[outcome.site], outcome.slot) == (site, slot)
        assert outcome.start == datetime(2022, 6, 10, 15, tzinfo=UTC)
        reason = outcome.reason(snap.sites)
        assert reason.startswith("deferred until 2022-06-10T15:00Z because carbon forecast on ashburn")
        assert "starting now on toronto" in reason


def test_the_deferral_names_both_forecasts_and_the_saving() -> None:
    snap = snapshot(NOON, FLAT)
    outcome = decide(green(), request(), snap)
    kw = 4 * TDP_KW[A100]
    then = kw * 2 * 100.0 / 1000.0  # two hours at 100 g/kWh
    now = kw * 2 * 300.0 / 1000.0  # toronto from 12:20 for two hours at 300 g/kWh
    assert outcome.value_then == pytest.approx(then)
    assert outcome.value_now == pytest.approx(now)
    assert f"({1 - then / now:.0%} less)" in outcome.reason(snap.sites)


def test_the_decision_a_user_reads_gives_the_plan_its_forecasts_and_both_chances_of_a_miss() -> None:
    snap = snapshot(NOON, FLAT)
    req = request()
    outcome = decide(green(), req, snap)
    decision, _ = explained(green(), outcome, snap, req)
    body = decision.model_dump(mode="json")["deferral"]  # as GET /v1/jobs/{id}/decision answers it
    kw = 4 * TDP_KW[A100]
    assert body["site"] == "ashburn" and body["start"] == "2022-06-10T15:00:00Z" and body["objective"] == "carbon"
    assert body["value_then"] == pytest.approx(kw * 2 * 100.0 / 1000.0)
    assert body["value_now"] == pytest.approx(kw * 2 * 300.0 / 1000.0) and body["now_site"] == "toronto"
    assert body["room_price_now"] is None  # no room is kept for latency-bound jobs here
    assert body["deadline_risk"] is None  # no finished jobs yet to price the risk from
    placed = decide(green(), request(slack_h=72.0, deferrable=False), snap)
    assert explained(green(), placed, snap, request(slack_h=72.0, deferrable=False))[0].deferral is None


def test_a_plan_full_at_the_clean_hour_sends_the_job_to_the_next_best_start() -> None:
    # Ashburn's A100s are promised from hour 3 to 5 to deferred jobs: the next 2-hour window with room is
    # hours 5-7, still clean.
    snap = snapshot(NOON, FLAT, booked={"ashburn": (16, 3, 5)})
    outcome = decide(green(), request(), snap)
    assert isinstance(outcome, Deferral) and (snap.sites[outcome.site], outcome.slot) == ("ashburn", 5)


def explained(pipeline, outcome, snap, req):
    """The decision a user reads for ``outcome`` (``GET /v1/jobs/{id}/decision``), and the CLI's text of it."""
    rec = (explain.record_deferral(pipeline, outcome, snap) if isinstance(outcome, Deferral)
           else explain.record(pipeline, outcome, snap))
    decision = explain.render(rec, req, {f.code: f for f in pipeline.filters}, 1)
    return decision, show_decision(decision.model_dump(mode="json"))


def test_a_start_now_moved_off_the_profiles_choice_names_the_site_turned_away_and_why() -> None:
    # Flat forecasts, Toronto the cleanest: the profile picks it, but its 8 A100s are booked from 13:00 (the
    # next hour) by running or deferred jobs, so a 2-hour run from 12:20 would take them. Nothing is saved by
    # waiting: the job starts now at the best-scoring site whose run fits, Ashburn, and says why not Toronto.
    flat = {"toronto": [300.0] * 48, "ashburn": [500.0] * 48, "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}
    snap = snapshot(NOON, flat, booked={"toronto": (8, 1, 97)})
    req = request()
    outcome = decide(green(), req, snap)
    assert outcome.placed and snap.sites[outcome.site] == "ashburn"
    decision, text = explained(green(), outcome, snap, req)
    verdicts = {v.site: v for v in decision.sites}
    assert verdicts["toronto"].score > verdicts["ashburn"].score
    why = "its a100-80gb GPUs are booked from 2022-06-10T13:00Z, within this run's expected 2 h, by running or deferred jobs"
    assert verdicts["toronto"].passed_over == why and verdicts["ashburn"].passed_over is None
    assert decision.summary.startswith("placed on ashburn (a100-80gb, score ")
    assert f"once the plan turned away 1 that ranked above it: toronto ({why})" in decision.summary
    assert "tied" not in decision.summary  # a better score is not a tie
    assert f"turned away now: {why}" in text
    # The profile's own choice, where it fits, carries no such note.
    free = snapshot(NOON, flat)
    plain = decide(green(), req, free)
    assert snap.sites[plain.site] == "toronto" and not plain.passed_over
    assert "turned away" not in explained(green(), plain, free, req)[0].summary


@pytest.mark.parametrize("profile", ["balanced", "green", "cheap"])
def test_after_warm_up_a_job_whose_site_is_booked_compiles_nothing_in_the_pass(profile: str) -> None:
    """warm_up never reached the walk over the profile's sites in score order (the profile's choice booked
    in the plan): the first such job of a fresh deployment waited about 2 s for Numba in the scheduling pass,
    once per objective and per named or chosen model (seen as 400 decisions/s in a first benchmark run)."""
    from policies import _shift_search
    from policies.profiles import profile_pipeline
    from policies.timeshift import warm_up

    warm_up()
    pipeline = profile_pipeline(profile)
    compiled = len(_shift_search.walk_now.signatures)
    flat = {"toronto": [300.0] * 48, "ashburn": [500.0] * 48, "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}
    snap = snapshot(NOON, flat, booked={"toronto": (8, 1, 97)})
    for kw in ({}, {"model": None}, {"model": None, "milli": 500, "count": 1}, {"milli": 500, "count": 1},
               {"model": None, "memory_gib": 40.0}):
        decide(pipeline, request(**kw), snap)
    assert len(_shift_search.walk_now.signatures) == compiled


def test_a_start_now_turned_away_for_the_headroom_says_so() -> None:
    # Toronto, the cleanest, has its 8 A100s free, but a 7-GPU job that could wait would leave fewer than a
    # quarter of them for work that cannot: it starts now at Ashburn (16 free), which keeps its headroom.
    flat = {"toronto": [300.0] * 48, "ashburn": [500.0] * 48, "frankfurt": [600.0] * 48, "sydney": [600.0] * 48}
    snap = snapshot(NOON, flat)
    req = request(count=7)
    outcome = decide(green(headroom=0.25), req, snap)
    assert outcome.placed and snap.sites[outcome.site] == "ashburn"
    why = "it would take the headroom kept for work that cannot wait: headroom 0.25"
    assert [(snap.sites[site], text) for site, text in outcome.passed_over] == [("toronto", why)]
    decision, _ = explained(green(headroom=0.25), outcome, snap, req)
    assert {v.site: v.passed_over for v in decision.sites}["toronto"] == why


def test_two_jobs_in_one_pass_do_not_plan_the_same_gpus() -> None:
    snap = snapshot(NOON, FLAT)
    decider = PassDecider(green(headroom=0.1), snap)
    first = decider.decide(request(count=8, job_id="a"))
    decider.reserve(first)
    second = decider.decide(request(count=8, job_id="b"))
    assert isinstance(first, Deferral) and (snap.sites[first.site], first.slot) == ("ashburn", 3)
    # Hours 3-4 keep 8 of 16 free, less than 8 + a 10 % headroom: the second waits for hours 5-6.
    assert isinstance(second, Deferral) and (snap.sites[second.site], second.slot) == ("ashburn", 5)


def test_headroom_keeps_part_of_each_site_for_work_that_cannot_wait_or_go_far() -> None:
    # Toronto has 8 A100s free; with a headroom of a quarter a 7-GPU flexible job may not take them (it
    # reserves ashburn's room from hour 2), while a job that cannot wait still does.
    snap = snapshot(NOON, FLAT | {"ashburn": [500.0] * 48}, free={"ashburn": 0, "frankfurt": 0, "sydney": 0},
                    booked={"ashburn": (16, 1, 2), "frankfurt": (16, 1, 97), "sydney": (8, 1, 97)})
    outcome = decide(green(headroom=0.25), request(count=7), snap)
    assert isinstance(outcome, Deferral) and snap.sites[outcome.site] == "ashburn" and outcome.now_site < 0
    assert outcome.slot == 2 and "no site can take it now" in outcome.reason(snap.sites)
    urgent = decide(green(headroom=0.25), request(count=7, slack_h=0.5), snap)
    assert urgent.placed and snap.sites[urgent.site] == "toronto"
    # A job with a latency objective (40 ms from us-east1: Ashburn or Toronto) is what the headroom is kept
    # for: it takes Toronto's GPUs now, slack or not.
    near = decide(green(headroom=0.25), request(count=7, origin_region="gcp:us-east1", latency_slo_ms=40.0), snap)
    assert near.placed and snap.sites[near.site] == "toronto"


def test_on_real_data_the_planned_start_is_the_cheapest_carbon_of_every_site_and_hour() -> None:
    """Brute force over every (site, hour) with room: the deferral is the minimum, and saves at least
    min_saving against starting now."""
    now = datetime(2022, 6, 3, 15, 30, tzinfo=UTC)
    snap = snapshot(now)
    req = replace(request(hours=3.0, count=4), deadline_ts=now.timestamp() + 33 * 3600.0)
    shift = ShiftPolicy()
    outcome = decide(green(), req, snap)
    assert isinstance(outcome, Deferral)
    latest = req.deadline_ts - shift.duration_safety * req.duration_s
    hour0 = math.floor(now.timestamp() / 3600) * 3600
    best = math.inf
    for i in range(snap.n_sites):
        if snap.total_gpus[i, A100] < 4:
            continue
        for k in range(1, 49):
            if hour0 + k * 3600 > latest:
                break
            best = min(best, 4 * TDP_KW[A100] * snap.carbon_forecast[i, k:k + 3].sum() / 1000.0)
    assert outcome.value_then == pytest.approx(best)
    assert outcome.value_then <= (1 - shift.min_saving) * outcome.value_now
    assert outcome.start.timestamp() <= latest
    assert snap.sites[outcome.site] == "toronto" and outcome.start == datetime(2022, 6, 4, 15, tzinfo=UTC)


def test_the_calendar_books_whole_hours_and_gives_them_back() -> None:
    start = datetime(2022, 6, 10, 14, 20, tzinfo=UTC)
    first, end = run_slots(start.timestamp(), 2 * 3600.0)
    assert (end - first) == 3  # 14:20-16:20 holds the 14, 15 and 16 o'clock hours
    calendar = Calendar(1, 1, first - 1, span_h=4)
    booking = calendar.book(0, 0, 8.0, first, end + 300)  # grows past its span
    view = calendar.view(start - timedelta(hours=1), np.array([[10]]), np.array([[16]]), 5)
    assert view[0, 0].tolist() == [10, 8, 8, 8, 8]  # hour 0 is the sites' real free capacity
    calendar.release(booking, from_h=first + 1)
    view = calendar.view(start - timedelta(hours=1), np.array([[10]]), np.array([[16]]), 5)
    assert view[0, 0].tolist() == [10, 8, 16, 16, 16]


# --- the live cycle --------------------------------------------------------------------------------------------------

CARBON_DIR = ROOT / "data" / "carbon"
GREEN_AT = datetime(2022, 6, 15, 2, 10, tzinfo=UTC)  # 11:10 in Tokyo, 04:10 in Frankfurt before its sun is up


async def frankfurt_and_tokyo(tmp_path, site_extra: dict | None = None, **settings):
    """A started broker on a manual clock at GREEN_AT over Frankfurt and Tokyo (simulated, starting a job
    after a second), with the shipped carbon data; ``site_extra`` maps a site to more of its spec fields,
    ``settings`` adds broker settings."""
    from broker.models import SimulatedAdapterConfig
    from tests.builders import site

    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    extra = site_extra or {}
    sites = [site("frankfurt", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin", adapter=fast,
                  **extra.get("frankfurt", {})),
             site("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=fast,
                  **extra.get("tokyo", {}))]
    return await green_broker(tmp_path, sites, **settings)


async def green_broker(tmp_path, sites, at=GREEN_AT, **settings):
    """A started broker over ``sites`` on a manual clock at ``at`` (GREEN_AT), with the shipped carbon data and
    its forecasts ready; ``settings`` adds broker settings."""
    from broker.clock import ManualClock
    from broker.config import BrokerSettings
    from broker.service import Broker

    cfg = {"db": str(tmp_path / "t.db"), "shutdown_grace_s": 0.1,
           "carbon": {"kind": "files", "path": str(CARBON_DIR)}, "carbon_forecast": {"history_h": 336}, **settings}
    clock = ManualClock(at)
    b = Broker(BrokerSettings.model_validate(cfg), clock=clock)
    await b.start(sites, run_loop=False)
    await b.signals.wait_ready()
    return b, clock


@contextlib.asynccontextmanager
async def restoring(tmp_path, sites, name: str, doc: str):
    """A green broker over ``sites`` that takes charge with ``doc`` stored as its state ``name``
    (``Store.put_state``), as a broker does after a restart or a takeover; stopped on leaving."""
    b, _ = await green_broker(tmp_path, sites, profiles={"default": "green"})
    try:
        await b.store.put_state(name, doc)
        await b.cycle.restore_learned()
        yield b
    finally:
        await b.stop()


@pytest.fixture
async def live(tmp_path):
    b, clock = await frankfurt_and_tokyo(tmp_path)
    yield b, clock
    await b.stop()


async def test_the_live_cycle_starts_a_job_that_asks_to_start_at_once_and_says_so(live) -> None:
    """The job the deferral test below defers, sent with ``deferrable: false``: it is placed in the first pass
    at the profile's best site now, and its decision says why no later start was weighed."""
    from broker.models import JobState
    from policies import explain
    from tests.builders import job

    b, _ = live
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30), deferrable=False))
    assert j.spec.deferrable is False
    await b.cycle.run_once(full=True)
    placed = await b.book.get(j.id)
    assert placed.state == JobState.DISPATCHING and placed.spec.deferrable is False  # as stored
    assert b.cycle.deferred_until(j.id) is None
    stored = await b.store.get_decision(j.id)
    why = explain.render(stored.record, JobRequest.from_spec(j.id, j.spec), b.cycle.filters, stored.attempt)
    assert why.outcome == "placed"
    assert why.summary.endswith("the job asks to start at once (deferrable: false): no later start is weighed "
                                "for it")


@pytest.mark.parametrize("req", [request(slack_h=72.0, deferrable=False), request(slack_h=0.5),
                                 request(slack_h=None)],
                         ids=["asks to start at once", "its latest start has come", "no deadline"])
def test_with_keep_promises_a_job_that_is_not_deferred_starts_around_the_plans_promises(req) -> None:
    # Toronto, green's choice now, has its 8 A100s promised to deferred jobs from the next hour: with
    # keep_promises a job that starts now goes to the best site whose GPUs are not promised, and says which it
    # passed over and why; without, it takes them.
    snap = snapshot(NOON, FLAT, booked={"toronto": (8, 1, 3)})
    outcome = decide(green(keep_promises=True), req, snap)
    assert outcome.placed and snap.sites[outcome.site] != "toronto"
    assert [snap.sites[site] for site, _ in outcome.passed_over] == ["toronto"]
    assert "booked from 2022-06-10T13:00Z" in outcome.passed_over[0][1]
    outcome = decide(green(), req, snapshot(NOON, FLAT, booked={"toronto": (8, 1, 3)}))
    assert outcome.placed and snap.sites[outcome.site] == "toronto" and not outcome.passed_over
    # Where every site's GPUs are promised it still starts now, at the profile's choice: it cannot wait.
    everywhere = {name: (16, 1, 3) for name in ("toronto", "ashburn", "frankfurt", "sydney")}
    full = snapshot(NOON, FLAT, booked=everywhere)
    outcome = decide(green(keep_promises=True), req, full)
    assert outcome.placed and snap.sites[outcome.site] == "toronto"
    # ... and its decision says that it took promised GPUs, and whose
    assert outcome.over_plan and outcome.n_passed_over == 4
    decision, text = explained(green(keep_promises=True), outcome, full, req)
    assert decision.summary.startswith("placed on toronto (a100-80gb, score ")
    assert ", started over the plan, which turned away all 4 sites that could take it now: toronto (its a100-80gb GPUs " \
           "are booked from 2022-06-10T13:00Z" in decision.summary
    assert decision.summary.count("are booked from") == 4
    assert "it starts at the profile's choice rather than wait" in decision.summary
    assert "once the plan turned away" not in decision.summary
    assert {v.site for v in decision.sites if v.passed_over} == set(everywhere)
    assert "turned away now: its a100-80gb GPUs are booked" in text


def test_a_job_that_could_wait_but_finds_every_start_taken_says_it_starts_over_the_plan() -> None:
    # A flexible job (72 h of slack) finds every site's GPUs promised for the next week: no later start has
    # room either, so it starts now at the profile's choice, and says that it starts over the plan.
    everywhere = {name: (16, 1, 400) for name in ("toronto", "ashburn", "frankfurt", "sydney")}
    snap = snapshot(NOON, FLAT, booked=everywhere)
    req = request(slack_h=72.0)
    outcome = decide(green(), req, snap)
    assert not isinstance(outcome, Deferral) and outcome.placed and outcome.over_plan
    decision, _ = explained(green(), outcome, snap, req)
    assert "started over the plan, which turned away all 4 sites that could take it now" in decision.summary
    # where the profile's choice fits the plan, nothing of the kind is said
    free = snapshot(NOON, FLAT)
    plain = decide(green(), request(slack_h=0.5), free)
    assert plain.placed and not plain.over_plan
    assert "over the plan" not in explained(green(), plain, free, request(slack_h=0.5))[0].summary


def test_a_job_that_must_start_at_once_is_queued_by_its_submit_time() -> None:
    from policies.timeshift import urgency_ts

    t = NOON.timestamp()
    roomy = urgency_ts(t, t + 30 * 3600.0, 3600.0)  # latest start 29 h after submission, capped at a day
    assert roomy == t + 24 * 3600.0
    assert urgency_ts(t + 600.0, t + 30 * 3600.0, 3600.0, deferrable=False) == t + 600.0
    # ahead of a job with slack submitted before it, behind one whose latest start has already passed
    assert urgency_ts(t + 600.0, None, 3600.0, deferrable=False) < roomy
    assert urgency_ts(t, t + 1800.0, 3600.0) < urgency_ts(t + 600.0, None, 3600.0, deferrable=False)


async def test_the_live_cycle_defers_a_green_job_says_why_and_starts_it_by_its_latest_start(live) -> None:
    from broker.models import JobState
    from policies import explain
    from tests.builders import job

    b, clock = live
    deadline = GREEN_AT + timedelta(hours=30)
    # Eight GPUs for four hours: enough carbon at stake (green defers for 0.5 kg or more), and green's wait
    # bound (four times the estimate: 16 h) comes before deadline - 1.5 × the estimate (24 h).
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600, deadline=deadline))
    latest = GREEN_AT + timedelta(hours=16)
    await b.cycle.run_once(full=True)
    assert (await b.book.get(j.id)).state == JobState.QUEUED
    stored = await b.store.get_decision(j.id)
    why = explain.render(stored.record, JobRequest.from_spec(j.id, j.spec), b.cycle.filters, stored.attempt)
    assert why.outcome == "deferred" and GREEN_AT < why.deferred_until <= latest
    assert why.summary.startswith(f"deferred until {why.deferred_until:%Y-%m-%dT%H:%MZ} because carbon forecast on ")
    assert {v.site for v in why.sites} == {"frankfurt", "tokyo"}  # every site's terms, as for a placement
    assert b.cycle.deferred_until(j.id) == why.deferred_until

    # Within the hour the job is not decided again; each whole hour it is, until it starts.
    await clock.advance(600)
    await b.cycle.run_once(full=True)
    assert (await b.book.get(j.id)).state == JobState.QUEUED
    while (await b.book.get(j.id)).state == JobState.QUEUED:
        assert clock.now() <= latest, "a deferred job started after its latest start"
        await clock.advance(3600)
        await b.cycle.run_once(full=True)
    placed = await b.book.get(j.id)
    assert placed.state == JobState.DISPATCHING and b.cycle.deferred_until(j.id) is None


async def test_a_deferred_job_cancelled_before_its_start_is_not_explained_as_still_waiting_for_it(live) -> None:
    # GET /v1/jobs/{id}/decision of a job cancelled while deferred used to give the deferral as it was recorded,
    # "deferred until T because ...", as if the job were still to start then.
    from aiohttp.test_utils import TestClient, TestServer

    from broker.api import create_app
    from tests.builders import job

    b, _ = live
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30)))
    await b.cycle.run_once(full=True)
    async with TestClient(TestServer(create_app(b))) as client:
        before = await (await client.get(f"/v1/jobs/{j.id}/decision")).json()
        assert before["outcome"] == "deferred" and "ended" not in before["summary"]
        await b.lifecycle.cancel(j.id)
        after = await (await client.get(f"/v1/jobs/{j.id}/decision")).json()
    assert after["outcome"] == "deferred" and after["deferred_until"] == before["deferred_until"]  # what was decided
    assert after["summary"] == (before["summary"] + "; the job ended before that start (cancelled: cancelled by "
                                                   "request), so it will not start")


async def _a_deferred_green_job(b):
    """An 8-GPU, 4-hour green job with 30 hours to its deadline, submitted and decided (deferred to frankfurt's
    clean hours), and a call that reads its decision as GET /v1/jobs/{id}/decision gives it."""
    from tests.builders import job

    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30)))
    await b.cycle.run_once(full=True)

    async def decision():
        stored = await b.decision(await b.book.get(j.id))
        return explain.render(stored.record, JobRequest.from_spec(j.id, j.spec), b.cycle.filters, stored.attempt)

    return j, decision


async def test_a_deferred_job_decided_again_after_its_start_now_site_is_cordoned_no_longer_quotes_that_site(live) -> None:
    # The job is deferred to frankfurt's clean hours against a start now on tokyo. Tokyo is then cordoned: at
    # the next hour the broker decides the job again, against a start now on frankfurt, to the same site and
    # hour. Its decision used to be recorded only when the planned site, model or hour changed, so GET
    # /v1/jobs/{id}/decision went on saying it waits to save carbon against starting now on tokyo, a site taken
    # out of routing (and listed tokyo as feasible).
    b, clock = live
    j, decision = await _a_deferred_green_job(b)
    first = await decision()
    assert first.outcome == "deferred" and first.deferral.site == "frankfurt" and first.deferral.now_site == "tokyo"
    tokyo = b.federation.get("tokyo")
    await b.update_site(tokyo.spec.model_copy(update={"cordoned": True}))
    await clock.advance(3600)
    await b.cycle.run_once(full=True)
    assert b.cycle.deferred_until(j.id) == first.deferred_until  # the same plan, decided again
    again = await decision()
    assert again.outcome == "deferred" and again.decided_at == clock.now()
    assert again.deferral.now_site == "frankfurt" and "starting now on tokyo" not in again.summary
    assert not next(v for v in again.sites if v.site == "tokyo").feasible


async def test_a_deferred_job_decided_again_an_hour_later_to_the_same_plan_quotes_that_hours_forecasts(live) -> None:
    # Decided again each whole hour to the same site and start against a start now on the same site, its
    # decision was recorded only when the plan, that site or the verdicts changed: GET /v1/jobs/{id}/decision
    # went on giving the first hour's decision time and "against 4.77 kg CO2e starting now on tokyo", a start
    # now that the broker no longer weighed (an hour later it is another run, of 5.04 kg).
    b, clock = live
    j, decision = await _a_deferred_green_job(b)
    first = await decision()
    assert first.outcome == "deferred" and first.deferral.now_site == "tokyo"
    await clock.advance(3600)
    await b.cycle.run_once(full=True)
    assert b.cycle.deferred_until(j.id) == first.deferred_until  # the same plan, decided again
    again = await decision()
    assert again.outcome == "deferred" and again.deferral.now_site == "tokyo" and again.decided_at == clock.now()
    assert again.deferral.value_now != first.deferral.value_now
    assert f"against {again.deferral.value_now:.3g} kg CO2e starting now on tokyo" in again.summary


async def test_a_deferred_job_whose_planned_site_is_cordoned_is_decided_again_at_once(live) -> None:
    # The job is deferred to frankfurt's clean hours; frankfurt is then cordoned. A deferred job is decided
    # again each whole hour, and the plan used to stand until then: for up to an hour the job stayed planned on
    # a site taken out of routing, its GPUs there booked, its decision saying it waits for frankfurt. A change
    # to the planned site's spec ends the plan: the next pass decides the job again, without frankfurt.
    from broker.models import JobState
    from tests.builders import job

    b, clock = live
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30)))
    await b.cycle.run_once(full=True)
    assert (await b.decision(await b.book.get(j.id))).record["deferred"]["site"] == "frankfurt"
    frankfurt = b.federation.get("frankfurt")
    await b.update_site(frankfurt.spec.model_copy(update={"cordoned": True, "cordon_reason": "maintenance"}))
    await clock.advance(60)  # the same hour
    await b.cycle.run_once(full=True)
    assert b.cycle.deferred_until(j.id) is None
    placed = await b.book.get(j.id)
    assert (placed.state, placed.site) == (JobState.DISPATCHING, "tokyo")
    assert (await b.decision(placed)).record.get("deferred") is None


async def _deferred_then_restarting(tmp_path, after: timedelta):
    """A green job deferred by a broker on frankfurt and tokyo, that broker stopped; then what a restart ``after``
    the decision needs: (the job, when it was deferred until, the sites, a clock, settings on the same database,
    a files carbon provider on that clock)."""
    from broker.clock import ManualClock
    from broker.config import BrokerSettings
    from broker.providers.carbon import build_carbon_provider
    from tests.builders import job

    b, _ = await frankfurt_and_tokyo(tmp_path)
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30)))
    await b.cycle.run_once(full=True)
    deferred_until = b.cycle.deferred_until(j.id)
    assert deferred_until is not None
    sites = list(b.federation.members[name].spec for name in ("frankfurt", "tokyo"))
    await b.stop()
    clock = ManualClock(GREEN_AT + after)
    settings = BrokerSettings.model_validate({"db": str(tmp_path / "t.db"), "shutdown_grace_s": 0.1,
                                              "carbon": {"kind": "files", "path": str(CARBON_DIR)},
                                              "carbon_forecast": {"history_h": 336}})
    return j, deferred_until, sites, clock, settings, build_carbon_provider(settings.carbon, clock=clock)


async def _first_pass_after_restart(settings, clock, provider, sites):  # noqa: ANN001, ANN202
    """The broker started again on ``settings`` with ``provider``, once its first scheduling pass is done (the
    caller stops it)."""
    import asyncio

    from broker.service import Broker

    again = Broker(settings, clock=clock, carbon=provider)
    await again.start(sites)
    async with asyncio.timeout(10):
        while again.cycles < 1:
            await asyncio.sleep(0.02)
    return again


async def test_a_deferred_job_stays_deferred_when_the_broker_restarts_before_its_forecasts_are_fetched(
        tmp_path) -> None:
    # The scheduling loop used to start beside the first round of carbon forecasts: its first pass, which after
    # a restart decides every queued job again, saw no forecast, so a job deferred for a cleaner hour was
    # started at once (and new jobs were placed carbon-blind).
    import asyncio

    from broker.models import JobState

    j, _, sites, clock, settings, provider = await _deferred_then_restarting(tmp_path, timedelta(minutes=5))
    fetch = provider.history

    async def slow_history(zone, start, end):  # a live provider's first round takes a while
        await asyncio.sleep(0.3)
        return await fetch(zone, start, end)

    provider.history = slow_history  # type: ignore[method-assign]
    again = await _first_pass_after_restart(settings, clock, provider, sites)
    try:
        assert (await again.book.get(j.id)).state == JobState.QUEUED
        assert again.cycle.deferred_until(j.id) is not None
    finally:
        await again.stop()


async def test_a_deferred_job_stays_deferred_when_the_broker_restarts_with_its_carbon_provider_down(
        tmp_path, caplog) -> None:
    # A restarted broker whose carbon provider was down had no forecast at all (a running one keeps its last
    # for 6 h): its first pass, which decides every queued job again, started a job deferred for a cleaner hour
    # at once. It now forecasts from what it kept in its store, and defers the job to the same hour as before.
    import logging

    from broker.models import JobState
    from broker.providers.carbon import ProviderError

    j, deferred_until, sites, clock, settings, provider = await _deferred_then_restarting(
        tmp_path, timedelta(minutes=20))

    async def down(zone, start, end):  # the carbon service refuses every connection
        raise ProviderError("connection refused", zone=zone, where="https://carbon.example")

    provider.history = down  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        again = await _first_pass_after_restart(settings, clock, provider, sites)
        try:
            assert (await again.book.get(j.id)).state == JobState.QUEUED
            assert again.cycle.deferred_until(j.id) == deferred_until
            assert "took up the forecasts kept in the store for DE-LU" in caplog.text
        finally:
            await again.stop()


@pytest.mark.parametrize(("later", "said"), [
    pytest.param(timedelta(minutes=5), "scheduling with those the store kept (2 zones) until they come",
                 id="with the forecasts the store kept"),
    pytest.param(timedelta(hours=7), "scheduling without them",
                 id="without them, those the store kept being older than stale_after_s"),
])
async def test_a_first_pass_waits_for_forecasts_only_so_long_and_says_it_went_on_without_them(
        tmp_path, monkeypatch, caplog, later, said) -> None:
    # Jobs that must start at once wait for the first pass too: a carbon service that does not answer must not
    # hold the queue for the fetch's whole timeout (300 s by default), and the operator is told why it moved,
    # and whether on the forecasts the store kept.
    import asyncio

    from broker import service
    from broker.clock import ManualClock
    from broker.config import BrokerSettings
    from broker.models import JobState
    from broker.providers.carbon import build_carbon_provider
    from broker.service import Broker
    from tests.builders import job

    b, _ = await frankfurt_and_tokyo(tmp_path)
    sites = list(b.federation.members[name].spec for name in ("frankfurt", "tokyo"))
    await b.stop()
    monkeypatch.setattr(service, "FIRST_PASS_WAIT_S", 0.3)
    clock = ManualClock(GREEN_AT + later)
    settings = BrokerSettings.model_validate({"db": str(tmp_path / "t.db"), "shutdown_grace_s": 0.1,
                                              "carbon": {"kind": "files", "path": str(CARBON_DIR)}})
    provider = build_carbon_provider(settings.carbon, clock=clock)

    async def silent(zone, start, end):  # a service that takes the connection and never answers
        await asyncio.sleep(3600)

    provider.history = silent  # type: ignore[method-assign]
    again = Broker(settings, clock=clock, carbon=provider)
    await again.start(sites)
    try:
        j, _ = await again.book.submit(job(count=1, duration_s=600, deferrable=False))
        async with asyncio.timeout(10):
            while (await again.book.get(j.id)).state == JobState.QUEUED:
                await asyncio.sleep(0.02)
        assert f"the first carbon forecasts are not in after 0.3 s; {said}" in caplog.text
    finally:
        await again.stop()


def test_a_job_naming_no_model_is_checked_for_room_on_the_gpus_it_would_start_on() -> None:
    # Toronto's L4s are busy for two more hours, its A100s idle. A job that names no model and may only run
    # in Toronto's region could start on the A100s now: that is what waiting is weighed against (it may
    # still wait for the L4s, which draw a fifth of the power), never "no site can take it now".
    snap = snapshot(NOON, FLAT)
    toronto, l4 = snap.index["toronto"], MODEL_INDEX["l4"]
    snap.free_gpus[toronto, l4] = 0
    snap.plan_free[toronto, l4, :3] = 0
    region = next(s.region for s in SITES if s.name == "toronto")
    outcome = decide(green(), request(model=None, allowed_regions=frozenset({region})), snap)
    if outcome.placed:
        assert snap.sites[outcome.site] == "toronto" and outcome.model == A100
    else:
        assert snap.sites[outcome.now_site] == "toronto"
        assert outcome.value_now == pytest.approx(4 * TDP_KW[A100] * 2 * 300.0 / 1000.0)
        assert "starting now on toronto" in outcome.reason(snap.sites)


def test_a_fractional_job_that_fits_a_shared_gpu_now_is_not_held_back() -> None:
    # No whole A100 is free at Toronto but a shared one has half a GPU free: a quarter-GPU job starts there.
    snap = snapshot(NOON, {name: [300.0] * 48 for name in ("toronto", "ashburn", "frankfurt", "sydney")},
                    free={"toronto": 0, "ashburn": 0, "frankfurt": 0, "sydney": 0})
    snap.shared_free_milli[snap.index["toronto"], A100] = 500
    outcome = decide(green(), request(count=1, milli=250), snap)
    assert outcome.placed and snap.sites[outcome.site] == "toronto"


def test_fractional_bookings_and_releases_cancel_out() -> None:
    import random

    calendar = Calendar(1, 1, 0, span_h=8)
    rnd = random.Random(1)
    held_now = []
    for _ in range(2000):
        if held_now and rnd.random() < 0.5:
            calendar.release(held_now.pop(rnd.randrange(len(held_now))))
        else:
            held_now.append(calendar.book(0, 0, rnd.randint(1, 999) / 1000.0, 0, 4))
    for booking in held_now:
        calendar.release(booking)
    assert np.abs(calendar.busy).max() < 1e-9  # a job needing every GPU still fits once the others left


def test_the_site_a_walk_settles_on_keeps_every_other_field_of_the_profiles_placement():
    """The plan makes the placement for the site its walk settles on field by field (faster than
    dataclasses.replace): every field of Placement is named there, so one added later is not dropped."""
    import ast
    from dataclasses import fields

    from policies import timeshift
    from policies.pipeline import Placement

    tree = ast.parse(Path(timeshift.__file__).read_text())
    made = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
            and getattr(node.func.func, "id", None) == "type"]
    assert len(made) == 1
    assert {k.arg for k in made[0].keywords} == {f.name for f in fields(Placement)}


@settings(max_examples=300, deadline=None)
@given(now=st.floats(0.0, 1e7, allow_subnormal=False), saved=st.floats(0.0, 1e7, allow_subnormal=False),
       min_abs=st.floats(1e-12, 1e4, allow_subnormal=False), nudge=st.integers(-3, 3))
def test_the_search_for_a_later_start_looks_as_high_as_any_start_the_plan_would_take(now, saved, min_abs, nudge):
    """Where a job can start now, the search for a later start looks only below ``_later_bar`` (far fewer sites
    when no start saves green's 0.5 kg). Every value the plan's own check takes (``best now - value >=
    min_saving_abs``, in floating point) is below that bar, also a few ulps either side of the boundary; and
    where the job cannot start now, or nothing must be saved, the bar is the threshold itself."""
    from policies.timeshift import _later_bar

    value = now - saved
    for _ in range(abs(nudge)):
        value = np.nextafter(value, math.inf if nudge > 0 else -math.inf)
    bar = _later_bar(math.inf, 0, now, min_abs)
    if now - value >= min_abs:
        assert value < bar, (now, value, min_abs, bar)
    assert _later_bar(7.5, -1, now, min_abs) == 7.5 and _later_bar(7.5, 3, now, 0.0) == 7.5
    assert _later_bar(-1.0, 0, now, min_abs) <= -1.0  # never above the threshold


def _overrun(snap, site: str, first: int, end: int, gpus: float = 16.0):
    """``snap`` with ``gpus`` A100s at ``site`` expected held in plan hours [first, end) by jobs past their
    estimates (``Snapshot.plan_overrun``), which its plan counts as free."""
    over = np.zeros_like(snap.plan_free)
    over[snap.index[site], A100, first:end] = gpus
    return replace(snap, plan_overrun=over)


def test_with_book_overruns_a_deferral_keeps_its_place_in_line_where_the_site_is_still_worth_the_wait() -> None:
    # Ashburn is clean from 15:00 to 20:00; green defers the 2-hour job there for 15:00. Jobs past their
    # estimates are expected to hold Ashburn's A100s until 17:00: planned on what is expected free, the job
    # still waits for Ashburn (from 17:00, still clean), so the deferral stands, its place in line kept.
    snap = _overrun(snapshot(NOON, FLAT), "ashburn", 3, 5)
    outcome = decide(green(book_overruns=True), request(), snap)
    assert isinstance(outcome, Deferral) and (snap.sites[outcome.site], outcome.slot) == ("ashburn", 3)
    assert (snap.plan_free == snapshot(NOON, FLAT).plan_free).all()  # the plan itself is left as it was


def test_with_book_overruns_a_deferral_onto_gpus_held_past_every_clean_hour_is_planned_again() -> None:
    # Held until 21:00, past Ashburn's clean hours: waiting there buys nothing, and the job starts now in
    # Toronto. Without book_overruns the plan counts those GPUs free and defers it to Ashburn at 15:00.
    snap = _overrun(snapshot(NOON, FLAT), "ashburn", 3, 9)
    outcome = decide(green(book_overruns=True), request(), snap)
    assert not isinstance(outcome, Deferral) and outcome.placed and snap.sites[outcome.site] == "toronto"
    outcome = decide(green(), request(), snap)
    assert isinstance(outcome, Deferral) and (snap.sites[outcome.site], outcome.slot) == ("ashburn", 3)


def test_a_deferral_reports_the_forecast_of_starting_now_and_the_price_of_the_room_it_would_take_apart() -> None:
    # Toronto keeps room for 6 A100s of latency-bound work (it held that much each hour of the samples): a
    # start now there takes 4 of it for 2 h, priced at 0.1 kg CO2e per GPU-hour. The plan compares 0.96 kg of
    # forecast plus that price; the explanation gives the forecast and the price apart, each as what it is.
    snap = snapshot(NOON, FLAT)
    samples = np.zeros((3, *snap.total_gpus.shape), dtype=np.float32)
    samples[:, snap.index["toronto"], A100] = 6.0
    snap = replace(snap, near_samples=samples, near_booked=np.zeros(snap.plan_free.shape))
    outcome = decide(green(latency_reserve=1.0, latency_reserve_price=0.1), request(), snap)
    assert isinstance(outcome, Deferral) and snap.sites[outcome.now_site] == "toronto"
    forecast_now = 4 * TDP_KW[A100] * 2 * 300.0 / 1000.0  # 4 GPUs, 2 h at 300 g/kWh: 0.96 kg
    assert outcome.forecast_now == pytest.approx(forecast_now)
    price = outcome.value_now - outcome.forecast_now
    assert price > 0.1  # what the plan compared: the forecast and the room's price
    text = outcome.reason(snap.sites)
    assert (f"is {outcome.value_then:.3g} kg CO2e against {forecast_now:.3g} kg CO2e starting now on toronto "
            f"({1 - outcome.value_then / forecast_now:.0%} less); a start now on toronto would also take room kept "
            f"for latency-bound jobs, priced at {price:.3g} kg CO2e") in text
    as_dict = outcome.as_dict(snap.sites)
    assert as_dict["value_now"] == pytest.approx(forecast_now) and as_dict["room_price_now"] == pytest.approx(price)
    # Where no room is taken, the two are one, and nothing is said of a price.
    plain = decide(green(), request(), snapshot(NOON, FLAT))
    assert plain.forecast_now == plain.value_now and "priced at" not in plain.reason(snap.sites)
    assert "room_price_now" not in plain.as_dict(snap.sites)


async def test_a_deferred_job_decided_again_hour_after_hour_leaves_no_pile_of_old_decision_signatures(
        live, monkeypatch) -> None:  # noqa: ANN001
    # Its decision is recorded again each hour (the figures its reason quotes change), each time under a new
    # signature: the copies kept of the old ones were swept only when the number of jobs doubled, so with as many
    # jobs waiting as ever they piled up, one for each job and hour, for as long as the broker ran.
    from tests.builders import job

    b, clock = live
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600,
                                   deadline=GREEN_AT + timedelta(hours=30)))
    monkeypatch.setattr("broker.cycle.SWEEP_MIN", 3)  # (4096, scaled down to one job)
    b.cycle._sweep_at = 3
    sizes, deferred_h = [], 0
    for _ in range(16):
        await b.cycle.run_once(full=True)
        sizes.append(len(b.cycle._signatures))
        deferred_h += b.cycle.deferred_until(j.id) is not None
        await clock.advance(3600)
    assert deferred_h >= 4  # (a new signature each of those hours)
    assert max(sizes) <= 3, sizes


# A day of hourly intensities whose cleanest four hours are its 6th to 9th (22.9-28.3 g/kWh), repeated as a
# forecast repeats the zone's mean day past its model's hours: the same window a day later is as clean, but
# its value, a difference of running sums, comes out a few bits lower (0.32511999999999974 kg against
# 0.32512000000000013 for 8 A100s), as does the same window after another first hour (450.25 g/kWh, not 400).
DAY = [74.5, 80.7, 168.4, 45.6, 132.0, 22.9, 28.3, 24.2, 26.2, 141.8, 125.6, 55.5, 103.5, 143.8, 101.9, 137.6,
       194.5, 146.1, 96.6, 61.8, 88.8, 116.9, 181.5, 161.8]


@pytest.mark.parametrize(("case", "rows", "tied"), [
    ("an hour a day later, as clean, does not win by rounding", [[400.0] + DAY * 2], [(6, 0), (30, 0)]),
    ("a site further down the list, as clean at the same hour, does not win by rounding",
     [[400.0] + DAY + [600.0] * 24, [450.25] + DAY + [600.0] * 24], [(6, 0), (6, 1)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_starts_whose_values_differ_by_rounding_alone_go_to_the_earlier_hour_then_the_first_site(
        case, rows, tied) -> None:
    """search_later: of two starts (hour, site) as clean but for rounding, the later one a few bits lower,
    the earlier hour wins, then the first site, as the search's rule says."""
    from policies import _shift_search as search
    from policies.snapshot import running_sums
    from policies.timeshift import _cleanest_ahead

    forecast = np.array(rows)
    cum = running_sums(forecast)
    n, hours = forecast.shape
    kw = np.full(n, TDP_KW[A100])
    values = {(k, s): 8 * kw[s] * (cum[s, k + 4] - cum[s, k]) / 1000.0 for k, s in tied}
    assert values[tied[1]] < values[tied[0]] < values[tied[1]] + 1e-15  # the later a few bits lower: rounding
    value, slot, site, _, _ = search.search_later(
        np.ones(n, dtype=bool), _cleanest_ahead(forecast), math.inf, kw, 8.0, 4.0, forecast, cum, True,
        np.full((n, len(TDP_KW), hours), 8.0, dtype=np.float32), np.full(n, A100, dtype=np.int64),
        np.zeros(n, dtype=np.float32), np.zeros((0, 0), dtype=np.float32), np.zeros((0, 0, 0)), hours - 5, 4,
        hours, np.zeros(0), math.inf)
    assert (slot, site) == tied[0], case
    assert value == values[tied[0]]


def test_balanced_does_not_defer_a_job_a_day_longer_for_an_hour_as_clean_but_for_rounding() -> None:
    """The demo's case: ``balanced`` deferred an 8×A100 4 h job to toronto 25 h away (0.04307199999999994 kg)
    rather than 1.3 h away (0.043072000000000006): a day's wait for 6e-17 kg. Toronto's forecast here repeats
    its day, whose cleanest four hours come again a day later, a few bits lower: the job waits for the first."""
    from policies.profiles import profile_pipeline

    dirty = [600.0] * 48
    snap = snapshot(NOON, {"toronto": [400.0] + DAY + DAY[:23], "ashburn": dirty, "frankfurt": dirty,
                           "sydney": dirty})
    outcome = decide(profile_pipeline("balanced"), request(hours=4.0, slack_h=40.0, count=8), snap)
    assert isinstance(outcome, Deferral)
    assert (snap.sites[outcome.site], outcome.start) == ("toronto", datetime(2022, 6, 10, 18, tzinfo=UTC))
    assert outcome.value_then == pytest.approx(8 * TDP_KW[A100] * sum(DAY[5:9]) / 1000.0)


async def test_a_preview_of_a_flexible_job_gives_the_deferral_a_submission_then_gets_and_books_nothing(live) -> None:
    # POST /v1/preview (heliotrope submit --dry-run) of a green job: deferred to frankfurt's clean hours, as
    # the job then submitted is; the preview held none of those hours, so two previews agree.
    from tests.builders import job

    b, clock = live
    spec = job(count=8, profile="green", duration_s=4 * 3600, deadline=GREEN_AT + timedelta(hours=30))
    req, record, _ = b.cycle.preview("preview", spec)
    previewed = explain.render(record, req, b.cycle.filters, 0)
    assert previewed.outcome == "deferred" and previewed.deferral.site == "frankfurt"
    req, record, _ = b.cycle.preview("preview", spec)
    assert explain.render(record, req, b.cycle.filters, 0) == previewed
    assert b.cycle.deferred_until("preview") is None
    j, decision = await _a_deferred_green_job(b)
    decided = await decision()
    assert (decided.outcome, decided.site, decided.deferred_until, decided.summary) == (
        previewed.outcome, previewed.site, previewed.deferred_until, previewed.summary)


async def test_a_preview_behind_a_deferred_job_plans_around_it_and_leaves_its_deferral_as_it_was(live) -> None:
    # A green job deferred this hour is not decided again before a preview (its hours are in the plan); an hour
    # on, the pass would decide it again first, so the preview does, on its scratch plan, and the broker's
    # deferral of it (its planned hours, the hour it was decided in) is left as it was.
    from tests.builders import job

    b, clock = live
    j, _ = await _a_deferred_green_job(b)
    spec = job(count=8, profile="green", duration_s=4 * 3600, deadline=GREEN_AT + timedelta(hours=30))
    kept = dict(b.cycle._deferred)
    assert j.id in kept
    _, _, ahead = b.cycle.preview("preview", spec)
    assert (ahead.decided, ahead.deferred) == (0, 0)
    await clock.advance(3600)
    req, record, ahead = b.cycle.preview("preview", spec)
    assert (ahead.decided, ahead.deferred) == (1, 1)
    previewed = explain.render(record, req, b.cycle.filters, 0)
    planned = kept[j.id]
    kept_start = datetime.fromtimestamp(planned.first * 3600, tz=UTC)  # the 8 GPUs it holds there, 4 hours
    assert previewed.outcome == "deferred"
    assert (previewed.deferral.site != planned.site
            or abs(previewed.deferred_until - kept_start) >= timedelta(hours=4))  # planned around it
    assert b.cycle._deferred == kept and b.cycle.deferred_until("preview") is None


async def test_a_preview_behind_many_jobs_deferred_this_hour_walks_past_a_bounded_number_and_says_so(
        live, monkeypatch) -> None:
    # Jobs deferred this hour are passed over, not decided, so PREVIEW_AHEAD_MAX does not bound them: a preview
    # behind a queue of a few hundred thousand of them used to walk them all, holding the broker's event loop for
    # seconds (the API, the leader's lease). It walks past at most PREVIEW_WALK_MAX, and says it was cut short.
    from broker import cycle as cycle_module
    from broker.api import preview_note
    from tests.builders import job

    b, _ = live
    spec = job(count=8, profile="green", duration_s=4 * 3600, deadline=GREEN_AT + timedelta(hours=30))
    for _ in range(3):
        await b.book.submit(spec)
    await b.cycle.run_once(full=True)
    deferred = len(b.cycle._deferred)  # (the first placed at once, or not: the others are deferred)
    assert deferred >= 2 and len(b.book.active.queue) == deferred
    monkeypatch.setattr(cycle_module, "PREVIEW_WALK_MAX", deferred - 1)
    _, _, ahead = b.cycle.preview("preview", spec)
    assert (ahead.decided, ahead.capped) == (0, True)
    assert "those further ahead were not weighed" in preview_note(ahead)
    monkeypatch.setattr(cycle_module, "PREVIEW_WALK_MAX", deferred)
    _, _, ahead = b.cycle.preview("preview", spec)
    assert (ahead.decided, ahead.capped) == (0, False)


async def test_a_deferred_job_whose_deadline_is_brought_forward_is_decided_again_at_once(live) -> None:
    # PATCH /v1/jobs/{id} with a deadline 5 h away for a 4-hour job deferred by 20 hours: the plan it had would
    # miss the new deadline; kept until the next hour, the job would not be decided again until then.
    from broker.models import JobChange

    b, clock = live
    j, decision = await _a_deferred_green_job(b)
    assert (await decision()).outcome == "deferred" and b.cycle.deferred_until(j.id) is not None
    await b.change_job(j.id, JobChange(deadline=clock.now() + timedelta(hours=5)))
    await b.cycle.run_once()  # the next pass, in the same hour
    again = await decision()
    assert again.decided_at == clock.now()
    assert again.outcome == "placed" or again.deferred_until <= clock.now() + timedelta(hours=1)


async def test_a_queue_of_waiting_flexible_jobs_records_one_decision_a_minute_not_one_per_job(live) -> None:
    # Flexible jobs (a deadline, deferrable) of a profile that defers are decided one by one (their queue group
    # is not dropped at its first failure); a waiting job's decision is recorded again once a minute so its
    # figures stay current, and that came to one store write per waiting job per minute: a queue of ten
    # thousand such jobs that cannot run wrote ten thousand decisions a minute. One a queue group is the aim.
    from tests.builders import job

    b, clock = live
    for i in range(6):  # more GPUs than any site has, now or in the plan: they wait, undeferred
        await b.book.submit(job(name=f"wide-{i}", count=64, profile="green", duration_s=3600,
                                deadline=GREEN_AT + timedelta(hours=30)))
    await b.cycle.run_once(full=True)  # each decided and recorded once
    saved: list[str] = []
    real = b.store.save_decision

    async def counting(job_id, attempt, record):  # noqa: ANN001, ANN202
        saved.append(job_id)
        return await real(job_id, attempt, record)

    b.store.save_decision = counting
    for _ in range(3):
        await clock.advance(60)
        b.book.capacity_freed = True  # (a job ended somewhere: the pass is no quiet one)
        await b.cycle.run_once(full=True)
    assert len(saved) == 3, saved  # one group, three minutes: its first job recorded again each minute


async def test_a_change_the_store_did_not_take_leaves_no_deferral_planned_for_it(live) -> None:
    # A deadline given to a waiting job is planned for by a pass that runs while its write is on the way (the
    # job deferred to frankfurt's clean hours); the write fails, and the job is back without a deadline (503,
    # "nothing changed"). The deferral made for the deadline it does not have stayed, and kept it out of every
    # pass until the next hour, though a job without a deadline starts as soon as a site has room.
    from broker.models import JobChange, JobState
    from broker.store import StoreError
    from tests.builders import job

    b, clock = live
    j, _ = await b.book.submit(job(count=8, profile="green", duration_s=4 * 3600))
    real = b.store.enqueue_update
    landed = asyncio.get_running_loop().create_future()

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        b.store.enqueue_update = real
        return landed

    b.store.enqueue_update = slow
    change = asyncio.ensure_future(b.change_job(j.id, JobChange(deadline=GREEN_AT + timedelta(hours=30))))
    while b.book.active[j.id].spec.deadline is None:
        await asyncio.sleep(0)
    await b.cycle.run_once(full=True)  # meanwhile: the job, with the deadline, is deferred
    assert b.cycle.deferred_until(j.id) is not None
    landed.set_exception(StoreError("disk full"))
    with pytest.raises(StoreError):
        await change
    assert (await b.book.get(j.id)).spec.deadline is None
    await clock.advance(5)
    await b.cycle.run_once(full=True)
    assert (await b.book.get(j.id)).state == JobState.DISPATCHING
