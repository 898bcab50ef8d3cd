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
Python loops. The pipeline is immutable and can be shared; ``decide`` has no side effects (beyond filling
the snapshot's cache of values derived from its fixed facts, ``Snapshot.derived``).

How a decision stays cheap at a thousand sites: where the request fits is worked out once
(:class:`~policies.filters.gpu_fit.Fit`, over the model columns the request could use) and handed to every
filter and scorer that offers ``passes_fit``/``raw_fit``; values that do not depend on free capacity are
cached on the snapshot; and the score terms are normalised together, as one [scorers, feasible sites]
array, with the same arithmetic per element as one term at a time (``_normalise_each``), so the numbers
are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from broker import ids
from policies import _scores
from policies._lazy import LazyTuple
from policies.filters import Filter, standard_filters
from policies.filters.gpu_fit import Fit, GpuFitFilter, fit_row
from policies.scorers import Scorer
from policies.scorers.free_gpus import FreeGpusScorer
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot
from policies.migration import MigrationPolicy
from policies.timeshift import ShiftPolicy

TIE_EPSILON = 1e-9  # (decision records of version 3 are normalised again with it: changing it needs a new one)
_FLOAT64 = np.dtype(np.float64)
_new_tuple = tuple.__new__  # a TermArrays made without its Python-level __new__ (one per scorer per decision)
_T = TypeVar("_T")
_MEMORY_ORDER = np.array([ids.GPU_MODEL_BY_ID[m].memory_gib for m in ids.GPU_MODEL_IDS], dtype=np.float64)


class PipelineError(ValueError):
    """A pipeline that cannot work: duplicate filters or scorers, negative or non-finite weights."""


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float


class Terms(LazyTuple["TermArrays"]):
    """A decision's score terms, a :class:`TermArrays` per scorer, made when first read: a pass decides many
    jobs whose terms nobody reads (the simulator reads none; the live cycle reads the placed jobs' when it
    records their explanation). Pickled, and equal to, the plain tuple of them."""

    __slots__ = ("_heads", "_raws", "_norm", "_terms")

    def __init__(self, heads: tuple[tuple[str, float], ...], raws: list[np.ndarray], norm: np.ndarray) -> None:
        self._heads, self._raws, self._norm = heads, raws, norm  # each scorer's (name, weight), raw, row of norm
        self._terms: tuple[TermArrays, ...] | None = None

    def all(self) -> tuple[TermArrays, ...]:
        terms = self._terms
        if terms is None:  # (two threads reading at once make equal tuples: either may stay)
            terms = self._terms = tuple([_new_tuple(TermArrays, (name, weight, raw, row)) for (name, weight), raw, row
                                         in zip(self._heads, self._raws, self._norm, strict=True)])
        return terms

    def __len__(self) -> int:
        return len(self._heads)


class TermArrays(NamedTuple):
    """One score term of a decision (a named tuple: made for every scorer of every decision, so cheap to make)."""

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
    terms: Sequence[TermArrays]  # a tuple, or Terms (made when read)
    totals: np.ndarray  # float64[k]: weighted sum per feasible site
    # Better-scoring feasible sites a time-shifting profile's plan turned away (site index, why), the first
    # policies.timeshift.PASSED_OVER_KEPT of n_passed_over: their GPUs are booked within the run, or kept.
    passed_over: Sequence[tuple[int, str]] = ()  # a tuple, or policies.timeshift.TurnedAway (worded when read)
    n_passed_over: int = 0
    # The plan turned away every site that could take it now (passed_over says why), and it starts at the
    # profile's choice anyway: it cannot wait, or no later start has room either (policies.timeshift.plan).
    over_plan: bool = False
    # For the time-shift search (policies.timeshift.plan), called straight after the decision: the sites
    # every filter but the GPU fit passed (None: all), and the decision's fit (it holds the free capacity
    # the decision saw, and the snapshot); None both in a placement made otherwise.
    steady: np.ndarray | None = None
    fit: Fit | None = None

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
    def __init__(self, filters: Sequence[Filter], scorers: Sequence[Weighted], shift: ShiftPolicy | None = None,
                 migrate: MigrationPolicy | None = None) -> None:
        """``shift``: how flexible jobs are deferred (``policies.timeshift``); None: never. ``migrate``: how
        running checkpointable jobs are moved to a cleaner or cheaper site (``policies.migration``); None: never."""
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
        self.migrate = migrate
        # A pipeline that defers jobs also orders the queue by urgency: within a priority, the job that
        # must start soonest (deadline - expected run time; no deadline last) is decided first (EDF).
        self.urgent_first = shift is not None
        self.filter_codes: tuple[str, ...] = tuple(codes)
        self._capacity_at = codes.index(GpuFitFilter.code) if GpuFitFilter.code in codes else -1
        # Filters and scorers that can use the decision's shared fit say so with passes_fit / raw_fit.
        self._passes = tuple(getattr(f, "passes_fit", None) or _on_request(f.passes) for f in self.filters)
        self._raws = tuple(getattr(w.scorer, "raw_fit", None) or _on_request(w.scorer.raw) for w in self.scorers)
        self._lower_mask = np.array([not w.scorer.higher_is_better for w in self.scorers], dtype=bool)
        # Each weighted scorer's name -> whether lower raw values are better (what an explanation record keeps).
        self.lower_is_better: dict[str, bool] = {w.scorer.name: not w.scorer.higher_is_better for w in self.scorers}
        self._weight_list = np.array([w.weight for w in self.scorers], dtype=np.float64)
        self._heads = tuple((w.scorer.name, w.weight) for w in self.scorers)  # each term's scorer and weight

    def decide(self, req: JobRequest, snap: Snapshot) -> Placement:
        fit = Fit(req, snap)  # shared by the filters and scorers that look at free capacity
        passes = tuple([passes(fit) for passes in self._passes])
        # The sites every filter but the GPU fit passes (what the time-shift search starts from), then those
        # that fit now as well.
        steady = room = None
        for i, passed in enumerate(passes):
            if passed is not None:
                if i == self._capacity_at:
                    room = passed
                else:
                    steady = passed if steady is None else steady & passed
        feasible_mask = room if steady is None else (steady if room is None else steady & room)
        feasible = np.arange(snap.n_sites) if feasible_mask is None else feasible_mask.nonzero()[0]
        raws = [raw(fit) for raw in self._raws]
        terms, totals, best = self._normalise(raws, feasible)
        if not feasible.size:
            return Placement(req, -1, -1, snap.n_sites, passes, feasible, terms, totals, steady=steady, fit=fit)
        site = int(feasible[best])
        model = MODEL_INDEX[req.model] if req.model is not None else _smallest_that_fits(fit, site)
        return Placement(req, site, model, snap.n_sites, passes, feasible, terms, totals, steady=steady, fit=fit)

    def _normalise(self, raws: list[np.ndarray], feasible: np.ndarray) -> tuple[Sequence[TermArrays], np.ndarray, int]:
        """Every term normalised over the feasible sites, the weighted sum per feasible site, and the index
        (among the feasible sites) of the best: the first whose total is within ``TIE_EPSILON`` of the highest.

        All terms at once, in one compiled pass (``policies._scores.gather_normalise``), with the arithmetic of
        ``_normalise_each`` element by element, so the numbers are the same: each term's raw values at the
        feasible sites go into a row of one [terms, feasible sites] float64 array, lower-is-better rows
        negated, so that ``(hi - r) / span`` is computed as ``(r' - lo') / span`` (negation is exact and
        ``-a - -b`` rounds as ``b - a``); the weighted rows are added in scorer order. Raw values of another
        dtype than float64 or integers (which float64 holds exactly) take the one-term-at-a-time path."""
        if not feasible.size or not raws:
            return _best_of(*_normalise_each(self.scorers, raws, feasible))
        # The kernel is handed read-only, contiguous, native float64 arrays only, so it has one compiled form
        # per number of terms (timeshift.warm_up compiles them all): no set of scorers, custom profile or
        # per-job weights included, waits for Numba in a scheduling pass. Integers are converted as NumPy's
        # take into a float64 array converts them; arrays of any other type take the one-term-at-a-time path.
        rows = []
        for raw in raws:
            dtype, flags = raw.dtype, raw.flags
            if (dtype is not _FLOAT64 and dtype != _FLOAT64) or not flags.c_contiguous:
                if dtype.char != "d" and dtype.kind not in "iu":
                    return _best_of(*_normalise_each(self.scorers, raws, feasible))
                raw = np.ascontiguousarray(raw, dtype=_FLOAT64)  # (a copy of its own)
                raw.flags.writeable = False
            elif flags.writeable:
                raw = raw.view()  # (its own flags: the scorer's array stays writeable)
                raw.flags.writeable = False
            rows.append(raw)
        norm, totals, best = _scores.gather_normalise(tuple(rows), feasible, self._lower_mask, self._weight_list,
                                                      TIE_EPSILON)
        return Terms(self._heads, raws, norm), totals, best


def _on_request(method: Callable[[JobRequest, Snapshot], _T]) -> Callable[[Fit], _T]:
    """A filter's ``passes`` or a scorer's ``raw`` called with the decision's fit."""
    return lambda fit: method(fit.req, fit.snap)


def _best_of(terms: tuple[TermArrays, ...], totals: np.ndarray) -> tuple[tuple[TermArrays, ...], np.ndarray, int]:
    """``terms`` and ``totals`` with the index of the best total (the first within ``TIE_EPSILON`` of the
    highest; 0 when there is none)."""
    best = int((totals >= np.maximum.reduce(totals) - TIE_EPSILON).argmax()) if totals.size else 0
    return terms, totals, best


def _normalise_each(scorers: tuple[Weighted, ...], raws: list[np.ndarray],
                    feasible: np.ndarray) -> tuple[tuple[TermArrays, ...], np.ndarray]:
    """One term at a time: min-max over the feasible sites, inverted when lower is better."""
    k = feasible.size
    totals = np.zeros(k, dtype=np.float64)
    terms: list[TermArrays] = []
    for w, raw in zip(scorers, raws, strict=True):
        norm = np.zeros(k, dtype=np.float64)
        if k:
            r = raw[feasible]
            lo, hi = r.min(), r.max()
            span = float(hi - lo)
            if span > TIE_EPSILON:
                norm = (r - lo) / span if w.scorer.higher_is_better else (hi - r) / span
                totals += w.weight * norm
        terms.append(TermArrays(w.scorer.name, w.weight, raw, norm))
    return tuple(terms), totals


def _smallest_that_fits(fit: Fit, site: int) -> int:
    """``choose_model`` for a job that names no model, from the decision's fit."""
    model = fit.smallest_at(site)
    if model < 0:
        raise IndexError(f"no GPU model fits the job at site {fit.snap.sites[site]}: a pipeline that places jobs "
                         f"needs the {GpuFitFilter.code} filter")
    return model


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
        filters=standard_filters(),
        scorers=(Weighted(FreeGpusScorer(), 1.0),),
    )
