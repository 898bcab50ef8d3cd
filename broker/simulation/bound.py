"""The offline bound: the least carbon (and, separately, the least cost) that any schedule of the jobs could
have, knowing the future carbon intensity of every site perfectly.

What it solves
    A fluid linear program over hourly slots. Each job brings ``gpu_hours`` of work that may be split in any
    way over the hours of its window and over the sites it may use (``allowed_sites``: all by default; the
    simulator gives each job the sites it fits and that meet its latency objective, the sites every policy
    is held to); in every hour ``t`` a site ``s`` serves at most
    ``capacity_gpus[s]`` GPU-hours in all; every job is served in full. The first LP minimises carbon,
    ``sum GPUh[s, t] × power_kw_per_gpu[s] × intensity[s, t] / 1000`` (kg; intensity is g/kWh), the second
    minimises cost, ``sum GPUh[s, t] × usd_per_gpu_hour[s]``. Both are solved by HiGHS through
    :func:`scipy.optimize.linprog`.

Why it is a lower bound
    Everything a real schedule must respect and the LP does not is a relaxation: a job may take any number
    of GPU-hours in one hour (no limit from its GPU count), may spread over several of its sites at once,
    is tied to no site beyond ``allowed_sites`` and never pays for restarts;
    each site draws its lowest power per GPU and holds all its GPUs (``SiteFacts`` gives both that way). A
    job's window is rounded *outward* to whole hours: it may use hour ``floor(release_s / 3600)`` through
    hour ``ceil(end_s / 3600) - 1``, both included, so a job that runs inside ``[release_s, end_s)`` uses
    only hours of its LP window. Hence for every schedule that keeps each site within its capacity at every
    instant and runs each job inside its window at sites it is allowed, the LP optimum is at most that
    schedule's carbon (and
    cost), counted with the same hourly intensities. To compare the bound with several schedules, give each
    job a window that holds its run in all of them (e.g. its submit time to the latest of its deadline and
    its ends); a wider window only lowers the bound.

The exact reduction (no approximation)
    1. Jobs allowed the same sites form a group (one group when every job may use every site). In a group,
       jobs with the same first and last hour form one class; their GPU-hours add up. Jobs with no work
       are dropped.
    2. A class may use any hour of its window at any of its group's sites, so the LP only needs how much
       of each class is served in each hour, plus how the group's total in each hour is split over its
       sites (``z[g, s, t] <= capacity_gpus[s]``, cost per GPU-hour of site ``s`` in hour ``t``); where
       several groups may use site ``s`` in hour ``t``, one row keeps their sum within its capacity.
    3. Per group, the hours of a window ``[a, d]`` are the disjoint union of at most ``2 log2(d - a + 1)``
       blocks of a
       segment tree over the hours (block ``b`` of level ``k`` is hours ``[b 2^k, (b + 1) 2^k)``). A class
       sends its work to its blocks in any split (one variable per block; a class of one block injects its
       work there directly), and each block passes work down to its two halves without limit, down to the
       hours. Work that enters a block can reach any hour of it and no other, so the flows that this
       network allows are exactly the assignments of class work to hours of its window.
    The model has about ``sum over classes of their blocks + per group (2 × hours + its sites × hours)``
    variables and ``blocks + classes`` equality rows (plus a capacity row per site-hour shared by groups),
    instead of ``jobs × sites × hours`` variables. The full Philly trace (82,247 jobs, windows to hour
    4,223, 16 sites) gives 117,610 variables and 17,776 rows instead of 5.6 billion when every job may use
    every site; with its 8,217 latency-bound jobs tied to the sites within 50 ms of their origin, 177,593
    variables and 75,421 rows (7 groups).

Solving
    Each LP goes to HiGHS's interior-point solver with crossover (``method="highs-ipm"``), 2 to 3 times
    faster than dual simplex here; should it stop on numerical trouble, dual simplex solves it again. The
    two LPs run in two threads (HiGHS releases the GIL). The full Philly trace takes 7 to 13 s on a 2-core
    machine (15 to 20 s with its latency-bound jobs tied to their sites), its 30 days from 2017-10-01
    (46,722 jobs, 66,467 variables) 2.5 to 4 s, and the time grows
    about linearly with the variables (four copies of the trace end to end, 385,000 variables: 30 s).
    HiGHS meets its tolerances (about 1e-7, relative) rather than exact arithmetic, so the optimum may be
    off by that much either way.

Coarsening (off unless the exact model is larger than ``max_variables``)
    When the exact model would have more than ``max_variables`` variables, windows are widened outward to
    a coarser grid, the finest of :data:`COARSENING` that fits: a window of ``L`` hours gets a grid of
    ``g`` hours, the largest power of two with ``g <= L × fraction`` (at least 1 hour, which leaves short
    windows exact), its first hour rounded down and its last hour rounded up to the grid (but not past the
    intensity data's last hour). A window grows by less than ``2 × fraction`` of its length and never
    shrinks, so the LP stays a relaxation: the result is still a lower bound, only a looser one.
    :attr:`BoundResult.relaxation` says what was done; it is ``"none"`` for the exact model. To turn
    coarsening off, give a ``max_variables`` large enough.

Feasibility
    Before any LP, the jobs are scheduled earliest-deadline-first over the hours on one pooled machine of
    ``sum(capacity_gpus)`` GPU-hours per hour, which meets every window if and only if the LP is feasible
    when every job may use every site (work is divisible). If it fails, :class:`BoundInfeasible` names an
    interval of hours whose jobs need more GPU-hours than the sites hold in it. With ``allowed_sites``, each
    group of jobs that may use only some sites is checked the same way on those sites alone, and named when
    it fails; groups that fit alone but not together (they share sites) are found by the LP itself, which
    raises :class:`BoundInfeasible` without naming hours.

Units
    ``release_s`` and ``end_s``: float seconds after the run start, where hour ``h`` is column ``h`` of
    ``SiteFacts.intensity``, ``[h × 3600, (h + 1) × 3600)``. ``gpu_hours``: GPU-hours of work per job.
    Results: carbon in kg CO2e, cost in US dollars, energy in kWh.

Energy
    ``energy_kwh`` is the total GPU-hours times the lowest ``power_kw_per_gpu`` over the sites that have
    GPUs: a lower bound on any schedule's energy, exact when all sites draw the same power per GPU (as in
    the default federation). It is not an LP optimum.

Nothing here reads a clock (other than to time the solve), a file or the network.
"""

from __future__ import annotations

import heapq
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, NoReturn

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from broker.simulation.results import SiteFacts

__all__ = [
    "COARSENING",
    "DEFAULT_MAX_VARIABLES",
    "SLOT_S",
    "BoundError",
    "BoundResult",
    "offline_bound",
]

SLOT_S = 3600.0
"""Seconds per slot: one column of ``SiteFacts.intensity``."""

DEFAULT_MAX_VARIABLES = 1_000_000
"""Largest LP (variables) solved without coarsening. The exact model of the full Philly trace over 16 sites
has 117,610, so by default nothing is coarsened there; at a million the two solves should take about a minute
and a half on 2 cores (extrapolated from the measured growth, see the module docstring)."""

COARSENING: tuple[float, ...] = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
"""Grid fractions tried in turn when the exact model is too large: a window of ``L`` hours is widened to a
grid of at most ``L × fraction`` hours (a power of two)."""

_METHODS = ("highs-ipm", "highs-ds")  # interior point (with crossover) is 2-3 times faster than dual simplex
# on these LPs; dual simplex is the fallback should it stop on numerical trouble
_FEASIBILITY_TOL = 1e-9  # relative to the pooled capacity per hour: EDF leftovers below this are float noise


class BoundError(ValueError):
    """The bound cannot be computed from what was given; the message says what is wrong and where."""


class BoundInfeasible(BoundError):
    """No schedule can serve every job inside its window with the sites' GPUs (the message names the hours)."""


@dataclass(frozen=True)
class BoundResult:
    """The offline bound of one set of jobs over one federation (module docstring: definition, units)."""

    carbon_kg: float  # least carbon of any schedule, kg CO2e
    cost_usd: float  # least cost of any schedule, US dollars (a separate LP)
    energy_kwh: float  # GPU-hours × the lowest power per GPU of the sites: a lower bound on energy
    jobs: int  # jobs given (including any with no work)
    gpu_hours: float  # their work in all
    variables: int  # of the LP solved (each of the two LPs has this many)
    constraints: int  # rows of the LP: equalities, and capacity rows of site-hours several groups share
    solve_s: float  # wall seconds of the whole call: checks, building the LP and both solves
    relaxation: str  # the coarsening applied, in a sentence; "none" when exact on hour slots
    # float64[sites, hours] with ``shadow_prices=True``: what one more GPU at site s in hour t would save
    # the carbon LP, kg CO2e per GPU-hour (the dual value of that site-hour's capacity; 0 where the LP
    # leaves GPUs free); None otherwise
    shadow_kg_per_gpu_hour: np.ndarray | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: plain ``int``, ``float`` and ``str`` values (the shadow prices are left out)."""
        out = asdict(self)
        out.pop("shadow_kg_per_gpu_hour")
        for key in ("carbon_kg", "cost_usd", "energy_kwh", "gpu_hours", "solve_s"):
            out[key] = float(out[key])
        for key in ("jobs", "variables", "constraints"):
            out[key] = int(out[key])
        return out


def offline_bound(
    sites: SiteFacts,
    release_s: np.ndarray,
    end_s: np.ndarray,
    gpu_hours: np.ndarray,
    *,
    allowed_sites: np.ndarray | None = None,
    max_variables: int = DEFAULT_MAX_VARIABLES,
    shadow_prices: bool = False,
) -> BoundResult:
    """The least carbon and the least cost of serving every job inside its window (module docstring).

    ``release_s[i]`` and ``end_s[i]`` (float seconds after the run start, ``end_s > release_s``; equal is
    allowed for a job with no work) bound job ``i``'s window and ``gpu_hours[i] >= 0`` is its work.
    ``allowed_sites`` (bool[jobs, sites], None: every site) says where each job may run, e.g. only the sites
    that meet its latency objective. Raises :class:`BoundError` for mismatched shapes, bad values, a window
    outside the intensity data (naming the job and the hour), work the sites cannot serve in time
    (:class:`BoundInfeasible`: naming the hours, the group of jobs or the job allowed no site with GPUs,
    except for groups that fit alone but not together), or an LP above ``max_variables`` even at the
    coarsest grid (with many groups of allowed sites the per-group site split dominates the model, and
    wider windows reach more hours, so coarsening may not shrink it). ``shadow_prices``: also return the
    carbon LP's price of each site-hour's capacity (:attr:`BoundResult.shadow_kg_per_gpu_hour`; of the
    coarsened LP when it was coarsened).
    """
    t0 = time.perf_counter()
    if isinstance(max_variables, bool) or not isinstance(max_variables, (int, np.integer)) or max_variables < 1:
        raise BoundError(f"max_variables must be a whole number, 1 or more, not {max_variables!r}")
    capacity, usd, power, intensity = _check_sites(sites)
    release, end, work = _check_jobs(release_s, end_s, gpu_hours)
    hours = intensity.shape[1]
    first, last = _slots(release, end, hours)

    n_jobs = len(work)
    total = float(work.sum()) if n_jobs else 0.0
    used = capacity > 0
    energy = total * float(power[used].min()) if total > 0 and used.any() else 0.0
    group_of, group_sites = _groups(allowed_sites, n_jobs, used, work > 0, sites.names)
    has_work = work > 0
    if not has_work.any():
        return BoundResult(0.0, 0.0, 0.0, n_jobs, total, 0, 0, time.perf_counter() - t0, "none",
                           np.zeros(intensity.shape) if shadow_prices else None)

    first, last, work, group_of = first[has_work], last[has_work], work[has_work], group_of[has_work]
    _check_feasible(*_classes(first, last, work, hours), float(capacity.sum()), int(used.sum()))
    present = [g for g in range(len(group_sites)) if (group_of == g).any()]  # groups with work
    for g in present:  # each group alone on its own sites: named when it cannot fit
        members = group_sites[g]
        if len(members) < int(used.sum()):
            mine = group_of == g
            _check_feasible(*_classes(first[mine], last[mine], work[mine], hours), float(capacity[members].sum()),
                            len(members), f" that may use only {', '.join(sites.names[i] for i in members)} and")

    def build(a: np.ndarray, d: np.ndarray) -> _Model:
        return _Model.build([(*_classes(a[group_of == g], d[group_of == g], work[group_of == g], hours),
                              group_sites[g]) for g in present], hours, capacity)

    model = build(first, last)
    relaxation = "none"
    if model.variables > max_variables:
        exact_variables = model.variables
        for fraction in COARSENING:
            ca, cd = _coarsen(first, last, fraction, hours)
            widened = int(np.count_nonzero((ca != first) | (cd != last)))
            model = build(ca, cd)
            if model.variables <= max_variables:
                relaxation = (
                    f"coarsened: the exact hour-slot LP needs {exact_variables:,} variables, more than "
                    f"max_variables={max_variables:,}, so each window of L hours was widened outward to a grid "
                    f"of g hours (g the largest power of two <= L × {fraction:g}, at least 1 h: first "
                    f"hour rounded down, last hour rounded up, within the data), lengthening it by less than "
                    f"{200 * fraction:g} %; {widened:,} of {int(has_work.sum()):,} jobs' windows grew. Wider "
                    "windows only relax the LP: the result is still a lower bound, a looser one"
                )
                break
        else:
            raise BoundError(
                f"the LP needs {exact_variables:,} variables exact and still {model.variables:,} at the "
                f"coarsest grid (windows widened by up to twice their length), over "
                f"max_variables={max_variables:,}: raise max_variables"
            )

    kg_per_gpu_hour = power[:, None] * intensity / 1000.0
    price = np.broadcast_to(usd[:, None], intensity.shape)
    with ThreadPoolExecutor(max_workers=2) as pool:  # HiGHS releases the GIL: the two LPs run side by side
        carbon_lp = pool.submit(model.solve, kg_per_gpu_hour, "carbon", shadow_prices)
        cost_lp = pool.submit(model.solve, price, "cost")
        carbon_opt, shadow = carbon_lp.result()
        carbon = _margin(carbon_opt, float(kg_per_gpu_hour.max(initial=0.0)) * total)
        cost = _margin(cost_lp.result()[0], float(price.max(initial=0.0)) * total)
    return BoundResult(
        carbon_kg=carbon, cost_usd=cost, energy_kwh=energy, jobs=n_jobs, gpu_hours=total,
        variables=model.variables, constraints=model.constraints, solve_s=time.perf_counter() - t0,
        relaxation=relaxation, shadow_kg_per_gpu_hour=shadow,
    )


# ---------------------------------------------------------------------------------------------------------
# Checks and slots
# ---------------------------------------------------------------------------------------------------------


SOLVER_MARGIN = 1e-6
"""HiGHS meets its tolerances (1e-7, on costs scaled to at most 1) to within a few parts in 10 million of the
problem's scale, so an optimum may come out a hair above the true one. The reported bound is lowered by
this fraction of the optimum and of the largest possible objective (every GPU-hour at the
dearest site-hour), so that it stays below every feasible schedule: on the Philly trace 0.4 kg of 78 t."""


def _margin(value: float, largest: float) -> float:
    """``value`` lowered by the solver's possible excess; ``largest``: the objective's largest possible value."""
    return max(0.0, value - SOLVER_MARGIN * (abs(value) + largest))


def _check_sites(sites: SiteFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = len(sites.names)
    intensity = np.asarray(sites.intensity, dtype=np.float64)
    if intensity.ndim != 2 or intensity.shape[0] != n:
        raise BoundError(f"sites.intensity must be [sites, hours] = [{n}, hours], not {list(intensity.shape)}")
    arrays = []
    for name in ("capacity_gpus", "usd_per_gpu_hour", "power_kw_per_gpu"):
        values = np.asarray(getattr(sites, name), dtype=np.float64)
        if values.shape != (n,):
            raise BoundError(f"sites.{name} must hold one value per site ({n}), not shape {list(values.shape)}")
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise BoundError(f"sites.{name} of site {i} ({sites.names[i]}) is {float(values[i])!r}; "
                             "it must be a finite number, 0 or more")
        arrays.append(values)
    bad = ~np.isfinite(intensity)
    if bad.any():
        s, h = (int(x) for x in np.argwhere(bad)[0])
        raise BoundError(f"sites.intensity of site {s} ({sites.names[s]}) in hour {h} is "
                         f"{float(intensity[s, h])!r}; every hour needs a finite value")
    return arrays[0], arrays[1], arrays[2], intensity


def _check_jobs(release_s: Any, end_s: Any, gpu_hours: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = []
    for name, values in (("release_s", release_s), ("end_s", end_s), ("gpu_hours", gpu_hours)):
        try:
            arr = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise BoundError(f"{name} must be an array of numbers: {err}") from None
        if arr.ndim != 1:
            raise BoundError(f"{name} must be one-dimensional (one value per job), not shape {list(arr.shape)}")
        bad = ~np.isfinite(arr)
        if bad.any():
            i = int(np.argmax(bad))
            raise BoundError(f"{name} of job {i} is {float(arr[i])!r}; it must be a finite number")
        arrays.append(arr)
    release, end, work = arrays
    if not len(release) == len(end) == len(work):
        raise BoundError(f"release_s, end_s and gpu_hours must have one value per job each, not "
                         f"{len(release)}, {len(end)} and {len(work)}")
    empty = (end < release) | ((end == release) & (work > 0))  # a job with no work may have an empty window
    for bad, what in ((work < 0, "gpu_hours is negative"), (empty, "end_s is not after release_s")):
        if bad.any():
            i = int(np.argmax(bad))
            raise BoundError(f"job {i}: {what} (release_s={float(release[i])!r}, end_s={float(end[i])!r}, "
                             f"gpu_hours={float(work[i])!r})")
    return release, end, work


def _slots(release: np.ndarray, end: np.ndarray, hours: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last hour (both included) of each window, rounded outward; checked against the data."""
    first_f = np.floor(release / SLOT_S)
    last_f = np.ceil(end / SLOT_S) - 1
    early = first_f < 0
    if early.any():
        i = int(np.argmax(early))
        raise BoundError(f"job {i}'s window starts at release_s={float(release[i])!r}, in hour {int(first_f[i])}, "
                         "before hour 0 of the intensity data")
    late = last_f > hours - 1
    if late.any():
        i = int(np.argmax(late))
        raise BoundError(f"job {i}'s window ends at end_s={float(end[i])!r}, in hour {int(last_f[i])}, past the "
                         f"intensity data, which has hours 0..{hours - 1} (give the sites more hours of data)")
    return first_f.astype(np.int64), last_f.astype(np.int64)


def _classes(first: np.ndarray, last: np.ndarray, work: np.ndarray,
             hours: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Jobs with the same window merged: first hours, last hours and summed work, sorted by window."""
    key, inverse = np.unique(first * hours + last, return_inverse=True)
    w = np.bincount(inverse, weights=work, minlength=len(key))
    return key // hours, key % hours, w


def _coarsen(first: np.ndarray, last: np.ndarray, fraction: float, hours: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows widened outward to a grid of the largest power of two <= length × fraction (at least 1)."""
    length = (last - first + 1).astype(np.float64)
    grid = np.left_shift(1, np.floor(np.log2(np.maximum(length * fraction, 1.0))).astype(np.int64))
    return (first // grid) * grid, np.minimum((last // grid + 1) * grid - 1, hours - 1)


def _check_feasible(a: np.ndarray, d: np.ndarray, w: np.ndarray, pooled: float, n_sites: int, who: str = "") -> None:
    """Earliest deadline first on one machine of ``pooled`` GPU-hours per hour; raises if a window is missed
    (``who``: which jobs these are, for the message)."""
    tol = _FEASIBILITY_TOL * max(pooled, 1.0)
    order = np.lexsort((d, a))
    a_sorted, d_sorted, rem = a[order].tolist(), d[order].tolist(), w[order].tolist()
    heap: list[tuple[int, int]] = []
    i, n = 0, len(rem)
    t = a_sorted[0] if n else 0
    while i < n or heap:
        if not heap and a_sorted[i] > t:
            t = a_sorted[i]
        while i < n and a_sorted[i] <= t:
            heapq.heappush(heap, (d_sorted[i], i))
            i += 1
        room = pooled
        while heap and room > 0:
            j = heap[0][1]
            take = min(room, rem[j])
            rem[j] -= take
            room -= take
            if rem[j] <= tol:
                heapq.heappop(heap)
        if heap and heap[0][0] <= t:
            _raise_infeasible(a, d, w, pooled, n_sites, heap[0][0], who)
        t += 1


def _raise_infeasible(a: np.ndarray, d: np.ndarray, w: np.ndarray, pooled: float, n_sites: int, q: int,
                      who: str = "") -> NoReturn:
    """Name the interval ending at hour ``q`` whose jobs exceed the sites' GPU-hours the most."""
    inside = d <= q
    by_first = np.bincount(a[inside], weights=w[inside], minlength=q + 1)
    need = np.cumsum(by_first[::-1])[::-1]  # need[p]: work of windows inside [p, q]
    held = pooled * (q + 1 - np.arange(q + 1))
    p = int(np.argmax(need - held))
    raise BoundInfeasible(
        f"the sites cannot serve the work in time, so the LP is infeasible: the jobs{who} whose windows lie "
        f"within hours {p}..{q} (seconds {p * SLOT_S:g} to {(q + 1) * SLOT_S:g}) need {need[p]:.6g} GPU-hours, but "
        f"the {n_sites} site(s) with GPUs hold {pooled:g} GPUs × {q + 1 - p} h = {held[p]:.6g} GPU-hours; "
        "widen the windows or add capacity"
    )


def _groups(allowed: Any, n_jobs: int, used: np.ndarray, has_work: np.ndarray,
            names: tuple[str, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Jobs grouped by the sites with GPUs they may use: each job's group, and each group's site indices.
    None: one group, every site with GPUs."""
    if allowed is None:
        return np.zeros(n_jobs, dtype=np.int64), [np.flatnonzero(used)]
    given = np.asarray(allowed)
    if given.dtype != bool or given.shape != (n_jobs, len(used)):
        raise BoundError(f"allowed_sites must be a bool array of [jobs, sites] = [{n_jobs}, {len(used)}], not "
                         f"{given.dtype} of shape {list(given.shape)}")
    mask = given & used
    stranded = has_work & ~mask.any(axis=1)
    if stranded.any():
        i = int(np.argmax(stranded))
        allowed_names = ", ".join(n for n, ok in zip(names, given[i], strict=True) if ok) or "none"
        raise BoundInfeasible(f"job {i} may use no site with GPUs (allowed: {allowed_names}), so the LP is "
                              "infeasible")
    rows, group_of = np.unique(mask, axis=0, return_inverse=True)
    return group_of.reshape(-1).astype(np.int64), [np.flatnonzero(r) for r in rows]


# ---------------------------------------------------------------------------------------------------------
# The LP
# ---------------------------------------------------------------------------------------------------------


def _blocks(a: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment-tree blocks of each window ``[a, d]``: (class index, level, block), disjoint, covering it."""
    lo, hi = a.astype(np.int64), d.astype(np.int64) + 1  # half-open [lo, hi) in blocks of the level
    idx = np.arange(len(a))
    out_c, out_k, out_b = [], [], []
    level = 0
    while True:
        open_ = lo < hi
        if not open_.any():
            break
        left = open_ & ((lo & 1) == 1)
        right = open_ & ((hi & 1) == 1)
        out_c.append(idx[left])
        out_k.append(np.full(int(left.sum()), level))
        out_b.append(lo[left])
        hi = hi - right
        out_c.append(idx[right])
        out_k.append(np.full(int(right.sum()), level))
        out_b.append(hi[right])
        lo = (lo + left) >> 1
        hi = hi >> 1
        level += 1
    return np.concatenate(out_c), np.concatenate(out_k).astype(np.int64), np.concatenate(out_b)


class _Network(NamedTuple):
    """One group's part of the LP: its matrix entries, right-hand sides and site-split variables, and the
    first row and variable after it."""

    rows: list[np.ndarray]
    cols: list[np.ndarray]
    vals: list[np.ndarray]
    b_eq: list[np.ndarray]
    z_var: np.ndarray
    z_site: np.ndarray
    z_hour: np.ndarray
    end_row: int
    end_var: int


def _network(a: np.ndarray, d: np.ndarray, w: np.ndarray, hours: int, sites: np.ndarray, row0: int,
             var0: int) -> _Network:
    """One group's network: its rows numbered from ``row0``, its variables from ``var0``."""
    cls_of, lev, blk = _blocks(a, d)
    levels = (hours - 1).bit_length() + 1  # the top level has one block
    n_blocks = [-(-hours // (1 << k)) for k in range(levels)]
    need = [np.zeros(n, dtype=bool) for n in n_blocks]
    for k in range(levels):
        need[k][blk[lev == k]] = True
    for k in range(levels - 1, 0, -1):  # every block below a used block is needed
        parents = np.flatnonzero(need[k])
        children = np.concatenate([2 * parents, 2 * parents + 1])
        need[k - 1][children[children < n_blocks[k - 1]]] = True
    offset = row0 + np.cumsum([0] + [int(m.sum()) for m in need])
    row_of = [offset[k] + np.cumsum(need[k]) - 1 for k in range(levels)]  # node row per (level, block)
    n_nodes = int(offset[-1]) - row0

    pieces = np.bincount(cls_of, minlength=len(a))
    single = pieces[cls_of] == 1
    node_row = np.empty(len(cls_of), dtype=np.int64)
    for k in range(levels):
        at = lev == k
        node_row[at] = row_of[k][blk[at]]
    # Node rows: outflow - inflow = work injected there (classes of one block).
    nodes_b = np.zeros(n_nodes, dtype=np.float64)
    np.add.at(nodes_b, node_row[single] - row0, w[cls_of[single]])

    # Splits of classes of several blocks: class row +1 (the splits sum to its work), block row -1.
    multi = np.flatnonzero(pieces > 1)
    class_row = np.full(len(a), -1, dtype=np.int64)
    class_row[multi] = row0 + n_nodes + np.arange(len(multi))
    split = ~single
    n_var = var0
    var = n_var + np.arange(int(split.sum()))
    rows = [class_row[cls_of[split]], node_row[split]]
    cols = [var, var]
    vals = [np.ones(len(var)), -np.ones(len(var))]
    n_var += len(var)

    # Tree edges, unbounded: parent row +1, child row -1.
    for k in range(1, levels):
        parents = np.flatnonzero(need[k])
        for half in (0, 1):
            child = 2 * parents + half
            ok = child < n_blocks[k - 1]
            var = n_var + np.arange(int(ok.sum()))
            rows += [row_of[k][parents[ok]], row_of[k - 1][child[ok]]]
            cols += [var, var]
            vals += [np.ones(len(var)), -np.ones(len(var))]
            n_var += len(var)

    # Site split of each hour reached: hour row +1 (outflow), 0 <= z[g, s, t] <= capacity[s].
    hours_used = np.flatnonzero(need[0])
    zh = np.repeat(hours_used, len(sites))
    zs = np.tile(sites, len(hours_used))
    var = n_var + np.arange(len(zh))
    rows.append(row_of[0][zh])
    cols.append(var)
    vals.append(np.ones(len(var)))
    return _Network(rows, cols, vals, [nodes_b, w[multi]], var, zs, zh, row0 + n_nodes + len(multi),
                    n_var + len(var))


@dataclass
class _Model:
    """The network LP of module docstring step 3, one network per site group, with the site split of every
    hour a group's windows reach; where several groups may use the same site in the same hour, a row keeps
    their GPU-hours within its capacity."""

    a_eq: sparse.csc_matrix  # rows: per group, its blocks then its classes of several blocks
    b_eq: np.ndarray
    a_ub: sparse.csc_matrix | None  # rows: (site, hour) pairs shared by several groups; None: no sharing
    b_ub: np.ndarray | None
    ub_site: np.ndarray | None  # the site and hour of each a_ub row
    ub_hour: np.ndarray | None
    bounds: np.ndarray  # [variables, 2]: lower (0) and upper bound of each variable
    z_var: np.ndarray  # the variables z[g, s, t], and their site and hour
    z_site: np.ndarray
    z_hour: np.ndarray

    @property
    def variables(self) -> int:
        return int(self.a_eq.shape[1])

    @property
    def constraints(self) -> int:
        return int(self.a_eq.shape[0]) + (int(self.a_ub.shape[0]) if self.a_ub is not None else 0)

    @classmethod
    def build(cls, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], hours: int,
              capacity: np.ndarray) -> _Model:
        """``groups``: per site group, its classes (first hours, last hours, work) and its sites (indices of
        sites with GPUs)."""
        parts: list[_Network] = []
        n_row = n_var = 0
        for a, d, w, sites in groups:
            parts.append(_network(a, d, w, hours, sites, n_row, n_var))
            n_row, n_var = parts[-1].end_row, parts[-1].end_var

        def joined(field: str) -> np.ndarray:
            return np.concatenate([x for part in parts for x in getattr(part, field)])

        zv, zs, zh = (np.concatenate([getattr(part, f) for part in parts]) for f in ("z_var", "z_site", "z_hour"))
        upper = np.full(n_var, np.inf)
        upper[zv] = capacity[zs]
        a_eq = sparse.csc_matrix((joined("vals"), (joined("rows"), joined("cols"))), shape=(n_row, n_var))
        a_ub = b_ub = ub_site = ub_hour = None
        if len(groups) > 1:  # a site-hour that several groups may use holds its capacity for all of them
            key, inverse, count = np.unique(zs * hours + zh, return_inverse=True, return_counts=True)
            shared = count[inverse] > 1
            if shared.any():
                row = np.cumsum(count > 1) - 1
                a_ub = sparse.csc_matrix((np.ones(int(shared.sum())), (row[inverse[shared]], zv[shared])),
                                         shape=(int((count > 1).sum()), n_var))
                ub_site, ub_hour = key[count > 1] // hours, key[count > 1] % hours
                b_ub = capacity[ub_site].astype(np.float64)
        return cls(a_eq, joined("b_eq"), a_ub, b_ub, ub_site, ub_hour, np.column_stack([np.zeros(n_var), upper]),
                   zv, zs, zh)

    def solve(self, per_gpu_hour: np.ndarray, what: str,
              shadow_prices: bool = False) -> tuple[float, np.ndarray | None]:
        """The least ``sum z[g, s, t] × per_gpu_hour[s, t]``, and with ``shadow_prices`` the price of each
        site-hour's capacity in the objective's unit per GPU-hour (float64 shaped as ``per_gpu_hour``): the
        dual values of the rows and upper bounds that hold it, which are 0 where the optimum leaves GPUs
        free."""
        c = np.zeros(self.variables)
        c[self.z_var] = per_gpu_hour[self.z_site, self.z_hour]
        # HiGHS's tolerances are absolute (1e-7): costs are scaled to at most 1 so that tiny ones (a clean
        # hour in kg per GPU-hour) are not taken for zero, and the optimum is scaled back.
        scale = float(np.abs(c).max()) if c.size else 0.0
        if scale > 0:
            c /= scale
        else:
            scale = 1.0
        res = None
        for method in _METHODS:
            res = linprog(c, A_ub=self.a_ub, b_ub=self.b_ub, A_eq=self.a_eq, b_eq=self.b_eq, bounds=self.bounds,
                          method=method)
            if res.status in (0, 2):
                break
        assert res is not None
        if res.status == 2:
            raise BoundInfeasible(f"the {what} LP is infeasible (HiGHS: {res.message}): the sites cannot serve "
                                  "the work inside the windows (at the sites each job may use); widen the windows "
                                  "or add capacity")
        if res.status != 0:
            raise BoundError(f"the {what} LP was not solved (HiGHS status {res.status}: {res.message})")
        shadow = None
        if shadow_prices:
            # linprog's marginals are d(objective)/d(bound), <= 0 for a binding upper bound or <= row
            shadow = np.zeros(per_gpu_hour.shape)
            np.add.at(shadow, (self.z_site, self.z_hour), -res.upper.marginals[self.z_var] * scale)
            if self.a_ub is not None:
                np.add.at(shadow, (self.ub_site, self.ub_hour), -res.ineqlin.marginals * scale)
            np.maximum(shadow, 0.0, out=shadow)  # -0.0 and solver noise
        return float(res.fun) * scale, shadow
