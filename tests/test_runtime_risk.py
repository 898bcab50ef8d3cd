"""Pricing the risk a deferral adds to a job's deadline (policies.runtime_risk): the probability read off how
long finished jobs ran against their estimates, the time-shift search paying for it, the explanation
saying it, the simulator and the live broker learning it from finished jobs only."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.models import JobState, SimulatedAdapterConfig
from policies.snapshot import MODEL_INDEX
from broker.service import Broker
from broker.simulation import engine
from broker.store import JobFilter
from policies import runtime_risk
from broker.simulation.run import prepare, simulate
from policies.profiles import BUILTIN, SHIFTS, pipeline_for
from policies.runtime_risk import MIN_SAMPLES, RunTimeErrors, deferral_penalty, miss_probability
from policies.timeshift import Deferral
from tests.builders import job, site
from tests.test_sim_engine import _clean_afternoons
from tests.test_timeshift import FLAT, NOON, decide, explained, green, request, snapshot


def errors_of(ratios: list[float]) -> np.ndarray:
    """What a snapshot carries after jobs ran ``ratios`` × their estimates."""
    learned = RunTimeErrors()
    for r in ratios:
        learned.add(3600.0, 3600.0 * r)
    return learned.sorted()


# -- the probability ---------------------------------------------------------------------------------------------

def test_the_probability_is_the_share_of_finished_jobs_that_ran_longer() -> None:
    errors = errors_of([0.5] * 50 + [2.0] * 30 + [4.0] * 20)
    est = 1000.0
    p = miss_probability(errors, np.array([400.0, 1000.0, 1500.0, 2000.0, 3000.0, 4000.0, 5000.0]), est)
    # room / estimate: 0.4 -> all 100 ran longer; 1 -> 50 (the 2x and 4x); 1.5 -> 50; 2 -> the 20 at 4x
    # (ran exactly 2x is not longer); 3 -> 20; 4 -> none; 5 -> none
    assert p.tolist() == [1.0, 0.5, 0.5, 0.2, 0.2, 0.0, 0.0]
    assert miss_probability(errors, np.array([0.0, -60.0]), est).tolist() == [1.0, 1.0]  # no room left at all


def test_the_errors_keep_the_latest_jobs_and_ignore_what_says_nothing() -> None:
    learned = RunTimeErrors(keep=3)
    for est, actual in [(100.0, 200.0), (100.0, 0.0), (0.0, 50.0), (100.0, math.nan), (100.0, 100.0),
                        (100.0, 50.0), (100.0, 400.0)]:
        learned.add(est, actual)
    assert len(learned) == 3  # the first of the four valid ones is gone
    assert learned.sorted() == pytest.approx(np.log([0.5, 1.0, 4.0]))
    assert learned.sorted() is learned.sorted()  # sorted once until the next job finishes
    with pytest.raises(ValueError, match="keep"):
        RunTimeErrors(keep=0)


def test_the_penalty_charges_only_the_risk_a_wait_adds() -> None:
    errors = errors_of([1.0] * 40 + [2.0] * 40 + [3.0] * 20)
    hour0 = 1_000_000 * 3600.0
    now = hour0 + 1200.0
    # Estimate 2 h, deadline 7 h after the hour: starting now leaves 6.67 h (3.3x, nothing ran longer); the
    # starts at hours 1..5 leave 6, 5, 4, 3, 2 h: 3x, 2.5x, 2x, 1.5x, 1x the estimate.
    req = request(hours=2.0, deadline_ts=hour0 + 7 * 3600.0)
    penalty, risk = deferral_penalty(req, errors, now, hour0, 5, miss_cost=100.0)
    assert risk.tolist() == [0.0, 0.0, 0.0, 0.2, 0.2, 0.6, 0.6]  # now, then hours 0..5
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 20.0, 20.0, 60.0, 60.0])
    assert (np.diff(penalty) >= 0).all()
    # Nothing is priced without a cost, on too few jobs, or for a job without a deadline.
    assert [a.size for a in deferral_penalty(req, errors, now, hour0, 5, miss_cost=0.0)] == [0, 0]
    assert [a.size for a in deferral_penalty(req, errors[: MIN_SAMPLES - 1], now, hour0, 5, miss_cost=100.0)] == [0, 0]
    assert [a.size for a in deferral_penalty(replace(req, deadline_ts=None), errors, now, hour0, 5, 100.0)] == [0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_the_compiled_penalty_is_the_probability_difference_to_the_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    errors = np.sort(rng.normal(0.0, rng.uniform(0.1, 1.5), int(rng.integers(MIN_SAMPLES, 3000))))
    hour0 = 1_000_000 * 3600.0
    now = hour0 + rng.uniform(0, 3600)
    est = rng.uniform(60, 40 * 3600)
    req = request(hours=est / 3600.0, deadline_ts=now + est * rng.uniform(0.5, 6.0))
    last = int(rng.integers(1, 169))
    penalty, risk = deferral_penalty(req, errors, now, hour0, last, miss_cost=37.5)
    starts = np.concatenate([[now], hour0 + np.arange(last + 1) * 3600.0])
    p = miss_probability(errors, req.deadline_ts - starts, est)
    assert risk.tolist() == p.tolist()
    assert penalty.tolist() == (np.maximum(p[1:] - p[0], 0.0) * 37.5).tolist()


# -- the time-shift search ---------------------------------------------------------------------------------------

# Two hours, deadline six hours after noon (18:20): ashburn's clean hours start at 15:00, which leaves 3 h 20 min,
# 1.67 × the estimate; starting now leaves 3 ×. Ashburn saves 0.64 kg of toronto's 0.96 kg.
TIGHT = request(hours=2.0, slack_h=4.0)


@pytest.mark.parametrize(("case", "ratios", "miss_cost", "deferred"), [
    ("not priced: the wait is taken", [2.0] * 30 + [1.0] * 70, 0.0, True),
    ("30 % of jobs ran 2x: a 30 % risk at 1 kg is 0.3 kg, less than the 0.64 kg saved", [2.0] * 30 + [1.0] * 70,
     1.0, True),
    ("the same risk at 3 kg is 0.9 kg, more than the saving: the job starts now", [2.0] * 30 + [1.0] * 70, 3.0,
     False),
    ("no finished job ran more than 1.5x its estimate: no risk, whatever its price", [1.5] * 30 + [0.5] * 70,
     1e6, True),
    ("49 finished jobs are too few to price anything", [2.0] * (MIN_SAMPLES - 1), 1e6, True),
    ("with min_saving_abs 0.3 kg: 0.64 kg saved less 0.3 kg of risk clears it", [2.0] * 30 + [1.0] * 70,
     (1.0, 0.3), True),
    ("with min_saving_abs 0.5 kg: 0.64 kg less 0.3 kg does not", [2.0] * 30 + [1.0] * 70, (1.0, 0.5), False),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_wait_must_save_more_than_the_risk_it_adds_costs(case, ratios, miss_cost, deferred) -> None:
    snap = replace(snapshot(NOON, FLAT), run_time_errors=errors_of(ratios))
    miss_cost, min_abs = miss_cost if isinstance(miss_cost, tuple) else (miss_cost, 0.0)
    outcome = decide(green(miss_cost=miss_cost, min_saving_abs=min_abs), TIGHT, snap)
    assert isinstance(outcome, Deferral) == deferred, case
    if deferred:
        assert (snap.sites[outcome.site], outcome.slot) == ("ashburn", 3), case
    else:
        assert outcome.placed and snap.sites[outcome.site] == "toronto", case


@pytest.mark.parametrize(("case", "max_risk", "deferred"), [
    ("no bound: the 30 % risk at hour 3 is priced (0.3 kg) and the 0.64 kg saving clears it", None, True),
    ("a bound of 30 %: hour 3's risk is within it", 0.3, True),
    ("a bound of 20 %: no start with room is that safe but now's, so the job starts now", 0.2, False),
], ids=lambda v: v if isinstance(v, str) else "")
def test_max_risk_bounds_the_chance_of_a_miss_a_deferral_may_take(case, max_risk, deferred) -> None:
    # Three in ten finished jobs ran twice their estimate: starting at 15:00 leaves 1.67 × the estimate
    # before the deadline, so 30 % of such jobs would miss it; starting now leaves 3 ×, so none.
    snap = replace(snapshot(NOON, FLAT), run_time_errors=errors_of([2.0] * 30 + [1.0] * 70))
    outcome = decide(green(miss_cost=1.0, max_risk=max_risk), TIGHT, snap)
    assert isinstance(outcome, Deferral) == deferred, case
    if deferred:
        assert outcome.risk_then <= (max_risk if max_risk is not None else 1.0)
    else:
        assert outcome.placed and snap.sites[outcome.site] == "toronto", case


def test_max_risk_keeps_the_safe_later_starts() -> None:
    # With a deadline 20 h away, hours 3-8 at Ashburn all leave more than twice the estimate: no risk, and
    # the bound changes nothing.
    snap = replace(snapshot(NOON, FLAT), run_time_errors=errors_of([2.0] * 30 + [1.0] * 70))
    outcome = decide(green(miss_cost=1.0, max_risk=0.0), request(hours=2.0, slack_h=18.0), snap)
    assert isinstance(outcome, Deferral) and (snap.sites[outcome.site], outcome.slot) == ("ashburn", 3)
    assert outcome.risk_then == 0.0


def test_a_priced_deferral_says_how_its_risk_to_the_deadline_grows() -> None:
    snap = replace(snapshot(NOON, FLAT), run_time_errors=errors_of([2.0] * 30 + [1.0] * 70))
    outcome = decide(green(miss_cost=1.0), TIGHT, snap)
    assert isinstance(outcome, Deferral)
    assert (outcome.risk_now, outcome.risk_then) == (0.0, 0.3)
    # value_then is the forecast carbon itself, not the priced value the search compared
    assert outcome.value_then == pytest.approx(4 * 0.4 * 2 * 100.0 / 1000.0)
    assert outcome.reason(snap.sites).endswith("the chance of missing its deadline, from how long recent jobs "
                                               "ran against their estimates, goes from 0.0% to 30.0%")
    assert outcome.as_dict(snap.sites)["deadline_risk"] == {"now": 0.0, "then": 0.3}
    decision, _ = explained(green(miss_cost=1.0), outcome, snap, TIGHT)  # what GET /v1/jobs/{id}/decision gives
    assert decision.model_dump(mode="json")["deferral"]["deadline_risk"] == {"now": 0.0, "then": 0.3}
    unpriced = decide(green(), TIGHT, snap)
    assert math.isnan(unpriced.risk_then) and unpriced.as_dict(snap.sites)["deadline_risk"] is None
    assert "chance of missing" not in unpriced.reason(snap.sites)


def test_every_built_in_profile_that_defers_prices_the_risk_out_of_the_box() -> None:
    assert {name: shift.miss_cost > 0 for name, shift in SHIFTS.items()} == {
        "balanced": True, "green": True, "cheap": True}


# -- the simulator learns from finished jobs only ---------------------------------------------------------------

def test_the_replay_learns_from_jobs_that_ran_past_their_estimates_and_stops_risking_deadlines(tmp_path: Path):
    """Sixty 1-GPU jobs at midnight and three 8-GPU jobs at 06:00, every one running twice its estimate. The
    three (estimated 2 h, really 4 h) could save 1.6 kg each by waiting for FR's clean afternoon at 12:00,
    and the 1.5 × estimate safety allows it (deadline 15:30, latest start 12:30), but a 4-hour run from 12:00
    ends at 16:00. By 06:00 the sixty small jobs have finished and shown that jobs here run twice their
    estimates: green, which prices that risk, starts the three at once and meets every deadline; the same
    profile with the price off defers them and misses three."""
    rows = "2022-06-04T00:00:00,3600,1,x\n" * 60 + "2022-06-04T06:00:00,14400,8,x\n" * 3
    spec = _clean_afternoons(tmp_path, 6, rows, slack_h=5.5, gpus=32)
    spec.assumptions["slack_factor"] = 1.0  # every job's slack is the 5.5 h
    prep = prepare(spec)
    w = replace(prep.workload, estimated_duration_s=prep.workload.true_duration_s / 2.0)
    prep = replace(prep, workload=w, requests=engine.requests_of(w))
    big = slice(60, 63)

    priced = simulate(spec, prepared=prep).policies["green"]
    assert priced.metrics["deadline_misses"] == 0 and priced.metrics["deferred_misses"] == 0
    assert (priced.start_s[big] == 6 * 3600.0).all() and not priced.was_deferred[big].any()

    unpriced_pipeline = pipeline_for(BUILTIN["green"], SHIFTS["green"].model_copy(update={"miss_cost": 0.0}))
    unpriced = engine.replay("green-unpriced", unpriced_pipeline, prep.workload, prep.federation, prep.requests,
                             prep.left_out)
    assert unpriced.was_deferred[big].all() and (unpriced.start_s[big] == 12 * 3600.0).all()
    assert int((unpriced.end_s > prep.workload.deadline_s).sum()) == 3


def test_the_replay_learns_nothing_from_jobs_still_running(tmp_path: Path) -> None:
    """The same three jobs, but the sixty small ones run from 05:00 to 07:00. At 06:00 none has finished, so
    nothing is known about how this workload's estimates run (the replay knows the true run times; only a
    finished job tells the policies): the risk is not priced and green defers the three to 12:00. At 07:00
    the sixty end, the deferred three are decided again, now with the risk priced, and start at once: every
    deadline is met."""
    rows = "2022-06-04T05:00:00,7200,1,x\n" * 60 + "2022-06-04T06:00:00,14400,8,x\n" * 3
    spec = _clean_afternoons(tmp_path, 6, rows, slack_h=5.5, gpus=64)  # room for the three beside the sixty
    spec.assumptions["slack_factor"] = 1.0
    prep = prepare(spec)
    w = replace(prep.workload, estimated_duration_s=prep.workload.true_duration_s / 2.0)
    prep = replace(prep, workload=w, requests=engine.requests_of(w))
    green_run = simulate(spec, prepared=prep).policies["green"]
    big = slice(60, 63)
    assert green_run.was_deferred[big].all()  # at 06:00, for the clean afternoon
    assert (green_run.start_s[big] == 2 * 3600.0).all()  # 07:00, as soon as the sixty have shown their errors
    assert green_run.metrics["deadline_misses"] == 0


# -- the live broker -----------------------------------------------------------------------------------------------

async def test_the_live_broker_learns_run_times_from_successes_and_again_after_a_restart(tmp_path: Path):
    t0 = datetime(2022, 6, 1, 12, tzinfo=UTC)
    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    settings = BrokerSettings(db=str(tmp_path / "r.db"), shutdown_grace_s=0.1)
    clock = ManualClock(t0)
    b = Broker(settings, clock=clock)
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=fast)], run_loop=False)
    try:
        j, _ = await b.book.submit(job(count=1, duration_s=600))
        await b.cycle.run_once()
        for _ in range(3):
            await clock.advance(601 if _ else 1)
            await asyncio.sleep(0.05)
            await b.cycle.drain()
        done = await b.book.get(j.id)
        assert done.state == JobState.SUCCEEDED
        assert b.lifecycle.run_times.sorted() == pytest.approx([math.log(done.run_s / 600.0)])
        assert b.cycle._with_plan(b.federation.freeze(clock.now())).run_time_errors.size == 1
    finally:
        await b.stop()
    again = Broker(settings, clock=ManualClock(t0 + timedelta(hours=1)))
    await again.start([site("alpha", gpus={"a100-80gb": 8}, adapter=fast)], run_loop=False)
    try:
        assert again.lifecycle.run_times.sorted() == pytest.approx([math.log(done.run_s / 600.0)])
    finally:
        await again.stop()


async def test_a_restarted_broker_keeps_the_jobs_that_finished_last_not_the_last_submitted(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """Three jobs estimated at 600 s, submitted a, b, c, that really run 1,800, 300 and 600 s: they finish b,
    c, a. With room for two errors, the live broker keeps c's and a's; so does a broker started afterwards on
    the same store, which lists jobs by submission."""
    from adapters.simulated import SimulatedSite

    monkeypatch.setattr(runtime_risk, "KEEP", 2)
    t0 = datetime(2022, 6, 1, 12, tzinfo=UTC)
    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    runs = {"a": 1800.0, "b": 300.0, "c": 600.0}
    settings = BrokerSettings(db=str(tmp_path / "r.db"), shutdown_grace_s=0.1)
    clock = ManualClock(t0)
    b = Broker(settings, clock=clock, factory=lambda spec: SimulatedSite(
        spec, clock, fast, run_seconds=lambda j: runs[j.spec.name]))
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=fast)], run_loop=False)
    expected = sorted([math.log(600.0 / 600.0), math.log(1800.0 / 600.0)])
    try:
        for name in "abc":
            await b.book.submit(job(name=name, count=1, duration_s=600))
        await b.cycle.run_once()
        for step in (1.0, 300.0, 300.0, 1200.0, 1.0):
            await clock.advance(step)
            await asyncio.sleep(0.05)
            await b.cycle.drain()
        assert len((await b.store.list_jobs(JobFilter(state=JobState.SUCCEEDED), limit=10)).items) == 3
        assert b.lifecycle.run_times.sorted() == pytest.approx(expected)
    finally:
        await b.stop()
    again = Broker(settings, clock=ManualClock(t0 + timedelta(hours=1)))
    await again.start([site("alpha", gpus={"a100-80gb": 8}, adapter=fast)], run_loop=False)
    try:
        assert again.lifecycle.run_times.sorted() == pytest.approx(expected)
    finally:
        await again.stop()


# -- book_overruns: what a job past its estimate is expected to hold, and deferrals that would slip -----------

def test_the_expected_run_of_a_job_is_the_median_of_those_that_ran_as_long() -> None:
    errors = errors_of([0.5] * 50 + [2.0] * 30 + [4.0] * 20)
    # all 100: the middle two are 0.5 and 2.0, and the median is taken in log terms (their geometric mean)
    assert runtime_risk.expected_ratio(errors, 0.25) == pytest.approx(1.0)
    assert runtime_risk.expected_ratio(errors, 0.0) == pytest.approx(1.0)  # a job that has not run yet: all 100
    assert runtime_risk.expected_ratio(errors, 1.2) == pytest.approx(2.0)  # past 1.2 ×: the fifty at 2 × and 4 ×
    assert runtime_risk.expected_ratio(errors, 2.0) == pytest.approx(4.0)  # ran exactly 2 × is not longer
    assert runtime_risk.expected_ratio(errors, 4.5) is None  # longer than any finished job: nothing to judge by
    assert runtime_risk.expected_ratio(errors_of([2.0] * (MIN_SAMPLES - 1)), 1.2) is None  # too few finished


def _overrun_replay(tmp_path: Path, book_overruns: bool, slack_h: float) -> tuple[engine.PolicyRun, float]:
    """Sixty 1-GPU jobs at midnight teach the replay how jobs here run against their estimates: fifty as
    estimated, ten twice as long. A hog of all 8 of FR's GPUs starts at FR's clean noon, estimated at 2 h; it
    runs 4 h, to 16:00. At 14:30 an 8-GPU job estimated at 1 h (it runs 2 h) arrives with its deadline
    ``slack_h`` hours after its estimated end; FR from 15:00 would save it 0.8 kg against GB now. ``green``
    with the deadline risk priced at 1 kg per whole unit of probability."""
    rows = ("2022-06-04T00:00:00,3600,1,x\n" * 60 + "2022-06-04T12:00:00,14400,8,x\n"
            + "2022-06-04T14:30:00,7200,8,x\n")
    spec = _clean_afternoons(tmp_path, 6, rows, slack_h=72, gpus=8)
    prep = prepare(spec)
    w = prep.workload
    ratio = np.array([1.0] * 50 + [2.0] * 10 + [2.0, 2.0])
    deadline = w.deadline_s.copy()
    deadline[61] = w.submit_s[61] + (1.0 + slack_h) * 3600.0
    w = replace(w, estimated_duration_s=w.true_duration_s / ratio, deadline_s=deadline)
    prep = replace(prep, workload=w, requests=engine.requests_of(w))
    shift = SHIFTS["green"].model_copy(update={"miss_cost": 1.0, "book_overruns": book_overruns})
    run = engine.replay("green", pipeline_for(BUILTIN["green"], shift), w, prep.federation, prep.requests,
                        prep.left_out)
    assert (run.site[60], run.start_s[60], run.end_s[60]) == (1, 12 * 3600.0, 16 * 3600.0)  # the hog, at FR
    return run, float(deadline[61])


def test_without_book_overruns_a_deferral_planned_on_a_job_past_its_estimate_slips_and_misses(tmp_path) -> None:
    # Deadline 16:45, so its latest start is 15:15. The plan counts the hog's GPUs free from 15:00, an hour
    # after its estimate ran out: the job is deferred to FR then (a one-in-six chance of a miss, priced at
    # 0.17 kg), finds the hog still there, can no longer wait, and starts at 15:00 in GB: it ends at 17:00.
    run, deadline = _overrun_replay(tmp_path, book_overruns=False, slack_h=1.25)
    assert deadline == 16.75 * 3600.0
    assert run.was_deferred[61] and (run.site[61], run.start_s[61]) == (0, 15 * 3600.0)
    assert run.end_s[61] == 17 * 3600.0 > deadline


def test_with_book_overruns_a_deferral_that_would_slip_past_its_deadline_is_not_made(tmp_path) -> None:
    # The finished jobs that ran past 1.25 × their estimates ran 2 ×: the hog is expected to hold FR until
    # 16:00, and a start then would miss the 16:45 deadline for certain. The job starts at once in GB.
    run, deadline = _overrun_replay(tmp_path, book_overruns=True, slack_h=1.25)
    assert not run.was_deferred[61] and (run.site[61], run.start_s[61]) == (0, 14.5 * 3600.0)
    assert run.end_s[61] == 16.5 * 3600.0 <= deadline


def test_with_book_overruns_a_job_with_time_to_spare_still_waits_in_line_for_the_clean_site(tmp_path) -> None:
    # Two days of slack: waiting for the hog to end risks nothing, so the job is still deferred to FR and runs
    # there from 16:00, when the hog ends, in the clean afternoon.
    run, deadline = _overrun_replay(tmp_path, book_overruns=True, slack_h=48.0)
    assert run.was_deferred[61] and (run.site[61], run.start_s[61]) == (1, 16 * 3600.0)
    assert run.carbon_kg[61] == pytest.approx(8 * 0.4 * 2 * 50 / 1000)


@pytest.mark.parametrize("book_overruns", [False, True])
async def test_the_live_pass_knows_what_a_job_past_its_estimate_is_expected_to_hold(tmp_path: Path,
                                                                                     book_overruns: bool) -> None:
    """A job estimated at half an hour holds alpha's 8 GPUs from 12:00:01 and is still running at 13:00:01,
    twice its estimate. Of sixty finished jobs, thirty ran three times their estimates and thirty six times.
    The plan counts its GPUs free from the next hour either way; with ``book_overruns`` in the profile the
    pass also shows what it is expected to hold past that (``plan_overrun``), until the end those that ran as
    long predict: 12:00:01 + 30 min × sqrt(3 × 6) (the median in log terms), 14:07, so the 14:00 hour. At
    13:40, past 3 ×, only the thirty that ran 6 × are like it: until 15:00:01, the 15:00 hour too."""
    from adapters.simulated import SimulatedSite

    t0 = datetime(2022, 6, 1, 12, tzinfo=UTC)
    fast = SimulatedAdapterConfig(dispatch_delay_s=1.0)
    settings = BrokerSettings(db=str(tmp_path / "o.db"), shutdown_grace_s=0.1, profiles={
        "default": "late", "definitions": {"late": {"weights": {"carbon": 1.0},
                                                    "shift": {"book_overruns": book_overruns}}}})
    clock = ManualClock(t0)
    b = Broker(settings, clock=clock, factory=lambda spec: SimulatedSite(
        spec, clock, fast, run_seconds=lambda j: 4 * j.spec.duration_s))
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=fast)], run_loop=False)
    try:
        for _ in range(30):
            b.lifecycle.run_times.add(1800.0, 3 * 1800.0)
            b.lifecycle.run_times.add(1800.0, 6 * 1800.0)
        j, _ = await b.book.submit(job(count=8, duration_s=1800))
        await b.cycle.run_once()
        await clock.advance(1.0)
        await asyncio.sleep(0.05)
        await b.cycle.drain()
        assert (await b.book.get(j.id)).state == JobState.RUNNING
        await clock.advance(3600.0)  # 13:00: past its half-hour estimate, on its way to two hours
        await asyncio.sleep(0.05)
        await b.cycle.drain()
        assert (await b.book.get(j.id)).state == JobState.RUNNING
        snap = b.cycle._with_plan(b.federation.freeze(clock.now()))
        at = (snap.index["alpha"], MODEL_INDEX["a100-80gb"])
        assert snap.plan_free[at][1:4].tolist() == [8.0, 8.0, 8.0]  # 14:00 to 16:00 (0: the site now)
        if not book_overruns:
            assert snap.plan_overrun.size == 0
        else:
            assert snap.plan_overrun[at][:4].tolist() == [0.0, 8.0, 0.0, 0.0]
        await clock.advance(2400.0)  # 13:40:01
        await asyncio.sleep(0.05)
        await b.cycle.drain()
        assert (await b.book.get(j.id)).state == JobState.RUNNING
        snap = b.cycle._with_plan(b.federation.freeze(clock.now()))
        assert snap.plan_free[at][1:4].tolist() == [8.0, 8.0, 8.0]
        if book_overruns:
            assert snap.plan_overrun[at][:4].tolist() == [0.0, 8.0, 8.0, 0.0]
    finally:
        await b.stop()


def test_with_max_risk_one_jobs_lack_of_a_safe_start_is_not_taken_for_anothers() -> None:
    # No A100 is free anywhere now. A, due soon, has no later start within max_risk; B, due in days, has.
    # The pass remembers which requests found no plan, so that their like is not searched again: B is not A's.
    from broker.cycle import PassDecider

    errors = RunTimeErrors()
    for r in np.linspace(0.5, 4.0, 60):
        errors.add(3600.0, 3600.0 * float(r))
    no_a100 = {name: 0 for name in ("ashburn", "toronto", "frankfurt", "sydney")}
    hour0 = NOON.replace(minute=0).timestamp()
    a = request(job_id="A", deadline_ts=hour0 + 4 * 3600.0, submitted_ts=NOON.timestamp())
    b = request(job_id="B", deadline_ts=NOON.timestamp() + 100 * 3600.0,
                submitted_ts=NOON.timestamp() - 336 * 3600.0 + 0.9 * 3600)  # the same last slot as A (max_wait)
    pipeline = green(miss_cost=30.0, max_risk=0.5)

    def pass_() -> PassDecider:
        snap = snapshot(NOON, FLAT, free=no_a100)
        return PassDecider(pipeline, replace(snap, run_time_errors=errors.sorted()))

    alone = pass_().decide(b)
    assert isinstance(alone, Deferral)
    decider = pass_()
    first = decider.decide(a)
    assert not isinstance(first, Deferral) and not first.placed  # it waits: no start it may take
    after = decider.decide(b)
    assert isinstance(after, Deferral) and (after.site, after.slot) == (alone.site, alone.slot)
