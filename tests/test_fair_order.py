"""The broker's queue order across tenants from the fair shares sites report (policies.fair_order)."""

from __future__ import annotations

import pytest

from broker.models import FairSharePolicy, QuotaState, TenantQuotaState
from policies.fair_order import FairOrder, Standing, standings


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
