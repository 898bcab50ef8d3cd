"""The cost of moving running work: step 3b of the scheduling cycle (``broker.cycle.Cycle._move_running``), which
calls the pure policies of ``policies.migration`` over a large federation (1,000 sites by default).

What runs:

1. The federation of ``bench/decisions.py`` (``make_federation``: ``--sites`` sites in eight regions, seeded),
   frozen with ``build_snapshot`` at a fixed time (``NOW``), with a 48-hour carbon forecast per site (the
   seasonal-naive forecast of a real zone at a seeded hour of 2022 from the shared data, round robin over
   the sites; seeded random intensities without that folder: ``real_forecasts``), a time-shift plan
   (``Snapshot.plan_free`` from ``plan_of``: the GPUs the sites report in use stay busy 1 to 12 more hours)
   and a round-trip time from each region to each site (seeded: 1-30 ms within the region, 20-90 ms within
   the continent, 120-280 ms elsewhere), which the latency-objective filter reads.
2. ``--running`` running checkpointable jobs (default 10,000) on whole GPUs: 1 to 8 GPUs, an estimate of 2
   to 48 hours, a seeded fraction of it done (``Running.done_s``), half of them with a deadline 1 to 48
   hours after their expected end; each placed at a random healthy site and model with that many GPUs in
   use that no other running job holds (three in ten then name that model), as the live cycle sees its
   running jobs: inside what the sites report in use. The snapshot stays consistent: the free GPUs are what
   the sites report, and the plan books the running jobs' GPUs until their expected end (``assume`` of the
   rest of each run) and the other GPUs in use for 1 to 12 hours (``plan_of``). ``--on-free`` puts them on
   the GPUs reported free instead, debited from them (10,000 jobs then fill the default federation, and no
   move is possible). A job that no site has room for is left out; the figures say how many were offered.
3. ``plan_moves`` (the hourly moves for a saving), with the ``green`` profile's pipeline, shift and migrate
   policies (``pipeline_for(BUILTIN["green"], SHIFTS["green"], MIGRATIONS["green"])``), ``--repeat``
   times, each on ``snap.working_copy(snap.now)`` (it debits the moves from the snapshot it gets); only
   the call is timed. The pipeline is handed in through a wrapper that counts its ``decide`` calls (one
   Python call more per ``decide``), which gives the candidates: the jobs that could save enough against
   the best site anywhere, each decided once.
4. ``make_room`` for ``--urgent`` (default 300) seeded latency-bound requests that can wait no longer
   (``policies.migration.urgent``: a deadline 1.5 × the estimate plus under an hour away), 1 to 8 GPUs,
   a latency objective of 3, 5 or 8 ms from one of the federation's regions: each on its own working copy
   in which every site within the objective is full (its free GPUs held, for 6 hours, by work that cannot
   be moved), so the call must find checkpointable jobs to move out of one of them, or give up. Only the
   call is timed.

``--cprofile`` adds a cProfile of one ``plan_moves`` call and of the ``make_room`` calls (top functions by
cumulative time). This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/moves.py [--sites 1000] [--running 10000] [--urgent 300] [--seed 1] [--repeat 5]
                                    [--on-free] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import random
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the helpers of decisions.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

from decisions import REGION_IDS, SHARED_CARBON, make_federation, plan_of, real_forecasts  # noqa: E402

from broker import ids  # noqa: E402
from policies.migration import MigrationPolicy, Move, Running, make_room, movable, plan_moves, urgent  # noqa: E402
from policies.pipeline import Pipeline  # noqa: E402
from policies.profiles import BUILTIN, MIGRATIONS, SHIFTS, pipeline_for  # noqa: E402
from policies.snapshot import JobRequest, Snapshot, build_snapshot, replace_forecast  # noqa: E402
from policies.timeshift import ShiftPolicy  # noqa: E402

NOW = datetime(2026, 2, 2, 10, 20, tzinfo=UTC)
"""The snapshot's clock: fixed, so that a seed gives the same figures on any day (20 minutes into the hour)."""

CONTINENT = {"gcp:us-east1": "us", "gcp:us-central1": "us", "aws:us-east-1": "us", "aws:us-west-2": "us",
             "gcp:europe-west4": "eu", "aws:eu-west-1": "eu", "gcp:asia-east1": "asia",
             "aws:ap-northeast-1": "asia"}
SLO_MS = (3.0, 5.0, 8.0)
FILLER_S = 6 * 3600.0


def with_rtts(snap: Snapshot, rng: np.random.Generator) -> Snapshot:
    """``snap`` with a round-trip time from each of the federation's regions to each site (seeded)."""
    rtt = np.empty((snap.n_sites, len(REGION_IDS)))
    for k, origin in enumerate(REGION_IDS):
        for i, region in enumerate(snap.regions):
            if region == origin:
                rtt[i, k] = rng.uniform(1.0, 30.0)
            elif CONTINENT[region] == CONTINENT[origin]:
                rtt[i, k] = rng.uniform(20.0, 90.0)
            else:
                rtt[i, k] = rng.uniform(120.0, 280.0)
    return replace(snap, rtt_ms=rtt, origin_index={o: k for k, o in enumerate(REGION_IDS)})


def whole(job_id: str, count: int, duration_s: float, **kw: object) -> JobRequest:
    return JobRequest(job_id=job_id, count=count, milli=1000, model=None, memory_gib=0.0,
                      allowed_regions=frozenset(), denied_regions=frozenset(), duration_s=duration_s, **kw)


def place_running(snap: Snapshot, room: np.ndarray, n: int, rng: random.Random) -> tuple[list[Running], int]:
    """``n`` running checkpointable jobs, each at a random healthy site and model with that many GPUs left in
    ``room`` (int[n_sites, n_models], debited here); and how many found no room."""
    now_ts = snap.now.timestamp()
    ok = snap.healthy[:, None] & (snap.total_gpus > 0)
    names = ids.GPU_MODEL_IDS
    running: list[Running] = []
    no_room = 0
    for i in range(n):
        count = rng.choice((1, 1, 1, 2, 2, 4, 4, 8))
        cells = np.flatnonzero((ok & (room >= count)).ravel())
        if not cells.size:
            no_room += 1
            continue
        site, model = divmod(int(cells[rng.randrange(cells.size)]), room.shape[1])
        room[site, model] -= count
        duration = rng.uniform(2.0, 48.0) * 3600.0
        done = rng.random() * duration
        deadline = now_ts + (duration - done) + rng.uniform(1.0, 48.0) * 3600.0 if rng.random() < 0.5 else None
        req = whole(f"run-{i:06d}", count, duration, deadline_ts=deadline, submitted_ts=now_ts - done - 600.0,
                    tenant=rng.choice(("vision", "nlp", "speech", "research")), checkpointable=True)
        if rng.random() < 0.3:
            req = replace(req, model=names[model])
        running.append(Running(req, site, model, done))
    return running, no_room


def with_running(snap: Snapshot, shift: ShiftPolicy, n: int, seed: int, on_free: bool
                 ) -> tuple[Snapshot, list[Running], int]:
    """``snap`` with its time-shift plan and ``n`` running checkpointable jobs (``place_running``) debited from
    it, each for the rest of its run (``assume``: its GPUs now and the plan's hours until its expected end).

    By default they run on GPUs the sites report in use, as the live cycle sees them (a site's report counts
    its running jobs as used): the plan books the rest of those GPUs for 1 to 12 hours (``plan_of``) and the
    jobs' own until their expected end, and the free GPUs stay what the sites report. ``on_free``: they take
    GPUs the sites report free instead, and ``plan_of`` books every GPU reported in use."""
    rng = random.Random(seed * 1_000_003 + 3)
    if on_free:
        running, no_room = place_running(snap, snap.free_gpus.copy(), n, rng)
        snap = replace(snap, plan_free=plan_of(snap, shift, seed))
    else:
        used = np.where(snap.healthy[:, None], snap.total_gpus - np.maximum(snap.free_gpus, 0), 0)
        running, no_room = place_running(snap, used, n, rng)
        free = snap.free_gpus.copy(order="F")
        for r in running:  # their GPUs free while the plan books the others', taken back below
            free[r.site, r.model] += r.request.count
        snap = replace(snap, free_gpus=free)
        snap = replace(snap, plan_free=plan_of(snap, shift, seed))
    for r in running:
        snap.assume(r.site, replace(r.request, duration_s=r.request.duration_s - r.done_s), r.model, placed_now=False)
    return snap, running, no_room


def urgent_requests(n: int, now_ts: float, rng: random.Random) -> list[JobRequest]:
    """Latency-bound jobs whose latest start (deadline - 1.5 × the estimate) falls within the hour."""
    out = []
    for i in range(n):
        duration = rng.uniform(0.5, 4.0) * 3600.0
        out.append(whole(f"urgent-{i:04d}", rng.choice((1, 1, 2, 2, 4, 8)), duration,
                         origin_region=rng.choice(REGION_IDS), latency_slo_ms=rng.choice(SLO_MS),
                         deadline_ts=now_ts + 1.5 * duration + rng.uniform(0.0, 3000.0), submitted_ts=now_ts - 60.0,
                         tenant="serving"))
    return out


def full_near(base: Snapshot, req: JobRequest) -> tuple[Snapshot, int]:
    """A working copy of ``base`` in which every healthy site within ``req``'s latency objective is full: its
    free GPUs held by work that cannot move. Returns it and how many such sites there are."""
    trial = base.working_copy(base.now)
    near = np.flatnonzero(base.healthy & (base.rtt_ms[:, base.origin_index[req.origin_region]] <= req.latency_slo_ms))
    for site in near.tolist():
        for model in np.flatnonzero(trial.free_gpus[site] > 0).tolist():
            trial.hold(site, whole("filler", int(trial.free_gpus[site, model]), FILLER_S), model)
    return trial, int(near.size)


class Counting:
    """``pipeline`` with its ``decide`` calls counted (plan_moves makes one per candidate). What the policies
    read of it besides ``decide`` is copied onto it, so the count adds one Python call per ``decide`` and
    nothing else to the timed calls."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._decide = pipeline.decide
        self.shift = pipeline.shift
        self.migrate = pipeline.migrate
        self.filter_codes = pipeline.filter_codes
        self.decides = 0

    def decide(self, req: JobRequest, snap: Snapshot):  # noqa: ANN201
        self.decides += 1
        return self._decide(req, snap)

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"bench.moves.Counting: the policies read pipeline.{name}; copy it in __init__")


def top(profile: cProfile.Profile, n: int = 18) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(n)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", type=int, default=1000, help="sites in the federation (default %(default)s)")
    p.add_argument("--running", type=int, default=10_000,
                   help="running checkpointable jobs to place and offer (default %(default)s)")
    p.add_argument("--urgent", type=int, default=300,
                   help="urgent latency-bound requests to make room for (default %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="seed of the federation, the jobs and the requests")
    p.add_argument("--repeat", type=int, default=5, help="timed plan_moves calls (default %(default)s)")
    p.add_argument("--on-free", action="store_true",
                   help="run the jobs on GPUs the sites report free (debited from them) rather than on GPUs they "
                        "report in use; 10,000 jobs then fill the default federation and no move is possible")
    p.add_argument("--cprofile", action="store_true",
                   help="also profile one plan_moves call and the make_room calls (top functions by cumulative time)")
    args = p.parse_args()

    t = time.perf_counter()
    specs, states = make_federation(args.sites, random.Random(args.seed))
    pipeline = pipeline_for(BUILTIN["green"], SHIFTS["green"], MIGRATIONS["green"])
    policy: MigrationPolicy = pipeline.migrate  # type: ignore[assignment]
    assert policy is not None and pipeline.shift is not None
    if SHARED_CARBON.exists():
        forecast, carbon = real_forecasts(SHARED_CARBON, args.sites, args.seed), "real zones' seasonal-naive forecasts"
    else:
        forecast = np.random.default_rng(args.seed).uniform(50, 700, size=(args.sites, 48))
        carbon = "seeded random intensities (no shared carbon data)"
    snap = replace_forecast(build_snapshot(NOW, specs, states), forecast)
    snap = with_rtts(snap, np.random.default_rng([args.seed, 2]))
    free_before = int(snap.free_gpus[snap.healthy].sum())
    used_before = int((snap.total_gpus[snap.healthy] - snap.free_gpus[snap.healthy]).sum())
    snap, running, no_room = with_running(snap, pipeline.shift, args.running, args.seed, args.on_free)
    reqs = urgent_requests(args.urgent, snap.now.timestamp(), random.Random(args.seed * 1_000_003 + 5))
    assert all(urgent(r, snap.now.timestamp(), policy) for r in reqs)
    setup_s = time.perf_counter() - t
    now_ts = snap.now.timestamp()
    n_movable = sum(movable(r, now_ts, policy) is not None for r in running)
    running_gpus = sum(r.request.count for r in running)

    # Warm-up (Numba steps compiled or loaded from their cache, first calls into numpy paths), untimed.
    t = time.perf_counter()
    plan_moves(pipeline, snap.working_copy(snap.now), running[:200], policy)
    for req in reqs[:5]:
        make_room(pipeline, full_near(snap, req)[0], req, running, policy)
    warm_s = time.perf_counter() - t

    # plan_moves: the hourly moves for a saving, each call on its own working copy.
    perf = time.perf_counter_ns
    plan_ns = []
    moves: list[Move] = []
    candidates = 0
    for _ in range(args.repeat):
        trial = snap.working_copy(snap.now)
        counting = Counting(pipeline)
        t0 = perf()
        moves = plan_moves(counting, trial, running, policy)  # type: ignore[arg-type]
        plan_ns.append(perf() - t0)
        candidates = counting.decides

    # make_room: one urgent request at a time, on a working copy whose sites near it are full.
    room_ns = np.empty(len(reqs), dtype=np.int64)
    made = suspended = rehomed = 0
    calls = 0
    near_sites = []
    for i, req in enumerate(reqs):
        trial, n_near = full_near(snap, req)
        near_sites.append(n_near)
        counting = Counting(pipeline)
        t0 = perf()
        got = make_room(counting, trial, req, running, policy)  # type: ignore[arg-type]
        room_ns[i] = perf() - t0
        calls += counting.decides
        if got:
            made += 1
            suspended += sum(m.site < 0 for m in got)
            rehomed += sum(m.site >= 0 for m in got)

    plan_s = np.array(plan_ns) / 1e9
    room_us = room_ns / 1000.0
    print()
    print(f"heliotrope moves benchmark (policies.migration, step 3b of the cycle): {args.sites} sites, "
          f"seed {args.seed}; {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}")
    print(f"  profile green: {len(pipeline.filters)} filters, scorers "
          f"{', '.join(f'{w.scorer.name} {w.weight:g}' for w in pipeline.scorers)}; migrate: {policy.objective}, "
          f"min_saving {policy.min_saving:g} and {policy.min_saving_abs:g} kg, overhead {policy.overhead_s:g} s, "
          f"min_remaining {policy.min_remaining_s:g} s, duration_safety {policy.duration_safety:g}, "
          f"suspend {policy.suspend}; a {pipeline.shift.plan_hours}-hour plan; forecast: {carbon}")
    where = "reported free" if args.on_free else "reported in use"
    print(f"  running: {len(running)} checkpointable jobs offered, on {running_gpus} of the {where} GPUs of healthy "
          f"sites ({used_before} in use, {free_before} free as reported; {int(snap.free_gpus[snap.healthy].sum())} "
          f"free with the jobs debited; {no_room} of {args.running} jobs found no room and were left out); "
          f"{n_movable} movable (at least {policy.min_remaining_s / 3600:g} h left and the deadline holds)")
    print(f"  setup (not timed): {setup_s:.2f} s; warm-up (not timed): {warm_s:.2f} s")
    print()
    saved = sum(m.value_stay - m.value_move for m in moves)
    print(f"plan_moves over {len(running)} running jobs, {args.repeat} calls: median {np.median(plan_s):.3f} s, "
          f"max {plan_s.max():.3f} s per call (min {plan_s.min():.3f} s)")
    print(f"  {n_movable} movable, {candidates} candidates (could save enough against the best site anywhere: one "
          f"pipeline.decide each), {len(moves)} moves found on {sum(m.running.request.count for m in moves)} GPUs, "
          f"{saved:,.0f} kg CO2e less over the forecast's reach (restarts included)")
    print()
    print(f"make_room for {len(reqs)} urgent latency-bound requests (objective {'/'.join(f'{s:g}' for s in SLO_MS)} "
          f"ms; {np.median(near_sites):.0f} sites within it, median, min {min(near_sites)}, max {max(near_sites)}, "
          f"all full), {len(running)} running jobs offered:")
    print(f"  median {np.median(room_us):,.0f} us, p99 {np.percentile(room_us, 99):,.0f} us, "
          f"mean {room_us.mean():,.0f} us, max {room_us.max():,.0f} us per call")
    print(f"  room made for {made}/{len(reqs)} ({rehomed} jobs moved, {suspended} requeued); "
          f"{calls / len(reqs):.1f} pipeline.decide per call on average")

    if args.cprofile:
        prof = cProfile.Profile()
        trial = snap.working_copy(snap.now)
        prof.enable()
        plan_moves(pipeline, trial, running, policy)
        prof.disable()
        print()
        print("cProfile, one plan_moves call:")
        print(top(prof))
        prof = cProfile.Profile()
        for req in reqs:
            trial = full_near(snap, req)[0]
            prof.enable()
            make_room(pipeline, trial, req, running, policy)
            prof.disable()
        print()
        print(f"cProfile, {len(reqs)} make_room calls:")
        print(top(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
