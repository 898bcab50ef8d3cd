"""The scheduling cycle, in numbered steps:

1. collect  — ask every site for capacity and telemetry (concurrently, each with a timeout). This is a
              full pass, which then decides the whole queue; it runs when capacity may have grown or
              every ``full_pass_interval_s``. Between full passes, a pass decides only new jobs;
2. snapshot — freeze the federation into arrays, carrying ``now`` from the injected clock, and debit the
              placements still in flight: dispatched but not yet admitted, or admitted after the site's
              report was asked for (Kueue's assumed workloads), so no GPU is promised twice;
3. decide   — for each queued job, highest priority then oldest first (within a priority, tenants furthest
             below their fair share first where sites report quotas: ``policies.fair_order``), run the
             placement pipeline and
              debit each placement from the snapshot so later jobs see it;
4. assume   — write every placement to the store (state ``dispatching``, a new attempt), in one group
              commit, before any site hears of it;
5. dispatch — hand each job to its site's adapter in the background, so a slow site never stalls the
              cycle;
6. confirm or undo — an admitted job becomes ``admitted``; a refusal (or a site that did not answer in
              time) sends the job back to ``queued`` with that site skipped for a while, and the next cycle
              routes it elsewhere.

Moving running work (profiles with ``migrate``; ``policies.migration``): at the first full pass of each hour,
running checkpointable jobs whose rest of run is forecast to emit (or cost) enough less at another site are
moved there, and at every full pass a job near its users that can wait no longer and found no room gets
room made at its sites. A move asks the job's site to checkpoint and stop the attempt (``Preempter``); the
site's ``preempted`` event requeues the job with its progress kept, and the next pass restarts it at the
site the move chose, if that still has room (else wherever the profile now places it). Sites whose adapter
cannot stop a job on request have no job moved away.

The clock is injected, so the same cycle runs live (system clock) and in the simulator (manual clock).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from broker import ids
from broker.carbon_ledger import CarbonLedger, Counted, assess
from broker.clock import Clock
from broker.events import EventHub
from broker.federation import Federation
from broker.jobs import JobBook
from broker.queue import Entry, QueueWalk
from broker.lifecycle import Lifecycle
from broker.metrics import Metrics
from broker.models import GpuModelId, Job, JobSpec, JobState, SiteSpec
from adapters.base import AdapterError, Preempter
from broker.store import Store, StoreError
from policies import explain, runtime_risk, timeshift
from policies.fair_order import FairOrder
from policies.pipeline import Pipeline, Placement, default_pipeline
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot
from policies.tenant_limit import TenantLimits, TenantRoom
from policies import latency_reserve
from policies.latency_reserve import LatencyDemand
from policies import migration
from policies.migration import Move, Running, make_room, plan_moves, urgent
from policies.timeshift import Deferral

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A placement the sites' reports may not show yet."""

    site: str
    attempt: int
    request: JobRequest
    model: int


@dataclass(frozen=True, slots=True)
class CycleReport:
    full: bool
    decided: int
    placed: int
    unplaceable: int


@dataclass(frozen=True, slots=True)
class _Planned:
    """A deferred job's plan: where, which model column, how many GPUs, the POSIX hours it holds, and the
    hour it was decided in (it is decided again in the next one, when the forecast has moved on)."""

    site: str
    model: int
    gpus: float
    first: int
    end: int
    decided_h: int
    near: bool = False  # the job has a latency objective (policies.latency_reserve)
    # The planned site's spec when the plan was made: a site changed since (cordoned, re-zoned, re-priced,
    # its quotas or GPUs changed) is not what the plan weighed, so the job is decided again at the next pass.
    spec: SiteSpec | None = None


@dataclass(frozen=True, slots=True)
class _Moving:
    """A running job whose site was asked to checkpoint and stop it (``policies.migration``): where it ran
    (which attempt), where it goes (``site`` None: back to the queue, its place taken by ``for_job``), why, and
    when it was asked (POSIX seconds); ``delivered`` once the site has taken the request."""

    origin: str
    attempt: int
    site: str | None
    model: int
    reason: str
    for_job: str | None
    asked_ts: float
    delivered: bool = False


@dataclass(frozen=True, slots=True)
class _Hold:
    """GPUs kept at a site for one job until it is placed: where a move restarts it (``request``: the rest
    of its run), or where room was made for a job near its users. Debited from every pass's snapshot, as
    placements in flight are, until the job's attempt changes or ``until_ts`` passes."""

    site: str
    model: int
    request: JobRequest
    attempt: int
    until_ts: float


MOVE_TIMEOUT_S = 1800.0
"""Seconds a move waits for its site's ``preempted`` event and the pass that restarts the job (its target,
and the room made for a job near its users, held meanwhile) before it is forgotten and the job is treated as
any other; also how long the moved job keeps off the site it left."""
CANNOT_STOP_S = 3600.0
"""Seconds a site that failed to stop a job on request is left out of moves."""


def held_since(job: Job, end: datetime | None = None, ran_s: float = 0.0) -> datetime:
    """When ``job``'s attempt, admitted or running at its site, began to hold its GPUs, as far as the broker knows:
    its admission or start as the broker recorded it (``updated_at``), or earlier where its site says so: the
    start the site reported (``started_at``, while it runs), or its end ``end`` less the run ``ran_s`` the site
    reported with it (a broker that heard of the attempt late, or restarted meanwhile, recorded it late)."""
    since = job.updated_at
    if job.state == JobState.RUNNING and job.started_at is not None:
        since = min(since, job.started_at)
    if end is not None and ran_s > 0:
        since = min(since, end - timedelta(seconds=ran_s))
    return since


def work_done(job: Job, now: datetime, overhead_s: float) -> float:
    """Seconds of a running job's work done at ``now``: what earlier attempts kept through their checkpoints
    (``run_s`` less the time those that resumed from one spent restarting: ``restart_s``), plus this attempt's
    time running, less ``overhead_s`` (its restart) where it resumed from a checkpoint too."""
    ran = max((now - job.updated_at).total_seconds() - (overhead_s if job.run_s > 0 else 0.0), 0.0)
    return max(job.run_s - job.restart_s, 0.0) + ran


def rest_of_run(job: Job, req: JobRequest, overhead_s: float) -> JobRequest:
    """The request a queued job is decided on: where earlier attempts kept work through their checkpoints
    (``run_s``), the rest of its run (its estimate less the work done: :func:`work_done`) plus ``overhead_s``
    for its restart, as the simulator decides a job put back in the queue from its checkpoint and as a move
    holds its target (``policies.migration.rest_of``); so its scores, the plan's hours and its latest start
    are those of what it has left to run, not of the whole estimate again. ``req`` itself otherwise."""
    if job.run_s <= 0:
        return req
    rest = max(job.spec.duration_s - work_done(job, job.updated_at, overhead_s), 0.0) + overhead_s
    # (a job past its estimate, with no overhead: a second)
    return replace(req, duration_s=max(rest, 1.0), estimate_s=job.spec.duration_s)


def _urgency(job: Job) -> float:
    """The queue's order for pipelines that defer jobs (``policies.timeshift.urgency_ts``)."""
    deadline = job.spec.deadline.timestamp() if job.spec.deadline is not None else None
    return timeshift.urgency_ts(job.created_at.timestamp(), deadline, job.spec.duration_s, job.spec.deferrable)


def _by_urgency(job: Job) -> tuple[float, float]:
    return (_urgency(job), job.created_at.timestamp())


class _Listed:
    """A pass over given jobs (the new ones), in scheduling order; a :class:`broker.queue.QueueWalk`'s
    interface. Failures are shared through ``PassDecider`` alone: the list holds few jobs per group."""

    def __init__(self, jobs: list[Job], fair: FairOrder[Job] | None) -> None:
        self._jobs = jobs
        self._fair = fair

    def __iter__(self) -> Any:
        return (j.id for j in (self._fair if self._fair is not None else self._jobs))

    def placed(self, tenant: str, gpus: float) -> None:
        if self._fair is not None:
            self._fair.placed(tenant, gpus)

    def fail_group(self) -> None:
        """Nothing to drop: ``PassDecider`` already answers the rest of the shape from its failure."""


@dataclass(frozen=True, slots=True)
class _GroupFailure:
    """A queue group that found no site in a full pass: the job it failed at (its place in the group) and
    that decision's record, which is every later job's of the group until the next full pass."""

    entry: Entry
    record: dict[str, Any]
    at_ts: float  # POSIX seconds of the pass: a job submitted after it was not skipped by it


class _Failure:
    """An unplaceable decision shared by every job of the same request shape in one pass."""

    placed = False

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._signature: bytes | None = None
        self._record: dict[str, Any] | None = None

    @property
    def signature(self) -> bytes:
        """Which filters rejected which sites: two failures with one signature read the same."""
        if self._signature is None:
            self._signature = self.placement.failures.tobytes()
        return self._signature

    def record(self, pipeline: Pipeline, snap: Snapshot) -> dict[str, Any]:
        if self._record is None:
            self._record = explain.record(pipeline, self.placement, snap)
        return self._record


class PassDecider:
    """Step 3's rule, shared by the live cycle and the simulator (``broker.simulation.engine``): decide
    queued jobs in order against one snapshot. A request shape that found no site fails again for the rest
    of the pass, since capacity only shrinks within a pass; each placement is debited from the snapshot at
    once (``assume``), so later jobs in the pass see it. With a pipeline that shifts jobs in time and a
    snapshot that carries a plan (``Snapshot.plan_free``), a flexible job may come back as a
    :class:`policies.timeshift.Deferral`, which ``reserve`` debits from the plan."""

    __slots__ = ("pipeline", "snap", "failed", "unplanned")

    def __init__(self, pipeline: Pipeline, snap: Snapshot) -> None:
        self.pipeline = pipeline
        self.snap = snap
        self.failed: dict[tuple[Any, ...], _Failure] = {}
        # Flexible requests that found no start at all, by (shape, hours run, last start): the plan only
        # fills up within a pass (until ``credit`` gives hours back), so they find none again.
        self.unplanned: set[tuple[Any, ...]] = set()

    def decide(self, req: JobRequest, shape: tuple[Any, ...] | None = None) -> Placement | _Failure | Deferral:
        """The placement of ``req`` (not yet assumed), its deferral, or the failure its shape met in this
        pass. ``shape`` is ``req.shape`` when the caller has it cached."""
        key = req.shape if shape is None else shape
        if self.snap.quota is not None:  # the sites' quotas tell tenants apart
            key = (key, req.tenant, req.preemptible)
        elif self.snap.tenant_room is not None:  # so do limits across the federation
            key = (key, req.tenant)
        if self.snap.preempt_levels:  # so does what a job's priority lets a site preempt for it
            key = (key, bisect.bisect_left(self.snap.preempt_levels, req.priority))
        failure = self.failed.get(key)
        if failure is None:
            placement = self.pipeline.decide(req, self.snap)
            if not placement.placed:
                failure = self.failed[key] = _Failure(placement)
        else:
            placement = failure.placement
        shift = self.pipeline.shift
        if shift is None:
            return failure if failure is not None else placement
        if timeshift.shiftable(req, self.snap, shift):
            plan_key = None
            if failure is not None:
                plan_key = (key, *timeshift.window(req, self.snap, shift))
                if shift.max_risk is not None:  # which starts it may take depends on its own deadline and run
                    plan_key = (*plan_key, req.deadline_ts, req.duration_s)
                if req.not_before_ts is not None and req.not_before_ts > self.snap.now.timestamp():
                    plan_key = (*plan_key, req.not_before_ts)  # paused: fewer starts than its shape's (none before)
                if plan_key in self.unplanned:
                    return failure
            outcome = timeshift.plan(req, self.snap, placement, shift, self.pipeline.filter_codes)
            if isinstance(outcome, Deferral) and shift.book_overruns and self.snap.plan_overrun.size:
                outcome = timeshift.unless_it_slips(req, self.snap, placement, outcome, shift,
                                                    self.pipeline.filter_codes)
            if outcome is not None:
                return outcome
            if plan_key is not None:
                self.unplanned.add(plan_key)
        elif failure is None and shift.keep_promises:  # it starts now, around the plan's promises where it can
            return timeshift.start_now(req, self.snap, placement, shift, self.pipeline.filter_codes)
        return failure if failure is not None else placement

    def assume(self, placement: Placement) -> None:
        self.snap.assume(placement.site, placement.request, placement.model)

    def credit(self, booking: timeshift.Booking) -> None:
        """Give a deferred job's planned hours back to the pass's plan before it is decided again."""
        timeshift.credit(self.snap, booking)
        self.unplanned.clear()

    def reserve(self, deferral: Deferral) -> None:
        """Debit a deferred job's planned hours from the pass's plan, so later jobs plan around it."""
        timeshift.debit(self.snap, deferral.site, deferral.model, deferral.request.charge,
                        deferral.slot, deferral.slot + deferral.slots, deferral.request.latency_slo_ms is not None)


def _replan(planned: _Planned, snap: Snapshot, deciders: Mapping[int, PassDecider]) -> None:
    """A job deferred in an earlier hour comes up again in a pass: its planned hours go back to the pass's plan,
    where later jobs may plan on them."""
    site = snap.index.get(planned.site)
    if site is not None:
        timeshift.credit(snap, timeshift.Booking(site, planned.model, planned.gpus, planned.first, planned.end,
                                                 planned.near))
        for other in deciders.values():
            other.unplanned.clear()


def _group_fails(req: JobRequest, pipeline: Pipeline, holds: Mapping[str, _Hold]) -> bool:
    """Whether the rest of the queue group of a job that found no site in a full pass finds none either: it asks
    for the same, with no fewer sites (no site refused this job), cannot be deferred, and no hold is given back
    to a job later in the pass."""
    return (not req.excluded_sites and not holds
            and (pipeline.shift is None or req.deadline_ts is None or not req.deferrable))


PREVIEW_AHEAD_MAX = 2000
"""Queued jobs a preview decides ahead of the job it previews, at most; past them it decides the job on what they
left (``SchedulingCycle.preview``), and says so."""
PREVIEW_WALK_MAX = 20_000
"""Queued jobs a preview walks past ahead of its job, at most, decided or not (jobs deferred this hour are passed
over, not decided: without this bound a queue of many of them would be walked whole, about 10 µs a job, while the
preview holds the event loop); past them it stops as at ``PREVIEW_AHEAD_MAX``."""


@dataclass(frozen=True, slots=True)
class Ahead:
    """What a preview decided before its job (``SchedulingCycle.previews``): how many queued jobs, of which how many
    took room now (placed) or hours of the plan (deferred), whether ``PREVIEW_AHEAD_MAX`` cut it short, and how
    many of the specs previewed with it (``listed``)."""

    decided: int = 0
    placed: int = 0
    deferred: int = 0
    capped: bool = False
    listed: int = 0


LATENCY_DEMAND_STATE = "latency-demand"  # the store's name for what latency-bound jobs held (put_state)
CARBON_LEDGER_STATE = "carbon-ledger"  # ... and for the carbon ledger (GET /v1/carbon): totals, attempts open
MOVES_STATE = "moves-in-flight"  # ... and for the moves asked for, the GPUs held for them, the sites that could not stop
LEDGER_SAVE_S = 10.0  # at most this often the ledger is saved (a crash loses at most that many seconds of it)
LEDGER_SEEN_S = 60.0  # ... and at least this often while it holds attempts open (keep_ledger's ``seen``)
STATE_READ_TRIES = 5  # reads of what the last broker in charge kept, before taking charge fails (about 1.5 s)
YIELD_EVERY = 256  # decisions between trips round the event loop in a long pass
SWEEP_MIN = 4096  # cache entries below which ended jobs' entries are not swept
UNPLACEABLE_REFRESH_S = 60.0
"""A waiting job's decision is recorded again when which filters turned which sites away changes, and at least
this often while it waits (the figures its reasons quote, "8 free", move without changing which filters fail): one
job of each queue group, the first a pass decides, so a group decided job by job costs a write a minute, not one a job."""


def _plan_moves(
    trial: Snapshot,
    stuck: list[tuple[Job, JobRequest, Pipeline]],
    running: dict[int, list[Running]],
    pipelines: dict[int, Pipeline],
    saving: bool,
) -> tuple[list[tuple[Move, Pipeline]], list[tuple[Job, str, int, JobRequest]]]:
    """Step 3b's decisions (``policies.migration``), on ``trial`` (a working copy of the pass's snapshot,
    debited as moves are made): room made for each stuck job near its users, from the running jobs of its
    own profile (``running``, by pipeline), then, with ``saving``, each profile's moves that save. Returns
    the moves (with the moved job's pipeline) and, for each stuck job room was made for, where it now fits
    (job, site, model, request)."""
    moves: list[tuple[Move, Pipeline]] = []
    held: list[tuple[Job, str, int, JobRequest]] = []
    for job, req, pipeline in stuck:
        assert pipeline.migrate is not None
        made = make_room(pipeline, trial, req, running[id(pipeline)], pipeline.migrate)
        if not made:
            continue
        placement = pipeline.decide(req, trial)  # it fits now: its room is held until it is placed there
        if placement.placed:
            trial.assume(placement.site, req, placement.model)
            held.append((job, trial.sites[placement.site], placement.model, req))
        moves += [(m, pipeline) for m in made]
        moved = {m.running.request.job_id for m in made}
        for key in running:
            running[key] = [r for r in running[key] if r.request.job_id not in moved]
    if saving:
        for key, pipeline in pipelines.items():
            assert pipeline.migrate is not None
            moves += [(m, pipeline) for m in plan_moves(pipeline, trial, running[key], pipeline.migrate)]
    return moves, held


class _KeptMove(BaseModel):
    """A move in flight as the store keeps it (``MOVES_STATE``): a :class:`_Moving` with its target's GPU model
    by id (None: the job goes back to the queue)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    origin: str
    attempt: int = Field(ge=0)
    site: str | None
    model: GpuModelId | None
    reason: str
    for_job: str | None
    asked_ts: float


class _KeptHold(BaseModel):
    """A hold as the store keeps it: a :class:`_Hold` whose request is the job's own with ``duration_s``."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    site: str
    model: GpuModelId
    duration_s: float = Field(gt=0)
    attempt: int = Field(ge=0)
    until_ts: float


_KEPT_UNTIL: TypeAdapter[float] = TypeAdapter(float, config=ConfigDict(strict=True, allow_inf_nan=False))
# A paused job as the store keeps it: [the attempt stopped, POSIX seconds it may restart from]
_KEPT_PAUSE: TypeAdapter[tuple[int, float]] = TypeAdapter(tuple[int, float], config=ConfigDict(allow_inf_nan=False))


class SchedulingCycle:
    def __init__(
        self,
        clock: Clock,
        federation: Federation,
        book: JobBook,
        store: Store,
        lifecycle: Lifecycle,
        pipeline: Pipeline | None = None,
        dispatch_timeout_s: float = 30.0,
        full_pass_interval_s: float = 1.0,
        profiles: Mapping[str, Pipeline] | None = None,
        tenant_limits: TenantLimits | None = None,
    ) -> None:
        """``pipeline`` places jobs that name no profile; ``profiles`` holds the pipelines of the profiles
        jobs may name (a job naming another one, after a configuration change, gets ``pipeline``);
        ``tenant_limits``: the GPUs each tenant may hold across the federation (``broker.tenant_limits``)."""
        self.lifecycle = lifecycle
        self.clock = clock
        self.federation = federation
        self.book = book
        self.store = store
        self.pipeline = pipeline or default_pipeline()
        self.profiles: dict[str, Pipeline] = dict(profiles or {})
        self.filters = {f.code: f for p in (self.pipeline, *self.profiles.values()) for f in p.filters}
        self.dispatch_timeout_s = dispatch_timeout_s
        self.tenant_limits = tenant_limits if tenant_limits else None
        self._limits_changed = False  # set_tenant_limits since the last full pass began: the next is full
        self._dispatches: set[asyncio.Task[None]] = set()
        # site -> its dispatches under way, until each is confirmed or undone (dispatches_to)
        self._submits: dict[str, set[asyncio.Task[None]]] = {}
        self._sending: set[tuple[str, int]] = set()  # (job id, attempt) of the dispatches under way
        self.may_act: Callable[[], bool] = lambda: True  # among replicas: whether this one surely still leads
        self.metrics = Metrics()  # the broker passes its own
        self.events: EventHub | None = None  # live events (broker.events); the broker passes its own
        self.carbon = CarbonLedger()  # carbon of placements against a carbon-agnostic choice
        self._carbon_saved = 0  # the ledger's revision the store holds
        self._carbon_saved_at = -math.inf  # when it was saved (time.monotonic)
        book.on_attempt_end = self._attempt_ended  # every attempt's end, for the ledger
        lifecycle.admitted_by_report = self._admitted_by_report  # admissions a site's report showed, likewise
        self._site_health: dict[str, str] = {}  # site -> health last published
        self._quiet: tuple[Any, ...] | None = None  # the key of the last full pass that placed nothing
        self._last_seen: dict[str, bytes] = {}  # job id -> what its last recorded decision looked like
        self._signatures: dict[bytes, bytes] = {}  # one copy of each signature in _last_seen (2 bytes a site)
        # (minute, the queue groups one of whose waiting jobs was recorded again in it: UNPLACEABLE_REFRESH_S)
        self._refreshed: tuple[int, set[tuple[Any, ...]]] = (0, set())
        self._sweep_at = SWEEP_MIN  # cache entries at which _forget_gone next runs
        self._in_flight: dict[str, InFlight] = {}
        self._requests: dict[str, JobRequest] = {}
        self.full_pass_interval_s = full_pass_interval_s
        self._last_full: datetime | None = None
        self._asked_at = 0  # book.seq when the sites were last asked for reports
        # Time-shifting: the hours the plan covers (0: no pipeline defers) and the jobs deferred, with
        # the hours their planned start holds; a deferred job is decided again each whole hour.
        shifts = [p.shift for p in (self.pipeline, *self.profiles.values()) if p.shift is not None]
        self._plan_hours = max((s.plan_hours for s in shifts), default=0)
        self._book_overruns = any(s.book_overruns for s in shifts)
        self._deferred: dict[str, _Planned] = {}
        # What latency-bound jobs held, hour by hour, for profiles that keep room for them (policies.latency_reserve).
        self._near = LatencyDemand() if any(s.latency_reserve is not None for s in shifts) else None
        self._near_saved: int | None = None  # the hour of the latest sample the store holds
        # Moving running work (profiles with ``migrate``): the jobs asked to stop, by job id, and the hour of
        # the last pass that looked for moves that save.
        self._migrating = any(p.migrate is not None for p in (self.pipeline, *self.profiles.values()))
        self._moving: dict[str, _Moving] = {}
        # Jobs paused through dirty hours (MigrationPolicy.pause): job -> (the attempt stopped, POSIX seconds it
        # may restart from), read as the queued job's ``not_before_ts``; forgotten once it restarts or ends
        self._paused_until: dict[str, tuple[int, float]] = {}
        self._holds: dict[str, _Hold] = {}  # job id -> GPUs kept for it until it is placed
        self._released: set[str] = set()  # jobs whose hold this pass gave back to them
        self._cannot_stop: dict[str, float] = {}  # site -> until when no job is moved away from it
        self._moves_h: int | None = None
        self._moves_saved: str | None = None  # the moves document the store holds (MOVES_STATE)
        self._moves_kept: dict[str, Any] | None = None  # one the last leader left, taken up at the next pass
        # The stops the last leader asked for, by (job id, attempt, site): (when, POSIX s; why). Kept after the
        # take-up, for a site that only answers later (stop_asked).
        self._stops_kept: dict[tuple[str, int, str], tuple[float, str]] = {}
        # Attempts that ended otherwise than stopped before those moves were taken up (move_over): theirs are over.
        self._over_before_take_up: set[tuple[str, int]] = set()
        self._stuck: list[tuple[Job, JobRequest, Pipeline]] = []  # this pass's urgent jobs that found no room
        if self._plan_hours:  # some profile defers jobs: the queue goes in urgency order
            book.active.queue.reorder(_by_urgency, book.active.get)
        # The groups the last full pass found no site for (``broker.queue``): their jobs it did not decide
        # are explained by the decision it failed at (``skipped_decision``).
        self._group_failures: dict[tuple[Any, ...], _GroupFailure] = {}

    def set_tenant_limits(self, limits: TenantLimits) -> None:
        """The federation-wide tenant limits changed live (``PUT /v1/tenants/{tenant}/limit``): every pass from the
        next on counts against ``limits``, and the next is a full one that decides the whole queue again, so jobs
        a raised limit makes room for start at once (a lowered one stops nothing: what runs runs on, and the
        tenant's new jobs wait until what it holds is below the limit)."""
        self.tenant_limits = limits if limits else None
        self._limits_changed = True

    def full_pass_due(self, now: datetime) -> bool:
        """A full pass asks the sites again and re-decides the whole queue. It is due when capacity may
        have grown (a job left a site, sites changed, a refusal expired, a tenant's limit changed) or
        ``full_pass_interval_s`` has passed; otherwise only new jobs are decided, since jobs that did not fit
        before still cannot."""
        return (
            self._last_full is None
            or self._limits_changed
            or self.book.capacity_freed
            or self.federation.membership_changed
            or self.book.refusal_expired(now)
            or (now - self._last_full).total_seconds() >= self.full_pass_interval_s
        )

    async def run_once(self, full: bool | None = None) -> CycleReport:
        now = self.clock.now()
        if full is None:
            full = self.full_pass_due(now)
        # 1. collect (full passes; between them the last reports stand and step 2 debits what was placed since)
        quiet_key = None
        if full:
            # Only the interval brought this pass: if the sites report what they reported at the last full
            # pass, which placed nothing, in the same hour, and no job changed since, every queued job would be
            # refused again; only the new ones are decided. So an idle, full federation costs a collect, not a
            # walk over a queue of jobs that cannot run.
            interval_only = not (self.book.capacity_freed or self.federation.membership_changed
                                 or self.book.refusal_expired(now) or self._limits_changed)
            self._last_full = now
            self._limits_changed = False
            self.book.capacity_freed = False
            self.federation.membership_changed = False
            self._asked_at = self.book.seq
            await self.federation.collect()
            self._announce_sites(now)
            quiet_key = self._quiet_key(now) if interval_only else None
            if quiet_key is not None and quiet_key == self._quiet:
                jobs = self.book.take_fresh()
            else:
                self.book.fresh.clear()
                jobs = None  # the whole queue, walked group by group
                if len(self._last_seen) + len(self._requests) + len(self._signatures) >= self._sweep_at:
                    self._forget_gone()  # (signatures too: a job decided again keeps a new one each time)
        else:
            jobs = self.book.take_fresh()
        moves_due = full and self._migrating and self._moves_h != timeshift.epoch_hour(now)
        if not (self.book.active.queue if jobs is None else jobs) and not moves_due:
            # nothing to decide: no snapshot, no plan (building the plan walks every job on a site)
            if full:
                self._quiet = quiet_key if quiet_key is not None and self.book.seq == quiet_key[1] else None
                if self._near is not None and self._near.hour != timeshift.epoch_hour(now):
                    # once an hour all the same: what latency-bound jobs hold is learned from every hour
                    self._with_plan(self.federation.freeze(now))
                    await self._keep_learned()
                if self._keeps_moves:  # a stop that failed in the background since the last pass
                    await self.keep_moves()
            await self._keep_ledger_due()  # placements admitted since the pass that made them
            return CycleReport(full=full, decided=0, placed=0, unplaceable=0)
        # 2. snapshot
        snap = self.federation.freeze(self.clock.now())
        self._debit_in_flight(snap, self._asked_at)
        snap = self._count_tenants(snap)
        if self._plan_hours:
            snap = self._with_plan(snap)
            await self._keep_learned()
        self._released = set()
        if self._moves_kept is not None:
            self._take_up_moves(snap.now.timestamp())
        if self._holds or self._moving:
            self._debit_holds(snap)  # after the plan, so its hours are held too
        # 3. decide, and assume each placement in memory at once (its store write is queued at once too)
        # (placed job, its store write, what the carbon ledger counts once its site admits it)
        assumed: list[tuple[Job, Awaitable[None], Counted | None]] = []
        records: list[tuple[Job, dict[str, Any]]] = []
        decided = 0
        self._stuck = []
        try:
            decided = await self._decide(jobs, snap, assumed, records)
            if self._migrating and full:
                await self._move_running(snap, moves_due)
        finally:
            self.federation.remember_pass(snap)
            # Steps 4 and 5 run for every placement made, even if deciding failed part-way.
            await self._finish(assumed, records)
            await self._keep_ledger_due()
            if self._keeps_moves:
                await self.keep_moves()
        if full:
            self._quiet = quiet_key if quiet_key is not None and not assumed and self.book.seq == quiet_key[1] else None
        return CycleReport(full=full, decided=decided, placed=len(assumed), unplaceable=decided - len(assumed))

    def _quiet_key(self, now: datetime) -> tuple[Any, ...]:
        """What a full pass's outcome depends on besides the queue: the hour (forecasts, deferrals), the job
        book's count of changes and of refusals made or expired (the sites a job may use), and every site's
        report without its clock and telemetry (no filter reads telemetry: it only ranks sites that can take
        a job)."""
        reports = tuple(
            (name, None if m.state is None else m.state.model_copy(
                update={"last_heard_at": None, "lease_expires_at": None, "telemetry": None}))
            for name, m in sorted(self.federation.members.items()))
        return (timeshift.epoch_hour(now), self.book.seq, self.book.refusals_changed,
                tuple(sorted(self.federation.leaving)), reports)

    def _order(self, jobs: list[Job] | None, snap: Snapshot, extra: Sequence[Job] = ()) -> QueueWalk | _Listed:
        """The pass's order over ``jobs`` (None: the whole queue): priority, then, where sites divide by
        fair share, the tenant furthest below its share (``policies.fair_order``), then urgency when some
        profile defers jobs (as the simulator replays it), then age. ``extra``: jobs not queued (a preview's),
        which the walk over the queue yields at the turns they would have were they queued, in that order."""
        standing = None
        if snap.quota is not None and any(s.entitled > 0 for s in snap.quota.standing.values()):
            standing = snap.quota.standing
        if jobs is None:
            queue = self.book.active.queue
            return queue.walk(standing, [queue.place_of(job) for job in extra])
        within: Callable[[Job], Any] = _by_urgency if self._plan_hours else (lambda j: j.created_at)
        jobs = sorted(jobs, key=lambda j: (-j.spec.priority, within(j)))
        fair = None
        if standing is not None:
            fair = FairOrder(jobs, lambda j: j.spec.tenant, lambda j: j.spec.priority, within, standing)
        return _Listed(jobs, fair)

    async def _decide(
        self,
        jobs: list[Job] | None,
        snap: Snapshot,
        assumed: list[tuple[Job, Awaitable[None], Counted | None]],
        records: list[tuple[Job, dict[str, Any]]],
    ) -> int:
        """Step 3: decide each job of ``jobs`` (None: the queue) in order; append placements (assumed in
        memory, writes queued) and the decisions worth recording. Returns how many jobs were decided."""
        deciders: dict[int, PassDecider] = {}  # one per pipeline in use, all on the same snapshot
        decided = 0
        hour = timeshift.epoch_hour(snap.now)
        order = self._order(jobs, snap)
        queue = self.book.active.queue
        metrics = self.metrics
        metrics.passes.labels("full" if jobs is None else "new").inc()
        if jobs is None:
            self._group_failures = {}
        for n, job_id in enumerate(order):
            if n and n % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the API breathe during a long pass
            job = self.book.active.get(job_id)
            if job is None or job.state != JobState.QUEUED:
                continue  # cancelled or changed while the pass yielded
            planned = self._deferred.get(job.id)
            if planned is not None:
                if planned.decided_h == hour:
                    continue  # deferred this hour; decided again when the forecast moves on
                del self._deferred[job.id]
                _replan(planned, snap, deciders)  # its hours are free to plan anew
            decided += 1
            req, pipeline = self._queued_request(job)
            started = time.perf_counter()
            decider, placement, moving = self._decide_queued(job, req, pipeline, snap, deciders, self._holds,
                                                             self._moving, self._released)
            metrics.decision_seconds.observe(time.perf_counter() - started)
            if isinstance(placement, Deferral):
                metrics.deferred.inc()
                decider.reserve(placement)
                first = hour + placement.slot
                planned_at = self.federation.get(snap.sites[placement.site])
                self._deferred[job.id] = _Planned(snap.sites[placement.site], placement.model,
                                                  req.charge, first, first + placement.slots, hour,
                                                  req.latency_slo_ms is not None,
                                                  planned_at.spec if planned_at is not None else None)
                # Recorded again where the plan, the start now it is weighed against (or none), the sites'
                # verdicts or the words of its reason (the forecasts it quotes, to their three figures: a start
                # now an hour later is another run) changed, so the explanation never quotes a start now the
                # broker no longer weighs (a site since cordoned, full or unhealthy), nor figures of an earlier
                # hour's plan. The verdicts and the words by a digest: kept per deferred job.
                now_site = snap.sites[placement.now_site] if placement.now_site >= 0 else "-"
                digest = hashlib.blake2b(placement.placement.failures.tobytes(), digest_size=8)
                digest.update(placement.reason(snap.sites).encode())
                signature = (f"deferred {snap.sites[placement.site]} {placement.model} {first} {now_site} "
                             f"{digest.hexdigest()}").encode()
                if self._last_seen.get(job.id) != signature:
                    self._last_seen[job.id] = self._signatures.setdefault(signature, signature)
                    rec = explain.record_deferral(pipeline, placement, snap)
                    records.append((job, self._with_refusals(req, rec)))
                    self._announce_decision(job, "deferral", "deferred", rec["deferred"]["site"], None,
                                            rec["deferred"]["reason"], snap.now, rec["deferred"]["start"])
                continue
            if isinstance(placement, _Failure):
                metrics.unplaceable.inc()
                if pipeline.migrate is not None and pipeline.migrate.make_room and urgent(
                        req, snap.now.timestamp(), pipeline.migrate):
                    self._stuck.append((job, req, pipeline))
                # record only decisions that changed, or whose figures may have (a minute on: once a minute
                # for each queue group, its first job decided, so a group decided job by job, which no failure
                # drops, is not written job by job every minute)
                minute = int(snap.now.timestamp() // UNPLACEABLE_REFRESH_S)
                signature = placement.signature + minute.to_bytes(8, "little", signed=True)
                seen = self._last_seen.get(job.id)
                if seen is not None and seen != signature and seen[:-8] == placement.signature:
                    where = queue.position(job.id)
                    if self._refreshed[0] != minute:
                        self._refreshed = (minute, set())
                    if where is not None and where[0] in self._refreshed[1]:
                        seen = signature  # another job of its group was recorded again this minute
                    elif where is not None:
                        self._refreshed[1].add(where[0])
                if seen != signature:
                    self._last_seen[job.id] = self._signatures.setdefault(signature, signature)
                    records.append((job, self._with_refusals(req, placement.record(pipeline, snap))))
                    if seen is None or seen[:-8] != placement.signature:  # (announced once per change, not a minute)
                        self._announce_decision(job, "decision", "unplaceable", None, None,
                                                "no site can run it now; it waits in the queue", snap.now)
                if jobs is None and _group_fails(req, pipeline, self._holds):
                    order.fail_group()
                    metrics.groups_skipped.inc()
                    where = queue.position(job.id)
                    if where is not None:
                        self._group_failures[where[0]] = _GroupFailure(where[1], placement.record(pipeline, snap),
                                                                       snap.now.timestamp())
                continue
            site = snap.sites[placement.site]
            if site in self.federation.leaving:
                continue  # being removed or rebuilt: the next pass decides without it
            metrics.placed.inc()
            rec = self._with_refusals(req, explain.record(pipeline, placement, snap))
            if moving is not None and moving.site is not None:  # the summary: why it restarts here, or not
                rec["moved"] = (moving.reason if site == moving.site else
                                f"moved away from {moving.origin} ({moving.reason}); {moving.site}, where the move "
                                f"would have restarted it, no longer had room for it, so it is placed as any other job")
            counted = assess(placement, snap)  # (counted in the ledger when the site admits it: _dispatch)
            self._announce_decision(job, "decision", "placed", site, rec["model"],
                                    f"placed on {site} ({rec['model']})", snap.now)
            decider.assume(placement)
            usd = float(snap.usd_per_gpu_hour[placement.site, placement.model])  # (the price the usage charges)
            new, version = self.book.apply(
                job.id, JobState.DISPATCHING, site=site, attempt=job.attempt + 1, gpu_model=rec["model"],
                usd_per_gpu_hour=usd if math.isfinite(usd) else None, reason=f"placed on {site}; dispatching",
            )
            landing = self.book.write_soon(job, new, version, event_reason=f"placed on {site} ({rec['model']})",
                                           decision=rec)
            self._in_flight[job.id] = InFlight(site, new.attempt, req, placement.model)
            self._last_seen.pop(job.id, None)
            assumed.append((new, landing, counted))
            order.placed(job.spec.tenant, req.charge)
        return decided

    def _announce_decision(self, job: Job, kind: str, outcome: str, site: str | None, model: str | None,
                           summary: str, now: datetime, deferred_until: str | None = None) -> None:
        if self.events is None:
            return
        data = {"job_id": job.id, "tenant": job.spec.tenant, "attempt": job.attempt + (outcome == "placed"),
                "outcome": outcome, "site": site, "model": model, "summary": summary, "at": now.isoformat()}
        if kind == "deferral":
            data["deferred_until"] = deferred_until
        self.events.publish(kind, data, tenant=job.spec.tenant, site=site, job_id=job.id)

    def _announce_sites(self, now: datetime) -> None:
        """Publish each site whose health (as routing sees it: a silent site is unhealthy, a cordoned one
        ``cordoned``) changed, joined or left since the last full pass."""
        if self.events is None:
            return
        seen: dict[str, str] = {}
        for name, member in self.federation.members.items():
            state = self.federation.fresh_state(member, now) or member.public_state()
            health, reason = state.health.value, state.reason
            if member.spec.cordoned and health == "healthy":  # up, but its operator took it out of routing
                health, reason = "cordoned", member.spec.cordon_reason or "cordoned by its operator"
            seen[name] = health
            previous = self._site_health.get(name)
            if previous != health:
                self.events.publish("site", {"site": name, "health": health, "previous": previous,
                                             "reason": reason, "at": now.isoformat()}, site=name)
        for name in self._site_health.keys() - seen.keys():
            self.events.publish("site", {"site": name, "health": "removed", "previous": self._site_health[name],
                                         "reason": "removed from the federation", "at": now.isoformat()}, site=name)
        self._site_health = seen

    def skipped_decision(self, job_id: str) -> dict[str, Any] | None:
        """The record explaining a queued job the last full pass did not decide, because an earlier job of
        its group (same request shape, tenant, priority and profile) found no site; None otherwise."""
        where = self.book.active.queue.position(job_id)
        if where is None:
            return None
        failure = self._group_failures.get(where[0])
        if failure is None or where[1] <= failure.entry or where[1][-2] > failure.at_ts:
            return None  # decided itself, or submitted after that pass (entries end with creation time, id)
        refusals = self.book.refusal_reasons(job_id)
        if refusals:  # the failure was another job's, which no site had refused
            return {**failure.record, "excluded": sorted(refusals), "refusals": refusals}
        return failure.record

    async def _finish(
        self, assumed: list[tuple[Job, Awaitable[None], Counted | None]], records: list[tuple[Job, dict[str, Any]]]
    ) -> None:
        """Steps 4 and 5: wait for the placements' writes and the decisions' writes; dispatch what landed."""
        # 4. assume in the store: every placement and changed decision, in one group commit
        results = await asyncio.gather(
            *(self._persist(new, landing) for new, landing, _ in assumed),
            *(self.store.save_decision(job.id, job.attempt, rec) for job, rec in records),
            return_exceptions=True,
        )
        # 5. dispatch what is safely on disk
        for (new, _, counted), ok in zip(assumed, results):
            if ok is True:
                task = asyncio.get_running_loop().create_task(self._dispatch(new, counted),
                                                              name=f"dispatch-{new.id}")
                self._dispatches.add(task)
                task.add_done_callback(self._dispatches.discard)
        for result in results[len(assumed):]:
            if isinstance(result, BaseException):
                log.error("could not record a decision: %s", result)

    # --- moving running work (policies.migration) ---

    def _moved_to(self, moving: _Moving, pipeline: Pipeline, req: JobRequest, snap: Snapshot,
                  holds: Mapping[str, _Hold]) -> Placement | None:
        """The restart of a moved job at the site its move chose (its hold there already given back to the
        pass), when that still passes every filter and has room now and in the plan for the rest of its run;
        None: decide it as any other job."""
        site = snap.index.get(moving.site) if moving.site is not None else None
        hold = holds.get(req.job_id)
        if site is None or hold is None:
            return None
        placement = pipeline.decide(req, snap)  # every site's terms, for the explanation
        if site not in placement.feasible or not migration.fits_rest(snap, site, hold.model, hold.request,
                                                                     pipeline.shift):
            return None
        return replace(placement, site=site, model=hold.model)

    def _debit_holds(self, snap: Snapshot, holds: dict[str, _Hold] | None = None,
                     moving: dict[str, _Moving] | None = None) -> None:
        """Debit the GPUs kept for moved jobs at their targets and for jobs room was made for, as placements
        in flight are (and, under federation-wide tenant limits, the room they take under their tenant's); forget
        holds whose job was placed again, has gone, or waited too long. ``holds``,
        ``moving``: a preview's copies, forgotten from instead of the broker's own."""
        now_ts = snap.now.timestamp()
        own = holds is None
        holds = self._holds if holds is None else holds
        moving = self._moving if moving is None else moving
        for job_id, hold in list(holds.items()):
            job = self.book.active.get(job_id)
            if job is None or job.attempt != hold.attempt or now_ts > hold.until_ts:
                del holds[job_id]
                continue
            site = snap.index.get(hold.site)
            if site is not None:
                snap.hold(site, hold.request, hold.model)
                if snap.tenant_room is not None and job.state == JobState.QUEUED:  # its tenant's room too (one
                    # not back in the queue yet is counted held: _count_tenants); _take_hold gives both back
                    snap.tenant_room.debit(hold.request.tenant, hold.request.charge)
        for job_id, move in list(moving.items()):  # moves whose event or restart never came
            if now_ts > move.asked_ts + MOVE_TIMEOUT_S:
                del moving[job_id]
        for site in [s for s, until in self._cannot_stop.items() if until <= now_ts] if own else ():
            del self._cannot_stop[site]

    @staticmethod
    def _take_hold(job: Job, snap: Snapshot, deciders: dict[int, PassDecider], holds: Mapping[str, _Hold],
                   released: set[str]) -> None:
        """Before ``job`` is decided: give the pass back what is held for it, so it may take it."""
        hold = holds.get(job.id)
        site = snap.index.get(hold.site) if hold is not None else None
        if hold is None or site is None or job.id in released:
            return
        snap.release(site, hold.request, hold.model)
        if snap.tenant_room is not None:  # (held for it by _debit_holds, or counted while it was not queued)
            snap.tenant_room.credit(hold.request.tenant, hold.request.charge)
        released.add(job.id)
        for decider in deciders.values():  # capacity grew: failures met earlier in the pass may not hold
            decider.failed.clear()
            decider.unplanned.clear()

    @staticmethod
    def _hold_again(job_id: str, snap: Snapshot, holds: Mapping[str, _Hold], released: set[str]) -> None:
        hold = holds.get(job_id)
        site = snap.index.get(hold.site) if hold is not None else None
        if hold is not None and site is not None:
            snap.hold(site, hold.request, hold.model)
            if snap.tenant_room is not None:
                snap.tenant_room.debit(hold.request.tenant, hold.request.charge)
        released.discard(job_id)

    async def _move_running(self, snap: Snapshot, saving: bool) -> None:
        """Step 3b, at full passes of a broker with ``migrate`` profiles: room made for this pass's urgent
        jobs near their users that found none, and, once an hour (``saving``), moves that save. Planned on a
        working copy of the pass's snapshot (what it says of the sites stays what they reported); each move
        asks the job's site to checkpoint and stop it, and holds its target (and the room made) until the
        jobs are placed there."""
        if saving:
            self._moves_h = timeshift.epoch_hour(snap.now)
            for job_id, (attempt, until_ts) in list(self._paused_until.items()):  # pauses over, or of jobs gone
                job = self.book.active.get(job_id)
                if until_ts <= snap.now.timestamp() or job is None or job.attempt != attempt:
                    del self._paused_until[job_id]
        waiting = {m.for_job for m in self._moving.values() if m.for_job is not None}
        stuck = [(job, req, pipeline) for job, req, pipeline in self._stuck  # the most urgent first
                 if job.id not in waiting and job.id not in self._holds]  # else room is being made already
        if not saving and not stuck:
            return
        trial = snap.working_copy(snap.now)
        pipelines = {id(p): p for p in (self.pipeline, *self.profiles.values()) if p.migrate is not None}
        offered = {key: self._running(trial, pipeline) for key, pipeline in pipelines.items()}
        jobs = {r.request.job_id: job for runs in offered.values() for r, job in runs}
        running = {key: [r for r, _ in runs] for key, runs in offered.items()}
        # Pure work on the pass's own copy, in a worker thread so the API stays responsive (a second or two
        # with ten thousand running jobs: bench/moves.py).
        moves, held = await asyncio.to_thread(_plan_moves, trial, stuck, running, pipelines, saving)
        not_asked: set[str] = set()  # jobs near their users one of whose moves was not asked for
        for move, pipeline in moves:
            job = jobs[move.running.request.job_id]
            now = self.book.active.get(job.id)
            if not (now is not None and now.state == JobState.RUNNING  # still running where the move found it
                    and (now.site, now.attempt) == (job.site, job.attempt)
                    and self._ask_to_move(move, job, pipeline, snap)) and move.for_job is not None:
                not_asked.add(move.for_job)
        until_ts = snap.now.timestamp() + MOVE_TIMEOUT_S
        for job, site, model, req in held:  # the room made is held only where every move making it was asked
            if job.id not in not_asked:
                self._holds[job.id] = _Hold(site, model, req, job.attempt, until_ts)

    @property
    def _keeps_moves(self) -> bool:
        """Whether passes save the moves in flight: where a profile moves running work, or where the last broker
        in charge left moves (taken up by this one, whose own profiles may move none: a configuration changed
        across a restart), so the store does not keep offering them to the next one once they are over."""
        return self._migrating or self._moves_saved is not None

    def restart_overhead_s(self, job: Job) -> float:
        """Seconds an attempt of ``job`` resumed from a checkpoint spends restarting before it adds work: its
        profile's move overhead (``MigrationPolicy.overhead_s``), 0 for a profile that moves nothing."""
        mine = self.profiles.get(job.spec.profile, self.pipeline) if job.spec.profile else self.pipeline
        return mine.migrate.overhead_s if mine.migrate is not None else 0.0

    def _running(self, snap: Snapshot, pipeline: Pipeline) -> list[tuple[Running, Job]]:
        """The running jobs of ``pipeline``'s profile a move may take, as ``policies.migration`` reads them:
        checkpointable, on a site that can stop a job on request (and has not lately failed to), not
        already moving. Work done: :func:`work_done`, with the profile's restart overhead."""
        assert pipeline.migrate is not None
        overhead = pipeline.migrate.overhead_s
        now = snap.now
        now_ts = now.timestamp()
        out = []
        for job in self.book.active.unqueued():
            if job.state != JobState.RUNNING or not job.spec.checkpointable or job.id in self._moving:
                continue
            mine = self.profiles.get(job.spec.profile, self.pipeline) if job.spec.profile else self.pipeline
            member = self.federation.members.get(job.site) if job.site is not None else None
            site = snap.index.get(job.site) if job.site is not None else None
            if (mine is not pipeline or member is None or site is None or job.gpu_model not in MODEL_INDEX
                    or self._cannot_stop.get(member.spec.name, 0.0) > now_ts
                    or not isinstance(member.adapter, Preempter)):
                continue
            req = JobRequest.from_spec(job.id, job.spec, self.book.refused_sites(job.id), job.created_at)
            out.append((Running(req, site, MODEL_INDEX[job.gpu_model], work_done(job, now, overhead)), job))
        return out

    def _ask_to_move(self, move: Move, job: Job, pipeline: Pipeline, snap: Snapshot) -> bool:
        """Remember the move and hold its target, keep the job off the site it leaves for a while (it was
        moved for a reason), then ask that site, in the background as a dispatch, to checkpoint and stop
        it. A site that cannot is logged, left out of moves for an hour, and the job runs on where it is."""
        reason = move.reason(snap.sites)
        origin = job.site or ""
        member = self.federation.members.get(origin)
        now_ts = snap.now.timestamp()
        if member is None or not self.may_act() or self._cannot_stop.get(origin, 0.0) > now_ts:
            return False
        target = snap.sites[move.site] if move.site >= 0 else None
        self._moving[job.id] = _Moving(origin, job.attempt, target, move.model, reason, move.for_job, now_ts)
        if target is None and move.for_job is None and move.not_before_ts is not None:  # paused
            self._paused_until[job.id] = (job.attempt, move.not_before_ts)
        if target is not None:
            assert pipeline.migrate is not None
            self._holds[job.id] = _Hold(target, move.model, migration.rest_of(move.running, move.remaining_s,
                                                                                pipeline.migrate),
                                        job.attempt, now_ts + MOVE_TIMEOUT_S)
        log.info("job %s: %s", job.id, reason)

        async def ask() -> None:
            try:
                await asyncio.wait_for(member.adapter.preempt(job.id, job.attempt, reason),  # type: ignore[attr-defined]
                                       self.dispatch_timeout_s)
            except Exception as e:  # the site could not: the job runs on there
                why = "no answer in time" if isinstance(e, TimeoutError) else str(e) or e.__class__.__name__
                log.warning("job %s: %s could not stop it to move it (%s); it runs on there, and no job is moved "
                            "away from %s for an hour", job.id, origin, why, origin)
                self._cannot_stop[origin] = now_ts + CANNOT_STOP_S
                if self._moving.get(job.id) is not None and self._moving[job.id].attempt == job.attempt:
                    del self._moving[job.id]
                    self._holds.pop(job.id, None)
                    self._paused_until.pop(job.id, None)
                if move.for_job is not None:  # room is not being made: the job near its users may ask again
                    self._holds.pop(move.for_job, None)
                self.book.forgive(job.id, origin)  # it runs on there: nothing keeps it off that site
                return
            why = "room" if move.for_job is not None else "pause" if move.site < 0 else "saving"
            self.metrics.moves.labels(origin, why).inc()
            asked = self._moving.get(job.id)
            if asked is not None and asked.attempt == job.attempt:  # the site has it: kept so (keep_moves)
                self._moving[job.id] = replace(asked, delivered=True)

        # Off the site it leaves until the move's time is up: a job put back in the queue to make room must
        # not take that room, nor a moved one go back where it was moved from. A paused one may: its rest is
        # planned there, later, as often as not.
        if move.site >= 0 or move.for_job is not None:
            self.book.refuse(job.id, origin, f"moved away: {reason}", ttl_s=MOVE_TIMEOUT_S)
        task = asyncio.get_running_loop().create_task(ask(), name=f"move-{job.id}")
        self._dispatches.add(task)
        task.add_done_callback(self._dispatches.discard)
        return True

    def _with_refusals(self, req: JobRequest, rec: dict[str, Any]) -> dict[str, Any]:
        """``rec`` (maybe shared by several jobs) with the reasons the sites it skips gave for refusing this job."""
        if not req.excluded_sites:
            return rec
        return {**rec, "refusals": self.book.refusal_reasons(req.job_id)}

    def _queued_request(self, job: Job) -> tuple[JobRequest, Pipeline]:
        """A queued job's request, as a pass decides it (the rest of its run: :func:`rest_of_run`), and its
        profile's pipeline. Built afresh: a queued job is decided again only when its group's turn comes (no
        cache per queued job, which would cost more memory than the compact job itself)."""
        req = JobRequest.from_spec(job.id, job.spec, self.book.refused_sites(job.id), job.created_at)
        req = rest_of_run(job, req, self.restart_overhead_s(job))
        paused = self._paused_until.get(job.id)  # (one over, or of an attempt gone, is forgotten hourly)
        if paused is not None and paused[0] == job.attempt and paused[1] > self.clock.now().timestamp():
            req = replace(req, not_before_ts=paused[1])
        return req, self.profiles.get(job.spec.profile, self.pipeline) if job.spec.profile else self.pipeline

    def _decide_queued(
        self, job: Job, req: JobRequest, pipeline: Pipeline, snap: Snapshot, deciders: dict[int, PassDecider],
        holds: dict[str, _Hold], moving: dict[str, _Moving], released: set[str],
    ) -> tuple[PassDecider, Placement | _Failure | Deferral, _Moving | None]:
        """Step 3 for one queued job, the part a preview runs too: what is held for it given back to the pass
        (``released``), then its restart where its move chose, else its pipeline's decision (placed, deferred or
        not placed); a job not placed keeps its hold. Changes ``snap``, ``deciders`` and the given ``holds``,
        ``moving`` (its move, taken: returned) and ``released`` only: a pass gives the broker's own, a preview
        copies. Nothing is assumed: the caller takes what it keeps."""
        decider = deciders.get(id(pipeline))
        if decider is None:
            decider = deciders[id(pipeline)] = PassDecider(pipeline, snap)
        move = moving.pop(job.id, None) if moving else None
        if move is not None and move.attempt != job.attempt:
            move = None  # a move of an earlier attempt
        if holds:
            self._take_hold(job, snap, deciders, holds, released)
        placement = self._moved_to(move, pipeline, req, snap, holds) if move is not None else None
        if placement is None:
            if move is not None:
                holds.pop(job.id, None)  # its target had no room left: nothing more to keep there
            placement = decider.decide(req)
        if job.id in released and not isinstance(placement, Placement):
            self._hold_again(job.id, snap, holds, released)  # not placed this pass: what is kept for it stays kept
        return decider, placement, move

    def _on_site_request(self, job: Job) -> JobRequest:
        """The placement request of a job on a site (what the plan books for it), cached while it is there."""
        req = self._requests.get(job.id)
        if req is None:
            req = self._requests[job.id] = JobRequest.from_spec(job.id, job.spec, frozenset(), job.created_at)
        return req

    def replan(self, job_id: str) -> None:
        """A queued job's spec changed: its deferral (and the hours it booked) is dropped, and it is decided and
        recorded again at the next pass."""
        self._deferred.pop(job_id, None)
        self._last_seen.pop(job_id, None)

    def preview(self, job_id: str, spec: JobSpec) -> tuple[JobRequest, dict[str, Any], Ahead]:
        """The decision a job of ``spec`` would get now: :meth:`previews` of it alone."""
        return self.previews([spec], job_id)[0]

    def previews(self, specs: Sequence[JobSpec],
                 job_id: str = "preview") -> list[tuple[JobRequest, dict[str, Any], Ahead]]:
        """The decisions jobs of ``specs`` would get now, submitted together one after another in the list's order,
        each at the place the queue would give it (as Slurm's ``sbatch --test-only``): on the sites' latest
        reports, less what is placed but not reported yet and what is kept for moves, with the time-shift plan of
        the jobs running and deferred, the queued jobs and the specs a pass would decide before each are decided
        first (:meth:`_decide_previewed`), taking their room, and then it is, by its profile. All of it on a
        scratch snapshot and copies: nothing is stored, assumed, planned, observed or announced, and what the
        broker keeps (deferrals, holds, moves, placements in flight) is not even pruned. Returns, in the list's
        order, the request each was decided for (``job_id``), the decision's record (``policies.explain``) and
        what was decided ahead of it."""
        snap = self.federation.freeze(self.clock.now())
        self._debit_in_flight(snap, self._asked_at, forget=False)
        snap = self._count_tenants(snap)
        deferred = dict(self._deferred)
        if self._plan_hours:
            snap = self._with_plan(snap, observe=False, deferred=deferred)
        holds, moving = dict(self._holds), dict(self._moving)
        if holds or moving:
            self._debit_holds(snap, holds, moving)
        # (ids no queued job has, for the walk: each decision is rendered with ``job_id``)
        jobs = [Job(id=f"{job_id} {n}", spec=spec, created_at=snap.now, updated_at=snap.now)
                for n, spec in enumerate(specs)]
        return [(JobRequest.from_spec(job_id, job.spec, frozenset(), snap.now), record, ahead)
                for job, (record, ahead) in zip(jobs, self._decide_previewed(jobs, snap, deferred, holds, moving),
                                                strict=True)]

    def _decide_previewed(
        self, jobs: list[Job], snap: Snapshot, deferred: dict[str, _Planned], holds: dict[str, _Hold],
        moving: dict[str, _Moving],
    ) -> list[tuple[dict[str, Any], Ahead]]:
        """Step 3 of a full pass as far as the last of ``jobs``' turns (jobs not queued: a preview's, as if queued
        in the list's order), on a preview's scratch ``snap`` and copies of the broker's deferrals, holds and moves:
        the queued jobs and ``jobs`` in the pass's order (``_order``), each decided as the pass decides it
        (``_decide_queued``), a placement or deferral taken from ``snap``, a queue group that found no site dropped.
        Nothing else is written, booked or announced. Each of ``jobs`` is decided by a decider of its own (one the
        jobs before it used would answer a failure of theirs, figures of then), and comes back as its decision's record
        (``policies.explain``), made at once, on the sites as they were at its turn (not as the jobs decided after it
        left them), with what was decided before it: the queued jobs, and ``listed``, those of ``jobs``. At most
        ``PREVIEW_AHEAD_MAX`` queued jobs are decided, and ``PREVIEW_WALK_MAX`` walked past, decided or not (``capped``
        past either; the rest of ``jobs`` are then decided in their order on what those left): a group that found no
        site costs one decision, so that many are reached only where room is left for most of them (about 0.1 s for
        2,000 placements)."""
        hour = timeshift.epoch_hour(snap.now)
        order = self._order(None, snap, extra=jobs)
        previewed = {job.id: n for n, job in enumerate(jobs)}
        out: list[tuple[dict[str, Any], Ahead] | None] = [None] * len(jobs)
        deciders: dict[int, PassDecider] = {}
        released: set[str] = set()
        decided = placed = deferrals = walked = listed = 0
        capped = False
        for job_id in order:
            n = previewed.get(job_id)
            if n is not None:
                job = jobs[n]
                req = JobRequest.from_spec(job.id, job.spec, frozenset(), snap.now)
                pipeline = self.profiles.get(job.spec.profile, self.pipeline) if job.spec.profile else self.pipeline
                decider, outcome, _ = self._decide_queued(job, req, pipeline, snap, {}, holds, moving, released)
                if isinstance(outcome, Deferral):
                    record = explain.record_deferral(pipeline, outcome, snap)
                elif isinstance(outcome, _Failure):
                    record = outcome.record(pipeline, snap)
                else:
                    record = explain.record(pipeline, outcome, snap)
                out[n] = (record, Ahead(decided, placed, deferrals, capped, listed))
                listed += 1
                if listed == len(jobs):
                    break
                if isinstance(outcome, Deferral):
                    decider.reserve(outcome)
                elif isinstance(outcome, Placement) and snap.sites[outcome.site] not in self.federation.leaving:
                    decider.assume(outcome)
                    order.placed(job.spec.tenant, req.charge)
                continue
            if capped:
                continue
            queued = self.book.active.get(job_id)
            if queued is None or queued.state != JobState.QUEUED:
                continue
            if walked == PREVIEW_WALK_MAX:
                capped = True
                order.only_extra()
                continue
            walked += 1
            planned = deferred.get(queued.id)
            if planned is not None and planned.decided_h == hour:
                continue  # deferred this hour: its hours are in the plan already
            if decided == PREVIEW_AHEAD_MAX:
                capped = True
                order.only_extra()
                continue
            if planned is not None:
                del deferred[queued.id]
                _replan(planned, snap, deciders)
            decided += 1
            req, pipeline = self._queued_request(queued)
            decider, outcome, _ = self._decide_queued(queued, req, pipeline, snap, deciders, holds, moving, released)
            if isinstance(outcome, Deferral):
                decider.reserve(outcome)
                deferrals += 1
            elif isinstance(outcome, _Failure):
                if _group_fails(req, pipeline, holds):
                    order.fail_group()
            elif snap.sites[outcome.site] not in self.federation.leaving:
                decider.assume(outcome)
                order.placed(queued.spec.tenant, req.charge)
                placed += 1
        return [o for o in out if o is not None]

    def _with_plan(self, snap: Snapshot, observe: bool = True,
                   deferred: dict[str, _Planned] | None = None) -> Snapshot:
        """``snap`` with the time-shift plan: hour by hour, the GPUs that jobs on sites (until their expected
        end: ``duration_s`` less the work earlier attempts kept, from when this attempt started or was placed)
        and deferred jobs (from their planned start) leave free. ``observe``: take what latency-bound jobs hold
        as this hour's sample of their demand (a pass does; a preview does not). ``deferred``: a preview's copy
        of the deferred jobs, whose plans that no longer hold are forgotten from it instead of the broker's own."""
        deferrals = self._deferred if deferred is None else deferred
        hours = self._plan_hours
        h0 = timeshift.epoch_hour(snap.now)
        calendar = timeshift.Calendar(snap.n_sites, snap.total_gpus.shape[1], h0, span_h=hours + 1)
        errors = self.lifecycle.run_times.sorted()
        overruns = (timeshift.Calendar(snap.n_sites, snap.total_gpus.shape[1], h0, span_h=hours + 1)
                    if self._book_overruns else None)
        for job in self.book.active.unqueued():
            site = snap.index.get(job.site) if job.site is not None else None
            if not job.state.on_site or site is None or job.gpu_model not in MODEL_INDEX:
                continue
            began = job.updated_at.timestamp()  # this attempt's start, or its placement (not the first attempt's)
            # a job past its estimate still holds its GPUs this hour (it is in free_gpus, and what
            # latency-bound jobs hold now is the reserve's sample)
            # (where it resumed from a checkpoint: the rest of its work after a restart's overhead, as its
            # profile's moves count it)
            overhead = self.restart_overhead_s(job)
            rest = max(job.spec.duration_s - work_done(job, job.updated_at, overhead), 0.0)
            end_ts = began + (overhead if job.run_s > 0 else 0.0) + rest
            end_h = max(math.ceil(end_ts / timeshift.HOUR_S), h0 + 1)
            req = self._on_site_request(job)
            calendar.book(site, MODEL_INDEX[job.gpu_model], req.charge, h0, min(end_h, h0 + hours),
                          near=req.latency_slo_ms is not None)
            if overruns is not None and end_h == h0 + 1 and job.spec.duration_s > 0:
                # its estimate runs out this hour or ran out before: it may hold its GPUs until the end that
                # the finished jobs that ran as long predict (policies.runtime_risk.expected_ratio), which
                # the plan shows beside it (Snapshot.plan_overrun; policies.timeshift.unless_it_slips)
                done = work_done(job, snap.now, overhead)
                ratio = runtime_risk.expected_ratio(errors, done / job.spec.duration_s)
                if ratio is not None:
                    over_h = math.ceil((snap.now.timestamp() + job.spec.duration_s * ratio - done) / timeshift.HOUR_S)
                    overruns.book(site, MODEL_INDEX[job.gpu_model], req.charge, h0 + 1, min(over_h, h0 + hours))
        for job_id, planned in list(deferrals.items()):
            job = self.book.active.get(job_id)
            site = snap.index.get(planned.site)
            if job is None or job.state != JobState.QUEUED or site is None:
                del deferrals[job_id]  # placed, cancelled, or its site left: nothing to hold
                continue
            member = self.federation.get(planned.site)
            if member is not None and member.spec is not planned.spec and member.spec != planned.spec:
                # its site changed since the plan was made (cordoned, moved to another grid zone, re-priced):
                # the plan no longer holds, and the job is decided again in this pass, not at the next hour (a
                # spec sent again unchanged, as a tool that keeps a site as declared does, changes nothing)
                del deferrals[job_id]
                continue
            calendar.book(site, planned.model, planned.gpus, planned.first, min(planned.end, h0 + hours),
                          near=planned.near)
        near: dict[str, Any] = {}
        if self._near is not None:  # what latency-bound jobs hold now is this hour's sample
            near["near_booked"] = booked = calendar.near_view(snap.now, hours)
            if observe:
                self._near.observe(h0, snap.sites, booked[:, :, 0])
            near["near_samples"] = self._near.samples(snap.sites, booked.shape[1])
        if overruns is not None:
            near["plan_overrun"] = overruns.booked_view(snap.now, hours)
        return replace(snap, plan_free=calendar.view(snap.now, snap.free_gpus, snap.total_gpus, hours),
                       run_time_errors=errors, **near)

    async def restore_learned(self) -> bool:
        """When this broker takes charge: the carbon ledger's totals, the moves in flight (taken up at the first
        pass, once the active jobs are loaded), and what latency-bound jobs held, hour by hour (saved at the
        first sample of each hour), so the room kept for them is not learned again from nothing. Returns
        whether a stored demand was taken; a document that cannot be read is ignored, with a warning. A store that
        cannot be read is tried again, then fails taking charge (StoreError): starting from nothing, this broker
        would save its own over what the last one kept."""
        await self._restore_ledger()
        # Whether or not this broker's profiles move running work: the last one's may have, and a stop it asked
        # for is still one that a site took (its job keeps its run up to the stop, and restarts where the move
        # chose), even where the configuration it restarted with no longer moves jobs.
        await self._restore_moves()
        if self._near is None:
            return False
        doc = await self._stored_state(LATENCY_DEMAND_STATE, "latency demand")
        if doc is None:
            return False
        try:
            near = LatencyDemand.restore(json.loads(doc))
            if near.sites and near.n_models != len(MODEL_INDEX):
                raise ValueError(f"kept for {near.n_models} GPU models, where this release knows {len(MODEL_INDEX)}")
        except ValueError as e:
            log.warning("ignoring the stored latency demand: %s; learning it again", e)
            return False
        self._near = near
        self._near_saved = self._near.hour
        return True

    def _moves_doc(self) -> str:
        """The moves in flight as the store keeps them (``MOVES_STATE``)."""
        return json.dumps({
            "moving": {job_id: _KeptMove(origin=m.origin, attempt=m.attempt, site=m.site,
                                         model=ids.GPU_MODEL_IDS[m.model] if m.site is not None else None,
                                         reason=m.reason, for_job=m.for_job, asked_ts=m.asked_ts).model_dump()
                       for job_id, m in sorted(self._moving.items())},
            # the moves whose stop the site has taken: a list beside the moves, which releases before this one
            # (strict about each move's fields) read past
            "delivered": sorted(job_id for job_id, m in self._moving.items() if m.delivered),
            "holds": {job_id: _KeptHold(site=h.site, model=ids.GPU_MODEL_IDS[h.model], duration_s=h.request.duration_s,
                                        attempt=h.attempt, until_ts=h.until_ts).model_dump()
                      for job_id, h in sorted(self._holds.items())},
            "cannot_stop": dict(sorted(self._cannot_stop.items())),
            # the jobs paused through dirty hours: (the attempt stopped, POSIX s it may restart from); only where
            # there are any, so the document is as an older release writes it otherwise
            **({"paused": {job_id: list(p) for job_id, p in sorted(self._paused_until.items())}}
               if self._paused_until else {}),
        }, separators=(",", ":"))

    async def keep_moves(self, final: bool = False) -> None:
        """Save the moves in flight when they changed (after a pass, and when the broker stops: ``final``, when
        a replica has already given up leading but still holds the lease; the store's fence refuses the write
        if another has taken over), so a broker that takes charge restarts the moved jobs where their moves
        chose and keeps holding the room made."""
        if not (final or self.may_act()) or self._moves_kept is not None:  # (what the last leader left: not read yet)
            return
        if self._moves_saved is None and not (self._moving or self._holds or self._cannot_stop or self._paused_until):
            return
        doc = self._moves_doc()
        if doc == self._moves_saved:
            return
        try:
            await self.store.put_state(MOVES_STATE, doc)
        except StoreError as e:  # tried again after the next pass
            log.warning("could not save the moves in flight: %s", e)
            return
        self._moves_saved = doc

    async def _restore_moves(self) -> None:
        """Read the moves the last leader kept (``keep_moves``), to be taken up at the first pass."""
        doc = await self._stored_state(MOVES_STATE, "moves in flight")
        if doc is None:
            return
        try:
            kept = json.loads(doc)
            if not isinstance(kept, dict) or not all(isinstance(kept.get(k), dict)
                                                     for k in ("moving", "holds", "cannot_stop")):
                raise ValueError("it is not an object with moving, holds and cannot_stop")
        except ValueError as e:
            log.warning("ignoring the stored moves in flight: %s; their jobs are placed as any other", e)
            return
        self._moves_saved = doc
        self._moves_kept = kept  # taken up at the next pass, when the active jobs are loaded
        delivered = kept.get("delivered")
        # (absent from an older release's document: none counts)
        kept["delivered"] = {j for j in delivered if isinstance(j, str)} if isinstance(delivered, list) else set()
        self._stops_kept = {}
        for job_id, entry in kept["moving"].items():
            with contextlib.suppress(ValueError):  # (the take-up says which it drops, and why)
                m = _KeptMove.model_validate(entry)
                if job_id in kept["delivered"]:
                    self._stops_kept[(job_id, m.attempt, m.origin)] = (m.asked_ts, m.reason)

    def stop_asked(self, job_id: str, attempt: int, site: str) -> tuple[float, str] | None:
        """When (POSIX seconds) and why ``site`` was asked to checkpoint and stop ``job_id``'s ``attempt`` to move
        it, by this broker or by the last one in charge (the moves in flight it kept), and the site took the
        request; None if not. A restarted broker whose site no longer knows the attempt takes it for stopped
        then, not lost (``Lifecycle.reconcile``): its work up to the stop is kept. A request the broker went
        down before the site took (or before the store kept that it had) does not count: the attempt may have
        gone for another reason, with no checkpoint. (A site answers a stop of an attempt it no longer runs
        without an error, and its own event for that attempt's end, which it sends first, is what counts.)"""
        m = self._moving.get(job_id)
        if m is not None and m.attempt == attempt and m.origin == site and m.delivered:
            return m.asked_ts, m.reason
        return self._stops_kept.get((job_id, attempt, site))

    def move_over(self, job_id: str, attempt: int) -> None:
        """``job_id``'s ``attempt`` ended otherwise than stopped (it succeeded, failed, or was lost or withdrawn;
        ``Lifecycle.ended_unstopped``): a move asking its site to stop it is over, and with it the GPUs held at
        its target, since nothing was checkpointed to restart there; the job is placed as any other (and not
        kept off the site it was leaving, which the move would have done). The room it was making for a job near
        its users is made all the same: the attempt has left its site."""
        if self._moves_kept is not None:  # not taken up yet: the take-up leaves it out
            self._over_before_take_up.add((job_id, attempt))
        paused = self._paused_until.get(job_id)
        if paused is not None and paused[0] == attempt:  # nothing was stopped: the job is decided as any other
            del self._paused_until[job_id]
        moving = self._moving.get(job_id)
        if moving is None or moving.attempt != attempt:
            return
        del self._moving[job_id]
        hold = self._holds.get(job_id)
        if hold is not None and hold.attempt == attempt:
            del self._holds[job_id]
        self.book.forgive(job_id, moving.origin)
        log.info("job %s: attempt %d ended on %s before its move was done; the move is over", job_id, attempt,
                 moving.origin)

    def _take_up_moves(self, now_ts: float) -> None:
        """The moves the last leader left (``_restore_moves``), for jobs still active at the same attempt and
        within their time: asked-for stops, the GPUs held, the moved jobs kept off the sites they left, the
        sites that could not stop a job. A job still running where its move found it (the stop may never have
        reached its site) is left to the next search, with the room its move was making. An entry that cannot
        be read is dropped, with a warning."""
        kept, self._moves_kept = self._moves_kept or {}, None
        over, self._over_before_take_up = self._over_before_take_up, set()
        dropped: set[str] = set()  # jobs whose room is no longer being made
        for job_id, entry in kept["moving"].items():
            try:
                m = _KeptMove.model_validate(entry)
                if (m.site is None) != (m.model is None):
                    raise ValueError("a target site needs its GPU model, and only it")
            except ValueError as e:  # pydantic's ValidationError included
                log.warning("ignoring a stored move of job %s: %s", job_id, e)
                continue
            moving = _Moving(m.origin, m.attempt, m.site, MODEL_INDEX[m.model] if m.model is not None else -1,
                             m.reason, m.for_job, m.asked_ts, job_id in kept["delivered"])
            job = self.book.active.get(job_id)
            left_s = min(moving.asked_ts + MOVE_TIMEOUT_S - now_ts, MOVE_TIMEOUT_S)
            if job is None or job.attempt != moving.attempt or left_s <= 0:
                continue
            if (job_id, moving.attempt) in over:  # it ended otherwise than stopped: nothing to restart elsewhere
                dropped.add(job_id)
                continue
            # Kept off the site it left either way: a stop on its way there may still come. (Not a paused job:
            # its rest is planned there, later, as often as not.)
            if moving.site is not None or moving.for_job is not None:
                self.book.refuse(job_id, moving.origin, f"moved away: {moving.reason}", ttl_s=left_s)
            if job.state != JobState.QUEUED:  # not stopped (yet), and nothing tells it will be
                dropped.add(job_id)
                if moving.for_job is not None:
                    dropped.add(moving.for_job)
                continue
            self._moving[job_id] = moving
        held = 0
        for job_id, entry in kept["holds"].items():
            job = self.book.active.get(job_id)
            if job is None or job_id in dropped:
                continue
            try:
                h = _KeptHold.model_validate(entry)
            except ValueError as e:
                log.warning("ignoring a stored hold for job %s: %s", job_id, e)
                continue
            until_ts = min(h.until_ts, now_ts + MOVE_TIMEOUT_S)
            if job.attempt != h.attempt or until_ts <= now_ts:
                continue
            req = replace(JobRequest.from_spec(job.id, job.spec, self.book.refused_sites(job.id), job.created_at),
                          duration_s=h.duration_s)
            self._holds[job_id] = _Hold(h.site, MODEL_INDEX[h.model], req, job.attempt, until_ts)
            held += 1
        paused = kept.get("paused")
        for job_id, entry in (paused.items() if isinstance(paused, dict) else ()):
            job = self.book.active.get(job_id)
            try:
                attempt, until = _KEPT_PAUSE.validate_python(entry)
            except ValueError:
                continue
            if job is not None and job.attempt == attempt and until > now_ts:
                self._paused_until[job_id] = (attempt, until)
        for site, until in kept["cannot_stop"].items():
            try:
                until = _KEPT_UNTIL.validate_python(until)
            except ValueError:
                continue
            if until > now_ts:
                self._cannot_stop[site] = min(until, now_ts + CANNOT_STOP_S)
        if self._moving or held:
            log.info("took up %d moves in flight and %d holds that the last broker in charge left", len(self._moving),
                     held)

    async def _stored_state(self, name: str, what: str) -> str | None:
        """``Store.get_state(name)``, tried again while the store cannot be read (a connection lost for a moment),
        each failure logged; after ``STATE_READ_TRIES`` the StoreError goes up and taking charge fails (a replica
        steps down and tries again later). Never taken for "nothing stored": the first save would then write
        this broker's fresh state over what the last one kept (the carbon ledger's totals back to 0)."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(StoreError), stop=stop_after_attempt(STATE_READ_TRIES),
            wait=wait_exponential(multiplier=0.1, max=1.0), reraise=True,
            before_sleep=lambda rs: log.warning("could not read the stored %s (%s); trying again", what,
                                                rs.outcome.exception() if rs.outcome else "?"),
        ):
            with attempt:
                return await self.store.get_state(name)
        return None  # (not reached: the last failure is raised)

    async def _restore_ledger(self) -> None:
        doc = await self._stored_state(CARBON_LEDGER_STATE, "carbon ledger")
        try:
            self.carbon = CarbonLedger() if doc is None else CarbonLedger.restore(json.loads(doc))
            self._carbon_saved = self.carbon.revision
        except ValueError as e:
            log.warning("ignoring the stored carbon ledger: %s; its totals start from 0", e)
        # The last time the broker then in charge knew the ledger's open attempts on their sites: one that a site
        # no longer knows now ended after that, while no broker heard (Lifecycle.recover).
        seen = self.carbon.seen_ts
        self.lifecycle.unheard_since = datetime.fromtimestamp(seen, UTC) if seen is not None else None

    async def settle_ledger(self) -> int:
        """Once the active jobs are loaded, when this broker takes charge: end the ledger's open attempts that are
        no longer on their site (their end reached the store after the last broker in charge last saved the
        ledger, or while it stopped), as of the job's end, or else its last change (the attempt ended by then;
        for a job on a later attempt since, when that one left its site, as its stored transitions say), and
        forget the jobs between attempts that have ended. The jobs no longer active are read from the store;
        one that cannot be read now stays open, for the next broker in charge. Returns how many were ended."""
        await self._settle_dispatching()
        ended = 0
        for job_id, held in list(self.carbon.open.items()):
            job = self.book.active.get(job_id)
            if job is not None and job.attempt == held.attempt and job.state.on_site:
                continue
            if job is None:
                try:
                    job = await self.store.get_job(job_id)
                except StoreError as e:
                    log.warning("job %s: cannot read it to end its attempt in the carbon ledger: %s", job_id, e)
                    continue
            if job is None:  # (not in the store: nothing tells when it ended; left as counted)
                self.carbon.end(job_id, held.attempt, held.admitted_ts + held.counted.expected_s, requeued=False)
                continue
            before = job.model_copy(update={"state": JobState.RUNNING, "attempt": held.attempt})
            if job.attempt > held.attempt:  # a later attempt's changes since: when this one left, as stored
                left = await self._left_site_at(job_id, held.attempt)
                if left is not None:
                    job = job.model_copy(update={"state": JobState.QUEUED, "updated_at": left, "finished_at": None})
            self._attempt_ended(before, job)
            ended += 1
        for job_id in [j for j in self.carbon.returning if j not in self.book.active]:
            self.carbon.forget(job_id)
        return ended

    async def _settle_dispatching(self) -> None:
        """Of the attempts the ledger holds sent to their site and not counted yet: count those the site admitted
        (the job is on it, admitted or running, or its stored transitions say it was), as of when it began to
        hold its GPUs as the broker knows it (:func:`held_since`; the first stored change of that attempt that
        says so, for one that has left its site since: ``settle_ledger`` then ends it), and drop those that
        left their site before any admission was heard. Those still being dispatched wait for their answer or
        their site's report (``_attempt_ended``)."""
        for job_id, sent in list(self.carbon.dispatching.items()):
            job = self.book.active.get(job_id)
            if job is not None and job.attempt == sent.attempt and job.state.on_site:
                if job.state != JobState.DISPATCHING:
                    self._count_admitted(job_id, sent.attempt, held_since(job).timestamp())
                continue
            try:
                events = await self.store.job_events(job_id)
            except StoreError as e:
                log.warning("job %s: cannot read its transitions to count attempt %d in the carbon ledger: %s",
                            job_id, sent.attempt, e)
                continue
            admitted = [ev["at"] for ev in events if ev["attempt"] == sent.attempt
                        and ev["state"] in (JobState.ADMITTED, JobState.RUNNING)]
            if not admitted:
                self.carbon.undispatch(job_id, sent.attempt)
                continue
            at = datetime.fromisoformat(admitted[0])
            at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
            self._count_admitted(job_id, sent.attempt, at.timestamp())

    async def _left_site_at(self, job_id: str, attempt: int) -> datetime | None:
        """When ``job_id``'s ``attempt`` left its site, from its stored transitions: its first change of that
        attempt to a state off the site (None: none stored, or they cannot be read)."""
        try:
            events = await self.store.job_events(job_id)
        except StoreError as e:
            log.warning("job %s: cannot read its transitions to end attempt %d in the carbon ledger: %s", job_id,
                        attempt, e)
            return None
        for ev in events:
            if ev["attempt"] == attempt and not JobState(ev["state"]).on_site:
                at = datetime.fromisoformat(ev["at"])
                return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
        return None

    def _count_admitted(self, job_id: str, attempt: int, admitted_ts: float) -> None:
        """Count ``job_id``'s ``attempt``, being dispatched, as admitted at ``admitted_ts`` (the counters too)."""
        added = self.carbon.admit(job_id, attempt, admitted_ts)
        if added is not None:
            self.metrics.carbon_grams.inc(added.grams)
            self.metrics.carbon_agnostic_grams.inc(added.agnostic_grams)

    def _admitted_by_report(self, job: Job) -> None:
        """The lifecycle's hook (``Lifecycle.admitted_by_report``): the site's report of ``job``'s attempt running
        or done showed it admitted, stored now; counted as of then, where it is being dispatched (its answer,
        when it comes, finds it counted), and corrected at its end to the run the site reports, where longer."""
        self._count_admitted(job.id, job.attempt, held_since(job).timestamp())

    def _attempt_ended(self, before: Job, job: Job) -> None:
        """The book's hook (``JobBook.on_attempt_end``): ``before``'s attempt left its site, or the job ended;
        the ledger corrects the attempt's figures to the time it held its GPUs, from its admission to this end
        (the site's reported end where the job succeeded or failed for good, or where a site's report of it
        stopping or lost, or a restart's finding that its site forgot it, came after it ended:
        ``Lifecycle.left_at``; the broker's time of the change otherwise), and an overrun is added to the
        counters too (they never go down). An attempt whose site admitted it (its reports say so: it was
        admitted or running) but whose end came before the broker recorded that admission (the site's report
        of it done overtook its answer to the dispatch, or a restart cut the dispatch off) is counted here,
        from when the site's reports say it began (:func:`held_since`)."""
        left = self.lifecycle.left_at.pop((job.id, before.attempt), None)
        if before.state.on_site:
            end = job.finished_at if job.state.terminal and job.finished_at is not None else job.updated_at
            if left is not None and left < end:
                end = left
            # (this attempt's run as its site reported it at its end, where it did: added to run_s)
            reported_s = max(job.run_s - before.run_s, 0.0)
            if before.state == JobState.DISPATCHING:
                self.carbon.undispatch(job.id, before.attempt)  # (never admitted, as far as anyone heard)
            else:
                self._count_admitted(job.id, before.attempt, held_since(before, end, reported_s).timestamp())
            over = self.carbon.end(job.id, before.attempt, end.timestamp(), requeued=not job.state.terminal,
                                   ran_s=reported_s)
            if over is not None:
                self.metrics.carbon_grams.inc(over.grams)
                self.metrics.carbon_agnostic_grams.inc(over.agnostic_grams)
        if job.state.terminal:
            self.carbon.forget(job.id)

    async def _keep_ledger_due(self) -> None:
        """``keep_ledger`` at most every ``LEDGER_SAVE_S``, at the end of every pass, quiet ones included: a
        placement is counted when its site admits it (``_dispatch``), after the pass that made it, and corrected
        when its attempt ends (``_attempt_ended``), between passes."""
        since = time.monotonic() - self._carbon_saved_at
        if self.carbon.revision != self._carbon_saved and since >= LEDGER_SAVE_S:
            await self.keep_ledger()
        elif self.carbon.open and since >= LEDGER_SEEN_S:
            await self.keep_ledger(seen=True)

    async def keep_ledger(self, final: bool = False, seen: bool = False) -> None:
        """Save the carbon ledger (its totals, the attempts it counted that are still running, the jobs between
        two attempts, when it was saved): at the end of a pass where it changed, at most every
        ``LEDGER_SAVE_S`` (tried again after the next one; ``_keep_ledger_due``), and when the broker stops
        (``final``: as for ``keep_moves``). While attempts are open, also unchanged (``seen``) every
        ``LEDGER_SEEN_S`` and when the broker stops: when it was saved is the last time the broker in charge
        knew them on their sites, which a broker that takes charge after a stop or a crash goes by for an attempt
        its site forgot meanwhile (``Lifecycle.recover``)."""
        if not (final or self.may_act()):
            return
        if self.carbon.revision == self._carbon_saved and not ((final or seen) and self.carbon.open):
            return
        revision = self.carbon.revision
        try:
            await self.store.put_state(CARBON_LEDGER_STATE,
                                       json.dumps(self.carbon.state(seen_ts=self.clock.now().timestamp())))
        except StoreError as e:
            log.warning("could not save the carbon ledger: %s", e)
            return
        self._carbon_saved, self._carbon_saved_at = revision, time.monotonic()

    async def _keep_learned(self) -> None:
        """Save the latency demand once an hour, at its first sample of the hour (the hour before is complete)."""
        near = self._near
        if near is None or near.hour is None or near.hour == self._near_saved or not self.may_act():
            return
        try:
            await self.store.put_state(LATENCY_DEMAND_STATE, json.dumps(near.state()))
        except StoreError as e:  # tried again at the next pass
            log.warning("could not save the latency demand: %s", e)
            return
        self._near_saved = near.hour

    def latency_reserve(self) -> dict[tuple[str, int, float], float]:
        """(site, model column, quantile) -> GPUs kept for latency-bound jobs there, for each quantile the
        profiles keep (``ShiftPolicy.latency_reserve``; the ``heliotrope_site_latency_reserve_gpus`` gauge).
        Empty when no profile keeps one or no hour has been sampled yet."""
        if self._near is None or not self._near.sites:
            return {}
        samples = self._near.samples(self._near.sites, self._near.n_models)
        quantiles = sorted({p.shift.latency_reserve for p in (self.pipeline, *self.profiles.values())
                            if p.shift is not None and p.shift.latency_reserve is not None})
        out: dict[tuple[str, int, float], float] = {}
        for q in quantiles:
            kept = latency_reserve.reserve(samples, q)
            for i, m in zip(*np.nonzero(kept > 0), strict=True):
                out[(self._near.sites[i], int(m), q)] = float(kept[i, m])
        return out

    def deferred_until(self, job_id: str) -> datetime | None:
        """When a deferred job is planned to start (None: not deferred)."""
        planned = self._deferred.get(job_id)
        return None if planned is None else datetime.fromtimestamp(planned.first * timeshift.HOUR_S, tz=UTC)

    def _forget_gone(self) -> None:
        """Drop the cached requests and decision signatures of jobs that have ended, and the signatures no job
        has any more (a job whose decision was recorded again has a new one). Run when the caches have doubled
        since the last sweep, so their upkeep costs a constant per entry, not a walk per pass."""
        active = self.book.active
        for cache in (self._requests, self._last_seen):
            for job_id in [j for j in cache if j not in active]:
                del cache[job_id]
        self._signatures = {sig: sig for sig in self._last_seen.values()}
        self._sweep_at = max(SWEEP_MIN, 2 * (len(self._last_seen) + len(self._requests) + len(self._signatures)))

    async def _persist(self, new: Job, landing: Awaitable[None]) -> bool:
        """Wait for an assumed placement's write (queued when it was decided, with its decision); if it
        failed, memory has gone back to what the store holds and the job is decided again."""
        try:
            await landing
            return True
        except StoreError as e:
            log.error("job %s: could not store its placement on %s (%s); it stays queued", new.id, new.site, e)
            self._in_flight.pop(new.id, None)
            return False

    def _count_tenants(self, snap: Snapshot) -> Snapshot:
        """``snap`` with, under federation-wide tenant limits, what each limited tenant holds now (its jobs on sites
        or on their way to one, and preempted ones not back in the queue yet), for the pass to debit its placements
        from."""
        limits = self.tenant_limits
        if limits is None:
            return snap
        held = {tenant: usage.gpus_held for tenant, usage in self.book.active.by_tenant().items()
                if limits.of(tenant) is not None}
        return replace(snap, tenant_room=TenantRoom(limits, held))

    def _debit_in_flight(self, snap: Snapshot, asked_at: int, forget: bool = True) -> None:
        """Debit placements the reports cannot show yet; forget those a report has caught up with (``forget``:
        a pass does; a preview changes nothing)."""
        for job_id, f in list(self._in_flight.items()):
            job = self.book.active.get(job_id)
            if job is None or job.site != f.site or job.attempt != f.attempt or not job.state.on_site:
                if forget:
                    del self._in_flight[job_id]  # refused, requeued, cancelled or finished
                continue
            if job.state == JobState.DISPATCHING or self.book.admitted_seq.get(job_id, asked_at) >= asked_at:
                site = snap.index.get(f.site)
                if site is not None:
                    snap.assume(site, f.request, f.model, placed_now=False)
            elif forget:
                del self._in_flight[job_id]  # admitted before the report was asked for: the report has it

    async def _dispatch(self, job: Job, counted: Counted | None = None) -> None:
        """Send the attempt to its site; confirm it, or undo it. ``counted``: the placement's figures for the
        carbon ledger, counted when the site admits the attempt (a refused one is placed again and counted
        there, once)."""
        site = job.site
        assert site is not None
        if not self._current(job):
            return  # cancelled before the site heard of it
        task = asyncio.current_task()
        assert task is not None
        under_way = self._submits.setdefault(site, set())
        under_way.add(task)
        self._sending.add((job.id, job.attempt))
        try:
            await self._send(job, site, counted)
        finally:
            self._sending.discard((job.id, job.attempt))
            under_way.discard(task)
            if not under_way and self._submits.get(site) is under_way:
                del self._submits[site]

    async def dispatches_to(self, site: str, timeout_s: float) -> int:
        """Wait, at most ``timeout_s``, for the dispatches to ``site`` under way to be confirmed or undone; how
        many are still under way. A site is rebuilt or removed only once none are: the attempt of a job cancelled
        while its site was slow to admit it is withdrawn through the adapter that sent it, not through a new one
        that may not see it (another kubeconfig or namespace) or, for a removed site, not at all."""
        under_way = self._submits.get(site)
        if not under_way:
            return 0
        _, pending = await asyncio.wait(list(under_way), timeout=timeout_s)
        return len(pending)

    async def _send(self, job: Job, site: str, counted: Counted | None) -> None:
        if counted is not None:  # (counted once the site admits it: below, or where its end is heard first)
            self.carbon.dispatch(job.id, job.attempt, counted, self.clock.now().timestamp())
        member = self.federation.get(site)
        if member is None:
            return await self._requeue(job, "site was removed")
        if not self.may_act():
            return  # no longer sure it leads: the next leader reconciles the attempt with the site
        try:
            async with asyncio.timeout(self.dispatch_timeout_s):
                admission = await member.adapter.submit(job)
        except Exception as e:
            # The site may have admitted the attempt and lost the answer: the job moves on only once
            # the site confirms the attempt is withdrawn, so it never runs twice at once.
            why = "no answer in time" if isinstance(e, TimeoutError) else str(e) or e.__class__.__name__
            if await self.lifecycle.withdraw(job, site):
                await self.lifecycle.requeue_from(site, job.id, job.attempt, f"dispatch failed ({why}); withdrawn")
            else:
                log.warning("job %s: dispatch to %s failed (%s) and the site has not confirmed it dropped the "
                            "attempt; the job stays dispatching until it does", job.id, site, why)
            return
        # 6. confirm or undo
        if not admission.admitted:
            return await self._requeue(job, admission.reason or "refused")
        if member is not self.federation.get(site) or site in self.federation.leaving:
            # The site was removed or rebuilt while it admitted the attempt: take it back.
            if await self.lifecycle.withdraw(job, site):
                await self.lifecycle.requeue_from(site, job.id, job.attempt, "the site changed during dispatch")
            return
        confirmed = await self.book.transition_if(
            job.id, (JobState.DISPATCHING,), job.attempt, JobState.ADMITTED, reason=f"admitted by {site}"
        )
        if confirmed is None and not self._at_site(job):
            await self.lifecycle.withdraw(job, site)  # cancelled or requeued while it was being dispatched
        elif counted is not None:
            # Opened as the admission's write lands, before the end of the attempt can land (the store lands
            # writes in order, and this task wakes first): the ledger hears of its end (_attempt_ended). Where
            # the site's report of the attempt running overtook this answer, as of the site's start.
            admitted = confirmed if confirmed is not None else self.book.active.get(job.id)
            at = held_since(admitted) if admitted is not None else self.clock.now()
            self._count_admitted(job.id, job.attempt, at.timestamp())
        # (one that ended before this answer, the site's report overtaking it, was counted at its end, where the
        # site's report said it began: _attempt_ended)

    def dispatching(self, job_id: str, attempt: int) -> bool:
        """Whether a dispatch of that attempt is under way (``Lifecycle.find_stranded``)."""
        return (job_id, attempt) in self._sending

    def _current(self, job: Job) -> bool:
        """Whether ``job``'s attempt is still the one being dispatched."""
        current = self.book.active.get(job.id)
        return current is not None and current.attempt == job.attempt and current.state == JobState.DISPATCHING

    def _at_site(self, job: Job) -> bool:
        """Whether the broker still counts ``job``'s attempt as at its site. (Not ``_holds``: that name is the
        GPUs kept for moved jobs, and an attribute of that name would hide this method.)"""
        current = self.book.active.get(job.id)
        return (current is not None and current.attempt == job.attempt and current.site == job.site
                and current.state.on_site)

    async def _requeue(self, job: Job, reason: str) -> None:
        """Undo: the site did not take the attempt; skip the site for a while and route the job again."""
        if self._current(job):
            assert job.site is not None
            await self.lifecycle.requeue_from(job.site, job.id, job.attempt, f"refused it: {reason}")

    async def drain(self, timeout_s: float | None = None) -> int:
        """Wait for dispatches in flight; after ``timeout_s`` cancel the rest and return how many.

        A cancelled dispatch leaves its job ``dispatching`` in the store; at the next start the broker asks
        the site which attempts it knows and requeues the others, so nothing runs twice or is lost.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._dispatches:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                pending = list(self._dispatches)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return len(pending)
            await asyncio.wait(list(self._dispatches), timeout=remaining)
        return 0

