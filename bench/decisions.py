"""Placement decisions per second of the default pipeline over a large federation (1,000 sites by default).

What runs:

1. ``--sites`` site specs with varied GPU inventories (a100-40gb, a100-80gb, h100-80gb, l4, t4; one to three
   node groups each), in eight ``gcp:``/``aws:`` regions, and a reported state for each: healthy (about 2%
   unhealthy, about 1% never heard from), with free whole GPUs and free shares of shared GPUs drawn at
   random. Seeded, so every run sees the same federation.
2. ``--jobs`` distinct job specs (whole GPUs 1..8, some naming a model, some a minimum memory, some a
   fraction of one GPU, some with allowed or denied regions, about 2% asking for a model no site has),
   turned into ``JobRequest`` objects before the
   timed loop (that conversion is timed on its own and reported).
3. The timed loop, as step 3 of the scheduling cycle does it: ``pipeline.decide(req, snap)`` and, when the
   job is placed, ``snap.assume(site, req, model)``, so later decisions see the debited capacity. When the
   federation runs low on free GPUs (checked every 500 decisions, outside the timed section), the snapshot
   is rebuilt from the original states with ``build_snapshot``; rebuilds are timed and reported on their
   own, not counted in the decision rate.
4. The cost of ``policies.explain.record`` (what the live cycle adds to keep a decision's explanation) and
   of serialising that record to JSON (what the store adds), on a sample of decisions.

``--profile NAME`` decides with a routing profile's pipeline (every scorer it weighs; ``every``: all the
routing scorers at once, follow-the-sun in both modes, with ``green``'s time-shifting, every bound and
the priced deadline risk on) on snapshots that
carry a week's carbon forecast per site, as the broker's rows reach (``broker.forecast.REACH_H``): the
seasonal-naive forecast of a real zone at a seeded hour of 2022 and, past its 48 hours, the zone's mean day
over the 28 days before (``--carbon``, default the shared data's 16 zones, round robin over the sites), or seeded random
intensities when there is no such folder. ``--shift`` adds the profile's time-shifting, as
the live cycle runs it: every job gets a deadline (its expected run plus 2 to 48 hours of slack, seeded),
every snapshot a plan hour by hour (``Snapshot.plan_free`` from a ``policies.timeshift.Calendar``: the GPUs
in use now stay busy for 1 to 12 more hours, seeded), the run-time errors of 2,000 finished jobs
(log-normal, sigma 0.5, seeded: what the pricing of a deferral's risk to the deadline reads), for a profile
that keeps room for latency-bound jobs (``green``'s time-shifting does) a week of what they held (at a third
of the sites, up to half of each model's GPUs there, seeded; ``--no-latency-reserve`` keeps none), and jobs are
decided through ``broker.cycle.PassDecider`` (``decide``, then ``assume`` for a placement or ``reserve`` for
a deferral), so the timed figure covers the whole decision with the time-shift search; it also prints the share of
deferrals and the cost of ``timeshift.plan`` per shiftable job.

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/decisions.py [--sites 1000] [--jobs 50000] [--seed 1] [--explain-sample 2000]
                                        [--profile balanced|green|cheap|fast|every [--shift [--no-latency-reserve]]]
                                        [--now ISO-TIME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SHARED_CARBON = Path(__file__).resolve().parents[2] / "shared" / "data" / "carbon-intensity" / "electricitymaps-hourly"

from broker import ids  # noqa: E402
from broker.data.carbon import load_carbon  # noqa: E402
from broker.cycle import PassDecider  # noqa: E402
from broker.forecast import PROFILE_DAYS, REACH_H, daily_profile, extend_by_profile  # noqa: E402
from broker.models import Health, JobSpec, ModelCapacity, SiteSpec, SiteState  # noqa: E402
from policies import explain, latency_reserve, runtime_risk, timeshift  # noqa: E402
from policies.pipeline import choose_model, default_pipeline  # noqa: E402
from policies.profiles import BUILTIN, SHIFTS, pipeline_for, profile_pipeline  # noqa: E402
from policies.snapshot import JobRequest, Snapshot, build_snapshot, replace_forecast  # noqa: E402
from policies.timeshift import Deferral, ShiftPolicy  # noqa: E402

MODELS = ("a100-40gb", "a100-80gb", "h100-80gb", "l4", "t4")
MODEL_WEIGHTS = (0.2, 0.2, 0.15, 0.25, 0.2)
REGIONS = (
    ("gcp:us-east1", "US-MIDA-PJM", "America/New_York"),
    ("gcp:us-central1", "US-MIDW-MISO", "America/Chicago"),
    ("gcp:europe-west4", "NL", "Europe/Amsterdam"),
    ("gcp:asia-east1", "TW", "Asia/Taipei"),
    ("aws:us-east-1", "US-MIDA-PJM", "America/New_York"),
    ("aws:us-west-2", "US-NW-BPAT", "America/Los_Angeles"),
    ("aws:eu-west-1", "IE", "Europe/Dublin"),
    ("aws:ap-northeast-1", "JP-TK", "Asia/Tokyo"),
)
REGION_IDS = tuple(r[0] for r in REGIONS)


def make_federation(n_sites: int, rng: random.Random) -> tuple[list[SiteSpec], dict[str, SiteState | None]]:
    specs: list[SiteSpec] = []
    states: dict[str, SiteState | None] = {}
    for i in range(n_sites):
        region, zone, tz = rng.choice(REGIONS)
        models = rng.sample(MODELS, k=rng.choice((1, 1, 2, 2, 3)))
        groups = []
        for m in models:
            per_node = rng.choice((1, 2, 4, 8, 8))
            groups.append({"model": m, "gpus_per_node": per_node, "nodes": rng.randint(1, 16)})
        name = f"site-{i:05d}"
        spec = SiteSpec(
            name=name, region=region, grid_zone=zone, timezone=tz,
            latitude=rng.uniform(-60, 60), longitude=rng.uniform(-180, 180), gpus=groups,
            usd_per_gpu_hour={m: round(rng.uniform(0.3, 12.0), 3) for m in models},
        )
        specs.append(spec)
        roll = rng.random()
        if roll < 0.01:
            states[name] = None  # never heard from: unhealthy in the snapshot
            continue
        health = Health.UNHEALTHY if roll < 0.03 else Health.HEALTHY
        capacity = []
        for g in spec.gpus:
            total = g.gpus
            free = rng.randint(0, total) if rng.random() < 0.8 else 0
            shared = rng.choice((0, 0, 0, 250, 500, 750)) if free < total else 0
            capacity.append(ModelCapacity(
                model=g.model, total_gpus=total, free_gpus=free, used_gpus=total - free,
                shared_free_milli=shared, memory_gib_per_gpu=g.gpu_memory_gib,
            ))
        states[name] = SiteState(site=name, health=health, capacity=capacity,
                                 reason=None if health == Health.HEALTHY else "bench: marked unhealthy")
    return specs, states


def make_jobs(n_jobs: int, rng: random.Random) -> list[JobSpec]:
    jobs = []
    for i in range(n_jobs):
        gpus: dict = {}
        kind = rng.random()
        if kind < 0.15:
            gpus = {"count": 1, "milli": rng.choice((250, 500))}
        else:
            gpus = {"count": rng.choice((1, 1, 1, 2, 2, 4, 4, 8))}
        shape = rng.random()
        if shape < 0.02:
            gpus["model"] = "h200-141gb"  # no site has these: the job fits nowhere (the unplaceable path)
        elif shape < 0.3:
            gpus["model"] = rng.choices(MODELS, MODEL_WEIGHTS)[0]
        elif shape < 0.5:
            gpus["memory_gib"] = rng.choice((20, 32, 40, 80))
        allowed: list[str] = []
        denied: list[str] = []
        where = rng.random()
        if where < 0.2:
            allowed = rng.sample(REGION_IDS, k=rng.randint(1, 3))
        elif where < 0.3:
            denied = rng.sample(REGION_IDS, k=rng.randint(1, 2))
        jobs.append(JobSpec(
            tenant=rng.choice(("vision", "nlp", "speech", "research")), name=f"bench-{i}", gpus=gpus,
            duration_s=rng.choice((600, 3600, 4 * 3600)), priority=rng.choice((0, 0, 0, 10)),
            allowed_regions=allowed, denied_regions=denied,
        ))
    return jobs


def pct(values_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(values_ns, q)) / 1000.0


def with_deadlines(reqs: list[JobRequest], now: datetime, seed: int) -> list[JobRequest]:
    """Each request with a deadline: its expected run time plus 2 to 48 hours of slack (seeded)."""
    rng = random.Random(seed)
    now_s = now.timestamp()
    return [replace(r, deadline_ts=now_s + r.duration_s + rng.uniform(2.0, 48.0) * 3600.0) for r in reqs]


def plan_of(snap: Snapshot, shift: ShiftPolicy, seed: int) -> np.ndarray:
    """The time-shift plan the live cycle gives a pass (``Snapshot.plan_free``, from a ``Calendar``): the
    GPUs in use now stay busy until their jobs' expected end, drawn per site and model from 1 to 12 hours
    (seeded); later hours are free."""
    rng = np.random.default_rng(seed)
    hours = shift.plan_hours
    h0 = timeshift.epoch_hour(snap.now)
    calendar = timeshift.Calendar(snap.n_sites, snap.total_gpus.shape[1], h0, span_h=hours + 1)
    used = snap.total_gpus - np.maximum(snap.free_gpus, 0)
    ends = rng.integers(1, 13, size=used.shape)
    for site, model in zip(*np.nonzero(used > 0), strict=True):
        calendar.book(int(site), int(model), float(used[site, model]), h0, h0 + int(ends[site, model]))
    return calendar.view(snap.now, snap.free_gpus, snap.total_gpus, hours)


def near_of(snap: Snapshot, shift: ShiftPolicy, seed: int) -> dict[str, np.ndarray]:
    """What a profile that keeps room for latency-bound jobs (``latency_reserve``) reads in a pass, as the live
    cycle hands it: a week of hourly samples of the GPUs such jobs held (at a third of the sites, seeded, up to
    half of each model's GPUs there) and what they hold or have booked in each hour of the plan (nothing)."""
    rng = np.random.default_rng(seed + 1)
    share = np.where(rng.random(snap.n_sites) < 1 / 3, rng.uniform(0.0, 0.5, snap.n_sites), 0.0)
    samples = rng.random((latency_reserve.WINDOW_H,) + snap.total_gpus.shape) * share[None, :, None]
    samples = np.sort(np.floor(samples * snap.total_gpus[None]), axis=0).astype(np.float32)
    return {"near_samples": samples, "near_booked": np.zeros(snap.plan_free.shape)}


def real_forecasts(folder: Path, n_sites: int, seed: int) -> np.ndarray:
    """[n_sites, REACH_H]: site i gets zone i mod (zones in ``folder``), and as its forecast the row a broker
    with a seasonal-naive model would make at a seeded hour of 2022: the 24 hours before, twice over (real
    daily shapes, so a later start is cleaner where the grid's day makes it so, not at random), then the
    zone's mean day over the 28 days before (``broker.forecast.extend_by_profile``), to a week."""
    carbon = load_carbon(folder)
    zones = sorted(carbon.zones())
    hour = datetime(2022, 1, 8, tzinfo=UTC) + timedelta(hours=random.Random(seed).randrange(300 * 24))
    past = {z: np.asarray(carbon.series(z, hour - timedelta(days=PROFILE_DAYS), PROFILE_DAYS * 24), dtype=np.float64)
            for z in zones}
    rows = {z: extend_by_profile(np.tile(y[-24:], 2)[None, :], daily_profile(y, PROFILE_DAYS, [len(y)]), REACH_H)[0]
            for z, y in past.items()}
    return np.vstack([rows[zones[i % len(zones)]] for i in range(n_sites)])


EVERY = BUILTIN["balanced"] | {"follow_sun_solar": 0.1}
"""``--profile every``: the routing issue's scorers all weighed at once (latency, cost, carbon, follow-the-sun
in both modes, telemetry) and free GPUs, as ``balanced`` weighs them, plus solar follow-the-sun."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", type=int, default=1000, help="sites in the federation (default %(default)s)")
    p.add_argument("--jobs", type=int, default=50_000, help="distinct jobs to decide (default %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="seed of the federation and the jobs")
    p.add_argument("--explain-sample", type=int, default=2000,
                   help="decisions whose explain.record cost is measured (default %(default)s)")
    p.add_argument("--profile", default=None,
                   help="decide with a routing profile (balanced, green, cheap, fast): every scorer it weighs, "
                        "with a week's carbon forecast per site (from --carbon); 'every': every routing scorer at once "
                        "(EVERY below) with green's time-shifting; default: the release's default pipeline")
    p.add_argument("--carbon", type=Path, default=SHARED_CARBON if SHARED_CARBON.exists() else None,
                   help="carbon-intensity folder whose zones the sites take, round robin, with a seasonal-naive "
                        "forecast (default: shared/data's when present; without one, seeded random intensities)")
    p.add_argument("--shift", action="store_true",
                   help="with --profile: the profile's time-shifting too; every job gets a deadline (2-48 h of "
                        "slack), the snapshot a plan hour by hour, and jobs are decided as the cycle does "
                        "(broker.cycle.PassDecider: decide, then assume a placement or reserve a deferral)")
    p.add_argument("--now", type=datetime.fromisoformat, default=None,
                   help="the decisions' time, ISO 8601 with a UTC offset (default: the current time); the forecast "
                        "hours, the plan and so the outcomes depend on it, so two builds decide the same jobs the "
                        "same way only at the same --now")
    p.add_argument("--no-latency-reserve", action="store_true",
                   help="with --shift: keep no room for latency-bound jobs (green keeps it, priced: without this, a "
                        "third of the sites are seen to need some, and the plan keeps it)")
    p.add_argument("--refresh-below", type=float, default=0.2,
                   help="rebuild the snapshot when free whole GPUs fall below this share of the start")
    args = p.parse_args()
    if args.shift and args.profile is None:
        p.error("--shift needs --profile: the default pipeline never defers a job")
    rng = random.Random(args.seed)

    t = time.perf_counter()
    specs, states = make_federation(args.sites, rng)
    t_fed = time.perf_counter() - t
    t = time.perf_counter()
    jobs = make_jobs(args.jobs, rng)
    t_jobs = time.perf_counter() - t

    # JobRequest conversion: done before the timed loop, timed on its own.
    t = time.perf_counter_ns()
    reqs = [JobRequest.from_spec(f"job-{i:06d}", spec) for i, spec in enumerate(jobs)]
    conv_ns = time.perf_counter_ns() - t

    if args.now is not None and args.now.tzinfo is None:
        p.error("--now needs a UTC offset, e.g. 2026-11-28T01:37:11+00:00")
    now = datetime.now(UTC) if args.now is None else args.now.astimezone(UTC)
    if args.profile == "every":
        pipeline = pipeline_for(EVERY, SHIFTS["green"])
    else:
        pipeline = default_pipeline() if args.profile is None else profile_pipeline(args.profile)
    if args.no_latency_reserve and pipeline.shift is not None:
        weights = EVERY if args.profile == "every" else BUILTIN[args.profile]
        pipeline = pipeline_for(weights, pipeline.shift.model_copy(update={"latency_reserve": None,
                                                                           "latency_reserve_price": None}))
    shift = pipeline.shift if args.shift else None
    if args.shift:
        reqs = with_deadlines(reqs, now, args.seed)
        if shift is None:
            print(f"note: profile {args.profile} has no time-shift policy; no job will be deferred")
    forecast = None
    if args.profile is not None and args.carbon is not None and args.carbon.exists():
        forecast = real_forecasts(args.carbon, args.sites, args.seed)
    elif args.profile is not None:  # seeded intensities, 50..700 g/kWh, one 48-hour row per site
        forecast = np.random.default_rng(args.seed).uniform(50, 700, size=(args.sites, REACH_H))

    # What the broker has learned after 2,000 jobs finished that ran a log-normal factor (sigma 0.5) off their
    # estimates, as the simulator's workload draws them: a deferral's risk to the deadline is priced from it.
    learned = runtime_risk.RunTimeErrors()
    for error in np.random.default_rng(args.seed).normal(0.0, 0.5, runtime_risk.KEEP):
        learned.add(3600.0, 3600.0 * float(np.exp(error)))
    errors = learned.sorted()

    def fresh() -> Snapshot:
        built = build_snapshot(now, specs, states)
        if forecast is not None:
            built = replace_forecast(built, forecast)
        if shift is not None:
            built = replace(built, plan_free=plan_of(built, shift, args.seed), run_time_errors=errors)
            if shift.latency_reserve is not None:
                built = replace(built, **near_of(built, shift, args.seed))
        return built

    t = time.perf_counter_ns()
    snap = build_snapshot(now, specs, states)
    build_ns = time.perf_counter_ns() - t
    snap = fresh()
    start_free = int(snap.free_gpus[snap.healthy].sum())
    refresh_at = max(1, int(start_free * args.refresh_below))

    # Warm-up on a throwaway snapshot (first calls into numpy paths), then the measured run.
    decider = PassDecider(pipeline, snap)
    for req in reqs[:300]:
        outcome = decider.decide(req) if args.shift else pipeline.decide(req, snap)
        if isinstance(outcome, Deferral):
            decider.reserve(outcome)
        elif outcome.placed:
            decider.assume(outcome)
    snap = fresh()
    decider = PassDecider(pipeline, snap)

    decide_ns = np.empty(len(reqs), dtype=np.int64)
    assume_ns = 0
    placed = 0
    deferred = 0
    refreshes = 0
    refresh_ns = 0
    perf = time.perf_counter_ns
    loop_start = perf()
    untimed_ns = 0
    for i, req in enumerate(reqs):
        t0 = perf()
        outcome = decider.decide(req) if args.shift else pipeline.decide(req, snap)
        t1 = perf()
        decide_ns[i] = t1 - t0
        if isinstance(outcome, Deferral):
            decider.reserve(outcome)
            assume_ns += perf() - t1
            deferred += 1
        elif outcome.placed:
            decider.assume(outcome)
            assume_ns += perf() - t1
            placed += 1
        if i % 500 == 499:  # outside the timed section: is the federation running out of GPUs?
            u0 = perf()
            if int(snap.free_gpus[snap.healthy].sum()) < refresh_at:
                snap = fresh()
                decider = PassDecider(pipeline, snap)  # a new pass
                refreshes += 1
                refresh_ns += perf() - u0
            untimed_ns += perf() - u0
    loop_ns = perf() - loop_start - untimed_ns

    # explain.record (and the JSON the store writes) on a sample, on a fresh snapshot.
    snap = fresh()
    sample = reqs[: min(args.explain_sample, len(reqs))]
    record_ns = np.empty(len(sample), dtype=np.int64)
    dumps_ns = np.empty(len(sample), dtype=np.int64)
    record_bytes = 0
    for i, req in enumerate(sample):
        placement = pipeline.decide(req, snap)
        t0 = perf()
        rec = explain.record(pipeline, placement, snap)
        t1 = perf()
        text = json.dumps(rec, separators=(",", ":"))
        t2 = perf()
        record_ns[i] = t1 - t0
        dumps_ns[i] = t2 - t1
        record_bytes += len(text)
        if placement.placed:
            snap.assume(placement.site, req, placement.model)

    # Where a decision's time goes: each filter, each scorer, the model choice and the time-shift search,
    # called on their own.
    snap = fresh()
    parts: dict[str, int] = {f"filter {f.code}": 0 for f in pipeline.filters}
    parts.update({f"scorer {w.scorer.name}": 0 for w in pipeline.scorers})
    parts["choose_model (placed jobs)"] = 0
    if shift is not None:
        parts["timeshift.plan (shiftable jobs)"] = 0
        if shift.keep_promises:
            parts["timeshift.start_now (placed jobs not deferred)"] = 0
    shiftable = 0
    for req in sample:
        for f in pipeline.filters:
            t0 = perf()
            f.passes(req, snap)
            parts[f"filter {f.code}"] += perf() - t0
        for w in pipeline.scorers:
            t0 = perf()
            w.scorer.raw(req, snap)
            parts[f"scorer {w.scorer.name}"] += perf() - t0
        placement = pipeline.decide(req, snap)
        if placement.placed:
            t0 = perf()
            choose_model(req, snap, placement.site)
            parts["choose_model (placed jobs)"] += perf() - t0
        outcome = placement
        if shift is not None and timeshift.shiftable(req, snap, shift):
            shiftable += 1
            t0 = perf()
            outcome = timeshift.plan(req, snap, placement, shift, pipeline.filter_codes) or placement
            parts["timeshift.plan (shiftable jobs)"] += perf() - t0
        elif shift is not None and shift.keep_promises and placement.placed:
            t0 = perf()
            outcome = timeshift.start_now(req, snap, placement, shift, pipeline.filter_codes)
            parts["timeshift.start_now (placed jobs not deferred)"] += perf() - t0
        if isinstance(outcome, Deferral):
            timeshift.debit(snap, outcome.site, outcome.model, req.charge, outcome.slot,
                            outcome.slot + outcome.slots)
        elif outcome.placed:
            snap.assume(outcome.site, req, outcome.model)

    n = len(reqs)
    decide_total_s = decide_ns.sum() / 1e9
    rate_loop = n / (loop_ns / 1e9)
    rate_decide = n / decide_total_s
    mean_record_us = record_ns.mean() / 1000
    mean_decide_us = decide_ns.mean() / 1000
    n_models = sum(1 for m in ids.GPU_MODEL_IDS if snap.total_gpus[:, ids.GPU_MODEL_IDS.index(m)].any())

    print()
    print(f"heliotrope placement benchmark: {args.sites} sites, {n} jobs, seed {args.seed}; "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}")
    what = "the default pipeline" if args.profile is None else f"profile {args.profile}"
    if shift is not None:
        what += (f" with time-shifting ({shift.objective}, min_saving {shift.min_saving:g}, horizon "
                 f"{shift.horizon_h} h, a {shift.plan_hours}-hour plan); deadlines 2-48 h after each job's run")
    print(f"  deciding with {what}")
    print(f"  federation: {len(specs)} sites in {len(REGIONS)} regions, {n_models} GPU models, "
          f"{int(snap.total_gpus.sum())} GPUs, {start_free} free whole GPUs at healthy sites; "
          f"{int((~snap.healthy).sum())} sites unhealthy or never heard from")
    print(f"  setup (not timed below): site specs+states {t_fed:.2f} s, {n} JobSpecs {t_jobs:.2f} s")
    print(f"  JobRequest.from_spec: done BEFORE the timed loop; {n} conversions in {conv_ns / 1e6:.1f} ms "
          f"= {conv_ns / n / 1000:.2f} us each")
    print(f"  build_snapshot({args.sites} sites): {build_ns / 1e6:.2f} ms; rebuilt {refreshes} times when free "
          f"GPUs fell below {args.refresh_below:.0%} of the start "
          f"({refresh_ns / max(refreshes, 1) / 1e6:.2f} ms each, not counted in the rates)")
    print(f"  decide: mean {mean_decide_us:.1f} us, p50 {pct(decide_ns, 50):.1f} us, "
          f"p99 {pct(decide_ns, 99):.1f} us, max {decide_ns.max() / 1000:.1f} us")
    per = {k: v / len(sample) for k, v in parts.items()}
    if shift is not None:  # per job it ran for
        per["timeshift.plan (shiftable jobs)"] = parts["timeshift.plan (shiftable jobs)"] / max(shiftable, 1)
    print("  inside decide, called on their own (mean per decision): "
          + ", ".join(f"{k} {v / 1000:.1f} us" for k, v in per.items()))
    if shift is not None:
        print(f"  time-shift search: {shiftable}/{len(sample)} sampled jobs were shiftable (latest start after "
              f"the next whole hour)")
    print(f"  {'assume or reserve' if args.shift else 'assume'}: "
          f"{assume_ns / max(placed + deferred, 1) / 1000:.2f} us per placement or deferral")
    print(f"  explain.record on {len(sample)} decisions: mean {mean_record_us:.1f} us, "
          f"p99 {pct(record_ns, 99):.1f} us; json.dumps of the record: mean {dumps_ns.mean() / 1000:.1f} us, "
          f"p99 {pct(dumps_ns, 99):.1f} us, {record_bytes / len(sample) / 1024:.1f} KiB per record")
    print()
    print("=" * 78)
    how = ("PassDecider.decide with time-shifting + assume or reserve" if args.shift
           else "decide + assume")
    print(f"decisions/s at {args.sites} sites ({how}, JobRequest built beforehand): {rate_loop:,.0f}")
    print(f"  decide alone: {rate_decide:,.0f}/s; mean {mean_decide_us:.1f} us, p99 {pct(decide_ns, 99):.1f} us "
          f"per decision; placed {placed}/{n} = {placed / n:.1%}"
          + (f", deferred {deferred}/{n} = {deferred / n:.1%}, waiting {n - placed - deferred}/{n} = "
             f"{(n - placed - deferred) / n:.1%}" if args.shift else ""))
    per_live_us = mean_decide_us + mean_record_us + conv_ns / n / 1000
    mean_dumps_us = dumps_ns.mean() / 1000
    print(f"  + JobRequest.from_spec (+{conv_ns / n / 1000:.2f} us) and explain.record (+{mean_record_us:.1f} us) "
          f"per decision, as the live cycle does for a placed job: {1e6 / per_live_us:,.0f}/s")
    print(f"  + json.dumps of the record (+{mean_dumps_us:.1f} us, {record_bytes / len(sample) / 1024:.1f} KiB; "
          f"SQLiteStore.save_decision does it on the event loop): {1e6 / (per_live_us + mean_dumps_us):,.0f}/s")
    print("=" * 78)
    return 0


if __name__ == "__main__":
    sys.exit(main())
