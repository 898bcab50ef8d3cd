"""The fast ``Pipeline.decide`` decides exactly as the straightforward one did.

The reference below is the code of every filter, scorer and the pipeline's normalisation as they were
before the decision was made fast (as of commit 3361953): whole [n_sites, n_models] matrices, one term at
a time, nothing cached. The pure functions that the speed-up did not touch (``window_mean``,
``offpeak_fraction``, ``sun_elevation_sine``, ``_samples``) are imported, not copied.

Each profile and baseline decides a stream of distinct requests on a seeded federation, one at a time,
and each placement is assumed into its own working copy, so every later decision sees the debited
capacity (and any cache that failed to follow it would show). For every decision the two must agree on
the site, the model, every filter's answer, the feasible sites, every raw and normalised term and the
totals, and produce the same explanation record (``policies.explain.record``, bit for bit), whose raw
values read back (``policies.explain.scores``) give the decision's normalised values and totals, bit for bit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import ids
from broker.models import Health, ModelCapacity, SiteState, Telemetry
from policies import _scores, explain
from policies.baselines import POLICIES
from policies.pipeline import TIE_EPSILON, Pipeline, Placement, TermArrays
from policies.profiles import BUILTIN, SCORERS, pipeline_for
from policies.scorers._usable import least_where, unknown_last
from policies.scorers.carbon import window_mean
from policies.scorers.follow_sun import _STEP_H, _samples, offpeak_fraction, sun_elevation_sine
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest, Snapshot, build_snapshot, replace_forecast, running_sums
from tests.builders import site

N_SITES = 200
N_REQUESTS = 500
NOW = datetime(2026, 7, 30, 12, 17, 23, 500000, tzinfo=UTC)  # a Thursday, 17 minutes into the hour

MODELS = ("a100-40gb", "a100-80gb", "h100-80gb", "l4", "t4", "l40s-48gb")
ABSENT_MODEL = "h200-141gb"  # no site has it
REGIONS = (
    ("gcp:us-east1", "America/New_York"), ("gcp:europe-west4", "Europe/Amsterdam"),
    ("gcp:asia-east1", "Asia/Taipei"), ("aws:us-west-2", "America/Los_Angeles"),
    ("aws:eu-west-1", "Europe/Dublin"), ("aws:ap-northeast-1", "Asia/Tokyo"),
)
REGION_IDS = tuple(r for r, _ in REGIONS)
UNMEASURED_ORIGIN = "aws:sa-east-1"  # no site has an RTT from it


# -- the reference: the straightforward code, as it was -------------------------------------------------

def _ref_fit_matrix(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if req.fractional:
        fits = (snap.free_gpus > 0) | (snap.shared_free_milli >= req.milli)
    else:
        fits = snap.free_gpus >= req.count
    if req.memory_gib:
        fits &= snap.memory_gib >= req.memory_gib
    else:
        fits &= snap.has_model
    return fits


def _ref_fit_column(req: JobRequest, snap: Snapshot, column: int) -> np.ndarray:
    free = snap.free_gpus[:, column]
    if req.fractional:
        fits = (free > 0) | (snap.shared_free_milli[:, column] >= req.milli)
    else:
        fits = free >= req.count
    if req.memory_gib:
        fits &= snap.memory_gib[:, column] >= req.memory_gib
    return fits


def _ref_fit_row(req: JobRequest, snap: Snapshot, site: int) -> np.ndarray:
    free = snap.free_gpus[site]
    if req.fractional:
        fits = (free > 0) | (snap.shared_free_milli[site] >= req.milli)
    else:
        fits = free >= req.count
    return fits & (snap.memory_gib[site] >= req.memory_gib if req.memory_gib else snap.memory_gib[site] > 0)


def _ref_usable_models(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if req.model is not None:
        mask = np.zeros_like(snap.has_model)
        mask[:, MODEL_INDEX[req.model]] = snap.has_model[:, MODEL_INDEX[req.model]]
        return mask
    return snap.memory_gib >= req.memory_gib if req.memory_gib else snap.has_model


def _ref_unknown_last(raw: np.ndarray) -> np.ndarray:
    known = ~np.isnan(raw)
    if known.all():
        return raw
    worst = float(raw[known].max()) + 1.0 if known.any() else 0.0
    return np.where(known, raw, worst)


def _ref_cheapest_with_room(req: JobRequest, snap: Snapshot) -> np.ndarray:
    prices = np.where(_ref_usable_models(req, snap) & _ref_fit_matrix(req, snap), snap.usd_per_gpu_hour, np.nan)
    with np.errstate(invalid="ignore"):
        return np.fmin.reduce(prices, axis=1)


def _ref_gpus_held(req: JobRequest) -> float:
    return req.count * (req.milli / 1000.0 if req.fractional else 1.0)


def _ref_run_intensity(req: JobRequest, snap: Snapshot) -> np.ndarray:
    duration_h = req.duration_s / 3600.0
    if snap.carbon_forecast.shape[0] == snap.n_sites and snap.carbon_forecast.shape[1] > 0:
        into_hour = (snap.now.minute * 60 + snap.now.second + snap.now.microsecond / 1e6) / 3600.0
        return window_mean(snap.carbon_forecast, into_hour, duration_h, snap.carbon_forecast_cum)
    if snap.carbon_g_per_kwh.size == snap.n_sites:
        return snap.carbon_g_per_kwh.astype(np.float64)
    return np.full(snap.n_sites, np.nan)


def _ref_carbon(req: JobRequest, snap: Snapshot) -> np.ndarray:
    ok = _ref_usable_models(req, snap) & _ref_fit_matrix(req, snap)
    tdp = np.where(ok, TDP_KW[None, :], np.nan)
    with np.errstate(invalid="ignore"):
        power_kw = np.fmin.reduce(tdp, axis=1) * _ref_gpus_held(req)
    energy_kwh = power_kw * req.duration_s / 3600.0
    return _ref_unknown_last(energy_kwh * _ref_run_intensity(req, snap) / 1000.0)


def _ref_cost(req: JobRequest, snap: Snapshot) -> np.ndarray:
    return _ref_unknown_last(_ref_cheapest_with_room(req, snap) * _ref_gpus_held(req) * req.duration_s / 3600.0)


def _ref_latency(req: JobRequest, snap: Snapshot) -> np.ndarray:
    column = snap.origin_index.get(req.origin_region or "")
    if column is None:
        return np.zeros(snap.n_sites)
    return _ref_unknown_last(snap.rtt_ms[:, column])


def _ref_free_gpus(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if req.model is not None:
        return snap.free_gpus[:, MODEL_INDEX[req.model]]
    usable = snap.memory_gib >= req.memory_gib if req.memory_gib else snap.has_model
    return (snap.free_gpus * usable).sum(axis=1)


def _ref_least_loaded(req: JobRequest, snap: Snapshot) -> np.ndarray:
    usable = _ref_usable_models(req, snap)
    total = (snap.total_gpus * usable).sum(axis=1)
    free = (np.maximum(snap.free_gpus, 0) * usable).sum(axis=1)
    return np.divide(free, total, out=np.zeros(snap.n_sites), where=total > 0)


def _ref_offpeak(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if snap.utc_offset_h.size != snap.n_sites:
        return np.zeros(snap.n_sites)
    return offpeak_fraction(snap, min(max(req.duration_s / 3600.0, _STEP_H), 24.0))


def _ref_solar(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if snap.latitude.size != snap.n_sites:
        return np.zeros(snap.n_sites)
    instants = snap.now.timestamp() + _samples(req, 12.0) * 3600.0
    return np.maximum(sun_elevation_sine(snap.latitude, snap.longitude, instants), 0.0).mean(axis=1)


def _ref_telemetry(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if snap.temperature_c.size != snap.n_sites:
        return np.zeros(snap.n_sites)
    heat = np.maximum(snap.temperature_c - 60.0, 0.0) / 25.0
    gpus = snap.total_gpus.sum(axis=1)
    queue = np.divide(snap.queue_depth, gpus, out=np.zeros(snap.n_sites), where=gpus > 0)
    return heat + snap.throttled + queue


def _ref_carbon_now(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if snap.carbon_g_per_kwh.size != snap.n_sites:
        return np.zeros(snap.n_sites)
    return _ref_unknown_last(snap.carbon_g_per_kwh)


def _ref_round_robin(req: JobRequest, snap: Snapshot) -> np.ndarray:
    n = snap.n_sites
    last = int(snap.last_placed[0])
    return (np.arange(n) - last - 1) % n + 1 if last >= 0 else np.arange(n) + 1


def _ref_spillover(req: JobRequest, snap: Snapshot) -> np.ndarray:
    return snap.rank if snap.rank.size == snap.n_sites else np.arange(snap.n_sites)


REF_RAW: dict[str, Callable[[JobRequest, Snapshot], np.ndarray]] = {
    "carbon": _ref_carbon, "cost": _ref_cost, "latency": _ref_latency, "free_gpus": _ref_free_gpus,
    "least_loaded": _ref_least_loaded, "follow_sun_offpeak": _ref_offpeak, "follow_sun_solar": _ref_solar,
    "telemetry": _ref_telemetry, "carbon_now": _ref_carbon_now,
    "cheapest": lambda req, snap: _ref_unknown_last(_ref_cheapest_with_room(req, snap)),
    "round_robin": _ref_round_robin, "spillover": _ref_spillover,
}


def _ref_region(req: JobRequest, snap: Snapshot) -> np.ndarray | None:
    if not req.allowed_regions and not req.denied_regions:
        return None
    table = np.fromiter(
        ((not req.allowed_regions or name in req.allowed_regions) and name not in req.denied_regions
         for name in snap.region_names), dtype=bool, count=len(snap.region_names))
    return table[snap.region_code]


def _ref_latency_objective(req: JobRequest, snap: Snapshot) -> np.ndarray | None:
    if req.latency_slo_ms is None:
        return None
    column = snap.origin_index.get(req.origin_region or "")
    if column is None:
        return np.zeros(snap.n_sites, dtype=bool)
    rtt = snap.rtt_ms[:, column]
    return ~np.isnan(rtt) & (rtt <= req.latency_slo_ms)


def _ref_refused(req: JobRequest, snap: Snapshot) -> np.ndarray | None:
    if not req.excluded_sites:
        return None
    ok = np.ones(snap.n_sites, dtype=bool)
    for name in req.excluded_sites:
        i = snap.index.get(name)
        if i is not None:
            ok[i] = False
    return ok


def _ref_gpu_fit(req: JobRequest, snap: Snapshot) -> np.ndarray:
    if req.model is not None:
        return _ref_fit_column(req, snap, MODEL_INDEX[req.model])
    return _ref_fit_matrix(req, snap).any(axis=1)


REF_FILTER: dict[str, Callable[[JobRequest, Snapshot], np.ndarray | None]] = {
    "site-unhealthy": lambda req, snap: snap.healthy,
    "site-cordoned": lambda req, snap: ~snap.cordoned if snap.cordoned.size else None,
    "region-not-allowed": _ref_region,
    "latency-objective": _ref_latency_objective, "site-refused": _ref_refused, "gpus-do-not-fit": _ref_gpu_fit,
    "quota-refuses": lambda req, snap: None,  # these federations report no quotas (the filter passes every site)
    "tenant-limit": lambda req, snap: None,  # nor are tenants limited (the filter passes every site)
}

_MEMORY_ORDER = np.array([ids.GPU_MODEL_BY_ID[m].memory_gib for m in ids.GPU_MODEL_IDS], dtype=np.float64)


def _ref_choose_model(req: JobRequest, snap: Snapshot, site: int) -> int:
    if req.model is not None:
        return MODEL_INDEX[req.model]
    candidates = np.flatnonzero(_ref_fit_row(req, snap, site))
    order = np.lexsort((-snap.free_gpus[site, candidates], _MEMORY_ORDER[candidates]))
    return int(candidates[order[0]])


def reference_decide(pipeline: Pipeline, req: JobRequest, snap: Snapshot) -> Placement:
    passes = tuple(REF_FILTER[code](req, snap) for code in pipeline.filter_codes)
    feasible_mask = None
    for passed in passes:
        if passed is not None:
            feasible_mask = passed if feasible_mask is None else feasible_mask & passed
    feasible = np.arange(snap.n_sites) if feasible_mask is None else np.flatnonzero(feasible_mask)
    k = feasible.size
    totals = np.zeros(k, dtype=np.float64)
    terms = []
    for w in pipeline.scorers:
        raw = REF_RAW[w.scorer.name](req, snap)
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
    site_ = int(feasible[best])
    return Placement(req, site_, _ref_choose_model(req, snap, site_), snap.n_sites, passes, feasible,
                     tuple(terms), totals)


# -- the federation and the requests --------------------------------------------------------------------

def federation(seed: int) -> Snapshot:
    """``N_SITES`` seeded sites: one to three GPU models, some unpriced, RTTs from most regions (some
    unmeasured), telemetry, about 5% unhealthy; a 48-hour forecast with a few sites unknown (NaN)."""
    rng = random.Random(seed)
    specs, states = [], {}
    for i in range(N_SITES):
        region, tz = rng.choice(REGIONS)
        models = rng.sample(MODELS, k=rng.choice((1, 1, 2, 2, 3)))
        gpus = {m: 8 * rng.randint(1, 6) for m in models}
        prices = {m: round(rng.uniform(0.3, 12.0), 3) for m in models if rng.random() < 0.9}
        rtt = {o: round(rng.uniform(1.0, 250.0), 1) for o in REGION_IDS if rng.random() < 0.85}
        spec = site(f"site-{i:04d}", region=region, timezone=tz, latitude=rng.uniform(-60, 60),
                    longitude=rng.uniform(-180, 180), gpus=gpus, usd_per_gpu_hour=prices, rtt_ms=rtt)
        specs.append(spec)
        capacity = []
        for model, total in gpus.items():
            free = rng.randint(0, total) if rng.random() < 0.8 else 0
            capacity.append(ModelCapacity(
                model=model, total_gpus=total, free_gpus=free, used_gpus=total - free,
                shared_free_milli=rng.choice((0, 0, 250, 500, 750)) if free < total else 0,
                memory_gib_per_gpu=ids.GPU_MODEL_BY_ID[model].memory_gib))
        states[spec.name] = SiteState(
            site=spec.name, health=Health.UNHEALTHY if rng.random() < 0.05 else Health.HEALTHY,
            capacity=capacity,
            telemetry=Telemetry(temperature_c_max=rng.choice((0.0, 55.0, 70.0, 88.0)), queue_depth=rng.randint(0, 9),
                                throttled_pct=rng.choice((None, 0.0, 25.0, 100.0))))
    snap = build_snapshot(NOW, specs, states)
    forecast = np.random.default_rng(seed).uniform(50, 700, size=(N_SITES, 48))
    forecast[rng.sample(range(N_SITES), 4)] = np.nan
    return replace_forecast(snap, forecast)


def requests(seed: int, snap: Snapshot) -> list[JobRequest]:
    """``N_REQUESTS`` distinct requests: named models (present and absent) and none, whole and fractional,
    memory minimums, regions allowed and denied, refused sites, origins with and without latency
    objectives (an unmeasured origin too), many run lengths, deadlines."""
    rng = random.Random(seed + 1)
    out = []
    for i in range(N_REQUESTS):
        fractional = rng.random() < 0.2
        shape = rng.random()
        model = (ABSENT_MODEL if shape < 0.03 else rng.choice(MODELS) if shape < 0.4 else None)
        origin = rng.choice(REGION_IDS + (UNMEASURED_ORIGIN, None, None))
        allowed = frozenset(rng.sample(REGION_IDS, k=rng.randint(1, 3))) if rng.random() < 0.2 else frozenset()
        denied = frozenset(rng.sample(REGION_IDS, k=1)) if rng.random() < 0.1 else frozenset()
        duration_s = rng.choice((300.0, 600.0, 3600.0, 5400.5, 4 * 3600.0, 30 * 3600.0, 3 * 86400.0))
        out.append(JobRequest(
            job_id=f"job-{i}", count=1 if fractional else rng.choice((1, 1, 2, 4, 8, 16)),
            milli=rng.choice((250, 500, 750)) if fractional else 1000, model=model,
            memory_gib=rng.choice((0.0, 0.0, 0.0, 16.0, 40.0, 48.0, 80.0)), allowed_regions=allowed,
            denied_regions=denied, priority=rng.choice((0, 10)),
            excluded_sites=excluded(rng, snap),
            duration_s=duration_s, origin_region=origin,
            latency_slo_ms=rng.choice((None, 40.0, 120.0)) if origin is not None else None,
            deadline_ts=NOW.timestamp() + duration_s + rng.uniform(0, 48 * 3600) if rng.random() < 0.5 else None,
        ))
    return out


def excluded(rng: random.Random, snap: Snapshot) -> frozenset[str]:
    """Sites a request must skip: none mostly, a few sometimes, and now and then all but one or two (so
    that one or two sites at most are feasible)."""
    roll = rng.random()
    if roll < 0.85:
        return frozenset()
    if roll < 0.95:
        return frozenset(rng.sample(snap.sites, k=rng.randint(1, 3)))
    return frozenset(snap.sites) - frozenset(rng.sample(snap.sites, k=rng.randint(1, 2)))


@dataclass(frozen=True)
class Case:
    name: str
    pipeline: Callable[[], Pipeline]


EVERY_SCORER = {name: 0.05 + 0.1 * i for i, name in enumerate(SCORERS)}

CASES = [
    *(Case(f"profile {name} (without time-shifting) decides as before", lambda w=weights: pipeline_for(w))
      for name, weights in BUILTIN.items()),
    *(Case(f"policy {name} decides as before", build) for name, build in POLICIES.items() if name not in BUILTIN),
    Case("a pipeline with every scorer on decides as before", lambda: pipeline_for(EVERY_SCORER)),
]


def assert_same(new: Placement, ref: Placement, pipeline: Pipeline, snap_new: Snapshot, snap_ref: Snapshot,
                where: str) -> None:
    assert (new.site, new.model) == (ref.site, ref.model), where
    assert np.array_equal(new.feasible, ref.feasible), where
    for code, a, b in zip(pipeline.filter_codes, new.passes, ref.passes, strict=True):
        assert (a is None) == (b is None), f"{where}: filter {code}"
        assert a is None or np.array_equal(a, b), f"{where}: filter {code}"
    for a, b in zip(new.terms, ref.terms, strict=True):
        assert (a.scorer, a.weight) == (b.scorer, b.weight), where
        assert np.allclose(a.raw, b.raw, rtol=1e-12, atol=0.0, equal_nan=True), f"{where}: {a.scorer} raw"
        assert np.allclose(a.normalised, b.normalised, rtol=1e-12, atol=0.0, equal_nan=True), \
            f"{where}: {a.scorer} normalised"
    assert np.allclose(new.totals, ref.totals, rtol=1e-12, atol=0.0, equal_nan=True), f"{where}: totals"
    # (and to the bit, as the records compared below once did when they kept the normalised values)
    for a, b in zip(new.terms, ref.terms, strict=True):
        assert a.normalised.tobytes() == b.normalised.tobytes(), f"{where}: {a.scorer} normalised"
    assert new.totals.tobytes() == ref.totals.tobytes(), f"{where}: totals"
    # The explanation the store keeps: every array packed to bytes, so this is equality bit for bit.
    rec = explain.record(pipeline, new, snap_new)
    assert rec == explain.record(pipeline, ref, snap_ref), where
    # It keeps the raw values only; read back, it gives the decision's normalised values and totals, to the bit.
    _, norms, totals = explain.scores(rec)
    for term, norm in zip(new.terms, norms, strict=True):
        assert norm.tobytes() == np.asarray(term.normalised, dtype=np.float64).tobytes(), f"{where}: {term.scorer}"
    assert totals.tobytes() == new.totals.tobytes(), f"{where}: totals"


@pytest.mark.parametrize("seed", [1, 2], ids=lambda s: f"federation {s}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_fast_decision_is_the_straightforward_one(case: Case, seed: int) -> None:
    pipeline = case.pipeline()
    base = federation(seed)
    snap_new, snap_ref = base.working_copy(NOW), base.working_copy(NOW)
    outcomes = {"placed": 0, "unplaceable": 0, "one feasible site": 0}
    for i, req in enumerate(requests(seed, base)):
        new = pipeline.decide(req, snap_new)
        ref = reference_decide(pipeline, req, snap_ref)
        assert_same(new, ref, pipeline, snap_new, snap_ref, f"request {i} ({req})")
        outcomes["one feasible site"] += new.feasible.size == 1
        if new.placed:
            snap_new.assume(new.site, req, new.model)
            snap_ref.assume(ref.site, req, ref.model)
            outcomes["placed"] += 1
        else:
            outcomes["unplaceable"] += 1
    # The stream exercised both outcomes, and capacity ran low enough to matter.
    assert outcomes["placed"] > 100 and outcomes["unplaceable"] > 10 and outcomes["one feasible site"], outcomes
    assert np.array_equal(snap_new.free_gpus, snap_ref.free_gpus)


def test_a_snapshot_with_a_new_forecast_scores_with_the_new_forecast() -> None:
    """Values cached on a snapshot (the run's mean intensity, here) do not follow it into a copy made with
    other facts."""
    pipeline = pipeline_for({"carbon": 1.0})
    snap = federation(3)
    req = JobRequest(job_id="j", count=1, milli=1000, model=None, memory_gib=0.0, allowed_regions=frozenset(),
                     denied_regions=frozenset(), duration_s=7200.0)
    first = pipeline.decide(req, snap)
    flipped = replace_forecast(snap, 750.0 - snap.carbon_forecast)
    second = pipeline.decide(req, flipped)
    assert second.site != first.site
    assert np.allclose(second.terms[0].raw, _ref_carbon(req, flipped), rtol=1e-12, atol=0.0, equal_nan=True)


# -- the compiled scorer kernels against their NumPy composition, on arrays drawn at random ----------------

def _bits(values: np.ndarray) -> bytes:
    """The array's bytes, every NaN as the one quiet NaN: the same to the bit but for a NaN's sign (inf - inf
    is -nan in NumPy's loops and nan in compiled code; the scorers never turn a NaN into a number by its
    sign)."""
    return np.where(np.isnan(values), np.nan, values).tobytes()


_VALUES = st.one_of(st.just(np.nan), st.just(-0.0), st.just(np.inf),
                    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 6), c=st.integers(0, 3), shared=st.booleans(), data=st.data())
def test_the_compiled_least_value_scaled_is_the_numpy_one(n: int, c: int, shared: bool, data: st.DataObject) -> None:
    """Unpriced (NaN) models beside priced ones, sites with no room or an unknown intensity, every site
    unknown: the scorers' ``least_where`` × intensity or × charge × hours, / 1000 or / 3600, then
    ``unknown_last``, and the compiled pass agree to the bit."""
    room = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=c, max_size=c), min_size=n, max_size=n)),
                    dtype=bool).reshape(n, c)
    rows = 1 if shared else n
    values = np.array(data.draw(st.lists(_VALUES, min_size=rows * c, max_size=rows * c)), dtype=np.float64)
    values = values.reshape(rows, c)
    # The carbon scorer's intensity per site (NaN where unknown), or none (the cost scorer's).
    per_site = data.draw(st.booleans())
    row_factor = np.array(data.draw(st.lists(st.one_of(st.just(np.nan), st.floats(-900.0, 900.0)), min_size=n,
                                             max_size=n)) if per_site else [], dtype=np.float64)
    factors = data.draw(st.lists(st.floats(0.0, 1e5), max_size=2))
    divisor = data.draw(st.sampled_from([1.0, 1000.0, 3600.0]))

    with np.errstate(invalid="ignore", over="ignore"):  # inf × 0 is NaN in both
        expected = least_where(room, values[0] if shared else values)
        if per_site:
            expected *= row_factor
        for f in factors:
            expected *= f
        expected /= divisor
        expected = unknown_last(expected)
    scale = np.array(factors, dtype=np.float64)
    got = _scores.least_scaled(np.asfortranarray(room), values, row_factor, scale, divisor)
    assert _bits(got) == _bits(expected)


@settings(max_examples=200, deadline=None)
@given(hours=st.integers(1, 6), offset=st.floats(0.0, 9.0), duration=st.floats(0.0, 12.0), data=st.data())
def test_the_compiled_window_mean_is_the_numpy_one(hours: int, offset: float, duration: float,
                                                   data: st.DataObject) -> None:
    """Runs inside the forecast, past its end, of zero length, and rows with unknown (NaN) or infinite hours."""
    forecast = np.array(data.draw(st.lists(_VALUES, min_size=3 * hours, max_size=3 * hours)), dtype=np.float64)
    forecast = forecast.reshape(3, hours)
    cum = running_sums(forecast)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN in both
        expected = window_mean(forecast, offset, duration, cum)
    assert _bits(_scores.window_mean_rows(forecast, cum, offset, duration)) == _bits(expected)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 6), c=st.integers(0, 3), data=st.data())
def test_the_compiled_free_gpu_sum_is_the_numpy_one(n: int, c: int, data: st.DataObject) -> None:
    """The free-GPUs scorer's sum over the columns a job could use, column-major as ``Fit`` holds them."""
    free = np.asfortranarray(np.array(data.draw(st.lists(st.integers(0, 64), min_size=n * c, max_size=n * c)),
                                      dtype=np.int32).reshape(n, c))
    mask = np.asfortranarray(np.array(data.draw(st.lists(st.booleans(), min_size=n * c, max_size=n * c)),
                                      dtype=bool).reshape(n, c))
    got = _scores.free_where(free, mask)
    assert got.dtype == np.int64 and got.tolist() == np.add.reduce(free * mask, axis=1, dtype=np.int_).tolist()


_AWKWARD = st.sampled_from([0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-10, 5e-10, 2.5, -3.0, 1e300,
                            -1e300, 5e-324])


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 24), terms=st.integers(1, 4), data=st.data())
def test_a_record_normalises_its_raw_values_again_as_the_kernel_did(n: int, terms: int, data: st.DataObject) -> None:
    """``explain.normalise`` (what reading a record of version 3 does) against the pipeline's kernel, bit for
    bit, signed zeros, NaN, infinities and spans at the tie tolerance included."""
    values = _AWKWARD | st.floats(-1e6, 1e6)
    raws = tuple(np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=np.float64) for _ in range(terms))
    feasible = np.flatnonzero(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if not feasible.size:  # (the pipeline normalises nothing then)
        feasible = np.array([n - 1])
    lower = data.draw(st.lists(st.booleans(), min_size=terms, max_size=terms))
    weights = data.draw(st.lists(st.sampled_from([1.0, 0.5, 0.3, 0.1, 2.0]), min_size=terms, max_size=terms))
    norm, totals, _ = _scores.gather_normalise(raws, feasible, np.array(lower), np.array(weights), TIE_EPSILON)
    again, again_totals = explain.normalise(list(raws), lower, weights, feasible)
    assert [row.tobytes() for row in again] == [row.tobytes() for row in norm]
    assert again_totals.tobytes() == totals.tobytes()


@dataclass(frozen=True)
class _Fixed:
    """A scorer of an operator's own whose raw values are one array, whatever the job."""

    name: str
    values: np.ndarray
    higher_is_better: bool = True

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return self.values


def test_scorers_of_any_array_type_are_normalised_as_one_term_at_a_time_and_compile_nothing_new() -> None:
    """A scorer may hand back integers, a strided view, big-endian or single-precision floats, NaN or a flat
    row: the decision's terms and totals are, bit for bit, those of normalising one term at a time (the plain
    NumPy path), and a set of scorers the kernel has not seen compiles nothing (it is handed read-only float64
    rows, one compiled form per number of terms)."""
    from policies.filters.gpu_fit import GpuFitFilter
    from policies.filters.health import HealthyFilter
    from policies.pipeline import Weighted, _best_of, _normalise_each
    from policies.timeshift import warm_up

    warm_up()
    base = federation(3)
    n = base.n_sites
    rng = np.random.default_rng(3)
    wide = rng.uniform(-5, 5, 2 * n)
    nan_row = rng.uniform(0, 1, n)
    nan_row[rng.integers(0, n)] = np.nan
    odd = [
        _Fixed("ints", rng.integers(0, 9, n).astype(np.int32)),
        _Fixed("strided", wide[::2], higher_is_better=False),
        _Fixed("big-endian", rng.uniform(0, 100, n).astype(">f8")),
        _Fixed("flat", np.full(n, 4.0)),
        _Fixed("nan", nan_row, higher_is_better=False),
        _Fixed("plain", rng.uniform(0, 1, n)),
    ]
    compiled = len(_scores.gather_normalise.signatures)
    for scorers in (odd, odd[::-1], odd[:3], [*odd[3:], _Fixed("single", rng.uniform(0, 1, n).astype(np.float32))]):
        pipeline = Pipeline(filters=(HealthyFilter(), GpuFitFilter()),
                            scorers=tuple(Weighted(s, 0.5 + i) for i, s in enumerate(scorers)))
        for req in requests(3, base)[:20]:
            placement = pipeline.decide(req, base)
            raws = [s.raw(req, base) for s in scorers]
            terms, totals, best = _best_of(*_normalise_each(pipeline.scorers, raws, placement.feasible))
            assert np.array_equal(placement.totals, totals, equal_nan=True)
            if placement.feasible.size:
                assert placement.site == int(placement.feasible[best])
            for a, b in zip(placement.terms, terms, strict=True):
                assert a.scorer == b.scorer and a.raw is b.raw  # the scorer's own array, not the kernel's copy
                assert np.array_equal(a.normalised, b.normalised, equal_nan=True), a.scorer
            # Its explanation record reads back the same numbers, to the bit: worked out again from the raw
            # values where the kernel normalised them, kept in the record where a term took the NumPy path.
            rec = explain.record(pipeline, placement, base)
            _, norms, rec_totals = explain.scores(rec)
            assert rec_totals.tobytes() == placement.totals.tobytes()
            for a, norm in zip(placement.terms, norms, strict=True):
                assert norm.tobytes() == np.asarray(a.normalised, dtype=np.float64).tobytes(), a.scorer
            assert ("totals" in rec) == any(s.name == "single" for s in scorers)
    assert len(_scores.gather_normalise.signatures) == compiled
    assert odd[0].values.flags.writeable and odd[1].values.flags.writeable  # the scorers' arrays are left as they were
