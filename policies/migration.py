"""Moving running work: which checkpointable jobs to stop, checkpoint and restart at another site, because the
rest of their run there is forecast to emit (or cost) enough less to pay for the move.

Why
    A job is placed with what was free when it started. In a burst the clean sites are full and the
    overflow starts where the grid is dirty; when the burst ends, clean capacity may stand idle while long
    jobs run on at the dirty sites for days (on the Philly replay it seldom does, and moving for a saving
    bought at most 1 %: README, Evidence). Making room for latency-bound work pays more. A training job that can checkpoint and resume (``JobSpec.checkpointable``;
    the schedulers that replay this kind of trace, Gandiva, Tiresias and Pollux, assume every training job
    can) can be stopped and restarted where the rest of its run is cleaner. This is how a whole-job schedule
    gets closer to the fluid bound, which may split a job over sites and hours.

What a move must clear (all of them, for the job's *expected* remaining run: its estimate less the work it
has done; a job that has run past its estimate is not moved, since how much is left is unknown)
    - the job is checkpointable, holds whole GPUs, and is expected to run at least ``min_remaining_s`` more;
    - its deadline still holds with the move: ``now + overhead_s + duration_safety × remaining <= deadline``;
    - the target site passes every filter of the profile's pipeline for the job (health, cordon, regions,
      latency objective, quotas, a GPU model that fits *now*) and has room in the time-shift plan for the
      whole remaining run (hours promised to deferred jobs stay theirs);
    - the objective of the rest of the run at the target, *including* ``overhead_s`` of GPU time spent to
      save, copy and restore the checkpoint there, is at least ``min_saving`` (a fraction) and
      ``min_saving_abs`` (kg CO2e or USD) below the rest of the run where it is.
    Carbon: GPUs × the model's board power × the forecast intensity integrated over the run window, judged
    over the part of the rest of the run that the forecast's model covers
    (``Snapshot.carbon_forecast_model_h``: 48 hours, less the part of this hour gone; not the zone's mean day
    the rows go on with past it), and a long job that is still better off elsewhere in two days may move
    again then. Cost: GPUs × price per GPU-hour × hours.

Making room (``make_room``)
    A job with a latency objective can run only at the few sites near its users. When they are full of work
    that could run anywhere and the job's latest start has come (``duration_safety`` × its estimate before
    its deadline, within the hour), the checkpointable jobs there are moved out to the site the profile
    would choose for the rest of their run, until the job fits: at the site and model that take the fewest
    moves, and of those the cleanest (or cheapest) for the job; one job that covers the shortfall if there
    is one (the smallest such), else the largest first. Each moved job must clear the same checks as above,
    except the saving: it may pay a little more carbon or money so that the other job meets its
    deadline. A job in the way that no other site has room for may instead be stopped and put back in the
    queue from its checkpoint (``suspend``), if its deadline leaves it its remaining run and the overhead,
    ``duration_safety`` times over, and as long again to wait (``site`` -1 in the :class:`Move`). Nothing is
    moved unless the job then fits.

Pausing (``pause``; carbon only)
    Moving chases a cleaner *site*; a pause waits for a cleaner *hour* where the job runs, as a checkpointable
    job that runs only in the cleanest hours its deadline leaves it ("Let's Wait Awhile", Wiesner et al.,
    Middleware 2021, on interruptible workloads). At each whole hour, a job that could move at all (above),
    does not ask to start at once, and has a deadline, is judged on its own site's forecast rows up to its
    deadline: it needs ``duration_safety`` × its expected remaining run, plus the restart, in whole hours, and
    the ``need``-th cleanest of those hours is its bar. When the current hour is above the bar and a later one
    is not, stopping now puts off the work of the hours until then; the pause is made when that work's
    forecast, as dirty as it is now, beats the same work and the restart at the bar by ``min_saving`` and
    ``min_saving_abs`` -- and the time-shift search, asked for the rest of the run with no start before that
    hour (``JobRequest.not_before_ts``), plans a start with room at some site before its latest start (the
    deadline less ``duration_safety`` × the rest), which keeps the deadline as any deferral does, and that
    start (its site, model and hour) is forecast to save as much against running the rest on where it is. The
    job goes back to the queue from its checkpoint (a :class:`Move` to ``site`` -1 with ``resume_at`` and
    ``not_before_ts``); until that hour the search only plans its later starts (where none has room that its
    deadline allows, it is decided as if not paused), and after it the job is decided as any deferred one,
    hour by hour. A long job is paused again at each dirty stretch: each pause must pay for its own restart.
    The bar reads the forecast's rows as far as they go (the model's 48 hours, then the zone's mean day), so a
    job needing more hours than the rows hold, or whose deadline leaves no hour to spare, runs on.

Order: the jobs that could save the most (against the best site for them anywhere) are decided first, so
they get the clean capacity; each move is debited from the snapshot at once (the source's GPUs freed, the
target's taken, the plan's hours moved), so later moves see it.

Who acts on it: the simulator (``broker.simulation.engine``) and the live scheduling cycle
(``broker.cycle``, which asks a job's site to checkpoint and stop it, and holds the GPUs the move counted
on until the job restarts) call the same functions.

Units: seconds, POSIX seconds, kg CO2e or USD. Pure: a function of the snapshot and the running jobs handed
in; no clock, no I/O. How to turn it off: a profile without ``migrate`` (the default) never moves a job, one
with ``pause: false`` never pauses one, and a job that is not checkpointable is never moved or paused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies import _shift_search as _search
from policies import timeshift
from policies._scores import window_mean_rows
from policies.snapshot import TDP_KW, JobRequest, Snapshot
from policies.scorers._usable import usable_models
from policies.timeshift import ShiftPolicy, held_back_for

if TYPE_CHECKING:
    from policies.pipeline import Pipeline, Placement

HOUR_S = 3600.0


class MigrationPolicy(BaseModel):
    """How a profile moves running checkpointable jobs (``migrate:`` in a profile)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: Literal["carbon", "cost"] = Field(default="carbon", description="what a move must save")
    min_saving: float = Field(default=0.2, ge=0.0, lt=1.0,
                              description="move only when the rest of the run saves at least this fraction, "
                                          "the move's overhead counted")
    min_saving_abs: float = Field(default=1.0, ge=0.0,
                                  description="and at least this much, in the objective's unit (kg CO2e or USD)")
    overhead_s: float = Field(default=600.0, ge=0.0, le=86400.0,
                              description="GPU seconds a move is assumed to cost at the target: save, copy and "
                                          "restore the checkpoint, warm up")
    min_remaining_s: float = Field(default=2 * HOUR_S, ge=0.0, le=366 * 24 * HOUR_S,
                                   description="a job expected to end sooner than this stays where it is (at most "
                                               "366 days, the longest a job may say it runs)")
    duration_safety: float = Field(default=1.5, ge=1.0, le=100.0,
                                   description="a move keeps this many times the expected remaining run (plus the "
                                               "overhead) before the deadline")
    make_room: bool = Field(default=True, description="move checkpointable jobs out of the sites near the users of "
                                                      "a job with a latency objective that can wait no longer")
    suspend: bool = Field(default=True, description="when making room, a job in the way that no other site has room "
                                                    "for may go back to the queue from its checkpoint, if its deadline "
                                                    "leaves it as long again to wait")
    pause: bool = Field(default=False, description="stop a job whose rest of run would emit min_saving and "
                                                   "min_saving_abs less from a later start than where it runs, and put "
                                                   "it back in the queue from its checkpoint, where the profile's "
                                                   "time-shift search defers it to that start (its deadline kept as a "
                                                   "deferral keeps it); needs the profile's shift and the carbon "
                                                   "objective")


@dataclass(frozen=True, slots=True)
class Running:
    """A running job as the broker knows it: its request (``duration_s`` the estimate of the whole run), where
    it runs, and how many seconds of work it has done (time since its latest start, less a restart's
    overhead, plus what earlier attempts kept through their checkpoints)."""

    request: JobRequest
    site: int
    model: int
    done_s: float


@dataclass(frozen=True, slots=True)
class Move:
    """Stop ``running`` where it is and restart it from its checkpoint on ``site``/``model`` now."""

    running: Running
    site: int
    model: int
    remaining_s: float  # the expected remaining run (estimate less work done), without the overhead
    value_stay: float  # objective of the judged part of the rest of the run where it is
    value_move: float  # the same at the target, the overhead included
    objective: str
    for_job: str | None = None  # the job it made room for (make_room), else None: moved for a saving
    judged_s: float = math.nan  # how much of the rest of the run the values cover (the forecast's reach)
    # Paused (site -1, for_job None): where the search plans its rest and from when, the hour it may restart
    # from (POSIX s), and the intensity (g/kWh) an hour must be under for it to run then
    resume_site: int = -1
    resume_at: datetime | None = None
    not_before_ts: float | None = None
    clean_bar: float = math.nan

    def reason(self, sites: tuple[str, ...]) -> str:
        unit = "kg CO2e" if self.objective == "carbon" else "USD"
        span = (f"the rest of its run (~{self.remaining_s / HOUR_S:.1f} h)"
                if not self.judged_s < self.remaining_s else
                f"the next {self.judged_s / HOUR_S:.1f} h of the ~{self.remaining_s / HOUR_S:.1f} h left of its run")
        if self.site < 0 and self.for_job is None:
            saving = 1.0 - self.value_move / self.value_stay if self.value_stay > 0 else 0.0
            until = (f" until {datetime.fromtimestamp(self.not_before_ts, tz=UTC):%Y-%m-%dT%H:%MZ}"
                     if self.not_before_ts is not None else "")
            plan = ""
            if self.resume_at is not None and self.resume_site >= 0:
                plan = f"; planned to resume on {sites[self.resume_site]} from {self.resume_at:%Y-%m-%dT%H:%MZ}"
            return (f"paused on {sites[self.running.site]}{until} and requeued from its checkpoint: the next "
                    f"{self.judged_s / HOUR_S:.1f} h there are forecast above {self.clean_bar:.0f} g/kWh, the "
                    f"cleanest hours its deadline leaves for the ~{self.remaining_s / HOUR_S:.1f} h left of its run "
                    f"are at or below it, and running that work then, restart included, is forecast at "
                    f"{self.value_move:.3g} {unit} against {self.value_stay:.3g} {unit} now ({saving:.0%} less)"
                    + plan)
        if self.site < 0:
            return (f"stopped on {sites[self.running.site]} and requeued from its checkpoint to make room for "
                    f"{self.for_job}, which must run near its users and can wait no longer; no other site has room "
                    f"for the ~{self.remaining_s / HOUR_S:.1f} h left of its run, and its deadline leaves time to wait")
        if self.for_job is not None:
            return (f"moved from {sites[self.running.site]} to {sites[self.site]} from its checkpoint to make room "
                    f"for {self.for_job}, which must run near its users and can wait no longer ({self.objective} "
                    f"forecast for {span}: {self.value_move:.3g} {unit} there, restart included, against "
                    f"{self.value_stay:.3g} {unit} where it ran)")
        saving = 1.0 - self.value_move / self.value_stay if self.value_stay > 0 else 0.0
        return (f"moved from {sites[self.running.site]} to {sites[self.site]} from its checkpoint because "
                f"{self.objective} forecast for {span} is {self.value_move:.3g} {unit} there, restart included, "
                f"against {self.value_stay:.3g} {unit} where it runs ({saving:.0%} less)")


def movable(run: Running, now_ts: float, policy: MigrationPolicy) -> float | None:
    """The expected remaining run (seconds) of a job the policy may move at all, else None."""
    req = run.request
    if not req.checkpointable or req.fractional or req.mig_profile is not None:
        return None
    remaining = req.duration_s - run.done_s
    if remaining < max(policy.min_remaining_s, 1.0):
        return None
    if req.deadline_ts is not None and now_ts + policy.overhead_s + policy.duration_safety * remaining > req.deadline_ts:
        return None
    return remaining


def _judged_h(snap: Snapshot, objective: str, into_h: float, rem_h: float) -> float:
    """Hours of the rest of a run that a move is judged over: as far as the zone's forecast model reaches
    (carbon; not the mean day past it), all of it (cost: prices do not change with the hour)."""
    if objective != "carbon" or not snap.carbon_forecast.shape[1]:
        return rem_h
    reach = snap.carbon_forecast.shape[1]
    if 0 < snap.carbon_forecast_model_h < reach:
        reach = snap.carbon_forecast_model_h
    return min(rem_h, max(reach - into_h, 1.0))


def _rates(snap: Snapshot, objective: str, into_h: float, hours: float) -> np.ndarray | None:
    """Per site and model: the objective of one GPU over ``hours`` from ``into_h`` into the current hour (NaN
    where unknown); None when the snapshot has no forecast for a carbon objective."""
    if objective == "carbon":
        forecast, cum = snap.carbon_forecast, snap.carbon_forecast_cum
        if forecast.shape[0] != snap.n_sites or not forecast.shape[1]:
            return None
        mean = window_mean_rows(forecast, cum, into_h, hours)
        return mean[:, None] * TDP_KW[None, :] * hours / 1000.0
    return np.asarray(snap.usd_per_gpu_hour, dtype=np.float64) * hours


class _Clock:
    """Where in the current hour a decision is: the plan's hour 0 is the hour containing ``now``."""

    __slots__ = ("now_ts", "into_h")

    def __init__(self, snap: Snapshot) -> None:
        self.now_ts = snap.now.timestamp()
        self.into_h = (self.now_ts - math.floor(self.now_ts / HOUR_S) * HOUR_S) / HOUR_S


def _values(snap: Snapshot, policy: MigrationPolicy, at: _Clock, remaining: float
            ) -> tuple[float, np.ndarray, np.ndarray] | None:
    """(hours judged, per site and model the objective of one GPU staying over them, and of one GPU moving:
    the overhead and then the same hours); None without a forecast for a carbon objective."""
    judged_h = _judged_h(snap, policy.objective, at.into_h, remaining / HOUR_S)
    stay = _rates(snap, policy.objective, at.into_h, judged_h)
    move = _rates(snap, policy.objective, at.into_h, judged_h + policy.overhead_s / HOUR_S)
    return None if stay is None or move is None else (judged_h, stay, move)


def rest_of(run: Running, remaining: float, policy: MigrationPolicy) -> JobRequest:
    """The request of the rest of a moving job's run: its expected remaining run plus the overhead."""
    whole = run.request.estimate_s if run.request.estimate_s is not None else run.request.duration_s
    return replace(run.request, duration_s=remaining + policy.overhead_s, estimate_s=whole)


def _has_room(snap: Snapshot, site: int, model: int, rest: JobRequest, at: _Clock,
              shift: ShiftPolicy | None) -> bool:
    """Whether the plan leaves room at ``site``/``model`` for the whole of ``rest`` from now (hours promised
    to deferred jobs and to the expected runs of running ones stay theirs, and a job without a latency
    objective leaves the room kept for those with one: policies.latency_reserve)."""
    if not snap.plan_free.size:
        return True
    hours = min(max(int(math.ceil(at.into_h + rest.duration_s / HOUR_S - 1e-9)), 1), snap.plan_free.shape[2])
    kept, near = held_back_for(rest, snap, shift)
    return bool(_search.room_now(snap.plan_free, site, model, 0, hours, rest.charge,
                                 np.zeros(snap.n_sites, dtype=np.float32), kept, near))


def fits_rest(snap: Snapshot, site: int, model: int, rest: JobRequest, shift: ShiftPolicy | None) -> bool:
    """Whether ``site``/``model`` still has room now and in the plan for ``rest`` (a moved job's rest of run,
    the overhead included), as a move checks it: where the live cycle restarts a moved job."""
    return bool(snap.free_gpus[site, model] >= rest.count) and _has_room(snap, site, model, rest, _Clock(snap), shift)


def _debit(snap: Snapshot, run: Running, rest: JobRequest | None, site: int, model: int) -> None:
    """Move ``run`` in ``snap``: its GPUs back where it ran (now and in the plan's hours of its expected run),
    the rest of its run taken at ``site``/``model`` (``rest`` None: nowhere, it goes back to the queue)."""
    req = run.request
    snap.release(run.site, replace(req, duration_s=max(req.duration_s - run.done_s, 0.0)), run.model)
    if rest is not None:
        snap.assume(site, rest, model, placed_now=False)


def plan_moves(pipeline: Pipeline, snap: Snapshot, running: Sequence[Running], policy: MigrationPolicy) -> list[Move]:
    """The moves to make now, in the order made; each is already debited from ``snap`` (free GPUs, the plan)."""
    from policies.filters.gpu_fit import fit_matrix
    from policies.pipeline import choose_model  # imported here: policies.pipeline imports this module

    at = _Clock(snap)
    candidates: list[tuple[float, int, float, float, float, np.ndarray, np.ndarray]] = []
    for i, run in enumerate(running):
        remaining = movable(run, at.now_ts, policy)
        if remaining is None:
            continue
        values = _values(snap, policy, at, remaining)
        if values is None:
            return []
        judged_h, stay_rates, move_rates = values
        g = run.request.charge
        stay = float(stay_rates[run.site, run.model]) * g
        usable = usable_models(run.request, snap) & (snap.total_gpus >= run.request.count)
        floor = float(np.nanmin(np.where(usable, move_rates, np.nan))) * g if usable.any() else math.nan
        if stay == stay and floor == floor and stay - floor >= max(policy.min_saving * stay, policy.min_saving_abs):
            candidates.append((floor - stay, i, remaining, stay, judged_h, move_rates, usable))
    candidates.sort(key=lambda c: c[:2])  # the most to save first
    moves: list[Move] = []
    for _, i, remaining, stay, judged_h, move_rates, usable in candidates:
        run = running[i]
        rest = rest_of(run, remaining, policy)
        placement = _decide_moving(pipeline, snap, rest)
        bar = stay - max(policy.min_saving * stay, policy.min_saving_abs)
        # The least value at each feasible site over the models the job could use there and would fit now
        # (free, or GPUs the site would preempt for it) bounds the value of the model it would get
        # (choose_model's pick is one of them): sites are tried from the lowest bound
        # up, and the search stops where no site left can beat (or tie with a lower index) the best found.
        # The same site as trying them all in order: the least value that clears the bar and has room, the
        # first site by index among equals.
        sites = placement.feasible[placement.feasible != run.site]
        fits_now = usable[sites] & fit_matrix(rest, snap)[sites]  # choose_model picks one of these
        lower = np.fmin.reduce(np.where(fits_now, move_rates[sites], np.nan), axis=1) * rest.charge
        clears = lower <= bar  # NaN: no usable model with a value
        sites, lower = sites[clears], lower[clears]
        # Rooms the plan has for the rest at no usable model, before any reserve, fail _has_room at any.
        hours = (min(max(int(math.ceil(at.into_h + rest.duration_s / HOUR_S - 1e-9)), 1), snap.plan_free.shape[2])
                 if snap.plan_free.size else 0)
        bar32 = np.float32(np.float32(np.float32(rest.charge) + np.float32(0.0)) - _search.EPS32)
        best: tuple[float, int, int] | None = None
        for k in np.lexsort((sites, lower)).tolist():
            site, bound = int(sites[k]), float(lower[k])
            if best is not None and (bound > best[0] or (bound == best[0] and site > best[1])):
                if bound > best[0]:
                    break
                continue
            if hours and not ((snap.plan_free[site, :, :hours] >= bar32).all(axis=1) & usable[site]).any():
                continue  # no model it could use has room in every hour of the rest, before any reserve
            model = choose_model(rest, snap, site)
            value = float(move_rates[site, model]) * rest.charge
            if (value <= bar and (best is None or value < best[0] or (value == best[0] and site < best[1]))
                    and _has_room(snap, site, model, rest, at, pipeline.shift)):
                best = (value, site, model)
        if best is not None:
            value, site, model = best
            _debit(snap, run, rest, site, model)
            moves.append(Move(run, site, model, remaining, stay, value, policy.objective, judged_s=judged_h * HOUR_S))
    if policy.pause and pipeline.shift is not None:
        moved = {m.running.request.job_id for m in moves}
        moves += _plan_pauses(pipeline, snap, [r for r in running if r.request.job_id not in moved], policy, at)
    return moves


def _plan_pauses(pipeline: Pipeline, snap: Snapshot, running: Sequence[Running], policy: MigrationPolicy,
                 at: _Clock) -> list[Move]:
    """``pause``: the running jobs to stop now and put back in the queue until the grid where they run is
    clean again (see the module docstring, *Pausing*). Each pause is debited from ``snap``: the job's GPUs
    freed, the hours of its planned restart taken, so later decisions see them. The most to save first."""
    shift = pipeline.shift
    assert shift is not None
    if not snap.plan_free.size or policy.objective != "carbon":
        return []
    forecast, cum, known = snap.derived(("shift-forecast",), timeshift._forecast, snap)
    if forecast.shape[0] != snap.n_sites or forecast.shape[1] < 2:
        return []
    hour0 = math.floor(at.now_ts / HOUR_S) * HOUR_S
    overhead_h = policy.overhead_s / HOUR_S
    candidates: list[tuple[float, int, float, float, float, int, float]] = []
    for i, run in enumerate(running):
        req = run.request
        remaining = movable(run, at.now_ts, policy)
        if remaining is None or not req.deferrable or req.deadline_ts is None or not known[run.site]:
            continue
        # The hours the rest of its run needs (duration_safety times over, and the restart), and the hours its
        # deadline leaves, as far as the forecast reaches; the need-th cleanest of them is the bar an hour
        # worth running in must be under.
        need = int(math.ceil(policy.duration_safety * remaining / HOUR_S + overhead_h - 1e-9))
        window = min(int((req.deadline_ts - hour0) // HOUR_S), forecast.shape[1])
        if window <= need:
            continue  # no hour to spare
        row = forecast[run.site, :window]
        bar = float(np.partition(row, need - 1)[need - 1])
        if not row[0] > bar:
            continue  # this hour is among the cleanest its deadline leaves: it runs on
        later = np.flatnonzero(row[1:] <= bar)
        if not later.size:
            continue
        k = int(later[0]) + 1  # the first whole hour clean enough to run in again
        postponed_h = min(k - at.into_h, remaining / HOUR_S)  # work the pause puts off
        dirty = _run_kg(forecast, cum, run.site, run.model, req.charge, at.into_h, postponed_h)
        clean = float(TDP_KW[run.model]) * req.charge / 1000.0 * (postponed_h + overhead_h) * bar  # (the restart too)
        if dirty - clean >= max(policy.min_saving * dirty, policy.min_saving_abs):
            candidates.append((clean - dirty, i, remaining, dirty, clean, k, bar))
    candidates.sort(key=lambda c: c[:2])
    pauses: list[Move] = []
    for _, i, remaining, dirty, clean, k, bar in candidates:
        run = running[i]
        here = replace(run.request, duration_s=remaining)
        snap.release(run.site, here, run.model)  # as if it stopped: its rest may restart where it was
        until = hour0 + k * HOUR_S
        rest = replace(rest_of(run, remaining, policy), not_before_ts=until)
        outcome = None
        if timeshift.shiftable(rest, snap, shift):
            outcome = _with_own_room(snap, rest, lambda: timeshift.plan(
                rest, snap, pipeline.decide(rest, snap), shift, pipeline.filter_codes))
        if (not isinstance(outcome, timeshift.Deferral) or outcome.start.timestamp() < until
                or not _pause_pays(outcome, run, remaining, rest, policy, cum, forecast, at)):
            # no room after the dirty hours that its deadline allows (the search then plans it as if not paused,
            # maybe sooner: no pause), or none that saves on running on
            snap.hold(run.site, here, run.model)
            continue
        timeshift.debit(snap, outcome.site, outcome.model, rest.charge, outcome.slot, outcome.slot + outcome.slots,
                        near=rest.latency_slo_ms is not None)
        pauses.append(Move(run, -1, -1, remaining, dirty, clean, policy.objective, judged_s=(k - at.into_h) * HOUR_S,
                           resume_site=outcome.site, resume_at=outcome.start, not_before_ts=rest.not_before_ts,
                           clean_bar=bar))
    return pauses


def _pause_pays(planned: timeshift.Deferral, run: Running, remaining: float, rest: JobRequest,
                policy: MigrationPolicy, cum: np.ndarray, forecast: np.ndarray, at: _Clock) -> bool:
    """Whether the restart the search planned (its site, model and hour) is forecast to emit ``min_saving``
    and ``min_saving_abs`` less, restart included, than running the rest of the run on where it is (kg CO2e):
    the bar is only where the job's own site is clean enough, and that site's clean hours may be promised to
    others, leaving room only at a dirtier site or hour. (The plan's own values may be in USD: a cost shift.)"""
    stay = _run_kg(forecast, cum, run.site, run.model, run.request.charge, at.into_h, remaining / HOUR_S)
    then = _run_kg(forecast, cum, planned.site, planned.model, rest.charge, float(planned.slot),
                   rest.duration_s / HOUR_S)
    return stay - then >= max(policy.min_saving * stay, policy.min_saving_abs)


def _run_kg(forecast: np.ndarray, cum: np.ndarray, site: int, model: int, gpus: float, from_h: float,
            hours: float) -> float:
    """kg CO2e of ``gpus`` GPUs of ``model`` at ``site`` for ``hours`` from ``from_h`` hours after the start of
    the current hour, on the forecast rows the time-shift search reads (as it values a start)."""
    return timeshift._forecast_now(site, float(TDP_KW[model]), gpus, hours, from_h, forecast, cum, True, math.nan)


def _with_own_room(snap: Snapshot, rest: JobRequest, decide):  # noqa: ANN001, ANN202 - a thunk
    """``decide()`` with the GPUs the job holds given back to its tenant's federation-wide limit, as
    :func:`_decide_moving` does."""
    room = snap.tenant_room
    if room is None:
        return decide()
    room.credit(rest.tenant, rest.charge)
    try:
        return decide()
    finally:
        room.debit(rest.tenant, rest.charge)


def urgent(req: JobRequest, now_ts: float, policy: MigrationPolicy) -> bool:
    """Whether ``req`` is a job near its users that may have room made for it now: it has a latency objective
    and its latest start (``duration_safety`` × its estimate before its deadline) is within the hour."""
    return (req.latency_slo_ms is not None and req.deadline_ts is not None and not req.fractional
            and req.mig_profile is None
            and req.deadline_ts - policy.duration_safety * req.duration_s <= now_ts + HOUR_S)


def make_room(pipeline: Pipeline, snap: Snapshot, req: JobRequest, running: Sequence[Running],
              policy: MigrationPolicy) -> list[Move]:
    """The moves that make room for ``req`` (see the module docstring), already debited from ``snap`` (the
    moved jobs' GPUs freed and taken at their new sites), or [] with ``snap`` untouched."""
    from policies.filters.gpu_fit import GpuFitFilter

    at = _Clock(snap)
    placement = pipeline.decide(req, snap)
    if placement.placed:  # it fits as things stand: nothing to move
        return []
    ok = np.ones(snap.n_sites, dtype=bool)
    for code, passed in zip(pipeline.filter_codes, placement.passes, strict=True):
        if passed is not None and code != GpuFitFilter.code:
            ok &= passed
    usable = usable_models(req, snap) & (snap.total_gpus >= req.count)
    ok &= usable.any(axis=1)
    own = _rates(snap, policy.objective, at.into_h, req.duration_s / HOUR_S)
    if not ok.any() or own is None:
        return []
    # The job's own sites and models, the cleanest (or cheapest) for it first.
    options = sorted(((float(own[site, model]), site, model) for site in np.flatnonzero(ok).tolist()
                      for model in np.flatnonzero(usable[site]).tolist()))
    places = {(site, model) for _, site, model in options}
    by_place: dict[tuple[int, int], list[int]] = {}  # the running jobs at those sites and models, in order
    for i, run in enumerate(running):
        if (run.site, run.model) in places:
            by_place.setdefault((run.site, run.model), []).append(i)
    remaining = {i: movable(running[i], at.now_ts, policy) for found in by_place.values() for i in found}
    best: list[Move] | None = None
    for _, site, model in options:
        short = req.count - int(snap.free_gpus[site, model])
        here = [i for i in by_place.get((site, model), ()) if remaining[i] is not None]
        if short <= 0 or sum(running[i].request.count for i in here) < short:
            continue
        # One job that covers the shortfall, the smallest such; else the largest first (the fewest moves).
        here.sort(key=lambda i: ((0, running[i].request.count) if running[i].request.count >= short
                                 else (1, -running[i].request.count), running[i].request.job_id))
        trial = snap.working_copy(snap.now)
        moves: list[Move] = []
        for i in here:
            if short <= 0:
                break
            move = _rehome(pipeline, trial, running[i], remaining[i], at, policy, req.job_id)  # type: ignore[arg-type]
            if move is None and policy.suspend and _may_wait(running[i], remaining[i], at, policy):  # type: ignore[arg-type]
                move = Move(running[i], -1, -1, remaining[i], math.nan, math.nan, policy.objective, req.job_id)  # type: ignore[arg-type]
                _debit(trial, running[i], None, -1, -1)
            if move is not None:
                moves.append(move)
                short -= running[i].request.count
        if short <= 0 and pipeline.decide(req, trial).placed and (best is None or len(moves) < len(best)):
            best = moves
            if len(best) == 1:
                break
    if best is None:
        return []
    for move in best:  # the chosen moves, on the pass's own snapshot
        rest = rest_of(move.running, move.remaining_s, policy) if move.site >= 0 else None
        _debit(snap, move.running, rest, move.site, move.model)
    return best


def _may_wait(run: Running, remaining: float, at: _Clock, policy: MigrationPolicy) -> bool:
    """Whether a job's deadline leaves it time to go back to the queue: its rest and the overhead,
    ``duration_safety`` times over, and as long again to wait."""
    deadline = run.request.deadline_ts
    return deadline is None or (
        at.now_ts + 2 * (policy.overhead_s + policy.duration_safety * remaining) <= deadline)


def _decide_moving(pipeline: Pipeline, snap: Snapshot, rest: JobRequest) -> Placement:
    """The pipeline's decision for the rest of a running job's run elsewhere: as for a job that starts, but with the
    GPUs it holds now given back to its tenant's federation-wide limit (``Snapshot.tenant_room``) while it is
    decided, since a move hands them over rather than adding to them (the limit would turn every site away from a
    job whose tenant is at its limit)."""
    return _with_own_room(snap, rest, lambda: pipeline.decide(rest, snap))


def _rehome(pipeline: Pipeline, snap: Snapshot, run: Running, remaining: float, at: _Clock,
            policy: MigrationPolicy, for_job: str) -> Move | None:
    """Move ``run`` out of its site to the profile's best other site with room now and in the plan, debited
    from ``snap``; None when there is none."""
    from policies.pipeline import choose_model  # imported here: policies.pipeline imports this module

    rest = rest_of(run, remaining, policy)
    placement = _decide_moving(pipeline, snap, rest)
    values = _values(snap, policy, at, remaining)
    for k in np.argsort(-placement.totals, kind="stable").tolist():
        site = int(placement.feasible[k])
        if site == run.site:
            continue
        model = choose_model(rest, snap, site)
        if not _has_room(snap, site, model, rest, at, pipeline.shift):
            continue
        _debit(snap, run, rest, site, model)
        if values is None:
            return Move(run, site, model, remaining, math.nan, math.nan, policy.objective, for_job)
        judged_h, stay, move = values
        return Move(run, site, model, remaining, float(stay[run.site, run.model]) * rest.charge,
                    float(move[site, model]) * rest.charge, policy.objective, for_job, judged_s=judged_h * HOUR_S)
    return None
