"""The discrete-event replay: a workload's jobs arrive, the scheduling cycle places them, they run, they end.

What is the live broker's and what is the simulator's
    Placement is the live cycle's own step 3 (:class:`broker.cycle.PassDecider`: jobs in priority-then-age
    order against one snapshot, a shape that failed fails for the rest of the pass, each placement debited
    at once) running the same :class:`policies.pipeline.Pipeline` on the same
    :class:`policies.snapshot.Snapshot` arrays. The cycle's passes are kept too: a *full* pass re-decides the
    whole queue whenever capacity freed (a job ended); between them a pass decides only the jobs that
    arrived. What the simulator replaces are the steps that talk to the world: collect (it knows every
    site's free GPUs exactly, so the snapshot is its own ledger), the store (nothing to make durable), and
    dispatch (a simulated site admits at once what the snapshot said fits, and runs it for its *true*
    duration). The asynchronous steps are exercised by the broker's own tests; here they would only add
    the event loop's cost to every job. As the live broker does, the replay learns how run times compare with
    estimates from the jobs that have finished (:class:`policies.runtime_risk.RunTimeErrors`, in every
    snapshot): the only knowledge of true run times a policy gets, and only once a job has ended.

Events
    Time jumps from event to event: an arrival (a job's submit time) or a completion (start + true
    duration). At each instant, completions are applied first, then arrivals, then one pass runs with
    ``now`` set to that instant and the grid intensity of the hour containing it. Ties are resolved by
    the pipeline's own rule (first site by name) and queue order by (priority, submit time, job index), so
    a replay is deterministic: same inputs, same numbers.

Accounting (per job, over its actual run window ``[start, start + true duration)``)
    - energy (kWh) = GPUs held × the GPU model's board power (:attr:`broker.ids.GpuModel.tdp_w`, the power
      limit: the simulated GPUs are busy for the whole run, so this is an upper-end figure; no host, network
      or cooling overhead, i.e. PUE 1) × hours. GPUs held is ``milli / 1000`` for a fractional job.
    - carbon (kg CO2e) = GPUs held × power × the integral of the site zone's hourly intensity over the run
      window (hour by hour, partial hours pro rata) / 1000.
    - cost (USD) = GPU-hours × the site's price per GPU-hour of the model used (its spec's
      ``usd_per_gpu_hour``; an unpriced model costs 0 and is reported).

Moving running work (a profile with ``migrate`` and a workload with checkpointable jobs; ``policies.migration``)
    At each whole hour the running checkpointable jobs are offered to the policy, as the broker knows them
    (the work each has done, counted with the restart its profile assumes), and jobs with a latency objective
    that can wait no longer get room made at their sites, when they arrive and at each whole hour. A move
    ends the job's piece where it ran; the rest starts at once at the new site and takes the workload's
    ``restart_s`` longer. The GPUs it frees are offered to the queue in a pass at the same instant. Each
    piece is accounted where it ran (``PolicyRun.moved``); ``start_s`` stays the job's first start.

Capacity: whole-GPU jobs take free whole GPUs of one model at one site; a fractional job shares a GPU
(best fit: the fullest shared GPU it fits on, else a fresh one), as the simulated adapter packs them.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn
from datetime import datetime, timedelta

import numpy as np

from broker.cycle import PassDecider
from broker.models import SiteSpec
from policies.filters.gpu_fit import GpuFitFilter
from policies.filters.latency import LatencyFilter
from policies.pipeline import Pipeline, Placement
from policies import timeshift
from policies.migration import Move, Running, make_room, plan_moves, urgent
from policies.latency_reserve import LatencyDemand
from policies.runtime_risk import RunTimeErrors, expected_ratio
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest, Snapshot, _offset_hour, build_snapshot
from policies.tenant_limit import TenantLimits, TenantRoom
from policies.timeshift import Booking, Calendar, Deferral, epoch_hour, run_slots

from broker.simulation.results import PolicyRun, SiteFacts
from broker.simulation.workload import Workload



class SimulationError(ValueError):
    """The run cannot go on as asked; the message names the job, site or zone and what to change."""


@dataclass(frozen=True)
class Federation:
    """The simulated sites as arrays: the base snapshot (full capacity), and the hourly intensity of each
    site's zone from the run's start, with its running integral for carbon accounting."""

    specs: tuple[SiteSpec, ...]  # in name order, as the snapshot's rows
    base: Snapshot
    intensity: np.ndarray  # float64[n_sites, hours]
    cumulative: np.ndarray  # float64[n_sites, hours + 1]: integral of intensity in g/kWh·h from the start
    price: np.ndarray  # float64[n_sites, n_models]: USD per GPU-hour, NaN unpriced
    forecast: np.ndarray | None = None  # float32[n_sites, hours, 168]: each hour's forecast of the next week
    forecast_cum: np.ndarray | None = None  # float64[n_sites, hours, 169]: their running sums
    utc_offset_h: np.ndarray | None = None  # float64[n_sites, hours]: local time - UTC in each hour
    forecast_model_h: int = 0  # hours of each forecast row its model made (the rest: the mean day); 0: all

    @property
    def hours(self) -> int:
        return int(self.intensity.shape[1])

    def facts(self) -> SiteFacts:
        has = self.base.total_gpus > 0
        power = np.where(has, TDP_KW[None, :], np.inf).min(axis=1)
        # An unpriced model costs 0 in the accounting (reported by run.prepare), so it does in the bound too.
        price = np.where(has, np.nan_to_num(self.price, nan=0.0), np.inf).min(axis=1)
        return SiteFacts(
            names=self.base.sites,
            zones=tuple(s.grid_zone for s in self.specs),
            regions=self.base.regions,
            capacity_gpus=self.base.total_gpus.sum(axis=1).astype(np.int64),
            usd_per_gpu_hour=price,
            power_kw_per_gpu=power,
            intensity=self.intensity,
        )

    def carbon_integral(self, site: np.ndarray | int, t_s: np.ndarray) -> np.ndarray:
        """The integral of each site's intensity from the start to ``t_s`` (g/kWh·h), partial hours pro rata."""
        return hourly_integral(self.intensity, self.cumulative, site, t_s)


def hourly_integral(hourly: np.ndarray, cum: np.ndarray, row: np.ndarray | int, t_s: np.ndarray) -> np.ndarray:
    """The integral of ``hourly[row]`` (values per hour from the run's start; ``cum``: their running sums,
    one column more) from 0 to ``t_s`` seconds, partial hours pro rata; past the last hour, its value."""
    hours = t_s / 3600.0
    h = np.minimum(np.floor(hours).astype(np.int64), hourly.shape[1] - 1)
    if isinstance(row, (int, np.integer)):  # one row: index its view (the oracle asks for one site at a time)
        return cum[row][h] + (hours - h) * hourly[row][h]
    return cum[row, h] + (hours - h) * hourly[row, h]


def build_federation(specs: Sequence[SiteSpec], intensity_by_zone: dict[str, np.ndarray], start: datetime,
                     forecast_by_zone: dict[str, np.ndarray] | None = None, forecast_model_h: int = 0) -> Federation:
    """``specs`` in configured order (spillover's order); ``intensity_by_zone``: hourly values from ``start``,
    every zone the same length; ``forecast_by_zone``: [hours, reach] forecasts, when a policy reads them, of
    which the first ``forecast_model_h`` hours are the model's (0: all)."""
    snap = build_snapshot(start, list(specs), {}, carbon_g_per_kwh=None)
    ordered = tuple(sorted(specs, key=lambda s: s.name))
    for i, spec in enumerate(ordered):
        for model, n in spec.total_gpus().items():
            snap.total_gpus[i, MODEL_INDEX[model]] = n
    snap.free_gpus[:] = snap.total_gpus
    snap.healthy[:] = True
    intensity = np.vstack([intensity_by_zone[s.grid_zone] for s in ordered]).astype(np.float64)
    cumulative = np.zeros((len(ordered), intensity.shape[1] + 1))
    np.cumsum(intensity, axis=1, out=cumulative[:, 1:])
    forecast = None
    offsets = None
    if forecast_by_zone is not None:
        forecast = np.stack([forecast_by_zone[s.grid_zone] for s in ordered])
        hours = intensity.shape[1]
        offsets = np.array([[_offset_hour(s.timezone, int(start.timestamp() // 3600) + h) for h in range(hours)]
                            for s in ordered], dtype=np.float64)
    forecast_cum = None
    if forecast is not None:
        forecast_cum = np.zeros(forecast.shape[:2] + (forecast.shape[2] + 1,))
        np.cumsum(forecast, axis=2, out=forecast_cum[:, :, 1:])
    return Federation(ordered, snap, intensity, cumulative, snap.usd_per_gpu_hour, forecast, forecast_cum, offsets,
                      forecast_model_h if forecast is not None else 0)


def requests_of(workload: Workload) -> list[JobRequest]:
    """Each job's placement request, as the live cycle builds it from the job's spec."""
    empty: frozenset[str] = frozenset()
    out = []
    regions = workload.region_names
    start_ts = workload.start.timestamp()
    deferrable = workload.deferrable.tolist()
    tenants = workload.tenant_names
    for i, (count, milli, model, estimate, origin, slo, deadline, submitted, tenant) in enumerate(zip(
            workload.gpus.tolist(), workload.milli.tolist(), workload.model.tolist(),
            workload.estimated_duration_s.tolist(), workload.origin_region.tolist(), workload.latency_slo_ms.tolist(),
            workload.deadline_s.tolist(), workload.submit_s.tolist(), workload.tenant.tolist(), strict=True)):
        out.append(JobRequest(job_id=str(i), count=count, milli=milli, model=model, memory_gib=0.0,
                              allowed_regions=empty, denied_regions=empty, duration_s=estimate,
                              origin_region=regions[origin], latency_slo_ms=None if slo != slo else slo,
                              deadline_ts=start_ts + deadline, submitted_ts=start_ts + submitted,
                              checkpointable=bool(workload.checkpointable[i]), deferrable=deferrable[i],
                              tenant=tenants[tenant]))
    return out


def sites_fitting(requests: Sequence[JobRequest], federation: Federation) -> np.ndarray:
    """bool[n_jobs, n_sites]: the sites each job fits when empty and that meet its latency objective (the
    pipeline's own GPU-fit and latency filters on the full federation): the only sites any policy could
    run it on. A job with none is left out of the run (no policy that honours the objective could run it),
    and the offline bound keeps every other job to its sites."""
    fit, near = GpuFitFilter(), LatencyFilter()
    by_shape: dict[tuple[object, ...], np.ndarray] = {}
    out = np.empty((len(requests), federation.base.n_sites), dtype=bool)
    for i, req in enumerate(requests):
        shape = req.shape
        ok = by_shape.get(shape)
        if ok is None:
            sites = fit.passes(req, federation.base)
            within = near.passes(req, federation.base)
            ok = by_shape[shape] = sites if within is None else sites & within
        out[i] = ok
    return out


class _Shared:
    """One site-model's shared GPUs: how many thousandths of each are in use."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used: list[int] = []


def replay(
    name: str,
    pipeline: Pipeline,
    workload: Workload,
    federation: Federation,
    requests: Sequence[JobRequest],
    left_out: np.ndarray,
    progress: Callable[[int], None] | None = None,
    tenant_limits: TenantLimits | None = None,
) -> PolicyRun:
    """Run every job of ``workload`` (except ``left_out``) to completion under ``pipeline``; ``tenant_limits``: the
    GPUs each tenant's jobs may hold at once across the federation (``broker.tenant_limits``), as the live cycle
    holds them (a job that would take its tenant past it waits; the caller leaves out any job larger than its
    limit, which would wait for ever)."""
    began = time.perf_counter()
    n = len(workload)
    submit = workload.submit_s
    true_s = workload.true_duration_s
    start_at = workload.start
    hours = federation.hours
    horizon_s = hours * 3600.0
    site_of = np.full(n, -1, dtype=np.int32)
    model_of = np.full(n, -1, dtype=np.int32)
    start_s = np.full(n, np.nan)
    end_s = np.full(n, np.nan)
    shapes = [r.shape for r in requests]
    fractional = [r.fractional for r in requests]
    priority = [r.priority for r in requests]

    base = federation.base
    free = base.free_gpus.copy(order="F")
    shared_free = np.zeros_like(base.shared_free_milli, order="F")
    cursor = np.full(1, -1, dtype=np.int64)
    shares: dict[tuple[int, int], _Shared] = {}
    share_of: dict[int, int] = {}  # job -> index of its shared GPU

    completions: list[tuple[float, int]] = []
    queue: list[int] = []  # jobs waiting for room, in scheduling order
    in_queue: set[int] = set()
    order_key = (lambda i: (-priority[i], submit[i], i)) if any(priority) else None
    if pipeline.urgent_first:
        t0 = start_at.timestamp()
        latest = np.array([timeshift.urgency_ts(t0 + float(submit[i]), r.deadline_ts, r.duration_s, r.deferrable)
                           for i, r in enumerate(requests)])
        rank = np.empty(n, dtype=np.int64)
        rank[np.lexsort((np.arange(n), latest, -np.asarray(priority)))] = np.arange(n)
        order_key = rank.tolist().__getitem__
    todo = np.flatnonzero(~left_out).tolist()
    next_arrival = 0
    done = passes = 0

    # Time-shifting (profiles with ``shift``): the plan of booked hours, each job's booking, and the jobs
    # deferred to a whole hour (decided again at every whole hour, when the forecast moves on).
    shift = pipeline.shift
    start_ts = start_at.timestamp()
    calendar = Calendar(base.n_sites, base.total_gpus.shape[1], epoch_hour(start_at)) if shift else None
    bookings: dict[int, Booking] = {}
    # With book_overruns: (replay seconds, job) when a running job is to be looked at (the start of the last
    # hour its booking holds, and when its estimate runs out); the running jobs whose estimate has run out (or
    # runs out this hour), looked at again at each whole hour; and what they are expected to hold past their
    # bookings (Snapshot.plan_overrun), one booking each.
    book_late = shift is not None and shift.book_overruns
    overdue: list[tuple[float, int]] = []
    overran: set[int] = set()
    looked_h = -1
    overruns = Calendar(base.n_sites, base.total_gpus.shape[1], epoch_hour(start_at)) if book_late else None
    past_estimate: dict[int, Booking] = {}
    errors = RunTimeErrors()  # how the finished jobs' run times compared with their estimates, as the broker learns it
    deferred: set[int] = set()
    ever_deferred = np.zeros(n, dtype=bool)
    gpus_held = [r.charge for r in requests]
    # The room kept for latency-bound jobs (ShiftPolicy.latency_reserve): what they held, sampled hourly.
    near = [r.latency_slo_ms is not None for r in requests]
    demand = LatencyDemand() if shift is not None and shift.latency_reserve is not None else None
    near_now = np.zeros(base.total_gpus.shape)  # GPUs latency-bound jobs hold now (past their estimates too)
    # Moving running work (profiles with ``migrate``): at every whole hour, the running checkpointable jobs
    # are offered to policies.migration; a move ends the job's piece where it ran and starts the rest, after
    # the workload's restart time, at the new site. A completion queued for an earlier end is then stale.
    migrate = pipeline.migrate if workload.checkpointable.any() else None
    restart_s = float(workload.assumptions.restart_s)
    running: set[int] = set()
    last_start = np.full(n, np.nan)  # start of a moved job's current piece
    done_before = np.zeros(n)  # seconds of work a moved job had done when its current piece started
    # ... as the broker counts it: it knows when each piece started, not how long a restart really took, so
    # it takes off the overhead its profile assumes (overhead_s) where the replay takes the workload's restart_s.
    seen_before = np.zeros(n)
    assumed_s = float(migrate.overhead_s) if migrate is not None else 0.0
    again = False  # a move freed GPUs: decide the queue again at the same instant
    resumed = np.zeros(n, dtype=bool)  # stopped to make room and back in the queue: its next start resumes it
    suspensions = 0
    whole = requests  # each job's own request: what a move reads (its estimate, against the work done)
    requests = list(requests)  # a stopped job's entry becomes the rest of its run (the caller's list is kept)
    moved: list[tuple[float, float, float, float, float]] = []  # earlier pieces: job, site, model, start, end

    # What each limited tenant's running jobs hold now (GPUs), as the live cycle counts it at each pass.
    limited = [tenant_limits is not None and tenant_limits.of(r.tenant) is not None for r in requests]
    held_by: dict[str, float] = {}

    def hold(j: int, sign: float) -> None:
        if limited[j]:
            tenant = requests[j].tenant or ""
            held_by[tenant] = held_by.get(tenant, 0.0) + sign * gpus_held[j]

    def start(j: int, outcome: Placement, decider: PassDecider, t: float) -> None:
        """Start job ``j`` now where ``outcome`` places it, debited from the pass's snapshot."""
        s, m = outcome.site, outcome.model
        if fractional[j]:
            # The ledger decides where the share goes; the snapshot's own debit is an estimate, so
            # its figures for this site-model are set from the ledger afterwards.
            whole_before = int(free[s, m])
            decider.assume(outcome)
            pool = shares.setdefault((s, m), _Shared())
            share_of[j], opened = _share(pool, int(requests[j].milli))
            free[s, m] = whole_before - opened
            shared_free[s, m] = _shared_free(pool)
        else:
            decider.assume(outcome)
        if calendar is not None:
            bookings[j] = calendar.book(s, m, gpus_held[j], *run_slots(start_ts + t, requests[j].duration_s),
                                        near=near[j])
            if book_late:
                overran.discard(j)  # a stopped job resumed: booked afresh for the rest of its run
                forget_overrun(j)
                look_at(j, bookings[j], t + requests[j].duration_s)
        if near[j]:
            near_now[s, m] += gpus_held[j]
        site_of[j], model_of[j] = s, m
        if resumed[j]:  # the rest of a stopped job's run, from its checkpoint
            resumed[j] = False
            last_start[j] = t
            end_s[j] = t + restart_s + (float(true_s[j]) - float(done_before[j]))
        else:
            start_s[j] = t
            end_s[j] = t + float(true_s[j])
        if end_s[j] > horizon_s:
            _past_the_data(j, float(end_s[j]), federation, workload, s)
        heapq.heappush(completions, (end_s[j], j))
        running.add(j)
        hold(j, 1.0)

    def work_done(j: int, t: float, seen: bool = False) -> tuple[float, float]:
        """(when job ``j``'s current piece started, seconds of work it has done by ``t``: in truth, or as the
        broker counts it when ``seen``)."""
        if last_start[j] != last_start[j]:
            return float(start_s[j]), t - float(start_s[j])
        before, lost = (seen_before[j], assumed_s) if seen else (done_before[j], restart_s)
        return float(last_start[j]), float(before) + max(t - float(last_start[j]) - lost, 0.0)

    def offer(t: float) -> list[Running]:
        """The running jobs a move may take, as the broker knows them (the work each has done, not its end),
        but not one that started at ``t``: a piece of no length would buy nothing for a restart. Nor one that
        a move would run past the carbon data (the replay's own limit, read from the true end)."""
        out = []
        for j in sorted(running):
            if (requests[j].checkpointable and not fractional[j] and work_done(j, t)[0] < t
                    and end_s[j] + restart_s <= horizon_s):
                out.append(Running(whole[j], int(site_of[j]), int(model_of[j]), work_done(j, t, seen=True)[1]))
        return out

    def apply(move: Move, t: float) -> None:
        """End the moving job's piece here and restart the rest, after the restart time, at its new site (or,
        stopped to make room, put it back in the queue, its work kept)."""
        nonlocal suspensions
        j = int(move.running.request.job_id)
        began, done = work_done(j, t)
        seen_before[j] = work_done(j, t, seen=True)[1]
        moved.append((j, site_of[j], model_of[j], began, t))
        done_before[j], last_start[j] = done, t
        if near[j]:
            near_now[site_of[j], model_of[j]] -= gpus_held[j]
            if move.site >= 0:
                near_now[move.site, move.model] += gpus_held[j]
        if move.site < 0:
            suspensions += 1
            running.discard(j)
            hold(j, -1.0)
            resumed[j] = True
            end_s[j] = np.nan  # its queued completion is stale
            booking = bookings.pop(j, None)
            if booking is not None and calendar is not None:
                calendar.release(booking)
            if book_late:
                forget_overrun(j)
            requests[j] = replace(requests[j], duration_s=move.remaining_s + (migrate.overhead_s if migrate else 0.0),
                                  not_before_ts=move.not_before_ts, estimate_s=whole[j].duration_s)
            requeued.append(j)
            return
        site_of[j], model_of[j] = move.site, move.model
        end_s[j] = t + restart_s + (float(true_s[j]) - done)
        heapq.heappush(completions, (end_s[j], j))
        booking = bookings.pop(j, None)
        if booking is not None and calendar is not None:
            calendar.release(booking)
        if calendar is not None and migrate is not None:
            bookings[j] = calendar.book(move.site, move.model, gpus_held[j],
                                        *run_slots(start_ts + t, move.remaining_s + migrate.overhead_s), near=near[j])
            if book_late:
                overran.discard(j)  # booked afresh, for the rest of its run there
                forget_overrun(j)
                look_at(j, bookings[j], t + move.remaining_s + migrate.overhead_s)

    def look_at(j: int, booking: Booking, estimate_end: float) -> None:
        """When to look at job ``j`` for ``book_overruns``: at the start of the last hour its booking holds,
        and when its estimate runs out (replay seconds)."""
        heapq.heappush(overdue, ((booking.end - 1) * 3600.0 - start_ts, j))
        heapq.heappush(overdue, (estimate_end, j))

    def forget_overrun(j: int, from_h: int | None = None) -> None:
        booking = past_estimate.pop(j, None)
        if booking is not None and overruns is not None:
            overruns.release(booking, from_h=from_h)

    def book_overruns(h0: int, t: float) -> None:
        """``book_overruns``: a running job whose booking holds no hour after this one (its estimate runs
        out this hour, or ran out before) may hold its GPUs past it, until the end that the finished jobs
        that ran as long predict (``runtime_risk.expected_ratio``), worked out again at each whole hour as it
        runs on and more jobs finish, and when its estimate runs out (the live broker: at every pass). Those
        hours go to ``overruns``, which the pass's ``Snapshot.plan_overrun`` shows beside the plan
        (``timeshift.unless_it_slips``)."""
        nonlocal looked_h
        assert overruns is not None
        fresh: list[int] = []
        while overdue and overdue[0][0] <= t:
            _, j = heapq.heappop(overdue)
            booking = bookings.get(j)
            if j in running and booking is not None and booking.end <= h0 + 1:
                overran.add(j)
                fresh.append(j)
        if h0 != looked_h:
            looked_h = h0
            fresh = list(overran)
        if not fresh:
            return
        known = errors.sorted()
        for j in fresh:
            booking = bookings.get(j)
            forget_overrun(j)
            if j not in running or booking is None:
                overran.discard(j)
                continue
            estimate = float(whole[j].duration_s)  # the job's own, against all the work it has done
            done = work_done(j, t, seen=True)[1]
            ratio = expected_ratio(known, done / estimate) if estimate > 0 else None
            if ratio is None:
                continue
            end_h = int(np.ceil((start_ts + t + estimate * ratio - done) / 3600.0))
            if end_h > max(booking.end, h0 + 1):
                past_estimate[j] = overruns.book(booking.site, booking.model, booking.gpus,
                                                 max(booking.end, h0 + 1), end_h)

    t_prev = -np.inf
    while next_arrival < len(todo) or completions or deferred:
        t_arrival = float(submit[todo[next_arrival]]) if next_arrival < len(todo) else np.inf
        t = min(t_arrival, completions[0][0]) if completions else t_arrival
        boundary = freed = False
        if again:  # the GPUs that moves freed: the queue is decided again now
            t, freed, again = t_prev, True, False
        elif deferred or (migrate is not None and running):
            t_hour = (np.floor(t_prev / 3600.0) + 1.0) * 3600.0
            if t_hour <= t:
                t, boundary = t_hour, True
        t_prev = t
        while completions and completions[0][0] <= t:
            t_end, j = heapq.heappop(completions)
            if t_end != end_s[j] or j not in running:  # the job moved: it ends later, elsewhere
                continue
            running.discard(j)
            hold(j, -1.0)
            s, m = int(site_of[j]), int(model_of[j])
            if near[j]:
                near_now[s, m] -= gpus_held[j]
            if fractional[j]:
                pool = shares[(s, m)]
                k = share_of.pop(j)
                pool.used[k] -= int(requests[j].milli)
                if pool.used[k] == 0:
                    free[s, m] += 1  # the GPU is whole again
                shared_free[s, m] = _shared_free(pool)
            else:
                free[s, m] += requests[j].count
            booking = bookings.pop(j, None)
            if booking is not None and calendar is not None:  # ended before (or after) its expected end
                calendar.release(booking, from_h=int((start_ts + t) // 3600.0) + 1)
            if overruns is not None:
                forget_overrun(j, from_h=int((start_ts + t) // 3600.0) + 1)
            freed = True
            done += 1
            errors.add(whole[j].duration_s, float(true_s[j]))  # its own estimate (a resumed job's entry is the rest)
        fresh: list[int] = []
        while next_arrival < len(todo) and submit[todo[next_arrival]] <= t:
            fresh.append(todo[next_arrival])
            next_arrival += 1
        candidates = (queue + fresh) if freed else fresh
        if boundary:
            candidates = candidates + sorted(deferred)
        moving = boundary and migrate is not None and bool(running)
        if not candidates and not moving:
            continue
        if order_key is not None:
            candidates.sort(key=order_key)
        elif boundary or freed:
            candidates.sort()  # job index is submit order
        h = min(int(t // 3600.0), hours - 1)
        hourly = {} if federation.forecast is None else {
            "carbon_forecast": federation.forecast[:, h, :], "carbon_forecast_cum": federation.forecast_cum[:, h, :],
            "carbon_forecast_model_h": federation.forecast_model_h,
            "utc_offset_h": federation.utc_offset_h[:, h]}
        now = start_at + timedelta(seconds=t)
        if calendar is not None:
            plan = calendar.view(now, free, base.total_gpus, shift.plan_hours)
            plan[:, :, max(hours - h, 1):] = 0  # no simulated site runs past the carbon data: plan no start there
            hourly["plan_free"] = plan
            if overruns is not None:
                book_overruns(epoch_hour(now), t)
                hourly["plan_overrun"] = overruns.booked_view(now, shift.plan_hours)
            if demand is not None:
                hourly["near_booked"] = booked = calendar.near_view(now, shift.plan_hours)
                booked[:, :, 0] = near_now  # as plan_free's hour 0 is the real free capacity
                demand.observe(epoch_hour(now), base.sites, near_now)
                hourly["near_samples"] = demand.samples(base.sites, booked.shape[1])
        if tenant_limits is not None:
            hourly["tenant_room"] = TenantRoom(tenant_limits, dict(held_by))
        snap = replace(base, now=now, free_gpus=free, shared_free_milli=shared_free,
                       carbon_g_per_kwh=federation.intensity[:, h], last_placed=cursor,
                       run_time_errors=errors.sorted(), **hourly)
        decider = PassDecider(pipeline, snap)
        waiting: list[int] = []  # candidates not already queued that now wait for room
        requeued: list[int] = []  # running jobs stopped to make room, back in the queue
        gone: set[int] = set()  # queued candidates placed or deferred
        for j in candidates:
            booking = bookings.pop(j, None)
            if booking is not None:  # a deferred job decided again: its hours are free to plan anew
                calendar.release(booking)
                decider.credit(booking)
            outcome = decider.decide(requests[j], shapes[j])
            if isinstance(outcome, Deferral):
                first = epoch_hour(now) + outcome.slot
                bookings[j] = calendar.book(outcome.site, outcome.model, gpus_held[j], first, first + outcome.slots,
                                            near=near[j])
                decider.reserve(outcome)
                # Planned for a whole hour: out of the queue until the next one, when it is decided again.
                ever_deferred[j] |= outcome.now_site >= 0  # for a saving (else for lack of room now)
                deferred.add(j)
                if j in in_queue:
                    gone.add(j)
                continue
            if not outcome.placed:  # waits for room
                deferred.discard(j)
                if j not in in_queue:
                    waiting.append(j)
                continue
            deferred.discard(j)
            if j in in_queue:
                gone.add(j)
            start(j, outcome, decider, t)
        if migrate is not None and migrate.make_room:
            # Jobs near their users that can wait no longer get room made at their sites (policies.migration):
            # those that just found no room, and at each whole hour those still waiting.
            offered: list[Running] | None = None
            asking = (*queue, *waiting) if boundary else waiting
            for j in sorted((k for k in asking if k not in gone), key=order_key or int):
                if not urgent(requests[j], start_ts + t, migrate):
                    continue
                offered = offer(t) if offered is None else offered
                moves = make_room(pipeline, decider.snap, requests[j], offered, migrate)
                if not moves:
                    continue
                offered = None  # the moved jobs run elsewhere now
                for move in moves:
                    apply(move, t)
                again = True
                outcome = decider.pipeline.decide(requests[j], decider.snap)
                if not outcome.placed:  # make_room moved enough GPUs out of one of its sites
                    raise SimulationError(f"job {j} did not fit where room was made for it")
                start(j, outcome, decider, t)
                deferred.discard(j)
                gone.add(j)
        if moving:  # at a whole hour, running jobs move where the rest of their run is cleaner
            for move in plan_moves(pipeline, decider.snap, offer(t), migrate):
                apply(move, t)
                again = True
        if demand is not None:  # what the pass started is held for the rest of the hour
            demand.observe(epoch_hour(now), base.sites, near_now)
        if gone:
            queue = [j for j in queue if j not in gone]
            in_queue -= gone
            waiting = [j for j in waiting if j not in gone]
        waiting.extend(requeued)
        if waiting:
            newest = queue[-1] if queue else -1
            queue.extend(waiting)
            in_queue.update(waiting)
            if order_key is not None:
                queue.sort(key=order_key)
            elif waiting[0] < newest:
                queue.sort()
        passes += 1
        if progress is not None and passes % 4096 == 0:
            progress(done)
    if queue:  # nothing left that could free room: a job no site can ever take slipped past sites_fitting
        raise SimulationError(f"{len(queue)} jobs were still waiting when no job was left to end or arrive "
                              f"(first: job {queue[0]}); no site can ever take them")
    if progress is not None:
        progress(done)
    pieces = np.array(moved, dtype=np.float64).reshape(-1, 5)
    run = _account(name, workload, federation, site_of, model_of, start_s, end_s, time.perf_counter() - began,
                   last_start=last_start, moved=pieces)
    run.deferred = int(ever_deferred.sum())
    run.preemptions = run.requeues = suspensions
    run.was_deferred = ever_deferred
    return run


def _share(pool: _Shared, milli: int) -> tuple[int, bool]:
    """Put a fractional job on the fullest shared GPU it fits on, else open a fresh one. Returns the shared
    GPU's index and whether it was opened (a whole free GPU became shared)."""
    best = -1
    idle = -1
    for k, used in enumerate(pool.used):
        if used == 0:
            idle = k if idle < 0 else idle
        elif used + milli <= 1000 and (best < 0 or used > pool.used[best]):
            best = k
    if best >= 0:
        pool.used[best] += milli
        return best, False
    if idle < 0:
        pool.used.append(0)
        idle = len(pool.used) - 1
    pool.used[idle] = milli
    return idle, True


def _shared_free(pool: _Shared) -> int:
    """The most thousandths free on one shared GPU in use (0 when none is shared)."""
    return max((1000 - u for u in pool.used if u), default=0)


def _past_the_data(job: int, end_s: float, federation: Federation, workload: Workload, site: int) -> NoReturn:
    zone = federation.specs[site].grid_zone
    raise SimulationError(
        f"job {job} would end {end_s / 3600.0:.1f} h after the run's start ({workload.start.isoformat()}), past the "
        f"{federation.hours} h of carbon data that zone {zone} and the others share from then; choose an earlier "
        "--start, fewer --days, or more years of carbon data"
    )


def _account(name: str, workload: Workload, federation: Federation, site: np.ndarray, model: np.ndarray,
             start_s: np.ndarray, end_s: np.ndarray, wall_s: float, *, last_start: np.ndarray | None = None,
             moved: np.ndarray | None = None) -> PolicyRun:
    """Per job energy, carbon and cost over where it ran: from ``start_s`` (or ``last_start``, where not NaN:
    a moved job's last piece) to ``end_s`` at ``site``/``model``, plus the earlier pieces in ``moved`` (rows of
    job, site, model, start, end)."""
    ran = site >= 0
    n = len(workload)
    held = workload.held
    energy = np.zeros(n)
    carbon = np.zeros(n)
    cost = np.zeros(n)
    if ran.any():
        s, m = site[ran], model[ran]
        last = float(end_s[ran].max())
        if last > federation.hours * 3600.0:
            j = int(np.flatnonzero(ran)[np.argmax(end_s[ran])])
            _past_the_data(j, last, federation, workload, int(site[j]))
        begin = start_s[ran]
        if last_start is not None:
            begin = np.where(np.isnan(last_start[ran]), begin, last_start[ran])
        power = TDP_KW[m] * held[ran]
        run_h = (end_s[ran] - begin) / 3600.0
        energy[ran] = power * run_h
        integral = federation.carbon_integral(s, end_s[ran]) - federation.carbon_integral(s, begin)
        carbon[ran] = power * integral / 1000.0
        cost[ran] = held[ran] * run_h * np.nan_to_num(federation.price[s, m], nan=0.0)
    if moved is not None and moved.shape[0]:
        j, ps, pm = moved[:, 0].astype(np.int64), moved[:, 1].astype(np.int64), moved[:, 2].astype(np.int64)
        a, b = moved[:, 3], moved[:, 4]
        power = TDP_KW[pm] * held[j]
        run_h = (b - a) / 3600.0
        np.add.at(energy, j, power * run_h)
        np.add.at(carbon, j, power * (federation.carbon_integral(ps, b) - federation.carbon_integral(ps, a)) / 1000.0)
        np.add.at(cost, j, held[j] * run_h * np.nan_to_num(federation.price[ps, pm], nan=0.0))
    return PolicyRun(name=name, site=site, start_s=start_s, end_s=end_s, energy_kwh=energy, carbon_kg=carbon,
                     cost_usd=cost, wall_s=wall_s, model=np.asarray(model, dtype=np.int64),
                     last_start_s=last_start, moved=moved)
