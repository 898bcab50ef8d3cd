"""The whole-job bound: the least carbon any schedule can have that runs each job whole, at one site, in one
stretch, knowing the future perfectly. A lower bound, tighter than the fluid offline bound.

Why another bound
    The offline bound (:mod:`broker.simulation.bound`) lets a job's GPU-hours be split over any hours and
    sites of its window, with no limit from its GPU count: a job of one GPU for 500 hours may take its work
    in the 50 cleanest hours of the month at 10 GPUs. No schedule that runs jobs whole can do that, so
    the fluid bound sits far below every such schedule (on the Philly trace at 30 % utilisation, 59.3 t
    where the whole-job oracle, which knows the future, packs 69.9 t). This bound keeps each job whole and
    relaxes the sites' capacity, through a price on it (and, as the fluid bound does, counts capacity per
    hour rather than at every instant, pools a site's GPU models at the lowest power among them, and treats
    checkpointable jobs as divisible work).

What it computes (Lagrangian relaxation of capacity)
    A job ``j`` holds ``gpus[j]`` GPUs for ``duration_s[j]`` at one site ``s`` it may use
    (``allowed_sites``), from a start ``t`` with ``release_s[j] <= t <= latest[j]``, where
    ``latest[j] = max(release_s[j], end_s[j] - duration_s[j])``. Its carbon is
    ``gpus × power_kw_per_gpu[s] × ∫ intensity[s] dt / 1000`` over the run (kg; hourly intensities, partial
    hours pro rata, as the replay counts them). Site ``s`` holds ``capacity_gpus[s]`` GPUs, so in each hour
    ``h`` the GPU-hours its jobs hold there add up to at most ``capacity_gpus[s]``. For prices
    ``λ[s, h] >= 0`` (kg CO2e per GPU-hour), let each job take, on its own, the site and start that
    minimise its carbon plus the price of the GPU-hours it holds, with no capacity limit; then

        ``L(λ) = Σ_j (that least value) - Σ_{s, h} λ[s, h] × capacity_gpus[s]``

    is at most the carbon of every schedule that keeps each site within its GPUs at every instant: for such
    a schedule the prices of what it holds come to at most ``Σ λ × capacity``, and no job's own least
    value is above what the schedule pays for it. So ``L(λ)`` is a lower bound **for every λ >= 0**; the
    search below only looks for a high one, and stopping it early loses tightness, never validity.

    A job's least value is found exactly. Over a start ``t``, the value of the run ``[t, t + d)`` is
    piecewise linear, with breaks where ``t`` or ``t + d`` is on an hour boundary, so its least value on
    ``[release, latest]`` is at one of those breaks or at an end: each site is tried at every such point
    (about two per hour of slack).

    Jobs marked ``splittable`` (checkpointable work, which a policy may stop and move) are bounded as the
    fluid bound bounds every job: their GPU-hours at the cheapest priced site-hour of their window, rounded
    outward to whole hours. A schedule that moves such a job runs it in pieces; this keeps the bound valid
    for it.

The search
    Projected subgradient ascent on ``λ``, started from ``start_prices`` (the fluid LP's capacity prices
    when the simulator has them, which already give at least the fluid bound; zeros otherwise). Each step
    moves ``λ`` by how much each site-hour is over- or under-held by the jobs' own choices, with Polyak's
    step towards a target above the best value so far (a tenth above it, or ``upper_kg``, the least carbon
    of the schedules known, when that is lower, but never less than half a percent above), halving the step
    after ``patience`` steps without a gain; it stops after ``max_iterations`` steps or when the step
    factor falls below ``min_step``. The best ``L`` seen is the bound, so more steps
    can only raise it. Prices found for one set of windows are valid for any other, but may be poor there:
    :func:`lagrangian_value` at them may even fall to 0 on much wider windows, where another search would
    find more (``broker.simulation.run`` takes the higher of it and the fluid bound for each policy).

Validity in floating point
    Every value is summed in float64 over at most a few hundred thousand jobs; the bound is lowered by a
    hundred-millionth of the largest sums it is the difference of (the carbon at stake, and the price of
    all capacity), which covers rounding at the prices the search reaches (prices of a million kg per
    GPU-hour were seen to leave a few billionths).

Units
    Seconds for times (after the run start, where hour ``h`` is column ``h`` of ``SiteFacts.intensity``),
    GPUs as a float count, kg CO2e for carbon, kg CO2e per GPU-hour for prices.

Cost
    One evaluation of ``L`` takes each job over each of its sites at about two points per hour of slack:
    about 0.1 s for the whole Philly trace (82,244 jobs, 570,000 hours of slack in all) at 30 % utilisation;
    a few hundred steps take under a minute. Memory: the prices and the GPU-hours held per site-hour.

Nothing here reads a clock (other than to time the search), a file or the network.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from broker.simulation.results import SiteFacts

__all__ = ["WholeJobBound", "WholeJobBoundError", "lagrangian_value", "whole_job_bound"]

HOUR_S = 3600.0
MARGIN = 1e-8
"""The bound is lowered by this fraction of the largest sums it is made of (float rounding; module
docstring)."""


class WholeJobBoundError(ValueError):
    """The inputs cannot be bounded; the message says which and why."""


@dataclass(frozen=True)
class WholeJobBound:
    """The whole-job bound of one set of jobs over one federation (module docstring)."""

    carbon_kg: float  # least carbon of any whole-job schedule inside the windows, kg CO2e (a lower bound)
    jobs: int  # jobs bounded
    splittable: int  # of them, bounded as divisible work
    iterations: int  # steps of the search taken
    solve_s: float  # wall seconds of the whole search
    # float64[sites, hours]: the prices at which the bound was found (kg CO2e per GPU-hour); any prices
    # give a valid bound, these give the highest found (for other windows: lagrangian_value)
    prices_kg_per_gpu_hour: np.ndarray = field(repr=False, compare=False)
    # True when the search stopped above ``upper_kg``, a schedule that does not fit the windows
    # (``upper_fits`` False): no whole-job schedule may fit them at all, and then no figure is meaningful
    above_known: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: plain ``int``, ``float``, ``bool`` values (the prices are left out)."""
        return {"carbon_kg": float(self.carbon_kg), "jobs": int(self.jobs), "splittable": int(self.splittable),
                "iterations": int(self.iterations), "solve_s": float(self.solve_s),
                "above_known": bool(self.above_known)}


class _Jobs:
    """Checked job arrays in hours, with each job's latest start and its hour window for splittable work."""

    def __init__(self, sites: SiteFacts, release_s: Any, end_s: Any, duration_s: Any, gpus: Any,
                 allowed_sites: Any, splittable: Any) -> None:
        n_sites = sites.n_sites
        if np.ndim(sites.intensity) != 2 or sites.hours < 1:
            raise WholeJobBoundError("sites.intensity must hold at least one hour per site")
        arrays = []
        for name, values in (("release_s", release_s), ("end_s", end_s), ("duration_s", duration_s),
                             ("gpus", gpus)):
            arr = np.asarray(values, dtype=np.float64)
            if arr.ndim != 1:
                raise WholeJobBoundError(f"{name} must hold one value per job, not shape {list(arr.shape)}")
            bad = ~np.isfinite(arr) | (arr < 0)
            if bad.any():
                i = int(np.argmax(bad))
                raise WholeJobBoundError(f"{name} of job {i} is {float(arr[i])!r}; it must be a finite number, "
                                         "0 or more")
            arrays.append(arr)
        release, end, duration, held = arrays
        n = len(release)
        if not len(end) == len(duration) == len(held) == n:
            raise WholeJobBoundError(f"release_s, end_s, duration_s and gpus must have one value per job each, "
                                     f"not {len(release)}, {len(end)}, {len(duration)} and {len(held)}")
        allowed = (np.ones((n, n_sites), dtype=np.bool_) if allowed_sites is None
                   else np.asarray(allowed_sites, dtype=np.bool_))
        if allowed.shape != (n, n_sites):
            raise WholeJobBoundError(f"allowed_sites must be bool[{n}, {n_sites}] (jobs, sites), not "
                                     f"{list(allowed.shape)}")
        split = np.zeros(n, dtype=np.bool_) if splittable is None else np.asarray(splittable, dtype=np.bool_)
        if split.shape != (n,):
            raise WholeJobBoundError(f"splittable must be bool[{n}] (one per job), not {list(split.shape)}")
        usable = allowed & (np.asarray(sites.capacity_gpus)[None, :] > 0)
        lost = (held > 0) & (duration > 0) & ~usable.any(axis=1)
        if lost.any():
            i = int(np.argmax(lost))
            raise WholeJobBoundError(f"job {i} may use no site with GPUs")
        hours = sites.hours
        self.n = n
        self.release_h = release / HOUR_S
        self.duration_h = duration / HOUR_S
        self.latest_h = np.maximum(self.release_h, end / HOUR_S - self.duration_h)
        self.gpus = held
        self.allowed = np.ascontiguousarray(usable)
        self.splittable = split
        # splittable work: whole hours from the release's to the one its window ends in (outward); column
        # ``hours`` of the priced rates stands for every hour past the data (its last carbon, no price)
        self.first_hour = np.minimum(np.floor(self.release_h), hours).astype(np.int64)
        self.last_hour = np.clip(np.ceil(np.maximum(end / HOUR_S, self.release_h + self.duration_h)) - 1,
                                 self.first_hour, hours).astype(np.int64)


def _carbon_rate(sites: SiteFacts) -> np.ndarray:
    """kg CO2e per GPU-hour of each site-hour, float64[sites, hours]."""
    intensity = np.asarray(sites.intensity, dtype=np.float64)
    power = np.asarray(sites.power_kw_per_gpu, dtype=np.float64)
    power = np.where(np.isfinite(power), power, 0.0)
    return power[:, None] * intensity / 1000.0


def _evaluate(carbon: np.ndarray, prices: np.ndarray, capacity: np.ndarray, jobs: _Jobs,
              site: np.ndarray, start: np.ndarray, held: np.ndarray | None) -> float:
    """``L(prices)`` (kg); each job's choice in ``site`` and ``start`` (hours), and, when ``held`` is given, the
    GPU-hours the choices hold per site-hour written into it."""
    n_sites, hours = carbon.shape
    rate = np.empty((n_sites, hours + 1))
    rate[:, :hours] = carbon + prices
    rate[:, hours] = carbon[:, -1]  # past the data: its last hour's carbon, with no price (nothing is held there)
    cum = np.zeros((n_sites, hours + 2))
    np.cumsum(rate, axis=1, out=cum[:, 1:])
    total = _choose(rate, cum, jobs.release_h, jobs.latest_h, jobs.duration_h, jobs.gpus, jobs.allowed,
                    jobs.splittable, jobs.first_hour, jobs.last_hour, site, start)
    if held is not None:
        _hold(site, start, jobs.duration_h, jobs.gpus, jobs.splittable, held)
    return total - float((prices * capacity[:, None]).sum())


def lagrangian_value(sites: SiteFacts, prices_kg_per_gpu_hour: np.ndarray, release_s: Any, end_s: Any,
                     duration_s: Any, gpus: Any, *, allowed_sites: Any = None, splittable: Any = None) -> float:
    """``L(λ)`` for the given prices (float64[sites, hours], each 0 or more): a lower bound, in kg CO2e, on
    the carbon of every whole-job schedule of these jobs inside these windows (module docstring). Use it
    to bound other windows (e.g. a policy's own, where it ran jobs past their deadlines) with the prices a
    search found."""
    jobs = _Jobs(sites, release_s, end_s, duration_s, gpus, allowed_sites, splittable)
    prices = _check_prices(sites, prices_kg_per_gpu_hour)
    carbon = _carbon_rate(sites)
    site = np.zeros(jobs.n, dtype=np.int64)
    start = np.zeros(jobs.n)
    capacity = np.asarray(sites.capacity_gpus, dtype=np.float64)
    value = _evaluate(carbon, prices, capacity, jobs, site, start, None)
    return _lowered(value, carbon, jobs, prices, capacity)


def whole_job_bound(sites: SiteFacts, release_s: Any, end_s: Any, duration_s: Any, gpus: Any, *,
                    allowed_sites: Any = None, splittable: Any = None, start_prices: np.ndarray | None = None,
                    upper_kg: float | None = None, upper_fits: bool = True, max_iterations: int = 1000,
                    patience: int = 25, min_step: float = 1e-3) -> WholeJobBound:
    """The whole-job bound (module docstring) of jobs ``release_s``, ``end_s`` (window, seconds after the
    run start), ``duration_s`` (true run time) and ``gpus`` (held), each one per job; ``allowed_sites``
    (bool[jobs, sites], None: every site); ``splittable`` (bool[jobs], None: none). ``start_prices``: where
    the search starts (float64[sites, hours], e.g. the fluid LP's capacity prices; None: zeros);
    ``upper_kg``: the least carbon of the schedules known, which steers the step sizes (it never changes
    what the bound means). ``upper_fits`` False: none of them fits the windows (each ran some job past its
    window), and no schedule may; the search then stops as soon as it rises above ``upper_kg`` and says so
    (:attr:`WholeJobBound.above_known`): where no whole-job schedule fits the windows, ``L`` grows without
    limit, and a figure above every schedule replayed tells a reader nothing. Raises
    :class:`WholeJobBoundError` for bad inputs."""
    t0 = time.perf_counter()
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, (int, np.integer)) or max_iterations < 0:
        raise WholeJobBoundError(f"max_iterations must be a whole number, 0 or more, not {max_iterations!r}")
    if isinstance(patience, bool) or not isinstance(patience, (int, np.integer)) or patience < 1:
        raise WholeJobBoundError(f"patience must be a whole number, 1 or more, not {patience!r}")
    if not 0 < min_step <= 1:
        raise WholeJobBoundError(f"min_step must be above 0 and at most 1, not {min_step!r}")
    jobs = _Jobs(sites, release_s, end_s, duration_s, gpus, allowed_sites, splittable)
    carbon = _carbon_rate(sites)
    capacity = np.asarray(sites.capacity_gpus, dtype=np.float64)
    prices = (np.zeros_like(carbon) if start_prices is None
              else _check_prices(sites, start_prices).copy())
    site = np.zeros(jobs.n, dtype=np.int64)
    start = np.zeros(jobs.n)
    held = np.zeros_like(carbon)
    value = _evaluate(carbon, prices, capacity, jobs, site, start, held)
    best, best_prices = value, prices.copy()
    step, since, taken = 1.0, 0, 0
    ceiling = None if upper_fits else upper_kg  # above it, the search has nothing left to tell
    above = ceiling is not None and best > ceiling
    while taken < max_iterations and step >= min_step and not above:
        over = held - capacity[:, None]  # GPU-hours held above (below: negative) what each site-hour has
        over[(prices <= 0.0) & (over < 0.0)] = 0.0  # a price at 0 cannot fall
        norm = float((over * over).sum())
        if norm == 0.0:  # no site-hour over its GPUs, none under it at a price: no step moves the prices
            break
        # Polyak's step aims at a value above the best so far: a tenth above it, or the known schedule's
        # carbon when that is lower, but always a little above (a schedule that ran late may be below it)
        target = best + 0.1 * abs(best)
        if upper_kg is not None:
            target = min(target, upper_kg)
        target = max(target, best + 0.005 * abs(best) + 1e-9)
        prices = np.maximum(0.0, prices + step * (target - value) / norm * over)
        value = _evaluate(carbon, prices, capacity, jobs, site, start, held)
        taken += 1
        if value > best + 1e-9 * abs(best):
            best, best_prices, since = value, prices.copy(), 0
            above = ceiling is not None and best > ceiling
        else:
            since += 1
            if since >= patience:
                step, since = step / 2.0, 0
    return WholeJobBound(carbon_kg=_lowered(best, carbon, jobs, best_prices, capacity), jobs=jobs.n,
                         splittable=int(jobs.splittable.sum()), iterations=taken,
                         solve_s=time.perf_counter() - t0, prices_kg_per_gpu_hour=best_prices, above_known=above)


def _check_prices(sites: SiteFacts, prices: Any) -> np.ndarray:
    arr = np.asarray(prices, dtype=np.float64)
    if arr.shape != (sites.n_sites, sites.hours):
        raise WholeJobBoundError(f"prices must be float[{sites.n_sites}, {sites.hours}] (sites, hours), not "
                                 f"{list(arr.shape)}")
    if not (np.isfinite(arr) & (arr >= 0)).all():
        raise WholeJobBoundError("prices must be finite and 0 or more (any such prices give a valid bound)")
    return arr


def _lowered(value: float, carbon: np.ndarray, jobs: _Jobs, prices: np.ndarray, capacity: np.ndarray) -> float:
    """``value`` lowered by float rounding's possible excess, and never below 0."""
    largest = float(carbon.max(initial=0.0)) * float((jobs.gpus * jobs.duration_h).sum())
    priced = float((prices * capacity[:, None]).sum())
    return max(0.0, value - MARGIN * (abs(value) + largest + 2.0 * priced))


@numba.njit(cache=True, nogil=True)
def _integral(cum: np.ndarray, rate: np.ndarray, s: int, x: float) -> float:
    """∫ rate[s] from 0 to ``x`` hours: whole hours from the running sums, the last one pro rata; past the
    last column, that column's rate."""
    h = int(np.floor(x))
    if h > rate.shape[1] - 1:
        h = rate.shape[1] - 1
    return cum[s, h] + (x - h) * rate[s, h]


@numba.njit(cache=True, nogil=True)
def _choose(rate: np.ndarray, cum: np.ndarray, release: np.ndarray, latest: np.ndarray, duration: np.ndarray,
            gpus: np.ndarray, allowed: np.ndarray, splittable: np.ndarray, first_hour: np.ndarray,
            last_hour: np.ndarray, site: np.ndarray, start: np.ndarray) -> float:  # pragma: no cover - compiled
    """Each job's least priced value on its own (its site and start hour written out); their sum."""
    total = 0.0
    for j in range(release.shape[0]):
        a, b, d, g = release[j], latest[j], duration[j], gpus[j]
        best, best_s, best_t = np.inf, -1, a
        for s in range(rate.shape[0]):
            if not allowed[j, s]:
                continue
            if splittable[j]:  # divisible work: its GPU-hours at the cheapest site-hour of its window
                for h in range(first_hour[j], last_hour[j] + 1):
                    v = rate[s, h] * d
                    if v < best:
                        best, best_s, best_t = v, s, float(h)
                continue
            v = _integral(cum, rate, s, a + d) - _integral(cum, rate, s, a)
            if v < best:
                best, best_s, best_t = v, s, a
            if b > a:
                v = _integral(cum, rate, s, b + d) - _integral(cum, rate, s, b)
                if v < best:
                    best, best_s, best_t = v, s, b
                k = np.floor(a) + 1.0  # starts on an hour boundary
                while k < b:
                    v = _integral(cum, rate, s, k + d) - _integral(cum, rate, s, k)
                    if v < best:
                        best, best_s, best_t = v, s, k
                    k += 1.0
                k = np.floor(a + d) + 1.0  # ends on an hour boundary
                while k < b + d:
                    v = _integral(cum, rate, s, k) - _integral(cum, rate, s, k - d)
                    if v < best:
                        best, best_s, best_t = v, s, k - d
                    k += 1.0
        site[j] = best_s
        start[j] = best_t
        if best_s >= 0:
            total += g * best
    return total


@numba.njit(cache=True, nogil=True)
def _hold(site: np.ndarray, start: np.ndarray, duration: np.ndarray, gpus: np.ndarray, splittable: np.ndarray,
          held: np.ndarray) -> None:  # pragma: no cover - compiled
    """The GPU-hours the jobs' choices hold per site-hour (within the data's hours)."""
    held[:, :] = 0.0
    hours = held.shape[1]
    for j in range(site.shape[0]):
        s = site[j]
        if s < 0 or gpus[j] <= 0.0 or duration[j] <= 0.0:
            continue
        if splittable[j]:
            if int(start[j]) < hours:  # past the data nothing is priced, so nothing is held
                held[s, int(start[j])] += gpus[j] * duration[j]
            continue
        t0, t1 = start[j], start[j] + duration[j]
        h = int(np.floor(t0))
        while h < t1 and h < hours:
            lo = t0 if t0 > h else float(h)
            hi = t1 if t1 < h + 1.0 else h + 1.0
            if hi > lo:
                held[s, h] += gpus[j] * (hi - lo)
            h += 1
