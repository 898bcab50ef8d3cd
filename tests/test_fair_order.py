"""The broker's queue order across tenants from the fair shares sites report (policies.fair_order)."""

from __future__ import annotations

import pytest

from broker.models import FairSharePolicy, QuotaState, TenantQuota, TenantQuotaState
from policies.fair_order import FairOrder, Standing, standings
from policies.quota import Ask, QuotaBook
from policies.snapshot import build_quota_view
from tests.builders import site, site_state


def report(mode: str, capacity: float, *tenants: tuple[str, float, float, float], listed: bool = True) -> QuotaState:
    """tenants: (name, weight, decayed GPU-hours, GPUs in use)."""
    return QuotaState(enforced=True, fair_share=FairSharePolicy(mode=mode), capacity_gpus=capacity, tenants=[
        TenantQuotaState(tenant=t, listed=listed, fair_share_weight=w, decayed_usage_gpu_h=u, in_use_gpus=held)
        for t, w, u, held in tenants])


def test_entitlements_follow_weights_and_time_based_usage_over_the_sites():
    instant = standings([report("instant", 30, ("a", 2, 100, 10), ("b", 1, 0, 0))])
    assert instant["a"][:2] == pytest.approx((10, 20)) and instant["b"][:2] == pytest.approx((0, 10))
    # time: a used it all: P_a = max(0, 2/3 + (2/3 - 1)) = 1/3, P_b = 1/3 + 1/3 = 2/3
    timed = standings([report("time", 30, ("a", 2, 100, 10), ("b", 1, 0, 0)),
                       report("time", 10, ("a", 1, 0, 0), ("b", 1, 0, 4))])
    assert timed["a"][:2] == pytest.approx((10, 10 + 5)) and timed["b"][:2] == pytest.approx((4, 20 + 5))
    assert standings([report("off", 30, ("a", 1, 5, 1))]) == {}  # a site without fair share adds nothing


def test_the_queue_goes_to_the_tenant_furthest_below_its_share_and_is_re_ranked_as_it_is_served():
    jobs = [("a", 0, 1), ("a", 0, 2), ("a", 0, 3), ("b", 0, 4), ("b", 0, 5), ("c", 0, 0)]  # (tenant, prio, age)
    order = FairOrder(jobs, lambda j: j[0], lambda j: j[1], lambda j: j[2],
                      {"a": Standing(0.0, 8.0, True), "b": Standing(4.0, 8.0, True)})  # c: listed nowhere
    served = []
    for j in order:
        served.append(j)
        order.placed(j[0], 2.0)
    # a (0/8) twice until level with b (4/8), then by age; c last
    assert served == [("a", 0, 1), ("a", 0, 2), ("a", 0, 3), ("b", 0, 4), ("b", 0, 5), ("c", 0, 0)]


def test_priority_comes_before_fair_share_and_an_unplaced_job_does_not_move_its_tenant():
    jobs = [("a", 0, 1), ("b", 5, 2), ("b", 0, 3), ("a", 0, 4)]
    order = FairOrder(jobs, lambda j: j[0], lambda j: j[1], lambda j: j[2], {"a": Standing(6.0, 8.0, True), "b": Standing(0.0, 8.0, True)})
    served = list(order)  # nothing placed: the ratios stay
    assert served == [("b", 5, 2), ("b", 0, 3), ("a", 0, 1), ("a", 0, 4)]


def test_a_listed_tenant_whose_usage_took_its_entitlement_still_comes_before_one_no_site_lists():
    # vision used the whole site: with k=1 its usage-adjusted share is 0, so it is entitled to nothing here
    site = report("time", 16, ("vision", 1, 69.2, 0), ("nlp", 1, 0, 0))
    site.tenants.append(TenantQuotaState(tenant="speech", listed=False, in_use_gpus=2))  # a best-effort guest
    standing = standings([site])
    assert standing["vision"] == (0, 0, True) and standing["speech"] == (2, 0, False)
    jobs = [("speech", 0, 1), ("vision", 0, 2), ("nlp", 0, 3)]  # speech waited longest
    order = FairOrder(jobs, lambda j: j[0], lambda j: j[1], lambda j: j[2], standing)
    assert [j[0] for j in order] == ["nlp", "vision", "speech"]


# --- a site whose quotas count different pools ------------------------------------------------------------

H100, A100 = "h100-80gb", "a100-80gb"
T0 = 1_785_420_000.0


def mixed_site() -> QuotaState:
    """8 H100 and 56 A100. vision's quota counts the H100s only and it runs on all 8 of them; nlp's counts any
    model and it runs on 24 A100s. Each has a weight of 1 (instant: shares by weight alone)."""
    quotas = [TenantQuota(tenant="vision", burst_gpus=8, model=H100), TenantQuota(tenant="nlp", burst_gpus=64)]
    book = QuotaBook(quotas, FairSharePolicy(mode="instant"), {H100: 8, A100: 56})
    book.start(Ask("v1", "vision", 8, H100, preemptible=True), T0)
    book.start(Ask("n1", "nlp", 24, A100, preemptible=True), T0)
    return QuotaState.model_validate_json(book.report(T0 + 60).model_dump_json())  # as the broker receives it


def test_a_one_model_quota_is_entitled_to_a_share_of_that_model_as_its_site_divides_it():
    # The site divides its 8 H100 among the tenants counting H100 (vision alone) and its 64 GPUs among those
    # counting any model (nlp alone). Counting vision against all 64 entitled each tenant to 32, and put
    # vision, whose every H100 is taken, first: 8/32 held against nlp's 24/32.
    standing = standings([mixed_site()], [{H100: 8, A100: 56}])
    assert standing["vision"] == pytest.approx((8, 8, True)) and standing["nlp"] == pytest.approx((24, 64, True))
    jobs = [("vision", 0, 1), ("nlp", 0, 2)]  # vision's job waited longer
    order = FairOrder(jobs, lambda j: j[0], lambda j: j[1], lambda j: j[2], standing)
    assert [j[0] for j in order] == ["nlp", "vision"]  # nlp holds 24 of 64 entitled, vision 8 of 8


def test_the_broker_sizes_a_one_model_pool_from_the_sites_capacity_report_whatever_its_release():
    # The pools come from what every site already reports (its GPUs by model), so a site agent of any release
    # is read so, and the quota report carries nothing new that a broker of an earlier release would refuse.
    spec = site("mixed", gpus={H100: 8, A100: 56})
    state = site_state(spec, free={H100: 0, A100: 32}).model_copy(update={"quota": mixed_site()})
    view = build_quota_view([spec], {"mixed": state})
    assert view is not None
    assert view.standing["vision"] == pytest.approx((8, 8, True))
    assert view.standing["nlp"] == pytest.approx((24, 64, True))
