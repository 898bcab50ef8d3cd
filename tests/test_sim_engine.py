"""The simulator's replay and accounting, on inputs small enough to check by hand, and its determinism."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import cli
from broker.data.traces import parse_columns
from broker.simulation.run import SimulationSpec, prepare, simulate
from policies.baselines import COMPARED

START = datetime(2022, 6, 1, tzinfo=UTC)


def _carbon(root: Path, series: dict[str, list[float]]) -> Path:
    for zone, values in series.items():
        (root / zone).mkdir(parents=True)
        rows = ["Datetime (UTC),Zone Id,Carbon Intensity gCO2eq/kWh (direct),Carbon Intensity gCO2eq/kWh (LCA)"]
        rows += [f"{(START + timedelta(hours=h)):%Y-%m-%d %H:%M:%S},{zone},{v},{v * 1.2}" for h, v in enumerate(values)]
        (root / zone / f"{zone}_2022_hourly.csv").write_text("\n".join(rows) + "\n")
    return root


def _site(name: str, zone: str, region: str, usd: float, gpus: int = 2) -> str:
    return (f"  - {{name: {name}, region: '{region}', grid_zone: {zone}, timezone: UTC, latitude: 0, longitude: 0,\n"
            f"     gpus: [{{model: a100-80gb, gpus_per_node: {gpus}, nodes: 1}}], usd_per_gpu_hour: {{a100-80gb: {usd}}},\n"
            f"     rtt_ms: {{'{region}': 1.0}}}}\n")


@pytest.fixture
def tiny(tmp_path: Path) -> SimulationSpec:
    """Two sites of two A100s (400 W each). Site a (GB, $2/GPU-h) is first in the file, b (FR, $1) second.
    Hourly intensity: GB 100, 300, 500, ...; FR 50, 150, 50, 150, ... (g/kWh).
    Jobs: j0 at 0 s, 2 GPUs, 1 h; j1 at 0 s, 1 GPU, 1.5 h; j2 at 1800 s, 2 GPUs, 1 h."""
    carbon = _carbon(tmp_path / "carbon", {
        "GB": [100.0 + 200 * h for h in range(48)],
        "FR": [50.0 if h % 2 == 0 else 150.0 for h in range(48)],
    })
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0) + _site("b", "FR", "gcp:europe-west9", 1.0))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n"
                     "2022-06-01T00:00:00,3600,2,x\n"
                     "2022-06-01T00:00:00,5400,1,y\n"
                     "2022-06-01T00:30:00,3600,2,x\n")
    return SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=carbon,
        policies=["baseline-spillover"], sites=sites,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0},
    )


def test_accounting_by_hand(tiny: SimulationSpec) -> None:
    result = simulate(tiny)
    run = result.policies["baseline-spillover"]
    # Spillover fills a first: j0 -> a at 0; j1 -> b at 0 (a is full); j2 waits until j0 ends, then a at 3600.
    assert [result.sites.names[s] for s in run.site] == ["a", "b", "a"]
    assert run.start_s.tolist() == [0.0, 0.0, 3600.0]
    assert run.end_s.tolist() == [3600.0, 5400.0, 7200.0]
    # Energy: 2 × 0.4 kW × 1 h, 1 × 0.4 × 1.5, 2 × 0.4 × 1.
    assert run.energy_kwh.tolist() == pytest.approx([0.8, 0.6, 0.8])
    # Carbon: j0 in GB hour 0 (100): 0.8 kWh × 100 g = 80 g; j1 in FR 1 h × 50 + 0.5 h × 150 = 125 g·h/kWh × 0.4 kW
    # = 50 g; j2 in GB hour 1 (300): 0.8 × 300 = 240 g.
    assert run.carbon_kg.tolist() == pytest.approx([0.08, 0.05, 0.24])
    assert run.cost_usd.tolist() == pytest.approx([4.0, 1.5, 4.0])
    m = run.metrics
    assert m["carbon_kg"] == pytest.approx(0.37)
    assert m["cost_usd"] == pytest.approx(9.5)
    assert m["energy_kwh"] == pytest.approx(2.2)
    assert m["jobs"] == 3
    assert m["wait_mean_s"] == pytest.approx(600.0)
    assert m["deadline_misses"] == 0
    # Busy GPU-hours 2 + 1.5 + 2 = 5.5 over 4 GPUs × 2 h.
    assert m["utilisation"] == pytest.approx(5.5 / 8)
    assert m["utilisation_by_site"] == pytest.approx({"a": 4 / 4, "b": 1.5 / 4})
    # Tenant x: slowdowns 1 and (1800 + 3600) / 3600 = 1.5, mean 1.25; tenant y: 1. Jain = 2.25² / (2 × (1.5625 + 1)).
    assert m["jain_fairness"] == pytest.approx(2.25**2 / (2 * (1.25**2 + 1)))


def test_carbon_greedy_and_cheapest_pick_by_their_signal(tiny: SimulationSpec) -> None:
    tiny.policies = ["baseline-carbon-greedy", "baseline-cheapest-first", "baseline-round-robin"]
    result = simulate(tiny)
    names = result.sites.names
    greedy = result.policies["baseline-carbon-greedy"]
    # FR (50) is cleaner than GB (100) at hour 0: j0 goes to b; j1 then only fits a; j2 waits for b (free at 3600,
    # FR hour 1 = 150 g, but a is busy until 5400 and b frees first).
    assert [names[s] for s in greedy.site] == ["b", "a", "b"]
    cheap = result.policies["baseline-cheapest-first"]
    assert [names[s] for s in cheap.site] == ["b", "a", "b"]
    rr = result.policies["baseline-round-robin"]
    assert [names[s] for s in rr.site] == ["a", "b", "a"]


def test_no_policy_beats_the_offline_bound(tiny: SimulationSpec) -> None:
    tiny.policies = ["baseline-spillover", "baseline-carbon-greedy", "baseline-cheapest-first"]
    result = simulate(tiny)
    bound = result.offline_bound
    assert bound is not None
    for run in result.policies.values():
        assert run.metrics["carbon_kg"] >= bound["carbon_kg"] - 1e-9
        assert run.metrics["gap_to_bound"] >= -1e-9
        assert run.metrics["cost_usd"] >= bound["cost_usd"] - 1e-9


def test_same_seed_same_numbers_on_real_data(shared_data: Path, tmp_path: Path) -> None:
    args = ["simulate", "--trace", str(shared_data / "traces/philly/philly_jobs_pollux.csv"), "--preset", "philly",
            "--carbon", str(shared_data / "carbon-intensity/electricitymaps-hourly"), "--trace-from", "2017-10-01",
            "--days", "2", "--compare", "baseline-round-robin,baseline-carbon-greedy", "--seed", "7"]
    figures = []
    for k in range(2):
        out = tmp_path / f"run{k}.json"
        assert cli.main([*args, "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        for m in doc["policies"].values():
            m.pop("replay_s")
        doc["offline_bound"].pop("solve_s")
        doc["whole_job_bound"].pop("solve_s")
        figures.append(doc)
    assert figures[0] == figures[1]
    greedy = figures[0]["policies"]["baseline-carbon-greedy"]
    rr = figures[0]["policies"]["baseline-round-robin"]
    assert greedy["jobs"] == rr["jobs"] > 1000
    assert greedy["carbon_kg"] < rr["carbon_kg"]  # greedy on intensity emits less than rotating blindly
    assert greedy["energy_kwh"] == pytest.approx(rr["energy_kwh"])  # same work, same GPUs


def test_left_out_jobs_are_reported_and_run_by_no_policy(tiny: SimulationSpec) -> None:
    tiny.trace.write_text(tiny.trace.read_text() + "2022-06-01T01:00:00,600,4,z\n")  # 4 GPUs: no site has 4
    result = simulate(tiny)
    assert result.left_out.tolist() == [False, False, False, True]
    assert result.policies["baseline-spillover"].site[3] == -1
    assert result.policies["baseline-spillover"].metrics["jobs"] == 3
    assert any("left out: 1 jobs" in line for line in result.report)
    assert np.isnan(result.policies["baseline-spillover"].start_s[3])


def test_a_tenant_limit_holds_each_tenant_to_its_gpus_in_every_replay_as_the_broker_would(tiny: SimulationSpec):
    """``--tenant-limit 2``: tenant x's second 2-GPU job waits for its first to end although the other site is empty
    (without the limit both start at once); y, under the same limit, is not held back by x; a job larger than the
    limit is left out, as a broker refuses it."""
    tiny.trace.write_text("submit,seconds,gpus,team\n"
                          "2022-06-01T00:00:00,3600,2,x\n"
                          "2022-06-01T00:00:00,3600,2,x\n"
                          "2022-06-01T00:10:00,600,1,y\n")
    tiny.policies = ["baseline-spillover", "green"]
    free = simulate(tiny)
    tiny.tenant_limit = 2
    limited = simulate(tiny)
    for name in tiny.policies:
        assert free.policies[name].start_s.tolist()[:2] == [0.0, 0.0], name
        starts = limited.policies[name].start_s.tolist()
        assert sorted(starts[:2]) == [0.0, 3600.0] and starts[2] < 3600.0, (name, starts)
    assert any("tenant limit: every tenant's jobs hold at most 2 GPUs" in line for line in limited.report)
    tiny.tenant_limit = 1.5
    result = simulate(tiny)
    assert result.left_out.tolist() == [True, True, False]
    assert any("left out: 2 jobs ask more GPUs than --tenant-limit 1.5" in line for line in result.report)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=12),
    gb=st.lists(st.floats(10, 900), min_size=48, max_size=48),
    fr=st.lists(st.floats(10, 900), min_size=48, max_size=48),
    slack=st.floats(1.0, 4.0),
)
def test_property_no_policy_emits_less_than_the_bound(
    tmp_path_factory: pytest.TempPathFactory, jobs: list[tuple[int, int, int]], gb: list[float], fr: list[float],
    slack: float,
) -> None:
    """Random small federations and traces: every policy's carbon and cost are at or above the offline bound."""
    root = tmp_path_factory.mktemp("prop")
    carbon = _carbon(root / "carbon", {"GB": gb, "FR": fr})
    sites = root / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=3)
                     + _site("b", "FR", "gcp:europe-west9", 1.5, gpus=2))
    trace = root / "trace.csv"
    trace.write_text("submit,seconds,gpus\n" + "".join(
        f"2022-06-01T{q // 4:02d}:{(q % 4) * 15:02d}:00,{quarters * 900},{gpus}\n" for q, quarters, gpus in jobs))
    spec = SimulationSpec(trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus"),
                          carbon=carbon, sites=sites, policies=list(COMPARED),
                          assumptions={"slack_factor": slack, "min_slack_s": 0.0, "estimate_sigma": 0.0})
    result = simulate(spec)
    bound = result.offline_bound
    assert bound is not None
    for run in result.policies.values():
        m = run.metrics
        # Each policy's own bound (the offline bound, or with its late jobs' windows reaching their ends).
        assert m["carbon_kg"] >= m["bound_carbon_kg"]
        assert m["cost_usd"] >= m["bound_cost_usd"]
        assert m["gap_to_bound"] >= 0
        if m["deadline_misses"] == 0:  # a policy that met every deadline is bounded by the offline bound itself
            assert m["bound_carbon_kg"] == bound["carbon_kg"]
        assert m["energy_kwh"] == pytest.approx(bound["energy_kwh"])  # one GPU model: same energy


def _trace(spec: SimulationSpec, rows: str, columns: str = "submit=submit,duration=seconds,gpus=gpus,tenant=team") -> None:
    spec.trace.write_text("submit,seconds,gpus,team,milli,due\n" + rows)
    spec.mapping = parse_columns(columns)


def test_a_run_that_does_not_start_on_the_hour_is_charged_the_right_hours(tiny: SimulationSpec) -> None:
    # One 2-GPU job of 1 h submitted at 00:30: it runs half in GB's hour 0 (100 g) and half in hour 1 (300 g).
    _trace(tiny, "2022-06-01T00:30:00,3600,2,x,1000,\n")
    tiny.policies = ["baseline-spillover"]
    run = simulate(tiny).policies["baseline-spillover"]
    assert run.carbon_kg[0] == pytest.approx(0.8 * (100 + 300) / 2 / 1000)


def test_start_maps_the_window_first_instant(tiny: SimulationSpec, tmp_path: Path) -> None:
    _trace(tiny, "2022-06-01T01:00:00,600,1,x,1000,\n2022-06-01T02:30:00,600,1,y,1000,\n")
    tiny.trace_from = datetime(2022, 6, 1, 2, tzinfo=UTC)
    tiny.start = datetime(2022, 6, 1, 20, tzinfo=UTC)
    result = simulate(tiny)
    # The window starts at 02:00 and is mapped to 20:00: its one job, 30 min into the window, arrives at 20:30.
    assert result.start + timedelta(seconds=float(result.submit_s[0])) == datetime(2022, 6, 1, 20, 30, tzinfo=UTC)
    run = result.policies["baseline-spillover"]
    assert run.carbon_kg[0] == pytest.approx(0.4 * (600 / 3600) * (100 + 200 * 20) / 1000)  # GB hour 20



@pytest.mark.parametrize("trace_from", [None, datetime(2022, 6, 1, tzinfo=UTC)], ids=["no window", "window from 00:00"])
def test_utilisation_counts_from_the_first_submit_not_from_the_window_or_the_hour(
        tiny: SimulationSpec, trace_from: datetime | None) -> None:
    # The tiny fixture's three jobs, 5 h 30 min later: the run's time 0 is 05:00 (the hour the first job
    # arrives in) without a window and 00:00 with --trace-from 2022-06-01, but the schedule and the span
    # from the first submit (05:30) to the last end (07:30) are the same: 5.5 busy GPU-hours over 4 GPUs × 2 h.
    _trace(tiny, "2022-06-01T05:30:00,3600,2,x,1000,\n2022-06-01T05:30:00,5400,1,y,1000,\n"
                 "2022-06-01T06:00:00,3600,2,x,1000,\n")
    tiny.trace_from = trace_from
    run = simulate(tiny).policies["baseline-spillover"]
    assert (run.end_s - run.start_s).tolist() == [3600.0, 5400.0, 3600.0]
    assert run.metrics["utilisation"] == pytest.approx(5.5 / 8)
    assert run.metrics["utilisation_by_site"] == pytest.approx({"a": 4 / 4, "b": 1.5 / 4})

def test_fractional_jobs_share_a_gpu_and_pay_for_their_share(tiny: SimulationSpec) -> None:
    _trace(tiny, "2022-06-01T00:00:00,3600,1,x,500,\n2022-06-01T00:00:00,3600,1,y,500,\n"
                 "2022-06-01T00:00:00,3600,2,x,1000,\n",
           columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,milli=milli")
    result = simulate(tiny)
    run = result.policies["baseline-spillover"]
    # Both halves share one of a's GPUs, so the 2-GPU job no longer fits on a and goes to b at once.
    assert [result.sites.names[s] for s in run.site] == ["a", "a", "b"]
    assert run.start_s.tolist() == [0.0, 0.0, 0.0]
    assert run.energy_kwh.tolist() == pytest.approx([0.2, 0.2, 0.8])
    assert run.cost_usd.tolist() == pytest.approx([1.0, 1.0, 2.0])


def test_power_and_price_follow_the_model_each_site_has(tiny: SimulationSpec) -> None:
    tiny.sites.write_text(tiny.sites.read_text().replace("model: a100-80gb", "model: h100-80gb", 1)
                          .replace("usd_per_gpu_hour: {a100-80gb: 2.0}", "usd_per_gpu_hour: {h100-80gb: 5.0}"))
    _trace(tiny, "2022-06-01T00:00:00,3600,1,x,1000,\n2022-06-01T00:00:00,3600,2,y,1000,\n")
    result = simulate(tiny)
    run = result.policies["baseline-spillover"]
    assert [result.sites.names[s] for s in run.site] == ["a", "b"]
    assert run.energy_kwh.tolist() == pytest.approx([0.7, 0.8])  # H100 700 W, A100 400 W
    assert run.cost_usd.tolist() == pytest.approx([5.0, 2.0])
    assert result.offline_bound is not None
    assert result.offline_bound["energy_kwh"] <= run.metrics["energy_kwh"]


def test_trace_deadlines_count_misses(tiny: SimulationSpec) -> None:
    # Two 2-GPU jobs of 1 h on one free site pair... j2 must wait for a: its deadline 1 h after submit is missed.
    _trace(tiny, "2022-06-01T00:00:00,3600,2,x,1000,2022-06-01T05:00:00\n"
                 "2022-06-01T00:00:00,3600,2,x,1000,2022-06-01T05:00:00\n"
                 "2022-06-01T00:00:00,3600,2,y,1000,2022-06-01T01:00:00\n",
           columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,deadline=due")
    run = simulate(tiny).policies["baseline-spillover"]
    assert run.start_s.tolist() == [0.0, 0.0, 3600.0]
    assert run.metrics["deadline_misses"] == 1


def test_a_policy_gap_does_not_depend_on_the_other_policies(tiny: SimulationSpec) -> None:
    _trace(tiny, "".join(f"2022-06-01T{h:02d}:00:00,{5400 + 600 * (h % 3)},{1 + h % 2},x,1000,2022-06-01T{h + 2:02d}:00:00\n"
                         for h in range(8)),
           columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,deadline=due")
    tiny.policies = ["baseline-round-robin"]
    alone = simulate(tiny).policies["baseline-round-robin"].metrics
    tiny.policies = list(COMPARED)
    together = simulate(tiny)
    assert together.policies["baseline-round-robin"].metrics["gap_to_bound"] == pytest.approx(alone["gap_to_bound"])
    for run in together.policies.values():
        assert run.metrics["gap_to_bound"] >= -1e-9


def test_profiles_replay_with_forecasts_made_from_the_past_only(tiny: SimulationSpec) -> None:
    from broker.data.carbon import load_carbon
    from broker.simulation.forecasts import forecast_rows

    tiny.policies = ["green", "baseline-carbon-greedy"]
    result = simulate(tiny)
    assert any(line.startswith("forecast: GB") for line in result.report)
    assert result.policies["green"].metrics["jobs"] == 3
    # With two weeks of history a zone gets seasonal-naive (24 h): the forecast for the next day repeats
    # the last day, and nothing at or after the run's start is read.
    carbon = load_carbon(Path(__file__).resolve().parents[1] / "data" / "carbon", zones=["GB"])
    hour0 = datetime(2022, 6, 15, tzinfo=UTC)
    report: list[str] = []
    rows = forecast_rows(carbon, "GB", hour0, 5, report)
    past = carbon.series("GB", hour0 - timedelta(hours=24), 24)
    assert rows.shape == (5, 168)
    assert rows[0, :24] == pytest.approx(past.astype(np.float32))
    # Past the model's 48 hours, each hour is that hour of the day's mean over the (up to 28) days before.
    before = carbon.series("GB", hour0 - timedelta(days=14), 14 * 24).reshape(14, 24).mean(axis=0)
    assert rows[0, 48:] == pytest.approx(before[np.arange(48, 168) % 24].astype(np.float32))
    assert "seasonal-naive" in report[0]


def _clean_afternoons(tmp_path: Path, days: int, trace_rows: str, slack_h: float, gpus: int = 4) -> SimulationSpec:
    """``days`` of hourly carbon data from 2022-06-01: FR is clean (50 g/kWh) from 12:00 to 18:00 and dirty
    (400) otherwise, GB is 300 all day. Sites a (GB) and b (FR) of ``gpus`` A100s; ``trace_rows`` (submit,seconds,
    gpus,team) replayed by green and carbon-greedy with exact estimates, no latency objectives, and
    ``slack_h`` hours of slack for every job."""
    first = datetime(2022, 6, 1, tzinfo=UTC)
    root = tmp_path / "carbon"
    for zone, value in {"FR": lambda h: 50.0 if 12 <= h % 24 < 18 else 400.0, "GB": lambda h: 300.0}.items():
        (root / zone).mkdir(parents=True)
        rows = ["Datetime (UTC),Zone Id,Carbon Intensity gCO2eq/kWh (direct),Carbon Intensity gCO2eq/kWh (LCA)"]
        rows += [f"{first + timedelta(hours=h):%Y-%m-%d %H:%M:%S},{zone},{value(h)},{value(h)}" for h in range(days * 24)]
        (root / zone / f"{zone}_2022_hourly.csv").write_text("\n".join(rows) + "\n")
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=gpus)
                     + _site("b", "FR", "gcp:europe-west9", 2.0, gpus=gpus))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n" + trace_rows)
    return SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=root,
        policies=["green", "baseline-carbon-greedy"], sites=sites, bound=False,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0,
                     "min_slack_s": slack_h * 3600.0})


def test_green_waits_for_the_clean_hours_it_can_foresee_and_meets_every_deadline(tmp_path: Path) -> None:
    """Three days of history come before the run, so the forecast (seasonal-naive) sees FR's clean
    afternoons. Three 4-GPU jobs of two hours arrive at 06:00 on the fourth day with 12 hours of slack:
    green defers them to FR at 12:00 (a six-hour wait, within four times their run; 0.8 kg saved each, over
    green's 0.5 kg); carbon-greedy runs them at once in GB."""
    result = simulate(_clean_afternoons(tmp_path, 6, "2022-06-04T06:00:00,7200,4,x\n" * 3, slack_h=12, gpus=16))
    green, greedy = result.policies["green"], result.policies["baseline-carbon-greedy"]
    assert green.metrics["deferred_jobs"] == 3 and green.metrics["deadline_misses"] == 0
    assert green.site.tolist() == [1, 1, 1] and green.start_s.tolist() == [6 * 3600.0] * 3  # 12:00, run hour 6
    assert green.carbon_kg.sum() == pytest.approx(3 * 4 * 0.4 * 2 * 50 / 1000)
    assert greedy.site.tolist() == [0, 0, 0]
    assert greedy.carbon_kg.sum() == pytest.approx(3 * 4 * 0.4 * 2 * 300 / 1000)


def test_green_starts_at_once_the_jobs_that_ask_to_even_with_slack(tmp_path: Path) -> None:
    """The three jobs green defers above (12 hours of slack, FR clean from 12:00), sent asking to start at once
    (``deferrable`` false): green runs them at 06:00 at the cleaner site of the hour, GB, as carbon-greedy
    does."""
    from dataclasses import replace

    from broker.simulation import engine
    from policies.baselines import policy

    spec = _clean_afternoons(tmp_path, 6, "2022-06-04T06:00:00,7200,4,x\n" * 3, slack_h=12, gpus=16)
    prep = prepare(spec)
    at_once = [replace(r, deferrable=False) for r in prep.requests]
    run = engine.replay("green", policy("green"), prep.workload, prep.federation, at_once, prep.left_out)
    assert not run.was_deferred.any()
    assert run.site.tolist() == [0, 0, 0] and run.start_s.tolist() == [0.0] * 3
    assert run.carbon_kg.sum() == pytest.approx(3 * 4 * 0.4 * 2 * 300 / 1000)


def test_green_does_not_hold_a_small_short_job_for_a_few_grams(tmp_path: Path) -> None:
    """The same clean afternoon six hours away is not worth a wait to three 1-GPU jobs of an hour: 0.1 kg each
    (under green's 0.5 kg), and six hours is more than four times their run. They start at once."""
    result = simulate(_clean_afternoons(tmp_path, 6, "2022-06-04T06:00:00,3600,1,x\n" * 3, slack_h=12))
    green = result.policies["green"]
    assert green.metrics["deferred_jobs"] == 0 and green.start_s.tolist() == [0.0] * 3


def test_a_shifting_policy_plans_no_start_past_the_carbon_data(tmp_path: Path) -> None:
    """The carbon data ends at midnight after the job arrives (20:00): FR's clean hours of the next day are
    past the data, so green runs the job within the data instead of stopping the run."""
    spec = _clean_afternoons(tmp_path, 4, "2022-06-04T20:00:00,3600,1,x\n", slack_h=24)
    spec.policies = ["green"]
    green = simulate(spec).policies["green"]
    assert green.site[0] >= 0 and green.end_s[0] <= 4 * 3600.0  # ends by midnight, the data's end


def test_the_bound_keeps_latency_bound_jobs_at_the_sites_their_objective_allows(tiny: SimulationSpec) -> None:
    # Each site's region is 1 ms from itself and unmeasured from the other, so a job with a latency objective
    # may run only at the site of its tenant's home region. Seed 1 homes tenant x in europe-west2 (site a,
    # GB) and y in europe-west9 (site b, FR).
    tiny.policies = ["baseline-spillover", "baseline-carbon-greedy", "baseline-cheapest-first"]
    tiny.seed = 1
    free = simulate(tiny)
    tiny.assumptions = {**tiny.assumptions, "latency_fraction": 1.0}
    prep = prepare(tiny)
    assert [prep.workload.region_names[o] for o in prep.workload.origin_region] == [
        "gcp:europe-west2", "gcp:europe-west9", "gcp:europe-west2"]
    tied = simulate(tiny, prepared=prep)
    assert free.offline_bound is not None and tied.offline_bound is not None
    # Free: all 5.5 GPU-hours may go to FR's 50 g hours (0, 2, 4) within the windows: j0 (2 GPUh, hours 0-2)
    # and j2 (2 GPUh, hours 0-3) and j1 (1.5 GPUh, hours 0-4) on b's 2 GPUs: 5.5 × 50 × 0.4 kW = 110 g.
    assert free.offline_bound["carbon_kg"] == pytest.approx(0.110, rel=1e-3)
    # Tied: x's 4 GPU-hours must run on a (GB 100, 300, 500 ...): 2 in hour 0 and 2 in hour 1 = 2 × 100 +
    # 2 × 300 = 800 g/kWh·GPUh × 0.4 kW = 320 g; y's 1.5 GPU-hours on b at 50 g: 30 g.
    assert tied.offline_bound["carbon_kg"] == pytest.approx(0.350, rel=1e-3)
    for run in tied.policies.values():  # every policy honours the objectives, so the bound holds for each
        assert run.metrics["latency_violations"] == 0
        assert run.metrics["carbon_kg"] >= tied.offline_bound["carbon_kg"] - 1e-9
