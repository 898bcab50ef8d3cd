"""What the broker counts a tenant could reclaim of its guarantee at a site (``TenantQuotaState.reclaimable_gpus``):
a site reclaims only borrowers' jobs on the model it gives the job, so where it reports them per model
(``reclaimable_gpus_by_model``) a job counts only those of its model; and a pass that routes a job there relying on
them finds them taken for its next jobs, on the site's other models too. The reports here are the site's own
(``SiteAdmission``), and each routing is checked against what the site then does with the job."""

from __future__ import annotations

import pytest

from broker.ids import GPU_MODEL_IDS
from broker.models import GpuRequest, JobSpec, QuotaState, SiteSpec, SiteState, TenantQuota
from policies.admission import Admitted, Refused, SiteAdmission
from tests.builders import NOW, placed_in_one_pass, site

A100, H100 = "a100-80gb", "h100-80gb"
T0 = NOW.timestamp()
# x is guaranteed 16 GPUs of any model and holds none of them; y is guaranteed 8 and may borrow 8 more.
QUOTAS = [TenantQuota(tenant="x", guaranteed_gpus=16), TenantQuota(tenant="y", guaranteed_gpus=8, burst_gpus=8)]


def job(tenant: str, count: int, model: str | None = None, *, preemptible: bool = False, milli: int = 1000,
        name: str = "job") -> JobSpec:
    return JobSpec(tenant=tenant, name=name, gpus=GpuRequest(count=count, model=model, milli=milli),
                   duration_s=3600, preemptible=preemptible)


def alpha(running: list[JobSpec], *, per_model: bool = True, quotas: list[TenantQuota] = QUOTAS,
          unlisted_tenants: str = "refuse") -> tuple[SiteAdmission, SiteSpec, SiteState]:
    """Site alpha (8 A100s, 8 H100s) running ``running``, and what it reports to the broker (``per_model``
    false: without ``reclaimable_gpus_by_model``, as a site agent of an earlier release)."""
    spec = site("alpha", gpus={A100: 8, H100: 8}, quotas=quotas, fair_share={"unlisted_tenants": unlisted_tenants})
    admission = SiteAdmission(spec)
    for i, spec_ in enumerate(running):
        verdict = admission.admit(f"run-{i}", spec_, T0)
        assert isinstance(verdict, Admitted) and not verdict.victims, verdict
        admission.start(f"run-{i}", verdict, T0)
    sent = admission.report(T0).model_dump(mode="json")
    if not per_model:
        for t in sent["tenants"]:
            t.pop("reclaimable_gpus_by_model", None)
    capacity = [f.capacity() for _, f in sorted(admission.inventory.free().items())]
    return admission, spec, SiteState(site="alpha", health="healthy", last_heard_at=NOW, capacity=capacity,
                                      quota=QuotaState.model_validate(sent))


def one_pass(where: tuple[SiteAdmission, SiteSpec, SiteState], *jobs: JobSpec) -> list[str | None]:
    """The model each of ``jobs`` is routed to at alpha (None: not routed), deciding them in order in one pass."""
    _, spec, state = where
    return [GPU_MODEL_IDS[p.model] if p is not None else None for p in placed_in_one_pass(spec, state, jobs)]


@pytest.mark.parametrize("model,routed", [(A100, None), (H100, H100), (None, H100)],
                         ids=["a job on the model borrowers do not hold is not routed there", "a job on theirs is",
                              "a job naming no model is, on theirs"])
def test_a_job_counts_only_the_gpus_its_tenant_could_reclaim_on_its_own_model(model, routed) -> None:
    # alpha is full: y holds its 8 guaranteed GPUs on the A100s (not preemptible) and borrows the 8 H100s with
    # preemptible work. x could reclaim 8 GPUs, all H100s: an A100 job of x's would be refused there.
    where = alpha([job("y", 8, A100), job("y", 8, H100, preemptible=True)])
    x4 = job("x", 4, model)
    assert one_pass(where, x4) == [routed]
    verdict = where[0].admit("x4", x4, T0, model=routed or A100)
    assert isinstance(verdict, Admitted if routed else Refused), verdict  # what the site does with it


def test_an_earlier_release_s_report_still_counts_reclaimable_gpus_for_every_model_of_an_any_model_quota() -> None:
    # Without the per-model figures the broker cannot tell the models apart: as before, it routes a job of
    # either model there and lets the site decide.
    where = alpha([job("y", 8, A100), job("y", 8, H100, preemptible=True)], per_model=False)
    for model in (A100, H100):
        assert one_pass(where, job("x", 4, model)) == [model]
    report = where[2].quota
    assert report is not None and report.tenant("x").reclaimable_gpus_by_model == {}  # type: ignore[union-attr]


@pytest.mark.parametrize("per_model", [True, False], ids=["per model", "over every model (an earlier release)"])
@pytest.mark.parametrize("running,jobs", [
    ([job("y", 8, H100), job("y", 4, A100, preemptible=True)],
     [job("x", 8, A100, name="first"), job("x", 4, name="second")]),
    ([job("y", 8, H100), job("y", 4, A100, preemptible=True)],
     [job("x", 8, name="first"), job("x", 4, H100, name="second")]),
    ([job("y", 8, H100), job("x", 7, A100), job("y", 1, A100, preemptible=True)],
     [*(job("x", 1, A100, milli=250, name=f"share-{i}") for i in range(4)), job("x", 1, milli=250, name="fifth")]),
], ids=["an 8-GPU job on the model, then one naming none", "an 8-GPU job naming none, then one on the other model",
        "four quarters of the GPU it reclaims, then a fifth naming no model"])
def test_reclaimable_gpus_a_pass_routes_a_job_to_are_taken_for_its_next_jobs_on_every_model(
        per_model, running, jobs) -> None:
    # y holds the H100s within its guarantee and borrows A100s (4 of them, or 1 where x holds 7), the rest free:
    # the first job(s) of x's fill the A100s, reclaiming what y borrows. Nothing is left for the last, on either
    # model (the pass used to count the same reclaimable GPUs again on the H100s, which nobody borrows).
    routed = one_pass(alpha(running, per_model=per_model), *jobs)
    assert routed == [A100] * (len(jobs) - 1) + [None]


@pytest.mark.parametrize("per_model", [True, False], ids=["per model", "over every model (an earlier release)"])
def test_a_quota_counting_one_model_reclaims_only_on_that_model(per_model) -> None:
    # x's quota counts 8 H100s; y borrows them, and holds the A100s. A (preemptible) job of x's on the A100s runs
    # there as an unlisted tenant's (best-effort, no limit), which reclaims nothing: it is not routed to the full
    # site, even from a report that gives no models (the quota's model tells which).
    quotas = [TenantQuota(tenant="x", guaranteed_gpus=8, model=H100), QUOTAS[1]]
    where = alpha([job("y", 8, A100), job("y", 8, H100, preemptible=True)], per_model=per_model, quotas=quotas,
                  unlisted_tenants="best-effort")
    assert one_pass(where, job("x", 4, A100, preemptible=True)) == [None]
    assert isinstance(where[0].admit("x4", job("x", 4, A100, preemptible=True), T0, model=A100), Refused)
    assert one_pass(where, job("x", 4, H100)) == [H100]
    assert isinstance(where[0].admit("x4", job("x", 4, H100), T0, model=H100), Admitted)
