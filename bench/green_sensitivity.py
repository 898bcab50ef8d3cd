"""What holds ``green`` back where the routing issue's targets are not met: the Evidence replay of the whole
Philly trace (one year, one utilisation), ``green`` and ``baseline-carbon-greedy`` as shipped, then
``green`` again under variants that change one assumption or one setting at a time:

- ``exact estimates``: the workload's run-time estimates equal the true run times (``estimate_sigma`` 0;
  the shipped workload draws them log-normal, sigma 0.5): how much of the carbon and of the misses is the
  estimates' error;
- ``exact estimates, waits unbounded``: the same, and ``green`` without ``max_wait_factor`` and
  ``min_saving_abs``: whether the wait bounds hold the carbon back;
- ``previous``: ``green`` as the release before this one shipped it: no room kept for latency-bound jobs, and
  ``duration_safety`` 1.25; ``no-reserve``: ``green`` without the room kept (``duration_safety`` 1.5 still);
  ``price-0.2``, ``-0.5``, ``-1``, ``-2``, ``-5``: the room priced at that many kg CO2e per GPU-hour
  instead of ``green``'s 0.2 (0.5 until 2026-11-29; ``reserve-1``, below: not priced, a bar);
- ``duration_safety 2`` and ``2.5``: a deferral keeps two (two and a half) expected run times before the
  deadline instead of ``green``'s 1.5; ``safety-1.25``: what ``green`` kept before it kept room for
  latency-bound jobs; ``safety-1.0``: none kept beyond the estimate itself;
- ``headroom 0.1``: deferred starts of jobs without a latency objective leave a tenth of every site free,
  for work that cannot wait or go far (``headroom-0.1-safety-2``: and ``duration_safety`` 2);
- ``reserve-0.75``, ``-0.9``, ``-1``: deferred work without a latency objective leaves free, at each site,
  that quantile of what latency-bound jobs held there hour by hour over the last week, as a bar
  (``latency_reserve``, :mod:`policies.latency_reserve`; ``green`` keeps the 1.0 quantile, priced);
- ``max-risk-0.05``: a deferral may not plan a start whose chance of missing the deadline is above 5 %
  (``max_risk``); ``-0.1``, ``-0.2``: 10 %, 20 %; ``reserve-0.9-max-risk-0.05``: both;
- ``deadline risk not priced`` (``unpriced``): ``miss_cost`` 0, as ``green`` was before it priced a
  wait's risk to the deadline (:mod:`policies.runtime_risk`); ``miss_cost 100`` and ``300``: priced higher
  than the shipped 30; ``balanced``, ``cheap`` and their ``-unpriced`` forms: the other profiles that defer,
  as shipped and with ``miss_cost`` 0;
- ``checkpointable``: nine in ten of the jobs that are not inflexible can be checkpointed
  (``checkpointable_fraction`` 0.9; the shipped workload has none), so ``green`` moves running work
  (``policies.migration``): to a site where the rest of the run is cleaner, and out of the sites near the
  users of a latency-bound job that can wait no longer (to another site, or stopped and requeued from its
  checkpoint when none has room); ``-no-room`` and ``-room-only``: one of the two; ``-no-suspend``: room is
  made only by moving jobs to another site; ``-pause``: also paused through the hours its grid is dirtier
  than the cleanest hours its deadline leaves it (``pause``);
- ``perfect forecast``: the policies read each zone's true intensity for the next week instead of the
  forecast: how much of the gap is the forecasts' error;
- ``full knowledge``: exact estimates, the true intensity for the next week, and ``green`` without the
  margins that only guard against not knowing (``duration_safety`` 1, no ``min_saving``, no wait bounds):
  what ``green``'s way of deciding, one job at a time as each arrives, reaches when nothing is uncertain
  but the jobs still to come (``heliotrope simulate --oracle`` knows those too);
- ``full-knowledge-capacity-prices``: that, and the jobs still to come as well, as prices: every site-hour's
  forecast is raised by the offline LP's price of that hour's capacity at that site (its shadow price, kg
  CO2e per GPU-hour, over the GPU's power: g/kWh), which the whole-job oracle packs by; a job then takes
  clean capacity only where it saves more than the jobs to come would have. Carbon is accounted on the true
  intensity. ``capacity-prices``: ``green`` as shipped (its forecasts, estimates as drawn) with the same
  prices, future ones included: whether a broker that learned such prices could gain from them.

- ``keep-promises``: ``green`` with ``keep_promises``: a job it does not defer starts where its run takes no
  GPUs the plan has promised to running or deferred jobs, where another site can take it
  (:func:`policies.timeshift.start_now`);
- ``book-overruns``: ``green`` with ``book_overruns``: a deferral onto GPUs that a running job past its
  estimate is expected to hold (until the end the finished jobs that ran as long predict,
  :func:`policies.runtime_risk.expected_ratio`) is planned again on what is expected free, and stands only
  where that plan also waits for the same site (:func:`policies.timeshift.unless_it_slips`);
  ``book-overruns-safety-1.0-price-0.2``: that, keeping one expected run time in hand before the deadline
  instead of 1.5, with the room kept for latency-bound jobs priced at 0.2 (``green``'s price since
  2026-11-29, 0.5 before);
- ``green-undeclared``, ``greedy-undeclared``, ``cheapest-first-undeclared``: the inflexible jobs (a
  tenth: deadline = submit + true run time) give only their deadline, as releases before 2026-11-29
  replayed them (``declare_inflexible`` false; the Evidence's workload has them ask to start at once,
  ``JobSpec.deferrable`` false). The broker then sees only that deadline and an estimate, and where the
  estimate runs short the deadline looks loose, so a profile that defers may defer them.

``greedy`` and ``cheapest-first`` are the baselines the routing issue's targets name (carbon-greedy, and
the best carbon-blind baseline of the Evidence), for the targets on another ``--seed`` of the workload.

Each line: carbon (t CO2e), cost (USD), deadline misses, and the misses by kind: latency-bound jobs (a latency
objective pins them to the sites near their origin) or not, and of the rest, how many were deferred (started
more than a minute after submission) and ran longer than their estimate; last, the misses of jobs deferred
for a saving at least once (``deferred_misses``: each would have met its deadline by starting at once), and
of those the inflexible ones (deadline = submit + true run time: they had to start at once). The
workload and the sites are the Evidence's (``heliotrope simulate --preset philly --trace-from
2017-09-01``, default federation) at ``--seed`` 0; only the named setting differs. Each replay takes about
half a minute here.

This prints figures; it asserts nothing. Usage::

    .venv/bin/python bench/green_sensitivity.py [--year 2021] [--utilisation 0.3] [--data ../shared/data]
                                                [--seed 0] [--variants all|greedy,green,exact,...] [--why-missed]

``--why-missed`` adds, under each line, the latency-bound misses by origin, how many found no site within
their latency objective with room when they arrived, and how long they waited.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import date, timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.data.traces import resolve_preset  # noqa: E402
from broker.simulation import engine  # noqa: E402
from broker.simulation.run import Prepared, SimulationSpec, capacity_prices, prepare  # noqa: E402
from policies.baselines import policy  # noqa: E402
from policies.filters.latency import LatencyFilter  # noqa: E402
from policies.pipeline import Pipeline  # noqa: E402
from policies.profiles import BUILTIN, MIGRATIONS, SHIFTS, pipeline_for  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def shifted(profile: str, **shift: object) -> Callable[[], Pipeline]:
    return lambda: pipeline_for(BUILTIN[profile], SHIFTS[profile].model_copy(update=shift))


def green(**shift: object) -> Callable[[], Pipeline]:
    return shifted("green", **shift)


def moving(**migrate: object) -> Callable[[], Pipeline]:
    """``green`` with its moving of running work (``policies.migration``) changed."""
    return lambda: pipeline_for(BUILTIN["green"], SHIFTS["green"], MIGRATIONS["green"].model_copy(update=migrate))


FORESIGHT_H = 168
"""Hours of true future intensity the ``perfect forecast`` variants read: the time-shift search's horizon."""


def true_future(federation: engine.Federation, hours: int = FORESIGHT_H) -> engine.Federation:
    """``federation`` with each hour's forecast replaced by the true intensity of the next ``hours`` hours
    (the last hour of data standing for any after it)."""
    intensity = federation.intensity
    padded = np.hstack([intensity, np.repeat(intensity[:, -1:], hours, axis=1)])
    ahead = np.arange(intensity.shape[1])[:, None] + np.arange(hours)[None, :]
    forecast = padded[:, ahead]  # [sites, hours of the run, hours ahead]
    cum = np.zeros(forecast.shape[:2] + (hours + 1,))
    np.cumsum(forecast, axis=2, out=cum[:, :, 1:])
    return replace(federation, forecast=forecast, forecast_cum=cum, forecast_model_h=0)  # all of it: the truth


class Variant(NamedTuple):
    label: str  # what it is
    assumptions: dict[str, object]  # workload assumptions that differ from the Evidence's
    build: Callable[[], Pipeline]  # the pipeline
    foresight: bool = False  # reads the true future intensity (true_future) instead of the forecasts
    capacity_prices: bool = False  # decides on intensity raised by the offline LP's price of capacity (priced)


VARIANTS: dict[str, Variant] = {
    "greedy": Variant("baseline-carbon-greedy", {}, lambda: policy("baseline-carbon-greedy")),
    "cheapest-first": Variant("baseline-cheapest-first", {}, lambda: policy("baseline-cheapest-first")),
    "green": Variant("green", {}, lambda: policy("green")),
    "exact": Variant("green, exact estimates", {"estimate_sigma": 0.0}, lambda: policy("green")),
    "exact-unbounded": Variant("green, exact estimates, waits unbounded", {"estimate_sigma": 0.0},
                               green(max_wait_factor=None, min_saving_abs=0.0)),
    "previous": Variant("green of the previous release (no room kept, duration_safety 1.25)", {},
                        green(latency_reserve=None, latency_reserve_price=None, duration_safety=1.25)),
    "no-reserve": Variant("green, no room kept for latency-bound jobs", {},
                          green(latency_reserve=None, latency_reserve_price=None)),
    "price-0.2": Variant("green, the room priced at 0.2 kg per GPU-hour", {}, green(latency_reserve_price=0.2)),
    "price-0.5": Variant("green, the room priced at 0.5 kg per GPU-hour", {}, green(latency_reserve_price=0.5)),
    "price-1": Variant("green, the room priced at 1 kg per GPU-hour", {}, green(latency_reserve_price=1.0)),
    "price-2": Variant("green, the room priced at 2 kg per GPU-hour", {}, green(latency_reserve_price=2.0)),
    "price-5": Variant("green, the room priced at 5 kg per GPU-hour", {}, green(latency_reserve_price=5.0)),
    "safety-1.0": Variant("green, duration_safety 1.0", {}, green(duration_safety=1.0)),
    "safety-1.25": Variant("green, duration_safety 1.25", {}, green(duration_safety=1.25)),
    "safety-2": Variant("green, duration_safety 2", {}, green(duration_safety=2.0)),
    "safety-2.5": Variant("green, duration_safety 2.5", {}, green(duration_safety=2.5)),
    "headroom-0.1": Variant("green, headroom 0.1", {}, green(headroom=0.1)),
    "headroom-0.1-safety-2": Variant("green, headroom 0.1, duration_safety 2", {},
                                     green(headroom=0.1, duration_safety=2.0)),
    "reserve-0.75": Variant("green, latency reserve 0.75 as a bar", {},
                            green(latency_reserve=0.75, latency_reserve_price=None)),
    "reserve-0.9": Variant("green, latency reserve 0.9 as a bar", {},
                           green(latency_reserve=0.9, latency_reserve_price=None)),
    "reserve-1": Variant("green, latency reserve 1.0 as a bar", {}, green(latency_reserve=1.0, latency_reserve_price=None)),
    "max-risk-0.05": Variant("green, max_risk 0.05", {}, green(max_risk=0.05)),
    "max-risk-0.1": Variant("green, max_risk 0.1", {}, green(max_risk=0.1)),
    "max-risk-0.2": Variant("green, max_risk 0.2", {}, green(max_risk=0.2)),
    "reserve-0.9-max-risk-0.05": Variant("green, latency reserve 0.9 as a bar, max_risk 0.05", {},
                                         green(latency_reserve=0.9, latency_reserve_price=None, max_risk=0.05)),
    "unpriced": Variant("green, deadline risk not priced", {}, green(miss_cost=0.0)),
    "balanced": Variant("balanced", {}, lambda: policy("balanced")),
    "balanced-unpriced": Variant("balanced, deadline risk not priced", {}, shifted("balanced", miss_cost=0.0)),
    "cheap": Variant("cheap", {}, lambda: policy("cheap")),
    "cheap-unpriced": Variant("cheap, deadline risk not priced", {}, shifted("cheap", miss_cost=0.0)),
    "miss-cost-100": Variant("green, miss_cost 100", {}, green(miss_cost=100.0)),
    "miss-cost-300": Variant("green, miss_cost 300", {}, green(miss_cost=300.0)),
    "checkpointable": Variant("green, 90 % of flexible jobs checkpointable", {"checkpointable_fraction": 0.9},
                              lambda: policy("green")),
    "checkpointable-no-suspend": Variant("green, 90 % checkpointable, no job stopped to make room",
                                         {"checkpointable_fraction": 0.9}, moving(suspend=False)),
    "checkpointable-no-room": Variant("green, 90 % checkpointable, moves for a saving only",
                                      {"checkpointable_fraction": 0.9}, moving(make_room=False)),
    "checkpointable-room-only": Variant("green, 90 % checkpointable, moves to make room only",
                                        {"checkpointable_fraction": 0.9}, moving(min_saving_abs=1e12)),
    "checkpointable-pause": Variant("green, 90 % checkpointable, jobs paused through dirty hours too",
                                    {"checkpointable_fraction": 0.9}, moving(pause=True)),
    "perfect-forecast": Variant("green, perfect forecast", {}, lambda: policy("green"), True),
    "full-knowledge": Variant("green, full knowledge", {"estimate_sigma": 0.0},
                              green(duration_safety=1.0, min_saving=0.0, max_wait_factor=None, min_saving_abs=0.0),
                              True),
    "full-knowledge-capacity-prices": Variant(
        "green, full knowledge, capacity prices", {"estimate_sigma": 0.0},
        green(duration_safety=1.0, min_saving=0.0, max_wait_factor=None, min_saving_abs=0.0), True, True),
    "capacity-prices": Variant("green, capacity prices", {}, lambda: policy("green"), False, True),
    "keep-promises": Variant("green, keep_promises", {}, green(keep_promises=True)),
    "book-overruns": Variant("green, book_overruns", {}, green(book_overruns=True)),
    "book-overruns-safety-1.0-price-0.2": Variant(
        "green, book_overruns, duration_safety 1, room at 0.2", {},
        green(book_overruns=True, duration_safety=1.0, latency_reserve_price=0.2)),
    "greedy-undeclared": Variant("baseline-carbon-greedy, inflexible jobs undeclared", {"declare_inflexible": False},
                                 lambda: policy("baseline-carbon-greedy")),
    "green-undeclared": Variant("green, inflexible jobs undeclared", {"declare_inflexible": False},
                                lambda: policy("green")),
    "cheapest-first-undeclared": Variant("baseline-cheapest-first, inflexible jobs undeclared",
                                         {"declare_inflexible": False}, lambda: policy("baseline-cheapest-first")),
}


def priced(prep: Prepared, federation: engine.Federation) -> engine.Federation:
    """``federation`` as a policy that knew the offline LP's price of every site-hour's capacity would read
    it: each hour's intensity, and each hour's forecast of every hour ahead, raised by that hour's price over
    the site's power per GPU (the LP's shadow prices, :func:`broker.simulation.run.capacity_prices`; they know
    the jobs still to come). Only what the policy reads: carbon is accounted on the true intensity
    (:func:`true_carbon`)."""
    g_per_kwh = capacity_prices(prep) * 1000.0 / prep.federation.facts().power_kw_per_gpu[:, None]
    n_sites, hours = g_per_kwh.shape
    assert federation.forecast is not None, "the replay reads forecasts: a profile"
    ahead = federation.forecast.shape[2]
    padded = np.hstack([g_per_kwh, np.zeros((n_sites, ahead))])  # no price past the carbon data
    forecast = federation.forecast + padded[:, np.arange(hours)[:, None] + np.arange(ahead)[None, :]]
    cum = np.zeros(forecast.shape[:2] + (ahead + 1,))
    np.cumsum(forecast, axis=2, out=cum[:, :, 1:])
    return replace(federation, intensity=federation.intensity + g_per_kwh, forecast=forecast, forecast_cum=cum)


def true_carbon(run: engine.PolicyRun, prep: Prepared) -> engine.PolicyRun:
    """``run`` with each job's carbon accounted on the true intensity, piece by piece, as the replay accounts
    it (``engine._account``)."""
    assert run.model is not None
    true = engine._account(run.name, prep.workload, prep.federation, run.site, run.model, run.start_s, run.end_s,
                           run.wall_s, last_start=run.last_start_s, moved=run.moved)
    return replace(run, carbon_kg=true.carbon_kg)


def replay(prep: Prepared, name: str, build: Callable[[], Pipeline], foresight: bool = False,
           with_prices: bool = False) -> tuple[engine.PolicyRun, float]:
    federation = true_future(prep.federation) if foresight else prep.federation
    if with_prices:
        federation = priced(prep, federation)
    t = time.perf_counter()
    run = engine.replay(name, build(), prep.workload, federation, prep.requests, prep.left_out)
    wall_s = time.perf_counter() - t
    return (true_carbon(run, prep) if with_prices else run), wall_s


def describe(prep: Prepared, name: str, run: engine.PolicyRun, wall_s: float) -> str:
    w = prep.workload
    ran = run.site >= 0
    missed = ran & (run.end_s > w.deadline_s + 1e-6)
    bound = np.nan_to_num(np.asarray(w.latency_slo_ms, dtype=np.float64), nan=0.0) > 0
    deferred = (run.start_s - w.submit_s) > 60.0
    overran = w.true_duration_s > w.estimated_duration_s
    mobile = missed & ~bound
    return (f"{name:42s} {run.carbon_kg[ran].sum() / 1000:7.1f} t {run.cost_usd[ran].sum():11,.0f} USD "
            f"{int(missed.sum()):6,d} misses: "
            f"latency-bound {int((missed & bound).sum()):5,d}, other {int(mobile.sum()):5,d} "
            f"(deferred and ran past the estimate {int((mobile & deferred & overran).sum()):5,d}); "
            f"after a deferral {int((missed & run.was_deferred).sum()):4,d} "
            f"(inflexible {int((missed & run.was_deferred & w.inflexible).sum()):4,d}); "
            f"moves {run.migrations:,d}, stops {run.preemptions:,d}  [{wall_s:.0f} s]")


def why_missed(prep: Prepared, run: engine.PolicyRun) -> str:
    """Where the latency-bound jobs that missed their deadline came from, whether any site near them (within
    their latency objective) had room for them when they arrived (GPUs of every model, less those the jobs
    running then held), and how long they waited."""
    w, base = prep.workload, prep.federation.base
    bound = ~np.isnan(np.asarray(w.latency_slo_ms, dtype=np.float64))
    missed = np.flatnonzero((run.site >= 0) & (run.end_s > w.deadline_s + 1e-6) & bound)
    if not missed.size:
        return "    no latency-bound job missed its deadline"
    jobs, site, start, end = run.pieces()
    held = np.array([prep.requests[j].charge for j in jobs.tolist()])
    capacity = base.total_gpus.sum(axis=1)
    near_of = LatencyFilter()
    origins: Counter[str] = Counter()
    full = 0
    for j in missed.tolist():
        req, t = prep.requests[j], float(w.submit_s[j])
        busy = (start <= t) & (end > t)
        in_use = np.bincount(site[busy], weights=held[busy], minlength=base.n_sites)
        near = near_of.passes(req, base)
        if near is not None and not np.any(near & (capacity - in_use >= req.charge)):
            full += 1
        origins[req.origin_region or "?"] += 1
    wait_h = (run.start_s[missed] - w.submit_s[missed]) / 3600.0
    where = ", ".join(f"{origin} {n:,d}" for origin, n in origins.most_common())
    days = Counter((w.start + timedelta(seconds=float(w.submit_s[j]))).date().isoformat() for j in missed.tolist())
    busiest = ", ".join(f"{day} {n:,d}" for day, n in days.most_common(3))
    return (f"    latency-bound misses by origin: {where}; {full:,d} of {missed.size:,d} found no site near them "
            f"with room when they arrived; they waited {np.median(wait_h):.2f} h at the median "
            f"(90th percentile {np.percentile(wait_h, 90):.2f} h); submitted on {len(days):,d} days, the most on "
            f"{busiest}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--year", type=int, default=2021, help="the carbon year the trace is mapped onto")
    p.add_argument("--utilisation", type=float, default=0.3, help="mean GPU utilisation the sites are sized for")
    p.add_argument("--data", type=Path, default=SHARED, help="the shared data folder")
    p.add_argument("--seed", type=int, default=0,
                   help="the workload's seed (heliotrope simulate --seed): which jobs are inflexible or latency-bound, "
                        "their origins and their estimates' errors; the Evidence's is 0")
    p.add_argument("--variants", default="all", help="'all' or a comma-separated list of: " + ", ".join(VARIANTS))
    p.add_argument("--why-missed", action="store_true",
                   help="after each line: the latency-bound misses by origin, how many found every site near them "
                        "full when they arrived, and how long they waited")
    args = p.parse_args()
    names = list(VARIANTS) if args.variants == "all" else [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    trace = args.data / "traces" / "philly" / "philly_jobs_pollux.csv"
    carbon = args.data / "carbon-intensity" / "electricitymaps-hourly"
    for path in (trace, carbon):
        if not path.exists():
            p.error(f"{path}: not found (give --data)")
    print(f"green sensitivity: Philly, {args.year}, utilisation {args.utilisation:g}, workload seed {args.seed}")
    prepared: dict[tuple[tuple[str, object], ...], Prepared] = {}
    for name in names:
        label, assumptions, build, foresight, with_prices = VARIANTS[name]
        key = tuple(sorted(assumptions.items()))
        if key not in prepared:
            # policies: a profile, so that the replay builds the forecasts it reads
            spec = SimulationSpec(trace=trace, mapping=resolve_preset("philly"), carbon=carbon, policies=["green"],
                                  utilisation=args.utilisation, trace_from=date(2017, 9, 1),
                                  start=date(args.year, 9, 1), bound=False, seed=args.seed,
                                  assumptions=dict(assumptions))
            prepared[key] = prepare(spec)
        run, wall_s = replay(prepared[key], label, build, foresight, with_prices)
        print(describe(prepared[key], label, run, wall_s), flush=True)
        if args.why_missed:
            print(why_missed(prepared[key], run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
