"""Domain models: what a job body and a site spec may say, the errors a user meets when they say it
wrong (each naming the field, as the API and the config loader show it), and the job state machine."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.errors import problems
from broker.models import (
    TRANSITIONS,
    IllegalTransition,
    Job,
    JobSpec,
    JobState,
    SiteSpec,
)
from tests.builders import NOW, job, site

MINIMAL_JOB: dict[str, Any] = {"tenant": "t1", "name": "train-1", "gpus": {"count": 1}, "duration_s": 60}


def field_errors(model: type, body: dict[str, Any]) -> dict[str, str]:
    """Validate ``body`` and return ``{field path: problem}`` as a user would see them."""
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return {p["field"]: p["problem"] for p in problems(err.value)}


def with_gpus(**gpus: Any) -> dict[str, Any]:
    return {**MINIMAL_JOB, "gpus": {**MINIMAL_JOB["gpus"], **gpus}}


# --- job specs ----------------------------------------------------------------------------------------


def test_the_minimal_job_body_is_accepted_with_the_documented_defaults() -> None:
    spec = JobSpec.model_validate(MINIMAL_JOB)
    assert (spec.tenant, spec.name, spec.duration_s) == ("t1", "train-1", 60.0)
    assert (spec.gpus.count, spec.gpus.model, spec.gpus.memory_gib, spec.gpus.milli) == (1, None, None, 1000)
    assert spec.priority == 0
    assert spec.deadline is None
    assert spec.latency_slo_ms is None and spec.origin_region is None
    assert spec.allowed_regions == [] and spec.denied_regions == []
    assert spec.preemptible is False and spec.checkpointable is False
    assert spec.max_attempts == 3
    assert spec.labels == {}
    assert spec.deferrable is True


def test_deferrable_is_sent_only_where_a_job_asks_to_start_at_once() -> None:
    # A spec of an earlier release (no ``deferrable``) reads as deferrable, and one that is deferrable is
    # written without the key, so brokers of that release, whose specs forbid unknown keys, read it.
    plain = JobSpec.model_validate(MINIMAL_JOB)
    assert "deferrable" not in plain.model_dump() and "deferrable" not in plain.model_dump_json()
    assert JobSpec.model_validate_json(plain.model_dump_json()) == plain
    at_once = JobSpec.model_validate({**MINIMAL_JOB, "deferrable": False})
    assert at_once.model_dump()["deferrable"] is False
    assert JobSpec.model_validate_json(at_once.model_dump_json()).deferrable is False


def test_max_lost_attempts_is_sent_only_where_a_job_sets_it() -> None:
    # A spec of an earlier release (no ``max_lost_attempts``) reads as leaving it to the broker, and is written
    # again without the key, so brokers of that release, whose specs forbid unknown keys, read it.
    plain = JobSpec.model_validate(MINIMAL_JOB)
    assert plain.max_lost_attempts is None
    assert "max_lost_attempts" not in plain.model_dump() and "max_lost_attempts" not in plain.model_dump_json()
    bounded = JobSpec.model_validate({**MINIMAL_JOB, "max_lost_attempts": 0})
    assert JobSpec.model_validate_json(bounded.model_dump_json()).max_lost_attempts == 0


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        pytest.param(
            with_gpus(count=-1), "gpus.count", "greater than or equal to 1",
            id="a negative GPU count is refused",
        ),
        pytest.param(with_gpus(count=0), "gpus.count", "greater than or equal to 1", id="a job must ask for a GPU"),
        pytest.param(
            with_gpus(milli=0), "gpus.milli", "greater than or equal to 1",
            id="a zero share of a GPU is refused",
        ),
        pytest.param(
            with_gpus(milli=1001), "gpus.milli", "less than or equal to 1000",
            id="more than one GPU in milli is refused",
        ),
        pytest.param(
            with_gpus(milli=500, count=2), "gpus.count", "count must be 1",
            id="a fractional job asking for two GPUs is refused",
        ),
        pytest.param(
            with_gpus(model="a1000"), "gpus.model", "unknown GPU model 'a1000'",
            id="an unknown GPU model is refused",
        ),
        pytest.param(
            {**MINIMAL_JOB, "deadline": "2026-07-30T12:00:00"}, "deadline", "timezone",
            id="a deadline without a time zone is refused",
        ),
        pytest.param(
            {**MINIMAL_JOB, "latency_slo_ms": 50}, "origin_region", "latency_slo_ms needs origin_region",
            id="a latency SLO without an origin region is refused",
        ),
        pytest.param(
            {**MINIMAL_JOB, "allowed_regions": ["gcp:us-east1-b"], "denied_regions": ["gcp:us-east1"]},
            "denied_regions", "regions both allowed and denied: gcp:us-east1",
            id="a region both allowed and denied is refused even when written as a zone",
        ),
        pytest.param(
            {**MINIMAL_JOB, "allowed_regions": ["us-east1"]}, "allowed_regions[0]", "provider:region",
            id="an allowed region without provider is refused at its position in the list",
        ),
        pytest.param({**MINIMAL_JOB, "duration_s": 0}, "duration_s", "greater than 0", id="a zero duration is refused"),
        pytest.param({**MINIMAL_JOB, "tenant": "Team A"}, "tenant", "lower-case letters", id="a tenant must be a slug"),
    ],
)
def test_an_invalid_job_spec_is_refused_with_an_error_naming_the_field(
    body: dict[str, Any], field: str, problem: str,
) -> None:
    errors = field_errors(JobSpec, body)
    assert field in errors, errors
    assert problem in errors[field]


def test_a_typo_in_a_field_name_is_an_unknown_field_not_a_silent_default() -> None:
    body = {k: v for k, v in MINIMAL_JOB.items() if k != "gpus"} | {"gpu": {"count": 1}}
    errors = field_errors(JobSpec, body)
    assert errors == {"gpu": "unknown field (check the spelling)", "gpus": "required field is missing"}


def test_an_aware_deadline_is_converted_to_utc() -> None:
    spec = JobSpec.model_validate({**MINIMAL_JOB, "deadline": "2026-07-30T14:00:00+02:00"})
    assert spec.deadline == datetime(2026, 7, 30, 12, 0, tzinfo=UTC)
    assert spec.deadline.utcoffset() == timedelta(0)


def test_regions_and_gpu_models_in_a_job_are_canonicalised() -> None:
    spec = job(model="NVIDIA A100-SXM4-80GB", allowed_regions=["GCP:us-east1-b"], origin_region="aws:eu-west-1a")
    assert spec.gpus.model == "a100-80gb"
    assert spec.allowed_regions == ["gcp:us-east1"]
    assert spec.origin_region == "aws:eu-west-1"


def test_a_fractional_job_of_one_gpu_is_accepted() -> None:
    assert job(milli=250).gpus.milli == 250


def test_a_tenant_with_a_trailing_newline_is_refused() -> None:
    errors = field_errors(JobSpec, {**MINIMAL_JOB, "tenant": "t1\n"})
    assert "tenant" in errors


# --- site specs ---------------------------------------------------------------------------------------


def site_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "berlin",
        "region": "gcp:europe-west3",
        "grid_zone": "DE",
        "timezone": "Europe/Berlin",
        "latitude": 52.5,
        "longitude": 13.4,
        "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 2}],
    }
    return body | changes


def test_a_valid_site_spec_is_accepted_and_canonicalised() -> None:
    spec = SiteSpec.model_validate(site_body(usd_per_gpu_hour={"NVIDIA A100-SXM4-80GB": 5.5}))
    assert spec.grid_zone == "DE-LU"
    assert spec.usd_per_gpu_hour == {"a100-80gb": 5.5}
    assert spec.total_gpus() == {"a100-80gb": 16}


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        pytest.param(
            site_body(timezone="Mars/Olympus_Mons"), "timezone", "not an IANA time zone",
            id="an unknown time zone is refused",
        ),
        pytest.param(
            site_body(timezone="europe/berlin"), "timezone", "not an IANA time zone",
            id="a time zone in the wrong case is refused",
        ),
        pytest.param(
            site_body(timezone="Europe"), "timezone", "not an IANA time zone",
            id="a time zone area without a city is refused as a field error",
        ),
        pytest.param(
            site_body(latitude=91), "latitude", "less than or equal to 90",
            id="a latitude above 90 is refused",
        ),
        pytest.param(
            site_body(latitude=-90.5), "latitude", "greater than or equal to -90",
            id="a latitude below -90 is refused",
        ),
        pytest.param(
            site_body(longitude=181), "longitude", "less than or equal to 180",
            id="a longitude above 180 is refused",
        ),
        pytest.param(
            site_body(usd_per_gpu_hour={"a100-80gb": 5.0, "h100": 11.0}), "usd_per_gpu_hour",
            "prices h100-80gb, which no node group of this site has",
            id="a price for a model the site lacks is refused",
        ),
        pytest.param(
            site_body(usd_per_gpu_hour={"a100-80gb": -1}), "usd_per_gpu_hour", "must be zero or more",
            id="a negative price is refused",
        ),
        pytest.param(
            site_body(quotas=[{"tenant": "vision", "guaranteed_gpus": 4}, {"tenant": "vision", "burst_gpus": 8}]),
            "quotas[1].tenant", "each tenant may appear once; vision appears at quotas[0] and quotas[1]",
            id="a tenant with two quotas at one site is refused",
        ),
        pytest.param(
            site_body(gpus=[
                {"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1, "mig_profiles": ["1g.10gb", "1g-10gb"]},
            ]),
            "gpus[0].mig_profiles", "'1g-10gb' is not a MIG profile such as 1g.10gb",
            id="a MIG profile written with a dash is refused",
        ),
        pytest.param(
            site_body(gpus=[{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1, "mig_profiles": ["1g.10gb\n"]}]),
            "gpus[0].mig_profiles", "is not a MIG profile",
            id="a MIG profile with a trailing newline is refused",
        ),
        pytest.param(site_body(gpus=[]), "gpus", "at least 1 item", id="a site without GPUs is refused"),
        pytest.param(
            site_body(gpus=[{"model": "a100-80gb", "gpus_per_node": 0, "nodes": 1}]),
            "gpus[0].gpus_per_node", "greater than or equal to 1", id="a node without GPUs is refused",
        ),
        pytest.param(
            site_body(region="europe-west3"), "region", "provider:region",
            id="a region without provider is refused",
        ),
        pytest.param(
            site_body(grid_zone="Berlin!"), "grid_zone", "is not a grid zone id",
            id="a malformed grid zone is refused",
        ),
        pytest.param(site_body(colour="blue"), "colour", "unknown field", id="an unknown site field is refused"),
        pytest.param(
            site_body(name="berlin\n"), "name", "lower-case letters",
            id="a site name with a trailing newline is refused",
        ),
    ],
)
def test_an_invalid_site_spec_is_refused_with_an_error_naming_the_field(
    body: dict[str, Any], field: str, problem: str,
) -> None:
    errors = field_errors(SiteSpec, body)
    assert field in errors, errors
    assert problem in errors[field]


@pytest.mark.parametrize(
    ("group", "memory_gib"),
    [
        pytest.param({"model": "a100-40gb"}, 40.0, id="an A100 40GB group defaults to 40 GiB per GPU"),
        pytest.param({"model": "h200"}, 141.0, id="an H200 group defaults to 141 GiB per GPU"),
        pytest.param({"model": "t4"}, 16.0, id="a T4 group defaults to 16 GiB per GPU"),
        pytest.param(
            {"model": "a100-80gb", "memory_gib_per_gpu": 79.2}, 79.2,
            id="a stated memory per GPU wins over the table",
        ),
    ],
)
def test_memory_per_gpu_defaults_to_the_model_table(group: dict[str, Any], memory_gib: float) -> None:
    spec = SiteSpec.model_validate(site_body(gpus=[{"gpus_per_node": 8, "nodes": 1, **group}]))
    assert spec.gpus[0].gpu_memory_gib == pytest.approx(memory_gib)


def test_total_gpus_adds_up_every_node_group_of_a_model() -> None:
    spec = site("berlin", gpus=[
        {"model": "a100-80gb", "gpus_per_node": 8, "nodes": 2},
        {"model": "a100-80gb", "gpus_per_node": 4, "nodes": 1},
        {"model": "l4", "gpus_per_node": 4, "nodes": 3},
    ])
    assert spec.total_gpus() == {"a100-80gb": 20, "l4": 12}


# --- the job state machine ----------------------------------------------------------------------------

Q, D, A, R = JobState.QUEUED, JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING
S, F, C, P = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED

# Why each edge of the machine exists, in words; the legal-transition table below is every edge of
# TRANSITIONS, so an edge added there is tested too (with a plain sentence until it gets its own here).
WHY = {
    (Q, D): "a queued job is dispatched to a site",
    (Q, C): "a queued job is cancelled",
    (Q, F): "a queued job fails (no site can ever take it)",
    (D, A): "a site admits a dispatched job",
    (D, R): "a dispatched job starts at once",
    (D, Q): "a site rejects a dispatched job and it is requeued",
    (D, F): "a dispatch fails for good",
    (D, C): "a dispatched job is cancelled",
    (D, S): "a short job finishes before its admission is confirmed",
    (A, R): "an admitted job starts running",
    (A, S): "an admitted job is reported finished",
    (A, F): "an admitted job fails",
    (A, C): "an admitted job is cancelled",
    (A, P): "an admitted job is preempted",
    (A, Q): "an admitted job's site is lost and it is requeued",
    (R, S): "a running job succeeds",
    (R, F): "a running job fails",
    (R, C): "a running job is cancelled",
    (R, P): "a running job is preempted",
    (R, Q): "a running job's attempt fails with attempts left and it is requeued",
    (P, Q): "a preempted job is requeued",
    (P, C): "a preempted job is cancelled",
    (P, F): "a preempted job fails",
}

LEGAL = [
    pytest.param(src, dst, id=WHY.get((src, dst), f"a {src.value} job may become {dst.value}"))
    for src in JobState
    for dst in sorted(TRANSITIONS[src])
]

ILLEGAL = [
    (S, R, "a succeeded job cannot run again"),
    (S, Q, "a succeeded job cannot be requeued"),
    (F, Q, "a failed job cannot be requeued"),
    (C, Q, "a cancelled job cannot be requeued"),
    (C, R, "a cancelled job cannot start"),
    (Q, R, "a queued job cannot run without being dispatched"),
    (Q, A, "a queued job cannot be admitted without being dispatched"),
    (Q, S, "a queued job cannot succeed without running"),
    (Q, P, "a queued job cannot be preempted"),
    (P, R, "a preempted job cannot resume without going back in line"),
    (R, A, "a running job cannot go back to admitted"),
    (R, R, "a running job cannot become running again"),
]


def make_job(state: JobState = Q, **fields: Any) -> Job:
    return Job(id="job-7", spec=job(), state=state, created_at=NOW, updated_at=NOW, **fields)


@pytest.mark.parametrize(("src", "dst"), LEGAL)
def test_legal_transitions_move_the_job(src: JobState, dst: JobState) -> None:
    later = NOW + timedelta(seconds=5)
    moved = make_job(src, version=4).transition(dst, later)
    assert moved.state == dst
    assert moved.version == 5
    assert moved.updated_at == later


@pytest.mark.parametrize(("src", "dst"), [pytest.param(s, d, id=why) for s, d, why in ILLEGAL])
def test_illegal_transitions_raise_with_a_message_naming_both_states(src: JobState, dst: JobState) -> None:
    before = make_job(src, version=4)
    with pytest.raises(IllegalTransition) as err:
        before.transition(dst, NOW + timedelta(seconds=5))
    assert f"job job-7 is {src.value}; it cannot become {dst.value}" in str(err.value)
    assert (err.value.src, err.value.dst) == (src, dst)
    assert before.state == src and before.version == 4


def test_terminal_states_have_no_way_out_and_every_other_state_can_be_cancelled() -> None:
    for state in JobState:
        if state.terminal:
            assert TRANSITIONS[state] == frozenset(), state
        else:
            assert C in TRANSITIONS[state], state


def test_the_illegal_transition_message_says_what_is_allowed_instead() -> None:
    with pytest.raises(IllegalTransition) as err:
        make_job(Q).transition(R, NOW)
    assert "allowed from queued: cancelled, dispatching, failed" in str(err.value)
    with pytest.raises(IllegalTransition) as err:
        make_job(S).transition(R, NOW)
    assert "none (final state)" in str(err.value)


def test_a_job_runs_through_its_happy_path_with_timestamps_and_versions() -> None:
    t = [NOW + timedelta(seconds=s) for s in range(5)]
    j = make_job()
    j = j.transition(D, t[1], site="berlin", attempt=1)
    j = j.transition(A, t[2])
    assert j.started_at is None
    j = j.transition(R, t[3])
    assert j.started_at == t[3]
    assert j.finished_at is None
    j = j.transition(S, t[4])
    assert (j.state, j.site, j.attempt, j.version) == (S, "berlin", 1, 4)
    assert (j.started_at, j.finished_at, j.updated_at) == (t[3], t[4], t[4])


def test_started_at_is_kept_from_the_first_run_across_a_requeue() -> None:
    t = [NOW + timedelta(seconds=s) for s in range(7)]
    j = make_job().transition(D, t[1]).transition(A, t[1]).transition(R, t[2])
    j = j.transition(P, t[3]).transition(Q, t[4])
    j = j.transition(D, t[5]).transition(A, t[5]).transition(R, t[6])
    assert j.started_at == t[2]
    assert j.version == 8


@pytest.mark.parametrize(
    "path",
    [
        pytest.param([D, A, R, F], id="a failed job gets a finish time"),
        pytest.param([C], id="a job cancelled while queued gets a finish time"),
        pytest.param([D, A, P, C], id="a preempted job that is cancelled gets a finish time"),
    ],
)
def test_terminal_states_set_finished_at(path: list[JobState]) -> None:
    j = make_job()
    for step, dst in enumerate(path, start=1):
        j = j.transition(dst, NOW + timedelta(seconds=step))
    assert j.state.terminal
    assert j.finished_at == NOW + timedelta(seconds=len(path))


def test_explicit_changes_are_applied_with_the_transition() -> None:
    j = make_job().transition(F, NOW, reason="no site has 4096 GPUs", failed_attempts=1)
    assert (j.reason, j.failed_attempts) == ("no site has 4096 GPUs", 1)


@given(st.lists(st.sampled_from(list(JobState)), max_size=30))
def test_once_terminal_a_job_never_leaves_its_terminal_state(attempts: list[JobState]) -> None:
    j = make_job()
    for n, dst in enumerate(attempts, start=1):
        was = j
        try:
            j = j.transition(dst, NOW + timedelta(seconds=n))
        except IllegalTransition:
            assert dst not in TRANSITIONS[was.state]
            assert j is was
            continue
        assert not was.state.terminal, f"{was.state} became {dst}"
        assert j.version == was.version + 1
    if j.state.terminal:
        for dst in JobState:
            with pytest.raises(IllegalTransition):
                j.transition(dst, NOW)


def test_what_an_earlier_release_stored_still_reads() -> None:
    # A burst written as "no limit in effect" and a MIG slice no GPU has were accepted before; a stored site or
    # job that no longer read would stop the broker from starting. New submissions of the latter are refused
    # by the API (GpuRequest.never_fits), not by the model.
    from broker.models import GpuRequest, Job, JobSpec, SiteSpec

    spec = SiteSpec.model_validate_json(
        '{"name": "a", "region": "gcp:us-east1", "grid_zone": "US-MIDA-PJM", "timezone": "America/New_York", '
        '"latitude": 33.2, "longitude": -80.0, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}], '
        '"quotas": [{"tenant": "t1", "guaranteed_gpus": 0, "burst_gpus": 1000000}]}')
    assert spec.quotas[0].burst_gpus == 1_000_000
    old = JobSpec(tenant="t1", name="n", gpus={"count": 1, "mig_profile": "1g.5000gb"}, duration_s=60)
    assert Job.model_validate_json(Job(id="j", spec=old, created_at=NOW, updated_at=NOW).model_dump_json()).spec == old
    assert "more than any GPU a site may have" in (old.gpus.never_fits() or "")
    assert GpuRequest(count=1, mig_profile="1g.10gb").never_fits() is None


def test_a_stored_quota_for_gpus_the_site_lacks_still_reads_and_is_named_for_new_specs() -> None:
    from broker.store import site_from_doc

    doc = ('{"name": "a", "region": "gcp:us-east1", "grid_zone": "US-MIDA-PJM", "timezone": "America/New_York", '
           '"latitude": 33.2, "longitude": -80.0, "gpus": [{"model": "a100-80gb", "gpus_per_node": 8, "nodes": 1}], '
           '"quotas": [{"tenant": "t1", "guaranteed_gpus": 2, "model": "h100-80gb"}, '
           '{"tenant": "t2", "guaranteed_gpus": 9}, {"tenant": "t3", "guaranteed_gpus": 8}]}')
    spec = site_from_doc(doc)  # an earlier release took it: the broker must still start
    assert [p["field"] for p in spec.quota_problems()] == ["quotas[0].model", "quotas[1].guaranteed_gpus"]
    assert "the site has no h100-80gb GPUs (it has a100-80gb)" in spec.quota_problems()[0]["problem"]
    assert spec.quota_problems()[1]["problem"].startswith("9 is more than the site's 8 GPUs")


def test_a_kubernetes_site_without_measured_telemetry_is_stored_as_an_earlier_release_wrote_it() -> None:
    # Brokers of earlier releases share the database during an upgrade and forbid keys they do not know:
    # ``telemetry`` is left out of a stored adapter that does not use it, and kept where one does.
    from broker.models import KubernetesAdapterConfig
    plain = KubernetesAdapterConfig()
    assert "telemetry" not in plain.model_dump() and "telemetry" not in plain.model_dump_json()
    measured = KubernetesAdapterConfig(telemetry={"kind": "prometheus", "url": "http://prometheus:9090"})
    again = KubernetesAdapterConfig.model_validate_json(measured.model_dump_json())
    assert again.telemetry is not None and again.telemetry.url == "http://prometheus:9090"


def test_a_node_group_offering_mig_slices_of_a_model_without_mig_is_refused_but_a_stored_one_loads() -> None:
    # Jobs asking for MIG slices of such a model are refused at submit; a site offering them would hold capacity
    # no job could take. A site an earlier release stored so still loads, so the broker still starts.
    from broker.models import STORED, NodeGroup

    group = {"model": "l4", "gpus_per_node": 8, "nodes": 1, "mig_profiles": ["1g.6gb"]}
    assert "l4 GPUs cannot be partitioned into MIG slices" in field_errors(NodeGroup, group)["mig_profiles"]
    assert NodeGroup.model_validate(group, context=STORED).mig_profiles == ["1g.6gb"]
    assert NodeGroup.model_validate({**group, "model": "a100-80gb", "mig_profiles": ["1g.10gb"]}).mig_profiles


def test_telemetry_that_would_go_stale_between_two_readings_is_refused_but_a_stored_one_loads() -> None:
    # Readings every 60 s that are stale after 30 s: the measured telemetry would come and go between readings.
    from broker.models import STORED, NvmlTelemetryConfig, PrometheusTelemetryConfig

    with pytest.raises(ValueError, match=r"stale_after_s \(30 s\) is not longer than every_s \(60 s\)"):
        NvmlTelemetryConfig(every_s=60, stale_after_s=30)
    with pytest.raises(ValueError, match="is not longer than every_s"):
        PrometheusTelemetryConfig(url="http://prometheus:9090", every_s=60, stale_after_s=60)
    assert NvmlTelemetryConfig.model_validate({"every_s": 60, "stale_after_s": 30}, context=STORED).every_s == 60
    assert PrometheusTelemetryConfig(url="http://prometheus:9090").stale_after_s == 120  # the defaults hold
