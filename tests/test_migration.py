"""Moving running work (policies.migration): which running jobs move where, and what the simulator charges
for a move."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.data.traces import parse_columns
from broker.simulation.run import SimulationSpec, simulate
from policies.migration import MigrationPolicy, Running, make_room, plan_moves, urgent
from policies.pipeline import Pipeline
from policies.profiles import BUILTIN, MIGRATIONS, SHIFTS, Profile, pipeline_for
from policies.snapshot import TDP_KW
from tests.test_sim_engine import _site
from tests.test_timeshift import A100, NOON, request, snapshot

H = 3600.0
GREEN = pipeline_for(BUILTIN["green"], SHIFTS["green"], MigrationPolicy())
# Frankfurt (where the job runs) is dirty, Toronto clean, the others in between: flat for two days.
FORECAST = {"frankfurt": [600.0] * 48, "toronto": [100.0] * 48, "ashburn": [450.0] * 48, "sydney": [500.0] * 48}


def running(hours: float = 10.0, done_h: float = 1.0, count: int = 8, job_id: str = "r", **kw) -> Running:
    req = request(hours=hours, slack_h=kw.pop("slack_h", 48.0), count=count, job_id=job_id,
                  checkpointable=kw.pop("checkpointable", True), **kw)
    return Running(req, site=-1, model=A100, done_s=done_h * H)


def at(snap, run: Running, site: str) -> Running:
    return Running(run.request, snap.index[site], run.model, run.done_s)


def test_a_long_job_at_a_dirty_site_moves_where_the_rest_of_its_run_is_cleaner() -> None:
    # The job holds 8 of Frankfurt's 16 GPUs, and its hours are in the plan.
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 10)})
    job = at(snap, running(), "frankfurt")
    fra, tor = snap.index["frankfurt"], snap.index["toronto"]
    moves = plan_moves(GREEN, snap, [job], MigrationPolicy())
    assert [(snap.sites[m.site], m.model) for m in moves] == [("toronto", A100)]
    move = moves[0]
    kw = 8 * TDP_KW[A100]
    assert move.remaining_s == 9 * H
    assert move.value_stay == pytest.approx(kw * 600 * 9 / 1000)
    assert move.value_move == pytest.approx(kw * 100 * (9 + 1 / 6) / 1000)  # the 10-minute restart is paid
    reason = move.reason(snap.sites)
    assert reason.startswith("moved from frankfurt to toronto from its checkpoint")
    assert "~9.0 h" in reason and "83% less" in reason
    # Debited at once: Frankfurt's GPUs are free again, Toronto's taken, now and in the plan's next hours.
    assert snap.free_gpus[fra, A100] == 16 and snap.free_gpus[tor, A100] == 0
    assert snap.plan_free[tor, A100, 1:10].max() == 0 and (snap.plan_free[fra, A100, :10] == 16).all()


def test_a_long_job_is_judged_over_the_hours_the_forecast_covers() -> None:
    """99 hours are left but the forecast covers 47 h 40 min from now (48 hours from the start of this hour):
    the move is judged on those, restart included; the forecast's last hour is not stretched over four days."""
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 8})
    move, = plan_moves(GREEN, snap, [at(snap, running(hours=100.0, slack_h=200.0), "frankfurt")], MigrationPolicy())
    judged = 48 - 20 / 60
    kw = 8 * TDP_KW[A100]
    assert move.judged_s == pytest.approx(judged * H) and move.remaining_s == 99 * H
    assert move.value_stay == pytest.approx(kw * 600 * judged / 1000)
    assert move.value_move == pytest.approx(kw * 100 * (judged + 1 / 6) / 1000)
    assert "forecast for the next 47.7 h of the ~99.0 h left of its run" in move.reason(snap.sites)


def test_a_move_is_judged_over_the_models_hours_not_the_mean_day_after_them() -> None:
    """Rows a week long whose first 48 hours are the model's (carbon_forecast_model_h 48): the move is still
    judged over 47 h 40 min, not the 99 hours left; told nothing (0: all the row is the model's), over all 99."""
    from dataclasses import replace

    rows = {name: [700.0] * 48 for name in snapshot(NOON).sites} | FORECAST  # the other sites: dirtier still
    week = {name: row * 3 + row[:24] for name, row in rows.items()}  # 168 hours, the same levels
    wide = snapshot(NOON, week, free={"frankfurt": 8})
    job = running(hours=100.0, slack_h=200.0)
    move, = plan_moves(GREEN, replace(wide, carbon_forecast_model_h=48), [at(wide, job, "frankfurt")],
                       MigrationPolicy())
    assert move.judged_s == pytest.approx((48 - 20 / 60) * H)
    wide = snapshot(NOON, week, free={"frankfurt": 8})
    move, = plan_moves(GREEN, wide, [at(wide, job, "frankfurt")], MigrationPolicy())
    assert wide.carbon_forecast_model_h == 0 and move.judged_s == pytest.approx(99 * H)


@pytest.mark.parametrize("case, job, forecast, booked", [
    ("not checkpointable", running(checkpointable=False), FORECAST, None),
    ("under 2 h left", running(hours=2.5, done_h=1.0), FORECAST, None),
    ("ran past its estimate", running(hours=10.0, done_h=11.0), FORECAST, None),
    ("the deadline would not hold", running(slack_h=3.0), FORECAST, None),
    ("saves under 20 %", running(), FORECAST | {"toronto": [520.0] * 48, "ashburn": [600.0] * 48,
                                                "sydney": [600.0] * 48}, None),
    ("the clean site's hours are promised", running(), FORECAST | {"ashburn": [600.0] * 48, "sydney": [600.0] * 48},
     {"toronto": (8, 3, 6)}),
    ("a fractional job", running(count=1, milli=500), FORECAST, None),
])
def test_what_keeps_a_job_where_it_is(case, job, forecast, booked) -> None:
    snap = snapshot(NOON, forecast, free={"frankfurt": 8}, booked=booked)
    free, plan = snap.free_gpus.copy(), snap.plan_free.copy()
    assert plan_moves(GREEN, snap, [at(snap, job, "frankfurt")], MigrationPolicy()) == [], case
    assert (snap.free_gpus == free).all() and (snap.plan_free == plan).all()


def test_the_job_that_saves_most_gets_the_clean_room_first() -> None:
    """Toronto has room for one 8-GPU job: of a 4-hour and a 20-hour job at Frankfurt, the longer one, which
    saves more, gets it; the shorter one goes to the next cleanest site with room (Ashburn, 25 % cleaner)."""
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 0})
    short, long = at(snap, running(hours=5.0, job_id="short"), "frankfurt"), at(snap, running(hours=21.0, job_id="long"), "frankfurt")
    moves = plan_moves(GREEN, snap, [short, long], MigrationPolicy())
    assert [(m.running.request.job_id, snap.sites[m.site]) for m in moves] == [("long", "toronto"), ("short", "ashburn")]


def test_room_is_made_for_a_job_that_must_run_near_its_users() -> None:
    """Frankfurt is the only site with A100 80GB within 20 ms of europe-west1, and two checkpointable jobs fill
    it. A job there that can wait no longer gets one of them moved out (to the cleanest site with room for the
    rest of its run), and then fits."""
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 0})
    near = request(hours=4.0, slack_h=0.0, count=8, job_id="near", origin_region="gcp:europe-west1",
                   latency_slo_ms=20.0)
    assert urgent(near, NOON.timestamp(), MigrationPolicy())
    assert not GREEN.decide(near, snap).placed
    busy = [at(snap, running(job_id="a"), "frankfurt"), at(snap, running(job_id="b"), "frankfurt")]
    moves = make_room(GREEN, snap, near, busy, MigrationPolicy())
    assert [(m.running.request.job_id, snap.sites[m.site]) for m in moves] == [("a", "toronto")]
    assert "to make room for near, which must run near its users" in moves[0].reason(snap.sites)
    placed = GREEN.decide(near, snap)
    assert placed.placed and snap.sites[placed.site] == "frankfurt"


def test_no_room_is_made_when_the_jobs_in_the_way_cannot_move() -> None:
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 0})
    near = request(hours=4.0, slack_h=0.0, count=8, job_id="near", origin_region="gcp:europe-west1",
                   latency_slo_ms=20.0)
    stuck = [at(snap, running(job_id="a", checkpointable=False), "frankfurt"),
             at(snap, running(job_id="b", slack_h=2.0), "frankfurt")]  # its deadline leaves no time for a move
    free, plan = snap.free_gpus.copy(), snap.plan_free.copy()
    assert make_room(GREEN, snap, near, stuck, MigrationPolicy()) == []
    assert (snap.free_gpus == free).all() and (snap.plan_free == plan).all()


def test_a_job_with_slack_or_without_a_latency_objective_is_not_urgent() -> None:
    policy = MigrationPolicy()
    now = NOON.timestamp()
    assert not urgent(request(hours=4.0, slack_h=10.0, origin_region="gcp:europe-west1", latency_slo_ms=20.0), now, policy)
    assert not urgent(request(hours=4.0, slack_h=0.0), now, policy)


def test_green_moves_work_and_a_configured_profile_says_how() -> None:
    from policies.profiles import ProfilesConfig, profile_pipeline

    assert profile_pipeline("green").migrate == MigrationPolicy()
    assert profile_pipeline("fast").migrate is None and profile_pipeline("balanced").migrate is None
    config = ProfilesConfig.model_validate({"definitions": {"green": {"weights": {"carbon": 1.0}},
                                                            "mover": {"weights": {"cost": 1.0},
                                                                      "migrate": {"objective": "cost"}}}})
    assert profile_pipeline("green", config).migrate is None  # a redefinition says whether it moves work
    assert profile_pipeline("mover", config).migrate == MigrationPolicy(objective="cost")


def test_a_profile_says_how_it_moves_work_and_bad_settings_are_named() -> None:
    profile = Profile.model_validate({"weights": {"carbon": 1.0}, "migrate": {"min_saving": 0.3, "overhead_s": 300}})
    assert profile.migrate == MigrationPolicy(min_saving=0.3, overhead_s=300.0)
    with pytest.raises(ValidationError, match="min_saving"):
        Profile.model_validate({"weights": {"carbon": 1.0}, "migrate": {"min_saving": 1.5}})
    with pytest.raises(ValidationError, match="overhaed_s"):
        Profile.model_validate({"weights": {"carbon": 1.0}, "migrate": {"overhaed_s": 60}})


# --- in the simulator -----------------------------------------------------------------------------------


def _hourly(root: Path, first: datetime, days: int, levels: dict) -> Path:
    """``days`` of hourly carbon data per zone from ``first``, each hour's value ``levels[zone](its start)``."""
    for zone, value in levels.items():
        (root / zone).mkdir(parents=True)
        rows = ["Datetime (UTC),Zone Id,Carbon Intensity gCO2eq/kWh (direct),Carbon Intensity gCO2eq/kWh (LCA)"]
        rows += [f"{first + timedelta(hours=h):%Y-%m-%d %H:%M:%S},{zone},{value(first + timedelta(hours=h))},0"
                 for h in range(days * 24)]
        (root / zone / f"{zone}_2022_hourly.csv").write_text("\n".join(rows) + "\n")
    return root


def _greening(tmp_path: Path, checkpointable: float) -> SimulationSpec:
    """Ten days of data from 2022-06-01. GB (site a) is 300 g/kWh throughout; FR (site b) is 500 until
    2022-06-05 and 50 from then on. One 4-GPU job of 100 hours arrives on 2022-06-04, when FR is the dirtier:
    it starts in GB. Once the forecast (made from the past only) has seen FR's new level, the rest of the run
    is cleaner there."""
    first = datetime(2022, 6, 1, tzinfo=UTC)
    switch = datetime(2022, 6, 5, tzinfo=UTC)
    root = _hourly(tmp_path / "carbon", first, 10, {"FR": lambda t: 500.0 if t < switch else 50.0,
                                                    "GB": lambda t: 300.0})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=4)
                     + _site("b", "FR", "gcp:europe-west9", 2.0, gpus=4))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-04T00:00:00,360000,4,x\n")
    return SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=root,
        policies=["green"], sites=sites, bound=False,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0,
                     "checkpointable_fraction": checkpointable, "restart_s": 900.0})


def test_a_replayed_job_moves_once_the_forecast_sees_the_cleaner_grid_and_pays_for_the_restart(tmp_path: Path) -> None:
    still = simulate(_greening(tmp_path / "whole", 0.0)).policies["green"]
    result = simulate(_greening(tmp_path / "moving", 1.0))
    run = result.policies["green"]
    assert still.migrations == 0 and still.site.tolist() == [0]
    assert run.migrations == 1 and run.metrics["migrations"] == 1
    (job, site, model, began, moved_at), = run.moved.tolist()
    assert (job, site, began) == (0, 0, still.start_s[0]) and run.site.tolist() == [1]
    assert moved_at > 24 * H  # not before FR's new level is in the past the forecast reads
    # It restarts at b at once and runs the rest of its 100 hours after the 15-minute restart.
    assert run.last_start_s[0] == moved_at
    assert run.end_s[0] == pytest.approx(still.end_s[0] + 900.0)
    kw = 4 * TDP_KW[A100]
    assert run.energy_kwh[0] == pytest.approx(kw * (100 + 0.25))
    assert run.carbon_kg[0] == pytest.approx(kw * (300 * (moved_at - began) / H + 50 * (run.end_s[0] - moved_at) / H) / 1000)
    assert run.carbon_kg[0] < 0.5 * still.carbon_kg[0]
    assert run.metrics["deadline_misses"] == 0
    # Each piece is counted at its own site.
    span = run.end_s[0] - run.start_s[0]
    assert run.metrics["utilisation_by_site"]["a"] == pytest.approx((moved_at - began) / span)
    assert run.metrics["utilisation_by_site"]["b"] == pytest.approx((run.end_s[0] - moved_at) / span)
    assert np.isnan(still.last_start_s[0])


def _three_sites(tmp_path: Path, rows: str) -> SimulationSpec:
    """24 days of data from 2022-06-01: GB (site a) 300 g/kWh throughout, FR (b) 500 then 50 from 2022-06-05,
    DE (c) 400 then 30 from 2022-06-10. Sites of four A100s; a is the only site within 20 ms of
    europe-west2 (the others have no RTT from there)."""
    first = datetime(2022, 6, 1, tzinfo=UTC)
    day = lambda n: first + timedelta(days=n)  # noqa: E731
    levels = {"GB": lambda t: 300.0, "FR": lambda t: 500.0 if t < day(4) else 50.0,
              "DE": lambda t: 400.0 if t < day(9) else 30.0}
    root = _hourly(tmp_path / "carbon", first, 24, levels)
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=4)
                     + _site("b", "FR", "gcp:europe-west9", 2.0, gpus=4) + _site("c", "DE", "gcp:europe-west3", 2.0, gpus=4))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n" + rows)
    return SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=root,
        policies=["green"], sites=sites, bound=False,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0})


def _replay(tmp_path: Path, rows: str, near: list[bool], checkpointable: list[bool],
            deadline_h: dict[int, float] | None = None, policy: MigrationPolicy | None = None,
            pipeline: Pipeline | None = None):
    """Replay ``rows`` over the three sites under green; jobs with ``near`` set have a 20 ms objective from
    europe-west2 (site a only); ``deadline_h``: job -> hours from its submission to its deadline."""
    from dataclasses import replace as with_

    from broker.simulation import engine
    from broker.simulation.run import prepare

    prep = prepare(_three_sites(tmp_path, rows))
    w = prep.workload
    n = len(w)
    deadline = w.deadline_s.copy()
    for i, hours in (deadline_h or {}).items():
        deadline[i] = w.submit_s[i] + hours * H
    w = with_(w, latency_slo_ms=np.where(near, 20.0, np.nan),
              origin_region=np.full(n, w.region_names.index("gcp:europe-west2"), dtype=w.origin_region.dtype),
              checkpointable=np.array(checkpointable), deadline_s=deadline)
    if pipeline is None:
        pipeline = GREEN if policy is None else pipeline_for(BUILTIN["green"], SHIFTS["green"], policy)
    run = engine.replay("green", pipeline, w, prep.federation, engine.requests_of(w), np.zeros(n, dtype=bool))
    return run, w


def _replay_near(tmp_path: Path, x_checkpointable: bool, q_deadline_h: float, pipeline: Pipeline | None = None):
    """X (4 GPUs, 100 h, submitted 2022-06-04 00:00) starts at a, the cleanest site then. Q (4 GPUs, 2 h,
    submitted half an hour later) must run at a (a 20 ms objective from europe-west2) and finish within
    ``q_deadline_h`` of its submission; a is full until X leaves."""
    return _replay(tmp_path, "2022-06-04T00:00:00,360000,4,x\n2022-06-04T00:30:00,7200,4,y\n", [False, True],
                   [x_checkpointable, False], {1: q_deadline_h}, pipeline=pipeline)


def test_room_is_made_in_a_replay_and_the_job_near_its_users_meets_its_deadline(tmp_path: Path) -> None:
    """Q's latest start (its deadline less 1.5 × its 2 hours) comes 7 hours after it arrived: within the
    hour before it, X is moved out of a to c (DE, cleaner than FR then), and Q starts at a at once. Once Q
    has left, a is 25 % cleaner than c, but green keeps a's GPUs for jobs near europe-west2 (Q held them:
    policies.latency_reserve, which moves treat as a bar), so X stays at c until the forecast has seen FR's
    new level, and moves there. Without the room kept, it moves back to a when Q leaves."""
    stuck, w = _replay_near(tmp_path / "stuck", False, q_deadline_h=10.0)
    assert stuck.start_s[1] == stuck.end_s[0] and stuck.end_s[1] > w.deadline_s[1]  # waits for X, and misses
    run, w = _replay_near(tmp_path / "moved", True, q_deadline_h=10.0)
    pieces = [(int(j), int(site), a / H, b / H) for j, site, _, a, b in run.moved.tolist()]
    assert [p[:2] for p in pieces] == [(0, 0), (0, 2)] and run.site.tolist() == [1, 0]
    made_room = pieces[0][3] * H
    assert run.start_s[1] == made_room and 6 * H <= made_room - w.submit_s[1] <= 7 * H
    assert run.end_s[1] <= w.deadline_s[1]
    assert pieces[1][3] > run.end_s[1] / H + 24  # not back to a when Q ended: on to FR a day later
    assert run.end_s[0] == pytest.approx(100 * H + 2 * 600.0)  # two restarts
    open_room = SHIFTS["green"].model_copy(update={"latency_reserve": None, "latency_reserve_price": None})
    back, w = _replay_near(tmp_path / "back", True, q_deadline_h=10.0,
                           pipeline=pipeline_for(BUILTIN["green"], open_room, MIGRATIONS["green"]))
    pieces = [(int(j), int(site), a / H, b / H) for j, site, _, a, b in back.moved.tolist()]
    assert [p[:2] for p in pieces] == [(0, 0), (0, 2), (0, 0)] and back.site.tolist() == [1, 0]
    assert pieces[1][3] == back.end_s[1] / H  # back to a when Q ended
    assert back.end_s[0] == pytest.approx(100 * H + 3 * 600.0)  # three restarts


def test_gpus_a_move_frees_go_to_the_queue_at_once(tmp_path: Path) -> None:
    """With a distant deadline Q is in no hurry; X moves for a saving once the forecast has seen FR clean,
    and Q takes a's GPUs in the same instant rather than when X would have ended."""
    run, w = _replay_near(tmp_path, True, q_deadline_h=90.0)
    (job, site, _, _, moved_at), = run.moved.tolist()
    assert (job, site) == (0, 0) and run.site.tolist() == [1, 0]
    assert run.start_s[1] == moved_at < run.end_s[0] - 30 * H
    assert run.end_s[1] <= w.deadline_s[1]


def test_a_job_no_other_site_can_take_is_stopped_and_resumed_from_its_checkpoint(tmp_path: Path) -> None:
    """As above, but b and c are full of work that cannot move (it must start at once; X came an hour
    before it and took a): X is stopped when Q can wait no longer (X's deadline, 300 h after it arrived,
    leaves it time to wait), Q runs at a, and X resumes there when Q ends, losing only the
    restart. Without ``suspend`` nothing can make room, and Q misses its deadline."""
    rows = ("2022-06-03T23:00:00,360000,4,x\n2022-06-04T00:00:00,720000,4,f\n2022-06-04T00:00:00,720000,4,f\n"
            "2022-06-04T00:30:00,7200,4,y\n")
    args = ([False, False, False, True], [True, False, False, False], {1: 200.0, 2: 200.0, 3: 10.0})  # f: no slack
    stuck, w = _replay(tmp_path / "stuck", rows, *args, policy=MigrationPolicy(suspend=False))
    assert stuck.migrations == stuck.preemptions == 0 and stuck.end_s[3] > w.deadline_s[3]
    run, w = _replay(tmp_path / "stopped", rows, *args)
    assert run.preemptions == run.requeues == 1 and run.migrations == 0
    (job, site, _, began, stopped_at), = run.moved.tolist()
    assert (job, site, began) == (0, 0, 0.0) and run.site[0] == 0 and run.site[3] == 0
    assert run.start_s[3] == stopped_at and run.end_s[3] <= w.deadline_s[3]
    assert run.last_start_s[0] == run.end_s[3]  # resumed when Q left
    assert run.end_s[0] == pytest.approx(run.end_s[3] + 600.0 + (100 * H - stopped_at))
    assert run.end_s[0] <= w.deadline_s[0] and run.start_s[0] == 0.0
    kw = 4 * TDP_KW[A100]
    assert run.energy_kwh[0] == pytest.approx(kw * (100 + 1 / 6))  # the work once, and the restart


def test_with_no_other_site_free_a_job_in_the_way_is_stopped_if_its_deadline_can_wait() -> None:
    snap = snapshot(NOON, FORECAST, free={"frankfurt": 0, "toronto": 0, "ashburn": 0, "sydney": 0})
    near = request(hours=4.0, slack_h=0.0, count=8, job_id="near", origin_region="gcp:europe-west1",
                   latency_slo_ms=20.0)
    fra = snap.index["frankfurt"]
    # "a" has 9 h of its run left and its deadline 20 h away: too little to wait; "b" has 48 hours of slack.
    busy = [at(snap, running(job_id="a", slack_h=10.0), "frankfurt"), at(snap, running(job_id="b"), "frankfurt")]
    moves = make_room(GREEN, snap, near, busy, MigrationPolicy())
    assert [(m.running.request.job_id, m.site) for m in moves] == [("b", -1)]
    assert moves[0].reason(snap.sites).startswith(
        "stopped on frankfurt and requeued from its checkpoint to make room for near")
    assert snap.free_gpus[fra, A100] == 8 and GREEN.decide(near, snap).placed
    assert make_room(GREEN, snapshot(NOON, FORECAST, free={"frankfurt": 0, "toronto": 0, "ashburn": 0, "sydney": 0}),
                     near, busy, MigrationPolicy(suspend=False)) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0, 24), st.floats(2, 100), st.integers(1, 2), st.booleans(), st.booleans()),
                min_size=4, max_size=10))
def test_property_moved_and_stopped_jobs_run_their_work_once_plus_the_restarts(tmp_path_factory, jobs) -> None:
    """Random jobs (arrival in the first day and run in hours, GPUs, near europe-west2 with two hours of
    slack or not, checkpointable or not) over the three sites, while FR turns clean a day in and DE five
    days in: however often green moves or stops them, each job's pieces follow one another, add up to
    its run plus a restart per move or stop (or as much of one as ran before the next move), and its
    energy is that much GPU time; a job near its users
    runs only at a."""
    jobs = sorted(jobs)
    t0 = datetime(2022, 6, 4, tzinfo=UTC)
    rows = "".join(f"{t0 + timedelta(hours=a):%Y-%m-%dT%H:%M:%S},{int(d * H)},{g},x\n" for a, d, g, _, _ in jobs)
    near = [n for *_, n, _ in jobs]
    checkpointable = [c and not n for *_, n, c in jobs]
    slack = {i: d + 2.0 for i, (_, d, _, n, _) in enumerate(jobs) if n}
    run, w = _replay(tmp_path_factory.mktemp("p"), rows, near, checkpointable, slack)
    job, site, a, b = run.pieces()
    # Each piece after the first resumes from a checkpoint and spends up to 600 s restarting (less where the
    # job was moved again before its restart was done); the rest of each piece is work.
    first = np.zeros(len(job), dtype=bool)
    first[[int(np.flatnonzero(job == k)[np.argmin(a[job == k])]) for k in np.unique(job)]] = True
    restarting = np.where(first, 0.0, np.minimum(b - a, 600.0))
    work = w.true_duration_s + np.bincount(job, weights=restarting, minlength=len(w))
    assert np.bincount(job, weights=b - a, minlength=len(w)) == pytest.approx(work)
    assert (b > a).all() and (run.end_s - run.start_s >= work - 1e-6).all()
    assert run.energy_kwh == pytest.approx(TDP_KW[A100] * w.gpus * work / H)
    for k in range(len(w)):
        order = np.argsort(a[job == k])
        starts, ends = a[job == k][order], b[job == k][order]
        assert (starts[1:] >= ends[:-1] - 1e-6).all()
        if near[k]:
            assert (site[job == k] == 0).all()


def _plan_moves_by_trying_every_site(pipeline, snap, running_jobs, policy):
    """plan_moves as first written: every feasible site tried in order, for each candidate (the reference
    the faster search must agree with, move for move)."""
    from policies import migration as m
    from policies.pipeline import choose_model
    from policies.scorers._usable import usable_models

    at_ = m._Clock(snap)
    candidates = []
    for i, run in enumerate(running_jobs):
        remaining = m.movable(run, at_.now_ts, policy)
        if remaining is None:
            continue
        judged_h, stay_rates, move_rates = m._values(snap, policy, at_, remaining)
        g = run.request.charge
        stay = float(stay_rates[run.site, run.model]) * g
        usable = usable_models(run.request, snap) & (snap.total_gpus >= run.request.count)
        floor = float(np.nanmin(np.where(usable, move_rates, np.nan))) * g if usable.any() else float("nan")
        if stay == stay and floor == floor and stay - floor >= max(policy.min_saving * stay, policy.min_saving_abs):
            candidates.append((floor - stay, i, remaining, stay, judged_h, move_rates))
    candidates.sort(key=lambda c: c[:2])
    moves = []
    for _, i, remaining, stay, judged_h, move_rates in candidates:
        run = running_jobs[i]
        rest = m.rest_of(run, remaining, policy)
        placement = pipeline.decide(rest, snap)
        bar = stay - max(policy.min_saving * stay, policy.min_saving_abs)
        best = None
        for site in placement.feasible.tolist():
            if site == run.site:
                continue
            model = choose_model(rest, snap, site)
            value = float(move_rates[site, model]) * rest.charge
            if value <= bar and (best is None or value < best[0]) and m._has_room(snap, site, model, rest, at_,
                                                                                 pipeline.shift):
                best = (value, site, model)
        if best is not None:
            value, site, model = best
            m._debit(snap, run, rest, site, model)
            moves.append((run.request.job_id, site, model, value, stay))
    return moves


@pytest.mark.parametrize(("seed", "planned"), [(1, True), (2, True), (3, True), (4, False), (5, False)])
def test_the_search_for_moves_finds_what_trying_every_site_finds(seed: int, planned: bool) -> None:
    """40 sites of random models, zones' flat forecasts, free GPUs and plans (or, for a profile that does not
    shift jobs, no plan, and sites that would preempt lower-priority work for a job); 150 running
    checkpointable jobs at random: the same moves, in the same order, to the same sites and models, at the
    same values."""
    import random
    from dataclasses import replace

    from broker.models import Health, ModelCapacity, SiteState
    from policies.snapshot import build_snapshot, replace_forecast
    from policies.timeshift import Calendar, epoch_hour
    from tests.builders import site

    rng = random.Random(seed)
    models = ("a100-80gb", "h100-80gb", "l4", "t4")
    owned = [rng.sample(models, rng.randint(1, 3)) for _ in range(40)]
    specs = [site(f"s{i:02d}", gpus={m: rng.choice((8, 16)) for m in mine},
                  usd_per_gpu_hour={m: rng.uniform(0.5, 5.0) for m in mine}) for i, mine in enumerate(owned)]
    states = {}
    for s in specs:
        caps = [ModelCapacity(model=m, total_gpus=n, free_gpus=rng.randint(0, n), used_gpus=0,
                              memory_gib_per_gpu=g.gpu_memory_gib)
                for m, n in s.total_gpus().items() for g in s.gpus if g.model == m][:len(s.total_gpus())]
        states[s.name] = SiteState(site=s.name, health=Health.HEALTHY, capacity=caps)
    snap = build_snapshot(NOON, specs, states)
    levels = [rng.choice((50.0, 100.0, 300.0, 300.0, 600.0)) for _ in specs]
    snap = replace_forecast(snap, np.array([[v] * 48 for v in levels]))
    calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(NOON))
    for s in range(snap.n_sites):
        for col in np.flatnonzero(snap.total_gpus[s]).tolist():
            calendar.book(s, col, float(rng.randint(0, 4)), epoch_hour(NOON) + rng.randint(1, 6),
                          epoch_hour(NOON) + rng.randint(6, 30))
    if planned:
        snap = replace(snap, plan_free=calendar.view(NOON, snap.free_gpus, snap.total_gpus, 97))
    else:  # GPUs held by preemptible work of lower priority count as room (policies.filters.gpu_fit)
        below = np.zeros((snap.n_sites, 2))
        below[:, 1] = [rng.choice((0, 0, 4, 8)) for _ in range(snap.n_sites)]
        snap = replace(snap, preempt_levels=(-100,), preempt_below=below)
    jobs = []
    for k in range(150):
        s = rng.randrange(snap.n_sites)
        col = rng.choice(np.flatnonzero(snap.total_gpus[s]).tolist())
        req = request(hours=rng.uniform(3, 40), slack_h=rng.choice((None, 60.0)), count=rng.choice((1, 2, 4, 8)),
                      job_id=f"r{k}", checkpointable=True, model=None)
        jobs.append(Running(req, s, col, done_s=rng.uniform(0, 1) * H))
    policy = MigrationPolicy(min_saving_abs=0.1)
    a, b = snap.working_copy(NOON), snap.working_copy(NOON)
    found = [(m.running.request.job_id, m.site, m.model, m.value_move, m.value_stay)
             for m in plan_moves(GREEN, a, jobs, policy)]
    assert found == _plan_moves_by_trying_every_site(GREEN, b, jobs, policy)
    assert len(found) >= 10, found  # the comparison covered real moves
    assert np.array_equal(a.free_gpus, b.free_gpus) and np.array_equal(a.plan_free, b.plan_free)


# Pausing (MigrationPolicy.pause): Frankfurt, where the job runs, is dirty for the next six hours and clean after;
# every other site is dirtier still, so no site is better now and only a later start saves.
PAUSE = MigrationPolicy(pause=True)
DIRTY_THEN_CLEAN = {"frankfurt": [600.0] * 6 + [100.0] * 42, "toronto": [700.0] * 48, "ashburn": [700.0] * 48,
                    "sydney": [700.0] * 48}


def test_a_job_through_dirty_hours_is_paused_and_planned_to_resume_when_the_grid_is_clean() -> None:
    snap = snapshot(NOON, DIRTY_THEN_CLEAN, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 5)})
    fra = snap.index["frankfurt"]
    job = at(snap, running(hours=5.0, done_h=1.0), "frankfurt")
    assert plan_moves(GREEN, snap, [job], MigrationPolicy()) == []  # without pause it runs on
    move, = plan_moves(GREEN, snap, [job], PAUSE)
    kw = 8 * TDP_KW[A100]
    assert move.site == -1 and move.for_job is None and move.remaining_s == 4 * H
    assert snap.sites[move.resume_site] == "frankfurt" and move.resume_at == datetime(2022, 6, 10, 18, tzinfo=UTC)
    # Running on: 4 h from 12:20, all at 600 g/kWh; resumed at 18:00: 4 h 10 min (the restart) at 100.
    assert move.value_stay == pytest.approx(kw * 600 * 4 / 1000)
    assert move.value_move == pytest.approx(kw * 100 * (4 + 1 / 6) / 1000)
    reason = move.reason(snap.sites)
    assert reason == ("paused on frankfurt until 2022-06-10T18:00Z and requeued from its checkpoint: the next 5.7 h "
                      "there are forecast above 100 g/kWh, the cleanest hours its deadline leaves for the ~4.0 h left "
                      "of its run are at or below it, and running that work then, restart included, is forecast at "
                      "1.33 kg CO2e against 7.68 kg CO2e now (83% less); planned to resume on frankfurt from "
                      "2022-06-10T18:00Z")
    assert move.not_before_ts == datetime(2022, 6, 10, 18, tzinfo=UTC).timestamp()
    # Debited at once: its GPUs free now, the planned hours (18:00 to 23:00) taken.
    assert snap.free_gpus[fra, A100] == 16
    assert (snap.plan_free[fra, A100, 1:6] == 16).all() and (snap.plan_free[fra, A100, 6:11] == 8).all()


@pytest.mark.parametrize("case, job", [
    ("not checkpointable", running(hours=5.0, checkpointable=False)),
    ("it asked to start at once", running(hours=5.0, deferrable=False)),
    ("the deadline comes before the clean hours", running(hours=5.0, slack_h=3.0)),
    ("under 2 h left", running(hours=2.5)),
])
def test_what_keeps_a_job_running_through_dirty_hours(case, job) -> None:
    snap = snapshot(NOON, DIRTY_THEN_CLEAN, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 5)})
    free, plan = snap.free_gpus.copy(), snap.plan_free.copy()
    assert plan_moves(GREEN, snap, [at(snap, job, "frankfurt")], PAUSE) == [], case
    assert (snap.free_gpus == free).all() and (snap.plan_free == plan).all(), case


def test_a_pause_that_saves_too_little_is_not_made() -> None:
    forecast = DIRTY_THEN_CLEAN | {"frankfurt": [600.0] * 6 + [520.0] * 42}  # 13 % cleaner later: under 20 %
    snap = snapshot(NOON, forecast, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 5)})
    plan = snap.plan_free.copy()
    assert plan_moves(GREEN, snap, [at(snap, running(hours=5.0), "frankfurt")], PAUSE) == []
    assert (snap.plan_free == plan).all()


def test_pause_needs_the_profiles_shift() -> None:
    with pytest.raises(ValidationError, match="pause needs shift"):
        Profile(weights={"carbon": 1.0}, migrate={"pause": True})
    assert Profile(weights={"carbon": 1.0}, shift={}, migrate={"pause": True}).migrate.pause
    # A pause weighs the grid's hours (carbon only): a cost objective would never pause, whatever it said.
    with pytest.raises(ValidationError, match="pause is for the carbon objective"):
        Profile(weights={"carbon": 1.0}, shift={}, migrate={"pause": True, "objective": "cost"})


def test_a_replayed_job_is_paused_through_each_night_and_emits_less_for_a_later_end(tmp_path: Path) -> None:
    """One site on a grid at 100 g/kWh from 08:00 to 20:00 UTC and 400 through the night (as a solar grid),
    its forecast the day before (seasonal-naive sees it exactly). A checkpointable 4-GPU job of 30 hours
    submitted at 08:00 with three days to spare: run through, 12 of its hours fall in the night; paused at
    each nightfall and resumed each morning, none does, for a restart each time, and it still ends by its
    deadline."""
    from broker.simulation import engine
    from broker.simulation.run import prepare

    first = datetime(2022, 6, 1, tzinfo=UTC)
    root = _hourly(tmp_path / "carbon", first, 12, {"GB": lambda t: 100.0 if 8 <= t.hour < 20 else 400.0})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=4))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-05T08:00:00,108000,4,x\n")
    prep = prepare(SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=root,
        policies=["green"], sites=sites, bound=False,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0,
                     "checkpointable_fraction": 1.0}))
    w = prep.workload
    runs = {}
    for pause in (False, True):
        pipeline = pipeline_for(BUILTIN["green"], SHIFTS["green"], MigrationPolicy(pause=pause))
        runs[pause] = engine.replay("green", pipeline, w, prep.federation, engine.requests_of(w), np.zeros(1, bool))
    through, paused = runs[False], runs[True]
    kw = 4 * TDP_KW[prep.federation.base.total_gpus.argmax(axis=1)[0]]
    assert through.preemptions == 0 and through.carbon_kg[0] == pytest.approx(kw * (18 * 100 + 12 * 400) / 1000)
    # Paused at 20:00 on both nights (the work left, 18 and then 6 hours, has day hours enough before its
    # deadline), resumed at 08:00, each restart 10 minutes of the day's GPU time.
    assert paused.preemptions == 2
    clock = lambda s: (w.start + timedelta(seconds=s)).strftime("%d %H:%M")  # noqa: E731 - UTC day and time
    pieces = sorted((clock(a), clock(b)) for _, _, _, a, b in paused.moved.tolist())
    assert pieces == [("05 08:00", "05 20:00"), ("06 08:00", "06 20:00")]
    assert clock(paused.last_start_s[0]) == "07 08:00" and clock(paused.end_s[0]) == "07 14:20"
    assert paused.carbon_kg[0] == pytest.approx(kw * (30 + 2 * 600 / H) * 100 / 1000)
    assert paused.end_s[0] <= w.deadline_s[0]


def test_no_pause_is_made_when_the_only_restart_planned_is_dirtier_than_running_on() -> None:
    """Frankfurt's clean hours from 18:00 are all promised to other deferred jobs, and every other site is at
    700 g/kWh: the only restart the plan has room for after the dirty hours is at one of those, dirtier than the
    600 the job runs at now. Pausing would emit more (and pay a restart): it runs on, the snapshot untouched."""
    from policies import timeshift

    snap = snapshot(NOON, DIRTY_THEN_CLEAN, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 5)})
    fra = snap.index["frankfurt"]
    timeshift.debit(snap, fra, A100, 16, 5, 97, near=False)
    free, plan = snap.free_gpus.copy(), snap.plan_free.copy()
    assert plan_moves(GREEN, snap, [at(snap, running(hours=5.0, done_h=1.0), "frankfurt")], PAUSE) == []
    assert (snap.free_gpus == free).all() and (snap.plan_free == plan).all()


def test_a_paused_job_that_finds_no_start_after_its_pause_keeps_no_job_of_its_shape_from_the_starts_before() -> None:
    """No A100 is free now anywhere, and the plan has room only for the next four hours. A job paused until
    18:00 finds no start after its pause: it is decided as if it had not been paused (a start in those four
    hours); a job of the same shape and deadline decided after it in the same pass still finds its start there."""
    from dataclasses import replace

    from broker.cycle import PassDecider
    from policies.timeshift import Deferral

    names = ("frankfurt", "toronto", "ashburn", "sydney")
    snap = snapshot(NOON, free={n: 0 for n in names}, booked={n: (16, 5, 97) for n in names})
    req = request(hours=2.0, slack_h=24.0, count=4)
    paused = replace(req, job_id="paused", not_before_ts=datetime(2022, 6, 10, 18, tzinfo=UTC).timestamp())
    decider = PassDecider(GREEN, snap)
    for r in (paused, req):
        deferral = decider.decide(r)
        assert isinstance(deferral, Deferral) and deferral.start < datetime(2022, 6, 10, 17, tzinfo=UTC), r
        decider.reserve(deferral)


def test_a_paused_job_whose_deadline_cannot_wait_for_its_pause_starts_around_the_plans_promises() -> None:
    """Frankfurt (the cleanest site, the profile's choice) has 8 A100s free now, promised to deferred jobs from
    13:00; Toronto has 8 free and promised to none. A job paused until 18:00 whose deadline needs it started by
    14:20 cannot wait for its pause: it starts now, where a job that was not paused would (Toronto), not over
    Frankfurt's promises."""
    from dataclasses import replace

    from broker.cycle import PassDecider

    flat = {"frankfurt": [100.0] * 48, "toronto": [300.0] * 48, "ashburn": [700.0] * 48, "sydney": [700.0] * 48}
    req = request(hours=2.0, slack_h=3.0, count=4)
    paused = replace(req, not_before_ts=datetime(2022, 6, 10, 18, tzinfo=UTC).timestamp())
    for r in (req, paused):
        snap = snapshot(NOON, flat, free={"frankfurt": 8, "toronto": 8, "ashburn": 0, "sydney": 0},
                        booked={"frankfurt": (16, 1, 97)})
        placed = PassDecider(GREEN, snap).decide(r)
        assert placed.placed and snap.sites[placed.site] == "toronto", r


def test_no_pause_is_made_when_the_plan_has_room_only_before_the_clean_hours() -> None:
    """Frankfurt is at 600 g/kWh for two hours, 300 for four, then 100; every site's GPUs are promised from
    20:00. The clean hours from 18:00 leave no room for the 4 h 10 min the job's rest needs, and the search's only
    start is at 15:00, within the hours the pause was to wait out: no pause is made."""
    from policies import timeshift

    forecast = DIRTY_THEN_CLEAN | {"frankfurt": [600.0] * 2 + [300.0] * 4 + [100.0] * 42}
    snap = snapshot(NOON, forecast, free={"frankfurt": 8}, booked={"frankfurt": (8, 0, 5)})
    for name in snap.sites:
        timeshift.debit(snap, snap.index[name], A100, float(snap.total_gpus[snap.index[name], A100]), 8, 97,
                        near=False)
    free, plan = snap.free_gpus.copy(), snap.plan_free.copy()
    assert plan_moves(GREEN, snap, [at(snap, running(hours=5.0, done_h=1.0), "frankfurt")], PAUSE) == []
    assert (snap.free_gpus == free).all() and (snap.plan_free == plan).all()
