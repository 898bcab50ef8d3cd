"""The offline bound: hand-checked optima, the errors a caller can make, and — on random small federations —
that it never exceeds the carbon or cost of a schedule that respects capacity and windows, and that it
equals the naive job × site × hour LP exactly when nothing is coarsened."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy import sparse
from scipy.optimize import linprog

from broker.simulation.bound import BoundError, BoundInfeasible, BoundResult, offline_bound
from broker.simulation.results import SiteFacts

H = 3600.0



def approx(expected, rel=1e-5, abs=1e-6):  # noqa: A002 - pytest's names
    """Equality up to the solver's tolerance and the bound's safety margin (bound.SOLVER_MARGIN)."""
    return pytest.approx(expected, rel=rel, abs=abs)

def facts(intensity, capacity, power=None, price=None) -> SiteFacts:
    intensity = np.atleast_2d(np.asarray(intensity, dtype=np.float64))
    n = intensity.shape[0]
    return SiteFacts(
        names=tuple(f"s{i}" for i in range(n)), zones=tuple(f"Z{i}" for i in range(n)),
        regions=tuple(f"gcp:r{i}" for i in range(n)),
        capacity_gpus=np.asarray(capacity, dtype=np.int64),
        usd_per_gpu_hour=np.asarray(price if price is not None else [1.0] * n, dtype=np.float64),
        power_kw_per_gpu=np.asarray(power if power is not None else [1.0] * n, dtype=np.float64),
        intensity=intensity,
    )


def bound(sites, release, end, work, **kw) -> BoundResult:
    return offline_bound(sites, np.asarray(release, float), np.asarray(end, float), np.asarray(work, float), **kw)


# ---------------------------------------------------------------------------------------------------------
# Hand-checked optima
# ---------------------------------------------------------------------------------------------------------


def test_one_job_takes_the_cleaner_hour():
    sites = facts([[100.0, 300.0]], [1], power=[0.5], price=[2.0])
    r = bound(sites, [0.0], [2 * H], [1.0])
    assert r.carbon_kg == approx(1.0 * 0.5 * 100 / 1000)  # 0.05 kg
    assert r.cost_usd == approx(2.0)
    assert r.energy_kwh == approx(0.5)
    assert (r.jobs, r.gpu_hours, r.relaxation) == (1, 1.0, "none")


def test_two_jobs_on_one_gpu_must_use_both_hours():
    sites = facts([[100.0, 300.0]], [1], power=[0.5], price=[2.0])
    r = bound(sites, [0.0, 0.0], [2 * H, 2 * H], [1.0, 1.0])
    assert r.carbon_kg == approx(0.5 * (100 + 300) / 1000)  # 0.2 kg
    assert r.cost_usd == approx(4.0)
    assert r.energy_kwh == approx(1.0)


def test_a_tight_window_spills_to_the_dirtier_site_and_a_wide_one_does_not():
    # Site 0 is clean but holds 1 GPU; site 1 is dirty and holds 2. Power 1 kW per GPU.
    sites = facts([[100.0, 100.0, 100.0], [500.0, 500.0, 500.0]], [1, 2], price=[3.0, 1.0])
    tight = bound(sites, [0.0], [H], [3.0])  # 3 GPU-hours inside hour 0: 1 clean, 2 dirty
    assert tight.carbon_kg == approx((1 * 100 + 2 * 500) / 1000)
    assert tight.cost_usd == approx(2 * 1.0 + 1 * 3.0)  # the cheap site is full, one GPU-hour costs 3
    wide = bound(sites, [0.0], [3 * H], [3.0])  # three hours: all of it on the clean site
    assert wide.carbon_kg == approx(3 * 100 / 1000)
    assert wide.cost_usd == approx(3 * 1.0)


def test_carbon_uses_each_sites_power_and_energy_the_lowest_power():
    sites = facts([[200.0], [200.0]], [1, 1], power=[0.4, 0.8])
    r = bound(sites, [0.0], [H], [2.0])  # both sites are needed for one hour
    assert r.carbon_kg == approx((0.4 + 0.8) * 200 / 1000)
    assert r.energy_kwh == approx(2.0 * 0.4)  # a lower bound, not the LP's energy (1.2 kWh)


def test_a_site_without_gpus_is_never_used_nor_sets_the_energy():
    sites = facts([[1.0], [900.0]], [0, 1], power=[0.1, 0.5])
    r = bound(sites, [0.0], [H], [1.0])
    assert r.carbon_kg == approx(0.5 * 900 / 1000)
    assert r.energy_kwh == approx(0.5)


def test_window_is_rounded_outward_to_whole_hours():
    # [1800 s, 5400 s) touches hours 0 and 1, so the job may use either, and never hour 2 (the cleanest).
    sites = facts([[100.0, 300.0, 10.0]], [1], power=[0.5])
    r = bound(sites, [1800.0], [5400.0], [2.0])
    assert r.carbon_kg == approx(0.5 * (100 + 300) / 1000)
    one = bound(sites, [1800.0], [5400.0], [1.0])
    assert one.carbon_kg == approx(0.5 * 100 / 1000)
    # A window ending exactly on an hour boundary does not reach the next hour.
    assert bound(sites, [0.0], [2 * H], [2.0]).carbon_kg == approx(0.5 * 400 / 1000)
    # A window ending a second after it does.
    assert bound(sites, [3600.0], [2 * H + 1], [1.0]).carbon_kg == approx(0.5 * 10 / 1000)


def test_no_work_gives_zero_and_solves_nothing():
    sites = facts([[100.0, 300.0]], [1])
    r = bound(sites, [0.0, 10.0], [H, 2 * H], [0.0, 0.0])
    assert (r.carbon_kg, r.cost_usd, r.energy_kwh, r.jobs, r.gpu_hours, r.variables) == (0, 0, 0, 2, 0, 0)
    assert bound(sites, [], [], []).jobs == 0


def test_jobs_with_no_work_are_counted_but_cost_nothing():
    sites = facts([[100.0, 300.0]], [1])
    r = bound(sites, [0.0, 0.0], [H, 2 * H], [1.0, 0.0])
    assert r.jobs == 2 and r.gpu_hours == 1.0
    assert r.carbon_kg == approx(0.1)
    # A job of zero duration (submit = deadline = end) needs no window.
    assert bound(sites, [0.0, 600.0], [H, 600.0], [1.0, 0.0]).carbon_kg == approx(0.1)


def test_as_dict_is_json_ready():
    sites = facts([[100.0, 300.0]], [1], power=[0.5], price=[2.0])
    d = bound(sites, [0.0], [2 * H], [1.0]).as_dict()
    back = json.loads(json.dumps(d))
    assert back["carbon_kg"] == approx(0.05) and back["relaxation"] == "none"
    assert set(back) == {"carbon_kg", "cost_usd", "energy_kwh", "jobs", "gpu_hours", "variables",
                         "constraints", "solve_s", "relaxation"}
    assert all(type(v) in (int, float, str) for v in d.values())


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def test_too_much_work_for_the_capacity_is_an_error_naming_the_hours():
    sites = facts([[100.0, 300.0, 200.0]], [1])
    with pytest.raises(BoundError, match=r"hours 0\.\.0 .* need 2 GPU-hours.* 1 GPUs × 1 h = 1 GPU-hours"):
        bound(sites, [0.0, 0.0], [H, H], [1.0, 1.0])
    # Three GPU-hours due by the end of hour 1 on one GPU: the interval named is hours 0..1.
    with pytest.raises(BoundError, match=r"hours 0\.\.1 .* need 3 GPU-hours"):
        bound(sites, [0.0, 0.0, 0.0], [2 * H, 2 * H, 3 * H], [1.5, 1.5, 0.5])
    # A federation with no GPUs at all serves nothing.
    with pytest.raises(BoundError, match="infeasible"):
        bound(facts([[100.0]], [0]), [0.0], [H], [0.5])


def test_the_same_work_fits_when_its_window_is_long_enough():
    sites = facts([[100.0, 300.0, 200.0]], [1])
    r = bound(sites, [0.0, 0.0, 0.0], [2 * H, 2 * H, 3 * H], [1.0, 1.0, 1.0])
    assert r.carbon_kg == approx((100 + 300 + 200) / 1000)


def test_a_window_past_the_data_names_the_job_and_the_hour():
    sites = facts([[100.0, 300.0]], [4])
    with pytest.raises(BoundError, match=r"job 1's window ends at end_s=7201\.0, in hour 2, past .* hours 0\.\.1"):
        bound(sites, [0.0, 0.0, 0.0], [2 * H, 7201.0, H], [1.0, 1.0, 1.0])
    with pytest.raises(BoundError, match=r"job 0's window starts at release_s=-1\.0, in hour -1, before hour 0"):
        bound(sites, [-1.0], [H], [1.0])


@pytest.mark.parametrize(
    ("release", "end", "work", "message"),
    [
        ([0.0, 0.0], [H], [1.0], "one value per job"),
        ([[0.0]], [[H]], [[1.0]], "one-dimensional"),
        ([0.0], [H], [-1.0], "job 0: gpu_hours is negative"),
        ([0.0, H], [H, H], [1.0, 1.0], "job 1: end_s is not after release_s"),
        ([0.0], [math.nan], [1.0], "end_s of job 0 is nan"),
        ([0.0], [H], ["x"], "gpu_hours must be an array of numbers"),
    ],
)
def test_bad_jobs_are_errors_saying_what(release, end, work, message):
    with pytest.raises(BoundError, match=message):
        offline_bound(facts([[100.0, 300.0]], [1]), release, end, work)


def test_bad_sites_are_errors_saying_what():
    good = facts([[100.0, 300.0], [50.0, 60.0]], [1, 1])
    with pytest.raises(BoundError, match=r"sites\.intensity must be \[sites, hours\] = \[2, hours\]"):
        offline_bound(SiteFacts(**{**good.__dict__, "intensity": np.array([[100.0, 300.0]])}), [0.0], [H], [1.0])
    for name, value in (("capacity_gpus", np.array([1])), ("power_kw_per_gpu", np.array([1.0, -2.0]))):
        bad = SiteFacts(**{**good.__dict__, name: value})
        with pytest.raises(BoundError, match=f"sites.{name}"):
            offline_bound(bad, [0.0], [H], [1.0])
    nan = SiteFacts(**{**good.__dict__, "intensity": np.array([[100.0, 300.0], [50.0, math.nan]])})
    with pytest.raises(BoundError, match=r"site 1 \(s1\) in hour 1"):
        offline_bound(nan, [0.0], [H], [1.0])
    with pytest.raises(BoundError, match="max_variables"):
        offline_bound(good, [0.0], [H], [1.0], max_variables=0)


# ---------------------------------------------------------------------------------------------------------
# Coarsening
# ---------------------------------------------------------------------------------------------------------


def _long_windows(n_hours: int = 96) -> tuple[SiteFacts, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    intensity = rng.uniform(50, 800, size=(3, n_hours))
    sites = facts(intensity, [4, 2, 3], power=[0.3, 0.4, 0.5], price=[2.0, 3.0, 1.5])
    release = rng.uniform(0, (n_hours // 2) * H, 60)
    length = rng.uniform(1, n_hours // 2, 60) * H
    return sites, release, release + length, rng.uniform(0.1, 6.0, 60)


def test_coarsening_when_the_exact_lp_is_too_large_stays_below_the_exact_bound():
    sites, release, end, work = _long_windows()
    exact = offline_bound(sites, release, end, work)
    assert exact.relaxation == "none"
    coarse = offline_bound(sites, release, end, work, max_variables=exact.variables - 1)
    assert coarse.relaxation.startswith("coarsened") and "widened outward" in coarse.relaxation
    assert coarse.variables < exact.variables
    assert coarse.carbon_kg <= exact.carbon_kg * (1 + 1e-9)
    assert coarse.cost_usd <= exact.cost_usd * (1 + 1e-9)
    assert coarse.carbon_kg > 0 and coarse.gpu_hours == exact.gpu_hours


def test_no_grid_small_enough_is_an_error_asking_for_more_variables():
    sites, release, end, work = _long_windows()
    with pytest.raises(BoundError, match="raise max_variables"):
        offline_bound(sites, release, end, work, max_variables=10)


# ---------------------------------------------------------------------------------------------------------
# Properties on random small federations
# ---------------------------------------------------------------------------------------------------------


def naive_lp(sites: SiteFacts, release, end, work, allowed=None) -> tuple[float, float]:
    """The definition itself: x[job, site, hour] over each job's outward-rounded hours (at the sites it is
    allowed, all by default)."""
    first = np.floor(np.asarray(release) / H).astype(int)
    last = np.ceil(np.asarray(end) / H).astype(int) - 1
    n_sites, n_hours = sites.intensity.shape
    cols = [(j, s, t) for j in range(len(work)) for s in range(n_sites) for t in range(first[j], last[j] + 1)
            if allowed is None or allowed[j][s]]
    n = len(cols)
    job_rows = sparse.coo_matrix((np.ones(n), ([c[0] for c in cols], range(n))), shape=(len(work), n))
    cap_rows = sparse.coo_matrix((np.ones(n), ([c[1] * n_hours + c[2] for c in cols], range(n))),
                                 shape=(n_sites * n_hours, n))
    b_ub = np.repeat(sites.capacity_gpus.astype(float), n_hours)
    out = []
    for per in (sites.power_kw_per_gpu[:, None] * sites.intensity / 1000,
                np.broadcast_to(sites.usd_per_gpu_hour[:, None], sites.intensity.shape)):
        c = np.array([per[s, t] for _, s, t in cols])
        res = linprog(c, A_ub=cap_rows, b_ub=b_ub, A_eq=job_rows, b_eq=np.asarray(work, float), method="highs-ds")
        assert res.status == 0, res.message
        out.append(res.fun)
    return out[0], out[1]


def greedy_hourly(sites: SiteFacts, release, work) -> tuple[np.ndarray, np.ndarray] | None:
    """Each job in submit order, as early as possible, into whatever GPU-hours are left in each hour (sites in
    order). Returns the GPU-hours per (site, hour) and each job's last hour, or None past the data."""
    free = np.repeat(sites.capacity_gpus[:, None].astype(float), sites.hours, axis=1)
    used = np.zeros_like(free)
    last = np.zeros(len(work), dtype=int)
    for j in np.argsort(release, kind="stable"):
        left, t = float(work[j]), int(release[j] // H)
        while left > 1e-12:
            if t >= sites.hours:
                return None
            for s in range(sites.n_sites):
                take = min(left, free[s, t])
                free[s, t] -= take
                used[s, t] += take
                left -= take
            last[j] = t
            t += 1
    return used, last


def continuous_schedule(sites: SiteFacts, release, gpus, duration_s, allowed=None):
    """A schedule a real policy could make: each job whole at one site from its start to its end, never more
    GPUs than the site holds at any instant; jobs in submit order, each at the earliest start it can get (at
    a site it is allowed, all by default)."""
    placed: list[list[tuple[float, float, int]]] = [[] for _ in range(sites.n_sites)]
    site = np.zeros(len(gpus), dtype=int)
    start = np.zeros(len(gpus))
    for j in np.argsort(release, kind="stable"):
        best = None
        for s in range(sites.n_sites):
            if gpus[j] > sites.capacity_gpus[s] or (allowed is not None and not allowed[j][s]):
                continue
            for t0 in sorted({release[j], *(e for _, e, _ in placed[s] if e > release[j])}):
                t1 = t0 + duration_s[j]
                points = [t0, *(b for b, _, _ in placed[s] if t0 < b < t1)]
                if all(sum(g for b, e, g in placed[s] if b <= p < e) + gpus[j] <= sites.capacity_gpus[s]
                       for p in points):
                    if best is None or t0 < best[0]:
                        best = (t0, s)
                    break
        assert best is not None
        start[j], site[j] = best
        placed[best[1]].append((best[0], best[0] + duration_s[j], int(gpus[j])))
    return site, start


def schedule_carbon_cost(sites: SiteFacts, site, start, end, gpus) -> tuple[float, float]:
    carbon = cost = 0.0
    for s, b, e, g in zip(site, start, end, gpus, strict=True):
        for h in range(int(b // H), int(math.ceil(e / H))):
            overlap_h = (min(e, (h + 1) * H) - max(b, h * H)) / H
            carbon += g * overlap_h * sites.power_kw_per_gpu[s] * sites.intensity[s, h] / 1000
            cost += g * overlap_h * sites.usd_per_gpu_hour[s]
    return carbon, cost


def test_equals_the_naive_lp_on_a_hundred_jobs_with_windows_up_to_two_days():
    # Long windows exercise every level of the block tree (windows of up to 48 hours over 100 hours).
    rng = np.random.default_rng(11)
    n_hours, n_jobs = 100, 120
    sites = facts(rng.uniform(20, 900, size=(3, n_hours)), [3, 2, 4], power=[0.3, 0.7, 0.5], price=[2.5, 1.0, 4.0])
    release = rng.uniform(0, 52 * H, n_jobs)
    end = release + rng.uniform(0.05, 48, n_jobs) * H
    work = rng.uniform(0.1, 5.0, n_jobs)
    r = offline_bound(sites, release, end, work)
    naive_carbon, naive_cost = naive_lp(sites, release, end, work)
    assert r.relaxation == "none"
    # Equal up to the bound's margin: 1e-6 of the optimum plus 1e-6 of the largest possible objective.
    carbon_scale = float((sites.power_kw_per_gpu[:, None] * sites.intensity).max()) / 1000 * float(work.sum())
    cost_scale = float(sites.usd_per_gpu_hour.max()) * float(work.sum())
    assert r.carbon_kg == approx(naive_carbon, rel=1e-5, abs=3e-6 * carbon_scale)
    assert r.cost_usd == approx(naive_cost, rel=1e-5, abs=3e-6 * cost_scale)
    assert r.carbon_kg <= naive_carbon
    assert r.variables < 120 * 3 * 25  # far fewer than the naive LP's job × site × hour variables


@st.composite
def federations(draw, max_hours: int = 8):
    n_sites = draw(st.integers(1, 3))
    n_hours = draw(st.integers(2, max_hours))
    capacity = draw(st.lists(st.integers(0, 4), min_size=n_sites, max_size=n_sites).filter(any))
    intensity = draw(st.lists(st.lists(st.floats(0, 900, allow_nan=False), min_size=n_hours, max_size=n_hours),
                              min_size=n_sites, max_size=n_sites))
    power = draw(st.lists(st.floats(0.1, 1.0), min_size=n_sites, max_size=n_sites))
    price = draw(st.lists(st.floats(0.5, 5.0), min_size=n_sites, max_size=n_sites))
    return facts(intensity, capacity, power, price)


def below(bound_value: float, schedule_value: float) -> bool:
    """At or below, up to the LP solver's tolerance (a few parts in 10 million)."""
    return bound_value <= schedule_value * (1 + 1e-6) + 1e-9


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(sites=federations(), data=st.data())
def test_bound_never_exceeds_an_hourly_greedy_schedule_and_equals_the_naive_lp(sites, data):
    n_jobs = data.draw(st.integers(1, 6))
    release = np.array(data.draw(st.lists(st.floats(0, (sites.hours - 1) * H - 1), min_size=n_jobs,
                                          max_size=n_jobs)))
    work = np.array(data.draw(st.lists(st.floats(0.01, 4.0), min_size=n_jobs, max_size=n_jobs)))
    greedy = greedy_hourly(sites, release, work)
    assume(greedy is not None)
    used, last = greedy
    # Each job's window ends in the greedy schedule's last hour, or up to 3 hours later, anywhere in that hour.
    extra = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n_jobs, max_size=n_jobs)))
    before = np.array(data.draw(st.lists(st.floats(0, H - 1), min_size=n_jobs, max_size=n_jobs)))
    end = np.maximum((np.minimum(last + extra, sites.hours - 1) + 1) * H - before, release + 1)
    r = offline_bound(sites, release, end, work)
    assert r.relaxation == "none"
    carbon = float((used * sites.power_kw_per_gpu[:, None] * sites.intensity / 1000).sum())
    cost = float((used * sites.usd_per_gpu_hour[:, None]).sum())
    assert below(r.carbon_kg, carbon)
    assert below(r.cost_usd, cost)
    naive_carbon, naive_cost = naive_lp(sites, release, end, work)
    # Equal up to the solver's tolerance and the bound's margin, both relative to the largest objective.
    carbon_scale = float((sites.power_kw_per_gpu[:, None] * sites.intensity).max()) / 1000 * float(work.sum())
    cost_scale = float(sites.usd_per_gpu_hour.max()) * float(work.sum())
    assert r.carbon_kg == approx(naive_carbon, rel=1e-5, abs=3e-6 * carbon_scale + 1e-12)
    assert r.cost_usd == approx(naive_cost, rel=1e-5, abs=3e-6 * cost_scale + 1e-12)
    assert r.energy_kwh <= float((used * sites.power_kw_per_gpu[:, None]).sum()) * (1 + 1e-9)


def whole_jobs(sites: SiteFacts, data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1 to 6 jobs released in the first three hours: release times, GPUs (up to the largest site) and run
    times (a minute to two hours)."""
    n_jobs = data.draw(st.integers(1, 6))
    cap_max = int(sites.capacity_gpus.max())
    release = np.array(data.draw(st.lists(st.floats(0, 3 * H), min_size=n_jobs, max_size=n_jobs)))
    gpus = np.array(data.draw(st.lists(st.integers(1, cap_max), min_size=n_jobs, max_size=n_jobs)))
    duration = np.array(data.draw(st.lists(st.floats(60, 2 * H), min_size=n_jobs, max_size=n_jobs)))
    return release, gpus, duration


@settings(max_examples=60, deadline=None)
@given(sites=federations(max_hours=12), data=st.data())
def test_bound_never_exceeds_a_whole_job_schedule_in_continuous_time(sites, data):
    release, gpus, duration = whole_jobs(sites, data)
    n_jobs = len(gpus)
    site, start = continuous_schedule(sites, release, gpus, duration)
    finish = start + duration
    assume(finish.max() <= sites.hours * H)
    slack = np.array(data.draw(st.lists(st.floats(0, 2 * H), min_size=n_jobs, max_size=n_jobs)))
    end = np.minimum(finish + slack, sites.hours * H)
    r = offline_bound(sites, release, end, gpus * duration / H)
    carbon, cost = schedule_carbon_cost(sites, site, start, finish, gpus)
    assert below(r.carbon_kg, carbon)
    assert below(r.cost_usd, cost)
    # Coarsened, the bound is lower still (or no grid fits the limit, which is said).
    assume(r.variables > 1)
    try:
        coarse = offline_bound(sites, release, end, gpus * duration / H, max_variables=r.variables - 1)
    except BoundError as err:
        assert "raise max_variables" in str(err)
    else:
        assert coarse.relaxation != "none"
        # Two solves, each within the solver's tolerance of its optimum: compare at that tolerance.
        carbon_scale = float((sites.power_kw_per_gpu[:, None] * sites.intensity).max()) / 1000 * r.gpu_hours
        cost_scale = float(sites.usd_per_gpu_hour.max()) * r.gpu_hours
        assert coarse.carbon_kg <= r.carbon_kg + 2e-6 * carbon_scale + 1e-12
        assert coarse.cost_usd <= r.cost_usd + 2e-6 * cost_scale + 1e-12


# ---------------------------------------------------------------------------------------------------------
# Jobs tied to some sites (latency objectives)
# ---------------------------------------------------------------------------------------------------------


def test_a_job_tied_to_the_dirty_site_pays_for_it_and_leaves_the_clean_one_to_others():
    # Site 0 is clean and holds 1 GPU; site 1 is dirty and holds 2. Power 1 kW per GPU.
    sites = facts([[100.0, 100.0, 100.0], [500.0, 500.0, 500.0]], [1, 2], price=[3.0, 1.0])
    free = bound(sites, [0.0], [3 * H], [3.0])
    assert free.carbon_kg == approx(0.3)
    tied = bound(sites, [0.0], [3 * H], [3.0], allowed_sites=np.array([[False, True]]))
    assert tied.carbon_kg == approx(1.5) and tied.cost_usd == approx(3.0)
    # One job may use only the clean site: it fills two of its three GPU-hours, the other job spills.
    both = bound(sites, [0.0, 0.0], [3 * H, 3 * H], [3.0, 2.0], allowed_sites=np.array([[True, True], [True, False]]))
    assert both.carbon_kg == approx((3 * 100 + 2 * 500) / 1000)
    # Every job allowed everywhere is the unrestricted LP, the same model.
    everywhere = bound(sites, [0.0], [3 * H], [3.0], allowed_sites=np.array([[True, True]]))
    assert everywhere.carbon_kg == approx(free.carbon_kg) and everywhere.variables == free.variables


def test_tied_jobs_that_cannot_fit_their_sites_are_infeasible_naming_them():
    sites = facts([[100.0, 300.0], [500.0, 500.0]], [1, 4])
    with pytest.raises(BoundInfeasible, match=r"the jobs that may use only s0 and whose windows lie within hours 0\.\.0"):
        bound(sites, [0.0, 0.0], [H, H], [1.0, 1.0], allowed_sites=np.array([[True, False], [True, False]]))
    with pytest.raises(BoundInfeasible, match="job 1 may use no site with GPUs"):
        bound(facts([[100.0], [200.0]], [1, 0]), [0.0, 0.0], [H, H], [0.5, 0.5],
              allowed_sites=np.array([[True, False], [False, True]]))
    # Each group fits alone, but not together: the LP says so.
    three = facts([[100.0], [200.0], [300.0]], [1, 1, 1])
    allowed = np.array([[True, True, False], [True, True, False], [True, True, False], [True, False, False]])
    with pytest.raises(BoundInfeasible):
        bound(three, [0.0] * 4, [H] * 4, [0.9, 0.9, 0.2, 0.5], allowed_sites=allowed)
    with pytest.raises(BoundError, match=r"allowed_sites must be a bool array of \[jobs, sites\] = \[1, 2\]"):
        bound(sites, [0.0], [H], [1.0], allowed_sites=np.array([[1, 0]]))


@settings(max_examples=60, deadline=None)
@given(sites=federations(max_hours=10), data=st.data())
def test_with_allowed_sites_the_bound_is_the_naive_lp_and_below_a_whole_job_schedule(sites, data):
    release, gpus, duration = whole_jobs(sites, data)
    n_jobs = len(gpus)
    roomy = sites.capacity_gpus[None, :] >= gpus[:, None]  # each job keeps at least one site it fits
    draws = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=sites.n_sites, max_size=sites.n_sites),
                                        min_size=n_jobs, max_size=n_jobs)))
    allowed = draws & roomy
    allowed[~allowed.any(axis=1), :] = roomy[~allowed.any(axis=1), :]
    site, start = continuous_schedule(sites, release, gpus, duration, allowed)
    finish = start + duration
    assume(finish.max() <= sites.hours * H)
    end = np.minimum(finish + np.array(data.draw(st.lists(st.floats(0, 2 * H), min_size=n_jobs, max_size=n_jobs))),
                     sites.hours * H)
    work = gpus * duration / H
    r = offline_bound(sites, release, end, work, allowed_sites=allowed)
    carbon, cost = schedule_carbon_cost(sites, site, start, finish, gpus)
    assert below(r.carbon_kg, carbon)
    assert below(r.cost_usd, cost)
    naive_carbon, naive_cost = naive_lp(sites, release, end, work, allowed)
    carbon_scale = float((sites.power_kw_per_gpu[:, None] * sites.intensity).max()) / 1000 * float(work.sum())
    cost_scale = float(sites.usd_per_gpu_hour.max()) * float(work.sum())
    assert r.carbon_kg == approx(naive_carbon, rel=1e-5, abs=3e-6 * carbon_scale + 1e-12)
    assert r.cost_usd == approx(naive_cost, rel=1e-5, abs=3e-6 * cost_scale + 1e-12)
    # Tying jobs to sites only takes choices away: never below the bound without it.
    free = offline_bound(sites, release, end, work)
    assert free.carbon_kg <= r.carbon_kg + 2e-6 * carbon_scale + 1e-12


def test_shadow_prices_value_the_capacity_that_binds() -> None:
    """Two jobs of one GPU-hour in hour 0 on a clean site (10 g/kWh) and a dirty one (100), one GPU each, 1 kW:
    one job must run dirty, so one more clean GPU in hour 0 would save 0.09 kg; hour 1 (outside every window)
    and the dirty site's GPU (never full) are worth nothing."""
    sites = facts([[10.0, 10.0], [100.0, 100.0]], capacity=[1, 1])
    result = bound(sites, [0.0, 0.0], [H, H], [1.0, 1.0], shadow_prices=True)
    assert result.carbon_kg == approx(0.11)
    prices = result.shadow_kg_per_gpu_hour
    assert prices is not None and prices.shape == (2, 2)
    assert prices[0, 0] == approx(0.09)
    assert prices[1, 0] == approx(0.0) and prices[:, 1] == approx([0.0, 0.0])
    assert "shadow_kg_per_gpu_hour" not in result.as_dict()
    assert bound(sites, [0.0, 0.0], [H, H], [1.0, 1.0]).shadow_kg_per_gpu_hour is None


def test_shadow_prices_with_groups_that_share_a_site() -> None:
    """A job tied to the clean site and one free to go anywhere, both one GPU-hour in hour 0, on one GPU
    each: the tied job takes the clean GPU, the free one runs dirty; the clean site's price is the same."""
    sites = facts([[10.0], [100.0]], capacity=[1, 1])
    allowed = np.array([[True, False], [True, True]])
    result = bound(sites, [0.0, 0.0], [H, H], [1.0, 1.0], allowed_sites=allowed, shadow_prices=True)
    assert result.carbon_kg == approx(0.11)
    assert result.shadow_kg_per_gpu_hour[:, 0] == approx([0.09, 0.0])


def test_shadow_price_of_a_site_hour_held_by_a_bound_and_a_shared_row() -> None:
    """Site a (10 then 100 g/kWh, one GPU) and b (50, one GPU); two GPU-hours tied to a over hours 0-1 and one
    that may go anywhere in hour 0. The tied work fills a in both hours and the free hour runs at b: 0.16 kg.
    One more GPU at a in hour 0 lets the tied work take it instead of hour 1: 0.07 kg, a price of 0.09. Its
    capacity is held both by the tied group's own upper bound and by the row both groups share, and the
    solver may split the dual between the two: the price is their sum."""
    sites = facts([[10.0, 100.0], [50.0, 50.0]], capacity=[1, 1])
    allowed = np.array([[True, False], [True, True]])
    result = bound(sites, [0.0, 0.0], [2 * H, H], [2.0, 1.0], allowed_sites=allowed, shadow_prices=True)
    assert result.carbon_kg == approx(0.16)
    more = facts([[10.0, 100.0], [50.0, 50.0]], capacity=[2, 1])
    assert bound(more, [0.0, 0.0], [2 * H, H], [2.0, 1.0], allowed_sites=allowed).carbon_kg == approx(0.07)
    assert result.shadow_kg_per_gpu_hour[0, 0] == approx(0.09)
