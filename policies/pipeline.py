"""Placement = filter, then score, then pick; every rejection and every score term is kept.

1. Filters: each returns a boolean array over sites (or None: all pass); the sites passing every filter
   are the feasible ones. Every filter's answer is kept, so ``failures`` can name all the filters that
   rejected each site, not only the first.
2. Scorers: each returns a raw value per site. Over the feasible sites only, raw values are normalised to
   0..1 (min-max; inverted when lower is better; all 0 when every site is equal), multiplied by the weight
   and summed.
3. Pick: the highest total; totals within ``TIE_EPSILON`` of the best tie, and a tie goes to the first site
   by name. No float ``==``.

Everything is arrays over sites: the cost of a decision grows with the number of sites in numpy, not in
Python loops. The pipeline is immutable and can be shared; ``decide`` has no side effects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from broker import ids
from policies.filters import Filter
from policies.filters.gpu_fit import GpuFitFilter, fit_row
from policies.filters.health import HealthyFilter
from policies.filters.region import RefusedFilter, RegionFilter
from policies.scorers import Scorer
from policies.scorers.free_gpus import FreeGpusScorer
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot
from policies.timeshift import ShiftPolicy

TIE_EPSILON = 1e-9
_MEMORY_ORDER = np.array([ids.GPU_MODEL_BY_ID[m].memory_gib for m in ids.GPU_MODEL_IDS], dtype=np.float64)


class PipelineError(ValueError):
    """A pipeline that cannot work: duplicate filters or scorers, negative or non-finite weights."""


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class TermArrays:
    scorer: str
    weight: float
    raw: np.ndarray  # over all sites
    normalised: np.ndarray  # over the feasible sites, in ``Placement.feasible`` order


@dataclass(frozen=True, slots=True)
class Placement:
    """The outcome of one decision: ``site``/``model`` are indices (-1 when the job fits nowhere)."""

    request: JobRequest
    site: int
    model: int
    n_sites: int
    passes: tuple[np.ndarray | None, ...]  # per filter: which sites passed (None: all did)
    feasible: np.ndarray  # int[k]: indices of the sites that passed every filter
    terms: tuple[TermArrays, ...]
    totals: np.ndarray  # float64[k]: weighted sum per feasible site

    @property
    def placed(self) -> bool:
        return self.site >= 0

    @property
    def failures(self) -> np.ndarray:
        """uint16[n_sites]: bit k set where filter k rejected the site (built on demand)."""
        mask = np.zeros(self.n_sites, dtype=np.uint16)
        for bit, passed in enumerate(self.passes):
            if passed is not None:
                mask |= (~passed).astype(np.uint16) << np.uint16(bit)
        return mask


class Pipeline:
    def __init__(self, filters: Sequence[Filter], scorers: Sequence[Weighted], shift: ShiftPolicy | None = None) -> None:
        """``shift``: how flexible jobs are deferred (``policies.timeshift``); None: never."""
        codes = [f.code for f in filters]
        if len(set(codes)) != len(codes):
            raise PipelineError(f"a filter is listed twice: {codes}")
        if len(filters) > 16:
            raise PipelineError("at most 16 filters fit the failure mask")
        names = [w.scorer.name for w in scorers]
        if len(set(names)) != len(names):
            raise PipelineError(f"a scorer is listed twice: {names}")
        for w in scorers:
            if not np.isfinite(w.weight) or w.weight < 0:
                raise PipelineError(f"scorer {w.scorer.name}: weight must be a finite number >= 0, got {w.weight}")
        self.filters: tuple[Filter, ...] = tuple(filters)
        self.scorers: tuple[Weighted, ...] = tuple(w for w in scorers if w.weight > 0)
        self.shift = shift
        # A pipeline that defers jobs also orders the queue by urgency: within a priority, the job that
        # must start soonest (deadline - expected run time; no deadline last) is decided first (EDF).
        self.urgent_first = shift is not None
        self.filter_codes: tuple[str, ...] = tuple(codes)

    def decide(self, req: JobRequest, snap: Snapshot) -> Placement:
        passes = tuple(f.passes(req, snap) for f in self.filters)
        feasible_mask: np.ndarray | None = None
        for passed in passes:
            if passed is not None:
                feasible_mask = passed if feasible_mask is None else feasible_mask & passed
        if feasible_mask is None:
            feasible = np.arange(snap.n_sites)
        else:
            feasible = np.flatnonzero(feasible_mask)
        k = feasible.size
        totals = np.zeros(k, dtype=np.float64)
        terms: list[TermArrays] = []
        for w in self.scorers:
            raw = w.scorer.raw(req, snap)
            norm = np.zeros(k, dtype=np.float64)
            if k:
                r = raw[feasible]
                lo, hi = r.min(), r.max()
                span = float(hi - lo)
                if span > TIE_EPSILON:
                    norm = (r - lo) / span if w.scorer.higher_is_better else (hi - r) / span
                    totals += w.weight * norm
            terms.append(TermArrays(w.scorer.name, w.weight, raw, norm))
        if not k:
            return Placement(req, -1, -1, snap.n_sites, passes, feasible, tuple(terms), totals)
        best = int(np.argmax(totals >= totals.max() - TIE_EPSILON))
        site = int(feasible[best])
        return Placement(req, site, choose_model(req, snap, site), snap.n_sites, passes, feasible, tuple(terms), totals)


def choose_model(req: JobRequest, snap: Snapshot, site: int) -> int:
    """The model column a placement uses: the named model, or the smallest GPUs that fit (best fit)."""
    if req.model is not None:
        return MODEL_INDEX[req.model]
    candidates = np.flatnonzero(fit_row(req, snap, site))
    # Smallest memory first, then most free GPUs.
    order = np.lexsort((-snap.free_gpus[site, candidates], _MEMORY_ORDER[candidates]))
    return int(candidates[order[0]])


def default_pipeline() -> Pipeline:
    """The filters of this release and the one scorer, most free GPUs, at weight 1."""
    return Pipeline(
        filters=(HealthyFilter(), RegionFilter(), RefusedFilter(), GpuFitFilter()),
        scorers=(Weighted(FreeGpusScorer(), 1.0),),
    )
