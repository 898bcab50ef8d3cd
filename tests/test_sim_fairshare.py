"""The quota simulator (``broker.simulation.fairshare``): one site's quotas and fair share over a trace.

Small hand-made workloads check what a user of the site would notice (a burst is lent and reclaimed, a flood
does not starve a quieter tenant, the figures mean what they say); one short window of the real Philly trace
runs every mode end to end and checks the invariants.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.data.traces import load_trace, resolve_preset
from broker.models import TenantQuota
from broker.simulation import fairshare_cli
from broker.simulation.fairshare import (MODES, QuotaSimulationError, QuotaWorkload, Replay, compare,
                                         derive_quotas, jain, metrics, policy_for, replay, site_spec,
                                         workload_from_trace)

H = 3600.0
PHILLY = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "philly" / "philly_jobs_pollux.csv"


# --- builders -----------------------------------------------------------------------------------------


def workload(*jobs: tuple[float, float, int, str], window_h: float | None = None) -> QuotaWorkload:
    """Jobs as (submit h, run h, GPUs, tenant), in any order; the window is [0, last submit] unless given."""
    jobs = tuple(sorted(jobs, key=lambda j: j[0]))
    names = sorted({j[3] for j in jobs})
    submit = np.array([j[0] * H for j in jobs])
    return QuotaWorkload(submit, np.array([j[1] * H for j in jobs]), np.array([j[2] for j in jobs]),
                         np.array([names.index(j[3]) for j in jobs]), names, 0.0,
                         (window_h * H) if window_h is not None else float(submit.max()))


def quota(tenant: str, g: int, gpus: int, weight: float = 1.0) -> TenantQuota:
    return TenantQuota(tenant=tenant, guaranteed_gpus=g, burst_gpus=gpus, fair_share_weight=weight)


def run(w: QuotaWorkload, mode: str, quotas: list[TenantQuota], nodes: int = 2, **more) -> Replay:
    policy = policy_for(mode, **{k: more.pop(k) for k in ("min_run_s", "k") if k in more})
    r = replay(w, site_spec(nodes, [] if mode == "fifo" else quotas, policy), mode, **more)
    r.metrics = metrics(r, w)
    return r


def jobs_of(w: QuotaWorkload, tenant: str) -> np.ndarray:
    return w.tenant == w.tenant_names.index(tenant)


# --- lending and reclaiming ---------------------------------------------------------------------------

# Tenant a fills all 16 GPUs with 10-hour jobs while b is idle; b comes back an hour later with 8 jobs of 2 h.
BURST = workload(*[(0.0, 10.0, 1, "a")] * 16, *[(1.0, 2.0, 1, "b")] * 8)
HALVES = [quota("a", 8, 16), quota("b", 8, 16)]


@pytest.mark.parametrize("mode", ["off", "instant", "time"])
def test_a_tenant_bursts_into_idle_gpus_and_gives_them_back_when_a_guaranteed_tenant_returns(mode: str) -> None:
    r = run(BURST, mode, HALVES)
    a, b = jobs_of(BURST, "a"), jobs_of(BURST, "b")
    assert (r.first_start_s[a] == 0).all(), "the idle half of the site is lent to a"
    assert (r.first_start_s[b] == 1 * H).all(), "b gets its guarantee back at once"
    assert r.preemptions == 8 and r.restarts == 8
    ends = np.sort(r.end_s[a])
    assert (ends[:8] == 10 * H).all(), "a's jobs within its guarantee run undisturbed"
    assert (ends[8:] == 12 * H).all(), "the preempted ones resume at 3 h with their 9 h of work left"
    assert r.metrics["preempted_gpu_h"] == pytest.approx(8.0)


def test_without_quotas_the_returning_tenant_waits_for_the_burst_to_end() -> None:
    r = run(BURST, "fifo", HALVES)
    assert (r.first_start_s[jobs_of(BURST, "b")] == 10 * H).all()
    assert r.preemptions == 0


def test_a_reclaim_waits_for_the_borrowers_minimum_run_time_then_happens_without_a_new_event() -> None:
    w = workload(*[(0.0, 10.0, 1, "a")] * 16, (0.1, 2.0, 1, "b"))  # b is back after 6 minutes
    r = run(w, "time", HALVES, min_run_s=900.0, cycle_s=300.0)
    assert r.first_start_s[jobs_of(w, "b")][0] == pytest.approx(0.25 * H), "at the first cycle after 15 min"
    assert r.preemptions == 1


# --- fairness -----------------------------------------------------------------------------------------

# Nobody is guaranteed anything: tenant flood asks for four times the site at 0:00, tenant calm for the site
# six minutes later. In arrival order calm waits behind the whole flood.
FLOOD = workload(*[(0.0, 1.0, 1, "flood")] * 64, *[(0.1, 1.0, 1, "calm")] * 16)
EQUAL = [quota("flood", 0, 16), quota("calm", 0, 16)]


def test_time_based_fair_share_raises_jains_index_of_slowdown_when_one_tenant_floods_the_queue() -> None:
    off, time_ = run(FLOOD, "off", EQUAL), run(FLOOD, "time", EQUAL)
    calm = jobs_of(FLOOD, "calm")
    assert (off.first_start_s[calm] == 4 * H).all(), "in arrival order calm waits for the whole flood"
    assert time_.first_start_s[calm].max() < 3 * H, "with fair share calm is served as GPUs free up"
    # off: flood's slowdowns 1, 2, 3, 4 (mean 2.5), calm's 4.9: Jain 0.905. time: flood's usage of the first
    # hour gives calm the whole site at 1:00 (1.9), flood runs at 0, 2, 3, 4 h (3.25): Jain 0.936.
    assert time_.metrics["jain"] > off.metrics["jain"] + 0.02
    assert time_.metrics["utilisation"] == pytest.approx(off.metrics["utilisation"])


def test_past_usage_moves_the_share_time_mode_serves_calm_sooner_than_instant_mode() -> None:
    instant, time_ = run(FLOOD, "instant", EQUAL), run(FLOOD, "time", EQUAL)
    calm = jobs_of(FLOOD, "calm")
    assert time_.first_start_s[calm].mean() < instant.first_start_s[calm].mean()


# --- the starvation guard ----------------------------------------------------------------------------

# Two nodes (16 GPUs). Tenant small sends a 2-hour 1-GPU job every 7.5 minutes for 60 h: it keeps the site
# exactly full, each completion's GPU taken by the arrival of the same instant. Tenant big asks for the whole
# site at 0:03, when one GPU is busy: with backfill alone 16 GPUs are never free at once until the stream ends.
STREAM = workload((0.05, 1.0, 16, "big"), *[(k / 8, 2.0, 1, "small") for k in range(480)])
NO_GUARANTEES = [quota("big", 0, 16), quota("small", 0, 16)]


@pytest.mark.parametrize("mode", MODES)
def test_a_large_job_of_a_small_tenant_starves_behind_backfill_without_the_guard_and_starts_with_it(
        mode: str) -> None:
    big = jobs_of(STREAM, "big")
    without = run(STREAM, mode, NO_GUARANTEES, starvation_h=0.0)
    assert without.first_start_s[big][0] >= 60 * H, "without a reservation big waits for the stream to end"
    guarded = run(STREAM, mode, NO_GUARANTEES)  # the default guard, 24 h
    start = guarded.first_start_s[big][0]
    assert 24.05 * H <= start <= (24.05 + 2) * H, "starving after 24 h, it starts once the running jobs end"
    assert guarded.metrics["jain"] > without.metrics["jain"]
    idled = without.busy_gpu_s - guarded.busy_gpu_s  # inside the window, which ends at the last submit
    assert 0 < idled <= 16 * 2 * H, "the reservation idles at most the site while the running jobs end"


# --- the figures --------------------------------------------------------------------------------------


def test_the_figures_are_what_they_claim_on_a_hand_computed_case() -> None:
    # One node of 8: a (8 GPUs, 2 h) at 0:00, b (4 GPUs, 30 s) at 1:00 waits an hour for it; window 4 h.
    w = workload((0.0, 2.0, 8, "a"), (1.0, 30 / H, 4, "b"), window_h=4.0)
    m = run(w, "fifo", [], nodes=1).metrics
    assert m["wait_mean_s"] == pytest.approx(1800.0)
    assert m["wait_p95_s"] == pytest.approx(0.95 * 3600.0)
    slowdown_b = (3600 + 30) / 60  # the run time is floored at 60 s
    assert m["slowdown_by_tenant"] == pytest.approx({"a": 1.0, "b": slowdown_b})
    assert m["jain"] == pytest.approx((1 + slowdown_b) ** 2 / (2 * (1 + slowdown_b**2)))
    assert m["utilisation"] == pytest.approx((8 * 2 * H + 4 * 30) / (8 * 4 * H))
    assert m["peak_gpus"] == 8


def test_utilisation_counts_only_the_window_not_the_drain_after_it() -> None:
    w = workload((0.0, 10.0, 8, "a"), (1.0, 1.0, 8, "a"), window_h=2.0)  # both run past the window's end
    m = run(w, "fifo", [], nodes=2).metrics
    assert m["utilisation"] == pytest.approx((8 * 2 + 8 * 1) / (16 * 2))


@pytest.mark.parametrize(("values", "index"), [
    pytest.param([3.0, 3.0, 3.0], 1.0, id="every tenant slowed alike gives 1"),
    pytest.param([5.0, 0.0, 0.0, 0.0], 0.25, id="one tenant bearing it all gives 1 over n"),
    pytest.param([1.0, 3.0], 16 / 20, id="1 and 3 give 16 over 20"),
])
def test_jains_index(values: list[float], index: float) -> None:
    assert jain(values) == pytest.approx(index)


# --- the site and its quotas --------------------------------------------------------------------------


def test_quotas_follow_tenant_sizes_with_four_fifths_of_the_site_guaranteed() -> None:
    quotas = {q.tenant: q for q in derive_quotas({"a": 30.0, "b": 10.0}, 40)}
    assert (quotas["a"].guaranteed_gpus, quotas["b"].guaranteed_gpus) == (24, 8)
    assert quotas["a"].burst_gpus == quotas["b"].burst_gpus == 40, "no burst limit in effect"
    assert quotas["a"].fair_share_weight == pytest.approx(0.75)


def test_the_site_is_sized_for_the_utilisation_and_jobs_larger_than_it_are_dropped() -> None:
    # Mean demand over the 10 h window: (8 GPUs × 10 h + 64 × 1 h) / 10 h = 14.4 GPUs; at 0.9 that is 2 nodes.
    w = workload((0.0, 10.0, 8, "a"), (5.0, 1.0, 64, "b"), (10.0, 1.0, 1, "b"))
    info, runs = compare(w, ["fifo"], utilisation=0.9)
    assert (info.nodes, info.capacity_gpus, info.dropped) == (2, 16, 1)
    assert runs[0].metrics["jobs"] == 2 and runs[0].metrics["dropped"] == 1


def test_an_unknown_mode_is_refused_with_the_modes_it_could_be() -> None:
    with pytest.raises(QuotaSimulationError, match="fifo, off, instant, time"):
        compare(FLOOD, ["fair"])


# --- invariants ---------------------------------------------------------------------------------------

JOBS = st.lists(st.tuples(st.integers(0, 40).map(lambda m: m / 10), st.integers(1, 30).map(lambda m: m / 10),
                          st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from(["a", "b", "c"])),
                min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=JOBS, mode=st.sampled_from(MODES), guaranteed=st.sampled_from([0, 4, 8]),
       starvation_h=st.sampled_from([0.0, 0.5, 24.0]))
def test_in_every_mode_every_job_runs_all_its_work_and_the_site_never_holds_more_than_it_has(
        jobs: list[tuple[float, float, int, str]], mode: str, guaranteed: int, starvation_h: float) -> None:
    w = workload(*jobs, window_h=1000.0)  # a window past every end: busy time is all the work done
    r = run(w, mode, [quota(t, guaranteed, 16) for t in ("a", "b", "c")], min_run_s=600.0,
            starvation_h=starvation_h)
    assert r.peak_gpus <= 16
    assert (r.first_start_s >= w.submit_s).all()
    assert (r.end_s - r.first_start_s >= w.run_s - 1e-6).all(), "no job finishes before its work is done"
    assert r.busy_gpu_s == pytest.approx(float((w.gpus * w.run_s).sum())), "checkpoints lose no work"
    if mode == "fifo":
        assert r.preemptions == 0


# --- the real trace -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def philly_day() -> QuotaWorkload:
    assert PHILLY.exists(), f"the shared Philly trace is not at {PHILLY}: clone the repo with shared/ beside it"
    return workload_from_trace(load_trace(PHILLY, resolve_preset("philly"), trace_from="2017-10-16", days=1))


def test_every_mode_runs_a_day_of_philly_to_the_end_within_the_sites_gpus(philly_day: QuotaWorkload) -> None:
    info, runs = compare(philly_day, MODES)
    assert len(philly_day) > 1000 and len(info.quotas) >= 5
    for r in runs:
        m = r.metrics
        assert r.peak_gpus <= info.capacity_gpus, r.mode
        assert not np.isnan(r.end_s).any(), f"{r.mode}: every job finishes"
        wait = r.first_start_s - philly_day.submit_s
        assert (wait >= 0).all(), r.mode
        assert (r.end_s - philly_day.submit_s >= philly_day.run_s - 1e-6).all(), f"{r.mode}: no job runs short"
        assert 0 < m["utilisation"] <= 1 and 0 < m["jain"] <= 1
        assert math.isfinite(m["wait_p95_s"])
    assert runs[0].preemptions == 0, "fifo has no quotas, so nobody is reclaimed"


def test_the_command_prints_one_row_per_mode_and_writes_the_json(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     + "".join(f"2017-10-01 00:{m:02d}:00,{600 + 60 * m},{1 + m % 3},0,vc{m % 2}\n"
                               for m in range(40)), encoding="utf-8")
    parser = argparse.ArgumentParser()
    fairshare_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "figures.json"
    args = parser.parse_args(["simulate-quotas", "--trace", str(trace), "--preset", "philly",
                              "--modes", "off,time", "--json", str(out)])
    table = fairshare_cli.run(args).splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["off", "time"]
    figures = json.loads(out.read_text())
    assert set(figures["modes"]) == {"off", "time"} and figures["site"]["capacity_gpus"] % 8 == 0


def test_a_json_path_that_cannot_be_written_is_refused_by_its_flag_before_the_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # It was found only after the replay (minutes on the whole trace), as "[Errno 21] Is a directory",
    # and the table was lost with it.
    trace = tmp_path / "jobs.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-01T00:00:00,60,1,a\n", encoding="utf-8")
    parser = argparse.ArgumentParser()
    fairshare_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate-quotas", "--trace", str(trace), "--columns",
                              "submit=submit,duration=seconds,gpus=gpus,tenant=team", "--json", str(tmp_path)])

    def no_replay(*_: object, **__: object) -> None:
        raise AssertionError("the replay ran before --json was checked")

    monkeypatch.setattr(fairshare_cli, "compare", no_replay)
    with pytest.raises(ValueError, match=rf"^--json {re.escape(str(tmp_path))}: is a folder; give a file name$"):
        fairshare_cli.run(args)


@pytest.mark.parametrize(("flags", "message"), [
    (["--trace-from", "junk"], "--trace-from 'junk': write an ISO date or time"),
    (["--days", "0"], "--days 0.0: give a number of days above 0"),
])
def test_a_bad_window_is_refused_naming_its_flag(tmp_path: Path, flags: list[str], message: str) -> None:
    # They were named as load_trace's arguments ("trace_from: ...", "days must be ...").
    trace = tmp_path / "jobs.csv"
    trace.write_text("submit,seconds,gpus,team\n2022-06-01T00:00:00,60,1,a\n", encoding="utf-8")
    parser = argparse.ArgumentParser()
    fairshare_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate-quotas", "--trace", str(trace), "--columns",
                              "submit=submit,duration=seconds,gpus=gpus,tenant=team", *flags])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        fairshare_cli.run(args)


def test_the_command_refuses_a_trace_without_tenants_and_says_what_to_add(tmp_path: Path) -> None:
    trace = tmp_path / "jobs.csv"
    trace.write_text("submit,seconds,gpus\n2022-06-01T00:00:00,60,1\n", encoding="utf-8")
    parser = argparse.ArgumentParser()
    fairshare_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate-quotas", "--trace", str(trace), "--columns",
                              "submit=submit,duration=seconds,gpus=gpus"])
    with pytest.raises(QuotaSimulationError, match="tenant=COL"):
        fairshare_cli.run(args)
