"""Which model columns a request could use at each site (shared by the scorers)."""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import fit_matrix
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
    known = ~np.isnan(raw)
    if known.all():
        return raw
    worst = float(raw[known].max()) + 1.0 if known.any() else 0.0
    return np.where(known, raw, worst)


def cheapest_with_room(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """USD per GPU-hour per site of the cheapest model the job could use that has room for it now (NaN:
    none is priced)."""
    prices = np.where(usable_models(req, snap) & fit_matrix(req, snap), snap.usd_per_gpu_hour, np.nan)
    with np.errstate(invalid="ignore"):
        return np.fmin.reduce(prices, axis=1)
