"""The loops of the time-shift search (:func:`policies.timeshift.plan`), compiled with Numba.

They do what the NumPy and Python code they replaced did (with values within the tie tolerance,
:data:`TIE_REL`, equal in both), in the same floating-point operations and the same order, so they find the
same site, hour and value, bit for bit (``tests/test_timeshift_speed_equivalence.py`` holds that code as the
reference and checks it): only the per-call overhead of some forty NumPy calls over a thousand sites is gone.

- :func:`start_now`: whether the plan allows a start now at one site, its value, and the best start now
  at any site (:func:`cheapest_fitting_now`), in one call; where the plan has no room, why.
- :func:`walk_now`: :func:`start_now` at each of the profile's sites, best score first, until one fits.
- :func:`cheapest_fitting_now`: of the sites that could take the job now, the one whose objective for a
  start now is lowest (ties: the earlier in ``feasible``), among those the plan has room for over the hours
  the run holds.
- :func:`search_later`: the best later start (value, then hour, then site, least first; values within the
  tie tolerance :data:`TIE_REL` are equal) among candidate sites, visited in batches of :data:`BATCH` from
  the lowest lower bound up, stopping at the first batch whose lower bound is above the best value found
  by more than that tolerance.

Units as in :mod:`policies.timeshift`: values in kg CO2e (``per_gpu`` in kW) or USD (``per_gpu`` in USD
per GPU-hour), hours counted from the hour containing ``now``, capacity in GPUs (float32, as the plan).
Compiled on first use and cached on disk (the next process loads it in milliseconds): in
``NUMBA_CACHE_DIR`` when it is set, else beside this file or in the user's cache folder, whichever can be
written; where none can (a read-only file system and no writable home), in memory only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class _Kernel:
    """A function for Numba, made a Numba dispatcher at its first call: Numba (half a second to import) is
    loaded by the first decision that needs it, not by every command that imports the policies. Then every
    kernel of the module replaces its own name there, so later calls through the module reach the
    dispatcher directly, and kernels that call one another see dispatchers when they are compiled."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options
        self.dispatcher: Any = None
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn

    def __call__(self, *args: Any) -> Any:
        if self.dispatcher is None:
            from numba import literal_unroll, njit

            names = self.fn.__globals__
            if "literal_unroll" in names:  # the module's stand-in (a kernel over a tuple of arrays of mixed types)
                names["literal_unroll"] = literal_unroll
            for name, value in list(names.items()):  # definition order: helpers before their callers
                if isinstance(value, _Kernel) and value.dispatcher is None:
                    try:
                        value.dispatcher = njit(cache=True, **value.options)(value.fn)
                    except RuntimeError:  # "no locator available": nowhere to write the cache
                        value.dispatcher = njit(cache=False, **value.options)(value.fn)
                    names[name] = value.dispatcher
        return self.dispatcher(*args)


def _jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, **options)``, applied at the first call (:class:`_Kernel`)."""
    return lambda fn: _Kernel(fn, options)

BATCH = 32  # sites whose later starts are searched at once (the NumPy code's batch size)
EPS32 = np.float32(1e-6)  # the plan's tolerance, in the plan's own precision
TIE_REL = 1e-9
"""Values (kg CO2e or USD) of two starts that differ by at most this share of the larger, plus :data:`TIE_ABS`,
are equal: a start's value is a difference of running sums of the forecast, so two hours the forecast makes
equally clean (a flat stretch, the zone's mean day repeated past the model's hours) differ in their last
bits, and without it the search would take the later one, or a site further down the list, for nothing."""
TIE_ABS = 1e-12
"""The absolute part of the tie tolerance (kg CO2e or USD), for values at or near 0."""


@_jit(inline="always")
def _lower(a: float, b: float) -> bool:
    """Whether value ``a`` is below ``b`` by more than the tie tolerance (:data:`TIE_REL` of the larger
    magnitude, plus :data:`TIE_ABS`); False where either is NaN. A finite value is lower than inf."""
    if not a < b:
        return False
    if b == np.inf or a == -np.inf:
        return True
    return b - a > TIE_REL * max(abs(a), abs(b)) + TIE_ABS


def lower(a: float, b: float) -> bool:
    """:func:`_lower` for Python callers (the same test, not compiled)."""
    if not a < b:
        return False
    if b == np.inf or a == -np.inf:
        return True
    return b - a > TIE_REL * max(abs(a), abs(b)) + TIE_ABS


@_jit(inline="always")
def _integral(cum: np.ndarray, forecast: np.ndarray, site: int, t: float) -> float:
    """Integral of site ``site``'s hourly forecast from its start to ``t`` hours (past its end the last hour
    stands): the running sum up to hour ``h``, plus the part of hour ``h`` up to ``t``."""
    hours = forecast.shape[1]
    h = min(int(np.floor(t)), hours - 1)
    return cum[site, h] + (t - h) * forecast[site, h]


@_jit(inline="always")
def _bar(need: float, reserve: np.float32) -> np.float32:
    """The free GPUs an hour needs for ``need`` plus ``reserve``, in the plan's precision, less its tolerance."""
    return np.float32(np.float32(np.float32(need) + reserve) - EPS32)


@_jit(inline="always")
def _hour_bar(bar: np.float32, need: float, reserve: np.float32, kept: np.ndarray, near: np.ndarray, site: int,
              column: int, h: int) -> np.float32:
    """The bar of hour ``h``: ``bar`` (need plus ``reserve``), or need plus the room kept for latency-bound
    jobs there when that is more: ``kept`` (float32[sites, models], or empty: none kept) less what they hold
    or have booked in that hour (``near``: float[sites, models, hours]; policies.latency_reserve)."""
    if kept.shape[0] == 0:
        return bar
    level = kept[site, column]
    if not level > 0:
        return bar
    held = np.float32(level - near[site, column, h])
    if not held > reserve:
        return bar
    return _bar(need, held)


@_jit(inline="always")
def _room(plan_free: np.ndarray, site: int, column: int, first: int, end: int, need: float,
          reserve: np.float32, kept: np.ndarray, near: np.ndarray) -> bool:
    """Whether the plan has room for ``need`` GPUs plus ``reserve`` (or plus the room kept for latency-bound
    jobs, where more: :func:`_hour_bar`) at ``site`` in model ``column`` in every hour of ``[first, end)``,
    in the plan's own precision (float32, within its tolerance)."""
    bar = _bar(need, reserve)
    if kept.shape[0] == 0 or not kept[site, column] > reserve:  # nothing kept above the bar: the bar alone
        for h in range(first, end):
            if not plan_free[site, column, h] >= bar:
                return False
        return True
    for h in range(first, end):
        if not plan_free[site, column, h] >= _hour_bar(bar, need, reserve, kept, near, site, column, h):
            return False
    return True


@_jit(inline="always")
def _taken(plan_free: np.ndarray, site: int, column: int, first: int, end: int, t0: float, t1: float, need: float,
           reserve: np.float32, kept: np.ndarray, near: np.ndarray) -> float:
    """GPU-hours of a run of ``need`` GPUs from ``t0`` to ``t1`` hours (counted from now's hour) that would come
    out of the room kept for latency-bound jobs, over its hours ``[first, end)``: in each hour, the part of
    :func:`_hour_bar` above need plus ``reserve`` that the plan has not free, at most ``need``, times the
    share of the hour the run holds. 0 when ``kept`` is empty."""
    if kept.shape[0] == 0 or not kept[site, column] > reserve:
        return 0.0
    total = 0.0
    for h in range(first, end):
        share = min(float(h + 1), t1) - max(float(h), t0)
        if share > 0.0:
            total += share * _taken_in(plan_free, site, column, need, reserve, kept, near, h)
    return total


@_jit(inline="always")
def _taken_in(plan_free: np.ndarray, site: int, column: int, need: float, reserve: np.float32, kept: np.ndarray,
              near: np.ndarray, h: int) -> float:
    """:func:`_taken` for hour ``h`` alone."""
    if kept.shape[0] == 0:
        return 0.0
    level = kept[site, column]
    if not level > 0:
        return 0.0
    held = np.float32(level - near[site, column, h])
    if not held > reserve:
        return 0.0
    over = float(_bar(need, held)) - float(plan_free[site, column, h])
    if not over > 0.0:
        return 0.0
    return min(over, need)


@_jit(inline="always")
def _priced_taken(site: int, column: int, feasible: np.ndarray, need: float, d_h: float, into_h: float,
                  plan_free: np.ndarray, reserve: np.ndarray, kept: np.ndarray, near: np.ndarray, first: int,
                  now_hours: int, kept_price: float, other: float, at: int, floor: float) -> float:
    """The GPU-hours a start now at an ``ok`` site would take from the room kept for latency-bound jobs, where
    priced (:func:`_taken`; 0 where none is kept above the bar, or the plan has no room for the run: start_now
    says why); -1 where :func:`start_now` turns it away for that room (``why`` 1) before it reads the start's
    value: its price for the room alone (plus ``floor``) is above the best start now elsewhere (by more than
    the tie tolerance) (``other``,
    at ``at``). Inline in the walk too, the same test with the same values without a call: compiled code pays
    for each call's array arguments, and a walk may turn away dozens of sites this way."""
    if not (kept.shape[0] > 0 and kept_price < np.inf) or not kept[site, column] > reserve[site]:
        return 0.0  # nothing priced, or nothing kept above the bar here: nothing taken
    if not _room(plan_free, site, column, first, now_hours, need, reserve[site], kept[:0], near):
        return 0.0
    taken = _taken(plan_free, site, column, first, now_hours, into_h, into_h + d_h, need, reserve[site], kept, near)
    if (taken > 0.0 and feasible.shape[0] > 1 and at >= 0 and at != site
            and _lower(other, floor + kept_price * taken)):
        return -1.0
    return taken


@_jit()
def room_now(plan_free: np.ndarray, site: int, column: int, first: int, end: int, need: float,
             reserve: np.ndarray, kept: np.ndarray, near: np.ndarray) -> bool:
    """:func:`_room` for one site, with its ``reserve`` from the per-site array (for Python callers)."""
    return _room(plan_free, site, column, first, end, need, reserve[site], kept, near)


@_jit()
def cheapest_fitting_now(feasible: np.ndarray, ok: np.ndarray, per_gpu: np.ndarray, need: float, d_h: float,
                         into_h: float, forecast: np.ndarray, cum: np.ndarray, carbon: bool,
                         plan_free: np.ndarray, col: np.ndarray, reserve: np.ndarray, kept: np.ndarray,
                         near: np.ndarray, first: int, now_hours: int, kept_price: float) -> tuple[float, int]:
    """(value, site) of the first site of ``feasible`` in ascending order of its value now (a stable
    order; values within the tie tolerance, :func:`_lower`, are equal) that is ``ok`` and whose plan column
    has room for ``need`` plus its ``reserve`` in hours ``[first, now_hours)``; (inf, -1) when none has. With a finite ``kept_price`` the room kept for
    latency-bound jobs is not a bar: a start that takes some of it pays ``kept_price`` per GPU-hour taken
    (:func:`_taken`), added to its value."""
    soft = kept.shape[0] > 0 and kept_price < np.inf
    best_value = np.inf
    best_site = -1
    for i in range(feasible.shape[0]):
        site = feasible[i]
        if not ok[site]:
            continue
        rate = per_gpu[site] * need
        if carbon:
            value = rate * (_integral(cum, forecast, site, into_h + d_h) - _integral(cum, forecast, site, into_h)) / 1000.0
        else:
            value = rate * d_h
        if soft:
            if not _lower(value, best_value):  # the price only adds
                continue
            if not _room(plan_free, site, col[site], first, now_hours, need, reserve[site], kept[:0], near):
                continue
            value = value + kept_price * _taken(plan_free, site, col[site], first, now_hours, into_h, into_h + d_h,
                                                need, reserve[site], kept, near)
            if not _lower(value, best_value):
                continue
            best_value = value
            best_site = site
            continue
        if not _lower(value, best_value):  # NaN never wins; a tie (within the tolerance) keeps the earlier site
            continue
        if _room(plan_free, site, col[site], first, now_hours, need, reserve[site], kept, near):
            best_value = value
            best_site = site
    return best_value, best_site


@_jit()
def start_now(site: int, column: int, rate: float, ok: np.ndarray, feasible: np.ndarray, per_gpu: np.ndarray,
              need: float, d_h: float, into_h: float, forecast: np.ndarray, cum: np.ndarray, carbon: bool,
              plan_free: np.ndarray, col: np.ndarray, reserve: np.ndarray, kept: np.ndarray, near: np.ndarray,
              first: int, now_hours: int, kept_price: float, other: float, at: int,
              floor: float) -> tuple[bool, float, float, int, int, int]:
    """A start now at ``site`` on model ``column`` (``rate``: kW or USD per GPU-hour there): (whether the plan
    allows it, its value, the value and site of the best start now at any site the plan allows, this one
    included, and -1, 0). A site that is not ``ok`` cannot be checked by the plan: it is allowed, valued 0.
    The best start anywhere is :func:`cheapest_fitting_now`'s (``other``, ``at``: the caller's, computed once
    for all the sites it tries; ``at`` -2 where not yet computed, when this computes it) when there is more
    than one feasible site, taken over this one's only where lower (a tie, within the tolerance of
    :func:`_lower`: the lower index).

    Where the plan has no room: (False, inf, inf, -1, why, hour), for the explanation: ``why`` 0 where the
    run itself does not fit, from ``hour`` on (the first hour of ``[first, now_hours)`` short of ``need``;
    ``first`` when none is, as with NaN); 1 where it would take the room kept for latency-bound jobs; 2 the
    headroom. With a finite ``kept_price`` that room is not a bar but a price per GPU-hour taken from it,
    added to the value (:func:`cheapest_fitting_now`); a start that takes some of it is allowed only where no
    start now elsewhere costs less (else ``why`` 1). ``floor``: a bound below every start's value here (0 where
    no forecast hour or price is negative; -inf: none known), so that a start whose price alone for the room
    it takes is above the best elsewhere is turned away before its value is read."""
    soft = kept.shape[0] > 0 and kept_price < np.inf
    hard_kept = kept[:0] if soft else kept
    taken = 0.0  # GPU-hours it takes from the room kept, where priced
    if ok[site]:
        if not _room(plan_free, site, column, first, now_hours, need, reserve[site], hard_kept, near):
            bare = _bar(need, np.float32(0.0))
            if not _room(plan_free, site, column, first, now_hours, need, np.float32(0.0), kept[:0], near):
                for h in range(first, now_hours):
                    if plan_free[site, column, h] < bare:
                        return False, np.inf, np.inf, -1, 0, h
                return False, np.inf, np.inf, -1, 0, first
            if kept.size and _room(plan_free, site, column, first, now_hours, need, reserve[site], kept[:0], near):
                return False, np.inf, np.inf, -1, 1, 0
            return False, np.inf, np.inf, -1, 2, 0
        if soft:
            taken = _priced_taken(site, column, feasible, need, d_h, into_h, plan_free, reserve, kept, near, first,
                                  now_hours, kept_price, other, at, floor)
            if taken < 0.0:
                return False, np.inf, np.inf, -1, 1, 0  # its price alone is more than the best start elsewhere
        if carbon:
            value = rate * need * (_integral(cum, forecast, site, into_h + d_h)
                                   - _integral(cum, forecast, site, into_h)) / 1000.0
        else:
            value = rate * need * d_h
        value = value + kept_price * taken if soft else value
    else:
        value = 0.0
    best_value, best_site = value, site
    if feasible.shape[0] > 1:
        if at == -2:
            other, at = cheapest_fitting_now(feasible, ok, per_gpu, need, d_h, into_h, forecast, cum, carbon,
                                             plan_free, col, reserve, kept, near, first, now_hours, kept_price)
        # min((other, at), (value, site)) as Python compares tuples, values within the tie tolerance equal
        if at >= 0 and not (_lower(value, other) or (not _lower(other, value) and site < at)):
            best_value, best_site = other, at
    if soft and ok[site] and taken > 0.0 and best_site != site:
        return False, np.inf, np.inf, -1, 1, 0  # it takes priced room where a start elsewhere costs less
    return True, value, best_value, best_site, -1, 0


@_jit(inline="always")
def _precedes(totals: np.ndarray, i: int, j: int) -> bool:
    """Whether site ``i`` comes before site ``j`` in descending order of ``totals``: a higher score, NaN after
    every number, equals in index order (the order of a stable sort of ``-totals``)."""
    a, b = totals[i], totals[j]
    if a != a:
        return b != b and i < j
    return b != b or a > b or (a == b and i < j)


@_jit()
def walk_now(totals: np.ndarray, models: np.ndarray, room: np.ndarray, free: np.ndarray, columns: np.ndarray,
             memory: np.ndarray, tdp: np.ndarray, usd: np.ndarray, ok: np.ndarray, feasible: np.ndarray,
             per_gpu: np.ndarray, need: float, d_h: float, into_h: float, forecast: np.ndarray, cum: np.ndarray,
             carbon: bool, plan_free: np.ndarray, col: np.ndarray, reserve: np.ndarray, kept: np.ndarray,
             near: np.ndarray, first: int, now_hours: int, kept_price: float, other: float, at: int, floor: float,
             keep: int) -> tuple[int, int, float, float, int, np.ndarray, int]:
    """:func:`start_now` at each of the profile's ``feasible`` sites, in descending order of their ``totals``
    (ties: the earlier in ``feasible``, as a stable sort), until the plan allows one. The model column each
    would start on: ``models[k]`` for ``feasible[k]`` where given (``models[0]`` for all where it holds one),
    else, as ``GpuFit.smallest_at``, of the
    ``columns`` with ``room`` at the site (bool and int32 [n_sites, len(columns)], with ``free`` GPUs), the
    least ``memory`` per GPU, then the most free, then the first (the plan's ``col`` where none has room). Its
    rate: ``tdp`` (kW per model) for carbon, else ``usd`` ([n_sites, n_models] per GPU-hour; NaN: inf).

    Returns (the site chosen, -1 when none; its model; its value; the value and site of the best start now
    anywhere; the first ``keep`` sites turned away before it, int64[keep, 4] rows of site, ``why``, ``hour``
    (as :func:`start_now` gives them; ``why`` 3: not ``ok``, the plan cannot check it) and model, -1 past the
    last; how many were turned away). One call instead of one per site: a profile whose best sites are
    turned away for the room kept for latency-bound jobs tries several, and a third of ``green``'s walks turn
    away more than fifty.

    Each site's answer depends on that site alone, so the site chosen is the first in score order of those the
    plan allows, and the walk needs no order: one pass in index order tries a site only where it comes before
    the best allowed so far (:func:`_precedes`). Every site before the one chosen is tried and turned away
    (it came before every earlier best), and the few others tried are those that came before a passing best
    (about ln(n) / the share allowed). The sites turned away before the one chosen are then counted and their
    first ``keep`` put in order from that short list. An earlier walk took the sites in order, from scans that
    picked the best 16, then 32, 64 and 128: a scan of a thousand scores costs as much as trying a dozen sites,
    and a long walk made four of them."""
    n = totals.shape[0]
    given = models.shape[0] > 0
    tried = np.empty((n, 4), dtype=np.int64)  # the sites tried and turned away: index in feasible, why, hour, model
    n_tried = 0
    chosen, chosen_model = -1, -1
    chosen_value, best_value, best_site = np.inf, np.inf, -1
    for k in range(n):
        if chosen >= 0 and not _precedes(totals, k, chosen):
            continue
        site = feasible[k]
        if given:
            model = models[k if models.shape[0] > 1 else 0]
        else:
            model = -1
            best_memory, best_free = np.inf, -1
            for i in range(columns.shape[0]):
                if room[site, i] and (model < 0 or memory[i] < best_memory
                                      or (memory[i] == best_memory and free[site, i] > best_free)):
                    model, best_memory, best_free = columns[i], memory[i], free[site, i]
            if model < 0:
                model = col[site]
        why, hour = 3, 0
        if ok[site]:
            why = 1
            if carbon:
                rate = float(tdp[model])
            else:
                rate = usd[site, model]
                if not rate == rate:
                    rate = np.inf
            if _priced_taken(site, model, feasible, need, d_h, into_h, plan_free, reserve, kept, near, first,
                             now_hours, kept_price, other, at, floor) >= 0.0:
                fits, value, best, best_at, why, hour = start_now(
                    site, model, rate, ok, feasible, per_gpu, need, d_h, into_h, forecast, cum, carbon, plan_free,
                    col, reserve, kept, near, first, now_hours, kept_price, other, at, floor)
                if fits:
                    chosen, chosen_model, chosen_value, best_value, best_site = k, model, value, best, best_at
                    continue
        tried[n_tried, 0], tried[n_tried, 1], tried[n_tried, 2], tried[n_tried, 3] = k, why, hour, model
        n_tried += 1
    # The sites turned away before the one chosen (all of them where none was), the first ``keep`` in order.
    passed = np.full((keep, 4), -1, dtype=np.int64)
    order = np.empty(keep, dtype=np.int64)  # their indices in feasible, in order
    n_passed = 0
    for t in range(n_tried):
        k = tried[t, 0]
        if chosen >= 0 and not _precedes(totals, k, chosen):
            continue
        n_passed += 1
        if keep == 0:
            continue
        j = min(n_passed, keep) - 1
        if n_passed > keep and not _precedes(totals, k, order[j]):
            continue  # (the first ``keep`` are already before it)
        while j > 0 and _precedes(totals, k, order[j - 1]):
            order[j] = order[j - 1]
            passed[j, 0], passed[j, 1], passed[j, 2], passed[j, 3] = (passed[j - 1, 0], passed[j - 1, 1],
                                                                      passed[j - 1, 2], passed[j - 1, 3])
            j -= 1
        order[j] = k
        passed[j, 0], passed[j, 1], passed[j, 2], passed[j, 3] = feasible[k], tried[t, 1], tried[t, 2], tried[t, 3]
    if chosen < 0:
        return -1, -1, np.inf, np.inf, -1, passed, n_passed
    return feasible[chosen], chosen_model, chosen_value, best_value, best_site, passed, n_passed




@_jit()
def search_later(ok: np.ndarray, cleanest: np.ndarray, threshold: float, per_gpu: np.ndarray, need: float,
                 d_h: float, forecast: np.ndarray, cum: np.ndarray, carbon: bool, plan_free: np.ndarray,
                 col: np.ndarray, reserve: np.ndarray, kept: np.ndarray, near: np.ndarray, last_slot: int,
                 run_hours: int, span: int, penalty: np.ndarray,
                 kept_price: float) -> tuple[float, int, int, int, float]:
    """(value, slot, site, model column, value without the penalty) of the best start at a whole hour
    ``1 .. last_slot`` where the plan has room in every hour of the run (hours past ``span`` are not
    checked); (inf, 0, 0, 0, inf) when none has.
    The candidates are the ``ok`` sites whose lower bound (the run at ``cleanest``, each site's cleanest
    forecast hour ahead, or its price) is below ``threshold``, visited from the lowest bound up in batches;
    within a batch, a site whose bound is above the best start found so far is passed over. Values within the
    tie tolerance (:func:`_lower`) are equal: the earlier hour wins, then the lower site index. ``penalty``
    (float64[last_slot + 1], or empty: none) is added to the value of a start at hour ``k``: the price of the
    risk it adds to the deadline (policies.runtime_risk); at least 0, so the lower bounds still hold. With a
    finite ``kept_price`` the room kept for latency-bound jobs is not a bar: a start pays ``kept_price`` per
    GPU-hour it takes from it (:func:`_taken`, its last hour pro rata), also at least 0."""
    soft = kept.shape[0] > 0 and kept_price < np.inf
    hard_kept = kept[:0] if soft else kept
    n_sites = ok.shape[0]
    floor_value = np.empty(n_sites)
    for site in range(n_sites):
        if carbon:
            floor_value[site] = per_gpu[site] * need * d_h * cleanest[site] / 1000.0
        else:
            floor_value[site] = per_gpu[site] * need * d_h
    candidates = np.flatnonzero(ok & (floor_value < threshold))
    if candidates.shape[0] > BATCH:
        candidates = candidates[np.argsort(floor_value[candidates], kind="mergesort")]  # stable
    best_value, best_slot, best_site, best_col, best_pure = np.inf, 0, 0, 0, np.inf
    n = candidates.shape[0]
    short = np.zeros(span + 1, dtype=np.int32)
    taken = np.zeros(span + 1)  # running sum of the GPU-hours a run would take from the room kept
    full_hours = int(np.floor(d_h))
    part = d_h - full_hours
    priced = penalty.shape[0] > last_slot
    for lo in range(0, n, BATCH):
        # (a site whose bound is within the tie tolerance of the best may still tie it at an earlier hour)
        if _lower(best_value, floor_value[candidates[lo]]):
            break
        sites = np.sort(candidates[lo:lo + BATCH])
        # The batch's least (value, slot, site): the earliest hour wins a tie (values within the tolerance of
        # _lower), then the lower site index.
        b_value, b_slot, b_site, b_col, b_pure = np.inf, 0, 0, 0, np.inf
        b_above = np.inf  # every value above this is above b_value by more than the tie tolerance (a cheap test)
        found = False
        for i in range(sites.shape[0]):
            site = sites[i]
            if _lower(best_value, floor_value[site]) or (found and _lower(b_value, floor_value[site])):
                continue  # every start here is worth more than one found already (its bound is above it)
            c = col[site]
            bar = _bar(need, reserve[site])
            # Nothing kept at this site for this model: the plain bar in every hour (the same answers, faster).
            keeps = kept.shape[0] > 0 and kept[site, c] > 0
            site_kept = hard_kept if keeps else kept[:0]
            for h in range(span):
                short[h + 1] = short[h] + (1 if plan_free[site, c, h] < _hour_bar(bar, need, reserve[site], site_kept,
                                                                                   near, site, c, h) else 0)
            with_price = soft and keeps
            if with_price:
                for h in range(span):
                    taken[h + 1] = taken[h] + _taken_in(plan_free, site, c, need, reserve[site], kept, near, h)
            rate = per_gpu[site] * need
            fixed = rate * d_h  # the cost objective: the same for every start
            for k in range(1, last_slot + 1):
                end = min(k + run_hours, span)
                if short[end] != short[k]:
                    continue
                if carbon:
                    value = rate * (_integral(cum, forecast, site, k + d_h)
                                    - _integral(cum, forecast, site, float(k))) / 1000.0
                else:
                    value = fixed
                pure = value
                if priced:
                    value = value + penalty[k]
                if with_price:  # the whole hours the run holds, and the share of its last one
                    whole_end = min(k + full_hours, span)
                    value = value + kept_price * (taken[whole_end] - taken[k])
                    if part > 0.0 and whole_end < span:
                        value = value + kept_price * part * (taken[whole_end + 1] - taken[whole_end])
                if value > b_above:
                    continue  # (the common case: no better, and no tie)
                if (not found or _lower(value, b_value)
                        or (not _lower(b_value, value) and (k < b_slot or (k == b_slot and site < b_site)))):
                    if value == value:  # NaN never wins (np.argmin would pick it; the plan's values are finite)
                        b_value, b_slot, b_site, b_col, b_pure = value, k, site, c, pure
                        b_above = value + 2.0 * (TIE_REL * abs(value) + TIE_ABS)
                        found = True
        if found and (_lower(b_value, best_value) or (not _lower(best_value, b_value) and (
                b_slot < best_slot or (b_slot == best_slot and b_site < best_site)))):
            best_value, best_slot, best_site, best_col, best_pure = b_value, b_slot, b_site, b_col, b_pure
    return best_value, best_slot, best_site, best_col, best_pure
