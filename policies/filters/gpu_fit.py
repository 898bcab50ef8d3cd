"""GPU fit: the site has the requested model (any model if none is named), each GPU has at least the
requested memory, and enough of it is free: ``count`` whole GPUs, or for a fractional job (``milli`` below
1000) a shared GPU with that share free or one whole free GPU. Units: GPUs, thousandths of a GPU, GiB.

GPUs a site reports its tenant could reclaim from borrowers of its guarantee on the model (``QuotaView.extra``),
or that preemptible work of lower priority holds there on the model (``Snapshot.preemptible_room``), count as
free for the job (a placement that relies on them drives free GPUs below 0, so a later job of the pass finds
them taken): the site preempts to admit it (its victim search decides exactly whom, and may refuse). Node
and NVLink topology, MIG slices and shared-GPU memory are checked exactly by the site itself
(``policies.inventory``); here a MIG request fits where the site reports that many slices of its profile could still be made
(``ModelCapacity.mig_free_slices``), and a GPU shared by memory is sized as ``JobRequest`` explains.

:class:`Fit` works out where one request fits once per decision, over only the model columns it could use,
and the pipeline shares it with the scorers that look at free capacity (``raw_fit``); ``fit_matrix``,
``fit_row`` and ``fit_column`` are the same rule over whole arrays.
"""

from __future__ import annotations

import numpy as np

from broker import ids
from policies.filters import FitView
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest, Snapshot


class Usable:
    """The model columns a request could use anywhere (``usable_models`` is false in every other one), fixed
    per snapshot and (model, memory per GPU), so kept in ``Snapshot.derived``.

    ``columns``: int[c], ascending; ``mask``: bool[n_sites, c], column-major: ``usable_models`` there (the
    named model where a site has it, or the models with enough memory per GPU); ``key``: what it was made
    for, for the caches of values over the same columns."""

    __slots__ = ("columns", "column_list", "mask", "named", "key", "tdp_kw", "memory_order", "memory_array", "span")

    def __init__(self, req: JobRequest, snap: Snapshot, key: tuple[object, ...]) -> None:
        self.key = key
        self.named = req.model is not None
        if req.model is not None:
            j = MODEL_INDEX[req.model]
            self.columns = np.array([j])
            self.mask = snap.has_model[:, j:j + 1]
        else:
            full = snap.memory_gib >= req.memory_gib if req.memory_gib else snap.has_model
            self.columns = np.flatnonzero(full.any(axis=0))
            self.mask = np.asfortranarray(full[:, self.columns])
            self.mask.flags.writeable = False
        self.column_list: list[int] = self.columns.tolist()
        # The columns as a slice where they are adjacent (a view of a matrix's columns, not a copy).
        first, last = (self.column_list[0], self.column_list[-1]) if self.column_list else (0, -1)
        self.span: slice | None = slice(first, last + 1) if last - first + 1 == len(self.column_list) else None
        self.tdp_kw: list[float] = TDP_KW[self.columns].tolist()  # board power per usable column
        # Per usable column: GPU memory of the model, the first key of ``choose_model``'s best fit.
        self.memory_order: list[float] = [ids.GPU_MODEL_BY_ID[ids.GPU_MODEL_IDS[c]].memory_gib
                                          for c in self.column_list]
        self.memory_array = np.array(self.memory_order, dtype=np.float64)  # the same, for compiled code

    def of(self, matrix: np.ndarray) -> np.ndarray:
        """``matrix`` ([n_sites, n_models]) in the usable columns only, column-major."""
        return np.asfortranarray(matrix[:, self.columns])

    def total(self, gpus: np.ndarray) -> np.ndarray:
        """Per site: the sum of ``gpus`` ([n_sites, n_models]) over the models usable there."""
        return (gpus[:, self.columns] * self.mask).sum(axis=1)


def usable_columns(req: JobRequest, snap: Snapshot) -> Usable:
    """The request's :class:`Usable` columns (cached per snapshot)."""
    key = ("usable", req.model) if req.model is not None else ("usable", None, req.memory_gib)
    return snap.derived(key, Usable, req, snap, key)


class Fit:
    """Where one request fits in one snapshot, worked out at most once per decision over the model columns
    it could use (``usable.columns``), and shared by the GPU-fit filter and the scorers that look at free
    capacity. Free capacity changes with every ``assume``: make a new one for each decision."""

    __slots__ = ("req", "snap", "usable", "_free", "_room", "_sites")

    def __init__(self, req: JobRequest, snap: Snapshot) -> None:
        self.req = req
        self.snap = snap
        self.usable = usable_columns(req, snap)
        self._free: np.ndarray | None = None
        self._room: np.ndarray | None = None
        self._sites: np.ndarray | None = None

    @property
    def free(self) -> np.ndarray:
        """int32[n_sites, c], column-major: free whole GPUs in each usable column now (a view of the
        snapshot's where the columns are adjacent: read it before anything is assumed)."""
        if self._free is None:
            span = self.usable.span
            self._free = self.snap.free_gpus[:, self.usable.columns if span is None else span]
        return self._free

    @property
    def room(self) -> np.ndarray:
        """bool[n_sites, c], column-major: the model is usable there and has room for the job now (in full,
        ``usable_models(req, snap) & fit_matrix(req, snap)``, which is false outside the usable columns)."""
        if self._room is None:
            self._work()
        return self._room  # type: ignore[return-value]

    @property
    def sites(self) -> np.ndarray:
        """bool[n_sites]: the GPU-fit filter's answer."""
        if self._sites is None:
            self._work()
        return self._sites  # type: ignore[return-value]

    def _work(self) -> None:
        req, usable = self.req, self.usable
        cols = usable.columns
        shared = None
        if req.fractional:
            shared = self.snap.shared_free_milli
            shared = shared[:, cols[0]:cols[0] + 1] if usable.named else shared[:, cols]
        mig = _mig_slices(self.snap, req)[:, cols] if req.mig_profile is not None else None
        reclaim = _reclaim(self.snap, req, cols)
        capacity = _room(req, self.free, shared, mig, reclaim)
        if not usable.named:
            room = np.logical_and(capacity, usable.mask, out=capacity)
            self._room, self._sites = room, np.logical_or.reduce(room, axis=1)
            return
        # As fit_column: the filter checks memory only when the job asks for some, and not that the site
        # has the model (a site without it has no free GPUs of it), unless GPUs it might preempt count: those
        # are the site's, of any model; the scorers' room also needs the model.
        fits = capacity[:, 0]
        if reclaim is not None:
            fits = fits & usable.mask[:, 0]
        if req.memory_gib:
            j, memory = usable.column_list[0], req.memory_gib
            fits = fits & self.snap.derived(("memory-column", j, memory), _at_least, self.snap.memory_gib, j, memory)
        self._sites = fits
        self._room = (fits & usable.mask[:, 0])[:, None]

    def smallest_at(self, site: int) -> int:
        """``choose_model`` at ``site`` for a job that names no model: of the usable columns with room, the
        one with the least memory per GPU, then the most free GPUs, then the first (-1: none has room)."""
        usable = self.usable
        best, best_key = -1, (0.0, 0)
        for c, ok, memory, free in zip(usable.column_list, self.room[site].tolist(), usable.memory_order,
                                       self.free[site].tolist(), strict=True):
            if ok and (best < 0 or (memory, -free) < best_key):
                best, best_key = c, (memory, -free)
        return best


def _at_least(memory_gib: np.ndarray, column: int, memory: float) -> np.ndarray:
    return memory_gib[:, column] >= memory


def _reclaim(snap: Snapshot, req: JobRequest, columns: np.ndarray | None = None) -> np.ndarray | None:
    """float64[n_sites, len(columns)] (or [n_sites, 1], the same for every column): GPUs a site might preempt
    for the job on each model of ``columns`` (all: None) (None: none anywhere): those its tenant could reclaim of
    its guarantee from borrowers on that model (``QuotaView.extra``), or those held by preemptible work of lower
    priority on that model (``Snapshot.preemptible_room``), whichever is more."""
    if req.mig_profile is not None or (snap.quota is None and not snap.preempt_levels):
        return None
    columns = _ALL_COLUMNS if columns is None else columns
    reclaim = snap.quota.extra(req, columns, snap.free_gpus) if snap.quota is not None else None
    if not snap.preempt_levels:
        return reclaim
    lower = snap.preemptible_room(req.priority, req.tenant, columns)
    if lower is None:
        return reclaim
    return lower if reclaim is None else np.maximum(reclaim, lower)


_ALL_COLUMNS = np.arange(len(MODEL_INDEX))


def _room(req: JobRequest, free: np.ndarray, shared: np.ndarray | None, mig: np.ndarray | None,
          extra: np.ndarray | float | None) -> np.ndarray:
    """The fit rule over matching arrays (or scalars) of one site, one column or all: ``free`` whole GPUs,
    ``shared`` the largest free share of a shared GPU (fractional jobs), ``mig`` free slices of the job's
    profile (MIG jobs), ``extra`` GPUs the site might preempt for the job (None: none)."""
    if req.mig_profile is not None:
        return mig >= req.count
    if req.fractional:
        fits = (free > 0) | (shared >= req.milli)
        # A GPU it opens where none is free drives free GPUs below 0: what may be preempted is that much less.
        return fits if extra is None else fits | (free + extra >= req.charge)
    return free >= req.count if extra is None else free + extra >= req.count


def _mig_slices(snap: Snapshot, req: JobRequest) -> np.ndarray:
    """int32[n_sites, n_models]: slices of the request's MIG profile that could still be made."""
    slices = snap.mig_free.get(req.mig_profile) if req.mig_profile is not None else None
    return slices if slices is not None else np.zeros_like(snap.free_gpus)


def fit_matrix(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """bool[n_sites, n_models]: where the job would fit, per model column."""
    fits = _room(req, snap.free_gpus, snap.shared_free_milli, _mig_slices(snap, req) if req.mig_profile else None,
                 _reclaim(snap, req))
    if req.memory_gib:
        fits &= snap.memory_gib >= req.memory_gib
    else:
        fits &= snap.has_model
    return fits


def fit_row(req: JobRequest, snap: Snapshot, site: int) -> np.ndarray:
    """bool[n_models]: which models the job would fit at one site."""
    reclaim = _reclaim(snap, req)
    fits = _room(req, snap.free_gpus[site], snap.shared_free_milli[site],
                 _mig_slices(snap, req)[site] if req.mig_profile else None,
                 reclaim[site] if reclaim is not None else None)
    return fits & (snap.memory_gib[site] >= req.memory_gib if req.memory_gib else snap.memory_gib[site] > 0)


def fit_column(req: JobRequest, snap: Snapshot, column: int) -> np.ndarray:
    """bool[n_sites]: where the job fits in one model column."""
    reclaim = _reclaim(snap, req, np.array([column]))
    fits = _room(req, snap.free_gpus[:, column], snap.shared_free_milli[:, column],
                 _mig_slices(snap, req)[:, column] if req.mig_profile else None,
                 reclaim[:, 0] if reclaim is not None else None)
    if req.memory_gib:
        fits &= snap.memory_gib[:, column] >= req.memory_gib
    elif reclaim is not None:  # what a site might preempt is of any of its models: not room where it has none
        fits &= snap.has_model[:, column]
    return fits


class GpuFitFilter:
    code = "gpus-do-not-fit"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return Fit(req, snap).sites

    def passes_fit(self, fit: Fit) -> np.ndarray:
        return fit.sites

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
        if req.mig_profile is not None:
            return f"job needs {req.count} MIG slices {req.mig_profile} of {what}; the site has not that many free"
        if req.fractional:
            return (
                f"job needs {req.milli}/1000 of one {what}; {free} whole GPUs free and the largest "
                f"shared GPU has {view.shared[site]}/1000 free"
            )
        return f"job needs {req.count} {what}; {free} free"
