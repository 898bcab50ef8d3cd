"""Which model columns a request could use at each site, and the cheapest of them with room (shared by the
scorers). ``usable_models`` and ``cheapest_with_room`` work over every model column; the scorers call the
``Fit`` forms, which work over the request's usable columns only and share one fit per decision."""

from __future__ import annotations

import numpy as np

from policies import _scores
from policies.filters.gpu_fit import Fit, fit_matrix
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot


def usable_models(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """bool[n_sites, n_models]: the named model, or every model with enough memory per GPU."""
    if req.model is not None:
        mask = np.zeros_like(snap.has_model)
        mask[:, MODEL_INDEX[req.model]] = snap.has_model[:, MODEL_INDEX[req.model]]
        return mask
    return snap.memory_gib >= req.memory_gib if req.memory_gib else snap.has_model


def unknown_last(raw: np.ndarray) -> np.ndarray:
    """Lower-is-better values with NaN (unknown) replaced by one more than the worst known value, so a site
    the broker knows nothing about ranks after every site it does (and never wins a tie with one)."""
    if raw.dtype.kind not in "fc" or not raw.size:
        return raw  # integers are never unknown
    worst = np.fmax.reduce(raw)  # the largest known value; NaN when none is known
    return np.where(np.isnan(raw), float(worst) + 1.0 if worst == worst else 0.0, raw)


def unknown_with_room(fit: Fit, values: np.ndarray) -> np.ndarray:
    """bool[n_sites]: where no model the job could use with room now has a known value among ``values``
    (float64[c], or [n_sites, c], over ``fit``'s usable columns): the sites whose raw value
    ``least_scaled`` or ``unknown_last`` made up as a stand-in (``Scorer.unknown_fit``): where
    ``least_where(fit.room, values)`` is NaN, without working out the least."""
    return ~np.logical_and(fit.room, ~np.isnan(values)).any(axis=1)


def cheapest_with_room(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """USD per GPU-hour per site of the cheapest model the job could use that has room for it now (NaN:
    none is priced)."""
    prices = np.where(usable_models(req, snap) & fit_matrix(req, snap), snap.usd_per_gpu_hour, np.nan)
    with np.errstate(invalid="ignore"):
        return np.fmin.reduce(prices, axis=1)


def least_where(ok: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64[n_sites]: per row of ``ok`` (bool[n_sites, c]), the least of ``values`` (float64[c], or
    [n_sites, c]) where ``ok`` is true; NaN where it is true nowhere or only beside NaN values."""
    c = ok.shape[1]
    if c == 1:
        return np.where(ok[:, 0], values[..., 0], np.nan)
    if c == 0:
        return np.full(ok.shape[0], np.nan)
    return np.fmin.reduce(np.where(ok, values, np.nan), axis=1)


def _usable_prices(fit: Fit) -> np.ndarray:
    snap, usable = fit.snap, fit.usable
    if usable.named:
        j = usable.column_list[0]
        return snap.usd_per_gpu_hour[:, j:j + 1]
    return snap.derived(("usd-per-gpu-hour", usable.key), usable.of, snap.usd_per_gpu_hour)


def unknown_price(fit: Fit) -> np.ndarray:
    """bool[n_sites]: where ``cheapest_known_last`` stands in for an unknown price (no model with room priced)."""
    return unknown_with_room(fit, _usable_prices(fit))


def cheapest_known_last(fit: Fit, factors: tuple[float, ...] = (), divisor: float = 1.0) -> np.ndarray:
    """``unknown_last(cheapest_with_room(req, snap) * factors[0] * ... / divisor)`` over the decision's
    shared fit, the same values, in one compiled pass (``policies._scores.least_scaled``)."""
    scale = np.array(factors, dtype=np.float64)
    least = _scores.least_scaled(fit.room, _usable_prices(fit), _scores.NO_VALUES, scale, divisor)
    least.flags.writeable = False  # (raw values are read, never written: the pipeline takes them as they are)
    return least
