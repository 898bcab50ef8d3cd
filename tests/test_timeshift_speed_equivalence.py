"""The compiled time-shift search (``policies._shift_search``) decides exactly as the NumPy code it replaced.

The reference below is :func:`policies.timeshift.plan` as it was before its two loops were compiled (as of
commit 7dd3aaf), with the helpers it used then, and with the rule for ties its docstring states since made
exact: values within the tie tolerance (``policies._shift_search.TIE_REL``) are equal, and the earlier hour,
then the lower site index, wins. Streams of distinct flexible requests are decided, one at
a time, on seeded federations with a plan already partly booked (some hours short of room), forecasts
that vary by site and hour, shared and whole GPUs, headroom and both objectives; every outcome is applied
to the snapshot before the next request (a placement assumed, a deferral debited from the plan), so later
decisions see the plan the earlier ones left. For every request the two must agree exactly: the kind of
outcome, site, model, hour, and every value (no tolerance: the same floating-point operations in the same
order).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import ids
from broker.cycle import PassDecider
from broker.models import Health, ModelCapacity, SiteState
from policies import runtime_risk
from policies.pipeline import Placement, choose_model
from policies.profiles import BUILTIN, pipeline_for
from policies.snapshot import TDP_KW, JobRequest, Snapshot, build_snapshot, replace_forecast
from policies.timeshift import (_CAPACITY_FILTER, HOUR_S, Calendar, Deferral, ShiftPolicy, _cleanest_ahead,
                                _columns, _forecast, debit, epoch_hour, latest_start_ts, shiftable)
from tests.builders import site

NOW = datetime(2026, 7, 30, 12, 17, 23, tzinfo=UTC)
MODELS = ("a100-80gb", "h100-80gb", "l4")
REGIONS = ("gcp:us-east1", "gcp:europe-west4", "gcp:asia-east1")


# -- the reference: the NumPy search, as it was ------------------------------------------------------------


def _moved(placement: Placement, snap: Snapshot, site: int) -> Placement:
    return replace(placement, site=site, model=choose_model(placement.request, snap, site))


_BATCH = 32
_EPS = 1e-6


def _lower(a: float, b: float) -> bool:
    """``a`` below ``b`` by more than the tie tolerance: a billionth of the larger magnitude, plus 1e-12."""
    if not a < b:
        return False
    return b == math.inf or b - a > 1e-9 * max(abs(a), abs(b)) + 1e-12


def _least(values: list[tuple[float, int, int]]) -> tuple[float, int, int]:
    """The least (value, hour, site), values within the tie tolerance of the least equal: of those, the earliest
    hour, then the lowest site."""
    least = min(value for value, _, _ in values)
    return min((item for item in values if not _lower(least, item[0])), key=lambda item: item[1:])


def _integral(cum: np.ndarray, forecast: np.ndarray, t: np.ndarray) -> np.ndarray:
    hours = forecast.shape[1]
    h = np.minimum(np.floor(t).astype(np.int64), hours - 1)
    return cum[:, h] + (t - h) * forecast[:, h]


def _values_now(sites: np.ndarray, rates: np.ndarray, need: float, d_h: float, into_h: float,
                forecast: np.ndarray, cum: np.ndarray, objective: str) -> np.ndarray:
    if objective == "carbon":
        window = _integral(cum[sites], forecast[sites], np.array([into_h, into_h + d_h]))
        return rates * need * (window[:, 1] - window[:, 0]) / 1000.0
    return rates * need * d_h


def reference_plan(req: JobRequest, snap: Snapshot, placement: Placement, policy: ShiftPolicy,
         filter_codes: tuple[str, ...]) -> Placement | Deferral | None:
    """(As of commit 7dd3aaf.) The time-shift decision for a flexible job: a :class:`~policies.pipeline.Placement` to start now
    (the profile's own choice, or another site when that one's GPUs are promised), a :class:`Deferral`, or
    None (the job waits: no room now and none planned). ``placement`` is the profile's decision for now
    (placed or not), ``filter_codes`` its pipeline's filters in order. Callers check flexibility first
    (:func:`shiftable`)."""
    plan_free = snap.plan_free
    hours = plan_free.shape[2]
    now_ts = snap.now.timestamp()
    hour0 = math.floor(now_ts / HOUR_S) * HOUR_S
    into_h = (now_ts - hour0) / HOUR_S
    latest = latest_start_ts(req, policy)
    assert latest is not None
    last_slot = min(hours - 1, policy.horizon_h, int((latest - hour0) // HOUR_S))
    need = req.charge
    d_h = req.duration_s / HOUR_S

    # Sites that could take the job at some hour: every filter but "free now", and a model with room in total.
    ok = np.ones(snap.n_sites, dtype=bool)
    for code, passed in zip(filter_codes, placement.passes, strict=True):
        if passed is not None and code != _CAPACITY_FILTER:
            ok &= passed
    col, per_gpu, usable_sites = snap.derived(("shift-columns", policy.objective, req.model, req.memory_gib,
                                               math.ceil(need)), _columns, req, snap, policy.objective, need)
    ok &= usable_sites
    forecast = cum = np.zeros((snap.n_sites, 1))
    if policy.objective == "carbon":
        forecast, cum, known = snap.derived(("shift-forecast",), _forecast, snap)
        ok &= known
    if not ok.any():
        return placement if placement.placed else None
    # The headroom is kept for work that cannot wait or go far: a job with a latency objective takes it.
    reserve_all = (policy.headroom * snap.total_gpus[np.arange(snap.n_sites), col].astype(np.float32)
                   if policy.headroom and req.latency_slo_ms is None else np.zeros(snap.n_sites, dtype=np.float32))
    run_hours = max(int(math.ceil(d_h - 1e-9)), 1)
    now_hours = min(max(int(math.ceil(into_h + d_h - 1e-9)), 1), hours)

    def per_gpu_at(site: int, column: int) -> float:
        if policy.objective == "carbon":
            return float(TDP_KW[column])
        return float(np.nan_to_num(snap.usd_per_gpu_hour[site, column], nan=np.inf))

    def value_now(site: int, column: int | None = None) -> float:
        rate = per_gpu[site] if column is None else per_gpu_at(site, column)
        return float(_values_now(np.array([site]), np.array([rate]), need, d_h, into_h, forecast, cum,
                                 policy.objective)[0])

    def fits_now(site: int, column: int | None = None) -> bool:
        # A job that can wait leaves the headroom free in every hour of its run, now or later. The current
        # hour is the sites' real free capacity, which the profile's GPU-fit filter has already checked
        # (shared GPUs included); for whole GPUs the headroom is checked in it too. ``column``: the model
        # the job would start on now (placement's choice), else the plan's column.
        first = 1 if req.fractional else 0
        hours_free = plan_free[site, col[site] if column is None else column, first:now_hours]
        return bool((hours_free >= need + reserve_all[site] - _EPS).all())

    # Starting now: the profile's choice if the plan allows it, else its best-scoring site that the plan allows.
    now_site = -1
    chosen = placement
    if placement.placed:
        if not ok[placement.site] or fits_now(placement.site, placement.model):
            now_site = placement.site
        else:
            for k in np.argsort(-placement.totals, kind="stable"):
                site = int(placement.feasible[k])
                if not ok[site]:
                    continue
                moved = _moved(placement, snap, site)
                if fits_now(site, moved.model):
                    now_site, chosen = site, moved
                    break
    best_now = (value_now(now_site, chosen.model) if ok[now_site] else 0.0) if now_site >= 0 else math.inf
    # Waiting must buy something that starting now cannot: the bar is the profile's choice or the best
    # start now at any site the plan allows, whichever is lower (a profile that weighs more than carbon
    # may start a job where it is dirtier; that is no reason to make it wait).
    anywhere_now, anywhere_site = best_now, now_site
    if now_site >= 0 and placement.feasible.size > 1:
        feasible = placement.feasible
        now_values = _values_now(feasible, per_gpu[feasible], need, d_h, into_h, forecast, cum, policy.objective)
        fitting = [(float(now_values[k]), k, site) for k, site in enumerate(feasible.tolist())
                   if ok[site] and fits_now(site)]
        if fitting:  # the least start now that fits (ties: the earlier in feasible), against the one chosen
            _, _, other = _least(fitting)
            anywhere_now, _, anywhere_site = _least([(value_now(other), 0, other), (best_now, 0, now_site)])
    threshold = anywhere_now * (1.0 - policy.min_saving) - 1e-12

    # Later starts, at the sites that could beat the threshold at all (a lower bound: the run at the
    # cleanest forecast hour ahead, or its price), in batches from the lowest bound up, until no site left
    # could beat the best start found.
    if last_slot < 1 or not threshold > 0:
        return chosen if now_site >= 0 else (placement if placement.placed else None)
    if policy.objective == "carbon":
        floor_value = per_gpu * need * d_h * snap.derived(("shift-cleanest",), _cleanest_ahead, forecast) / 1000.0
    else:
        floor_value = per_gpu * need * d_h
    candidates = np.flatnonzero(ok & (floor_value < threshold))
    if candidates.size > _BATCH:
        candidates = candidates[np.argsort(floor_value[candidates], kind="stable")]
    ks = np.arange(1, last_slot + 1)
    span = min(hours, last_slot + run_hours)
    penalty, risk = runtime_risk.deferral_penalty(req, snap.run_time_errors, now_ts, hour0, last_slot,
                                                      policy.miss_cost)
    best: tuple[float, int, int] = (math.inf, 0, 0)  # (value, slot, site): ties go to the earlier slot, then site
    best_col = 0
    best_pure = math.inf
    for lo in range(0, candidates.size, _BATCH):
        if _lower(best[0], floor_value[candidates[lo]]):
            break
        sites = np.sort(candidates[lo:lo + _BATCH])
        cols = col[sites]
        short = np.zeros((sites.size, span + 1), dtype=np.int32)
        room = plan_free[sites, cols, :span] < (need + reserve_all[sites])[:, None] - _EPS
        np.cumsum(room, axis=1, out=short[:, 1:])
        fits_later = short[:, np.minimum(ks + run_hours, span)] == short[:, ks]
        if not fits_later.any():
            continue
        if policy.objective == "carbon":
            fc, cc = forecast[sites], cum[sites]
            then = (per_gpu[sites] * need)[:, None] * (
                _integral(cc, fc, ks + d_h) - _integral(cc, fc, ks.astype(np.float64))) / 1000.0
        else:
            then = np.broadcast_to((per_gpu[sites] * need * d_h)[:, None], (sites.size, ks.size))
        pure = then
        if penalty.size:  # (added since 7dd3aaf) the priced risk to the deadline of each later start
            then = then + penalty[ks][None, :]
        masked = np.where(fits_later, then, np.inf)
        at = {(int(ks[k]), int(sites[i])): (i, k) for i, k in zip(*np.nonzero(np.isfinite(masked)), strict=True)}
        if not at:
            continue
        # the earliest hour wins a tie (values within the tolerance), then the first site
        found = _least([(float(masked[i, k]), slot, site) for (slot, site), (i, k) in at.items()])
        if found == _least([found, best]):
            best = found
            i, k = at[found[1:]]
            best_col = int(cols[i])
            best_pure = float(pure[i, k])
    value, slot, site = best
    if now_site >= 0 and math.isfinite(value) and anywhere_now - value < policy.min_saving_abs:
        value = math.inf  # too little saved for the risk a wait puts on the deadline: start now
    if math.isfinite(value) and value < threshold and _lower(value, anywhere_now):
        return Deferral(
            request=req, site=site, model=best_col, slot=slot,
            start=datetime.fromtimestamp(hour0 + slot * HOUR_S, tz=UTC), objective=policy.objective,
            value_then=best_pure, value_now=best_now,
            now_site=now_site, decided_at=snap.now, slots=run_hours, placement=placement, best_now=anywhere_now,
            best_now_site=anywhere_site, risk_now=float(risk[0]) if risk.size else math.nan,
            risk_then=float(risk[slot + 1]) if risk.size else math.nan,
        )
    if now_site >= 0:
        return chosen
    return placement if placement.placed else None


# -- the streams -----------------------------------------------------------------------------------------------


def federation(rng: random.Random, n_sites: int, plan_hours: int, forecast_dtype: type) -> Snapshot:
    specs, states = [], {}
    for i in range(n_sites):
        models = rng.sample(MODELS, rng.randint(1, 2))
        spec = site(f"s{i:03d}", region=rng.choice(REGIONS),
                    gpus=[{"model": m, "gpus_per_node": 8, "nodes": rng.randint(1, 4)} for m in models],
                    usd_per_gpu_hour={m: round(rng.uniform(0.5, 12.0), 3) for m in models})
        specs.append(spec)
        states[spec.name] = SiteState(site=spec.name, health=Health.HEALTHY, capacity=[
            ModelCapacity(model=m, total_gpus=n, free_gpus=rng.randint(0, n), used_gpus=0,
                          shared_free_milli=rng.choice((0, 0, 250, 600)),
                          memory_gib_per_gpu=ids.GPU_MODEL_BY_ID[m].memory_gib)
            for m, n in spec.total_gpus().items()])
    snap = build_snapshot(NOW, specs, states)
    hours = np.arange(48)
    forecast = np.array([[rng.uniform(20, 700) * (1 + 0.4 * math.sin((h + rng.random() * 24) / 24 * 2 * math.pi))
                          for h in hours] for _ in range(n_sites)], dtype=forecast_dtype)
    snap = replace_forecast(snap, forecast)
    if forecast_dtype is np.float32:  # as the simulator hands them over
        snap = replace(snap, carbon_forecast=forecast)
    calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(NOW))
    for _ in range(n_sites * 3):  # work already planned: some sites short of room in some hours
        s = rng.randrange(n_sites)
        m = int(rng.choice(np.flatnonzero(snap.total_gpus[s] > 0)))
        first = epoch_hour(NOW) + rng.randint(0, plan_hours // 2)
        calendar.book(s, m, float(rng.randint(1, 8)), first, first + rng.randint(1, 30))
    return replace(snap, plan_free=calendar.view(NOW, snap.free_gpus, snap.total_gpus, plan_hours))


def requests(rng: random.Random, n: int) -> list[JobRequest]:
    out = []
    for i in range(n):
        hours = rng.choice((0.2, 0.75, 1.0, 2.5, 6.0, 13.3, 40.0))
        shared = rng.random() < 0.15
        out.append(JobRequest(
            job_id=f"j{i}", count=1 if shared else rng.choice((1, 2, 4, 8)), milli=rng.choice((250, 500)) if shared
            else 1000, model=rng.choice((None, None, *MODELS)), memory_gib=0.0,
            allowed_regions=frozenset(rng.sample(REGIONS, 2)) if rng.random() < 0.2 else frozenset(),
            denied_regions=frozenset(), duration_s=hours * 3600.0,
            deadline_ts=NOW.timestamp() + hours * 3600.0 * rng.uniform(1.2, 6.0) + rng.uniform(0, 48) * 3600.0,
            submitted_ts=NOW.timestamp() - rng.uniform(0, 6) * 3600.0))
    return out


def same(new: object, ref: object) -> None:
    assert type(new) is type(ref) or (new is None) == (ref is None), (new, ref)
    if isinstance(ref, Deferral):
        assert isinstance(new, Deferral)
        for f in ("site", "model", "slot", "start", "value_then", "value_now", "now_site", "slots", "best_now",
                  "best_now_site", "risk_now", "risk_then"):
            a, b = getattr(new, f), getattr(ref, f)
            assert a == b or (a != a and b != b), (f, a, b)  # NaN: not priced in either
    elif isinstance(ref, Placement):
        assert isinstance(new, Placement) and (new.site, new.model) == (ref.site, ref.model), (new, ref)


@pytest.mark.parametrize(("seed", "profile", "shift", "forecast_dtype"), [
    (1, "green", dict(objective="carbon", max_wait_factor=4.0, min_saving_abs=0.5), np.float64),
    (2, "green", dict(objective="carbon"), np.float32),
    (3, "balanced", dict(objective="carbon", min_saving=0.2, headroom=0.1), np.float64),
    (4, "cheap", dict(objective="cost"), np.float64),
    (5, "cheap", dict(objective="cost", headroom=0.25, horizon_h=24), np.float32),
    (6, "green", dict(objective="carbon", max_wait_factor=4.0, min_saving_abs=0.5, miss_cost=30.0), np.float64),
    (7, "cheap", dict(objective="cost", miss_cost=2.0), np.float64),
], ids=["green", "green-float32-forecast", "balanced-headroom", "cheap", "cheap-headroom-short-horizon",
        "green-risk-priced", "cheap-risk-priced"])
def test_the_compiled_search_decides_as_the_numpy_one(seed: int, profile: str, shift: dict, forecast_dtype: type):
    from policies import timeshift

    rng = random.Random(seed)
    policy = ShiftPolicy(**shift)
    pipeline = pipeline_for(BUILTIN[profile], policy)
    snap = federation(rng, 120, policy.plan_hours, forecast_dtype)
    if policy.miss_cost:  # finished jobs that ran from half to three times their estimates
        snap = replace(snap, run_time_errors=np.sort(np.log(np.random.default_rng(seed).uniform(0.5, 3.0, 400))))
    decider = PassDecider(pipeline, snap)
    outcomes = {"deferred": 0, "placed": 0, "none": 0, "risk_added": 0}
    for req in requests(rng, 400):
        if not shiftable(req, snap, policy):
            continue
        placement = pipeline.decide(req, snap)
        new = timeshift.plan(req, snap, placement, policy, pipeline.filter_codes)
        ref = reference_plan(req, snap, placement, policy, pipeline.filter_codes)
        same(new, ref)
        if isinstance(new, Deferral):
            outcomes["deferred"] += 1
            outcomes["risk_added"] += new.risk_then > new.risk_now
            decider.reserve(new)
        elif new is not None and new.placed:
            outcomes["placed"] += 1
            decider.assume(new)
            debit(snap, new.site, new.model, req.charge, 0, 3)
        else:
            outcomes["none"] += 1
    # The streams reach every outcome, so each branch of the search was compared.
    assert outcomes["deferred"] > 10 and outcomes["placed"] > 5, outcomes
    assert (outcomes["risk_added"] > 0) == bool(policy.miss_cost), outcomes  # the priced search was compared too


@settings(max_examples=60, deadline=None)
@given(totals=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -1.0, math.nan]), min_size=2, max_size=320),
       rank=st.integers(0, 319))
def test_the_walk_tries_sites_in_the_order_of_a_stable_sort_of_their_scores(totals: list[float], rank: int):
    """walk_now tries the sites in index order, skipping those after the best it has allowed, and orders the
    ones it turned away afterwards: the sites it reports turned away, and the one it stops at, come in the
    order np.argsort(-totals, kind="stable") gives (NaN last, equals by index), wherever the one the plan
    allows lies in that order."""
    from policies import _shift_search as search

    n = len(totals)
    scores = np.array(totals)
    order = np.argsort(-scores, kind="stable")
    feasible = np.arange(n, dtype=np.int64)
    target = int(order[rank % n])
    ok = np.zeros(n, dtype=bool)
    ok[target] = True  # the one the plan can check (and has room at); every other site is turned away
    plan_free = np.full((n, 1, 4), 8.0, dtype=np.float32)
    forecast, cum = np.zeros((n, 4)), np.zeros((n, 5))
    nothing = np.zeros((0, 0), dtype=np.float32)
    site, model, value, best, best_site, passed, n_passed = search.walk_now(
        scores, np.zeros(n, dtype=np.int64), np.zeros((0, 0), dtype=bool), np.zeros((0, 0), dtype=np.int32),
        np.zeros(0, dtype=np.int64), np.zeros(0), np.ones(1), np.ones((n, 1)), ok, feasible, np.ones(n), 1.0, 1.0,
        0.0, forecast, cum, True, plan_free, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float32), nothing,
        np.zeros((0, 0, 0)), 0, 1, math.inf, math.inf, -1, 0.0, 8)
    assert site == target and n_passed == rank % n
    tried = order[:rank % n][:8].tolist()
    assert passed[:len(tried), 0].tolist() == tried and (passed[:len(tried), 1] == 3).all()



def _random_plan(rng: np.random.Generator, n: int, models: int, hours: int) -> tuple[np.ndarray, ...]:
    """A plan for the compiled search's tests, room, kept room and what latency-bound jobs hold varying hour by
    hour: plan_free, kept, near, a forecast and its running sums."""
    plan_free = rng.choice([0.0, 0.5, 1.0, 2.0, 4.0, 8.0], size=(n, models, hours)).astype(np.float32)
    kept = np.where(rng.random((n, models)) < 0.5, rng.choice([1.0, 2.0, 4.0], size=(n, models)),
                    0.0).astype(np.float32)
    near = rng.choice([0.0, 0.5, 1.0, 2.0], size=(n, models, hours))
    forecast = rng.uniform(0.0, 600.0, size=(n, hours))
    cum = np.concatenate([np.zeros((n, 1)), np.cumsum(forecast, axis=1)], axis=1)
    return plan_free, kept, near, forecast, cum


def test_a_start_priced_out_early_is_turned_away_as_a_start_valued_in_full_would_be():
    """With the room kept for latency-bound jobs priced, a site whose price for that room alone is above the
    best start elsewhere is turned away before the start's value is read (``floor`` 0: no negative forecast).
    That only saves work: on 600 random plans (room, kept room and what latency-bound jobs hold varying hour
    by hour; models of 1 kW and 70 W, so a start may be valued on another model than the search's own),
    every site's answer and the walk's outcome are those of the search that values every start in full
    (``floor`` -inf), including the starts that take priced room and still cost least."""
    from policies import _shift_search as search

    models = len(TDP_KW)
    kinds = np.array([ids.GPU_MODEL_IDS.index("b200-180gb"), ids.GPU_MODEL_IDS.index("t4")])
    no_room, no_free, no_columns, no_memory = (np.zeros((0, 0), dtype=bool), np.zeros((0, 0), dtype=np.int32),
                                               np.zeros(0, dtype=np.int64), np.zeros(0))
    taken_and_cheapest = 0
    for seed in range(600):
        rng = np.random.default_rng(seed)
        n, hours = int(rng.integers(2, 40)), int(rng.integers(1, 6))
        price, need = float(rng.choice([0.01, 0.5, 5.0])), float(rng.choice([0.25, 1.0, 2.0, 4.0]))
        d_h, into_h = float(rng.choice([0.1, 0.5, 1.0, 2.5])), float(rng.uniform(0.0, 1.0))
        plan_free, kept, near, forecast, cum = _random_plan(rng, n, models, hours)
        feasible, ok = np.arange(n, dtype=np.int64), rng.random(n) < 0.9
        col = rng.choice(kinds, size=n).astype(np.int64)
        start_on = rng.choice(kinds, size=n).astype(np.int64)  # the model a start now takes: not always col's
        per_gpu, reserve = TDP_KW[col].astype(np.float64), np.zeros(n, dtype=np.float32)
        now_hours = min(max(math.ceil(into_h + d_h - 1e-9), 1), hours)
        other, at = search.cheapest_fitting_now(feasible, ok, per_gpu, need, d_h, into_h, forecast, cum, True,
                                                plan_free, col, reserve, kept, near, 0, now_hours, price)
        for site in range(n):
            rate = float(TDP_KW[start_on[site]])
            full, early = (search.start_now(site, int(start_on[site]), rate, ok, feasible, per_gpu, need, d_h, into_h,
                                            forecast, cum, True, plan_free, col, reserve, kept, near, 0, now_hours,
                                            price, other, at, floor) for floor in (-math.inf, 0.0))
            assert early == full, (seed, site)
            ends = [(min(math.floor(t), hours - 1), t) for t in (into_h, into_h + d_h)]  # past the end, its last hour
            start, end = (cum[site, h] + (t - h) * forecast[site, h] for h, t in ends)
            pure = rate * need * (end - start) / 1000.0  # the value without the price of any room taken
            taken_and_cheapest += bool(full[0] and ok[site] and 0 <= at != site and full[1] > pure + 1e-9)
        scores = rng.permutation(n).astype(np.float64)
        full, early = (search.walk_now(scores, start_on, no_room, no_free, no_columns,
                                       no_memory, TDP_KW, np.ones((n, models)), ok, feasible, per_gpu, need, d_h,
                                       into_h, forecast, cum, True, plan_free, col, reserve, kept, near, 0, now_hours,
                                       price, other, at, floor, 8) for floor in (-math.inf, 0.0))
        assert full[:5] == early[:5] and full[6] == early[6] and (full[5] == early[5]).all(), seed
    assert taken_and_cheapest > 5, taken_and_cheapest  # the case the early test must leave alone was met



@pytest.mark.parametrize("keep", [0, 1, 3, 8])
def test_the_walk_chooses_and_turns_away_as_a_site_by_site_walk_in_score_order(keep: int):
    """The compiled walk tries sites in index order, skipping those after the best it has allowed so far, and
    puts the ones it turned away in order afterwards: on 400 random plans (scores with ties and NaN, sites the
    plan cannot check, room kept for latency-bound jobs priced, models named or chosen from the fit), its site,
    model, values, the first ``keep`` sites turned away (site, why, hour, model) and how many there were are
    those of the site-by-site walk in stable score order (``_slow_walk``)."""
    from policies import _shift_search as search

    models = len(TDP_KW)
    kinds = np.array([ids.GPU_MODEL_IDS.index("b200-180gb"), ids.GPU_MODEL_IDS.index("t4")])
    memory = np.array([180.0, 16.0])
    chose = walked = 0
    for seed in range(400):
        rng = np.random.default_rng(1000 + seed)
        n, hours = int(rng.integers(1, 300)), int(rng.integers(1, 6))
        price, need = float(rng.choice([0.01, 0.5, 5.0, math.inf])), float(rng.choice([0.25, 1.0, 2.0, 4.0]))
        d_h, into_h = float(rng.choice([0.1, 0.5, 1.0, 2.5])), float(rng.uniform(0.0, 1.0))
        plan_free, kept, near, forecast, cum = _random_plan(rng, n, models, hours)
        feasible = np.sort(rng.permutation(n + 5)[:n]).astype(np.int64)  # not every site is feasible
        width = int(feasible[-1]) + 1
        ok = rng.random(width) < float(rng.choice([0.3, 0.9]))
        col = rng.choice(kinds, size=width).astype(np.int64)
        per_gpu, reserve = TDP_KW[col].astype(np.float64), np.zeros(width, dtype=np.float32)
        plan_free = np.concatenate([plan_free, np.zeros((width - n, models, hours), dtype=np.float32)])
        kept = np.concatenate([kept, np.zeros((width - n, models), dtype=np.float32)])
        near = np.concatenate([near, np.zeros((width - n, models, hours))])
        forecast = np.concatenate([forecast, np.zeros((width - n, hours))])
        cum = np.concatenate([cum, np.zeros((width - n, hours + 1))])
        now_hours = min(max(math.ceil(into_h + d_h - 1e-9), 1), hours)
        other, at = search.cheapest_fitting_now(feasible, ok, per_gpu, need, d_h, into_h, forecast, cum, True,
                                                plan_free, col, reserve, kept, near, 0, now_hours, price)
        scores = rng.choice([0.0, 0.25, 0.5, 1.0, math.nan], size=n) if seed % 2 else rng.normal(size=n)
        if seed % 3:  # the model each start takes: named, or chosen from the fit's columns with room
            given, room = rng.choice(kinds, size=n if seed % 3 == 1 else 1).astype(np.int64), np.zeros((0, 0), bool)
            free = np.zeros((0, 0), dtype=np.int32)
        else:
            given, room = np.zeros(0, dtype=np.int64), rng.random((width, 2)) < 0.5
            free = rng.integers(0, 4, size=(width, 2)).astype(np.int32)
        args = (scores, given, room, free, kinds, memory, TDP_KW, np.ones((width, models)), ok, feasible, per_gpu,
                need, d_h, into_h, forecast, cum, True, plan_free, col, reserve, kept, near, 0, now_hours, price,
                other, at)
        fast = search.walk_now(*args, 0.0, keep)
        slow = _slow_walk(*args, 0.0, keep)
        assert fast[:5] == slow[:5] and fast[6] == slow[6], seed
        assert fast[5].tolist() == slow[5].tolist(), seed
        chose += fast[0] >= 0
        walked += fast[6] > 8
    assert chose > 100 and walked > 50, (chose, walked)  # walks that chose, and long ones, were both met

def _slow_walk(totals, models, room, free, columns, memory, tdp, usd, ok, feasible, per_gpu, need, d_h, into_h,
               forecast, cum, carbon, plan_free, col, reserve, kept, near, first, now_hours, kept_price, other, at,
               floor, keep):
    """walk_now as its docstring says it, one start_now call per site, in the order of a stable argsort and
    with every start valued in full (``floor`` -inf, so start_now never turns a site away for its price
    alone): the reference for the compiled walk and its shortcut."""
    from policies import _shift_search as search

    passed = np.full((keep, 4), -1, dtype=np.int64)
    n_passed = 0
    for k in np.argsort(-totals, kind="stable").tolist():
        site = int(feasible[k])
        if models.shape[0]:
            model = int(models[k if models.shape[0] > 1 else 0])
        else:  # the usable column with room, least memory, then most free, then first; else the plan's
            choices = [(memory[i], -free[site, i], i) for i in range(columns.shape[0]) if room[site, i]]
            model = int(columns[min(choices)[2]]) if choices else int(col[site])
        if not ok[site]:
            why, hour = 3, 0
        else:
            rate = float(tdp[model]) if carbon else float(np.nan_to_num(usd[site, model], nan=np.inf))
            fits, value, best_value, best_site, why, hour = search.start_now(
                site, model, rate, ok, feasible, per_gpu, need, d_h, into_h, forecast, cum, carbon, plan_free, col,
                reserve, kept, near, first, now_hours, kept_price, other, at, -math.inf)
            if fits:
                return site, model, value, best_value, best_site, passed, n_passed
        if n_passed < keep:
            passed[n_passed] = (site, why, hour, model)
        n_passed += 1
    return -1, -1, math.inf, math.inf, -1, passed, n_passed


def _forget_floor(snap: Snapshot) -> None:
    """Drop the plan's value floor from the snapshot's cache, and what the plan keeps of it (its facts)."""
    for key in [key for key in snap._derived if key[0] in ("shift-value-floor", "shift-facts")]:
        del snap._derived[key]


@pytest.mark.parametrize("price", [0.05, 0.5, 5.0])
def test_with_room_kept_for_latency_bound_jobs_priced_the_plan_decides_as_a_site_by_site_walk(price, monkeypatch):
    """``green``'s room for latency-bound jobs, priced, over a stream of jobs on 120 sites, a third of which saw
    latency-bound jobs hold up to half their GPUs: every outcome of the plan (where, which model, when, its
    values, the sites it turned away and why, in words) is the one the same plan gives with its compiled walk
    replaced by a site-by-site walk in stable score order that values every start in full."""
    from policies import _shift_search as search
    from policies import timeshift

    rng = random.Random(11)
    nprng = np.random.default_rng(11)
    policy = ShiftPolicy(objective="carbon", max_wait_factor=4.0, min_saving_abs=0.5, miss_cost=30.0,
                         latency_reserve=1.0, latency_reserve_price=price)
    pipeline = pipeline_for(BUILTIN["green"], policy)
    snap = federation(rng, 120, policy.plan_hours, np.float64)
    samples = np.zeros((24,) + snap.total_gpus.shape, dtype=np.float32)
    for s in range(0, snap.n_sites, 3):
        samples[:, s] = np.floor(nprng.uniform(0.0, 0.5, samples[:, s].shape) * snap.total_gpus[s])
    snap = replace(snap, near_samples=samples, near_booked=np.zeros(snap.plan_free.shape),
                   run_time_errors=np.sort(np.log(nprng.uniform(0.5, 3.0, 400))))
    decider = PassDecider(pipeline, snap)
    walked = taken_priced = 0
    for req in requests(rng, 400):
        if not shiftable(req, snap, policy):
            continue
        placement = pipeline.decide(req, snap)
        new = timeshift.plan(req, snap, placement, policy, pipeline.filter_codes)
        with monkeypatch.context() as patch:
            patch.setattr(search, "walk_now", _slow_walk)
            _forget_floor(snap)  # start_now, first site: no floor
            patch.setattr(timeshift, "_value_floor", lambda values: -math.inf)
            ref = timeshift.plan(req, snap, placement, policy, pipeline.filter_codes)
        _forget_floor(snap)
        assert type(new) is type(ref)
        if ref is not None:
            for f in ("site", "model", "slot", "start", "value_then", "value_now", "now_site", "best_now",
                      "best_now_site", "n_passed_over"):
                assert getattr(new, f, None) == getattr(ref, f, None), (req.job_id, f)
            assert list(new.passed_over) == list(ref.passed_over), req.job_id
            walked += new.n_passed_over > 0
            taken_priced += any("room kept for latency-bound jobs" in why for _, why in new.passed_over)
        if isinstance(new, Deferral):
            decider.reserve(new)
        elif new is not None and new.placed:
            decider.assume(new)
    assert walked > 10 and taken_priced > 5, (walked, taken_priced)  # the walk and the price were compared
