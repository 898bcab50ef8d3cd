"""What the broker counts a site may preempt for a job of higher priority: the GPUs that preemptible work of lower
priority holds there (``QuotaState.preemptible_gpus_by_priority``), and a tenant's own at a site where it is at its
limit (``TenantQuotaState.preemptible_gpus_by_priority``). A site preempts for a job only jobs on the model it gives
it, so where it reports them per model (``preemptible_gpus_by_model``) a job counts only those of its model; and a
pass that routes a job there relying on them finds them taken for its next jobs."""

from __future__ import annotations

from typing import Any

import pytest

from broker.models import JobSpec, QuotaState, SiteSpec, SiteState
from tests.builders import NOW, job, placed_in_one_pass, site, site_state

A100, H100 = "a100-80gb", "h100-80gb"


def alpha(free: dict[str, int], held: dict[str, dict[int, float]], *, per_model: bool = True,
          tenant_at_limit: bool = False, ceiling: int | None = None) -> tuple[SiteSpec, SiteState]:
    """A site of 8 A100s and 8 H100s with ``free`` GPUs free, where preemptible work of priority 0 holds ``held``
    ({model: {priority: GPUs}}). ``per_model``: the site reports it per model as well (false: as a site agent of
    an earlier release, by priority only). ``tenant_at_limit``: that work is tenant t1's own, and t1 holds all its
    quota lets it (16 GPUs), its priority capped at ``ceiling`` there."""
    spec = site("alpha", gpus={A100: 8, H100: 8})
    by_priority: dict[int, float] = {}
    for on in held.values():
        for p, g in on.items():
            by_priority[p] = by_priority.get(p, 0.0) + g
    report: dict[str, Any] = {"enforced": tenant_at_limit, "capacity_gpus": 16,
                              "preemptible_gpus_by_priority": by_priority}
    if per_model:
        report["preemptible_gpus_by_model"] = held
    if tenant_at_limit:
        t1 = {"tenant": "t1", "guaranteed_gpus": 16, "burst_gpus": 0, "in_use_gpus": 16, "room_gpus": 0,
              "nonpreemptible_room_gpus": 0, "preemptible_gpus_by_priority": by_priority, "priority_ceiling": ceiling}
        if per_model:
            t1["preemptible_gpus_by_model"] = held
        report["tenants"] = [t1]
    # As the broker reads a heartbeat: from JSON, so an earlier release's report (no per-model key) is one too.
    state = site_state(spec, free=free).model_copy(update={"quota": QuotaState.model_validate_json(
        QuotaState.model_validate(report).model_dump_json())})
    return spec, state


def one_pass(where: tuple[SiteSpec, SiteState], *jobs: JobSpec) -> list[str | None]:
    """The site each of ``jobs`` is routed to (None: none), deciding them in order in one pass."""
    spec, state = where
    return [spec.name if p is not None else None for p in placed_in_one_pass(spec, state, jobs)]


def urgent(model: str | None = None, count: int = 8, milli: int = 1000, name: str = "urgent") -> JobSpec:
    return job(tenant="t1", name=name, count=count, model=model, milli=milli, priority=10)


@pytest.mark.parametrize("tenant_at_limit", [False, True], ids=["the site is full", "its tenant is at its limit"])
@pytest.mark.parametrize("model,routed", [(A100, None), (H100, "alpha"), (None, "alpha")],
                         ids=["a job on another model is not routed there", "a job on that model is",
                              "a job naming no model is (the site gives it that model)"])
def test_a_job_counts_only_the_preemptible_work_on_its_own_model(tenant_at_limit, model, routed) -> None:
    # All of alpha's preemptible work is on its H100s; its A100s are full too, or free but its tenant at its limit.
    free = {A100: 8, H100: 0} if tenant_at_limit else {A100: 0, H100: 0}
    where = alpha(free, {H100: {0: 8}}, tenant_at_limit=tenant_at_limit)
    assert one_pass(where, urgent(model, count=4)) == [routed]


@pytest.mark.parametrize("per_model", [True, False], ids=["per model", "by priority only (an earlier release)"])
@pytest.mark.parametrize("jobs", [
    [urgent(name="first"), urgent(name="second")],
    [urgent(A100, name="first"), urgent(None, name="second")],
    [urgent(count=1, milli=250, name=f"share-{i}") for i in range(5)],
], ids=["two jobs naming no model", "a job on the model, then one naming none", "a fifth quarter of one GPU"])
def test_preemptible_gpus_a_pass_routes_a_job_to_are_taken_for_its_next_jobs(per_model, jobs) -> None:
    # alpha is full; preemptible work of lower priority holds 8 of its A100s (one, for the shares of one GPU):
    # room for one more 8-GPU job, or four quarters of a GPU. The job after that goes nowhere, not to alpha
    # to be refused (the pass used to count the same GPUs again on alpha's other model, or for each share).
    held = {A100: {0: 1.0 if jobs[0].gpus.milli < 1000 else 8.0}}
    routed = one_pass(alpha({A100: 0, H100: 0}, held, per_model=per_model), *jobs)
    assert routed == ["alpha"] * (len(jobs) - 1) + [None]


def test_an_earlier_release_s_report_still_counts_its_preemptible_gpus_for_every_model() -> None:
    # Without the per-model figures the broker cannot tell the models apart: as before, it routes a job of
    # either model there and lets the site decide.
    for model in (A100, H100):
        assert one_pass(alpha({A100: 0, H100: 0}, {H100: {0: 8}}, per_model=False), urgent(model)) == ["alpha"]
    report = alpha({A100: 0, H100: 0}, {H100: {0: 8}}, per_model=False)[1].quota
    assert report is not None and "preemptible_gpus_by_model" not in report.model_dump(mode="json")


def test_a_tenant_at_its_limit_preempts_its_own_on_each_model_for_one_job_each() -> None:
    # t1 holds all it may at alpha, its preemptible work 8 GPUs on each model; alpha is full. An urgent job on each
    # model is routed there (the first does not use up what the second relies on), and a third goes nowhere.
    where = alpha({A100: 0, H100: 0}, {A100: {0: 8}, H100: {0: 8}}, tenant_at_limit=True)
    assert one_pass(where, urgent(A100, name="a"), urgent(H100, name="h"), urgent(None, name="third")) == [
        "alpha", "alpha", None]


@pytest.mark.parametrize("ceiling,routed", [(None, "alpha"), (5, "alpha"), (0, None)])
def test_per_model_the_site_still_preempts_only_below_the_priority_it_lets_the_tenant_have(ceiling, routed) -> None:
    where = alpha({A100: 0, H100: 0}, {H100: {0: 8}}, tenant_at_limit=True, ceiling=ceiling)
    assert one_pass(where, urgent(H100)) == [routed]
