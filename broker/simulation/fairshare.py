"""``heliotrope simulate-quotas``: one site's local quotas and fair share replayed over a job trace.

The question (the fair-share acceptance experiment): on a trace whose tenants share one cluster, does the
site's time-based fair share (``policies.quota``, ``policies.fairshare``) make tenants' slowdowns more alike
(Jain's index over tenants of their mean slowdown rises) without costing utilisation (at most 2 points) or
the tail of waiting (p95 wait at most 10 % longer)? The site's own pure policies decide everything:
:class:`policies.admission.SiteAdmission` orders the queue, admits, names victims; this module only keeps
the clock, the queue and the books, as the simulated adapter would.

The site (assumptions, each the same for every mode and derived from the trace by one rule)
    - One site, as Philly was one cluster: ``nodes`` nodes of :data:`GPUS_PER_NODE` (8) GPUs of one model
      (:data:`MODEL`, the default federation's; jobs name no model and the site has one, so which model it
      is changes nothing here). ``nodes`` is the smallest number that keeps the trace's mean GPUs busy
      (``Trace.mean_gpus_busy`` over its window) at or below ``utilisation`` of the site
      (``broker.simulation.federation.size_sites``). Jobs asking for more GPUs than the site has are
      dropped for every mode alike and counted.
    - Default ``utilisation`` :data:`DEFAULT_UTILISATION` (0.8): a queueing experiment needs queues, and
      the order a site picks only matters while jobs wait. Demand in real traces comes in bursts of hours
      to days, so a site carrying 0.8 of its window's mean is overloaded for hours at a time: queues form and
      drain. Far below (0.5 of a steady window) little waits and every order is nearly the same order; near
      1 the queue never drains and waits are set by the backlog, not by the order. The fraction is of the
      *window's* mean: a window with idle stretches (the whole Philly trace opens with three nearly idle
      weeks) makes the same fraction a busier site in its busy weeks, so pick the window with the fraction.
    - Tenants are the trace's tenants (Philly: its virtual clusters). A tenant's *size* is the GPU-seconds
      its jobs submitted in the window asked for, over the window's length (every tenant with a job has a
      positive size). With ``share = size / sum(sizes)`` and C the site's GPUs:
      ``guaranteed_gpus = floor(C × share × guaranteed_fraction)`` (default :data:`GUARANTEED_FRACTION`,
      0.8: four fifths of the site is guaranteed in all, the rest and any unused guarantee is lent),
      ``burst_gpus = C`` (no burst limit in effect: idle capacity goes to whoever asks) and
      ``fair_share_weight = share``. The same rule reads any trace with a tenant column.
    - Jobs: every job is preemptible and checkpointable (a preempted job goes back in the queue at its
      submit position and later resumes with the progress it made, so no work is lost; the restarts and the
      GPU-hours that *would* have been lost without checkpoints are reported). A job runs for its true
      duration (the site does not use estimates). Preemption spares a job that ran less than the policy's
      ``min_run_s`` (default :data:`DEFAULT_MIN_RUN_S`, 10 minutes) so reclaiming does not thrash. All jobs
      have priority 0, so the only preemption is a *reclaim*: a tenant within its guarantee takes back GPUs
      from tenants above theirs. Preemption for priority never happens, as the trace records none.

Modes (``--modes``; every mode has the same site, jobs and ``min_run_s``)
    - ``fifo``: no quotas at all (the site admits whatever fits in arrival order, nobody is preempted): a
      site with neither quotas nor fair share.
    - ``off``: the quotas above, ``FairSharePolicy(mode="off")``: the queue in priority-then-arrival order,
      the guarantees enforced by reclaim. This is the baseline the acceptance test compares against, as it
      differs from ``time`` in the fair share alone (reclaims happen in both).
    - ``instant``: fair share by weight (the queue ordered by each tenant's GPUs held over its share).
    - ``time``: fair share weighted by decayed usage (``window_h``, ``half_life_h``, ``reweight_h``, ``k``).

The replay (discrete events; no asyncio, no clock)
    Events are arrivals (submit times) and completions (start + remaining work). At each instant,
    completions are applied first, then arrivals, then one scheduling cycle runs: the site orders its whole
    queue (``SiteAdmission.order``), then walks it calling ``admit`` with the demand of each tenant (GPUs it
    runs plus GPUs it waits for); an admitted job's victims are stopped and put back in the queue at their
    submit position with their remaining work (they are considered again from the next cycle), then the job
    starts. Later jobs may start past a refused one (backfill, the same in every mode) until a job starves:

    - the starvation guard (``starvation_h``, default :data:`DEFAULT_STARVATION_H`, 24 h; 0 turns it off):
      the first job in the site's order that has been queued for ``starvation_h`` or longer (since its
      submit, or since its last preemption) holds a reservation once it is refused in a cycle: later jobs
      in that cycle may start only if, after their victims are stopped, the site still has at least the
      starving job's GPUs free (they fit in GPUs beyond what it needs, counted, not placed on nodes); the
      others are held back and count as refused for the two rules below. Preemption (reclaim) still
      happens wherever it leaves those GPUs free. One reservation at a time, the same in every mode, so a
      large job of a small tenant cannot be starved for ever by smaller jobs backfilling every GPU freed
      (without it, nothing ever gathers 32 free GPUs on a busy site). The default is one day: the usage
      window of the fair share (so a job that waited that long has outlived any usage an order could hold
      against it), and far above the waits an order alone causes on a site that drains (p95 waits are
      hours), so the guard acts only where backfill starves a job; it is a round figure, not fitted to any
      trace.

    Two rules bound a cycle's work whatever the queue's length:

    - a job is not asked about when a job of its tenant no larger was refused earlier in the same cycle (the
      answer could only be no: the tenant holds no less and the site has no more free GPUs, except where a
      preemption earlier in the cycle freed more than its job took; that job is asked again next cycle);
    - the walk ends after :data:`DEFAULT_MAX_REFUSALS` (64) refusals.

    While jobs wait, a cycle also runs at every multiple of :data:`DEFAULT_CYCLE_S` (300 s) so that a
    reclaim waiting on ``min_run_s``, or a change of usage weights at a reweight boundary, is acted on
    without a new arrival or completion. The clock is seconds after the trace's first submit (so reweight
    boundaries fall on whole hours from there).

Cost
    ``SiteAdmission.order`` sorts the whole queue every cycle, so a cycle costs O(queue). The whole Philly
    trace (82,247 jobs) replays in well under a minute per mode where queues drain (a site sized for 0.5 of
    its mean, whose busy weeks then run at 0.7 to 0.95); a site that stays overloaded for weeks (0.8 of the
    whole trace's mean, when its busy weeks ask 1.1 to 1.5 times the site) builds queues of thousands of
    jobs and takes far longer: pick a window (``--trace-from``, ``--days``) whose load the site can carry.

Metrics (per mode, over the jobs that were not dropped; every job runs to completion)
    - ``utilisation``: busy GPU-seconds inside the trace window over (site GPUs × window length); the drain
      after the window is excluded (in every mode). The window is the trace's (``--trace-from``/``--days``,
      else its first to its last submit). With every job checkpointed a work-conserving site does the same
      work in every mode, so utilisation differs only by work left over at the window's end.
    - ``wait_mean_s``, ``wait_p95_s``: first start minus submit.
    - ``slowdown``: per job ``max(1, (finish - submit) / max(run time, SLOWDOWN_FLOOR_S))`` with the floor
      :data:`SLOWDOWN_FLOOR_S` (60 s): a one-second job that waited ten minutes counts 10, not 600, so the
      many very short jobs of real traces (failed starts) do not decide the mean alone. Per tenant the mean
      over its jobs; ``slowdown_mean`` over all jobs.
    - ``jain``: Jain's index over tenants of their mean slowdown, ``(sum x)^2 / (n × sum x^2)``: 1 when every
      tenant is slowed alike, 1/n when one bears it all.
    - ``preemptions`` (attempts stopped), ``restarts`` (jobs preempted at least once),
      ``preempted_gpu_h`` (progress those attempts had made: lost without checkpoints, kept here),
      ``dropped`` (jobs larger than the site), ``peak_gpus`` (most GPUs held at once: never above the site).

Units: seconds (times after the first submit), GPUs, GPU-hours. Turn a site's fair share off with
``FairSharePolicy(mode="off")`` (mode ``off`` here) and its quotas off with an empty quota list (``fifo``).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker.data.traces import Trace
from broker.models import FairSharePolicy, GpuRequest, JobSpec, NodeGroup, SiteSpec, TenantQuota
from broker.simulation.federation import DEFAULT_GPU_MODEL, GPUS_PER_NODE, size_sites
from broker.simulation.workload import tenant_slug
from policies.admission import Refused, SiteAdmission
from policies.quota import Ask

MODEL = DEFAULT_GPU_MODEL
DEFAULT_UTILISATION = 0.8
GUARANTEED_FRACTION = 0.8
DEFAULT_MIN_RUN_S = 600.0
DEFAULT_MAX_REFUSALS = 64
DEFAULT_CYCLE_S = 300.0
DEFAULT_STARVATION_H = 24.0
SLOWDOWN_FLOOR_S = 60.0
MODES = ("fifo", "off", "instant", "time")
_MAX_DURATION_S = 366 * 86400.0  # the longest JobSpec.duration_s (the site does not read it here)

_COMPLETE, _ARRIVE, _TICK = 0, 1, 2  # at one instant: completions, then arrivals, then the cycle's tick


class QuotaSimulationError(ValueError):
    """A quota simulation that cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class QuotaWorkload:
    """Jobs in submit order: ``submit_s`` float seconds after the first submit, ``run_s`` true durations,
    ``gpus`` whole GPUs, ``tenant`` codes into ``tenant_names`` (valid ``JobSpec`` tenants). The window
    ``[window_lo_s, window_hi_s]`` (same clock) is what utilisation and sizes are measured over."""

    submit_s: np.ndarray
    run_s: np.ndarray
    gpus: np.ndarray
    tenant: np.ndarray
    tenant_names: list[str]
    window_lo_s: float
    window_hi_s: float

    def __len__(self) -> int:
        return int(self.submit_s.shape[0])

    @property
    def window_s(self) -> float:
        return self.window_hi_s - self.window_lo_s

    def mean_gpus_busy(self) -> float:
        """Mean GPUs busy over the window had every job run at its submit time (the part inside it)."""
        return float(self._inside().sum()) / self.window_s

    def sizes(self) -> dict[str, float]:
        """Each tenant's size: GPU-seconds its jobs asked for in all, over the window's length (GPUs)."""
        per = np.bincount(self.tenant, weights=self.gpus * self.run_s, minlength=len(self.tenant_names))
        return {n: float(v) / self.window_s for n, v in zip(self.tenant_names, per, strict=True) if v > 0}

    def _inside(self) -> np.ndarray:
        lo, hi = self.window_lo_s, self.window_hi_s
        return self.gpus * (np.clip(self.submit_s + self.run_s, lo, hi) - np.clip(self.submit_s, lo, hi))

    def subset(self, keep: np.ndarray) -> QuotaWorkload:
        return QuotaWorkload(self.submit_s[keep], self.run_s[keep], self.gpus[keep], self.tenant[keep],
                             self.tenant_names, self.window_lo_s, self.window_hi_s)


def workload_from_trace(trace: Trace) -> QuotaWorkload:
    """The trace's jobs (tenant names made valid ``JobSpec`` tenants) and its window."""
    if (trace.milli != 1000).any():
        raise QuotaSimulationError(f"{trace.path}: jobs using part of a GPU are not supported here; map no "
                                   "milli column, or drop those rows")
    names = [tenant_slug(n) for n in trace.tenant_names]
    if len(set(names)) != len(names):
        raise QuotaSimulationError(f"{trace.path}: two tenant names map to one JobSpec tenant; rename them")
    lo = (trace.span[0] - trace.start).total_seconds()
    hi = (trace.span[1] - trace.start).total_seconds()
    if not hi > lo:
        raise QuotaSimulationError(f"{trace.path}: the window has no length; give --days")
    return QuotaWorkload(trace.submit_s.astype(np.float64), trace.duration_s.astype(np.float64),
                         trace.gpus.astype(np.int64), trace.tenant.astype(np.int64), names, lo, hi)


def derive_quotas(sizes: Mapping[str, float], capacity_gpus: int,
                  guaranteed_fraction: float = GUARANTEED_FRACTION) -> list[TenantQuota]:
    """Quotas from tenants' sizes (GPUs): guarantee ``floor(C × share × fraction)``, burst C (no limit in
    effect), weight the share. Tenants of size 0 get none (they have no jobs)."""
    if not 0 <= guaranteed_fraction <= 1:
        raise QuotaSimulationError(f"guaranteed fraction {guaranteed_fraction}: give a fraction from 0 to 1")
    total = sum(v for v in sizes.values() if v > 0)
    out = []
    for name, size in sorted(sizes.items()):
        if size <= 0:
            continue
        share = size / total
        out.append(TenantQuota(tenant=name, guaranteed_gpus=math.floor(capacity_gpus * share * guaranteed_fraction
                                                                       + 1e-9),
                               burst_gpus=capacity_gpus, fair_share_weight=share))
    return out


def site_spec(nodes: int, quotas: Sequence[TenantQuota], policy: FairSharePolicy) -> SiteSpec:
    """The one site (its place is a placeholder: nothing here depends on where it is)."""
    return SiteSpec(name="cluster", region="onprem:cluster", grid_zone="US-MIDA-PJM", timezone="UTC",
                    latitude=0.0, longitude=0.0,
                    gpus=[NodeGroup(model=MODEL, gpus_per_node=GPUS_PER_NODE, nodes=nodes)],
                    quotas=list(quotas), fair_share=policy)


def policy_for(mode: str, *, window_h: float = 24.0, half_life_h: float = 6.0, reweight_h: float = 1.0,
               k: float = 1.0, min_run_s: float = DEFAULT_MIN_RUN_S) -> FairSharePolicy:
    if mode not in MODES:
        raise QuotaSimulationError(f"unknown mode {mode!r}; modes are: {', '.join(MODES)}")
    return FairSharePolicy(mode="off" if mode == "fifo" else mode, window_h=window_h, half_life_h=half_life_h,
                           reweight_h=reweight_h, k=k, min_run_s=min_run_s)


@dataclass
class Replay:
    """One mode's replay: per job its first start and finish (seconds, the workload's clock), and counts."""

    mode: str
    capacity_gpus: int
    first_start_s: np.ndarray
    end_s: np.ndarray
    busy_gpu_s: float = 0.0  # inside the window
    preemptions: int = 0
    restarts: int = 0
    preempted_gpu_s: float = 0.0
    peak_gpus: int = 0
    cycles: int = 0
    wall_s: float = 0.0
    dropped: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


def replay(w: QuotaWorkload, spec: SiteSpec, mode: str, *, max_refusals: int = DEFAULT_MAX_REFUSALS,
           cycle_s: float = DEFAULT_CYCLE_S, starvation_h: float = DEFAULT_STARVATION_H) -> Replay:
    """Replay every job of ``w`` at the site ``spec`` (its quotas and fair-share policy) until all finished.
    ``mode`` only labels the result. Jobs must fit the site (see :func:`compare`, which drops the others).
    ``starvation_h``: the starvation guard's threshold, hours (0: no guard; module docstring)."""
    if max_refusals < 1:
        raise QuotaSimulationError(f"max refusals {max_refusals}: give 1 or more")
    if not starvation_h >= 0:
        raise QuotaSimulationError(f"starvation threshold {starvation_h} h: give 0 (no guard) or more hours")
    starvation_s = starvation_h * 3600.0
    began = time.perf_counter()
    capacity = sum(spec.total_gpus().values())
    if len(w) and int(w.gpus.max()) > capacity:
        raise QuotaSimulationError(f"a job asks for {int(w.gpus.max())} GPUs; the site has {capacity}")
    adm = SiteAdmission(spec)
    n = len(w)
    names = w.tenant_names
    ids = [f"j{i}" for i in range(n)]
    index = {job_id: i for i, job_id in enumerate(ids)}
    tenant = w.tenant.tolist()
    gpus = w.gpus.tolist()
    submit = w.submit_s.tolist()
    remaining = w.run_s.tolist()
    first = [math.nan] * n
    end = [math.nan] * n
    began_at = [0.0] * n  # start of the running attempt
    queued_at = list(submit)  # when the job last joined the queue: submit, or its last preemption
    attempt = [0] * n
    preempted = [False] * n
    specs: list[JobSpec | None] = [None] * n
    asks: list[Ask | None] = [None] * n
    demand = {name: 0.0 for name in names}  # GPUs each tenant runs plus waits for
    out = Replay(mode, capacity, np.empty(0), np.empty(0))
    lo, hi = w.window_lo_s, w.window_hi_s
    held = 0
    pending: list[tuple[float, int]] = []  # (submit, index): arrival order, preempted jobs at their place
    events: list[tuple[float, int, int, int]] = [(s, _ARRIVE, i, 0) for i, s in enumerate(submit)]
    heapq.heapify(events)
    ticking = False  # a tick is scheduled

    def busy(i: int, t: float) -> None:
        out.busy_gpu_s += gpus[i] * (min(max(t, lo), hi) - min(max(began_at[i], lo), hi))

    def cycle(now: float) -> None:
        nonlocal held
        out.cycles += 1
        ordered = adm.order([asks[i] for _, i in pending], now)
        refusals = 0
        started: set[int] = set()
        back: list[int] = []
        smallest_refused: dict[str, float] = {}  # per tenant, in this cycle
        starving = next((a.job_id for a in ordered if now - queued_at[index[a.job_id]] >= starvation_s),
                        None) if starvation_s > 0 else None
        reserved = 0  # GPUs kept free for the starving job once it was refused this cycle
        for ask in ordered:
            i = index[ask.job_id]
            if ask.gpus >= smallest_refused.get(ask.tenant, math.inf):
                if ask.job_id == starving:
                    reserved = gpus[i]
                continue
            verdict = adm.admit(ask.job_id, specs[i], now, demand=demand)
            if reserved and not isinstance(verdict, Refused):
                freed = sum(gpus[index[v]] for v in verdict.victims)
                if capacity - held + freed - gpus[i] < reserved:
                    verdict = Refused("held back for a starving job")
            if isinstance(verdict, Refused):
                if ask.job_id == starving:
                    reserved = gpus[i]
                smallest_refused[ask.tenant] = ask.gpus
                refusals += 1
                if refusals >= max_refusals:
                    break
                continue
            for victim in verdict.victims:
                v = index[victim]
                adm.stop(victim, now)
                done = now - began_at[v]
                busy(v, now)
                remaining[v] = max(remaining[v] - done, 0.0)
                attempt[v] += 1
                out.preemptions += 1
                out.preempted_gpu_s += gpus[v] * done
                preempted[v] = True
                queued_at[v] = now
                held -= gpus[v]
                back.append(v)
            adm.start(ask.job_id, verdict, now)
            held += gpus[i]
            if held > capacity:
                raise AssertionError(f"{held} GPUs held at {now} s on a site of {capacity}")
            out.peak_gpus = max(out.peak_gpus, held)
            started.add(i)
            began_at[i] = now
            if math.isnan(first[i]):
                first[i] = now
            heapq.heappush(events, (now + remaining[i], _COMPLETE, i, attempt[i]))
        if started:
            pending[:] = [p for p in pending if p[1] not in started]
        for v in back:
            bisect.insort(pending, (submit[v], v))

    while events:
        now = events[0][0]
        while events and events[0][0] <= now:
            _, kind, i, a = heapq.heappop(events)
            if kind == _COMPLETE:
                if a != attempt[i]:
                    continue  # a completion of an attempt that was preempted
                adm.stop(ids[i], now)
                busy(i, now)
                held -= gpus[i]
                end[i] = now
                demand[names[tenant[i]]] -= gpus[i]
            elif kind == _ARRIVE:
                specs[i] = JobSpec(tenant=names[tenant[i]], name=ids[i], gpus=GpuRequest(count=gpus[i]),
                                   duration_s=min(max(remaining[i], 1.0), _MAX_DURATION_S),
                                   preemptible=True, checkpointable=True)
                asks[i] = Ask.of(ids[i], specs[i], MODEL)
                pending.append((submit[i], i))
                demand[names[tenant[i]]] += gpus[i]
            else:
                ticking = False
        if pending:
            cycle(now)
        if pending and not ticking:
            ticking = True
            heapq.heappush(events, ((math.floor(now / cycle_s) + 1) * cycle_s, _TICK, -1, 0))
    out.first_start_s = np.asarray(first)
    out.end_s = np.asarray(end)
    out.restarts = sum(preempted)
    out.wall_s = time.perf_counter() - began
    return out


# --- metrics ------------------------------------------------------------------------------------------


def metrics(r: Replay, w: QuotaWorkload) -> dict[str, Any]:
    """The figures of one replay (definitions in the module docstring)."""
    if len(w) == 0:
        raise QuotaSimulationError("no job to measure: every job was dropped")
    wait = r.first_start_s - w.submit_s
    slowdown = np.maximum(1.0, (r.end_s - w.submit_s) / np.maximum(w.run_s, SLOWDOWN_FLOOR_S))
    counts = np.bincount(w.tenant, minlength=len(w.tenant_names))
    sums = np.bincount(w.tenant, weights=slowdown, minlength=len(w.tenant_names))
    has = counts > 0
    per_tenant = sums[has] / counts[has]
    return {
        "jobs": len(w),
        "capacity_gpus": r.capacity_gpus,
        "utilisation": r.busy_gpu_s / (r.capacity_gpus * w.window_s),
        "wait_mean_s": float(wait.mean()),
        "wait_p95_s": float(np.percentile(wait, 95)),
        "slowdown_mean": float(slowdown.mean()),
        "jain": jain(per_tenant),
        "slowdown_by_tenant": {n: float(x) for n, x in zip(np.asarray(w.tenant_names)[has].tolist(), per_tenant,
                                                            strict=True)},
        "preemptions": r.preemptions,
        "restarts": r.restarts,
        "preempted_gpu_h": r.preempted_gpu_s / 3600,
        "dropped": r.dropped,
        "peak_gpus": r.peak_gpus,
        "cycles": r.cycles,
        "wall_s": r.wall_s,
    }


def jain(x: Sequence[float] | np.ndarray) -> float:
    """Jain's fairness index of ``x``: (sum x)^2 / (n × sum x^2); 1 for no values."""
    a = np.asarray(x, dtype=np.float64)
    return float(a.sum() ** 2 / (a.size * (a**2).sum())) if a.size else 1.0


# --- the experiment -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuotaExperiment:
    """Everything a comparison was given: the site's size, the quotas derived, the policy's settings."""

    nodes: int
    capacity_gpus: int
    utilisation: float
    quotas: list[TenantQuota]
    dropped: int
    settings: dict[str, float]


def compare(w: QuotaWorkload, modes: Sequence[str] = ("off", "instant", "time"), *,
            utilisation: float = DEFAULT_UTILISATION, guaranteed_fraction: float = GUARANTEED_FRACTION,
            window_h: float = 24.0, half_life_h: float = 6.0, reweight_h: float = 1.0, k: float = 1.0,
            min_run_s: float = DEFAULT_MIN_RUN_S, max_refusals: int = DEFAULT_MAX_REFUSALS,
            cycle_s: float = DEFAULT_CYCLE_S, starvation_h: float = DEFAULT_STARVATION_H,
            nodes: int | None = None) -> tuple[QuotaExperiment, list[Replay]]:
    """Size the site (or take ``nodes``), derive the quotas, drop jobs larger than the site, replay each mode."""
    for m in modes:
        policy_for(m)  # unknown modes fail before any work
    if nodes is None:
        nodes = size_sites(w.mean_gpus_busy(), 1, utilisation, GPUS_PER_NODE)
    capacity = nodes * GPUS_PER_NODE
    fits = w.gpus <= capacity
    dropped = int((~fits).sum())
    kept = w.subset(fits)
    quotas = derive_quotas(kept.sizes(), capacity, guaranteed_fraction)
    settings = {"window_h": window_h, "half_life_h": half_life_h, "reweight_h": reweight_h, "k": k,
                "min_run_s": min_run_s, "guaranteed_fraction": guaranteed_fraction,
                "max_refusals": max_refusals, "cycle_s": cycle_s, "starvation_h": starvation_h}
    runs = []
    for m in modes:
        policy = policy_for(m, window_h=window_h, half_life_h=half_life_h, reweight_h=reweight_h, k=k,
                            min_run_s=min_run_s)
        r = replay(kept, site_spec(nodes, [] if m == "fifo" else quotas, policy), m, max_refusals=max_refusals,
                   cycle_s=cycle_s, starvation_h=starvation_h)
        r.dropped = dropped
        r.metrics = metrics(r, kept)
        runs.append(r)
    info = QuotaExperiment(nodes, capacity, kept.mean_gpus_busy() / capacity, quotas, dropped, settings)
    return info, runs


def format_table(info: QuotaExperiment, runs: Sequence[Replay]) -> str:
    """One row per mode, then one line on the site and the quotas."""
    head = ("mode", "util %", "wait mean h", "wait p95 h", "slowdown", "Jain", "preempt", "restarts",
            "preempted GPU-h", "dropped", "wall s")
    rows = [head]
    for r in runs:
        m = r.metrics
        rows.append((r.mode, f"{100 * m['utilisation']:.1f}", f"{m['wait_mean_s'] / 3600:.2f}",
                     f"{m['wait_p95_s'] / 3600:.2f}", f"{m['slowdown_mean']:.2f}", f"{m['jain']:.3f}",
                     str(m["preemptions"]), str(m["restarts"]), f"{m['preempted_gpu_h']:.0f}", str(m["dropped"]),
                     f"{m['wall_s']:.0f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(widths[c]) if c == 0 else cell.rjust(widths[c]) for c, cell in enumerate(row))
             for row in rows]
    guaranteed = sum(q.guaranteed_gpus for q in info.quotas)
    lines.append(f"site: {info.nodes} nodes x {GPUS_PER_NODE} {MODEL} = {info.capacity_gpus} GPUs, mean demand "
                 f"{100 * info.utilisation:.1f} % of it; {len(info.quotas)} tenants, {guaranteed} GPUs guaranteed; "
                 f"{info.dropped} jobs larger than the site dropped")
    return "\n".join(lines)


def as_json(info: QuotaExperiment, runs: Sequence[Replay]) -> dict[str, Any]:
    return {
        "site": {"nodes": info.nodes, "gpus_per_node": GPUS_PER_NODE, "model": MODEL,
                 "capacity_gpus": info.capacity_gpus, "mean_demand_fraction": info.utilisation},
        "quotas": [q.model_dump() for q in info.quotas],
        "settings": info.settings,
        "dropped": info.dropped,
        "modes": {r.mode: r.metrics for r in runs},
    }
