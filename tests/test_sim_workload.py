"""The simulator's workload: the real Philly trace with seeded origins, deadlines, latency objectives and
noisy duration estimates; the same seed gives the same workload; every deadline can be met by starting at
once; ``--start`` keeps every offset; and ``--dump-workload`` writes what the run was given."""

from __future__ import annotations

import csv
import json
import math
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.data.traces import Trace, load_trace, resolve_preset
from broker.models import JobSpec
from broker.simulation.engine import requests_of
from broker.simulation.workload import (
    JOBS_CSV_COLUMNS,
    MAX_ESTIMATE_S,
    Workload,
    WorkloadAssumptions,
    build_workload,
    dump_workload,
    tenant_slug,
)
from tests.builders import site

PHILLY = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "philly" / "philly_jobs_pollux.csv"
PHILLY_JOBS = 82_247
REGIONS = ("gcp:us-east1", "gcp:europe-west3", "aws:us-west-2", "azure:eastus")
DEFAULTS = WorkloadAssumptions(origin_regions=REGIONS)


@pytest.fixture(scope="module")
def philly() -> Trace:
    assert PHILLY.exists(), f"the shared Philly trace is not at {PHILLY}: clone the repo with shared/ beside it"
    return load_trace(PHILLY, resolve_preset("philly"))


@pytest.fixture(scope="module")
def workload(philly: Trace) -> Workload:
    return build_workload(philly, DEFAULTS)


def assume(**changes: Any) -> WorkloadAssumptions:
    """The default assumptions with ``changes``, validated."""
    return WorkloadAssumptions(**{**DEFAULTS.model_dump(), **changes})


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def small_trace(submit_s: list[float], duration_s: list[float], *, gpus: list[int] | None = None,
                milli: list[int] | None = None, model: list[str | None] | None = None,
                tenants: list[str] | None = None) -> Trace:
    """A Trace built in memory, as load_trace would return it."""
    n = len(submit_s)
    names, codes = np.unique(np.array(tenants or ["t"] * n, dtype=str), return_inverse=True)
    start = datetime(2017, 10, 1, tzinfo=UTC)
    return Trace(
        path=Path("in-memory.csv"), start=start, submit_s=np.array(submit_s, dtype=np.float64),
        duration_s=np.array(duration_s, dtype=np.float64), gpus=np.array(gpus or [1] * n, dtype=np.int32),
        milli=np.array(milli or [1000] * n, dtype=np.int32), model=np.array(model or [None] * n, dtype=object),
        tenant=codes.astype(np.int32), tenant_names=[str(x) for x in names],
        line=np.arange(2, n + 2, dtype=np.int32), span=(start, start + timedelta(seconds=max(submit_s))), report=[],
    )


# --- seeds ------------------------------------------------------------------------------------------------

ARRAYS = ("submit_s", "true_duration_s", "estimated_duration_s", "gpus", "milli", "model", "tenant",
          "origin_region", "deadline_s", "latency_slo_ms", "inflexible")


def test_the_same_seed_gives_the_same_workload_array_for_array(philly: Trace, workload: Workload) -> None:
    again = build_workload(philly, DEFAULTS)
    assert len(again) == PHILLY_JOBS
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(again, name), getattr(workload, name), err_msg=name)


def test_another_seed_gives_other_estimates_deadlines_and_latency_objectives(philly: Trace,
                                                                             workload: Workload) -> None:
    other = build_workload(philly, assume(seed=1))
    assert (other.estimated_duration_s != workload.estimated_duration_s).mean() > 0.99
    assert not np.array_equal(other.inflexible, workload.inflexible)
    assert not np.array_equal(other.has_latency_slo, workload.has_latency_slo)
    np.testing.assert_array_equal(other.true_duration_s, workload.true_duration_s)  # the trace itself is kept


def test_changing_one_assumption_leaves_the_other_draws_as_they_were(philly: Trace, workload: Workload) -> None:
    more_latency = build_workload(philly, assume(latency_fraction=0.3))
    np.testing.assert_array_equal(more_latency.estimated_duration_s, workload.estimated_duration_s)
    np.testing.assert_array_equal(more_latency.deadline_s, workload.deadline_s)
    np.testing.assert_array_equal(more_latency.origin_region, workload.origin_region)
    # raising a fraction keeps the jobs already chosen and adds more
    assert (more_latency.has_latency_slo[workload.has_latency_slo]).all()
    assert more_latency.has_latency_slo.sum() > workload.has_latency_slo.sum()


# --- estimates -----------------------------------------------------------------------------------------


def test_estimates_are_right_in_the_median_and_off_by_a_log_normal_factor_of_sigma(workload: Workload) -> None:
    log_ratio = np.log(workload.estimated_duration_s / workload.true_duration_s)
    assert abs(np.exp(np.median(log_ratio)) - 1) < 0.02
    assert abs(log_ratio.std() - DEFAULTS.estimate_sigma) < 0.01
    # median-unbiased: the mean estimate is exp(sigma^2 / 2) = 1.133 times the truth
    assert abs(np.mean(np.exp(log_ratio)) - math.exp(DEFAULTS.estimate_sigma**2 / 2)) < 0.02


def test_estimates_are_whole_seconds_as_a_user_gives_them(philly: Trace, workload: Workload) -> None:
    # Whole seconds also keep the last bit of a vectorised exp, which may differ from one CPU to another, out
    # of the replay (short of an estimate that lands on a half second to the last bit).
    est = workload.estimated_duration_s
    np.testing.assert_array_equal(est, np.rint(est))
    assert est.min() >= 1.0
    wide = build_workload(philly, assume(estimate_sigma=5.0))  # factors down to e^-25: still at least a second
    assert wide.estimated_duration_s.min() == 1.0


def test_mean_unbiased_estimates_are_right_on_average(philly: Trace) -> None:
    w = build_workload(philly, assume(estimate_unbiased="mean"))
    ratio = w.estimated_duration_s / w.true_duration_s
    assert abs(ratio.mean() - 1) < 0.02
    assert np.median(ratio) < 0.9  # exp(-sigma^2 / 2) = 0.88


def test_sigma_zero_gives_exact_estimates(philly: Trace) -> None:
    w = build_workload(philly, assume(estimate_sigma=0.0))
    np.testing.assert_array_equal(w.estimated_duration_s, w.true_duration_s)


def test_an_estimate_never_exceeds_what_a_job_spec_accepts(philly: Trace) -> None:
    w = build_workload(philly, assume(estimate_sigma=3.0))
    assert w.estimated_duration_s.max() == MAX_ESTIMATE_S
    assert (w.estimated_duration_s > 0).all()
    JobSpec.model_validate(w.job_spec(int(np.argmax(w.estimated_duration_s))).model_dump())


# --- deadlines -----------------------------------------------------------------------------------------


def test_every_deadline_can_be_met_by_starting_the_job_at_once(workload: Workload) -> None:
    assert (workload.deadline_s >= workload.submit_s + workload.true_duration_s).all()


def test_inflexible_jobs_must_start_at_once_and_are_the_requested_share(workload: Workload) -> None:
    rigid = workload.inflexible
    assert within_binomial(int(rigid.sum()), len(workload), DEFAULTS.inflexible_fraction)
    np.testing.assert_array_equal(workload.deadline_s[rigid],
                                  workload.submit_s[rigid] + workload.true_duration_s[rigid])


def test_inflexible_jobs_ask_to_start_at_once_unless_the_assumptions_leave_it_undeclared(philly: Trace,
                                                                                        workload: Workload) -> None:
    rigid = workload.inflexible
    np.testing.assert_array_equal(workload.deferrable, ~rigid)
    one, other = int(np.flatnonzero(rigid)[0]), int(np.flatnonzero(~rigid)[0])
    assert workload.job_spec(one).deferrable is False and workload.job_spec(other).deferrable is True
    assert [r.deferrable for r in requests_of(workload)] == workload.deferrable.tolist()
    assert any("ask to start at once (deferrable: false)" in line for line in workload.report)
    undeclared = build_workload(philly, assume(declare_inflexible=False))
    np.testing.assert_array_equal(undeclared.inflexible, rigid)  # the same jobs, drawn alike
    assert undeclared.deferrable.all() and undeclared.job_spec(one).deferrable is True


def test_no_job_is_checkpointable_unless_asked_and_interactive_jobs_never_are(philly: Trace,
                                                                             workload: Workload) -> None:
    assert not workload.checkpointable.any() and not workload.job_spec(0).checkpointable
    some = build_workload(philly, assume(checkpointable_fraction=0.9))
    assert not some.checkpointable[some.inflexible].any()
    flexible = ~some.inflexible
    assert within_binomial(int(some.checkpointable[flexible].sum()), int(flexible.sum()), 0.9)
    np.testing.assert_array_equal(some.estimated_duration_s, workload.estimated_duration_s)  # other draws as they were
    np.testing.assert_array_equal(some.has_latency_slo, workload.has_latency_slo)
    i = int(np.flatnonzero(some.checkpointable)[0])
    assert some.job_spec(i).checkpointable
    assert any("can be checkpointed and moved; a move costs 600 s" in line for line in some.report)


def test_a_flexible_job_may_wait_twice_its_length_and_at_least_an_hour(workload: Workload) -> None:
    flexible = ~workload.inflexible
    true_s = workload.true_duration_s[flexible]
    expected = np.maximum((DEFAULTS.slack_factor - 1) * true_s, DEFAULTS.min_slack_s)
    np.testing.assert_allclose(workload.slack_s[flexible], expected, rtol=1e-9, atol=1e-6)
    assert workload.slack_s[flexible].min() >= DEFAULTS.min_slack_s - 1e-6


# --- latency objectives and origins ---------------------------------------------------------------------


def test_the_requested_share_of_jobs_has_a_latency_objective(workload: Workload) -> None:
    has = workload.has_latency_slo
    assert within_binomial(int(has.sum()), len(workload), DEFAULTS.latency_fraction)
    assert set(workload.latency_slo_ms[has].tolist()) == {DEFAULTS.latency_slo_ms}


def test_a_tenant_submits_all_its_jobs_from_its_home_region(workload: Workload) -> None:
    for code, name in enumerate(workload.tenant_names):
        origins = set(workload.origin_region[workload.tenant == code].tolist())
        assert len(origins) == 1, f"tenant {name} has jobs from {len(origins)} regions"
    assert set(workload.region_names) == set(REGIONS)


def test_a_tenants_home_does_not_depend_on_the_window(workload: Workload) -> None:
    window = load_trace(PHILLY, resolve_preset("philly"), trace_from="2017-11-01", days=7)
    part = build_workload(window, DEFAULTS)
    homes = {workload.tenant_names[t]: o for t, o in zip(workload.tenant.tolist(), workload.origin_region.tolist())}
    for t, o in zip(part.tenant.tolist(), part.origin_region.tolist()):
        assert homes[part.tenant_names[t]] == o


def test_per_job_origins_send_one_tenants_jobs_from_everywhere(philly: Trace) -> None:
    w = build_workload(philly, assume(origin_rule="per_job"))
    busiest = np.bincount(w.tenant).argmax()
    assert set(w.origin_region[w.tenant == busiest].tolist()) == set(range(len(REGIONS)))


def test_for_sites_draws_origins_from_the_federations_regions() -> None:
    sites = [site("a", region="gcp:us-east1"), site("b", region="gcp:us-east1"),
             site("c", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin")]
    assert WorkloadAssumptions.for_sites(sites).origin_regions == ("gcp:europe-west3", "gcp:us-east1")


# --- start ---------------------------------------------------------------------------------------------


def test_start_moves_the_first_instant_and_keeps_every_offset(philly: Trace, workload: Workload) -> None:
    moved = build_workload(philly, DEFAULTS, start=datetime(2022, 6, 1, tzinfo=UTC))
    assert workload.start == philly.start
    assert moved.submit_at(0) == datetime(2022, 6, 1, tzinfo=UTC)
    np.testing.assert_array_equal(moved.submit_s, workload.submit_s)
    np.testing.assert_array_equal(moved.deadline_s, workload.deadline_s)
    shift = moved.start - workload.start
    assert moved.submit_at(PHILLY_JOBS - 1) - workload.submit_at(PHILLY_JOBS - 1) == shift
    assert moved.job_spec(100).deadline == workload.job_spec(100).deadline + shift


def test_start_may_be_a_plain_date_taken_as_utc_midnight(philly: Trace) -> None:
    assert build_workload(philly, DEFAULTS, start=date(2022, 6, 1)).start == datetime(2022, 6, 1, tzinfo=UTC)


# --- job specs -----------------------------------------------------------------------------------------


def test_a_job_spec_carries_the_estimate_the_deadline_the_origin_and_the_objective(workload: Workload) -> None:
    i = int(np.flatnonzero(workload.has_latency_slo & (workload.gpus > 1))[0])
    spec = JobSpec.model_validate(workload.job_spec(i).model_dump())
    assert spec.name == f"trace-{i}"
    assert spec.tenant == workload.tenant_names[workload.tenant[i]]
    assert spec.gpus.count == workload.gpus[i] and spec.gpus.model is None and spec.gpus.milli == 1000
    assert spec.duration_s == workload.estimated_duration_s[i] != workload.true_duration_s[i]
    assert spec.deadline == workload.start + timedelta(seconds=float(workload.deadline_s[i]))
    assert spec.origin_region == workload.region_names[workload.origin_region[i]]
    assert spec.latency_slo_ms == DEFAULTS.latency_slo_ms
    without = int(np.flatnonzero(~workload.has_latency_slo)[0])
    assert workload.job_spec(without).latency_slo_ms is None


@pytest.mark.parametrize(("name", "slug"), [
    pytest.param("6214e9", "6214e9", id="a Philly virtual cluster id is kept as it is"),
    pytest.param("team-a", "team-a", id="a name that is already a valid tenant is kept"),
    pytest.param("Team A", "team-a-", id="upper case and spaces become a lower-case slug with a hash"),
    pytest.param("vc_6YE", "vc-6ye-", id="underscores become dashes"),
    pytest.param("", "tenant-", id="an empty tenant gets a name"),
    pytest.param("x" * 80, "x" * 54 + "-", id="a long name is cut to fit 63 characters"),
])
def test_trace_tenants_become_valid_job_spec_tenants(name: str, slug: str) -> None:
    got = tenant_slug(name)
    assert got.startswith(slug) and (got == slug or len(got) == len(slug) + 8)
    JobSpec(tenant=got, name="x", gpus={"count": 1}, duration_s=1)


def test_tenants_differing_only_in_case_stay_apart() -> None:
    trace = small_trace([0, 1, 2], [10, 10, 10], tenants=["Team", "team", "TEAM"])
    w = build_workload(trace, DEFAULTS)
    assert len(set(w.tenant_names)) == 3
    assert "team" in w.tenant_names


@pytest.mark.parametrize(("trace_kw", "message"), [
    pytest.param({"model": ["a100", "nvidia-quantum-9000"]}, "line 3: unknown GPU model 'nvidia-quantum-9000'",
                 id="an unknown GPU model names its line"),
    pytest.param({"gpus": [1, 4], "milli": [500, 500]}, "part of each of several GPUs",
                 id="a share of each of several GPUs cannot be a job spec"),
])
def test_a_trace_a_job_spec_cannot_express_is_refused(trace_kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_workload(small_trace([0, 5], [10, 20], **trace_kw), DEFAULTS)


def test_trace_gpu_models_become_canonical_ids() -> None:
    w = build_workload(small_trace([0, 5], [10, 20], model=["NVIDIA A100-SXM4-80GB", None]), DEFAULTS)
    assert w.model.tolist() == ["a100-80gb", None]
    assert w.job_spec(0).gpus.model == "a100-80gb"


# --- the dump ------------------------------------------------------------------------------------------


def test_dump_writes_every_job_and_every_site_in_the_documented_columns(tmp_path: Path,
                                                                        workload: Workload) -> None:
    sites = [site("alpha", usd_per_gpu_hour={"a100-80gb": 3.5}),
             site("beta", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin",
                  gpus={"h100-80gb": 16, "l4": 8})]
    dump_workload(workload, sites, tmp_path / "dump")
    with (tmp_path / "dump" / "jobs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
        header = list(rows[0])
    assert tuple(header) == JOBS_CSV_COLUMNS
    assert len(rows) == PHILLY_JOBS
    slo = int(np.flatnonzero(workload.has_latency_slo)[0])
    for i in (0, slo, 12_345, PHILLY_JOBS - 1):
        row, spec = rows[i], workload.job_spec(i)
        assert datetime.fromisoformat(row["submit_utc"]) == workload.submit_at(i)
        assert datetime.fromisoformat(row["deadline_utc"]) == spec.deadline
        assert float(row["true_duration_s"]) == workload.true_duration_s[i]
        assert float(row["estimated_duration_s"]) == spec.duration_s
        assert (int(row["gpus"]), int(row["milli"]), row["model"]) == (spec.gpus.count, spec.gpus.milli, "")
        assert (row["tenant"], row["origin_region"]) == (spec.tenant, spec.origin_region)
        assert (float(row["latency_slo_ms"]) if row["latency_slo_ms"] else None) == spec.latency_slo_ms
        assert row["checkpointable"] == ("true" if spec.checkpointable else "false")
        assert row["deferrable"] == ("true" if spec.deferrable else "false")
    assert {row["deferrable"] for row, rigid in zip(rows, workload.inflexible.tolist()) if rigid} == {"false"}
    listing = json.loads((tmp_path / "dump" / "sites.json").read_text())
    assert listing == [
        {"name": "alpha", "grid_zone": "US-MIDA-PJM", "region": "gcp:us-east1",
         "capacity_gpus": {"a100-80gb": 8}, "usd_per_gpu_hour": {"a100-80gb": 3.5}},
        {"name": "beta", "grid_zone": "DE-LU", "region": "gcp:europe-west3",
         "capacity_gpus": {"h100-80gb": 16, "l4": 8}, "usd_per_gpu_hour": {}},
    ]


# --- invalid assumptions -------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "field"), [
    pytest.param({"slack_factor": 0.5}, "slack_factor", id="a slack factor below 1 makes deadlines unmeetable"),
    pytest.param({"estimate_sigma": -0.1}, "estimate_sigma", id="a negative sigma is refused"),
    pytest.param({"inflexible_fraction": 1.5}, "inflexible_fraction", id="an inflexible share above 1 is refused"),
    pytest.param({"latency_fraction": -0.2}, "latency_fraction", id="a negative latency share is refused"),
    pytest.param({"latency_fraction": 1.01}, "latency_fraction", id="a latency share above 1 is refused"),
    pytest.param({"origin_regions": ()}, "origin_regions", id="no origin region is refused"),
    pytest.param({"origin_regions": ("gcp:us-east1", "gcp:us-east1-b")}, "origin_regions",
                 id="a region listed twice is refused"),
    pytest.param({"origin_regions": ("mars:olympus",)}, "origin_regions", id="an unknown provider is refused"),
    pytest.param({"min_slack_s": -1}, "min_slack_s", id="a negative minimum slack is refused"),
    pytest.param({"latency_slo_ms": 0}, "latency_slo_ms", id="a latency objective of 0 ms is refused"),
    pytest.param({"seed": -1}, "seed", id="a negative seed is refused"),
    pytest.param({"checkpointable_fraction": 2}, "checkpointable_fraction", id="a checkpointable share above 1"),
    pytest.param({"restart_s": -5}, "restart_s", id="a negative restart time is refused"),
    pytest.param({"origin_rule": "nearest"}, "origin_rule", id="an unknown origin rule is refused"),
])
def test_invalid_assumptions_are_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WorkloadAssumptions(**{"origin_regions": REGIONS, **changes})


# --- property ------------------------------------------------------------------------------------------


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 25))
    submit = sorted(draw(st.lists(st.floats(0, 1e7), min_size=n, max_size=n)))
    submit = [s - submit[0] for s in submit]
    duration = draw(st.lists(st.floats(1, 6e6), min_size=n, max_size=n))
    gpus = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    tenants = draw(st.lists(st.sampled_from(["6214e9", "Team A", "team-a", "vc_6YE", ""]), min_size=n, max_size=n))
    return small_trace(submit, duration, gpus=gpus, tenants=tenants)


assumptions = st.builds(
    WorkloadAssumptions,
    origin_regions=st.lists(st.sampled_from(REGIONS), min_size=1, unique=True).map(tuple),
    seed=st.integers(0, 2**32), origin_rule=st.sampled_from(["tenant_home", "per_job"]),
    slack_factor=st.floats(1, 20), min_slack_s=st.floats(0, 1e6), inflexible_fraction=st.floats(0, 1),
    latency_fraction=st.floats(0, 1), estimate_sigma=st.floats(0, 5),
    estimate_unbiased=st.sampled_from(["median", "mean"]),
)


@settings(max_examples=150, deadline=None)
@given(trace=traces(), a=assumptions)
def test_any_trace_gives_meetable_deadlines_positive_estimates_and_valid_job_specs(
        trace: Trace, a: WorkloadAssumptions) -> None:
    w = build_workload(trace, a)
    assert (w.deadline_s >= w.submit_s + w.true_duration_s).all()
    assert ((w.estimated_duration_s > 0) & (w.estimated_duration_s <= MAX_ESTIMATE_S)).all()
    for i in range(len(w)):
        assert w.job_spec(i).deadline >= w.submit_at(i) + timedelta(seconds=float(w.true_duration_s[i])
                                                                   ) - timedelta(microseconds=1)
