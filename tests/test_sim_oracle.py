"""The whole-job oracle (``heliotrope simulate --oracle``): by hand on two sites, and as a schedule that no
site could refuse on random small federations."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from broker import cli
from broker.data.traces import parse_columns
from broker.simulation.oracle import NAME, whole_job_oracle
from broker.simulation.report import write_html
from broker.simulation.run import SimulationSpec, capacity_prices, prepare, simulate
from policies.snapshot import MODEL_INDEX
from tests.test_sim_engine import START, _carbon, _site, tiny  # noqa: F401 - the fixture


def test_packs_each_job_at_its_cleanest_start_with_room(tiny: SimulationSpec) -> None:  # noqa: F811
    """The engine tests' two sites (GB 100, 300, 500, ... g/kWh; FR 50, 150, 50, ...; two GPUs each) and jobs
    j0 (0 s, 2 GPUs, 1 h), j1 (0 s, 1 GPU, 1.5 h), j2 (1800 s, 2 GPUs, 1 h); deadlines submit + 3 × run."""
    prep = prepare(tiny)
    run = whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out)
    names = [s.name for s in prep.federation.specs]
    # j0: FR hour 0 (50), the first of its cleanest starts. j1: FR is full until 3600; its cleanest 1.5 h there
    # starts at 5400 (half of hour 1 at 150, hour 2 at 50: 125 g/kWh·h), GB's best is 250. j2: FR has both GPUs
    # free for only half an hour before its latest start (9000) (j1 holds one from 5400): GB at once, half an
    # hour at 100 and half at 300.
    assert [names[s] for s in run.site] == ["b", "b", "a"]
    assert run.start_s.tolist() == [0.0, 5400.0, 1800.0]
    assert run.end_s.tolist() == [3600.0, 10800.0, 5400.0]
    # 0.8 kWh × 50 g + 0.4 kW × 125 g·h + 0.8 kWh × 200 g
    assert run.carbon_kg.tolist() == pytest.approx([0.04, 0.05, 0.16])
    assert run.name == NAME


def test_jobs_allowed_fewest_sites_are_packed_first(tiny: SimulationSpec) -> None:  # noqa: F811
    prep = prepare(tiny)
    allowed = prep.fitting.copy()
    allowed[2] = [False, True]  # j2, submitted last, may use only FR (site b)
    run = whole_job_oracle(prep.workload, prep.federation, allowed, prep.left_out)
    # j2 first: FR's cleanest hour in its window, hour 2 (50). j0 then FR at 0 (50); j1 finds no 1.5 h with a free
    # GPU at FR before its latest start (10800), where FR gives 150 + 0.5 × 50 = 175 against GB's 250 at 0. Here
    # the order happens to find a cleaner schedule than submit order: 0.15 kg against 0.25.
    assert run.site.tolist() == [1, 1, 1]
    assert run.start_s.tolist() == [0.0, 10800.0, 7200.0]
    assert run.carbon_kg.sum() == pytest.approx(0.04 + 0.07 + 0.04)
    assert (run.end_s <= prep.workload.deadline_s).all()


def test_in_submit_order_the_job_allowed_one_site_finds_it_taken(tiny: SimulationSpec) -> None:  # noqa: F811
    """The case above packed in submit order (``submit_order``, an ablation): j0 takes FR at 0 (50), j1 FR's
    cleanest 1.5 h from 5400 (125 g/kWh·h), and j2, which may use only FR, finds both GPUs free there for
    half an hour only (3600-5400) before its latest start (9000): it runs late, from 10800 when j1 ends (hour
    3, 150). 0.21 kg and a missed deadline, against 0.15 kg and none when it went first."""
    prep = prepare(tiny)
    allowed = prep.fitting.copy()
    allowed[2] = [False, True]
    run = whole_job_oracle(prep.workload, prep.federation, allowed, prep.left_out, submit_order=True)
    assert run.site.tolist() == [1, 1, 1]
    assert run.start_s.tolist() == [0.0, 5400.0, 10800.0]
    assert run.carbon_kg.tolist() == pytest.approx([0.04, 0.05, 0.12])
    assert (run.end_s > prep.workload.deadline_s).tolist() == [False, False, True]


def test_a_cap_on_the_wait_takes_the_best_start_within_it(tiny: SimulationSpec) -> None:  # noqa: F811
    """``max_wait_s`` 3600 (an ablation: a policy's deferral horizon): j1 may no longer wait until 5400 for
    FR's cleanest hours; FR from 3600 (150 for an hour, then 50: 175 g/kWh·h, 0.07 kg) still beats GB at 0
    (250, 0.1 kg). j0 and j2 as without the cap. A negative cap is refused."""
    prep = prepare(tiny)
    run = whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out, max_wait_s=3600.0)
    assert run.start_s.tolist() == [0.0, 3600.0, 1800.0]
    assert run.carbon_kg.tolist() == pytest.approx([0.04, 0.07, 0.16])
    assert ((run.start_s - prep.workload.submit_s)[~prep.left_out] <= 3600.0).all()
    from broker.simulation.engine import SimulationError

    with pytest.raises(SimulationError, match="max_wait_s must be 0 or more, got -1"):
        whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out, max_wait_s=-1.0)


def test_a_job_with_no_room_in_its_window_takes_the_first_room_after_it(tiny: SimulationSpec) -> None:  # noqa: F811
    tiny.assumptions = {**tiny.assumptions, "inflexible_fraction": 1.0}  # deadline = submit + run time
    prep = prepare(tiny)
    run = whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out)
    # j0 and j1 start at once (FR then GB: FR is full); j2 at 1800 finds FR full (j0) and one GPU taken at
    # GB (j1): it starts when j0 ends, late.
    assert run.start_s.tolist() == [0.0, 0.0, 3600.0]
    late = run.end_s > prep.workload.deadline_s
    assert late.tolist() == [False, False, True]


def test_a_start_after_a_mid_slot_submit_holds_only_the_slots_its_run_touches(tmp_path: Path) -> None:
    """One GPU, ten one-hour jobs submitted a second apart, none able to wait: each starts when the one before
    it ends, on the hour, not five minutes later for the slot its submit time fell in."""
    carbon = _carbon(tmp_path / "carbon", {"GB": [100.0] * 30})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=1))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n" + "".join(
        f"{(START + timedelta(seconds=k)):%Y-%m-%dT%H:%M:%S},3600,1,t\n" for k in range(10)))
    spec = SimulationSpec(trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"),
                          carbon=carbon, policies=["baseline-carbon-greedy"], sites=sites,
                          assumptions={"inflexible_fraction": 1.0, "latency_fraction": 0.0})
    prep = prepare(spec)
    run = whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out)
    assert run.start_s.tolist() == [0.0] + [3600.0 * k for k in range(1, 10)]


def test_equal_carbon_goes_to_the_earlier_start(tmp_path: Path) -> None:
    """Two sites of one GPU on grids of the same constant intensity; j0 may use only a, j1 either: j1 starts
    at once at b rather than after j0 at a, for the same carbon."""
    carbon = _carbon(tmp_path / "carbon", {"GB": [200.0] * 30, "FR": [200.0] * 30})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=1)
                     + _site("b", "FR", "gcp:europe-west9", 2.0, gpus=1))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-01T00:00:00,3600,1,t\n2022-06-01T00:00:00,3600,1,u\n")
    spec = SimulationSpec(trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"),
                          carbon=carbon, policies=["baseline-carbon-greedy"], sites=sites,
                          assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0})
    prep = prepare(spec)
    allowed = prep.fitting.copy()
    allowed[0] = [True, False]
    run = whole_job_oracle(prep.workload, prep.federation, allowed, prep.left_out)
    assert run.site.tolist() == [0, 1]
    assert run.start_s.tolist() == [0.0, 0.0]


def test_the_price_of_capacity_moves_a_job_off_a_clean_site(tiny: SimulationSpec) -> None:  # noqa: F811
    """j0 alone (2 GPUs, 1 h): FR at hour 0 (50 g/kWh) is its cleanest start; priced at 1 kg per GPU-hour in
    every hour (the jobs to come want it more), FR costs it 0.04 + 2 kg, and GB at once (0.08 kg) wins."""
    prep = prepare(tiny)
    alone = np.array([False, True, True])
    free = whole_job_oracle(prep.workload, prep.federation, prep.fitting, alone)
    assert (free.site[0], free.start_s[0]) == (1, 0.0)
    prices = np.zeros((2, prep.federation.hours))
    prices[1] = 1.0
    priced = whole_job_oracle(prep.workload, prep.federation, prep.fitting, alone, shadow_kg_per_gpu_hour=prices)
    assert (priced.site[0], priced.start_s[0]) == (0, 0.0)
    assert priced.carbon_kg[0] == pytest.approx(0.08)
    assert free.site[1] == priced.site[1] == -1  # left out: not run


def _held_within_capacity(run, prep) -> None:
    """At every instant, each (site, model) pool holds at most its GPUs (ends before starts at one instant)."""
    w = prep.workload
    held = w.gpus * np.where(w.milli < 1000, w.milli / 1000.0, 1.0)
    total = prep.federation.base.total_gpus
    for s, m in zip(*np.nonzero(total > 0), strict=True):
        mine = np.flatnonzero((run.site == s) & (run.model == m))  # type: ignore[operator]
        events = sorted([(run.start_s[j], 1, held[j]) for j in mine] + [(run.end_s[j], 0, -held[j]) for j in mine])
        busy = np.cumsum([e[2] for e in events]) if events else np.zeros(0)
        assert (busy <= total[s, m] + 1e-9).all(), f"site {s} model {m} holds {busy.max()} of {total[s, m]} GPUs"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    jobs=st.lists(st.tuples(st.integers(0, 4 * 3600), st.integers(30, 3 * 3600), st.integers(1, 3),
                            st.sampled_from(["", "a100-80gb", "h100-80gb"])), min_size=1, max_size=14),
    gb=st.lists(st.integers(20, 600), min_size=6, max_size=6),
    fr=st.lists(st.integers(20, 600), min_size=6, max_size=6),
    inflexible=st.sampled_from([0.0, 0.5]),
)
def test_a_feasible_schedule_never_below_its_bound(tmp_path_factory: pytest.TempPathFactory,
                                                   jobs: list[tuple[int, int, int, str]], gb: list[int],
                                                   fr: list[int], inflexible: float) -> None:
    """Random jobs (any second, runs of 30 s to 3 h, 1-3 GPUs, a model named or not) on site a (three A100s)
    and site b (two A100s and two H100s): every job runs whole on a pool it may use, for its true run time,
    never before its submit time, on its model when it names one; no pool ever holds more GPUs than it has;
    the carbon is never below the offline bound on its own windows."""
    root = tmp_path_factory.mktemp("oracle")
    carbon = _carbon(root / "carbon", {"GB": [float(v) for v in gb * 40], "FR": [float(v) for v in fr * 40]})
    sites = root / "sites.yaml"
    sites.write_text(
        "sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0, gpus=3)
        + "  - {name: b, region: 'gcp:europe-west9', grid_zone: FR, timezone: UTC, latitude: 0, longitude: 0,\n"
          "     gpus: [{model: a100-80gb, gpus_per_node: 2, nodes: 1},\n"
          "            {model: h100-80gb, gpus_per_node: 2, nodes: 1}],\n"
          "     usd_per_gpu_hour: {a100-80gb: 1.0, h100-80gb: 3.0}, rtt_ms: {'gcp:europe-west9': 1.0}}\n")
    trace = root / "trace.csv"
    trace.write_text("submit,seconds,gpus,team,model\n" + "".join(
        f"{(START + timedelta(seconds=t)):%Y-%m-%dT%H:%M:%S},{d},{g},t{i % 3},{m}\n"
        for i, (t, d, g, m) in enumerate(sorted(jobs))))
    spec = SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team,model=model"),
        carbon=carbon, policies=["baseline-carbon-greedy"], sites=sites, oracle=True,
        assumptions={"inflexible_fraction": inflexible, "latency_fraction": 0.0, "estimate_sigma": 0.5},
    )
    prep = prepare(spec)
    ran = ~prep.left_out
    assume(ran.any())  # a job larger than every pool is left out, for every policy and the oracle alike
    result = simulate(spec, prepared=prep)
    run = result.oracle
    assert run is not None and run.model is not None
    w = prep.workload
    assert (run.site[ran] >= 0).all() and prep.fitting[np.flatnonzero(ran), run.site[ran]].all()
    named = np.array([m is not None for m in w.model])
    assert (prep.federation.base.total_gpus[run.site[ran], run.model[ran]] > 0).all()
    assert all(run.model[j] == MODEL_INDEX[w.model[j]] for j in np.flatnonzero(ran & named))
    assert (run.start_s[ran] >= w.submit_s[ran]).all()
    assert run.end_s[ran] - run.start_s[ran] == pytest.approx(w.true_duration_s[ran])
    _held_within_capacity(run, prep)
    assert run.metrics["carbon_kg"] >= run.metrics["bound_carbon_kg"] * (1 - 1e-6) - 1e-9
    assert run.metrics["guided_by_shadow_prices"] is True
    # and never below its whole-job bound, which is never below its fluid bound: for the oracle and the
    # policy alike, on time or late
    for m in (run.metrics, result.policies["baseline-carbon-greedy"].metrics):
        assert m["carbon_kg"] >= m["whole_job_bound_carbon_kg"] * (1 - 1e-6) - 1e-9
        assert m["whole_job_bound_carbon_kg"] >= m["bound_carbon_kg"] * (1 - 1e-6) - 1e-9


def test_cli_oracle_row_and_json(tiny: SimulationSpec, tmp_path: Path,  # noqa: F811
                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--trace", str(tiny.trace), "--columns", "submit=submit,duration=seconds,gpus=gpus,tenant=team",
            "--carbon", str(tiny.carbon), "--sites", str(tiny.sites), "--policy", "baseline-carbon-greedy"]
    out = tmp_path / "with.json"
    assert cli.main([*args, "--oracle", "--json", str(out), "--report", str(tmp_path / "report")]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    oracle_line = next(i for i, line in enumerate(lines) if line.startswith(NAME))
    assert lines[oracle_line - 1].startswith("---")  # below the policies, above the bound
    assert lines[oracle_line + 1].startswith("offline bound")
    doc = json.loads(out.read_text())
    assert doc["oracle"]["jobs"] == 3
    assert doc["oracle"]["carbon_kg"] >= doc["offline_bound"]["carbon_kg"]
    assert NAME not in doc["policies"]
    assert "whole-job oracle is a schedule, not a policy" in (tmp_path / "report" / "index.html").read_text()
    plain = tmp_path / "without.json"
    assert cli.main([*args, "--json", str(plain)]) == 0
    assert NAME not in capsys.readouterr().out
    assert json.loads(plain.read_text())["oracle"] is None


def test_an_oracle_that_cannot_pack_leaves_the_policies_figures(tiny: SimulationSpec,  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import broker.simulation.run as run_module
    from broker.simulation.engine import SimulationError

    def no_room(*args: object, **kwargs: object) -> None:
        raise SimulationError(f"{NAME}: found no room for job 2 before the carbon data ends")

    monkeypatch.setattr(run_module, "whole_job_oracle", no_room)
    tiny.oracle = True
    result = simulate(tiny)
    assert result.oracle is None
    assert result.policies["baseline-spillover"].metrics["carbon_kg"] == pytest.approx(0.37)
    assert f"not packed: {NAME}: found no room for job 2 before the carbon data ends" in result.report


def test_without_the_bound_the_oracle_packs_for_carbon_alone(tiny: SimulationSpec) -> None:  # noqa: F811
    tiny.bound, tiny.oracle = False, True
    result = simulate(tiny)
    assert result.offline_bound is None
    run = result.oracle
    assert run is not None
    assert run.metrics["guided_by_shadow_prices"] is False and run.metrics["gap_to_bound"] is None
    # the schedule of test_packs_each_job_at_its_cleanest_start_with_room, with no prices
    assert run.start_s.tolist() == [0.0, 5400.0, 1800.0]
    assert run.metrics["carbon_kg"] == pytest.approx(0.04 + 0.05 + 0.16)


def test_capacity_prices_are_the_prices_the_oracle_packs_by(tiny: SimulationSpec) -> None:  # noqa: F811
    """``capacity_prices`` (what bench/green_sensitivity.py prices a policy's inputs with) is the carbon LP's
    price of each site-hour that ``simulate --oracle`` guides the oracle with: packing by it gives the
    oracle's own schedule. Four jobs of 2 GPUs for 1 h at once, each with 3 h to run in: FR (2 GPUs) is the
    cleaner site in every one of those hours but has room for three of them only, so its hours have a price."""
    tiny.trace.write_text("submit,seconds,gpus,team\n" + "2022-06-01T00:00:00,3600,2,x\n" * 4)
    prep = prepare(tiny)
    prices = capacity_prices(prep)
    assert prices.shape == (len(prep.federation.specs), prep.federation.hours)
    assert (prices >= 0).all() and prices.max() > 0  # the jobs contend for the clean site-hours
    tiny.oracle = True
    oracle = simulate(tiny, prepared=prep).oracle
    assert oracle is not None and oracle.metrics["guided_by_shadow_prices"] is True
    packed = whole_job_oracle(prep.workload, prep.federation, prep.fitting, prep.left_out,
                              shadow_kg_per_gpu_hour=prices)
    assert packed.site.tolist() == oracle.site.tolist()
    assert packed.start_s.tolist() == oracle.start_s.tolist()


def test_the_reports_run_facts_count_the_hours_until_the_oracles_last_job_ends(tmp_path: Path) -> None:
    """One site whose carbon falls every hour and one job of an hour at 0 s (its deadline 3 h later):
    baseline-spillover runs it at once, to 1 h; the oracle at its latest start, 2 h, to 3 h. The report's
    facts say the run lasted 3 hours, not the policies' span."""
    carbon = _carbon(tmp_path / "carbon", {"FR": [500.0 - 100 * h if h < 5 else 50.0 for h in range(48)]})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("b", "FR", "gcp:europe-west9", 1.0))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-01T00:00:00,3600,1,x\n")
    result = simulate(SimulationSpec(
        trace=trace, mapping=parse_columns("submit=submit,duration=seconds,gpus=gpus,tenant=team"), carbon=carbon,
        policies=["baseline-spillover"], sites=sites, oracle=True,
        assumptions={"inflexible_fraction": 0.0, "latency_fraction": 0.0, "estimate_sigma": 0.0},
    ))
    assert result.policies["baseline-spillover"].end_s.tolist() == [3600.0]
    assert result.oracle is not None and result.oracle.end_s.tolist() == [10800.0]
    page = write_html(result, tmp_path / "report").read_text()
    assert re.findall(r"over 1 sites for (\d+) hours from 2022-06-01 00:00 UTC", page) == ["3"]
