"""Properties of the site-local quota policies (``policies.quota``, ``policies.preemption``,
``policies.fairshare``, ``policies.fair_order``) that the README and the modules' docstrings promise, checked on
random sites and histories. ``tests/test_quota.py`` holds the worked cases and the guarantee/limit properties
on one-GPU jobs; these add the victims of a priority preemption against the fair shares the book reports, the
shortest prefix, admit-then-release, quota changes, a model's guarantee reclaimed from tenants whose quotas
count any model, the decay formula, the division and the broker's order. The sites are of one model but for
that one: there no tenant can hold its guarantee on another model, so none is ever pushed below it."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.models import FairSharePolicy, TenantQuota
from policies.fair_order import FairOrder, Standing
from policies.fairshare import Claim, divide
from policies.quota import Ask, Verdict
from tests.test_quota import EPS, H, MODEL, Site, ask, quota

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- a random site and history ------------------------------------------------------------------------


@st.composite
def sites(draw: st.DrawFn) -> tuple[int, list[TenantQuota]]:
    """A small site and 2-4 listed tenants (guarantees within the site, some ceilings); ``guest`` is unlisted."""
    gpus = draw(st.integers(4, 12))
    left, quotas = gpus, []
    for i in range(draw(st.integers(2, 4))):
        g = draw(st.integers(0, left))
        left -= g
        quotas.append(quota(f"t{i}", g, draw(st.integers(0, gpus)), fair_share_weight=draw(st.sampled_from([1, 2, 3])),
                            priority_ceiling=draw(st.sampled_from([None, None, 0, 1]))))
    return gpus, quotas


STEP = st.tuples(
    st.sampled_from(["submit", "submit", "submit", "finish"]),
    st.integers(0, 4),  # tenant (4: the unlisted guest)
    st.sampled_from([0.25, 0.5, 1, 1, 2, 3]),  # GPUs
    st.booleans(),  # preemptible
    st.integers(-2, 3),  # priority
    st.sampled_from([None, 0.0, 600.0]),  # min_run_s
    st.sampled_from([0.0, 0.0, 60.0, 3600.0]),  # seconds before it
    st.dictionaries(st.integers(0, 4), st.sampled_from([0, 0.5, 1, 2, 4]), max_size=5),  # waiting beyond what it runs
)


def name(i: int, quotas: Sequence[TenantQuota]) -> str:
    return quotas[i].tenant if i < len(quotas) else "guest"


def effective(quotas: dict[str, TenantQuota], tenant: str, priority: int) -> int:
    q = quotas.get(tenant)
    return priority if q is None or q.priority_ceiling is None else min(priority, q.priority_ceiling)


def check_verdict(site: Site, job: Ask, v: Verdict, demand: dict[str, float], quotas: dict[str, TenantQuota]) -> None:
    """What the docs promise of the victims of one admitted verdict."""
    held = site.held(job.tenant)
    q = quotas.get(job.tenant)
    guaranteed = q.guaranteed_gpus if q else 0
    limit = q.guaranteed_gpus + q.burst_gpus if q else math.inf
    p = effective(quotas, job.tenant, job.priority)
    reclaim = v.reason is not None and v.reason.startswith("reclaims")
    # the fair shares that decide who is over its share: the caller's demand, the asking job counted in
    shares = site.book.fair_shares(site.now, {**demand, job.tenant: max(demand.get(job.tenant, 0), held + job.gpus)})
    fits = site.fits(job)
    taken: dict[str, float] = {}
    for victim in v.victims:
        was = site.running[victim]
        min_run = was.min_run_s if was.min_run_s is not None else site.book.policy.min_run_s
        if reclaim:
            min_run = min(min_run, site.book.policy.min_run_s)
        assert was.preemptible, victim
        assert site.now - site.started[victim] >= min_run, victim
        assert was.model == job.model
        prio = effective(quotas, was.tenant, was.priority)
        if was.tenant == job.tenant:
            assert prio < p, (victim, prio, p)  # its own work only of lower priority
        else:
            g = quotas[was.tenant].guaranteed_gpus if was.tenant in quotas else 0
            assert site.held(was.tenant) > g + EPS  # a borrower
            if not reclaim:
                assert prio < p, (victim, prio, p)
                assert site.held(was.tenant) > shares[was.tenant] + EPS, (victim, shares)  # over its fair share
        taken[was.tenant] = taken.get(was.tenant, 0.0) + was.gpus
    for tenant, gpus in taken.items():  # never below a guarantee (one model: none could hold it elsewhere)
        if tenant != job.tenant:
            g = quotas[tenant].guaranteed_gpus if tenant in quotas else 0
            assert site.held(tenant) - gpus >= g - EPS
    # the victims free enough where the job fits, within the tenant's limit ...
    assert fits(v.victims)
    assert held - taken.get(job.tenant, 0.0) + job.gpus <= limit + EPS
    assert v.borrowed == (held - taken.get(job.tenant, 0.0) + job.gpus > guaranteed + EPS)
    # ... and no more of them than needed: without any one of them the job would not fit
    for spared in v.victims:
        fewer = tuple(x for x in v.victims if x != spared)
        own = sum(site.running[x].gpus for x in fewer if site.running[x].tenant == job.tenant)
        assert not (fits(fewer) and held - own + job.gpus <= limit + EPS), (spared, v)


def books(site: Site) -> list[tuple]:
    """Everything the book reports but the refusal reasons (which any stop clears, as documented)."""
    out = []
    for s in site.book.state(site.now):
        out.append((s.tenant, s.listed, s.model, s.in_use_gpus, s.borrowed_gpus, s.nonpreemptible_gpus,
                    round(s.fair_share_gpus, 9), s.decayed_usage_gpu_h, s.room_gpus, s.nonpreemptible_room_gpus,
                    s.reclaimable_gpus))
    r = site.book.report(site.now)
    return [*out, r.unlisted_nonpreemptible_room_gpus, r.preemptible_gpus_by_priority]


@settings(max_examples=120, **SLOW)
@given(site_quotas=sites(), steps=st.lists(STEP, min_size=15, max_size=45),
       policy=st.sampled_from([FairSharePolicy(), FairSharePolicy(mode="instant", min_run_s=300),
                               FairSharePolicy(mode="off")]))
def test_every_verdict_keeps_the_documented_promises_about_its_victims(site_quotas, steps, policy) -> None:
    gpus, quotas = site_quotas
    by_name = {q.tenant: q for q in quotas}
    site = Site(quotas, gpus, policy=policy)
    for n, (kind, who, size, preemptible, priority, min_run, dt, demand) in enumerate(steps):
        site.advance(dt)
        if kind == "finish":
            if site.running:
                site.finish(sorted(site.running)[who % len(site.running)])
            continue
        job = ask(f"j{n}", name(who, quotas), size, priority=priority, preemptible=preemptible, min_run_s=min_run)
        wanted = {name(i, quotas): site.held(name(i, quotas)) + d for i, d in demand.items()}
        v = site.verdict(job, wanted)
        if not v.admitted:
            continue
        check_verdict(site, job, v, wanted, by_name)
        if not v.victims:  # admitting then releasing a job leaves the books as they were
            before = books(site)
            site.run(job)
            site.finish(job.job_id)
            assert books(site) == before
        site.submit(job)
        assert sum(a.gpus for a in site.running.values()) <= gpus + EPS
        for q in quotas:
            assert site.held(q.tenant) <= q.guaranteed_gpus + q.burst_gpus + EPS


def test_a_guest_new_to_the_site_counts_once_in_the_fair_shares_that_pick_victims() -> None:
    """A tenant no quota names and that runs nothing yet, named in the caller's demand, used to be counted twice
    in the division ``admit`` makes (once for the demand, once as the asking job), so every other tenant's
    share shrank and one within its fair share was preempted."""
    site = Site([quota("a", 0, 8), quota("b", 0, 8)], gpus=8)
    for i in range(5):
        site.run(ask(f"a{i}", "a"))
    site.advance(60)
    for i in range(3):  # b's jobs are the newest: first in line among equals
        site.run(ask(f"b{i}", "b"))
    site.advance(H)
    demand = {"a": 5, "b": 3, "guest": 2}
    # guest 2, then a and b 3 each of the 6 left: b holds its share, a is 2 over it
    assert site.book.fair_shares(site.now, demand) == {"a": 3, "b": 3, "guest": 2}
    job = ask("g0", "guest", 2, priority=5)
    v = site.verdict(job, demand)
    assert v.admitted and v.victims == ("a0", "a1")  # a started all at once: by job id
    check_verdict(site, job, v, demand, {q.tenant: q for q in [quota("a", 0, 8), quota("b", 0, 8)]})


# --- quota changes: a guarantee that is reclaimable stays reclaimable ---------------------------------


@settings(max_examples=80, **SLOW)
@given(site_quotas=sites(), steps=st.lists(st.tuples(
    st.sampled_from(["submit", "submit", "submit", "finish", "set"]), st.integers(0, 4), st.booleans(),
    st.integers(-2, 2), st.sampled_from([0.0, 60.0, 3600.0]), st.integers(0, 12), st.integers(0, 12)),
    min_size=20, max_size=50))
def test_after_any_quota_changes_a_tenant_within_its_guarantee_is_admitted_while_every_guarantee_is_reclaimable(
        site_quotas, steps) -> None:
    """The operator may change quotas at any time (running jobs stay, even over a lowered limit or on a raised
    guarantee). Whenever the guarantees stay reclaimable (sum over tenants of max(guarantee, non-preemptible
    GPUs) within the site, guarantees within the site), a tenant below its guarantee is admitted, preemptible
    or not, at once; one-GPU jobs, so a borrower's job can always be taken without crossing its guarantee."""
    gpus, quotas = site_quotas
    current = {q.tenant: q for q in quotas}
    site = Site(quotas, gpus, policy=FairSharePolicy(min_run_s=0))
    for n, (kind, who, preemptible, priority, dt, g, burst) in enumerate(steps):
        site.advance(dt)
        tenant = name(who, quotas)
        if kind == "finish" and site.running:
            site.finish(sorted(site.running)[who % len(site.running)])
        elif kind == "set" and tenant != "guest":
            others = sum(q.guaranteed_gpus for t, q in current.items() if t != tenant)
            current[tenant] = quota(tenant, min(g, gpus - others), burst)
            site.book.set_quota(current[tenant], site.now)
        elif kind == "submit":
            job = ask(f"j{n}", tenant, 1, priority=priority, preemptible=preemptible)
            v = site.verdict(job)
            if v.admitted:
                check_verdict(site, job, v, {}, current)
                site.submit(job)
        np = {t: sum(a.gpus for a in site.running.values() if a.tenant == t and not a.preemptible)
              for t in [*current, "guest"]}
        if sum(max(current[t].guaranteed_gpus if t in current else 0, n) for t, n in np.items()) > gpus:
            continue  # a change made some guarantee unreclaimable: the docs promise nothing then
        for q in current.values():
            if site.held(q.tenant) + 1 <= q.guaranteed_gpus:
                for probe_preemptible in (True, False):
                    probe = ask("probe", q.tenant, 1, preemptible=probe_preemptible)
                    v = site.verdict(probe)
                    assert v.admitted, (q, v.reason)
                    check_victims_reclaim = v.reason is None or v.reason.startswith("reclaims")
                    assert check_victims_reclaim, v.reason
                    check_verdict(site, probe, v, {}, current)


# --- two models: a model's guarantee reclaimed from tenants whose quotas count any model ------------------

H100 = "h100-80gb"


@st.composite
def two_model_sites(draw: st.DrawFn) -> tuple[dict[str, float], list[TenantQuota]]:
    """H100s and A100s; t0's quota counts any model, t1's H100s, t2's and t3's (if drawn) either; each guarantee
    within what it counts (together they may be more than the site); ``guest`` is unlisted."""
    capacity = {H100: float(draw(st.integers(2, 4))), MODEL: float(draw(st.integers(2, 8)))}
    models = [None, H100] + draw(st.lists(st.sampled_from([None, H100, MODEL]), max_size=2))
    quotas = []
    for i, model in enumerate(models):
        pool = sum(capacity.values()) if model is None else capacity[model]
        quotas.append(quota(f"t{i}", draw(st.integers(1 if i < 2 else 0, int(pool))), draw(st.integers(0, 8)),
                            model=model))
    return capacity, quotas


def lacks(site: Site, quotas: Sequence[TenantQuota]) -> dict[str, float]:
    """GPUs each listed tenant lacks of its guarantee (one counting a model: of that model's GPUs it holds)."""
    return {q.tenant: max(0.0, q.guaranteed_gpus - sum(a.gpus for a in site.running.values()
                                                       if a.tenant == q.tenant and q.model in (None, a.model)))
            for q in quotas}


@settings(max_examples=150, **SLOW)
@given(site_quotas=two_model_sites(), steps=st.lists(st.tuples(
    st.sampled_from(["submit", "submit", "submit", "finish"]), st.sampled_from([0, 0, 1, 1, 2, 3, 4]),  # 4: guest
    st.sampled_from([H100, MODEL]), st.sampled_from([1, 1, 2]), st.booleans(), st.integers(-2, 2),
    st.sampled_from([0.0, 60.0, 3600.0])),
    min_size=15, max_size=45), site_min_run=st.sampled_from([0.0, 300.0]))
def test_a_tenant_counting_any_model_falls_below_its_guarantee_only_to_a_model_guarantee_and_can_hold_it_elsewhere(
        site_quotas, steps, site_min_run) -> None:
    """Another tenant falls below its guarantee only through a reclaim by a tenant whose quota counts the job's
    model, only one whose quota counts any model, only preemptible work past its minimum run time (at most the
    site's), and afterwards the GPUs the any-model tenants lack of their guarantees fit in the idle GPUs of the
    other models that those models' own guarantees do not need: once those are held, each of them is admitted
    one GPU at a time, without preempting anyone, up to its guarantee."""
    capacity, quotas = site_quotas
    by_name = {q.tenant: q for q in quotas}
    site = Site(quotas, capacity=capacity, policy=FairSharePolicy(min_run_s=site_min_run))
    for i in range(int(capacity[H100])):  # t0 starts on the H100s, t1's model
        site.submit(ask(f"t0-{i}", "t0", model=H100))
    for n, (kind, who, model, size, preemptible, priority, dt) in enumerate(steps):
        site.advance(dt)
        if kind == "finish":
            if site.running:
                site.finish(sorted(site.running)[who % len(site.running)])
            continue
        job = ask(f"j{n}", name(who, quotas), size, priority=priority, preemptible=preemptible, model=model)
        v = site.verdict(job)
        if not v.admitted:
            continue
        before = lacks(site, quotas)
        for victim in v.victims:
            was = site.running[victim]
            min_run = was.min_run_s if was.min_run_s is not None else site_min_run
            if v.reason.startswith("reclaims"):
                min_run = min(min_run, site_min_run)
            assert was.preemptible and was.model == model
            assert site.now - site.started[victim] >= min_run, victim
        site.submit(job)
        after = lacks(site, quotas)
        below = [t for t in after if t != job.tenant and after[t] > before[t] + EPS]
        if not below:
            continue
        assert v.reason.startswith("reclaims") and by_name[job.tenant].model == model, v
        assert all(by_name[t].model is None for t in below), (below, v)
        assert f"tenant {below[0]}, left with" in v.reason
        idle = {m: site.free(m) - sum(after[q.tenant] for q in quotas if q.model == m) for m in capacity}
        assert sum(after[q.tenant] for q in quotas if q.model is None) <= sum(
            max(0.0, g) for m, g in idle.items() if m != model) + EPS
        # the proof: every other model's own guarantees held first, then each any-model tenant asks for its own
        fill = copy.deepcopy(site)
        for q in quotas:
            for i in range(int(after[q.tenant]) if q.model not in (None, model) else 0):
                if not fill.submit(ask(f"fill-{q.tenant}-{i}", q.tenant, model=q.model)).admitted:
                    break
        for q in quotas:
            if q.model is None:
                while lacks(fill, [q])[q.tenant] > EPS:
                    tries = [fill.verdict(ask(f"back-{len(fill.running)}", q.tenant, model=m)) for m in capacity]
                    m = next((m for m, t in zip(capacity, tries, strict=True) if t.admitted and not t.victims), None)
                    assert m is not None, (q, tries)
                    fill.submit(ask(f"back-{len(fill.running)}", q.tenant, model=m))


# --- usage over time -----------------------------------------------------------------------------------


def expected_usage_gpu_h(jobs: Sequence[tuple[float, float, float]], now: float, policy: FairSharePolicy) -> float:
    """The documented decayed usage at the last reweight boundary E <= now, from scratch: each bucket's
    GPU-seconds (up to E) times 0.5 ** ((E - its middle) / half-life), over the buckets whose middle is within
    the window before E, and at least the last one."""
    r, window, half = policy.reweight_h * H, policy.window_h * H, policy.half_life_h * H
    epoch = math.floor(now / r)
    boundary = epoch * r
    total = 0.0
    for i in range(epoch - 200, epoch):
        middle = (i + 0.5) * r
        if not (middle >= boundary - window or i == epoch - 1):
            continue
        lo, hi = i * r, (i + 1) * r
        gpu_s = sum(g * max(0.0, min(end, hi, boundary) - max(start, lo)) for start, end, g in jobs)
        total += gpu_s * 0.5 ** ((boundary - middle) / half)
    return total / H


@settings(max_examples=60, **SLOW)
@given(jobs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.sampled_from([0.25, 1, 3])),
                     min_size=1, max_size=8),
       probes=st.lists(st.integers(0, 60), max_size=6), window_h=st.sampled_from([0.25, 2, 6, 24]),
       reweight_h=st.sampled_from([0.5, 1, 3]), half_life_h=st.sampled_from([1, 6]), order=st.randoms())
def test_decayed_usage_is_the_documented_sum_whatever_the_order_events_are_recorded_in(
        jobs, probes, window_h, reweight_h, half_life_h, order) -> None:
    """Jobs start and stop on a quarter-hour grid, so many events share a moment; those are recorded in a
    random order, and the book is read at random moments in between. Its usage at every reading is the
    formula's, and so is every tenant's after all of it."""
    policy = FairSharePolicy(window_h=window_h, reweight_h=reweight_h, half_life_h=half_life_h)
    t0 = math.floor(1_785_420_000 / (3 * H)) * 3 * H  # a boundary of every reweight period drawn
    spans = [(t0 + a * H / 4, t0 + (a + d) * H / 4, g) for a, d, g in jobs]
    site = Site([quota("a", 0, 100), quota("b", 0, 100)], gpus=100, policy=policy, now=t0)
    site.book.state(t0)  # the book's first moment: its capacity is integrated from here
    events = [(start, 1, f"j{i}", g) for i, (start, _, g) in enumerate(spans)]
    events += [(end, 0, f"j{i}", g) for i, (_, end, g) in enumerate(spans)]
    events += [(t0 + p * H / 4, 2, "", 0) for p in probes]
    order.shuffle(events)
    events.sort(key=lambda e: e[0])  # stable: events at one moment stay shuffled (a stop may come first)
    tenant = {f"j{i}": "ab"[i % 2] for i in range(len(spans))}
    started: set[str] = set()
    for t, kind, job_id, g in events:
        site.now = t
        if kind == 1:
            site.run(ask(job_id, tenant[job_id], g))
            started.add(job_id)
        elif kind == 0 and job_id in started:
            site.finish(job_id)
        elif kind == 0:  # its stop came before its start at the same moment: a zero-length job, never run
            started.add(job_id)
            continue
        for who in "ab":
            mine = [s for i, s in enumerate(spans) if "ab"[i % 2] == who and s[1] > s[0]]
            got = {s.tenant: s.decayed_usage_gpu_h for s in site.book.state(t)}[who]
            assert got == pytest.approx(expected_usage_gpu_h(mine, t, policy), rel=1e-9, abs=1e-9)


# --- the division -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(capacity=st.sampled_from([0.0, 1.5, 8.0, 64.0]), k=st.sampled_from([0.0, 1.0, 3.0]), data=st.data(),
       by_weight=st.booleans())
def test_the_division_meets_guarantees_first_never_exceeds_a_limit_and_hands_out_what_is_left(
        capacity, k, data, by_weight) -> None:
    claims = data.draw(st.lists(st.builds(
        lambda g, burst, w, d, u: Claim(g, g + burst if burst is not None else math.inf, w, d, u),
        st.sampled_from([0.0, 1.0, 4.0]), st.one_of(st.none(), st.sampled_from([0.0, 2.0, 16.0])),
        st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.0, 0.5, 3.0, 20.0, 100.0]),
        st.floats(0, 1)), min_size=1, max_size=5))
    shares = divide(capacity, claims, k, by_weight=by_weight)
    wants = [min(c.demand_gpus, c.limit_gpus) for c in claims]
    first = [min(w, c.guaranteed_gpus) for w, c in zip(wants, claims, strict=True)]
    for s, w, f in zip(shares, wants, first, strict=True):
        assert f - EPS <= s <= w + 1e-6  # its guarantee part, at most what it wants and may hold
    if not by_weight:
        assert shares == pytest.approx(first)
    elif sum(first) <= capacity:  # work-conserving: all of the site, or all that is wanted
        assert sum(shares) == pytest.approx(min(capacity, sum(wants)), abs=1e-6)


# --- the broker's order across tenants --------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(standing=st.dictionaries(st.sampled_from("abcde"), st.tuples(
    st.sampled_from([0.0, 1.0, 4.0, 10.0]), st.sampled_from([0.0, 2.0, 8.0, 20.0]), st.booleans()), max_size=5),
    items=st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 2), st.sampled_from([0.5, 1.0, 4.0])),
                   min_size=1, max_size=25),
    placed=st.lists(st.booleans(), min_size=25, max_size=25))
def test_the_broker_serves_the_highest_priority_then_the_tenant_least_served_for_its_entitlement(
        standing, items, placed) -> None:
    """At every step the item served is of the highest priority waiting and, among the tenants waiting at that
    priority, its tenant is listed if any is and holds least per entitled GPU (counting what was placed);
    within a tenant, highest priority then key. A tenant over its entitlement never goes before one under it."""
    stand = {t: Standing(h, e, listed) for t, (h, e, listed) in standing.items()}
    jobs = [(t, p, g, i) for i, (t, p, g) in enumerate(items)]
    order = FairOrder(jobs, lambda j: j[0], lambda j: j[1], lambda j: j[3], stand)
    held = {t: s.held for t, s in stand.items()}
    waiting = list(jobs)

    def rank(t: str) -> tuple[bool, float]:
        s = stand.get(t)
        listed = s is not None and s.listed
        entitled = s.entitled if s is not None else 0.0
        return not listed, held.get(t, 0.0) / entitled if entitled > 0 else math.inf

    served = []
    for n, job in enumerate(order):
        top = max(p for _, p, _, _ in waiting)
        assert job[1] == top
        for other in waiting:
            if other[1] == top and other[0] != job[0]:
                assert rank(job[0]) <= rank(other[0])
        mine = [w for w in waiting if w[0] == job[0]]
        assert job == min(mine, key=lambda w: (-w[1], w[3]))
        waiting.remove(job)
        served.append(job)
        if placed[n]:
            order.placed(job[0], job[2])
            held[job[0]] = held.get(job[0], 0.0) + job[2]
    assert sorted(served) == sorted(jobs)


# --- the site's own queue order -----------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(site_quotas=sites(), running=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.5, 1, 2])), max_size=10),
       pending=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.5, 1, 2]), st.integers(0, 2)), min_size=1,
                        max_size=12), mode=st.sampled_from(["time", "instant"]))
def test_the_sites_queue_serves_first_a_tenant_within_its_guarantee_else_the_one_least_served_for_its_share(
        site_quotas, running, pending, mode) -> None:
    """``order`` is a permutation of what waits; within a tenant, priority then arrival; the first job is of a
    tenant within its guarantee if any such job waits, else of the tenant holding least per GPU of the fair
    share ``fair_shares`` reports for what each runs and waits for."""
    gpus, quotas = site_quotas
    site = Site(quotas, gpus, policy=FairSharePolicy(mode=mode))
    for n, (who, g) in enumerate(running):
        t = quotas[who % len(quotas)].tenant
        if site.free() >= g:
            site.run(ask(f"r{n}", t, g))
    site.advance(H)
    asks = [ask(f"p{n}", quotas[who % len(quotas)].tenant, g, priority=p) for n, (who, g, p) in enumerate(pending)]
    out = site.book.order(asks, site.now)
    assert sorted(a.job_id for a in out) == sorted(a.job_id for a in asks)
    for t in {a.tenant for a in asks}:
        mine = [a for a in out if a.tenant == t]
        assert mine == sorted(mine, key=lambda a: (-effective({q.tenant: q for q in quotas}, t, a.priority),
                                                   int(a.job_id[1:])))
    demand = {t: site.held(t) + sum(a.gpus for a in asks if a.tenant == t) for t in {a.tenant for a in asks}}
    shares = site.book.fair_shares(site.now, demand)
    by_name = {q.tenant: q for q in quotas}

    def rank(t: str) -> tuple[int, float]:
        nxt = next(a for a in out if a.tenant == t).gpus
        tier = 0 if site.held(t) + nxt <= by_name[t].guaranteed_gpus + EPS else 1
        return tier, site.held(t) / shares[t] if shares[t] > EPS else math.inf

    first = out[0].tenant
    for t in demand:
        assert rank(first) <= (rank(t)[0], rank(t)[1] + 1e-9)


# --- the site's whole admission: inventory and book together ------------------------------------------

_REQUESTS = st.sampled_from([
    {"count": 1}, {"count": 2}, {"count": 3}, {"count": 4, "topology": "node"}, {"milli": 500}, {"milli": 250},
    {"shared": True, "memory_gib": 20}, {"count": 1, "mig_profile": "1g.10gb", "model": "a100-80gb"},
    {"count": 2, "mig_profile": "3g.40gb", "model": "a100-80gb"}, {"count": 1, "model": "l4"},
])
_POOLS = {"t0": None, "t1": "a100-80gb", "t2": "l4"}


@settings(max_examples=150, **SLOW)
@given(guarantees=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 4)),
       steps=st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "finish", "set", "remove"]),
                                st.sampled_from(["t0", "t1", "t2", "guest"]), _REQUESTS, st.booleans(),
                                st.integers(0, 3), st.sampled_from([None, 0.0, 600.0]), st.integers(0, 40),
                                st.sampled_from([0, 60, 700, 3600])), max_size=50),
       mode=st.sampled_from(["time", "instant", "off"]), site_min_run=st.sampled_from([0.0, 300.0]))
def test_shares_slices_and_models_never_let_the_books_and_the_gpus_disagree(guarantees, steps, mode,
                                                                              site_min_run) -> None:
    """On a site of two models, one node group in MIG slices, with jobs of whole GPUs, shares and slices and
    quota changes between them: every GPU the book counts is one the inventory holds (no GPU double-booked,
    none lost), each tenant's report adds up to what it runs, a job admitted leaves its tenant within its
    limit, and every victim is preemptible, on the job's model and past its minimum run time."""
    from broker.models import GpuRequest, JobSpec, NodeGroup, SiteSpec
    from policies.admission import Admitted, SiteAdmission

    quotas = {t: quota(t, g, 8, model=_POOLS[t]) for t, g in zip(_POOLS, guarantees, strict=True)}
    spec = SiteSpec(name="s", region="onprem:s", grid_zone="DE-LU", timezone="UTC", latitude=0, longitude=0,
                    gpus=[NodeGroup(model="a100-80gb", gpus_per_node=4, nodes=2),
                          NodeGroup(model="a100-80gb", gpus_per_node=2, nodes=1, mig_profiles=["1g.10gb", "3g.40gb"]),
                          NodeGroup(model="l4", gpus_per_node=4, nodes=1)],
                    quotas=list(quotas.values()), fair_share=FairSharePolicy(mode=mode, min_run_s=site_min_run))
    site = SiteAdmission(spec)
    now = 1_785_420_000.0
    running: dict[str, tuple[JobSpec, Ask, float]] = {}
    for n, (kind, tenant, req, preemptible, priority, min_run, pick, dt) in enumerate(steps):
        now += dt
        if kind == "submit":
            job = JobSpec(tenant=tenant, name=f"j{n}", gpus=GpuRequest(**req), duration_s=3600,
                          preemptible=preemptible, priority=priority, min_run_s=min_run)
            d = site.admit(f"j{n}", job, now)
            if isinstance(d, Admitted):
                reclaim = d.reason is not None and d.reason.startswith("reclaims")
                for victim in d.victims:
                    was, was_ask, started = running.pop(victim)
                    spared = was.min_run_s if was.min_run_s is not None else site_min_run
                    assert was.preemptible and was_ask.model == d.ask.model
                    assert now - started >= (min(spared, site_min_run) if reclaim else spared) - EPS
                    assert site.stop(victim, now) is not None
                site.start(f"j{n}", d, now)
                running[f"j{n}"] = (job, d.ask, now)
                q = quotas.get(tenant)
                if q is not None and q.model in (None, d.ask.model):
                    held = sum(a.gpus for _, a, _ in running.values()
                               if a.tenant == tenant and q.model in (None, a.model))
                    assert held <= q.guaranteed_gpus + q.burst_gpus + EPS
        elif kind == "finish" and running:
            assert site.stop(sorted(running)[pick % len(running)], now) is not None
            del running[sorted(running)[pick % len(running)]]
        elif kind == "set" and tenant != "guest":
            q = quota(tenant, pick % 7, priority * 2, model=_POOLS[tenant] if pick % 2 else None)
            try:
                site.book.check(q)
            except ValueError:
                continue
            site.set_quota(q, now)
            quotas[tenant] = q
        elif kind == "remove" and site.book.has_quota(tenant):
            site.remove_quota(tenant, now)
            del quotas[tenant]
        per_model: dict[str, float] = {}
        for _, a, _ in running.values():
            per_model[a.model] = per_model.get(a.model, 0.0) + a.gpus
        for model, use in site.inventory.usage().items():
            assert use.busy <= use.gpus + EPS
            assert use.busy == pytest.approx(per_model.get(model, 0.0), abs=1e-6)
        held_by: dict[str, float] = {}
        for s in site.book.state(now):
            held_by[s.tenant] = held_by.get(s.tenant, 0.0) + s.in_use_gpus
        for t in ("t0", "t1", "t2", "guest"):
            assert held_by.get(t, 0.0) == pytest.approx(sum(a.gpus for _, a, _ in running.values() if a.tenant == t),
                                                        abs=1e-6)
