"""GPU fit: the site has the requested model (any model if none is named), each GPU has at least the
requested memory, and enough of it is free: ``count`` whole GPUs, or for a fractional job (``milli`` below
1000) a shared GPU with that share free or one whole free GPU. Units: GPUs, thousandths of a GPU, GiB.

This issue counts GPUs per site; node and NVLink topology are checked by the site-local policies.
"""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot


def fit_matrix(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """bool[n_sites, n_models]: where the job would fit, per model column."""
    if req.fractional:
        fits = (snap.free_gpus > 0) | (snap.shared_free_milli >= req.milli)
    else:
        fits = snap.free_gpus >= req.count
    if req.memory_gib:
        fits &= snap.memory_gib >= req.memory_gib
    else:
        fits &= snap.has_model
    return fits


def fit_row(req: JobRequest, snap: Snapshot, site: int) -> np.ndarray:
    """bool[n_models]: which models the job would fit at one site."""
    free = snap.free_gpus[site]
    if req.fractional:
        fits = (free > 0) | (snap.shared_free_milli[site] >= req.milli)
    else:
        fits = free >= req.count
    return fits & (snap.memory_gib[site] >= req.memory_gib if req.memory_gib else snap.memory_gib[site] > 0)


def fit_column(req: JobRequest, snap: Snapshot, column: int) -> np.ndarray:
    """bool[n_sites]: where the job fits in one model column."""
    free = snap.free_gpus[:, column]
    if req.fractional:
        fits = (free > 0) | (snap.shared_free_milli[:, column] >= req.milli)
    else:
        fits = free >= req.count
    if req.memory_gib:
        fits &= snap.memory_gib[:, column] >= req.memory_gib
    return fits


class GpuFitFilter:
    code = "gpus-do-not-fit"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        if req.model is not None:
            return fit_column(req, snap, MODEL_INDEX[req.model])
        return fit_matrix(req, snap).any(axis=1)

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        what = req.model or "GPUs of any model"
        mem = view.memory_gib[site]
        if mem == 0:
            if req.model is None and req.memory_gib:
                return f"no GPU model here has {req.memory_gib:g} GiB per GPU"
            return f"site has no {what}"
        if req.memory_gib and mem < req.memory_gib:
            return f"{what} here have {mem:g} GiB per GPU; the job needs {req.memory_gib:g} GiB"
        free = view.free[site]
        if req.fractional:
            return (
                f"job needs {req.milli}/1000 of one {what}; {free} whole GPUs free and the largest "
                f"shared GPU has {view.shared[site]}/1000 free"
            )
        return f"job needs {req.count} {what}; {free} free"
