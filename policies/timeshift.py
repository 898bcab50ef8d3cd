"""Time-shifting: start a flexible job later, at the site and hour that minimise its forecast carbon (or
cost), when that saves enough, planning capacity hour by hour so deferred jobs do not all pile onto the
same clean site.

Who may be deferred
    A job with a deadline that does not ask to start at once (``JobSpec.deferrable``, true by default: a
    job that sets it false, interactive work, is placed as soon as a site has room, whatever slack its
    deadline leaves, and queued by its submit time, as urgent as a job with no slack). Its *latest start*
    is ``deadline - duration_safety × duration_s`` (the submitter's estimate of its run time, inflated
    because estimates run short as often as long); a job whose latest start is before the next whole hour
    starts now (below). A deferral also
    ends ``max_wait_h`` (two weeks) after the job was submitted, however often it was deferred again, and,
    with ``max_wait_factor``, ``max_wait_factor × duration_s`` after it: a job waits in proportion to its
    own length (its slowdown stays under ``1 + max_wait_factor``), so a ten-minute job is not held for
    hours, and a wait that the deadline allows only because the estimate runs short stays short. A deferred job
    is decided again at every whole hour (its forecast has been refreshed), and at the latest start it can
    no longer be deferred: deferral never pushes a job past the point where its deadline is at risk, nor
    holds it for more than ``max_wait_h`` in all, and since the queue is taken in urgency order with aging
    (:func:`urgency_ts`), a job that waits for room is not overtaken by newer ones for long either.

The plan (:class:`Calendar`)
    Planned GPUs per site, model and whole hour: running jobs until their expected end, deferred jobs from
    their planned start for their expected run. A booking holds whole hours (a job ending at 14:20 holds
    the 14:00 hour), so the plan errs on the side of never promising a GPU twice; the current hour is the
    sites' real free capacity. A job that runs past its estimate holds its GPUs in the current hour only,
    so the plan counts on them from the next; with ``book_overruns`` the pass also knows what such jobs are
    expected to hold (``Snapshot.plan_overrun``: until the end the finished jobs that ran as long predict,
    :func:`policies.runtime_risk.expected_ratio`, worked out again as they run on: the live broker at every
    pass, the simulator at every whole hour and when an estimate runs out), and a deferral planned on it is
    planned again on what is expected free (:func:`unless_it_slips`). Each pass plans on a working copy
    (``Snapshot.plan_free``: GPUs free per site, model and hour from the hour containing ``now``) that every
    placement and every deferral of the pass debits, as ``Snapshot.assume`` debits the free capacity.

Jobs that are not deferred (:func:`start_now`)
    A job the profile may not defer (it asks to start at once, its latest start has come, or it has no
    deadline) starts now at the profile's choice. With ``keep_promises``, not where its run would take GPUs
    the plan has promised to running or deferred jobs: then at the best-scoring site whose GPUs are not
    promised, and at the profile's choice where every site's are (``Placement.over_plan``: its decision says
    it starts over the plan, and why each site was turned away). So it does not take a deferred job's
    planned start where another site can take it, and it never waits for one. Neither the headroom nor the
    room kept for latency-bound jobs is kept from it.

The search (:func:`plan`)
    Candidates are every site that passes the profile's filters other than "free now" (health, region,
    latency objective, refused, a model with enough memory and enough GPUs in total) × every start: now,
    or a whole hour up to the latest start (at most ``horizon_h`` ahead). A start is feasible where the plan
    has room for the job in every hour of its expected run (hours past the plan's end are not checked).
    Starting now, the profile's own choice stands unless its run would take GPUs the plan has promised to
    a deferred job (then the best-scoring site that does not is used). Objective, per (site, start):

    - ``carbon``: the job's energy (GPUs held × board power of the site's lowest-power usable model, kW, ×
      expected hours) × the site zone's forecast intensity integrated over the run (g/kWh; past the
      forecast's end its last hour stands), in kg CO2e;
    - ``cost``: the site's price per GPU-hour × GPUs held × expected hours, in USD (prices do not change by
      the hour, so a job waits for cost only when the cheap site is full now and has room later).

    With ``miss_cost`` (and enough finished jobs to judge by), each later start's value also carries the
    price of the risk it adds to the deadline (:mod:`policies.runtime_risk`): the search finds the least
    value with that price included, and the bars below are cleared with it included too; the deferral
    reports the forecast value itself and both chances of a miss.

    The job is deferred to the best later (site, hour) when that is at least ``min_saving`` (a fraction)
    and ``min_saving_abs`` (kg CO2e or USD) below starting now: every deferral risks the deadline a little
    (the estimate may be short), which a job's few grams are not worth; with no room now, to the best later start with room (a reservation, so it is not
    overtaken); otherwise it starts now. Ties go to the earlier hour, then the first site by name: values
    within a billionth of each other (``policies._shift_search.TIE_REL``, plus ``TIE_ABS`` near 0) are ties,
    so two hours the forecast makes equally clean, whose values differ by rounding, go to the earlier; and a
    later start no lower than starting now by more than that is not taken over it, whatever ``min_saving``.

Units: times are POSIX seconds or aware datetimes, hours are whole UTC hours, capacity is GPUs (a
fractional job holds ``milli / 1000`` of one). Turning it off: a profile without ``shift`` (or ``fast``)
never defers; ``min_saving`` close to 1 defers only for lack of room.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker import ids
from broker.errors import at
from policies import _shift_search as _search
from policies import latency_reserve, runtime_risk
from policies._lazy import LazyTuple
from policies.scorers._usable import usable_models
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest, Snapshot

if TYPE_CHECKING:
    from policies.pipeline import Placement

HOUR_S = 3600.0
_CAPACITY_FILTER = "gpus-do-not-fit"
_NOTHING_KEPT = np.zeros((0, 0), dtype=np.float32)
_NOTHING_NEAR = np.zeros((0, 0, 0))
PASSED_OVER_KEPT = 8
"""How many of the better-scoring sites a start now passed over are named, with the reason, in a decision."""


class ShiftPolicy(BaseModel):
    """How a profile shifts flexible jobs in time (``shift:`` in a profile)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: Literal["carbon", "cost"] = Field(default="carbon", description="what a later start must save")
    min_saving: float = Field(default=0.1, ge=0.0, lt=1.0,
                              description="defer only when the later start saves at least this fraction")
    duration_safety: float = Field(default=1.5, ge=1.0, le=100.0,
                                   description="latest start = deadline - duration_safety × expected run time")
    horizon_h: int = Field(default=168, ge=1, le=336, description="how many hours ahead a job may be deferred")
    max_wait_h: float = Field(default=336.0, gt=0.0, le=8784.0,
                              description="longest a job may be kept waiting by deferrals, from its submission")
    max_wait_factor: float | None = Field(
        default=None, gt=0.0, le=1000.0,
        description="longest a deferral may hold a job, as a multiple of its expected run time from its "
                    "submission (None: only max_wait_h and the deadline bound it)")
    min_saving_abs: float = Field(default=0.0, ge=0.0,
                                  description="defer only when the later start saves at least this much, in the "
                                              "objective's unit (kg CO2e for carbon, USD for cost)")
    miss_cost: float = Field(default=0.0, ge=0.0, le=1e9,
                             description="what a later start must save, in the objective's unit, for each whole "
                                         "unit of probability of missing the deadline it adds, judged on how long "
                                         "the latest finished jobs ran against their estimates "
                                         "(policies.runtime_risk); 0: not priced, duration_safety alone guards "
                                         "the deadline")
    max_risk: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="defer only to a start whose chance of missing the deadline, judged as miss_cost judges it "
                    "(policies.runtime_risk), is at most this; None: no bound but the price. Needs miss_cost > 0; "
                    "like the price, judges nothing until 50 jobs have finished")
    headroom: float = Field(default=0.0, ge=0.0, lt=1.0,
                            description="share of each site's GPUs that deferred starts leave free, for work "
                                        "that cannot wait (no slack) or go far (a latency objective: such a job "
                                        "may take the headroom, which is kept for it)")
    latency_reserve: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="keep room at each site for jobs with a latency objective: this quantile of the GPUs they "
                    "held there, hour by hour over the last week, less what they hold or have booked in each "
                    "hour, is left free by work without one that the plan places (policies.latency_reserve); "
                    "None: no such reserve")
    keep_promises: bool = Field(
        default=False,
        description="a job the profile does not defer (it asks to start at once, its latest start has come, or it "
                    "has no deadline) starts where its run takes no GPUs the plan has promised to running or "
                    "deferred jobs, where another site can take it (timeshift.start_now); false: at the profile's "
                    "choice, promised or not")
    book_overruns: bool = Field(
        default=False,
        description="the plan also knows what running jobs whose estimates have run out are expected to hold "
                    "until the end that the finished jobs that ran as long predict (runtime_risk.expected_ratio); "
                    "a deferral onto such GPUs is planned again on what is expected free, and stands only where "
                    "that plan also waits for the same site (timeshift.unless_it_slips); false: such GPUs count as "
                    "free from the next hour. The broker works them out when any profile asks")
    latency_reserve_price: float | None = Field(
        default=None, ge=0.0,
        description="make the latency_reserve a price instead of a bar: work the plan places may take room kept "
                    "for latency-bound jobs, paying this much in the objective's unit (kg CO2e for carbon, USD for "
                    "cost) for each GPU-hour it takes, so it does so only where every other start costs more; "
                    "None: the room kept is never taken")

    @model_validator(mode="after")
    def _risk_is_judged(self) -> ShiftPolicy:
        if self.max_risk is not None and not self.miss_cost > 0:
            raise at("max_risk", "max_risk needs miss_cost > 0: a deferral's risk to the deadline is judged only "
                                 "where it is priced")
        if self.latency_reserve_price is not None and self.latency_reserve is None:
            raise at("latency_reserve_price", "latency_reserve_price needs latency_reserve: it is the price of taking "
                                              "the room kept for latency-bound jobs, and without latency_reserve none "
                                              "is kept")
        return self

    @property
    def plan_hours(self) -> int:
        """Hours the plan covers: the furthest start plus as long again for the run that follows."""
        return 2 * self.horizon_h + 1


MAX_QUEUE_WAIT_S = 24 * 3600.0
"""In urgency order no job waits behind newer ones for longer than this: a job's place in the queue is its
latest start (deadline - expected run time) or its submit time + a day, whichever is sooner, so a large job
with a distant deadline is not overtaken for weeks by a stream of more urgent small ones."""


def urgency_ts(submit_ts: float, deadline_ts: float | None, duration_s: float, deferrable: bool = True) -> float:
    """A job's place in urgency order (POSIX seconds; sooner is first): see :data:`MAX_QUEUE_WAIT_S`. A job
    that must start at once (not ``deferrable``) has its submit time as its latest start."""
    latest = math.inf if deadline_ts is None else deadline_ts - duration_s
    if not deferrable:
        latest = min(latest, submit_ts)
    return min(latest, submit_ts + MAX_QUEUE_WAIT_S)


def latest_start_ts(req: JobRequest, policy: ShiftPolicy) -> float | None:
    """POSIX seconds of the latest start a deferral may plan: ``duration_safety`` × the estimate before the
    deadline, and no later than ``max_wait_h`` (and ``max_wait_factor`` × the estimate) after the job was
    submitted, so that a job deferred again and again as forecasts move can never be put off for longer
    than that (None: no deadline)."""
    if req.deadline_ts is None:
        return None
    latest = req.deadline_ts - policy.duration_safety * req.duration_s
    if req.submitted_ts is not None:
        latest = min(latest, req.submitted_ts + policy.max_wait_h * HOUR_S)
        if policy.max_wait_factor is not None:
            whole = req.estimate_s if req.estimate_s is not None else req.duration_s
            latest = min(latest, req.submitted_ts + policy.max_wait_factor * whole)
    return latest



@dataclass(frozen=True, slots=True)
class Deferral:
    """A decision to start ``request`` later: at ``site`` (index), model column ``model``, at ``start``
    (``slot`` whole hours after the hour containing the decision). ``value_then``/``value_now`` are the
    objective (kg CO2e or USD) of the planned start and of starting now (``now_site``; inf and -1 when no
    site has room now)."""

    request: JobRequest
    site: int
    model: int
    slot: int
    start: datetime
    objective: str
    value_then: float
    value_now: float
    now_site: int
    decided_at: datetime
    slots: int  # whole hours the run is planned to hold
    placement: Placement  # the profile's decision for now, for the explanation (every site's terms)
    best_now: float = math.inf  # the best start now at any site the plan allows (the bar a later start clears)
    best_now_site: int = -1
    # P(missing the deadline) starting now and at ``start`` (policies.runtime_risk); NaN: not priced
    risk_now: float = math.nan
    risk_then: float = math.nan
    # The profile's better-scoring sites the plan turned away now, and why (the first PASSED_OVER_KEPT of
    # n_passed_over): their GPUs are booked within the run, or kept for latency-bound jobs or as headroom.
    passed_over: Sequence[tuple[int, str]] = ()  # a tuple, or TurnedAway
    n_passed_over: int = 0
    # value_now and best_now are what the plan compared: the forecast objective plus, where the policy prices
    # the room kept for latency-bound jobs, that price for the room a start now would take. These are the
    # forecast objective alone (NaN: not worked out; the same as value_now / best_now where no room is taken).
    forecast_now: float = math.nan
    forecast_best_now: float = math.nan

    placed = False

    def reason(self, sites: tuple[str, ...]) -> str:
        unit = "kg CO2e" if self.objective == "carbon" else "USD"
        then = f"{sites[self.site]} from {self.start:%Y-%m-%dT%H:%MZ}"
        if self.now_site < 0 and self.request.not_before_ts is not None and self.decided_at.timestamp() \
                < self.request.not_before_ts:
            return (f"deferred until {self.start:%Y-%m-%dT%H:%MZ}: paused through dirty hours, it restarts no sooner "
                    f"than {datetime.fromtimestamp(self.request.not_before_ts, tz=UTC):%Y-%m-%dT%H:%MZ}; planned "
                    f"on {then} ({self.value_then:.3g} {unit} forecast for the rest of its run)"
                    + self._risk_text())
        if self.now_site < 0 or not math.isfinite(self.value_now):
            return (f"deferred until {self.start:%Y-%m-%dT%H:%MZ} because no site can take it now without "
                    f"breaking a plan; reserved on {then} ({self.value_then:.3g} {unit} forecast)"
                    + self._passed_text(sites) + self._risk_text())
        now = self._forecast(self.forecast_now, self.value_now)
        saving = 1.0 - self.value_then / now if now > 0 else 0.0
        text = (f"deferred until {self.start:%Y-%m-%dT%H:%MZ} because {self.objective} forecast on {then} is "
                f"{self.value_then:.3g} {unit} against {now:.3g} {unit} starting now on "
                f"{sites[self.now_site]} ({saving:.0%} less)"
                + self._room_text(self.value_now - now, unit, sites[self.now_site]))
        if self.best_now_site >= 0 and self.best_now_site != self.now_site:
            best = self._forecast(self.forecast_best_now, self.best_now)
            text += (f"; the best start now, on {sites[self.best_now_site]}, is {best:.3g} {unit}"
                     + self._room_text(self.best_now - best, unit, sites[self.best_now_site]))
        return text + self._passed_text(sites) + self._risk_text()

    @staticmethod
    def _forecast(pure: float, compared: float) -> float:
        return pure if pure == pure else compared

    @staticmethod
    def _room_text(price: float, unit: str, site: str) -> str:
        """The price of the room kept for latency-bound jobs that a start now would take, where it has one."""
        if not price > 1e-9:  # (none taken: the two differ by rounding at most)
            return ""
        return f"; a start now on {site} would also take room kept for latency-bound jobs, priced at {price:.3g} {unit}"

    def _passed_text(self, sites: tuple[str, ...]) -> str:
        if not self.n_passed_over:
            return ""
        return "; turned away now: " + passed_over_text(
            [(sites[site], why) for site, why in self.passed_over], self.n_passed_over)

    def _risk_text(self) -> str:
        if self.risk_then != self.risk_then:  # not priced
            return ""
        return (f"; the chance of missing its deadline, from how long recent jobs ran against their estimates, "
                f"goes from {self.risk_now:.1%} to {self.risk_then:.1%}")

    def as_dict(self, sites: tuple[str, ...]) -> dict[str, object]:
        now = self._forecast(self.forecast_now, self.value_now)
        return {"site": sites[self.site], "start": self.start.isoformat(), "objective": self.objective,
                "value_then": self.value_then, "value_now": now if math.isfinite(now) else None,
                **({"room_price_now": self.value_now - now} if self.value_now - now > 1e-9 else {}),
                "now_site": sites[self.now_site] if self.now_site >= 0 else None,
                "deadline_risk": ({"now": self.risk_now, "then": self.risk_then}
                                  if self.risk_then == self.risk_then else None),
                "reason": self.reason(sites)}


class TurnedAway(LazyTuple[tuple[int, str]]):
    """The better-scoring sites a plan turned away now, and why: a sequence of (site index, why) pairs whose
    words are written when first read. A walk turns away several sites for each job it places; the simulator
    never reads why, and the live cycle reads it when it records the decision's explanation. Pickled as the
    plain pairs (its words need the plan to be written)."""

    __slots__ = ("_rows", "_say", "_pairs", "_n")

    def __init__(self, rows: np.ndarray | list[list[int]], say: Callable[[int, int, int, int], str]) -> None:
        # rows: (site, why code, hour, model), as policies._shift_search.walk_now gives them (int[n, 4], made
        # Python ints when read); say: their words
        self._rows: np.ndarray | list[list[int]] | None = rows
        self._say: Callable[[int, int, int, int], str] | None = say
        self._pairs: tuple[tuple[int, str], ...] | None = None
        self._n = len(rows)

    def all(self) -> tuple[tuple[int, str], ...]:
        pairs = self._pairs
        if pairs is None:
            rows, say = self._rows, self._say
            if rows is None or say is None:  # another thread wrote them meanwhile
                return self.all()
            pairs = self._pairs = tuple((row[0], say(*row)) for row in
                                        (rows.tolist() if isinstance(rows, np.ndarray) else rows))
            self._rows = self._say = None  # what the words were made from (the plan's arrays), let go
        return pairs

    def __len__(self) -> int:
        return self._n


def passed_over_text(passed: Sequence[tuple[str, str]], n_passed: int) -> str:
    """The better-scoring sites a plan turned away now ((name, why), the first of ``n_passed``), in words:
    "site (why); site (why) and N more"."""
    text = "; ".join(f"{site} ({why})" for site, why in passed)
    if n_passed > len(passed):
        text += f" and {n_passed - len(passed)} more"
    return text


def epoch_hour(when: datetime) -> int:
    return int(when.timestamp() // HOUR_S)


@dataclass(frozen=True, slots=True)
class Booking:
    site: int
    model: int
    gpus: float
    first: int  # POSIX hour of the first slot held
    end: int  # POSIX hour after the last slot held
    near: bool = False  # a job with a latency objective (policies.latency_reserve)


class Calendar:
    """Planned GPUs per site, model column and POSIX hour. Bookings are kept in full (a long job's whole
    run), the past is dropped as time moves on. The bookings of jobs with a latency objective are also
    summed on their own (``near_view``), for the reserve kept for them (:mod:`policies.latency_reserve`)."""

    def __init__(self, n_sites: int, n_models: int, origin_h: int, span_h: int = 256) -> None:
        # float64: many fractional bookings and releases must cancel out (float32 drifts by ~1e-5)
        self.busy = np.zeros((n_sites, n_models, span_h), dtype=np.float64)
        self.near: np.ndarray | None = None  # the same, for latency-bound jobs alone; made by the first one
        self.origin = origin_h

    def _grown(self, busy: np.ndarray, span: int) -> np.ndarray:
        grown = np.zeros(busy.shape[:2] + (span,), dtype=np.float64)
        grown[:, :, :busy.shape[2]] = busy
        return grown

    def _reach(self, end_h: int) -> None:
        need = end_h - self.origin
        if need > self.busy.shape[2]:
            span = max(need, 2 * self.busy.shape[2])
            self.busy = self._grown(self.busy, span)
            if self.near is not None:
                self.near = self._grown(self.near, span)

    def advance(self, now_h: int) -> None:
        """Forget the hours before ``now_h`` once they are more than half the array."""
        drop = now_h - self.origin
        if drop > self.busy.shape[2] // 2:
            for name in ("busy", "near"):
                busy = getattr(self, name)
                if busy is not None:
                    kept = np.zeros_like(busy)
                    n = max(busy.shape[2] - drop, 0)
                    kept[:, :, :n] = busy[:, :, drop:drop + n]
                    setattr(self, name, kept)
            self.origin = now_h

    def book(self, site: int, model: int, gpus: float, first_h: int, end_h: int, near: bool = False) -> Booking:
        first_h = max(first_h, self.origin)
        self._reach(end_h)
        if end_h > first_h:
            self.busy[site, model, first_h - self.origin:end_h - self.origin] += gpus
            if near:
                if self.near is None:
                    self.near = np.zeros_like(self.busy)
                self.near[site, model, first_h - self.origin:end_h - self.origin] += gpus
        return Booking(site, model, gpus, first_h, end_h, near)

    def release(self, booking: Booking, from_h: int | None = None) -> None:
        """Give back a booking's hours from ``from_h`` on (all of them by default)."""
        lo = max(booking.first, self.origin, from_h if from_h is not None else booking.first)
        if booking.end > lo:
            self.busy[booking.site, booking.model, lo - self.origin:booking.end - self.origin] -= booking.gpus
            if booking.near and self.near is not None:
                self.near[booking.site, booking.model, lo - self.origin:booking.end - self.origin] -= booking.gpus

    def view(self, now: datetime, free_now: np.ndarray, total: np.ndarray, hours: int) -> np.ndarray:
        """float32[n_sites, n_models, hours]: GPUs free in each hour from the one containing ``now``; hour 0
        is ``free_now`` (the sites' real free capacity), later hours total - planned."""
        h0 = epoch_hour(now)
        self.advance(h0)
        self._reach(h0 + hours)
        out = (total[:, :, None] - self.busy[:, :, h0 - self.origin:h0 - self.origin + hours]).astype(np.float32)
        out[:, :, 0] = free_now
        return out

    def booked_view(self, now: datetime, hours: int) -> np.ndarray:
        """float32[n_sites, n_models, hours]: GPUs booked in each hour from the one containing ``now``, hour 0
        left at 0 (the sites' real capacity knows it): ``Snapshot.plan_overrun`` from a calendar of what jobs
        past their estimates are expected to hold."""
        h0 = epoch_hour(now)
        self.advance(h0)
        self._reach(h0 + hours)
        out = self.busy[:, :, h0 - self.origin:h0 - self.origin + hours].astype(np.float32)
        out[:, :, 0] = 0.0
        return out

    def near_view(self, now: datetime, hours: int) -> np.ndarray:
        """float64[n_sites, n_models, hours], a copy for a pass to debit: GPUs booked by latency-bound jobs in
        each hour from the one containing ``now`` (running ones until their expected end, deferred ones from
        their planned start)."""
        h0 = epoch_hour(now)
        self.advance(h0)
        self._reach(h0 + hours)
        if self.near is None:
            return np.zeros(self.busy.shape[:2] + (hours,))
        return self.near[:, :, h0 - self.origin:h0 - self.origin + hours].copy()


def run_slots(start_ts: float, duration_s: float) -> tuple[int, int]:
    """The POSIX hours a run from ``start_ts`` of ``duration_s`` holds: [first, end)."""
    first = int(start_ts // HOUR_S)
    end = int(math.ceil((start_ts + duration_s) / HOUR_S - 1e-9))
    return first, max(end, first + 1)


def debit(snap: Snapshot, site: int, model: int, gpus: float, first_slot: int, end_slot: int,
          near: bool = False) -> None:
    """Take ``gpus`` from the pass's plan in slots [first_slot, end_slot) (clipped to the plan); ``near``: a
    latency-bound job's, which the plan's ``near_booked`` counts too (policies.latency_reserve)."""
    if snap.plan_free.size:
        lo, hi = max(first_slot, 0), max(min(end_slot, snap.plan_free.shape[2]), 0)
        snap.plan_free[site, model, lo:hi] -= gpus
        if near and snap.near_booked.shape == snap.plan_free.shape:
            snap.near_booked[site, model, lo:hi] += gpus


def credit(snap: Snapshot, booking: Booking) -> None:
    """Give a booking back to the pass's plan (a deferred job being decided again)."""
    if snap.plan_free.size:
        h0 = epoch_hour(snap.now)
        lo, hi = max(booking.first - h0, 1), min(booking.end - h0, snap.plan_free.shape[2])
        if hi > lo:
            snap.plan_free[booking.site, booking.model, lo:hi] += booking.gpus
            if booking.near and snap.near_booked.shape == snap.plan_free.shape:
                snap.near_booked[booking.site, booking.model, lo:hi] -= booking.gpus


def _value_floor(values: np.ndarray) -> float:
    """0 where none of ``values`` (hourly intensities, or prices per GPU-hour) is negative, so that no start's value
    is below 0; else -inf (nothing known)."""
    return -math.inf if bool((values < 0).any()) else 0.0


def _later_bar(threshold: float, now_site: int, anywhere_now: float, min_saving_abs: float) -> float:
    """The value a later start must be below for the plan to take it: ``threshold``, and where the job can
    start now (``now_site`` >= 0), at most ``min_saving_abs`` below the best start now, ``anywhere_now``. That
    bar is raised by a hair (a billionth of the values compared) so that no start the plan's exact check
    (``anywhere_now - value >= min_saving_abs``) would take is above it: the search finds the same start
    wherever the plan takes one, and looks at far fewer sites where none saves that much."""
    if now_site < 0 or not min_saving_abs > 0:
        return threshold
    cut = anywhere_now - min_saving_abs
    return min(threshold, cut + 1e-9 * max(1.0, abs(anywhere_now), min_saving_abs))


def _cleanest_ahead(forecast: np.ndarray) -> np.ndarray:
    """Each row's lowest value from its second hour on: a later start's run sees no cleaner hour."""
    return forecast[:, 1:].min(axis=1) if forecast.shape[1] > 1 else forecast[:, 0].copy()


def _columns(req: JobRequest, snap: Snapshot, objective: str, need: float) -> tuple[np.ndarray, ...]:
    """Per site: the model column a plan uses, its kW or USD per GPU-hour, and whether there is one. The
    column is the one placement would use (``policies.pipeline.choose_model``: the named model, else the
    smallest GPUs that fit, here among the models with enough GPUs in total), so a plan checks room and
    counts carbon or cost on the GPUs the job would really run on."""
    usable = usable_models(req, snap) & (snap.total_gpus >= math.ceil(need))
    memory = np.where(usable, snap.memory_gib, np.inf)
    col = np.argmin(memory, axis=1)  # the named model's column is the only usable one
    rows = np.arange(snap.n_sites)
    if objective == "carbon":
        per_gpu = np.where(usable[rows, col], TDP_KW[col], np.inf)
    else:
        per_gpu = np.where(usable[rows, col], np.nan_to_num(snap.usd_per_gpu_hour[rows, col], nan=np.inf), np.inf)
    return col, per_gpu, np.isfinite(per_gpu)


def _forecast(snap: Snapshot) -> tuple[np.ndarray, ...]:
    """The hourly intensity a plan reads (the forecast, else the current intensity for every hour), its
    running sums, and which sites have one with no gap."""
    if snap.carbon_forecast.shape[0] == snap.n_sites and snap.carbon_forecast.shape[1]:
        forecast, cum = snap.carbon_forecast, snap.carbon_forecast_cum
    else:
        forecast = snap.carbon_g_per_kwh[:, None].astype(np.float64)
        cum = np.concatenate([np.zeros((snap.n_sites, 1)), forecast], axis=1)
    return forecast, cum, np.isfinite(forecast).all(axis=1)


class _Facts(NamedTuple):
    """What a plan reads of the snapshot for a policy, the same for every job a pass decides
    (:func:`_facts`, kept in ``Snapshot.derived``)."""

    hours: int  # the plan's hours
    now_ts: float
    hour0: float  # the start of now's hour (POSIX seconds)
    into_h: float  # how far into it now is, in hours
    carbon: bool  # the objective is carbon (else cost)
    forecast: np.ndarray  # the hourly intensity the plan reads (zeros [n_sites, 1] for cost) ...
    cum: np.ndarray  # ... its running sums
    known: np.ndarray | None  # the sites with a complete forecast (None for cost)
    no_reserve: np.ndarray  # float32 zeros, read-only: no headroom
    kept: np.ndarray  # held_back_for a job with no latency objective: the room kept, and what
    near: np.ndarray  # latency-bound jobs hold or have booked (the pass's own near_booked, not a copy)
    kept_price: float  # the price per GPU-hour of that room (inf: a bar, not a price)
    floor: float  # a bound below every start's value for the room's price (-inf: none, or nothing priced)
    least: float  # a bound below every start's value (_value_floor: 0, or -inf)


def _facts(snap: Snapshot, policy: ShiftPolicy) -> _Facts:
    now_ts = snap.now.timestamp()
    hour0 = math.floor(now_ts / HOUR_S) * HOUR_S
    carbon = policy.objective == "carbon"
    known = None
    if carbon:
        forecast, cum, known = snap.derived(("shift-forecast",), _forecast, snap)
    else:
        forecast = cum = snap.derived(("shift-no-forecast",), np.zeros, (snap.n_sites, 1))
    kept, near = _held_back(snap, policy)
    kept_price = math.inf if policy.latency_reserve_price is None else float(policy.latency_reserve_price)
    least = snap.derived(("shift-value-floor", policy.objective), _value_floor,
                         forecast if carbon else snap.usd_per_gpu_hour)
    return _Facts(
        hours=snap.plan_free.shape[2], now_ts=now_ts, hour0=hour0, into_h=(now_ts - hour0) / HOUR_S, carbon=carbon,
        forecast=forecast, cum=cum, known=known,
        no_reserve=snap.derived(("shift-no-headroom",), np.zeros, snap.n_sites, np.float32), kept=kept, near=near,
        kept_price=kept_price, floor=least if kept.size and kept_price < math.inf else -math.inf, least=least)


def start_now(req: JobRequest, snap: Snapshot, placement: Placement, policy: ShiftPolicy,
              filter_codes: tuple[str, ...]) -> Placement:
    """Where a job that a profile with ``keep_promises`` does not defer (not :func:`shiftable`: it asks to
    start at once, its latest start has come, or it has no deadline) starts, ``placement`` being the
    profile's choice (placed): there, unless its run would take GPUs the plan has promised to running or
    deferred jobs (as for a flexible job starting now, :func:`plan`); then the best-scoring site whose GPUs
    are not promised; the profile's choice where every site's are. So a job that cannot wait does not take a
    deferred job's planned start where another site can take it, and still never waits for one. Neither the
    headroom nor the room kept for latency-bound jobs is kept from it: both are kept for such work."""
    if not snap.plan_free.size:
        return placement
    chosen = plan(req, snap, placement, policy, filter_codes, now_only=True)
    assert not isinstance(chosen, Deferral), "now_only searches no later start"
    return placement if chosen is None else chosen


def plan(req: JobRequest, snap: Snapshot, placement: Placement, policy: ShiftPolicy,
         filter_codes: tuple[str, ...], now_only: bool = False) -> Placement | Deferral | None:
    """The time-shift decision for a flexible job: a :class:`~policies.pipeline.Placement` to start now
    (the profile's own choice, or another site when that one's GPUs are promised), a :class:`Deferral`, or
    None (the job waits: no room now and none planned). ``placement`` is the profile's decision for now
    (placed or not), ``filter_codes`` its pipeline's filters in order. Callers check flexibility first
    (:func:`shiftable`); with ``now_only`` (:func:`start_now`) no later start is searched, and neither the
    headroom nor the room kept for latency-bound jobs is kept from the job."""
    plan_free = snap.plan_free
    # What is the same for every job of the pass, worked out once.
    facts = snap.derived(("shift-facts", policy.objective, policy.latency_reserve, policy.latency_reserve_price),
                         _facts, snap, policy)
    hours, now_ts, hour0, into_h, carbon = facts.hours, facts.now_ts, facts.hour0, facts.into_h, facts.carbon
    forecast, cum = facts.forecast, facts.cum
    if now_only:
        last_slot = 0
    else:
        latest = latest_start_ts(req, policy)
        assert latest is not None
        last_slot = min(hours - 1, policy.horizon_h, int((latest - hour0) // HOUR_S))
    need = req.charge
    d_h = req.duration_s / HOUR_S

    # Sites that could take the job at some hour: every filter but "free now", and a model with room in total.
    col, per_gpu, usable_sites = snap.derived(("shift-columns", policy.objective, req.model, req.memory_gib,
                                               math.ceil(need)), _columns, req, snap, policy.objective, need)
    ok = usable_sites & _steady(placement, filter_codes)
    if facts.known is not None:
        ok &= facts.known
    if not placement.placed and not ok.any():
        return None  # (a placed job with no such site starts now below: its bar is 0, nothing beats it)
    # The headroom is kept for work that cannot wait or go far: a job with a latency objective takes it.
    if policy.headroom and req.latency_slo_ms is None and not now_only:
        reserve_all = policy.headroom * snap.total_gpus[np.arange(snap.n_sites), col].astype(np.float32)
        reserve_all.flags.writeable = False  # as the cached zeros: one compiled form of the search for both
    else:
        reserve_all = facts.no_reserve
    # So is the room latency-bound jobs were seen to need where they run (policies.latency_reserve, as
    # held_back_for). With it, a bound below every start's value (0 where no forecast hour or price is
    # negative), for the room's price: a start whose price for the room it would take is more than the best
    # start elsewhere is turned away without its value being worked out.
    if req.latency_slo_ms is None and not now_only:
        kept, near, floor = facts.kept, facts.near, facts.floor
    else:
        kept, near, floor = _NOTHING_KEPT, _NOTHING_NEAR, -math.inf
    kept_price = facts.kept_price
    run_hours = max(int(math.ceil(d_h - 1e-9)), 1)
    now_hours = min(max(int(math.ceil(into_h + d_h - 1e-9)), 1), hours)
    first = 1 if req.fractional else 0

    def why_not_now(site: int, why: int, hour: int, column: int) -> str:
        # Why a run starting now at ``site`` does not fit the plan (walk_now's ``why`` and ``hour``), for the
        # explanation: the first hour short of room with nothing kept, else what is kept.
        model = ids.GPU_MODEL_IDS[column]
        if why == 3:
            return ("the plan cannot check it: no complete forecast for its zone, or no price, for the GPUs the "
                    "job would use")
        if why == 0:
            if not hour:
                return f"its {model} GPUs are not free now"
            at = datetime.fromtimestamp(hour0 + hour * HOUR_S, tz=UTC)
            return (f"its {model} GPUs are booked from {at:%Y-%m-%dT%H:%MZ}, within this run's expected "
                    f"{d_h:.3g} h, by running or deferred jobs")
        if why == 1:
            text = (f"it would take the room kept for latency-bound jobs: {float(kept[site, column]):g} "
                    f"{model} GPUs at latency_reserve {policy.latency_reserve:g}")
            if policy.latency_reserve_price is not None:
                text += (f", at {policy.latency_reserve_price:g} per GPU-hour taken, where a start elsewhere "
                         "costs less")
            return text
        return f"it would take the headroom kept for work that cannot wait: headroom {policy.headroom:g}"

    # Starting now: the profile's choice if the plan allows it, else its best-scoring site that the plan allows.
    # Waiting must buy something that starting now cannot: the bar is the profile's choice or the best start
    # now at any site the plan allows, whichever is lower (a profile that weighs more than carbon may start a
    # job where it is dirtier; that is no reason to make it wait).
    now_site = -1
    chosen = placement
    best_now = anywhere_now = math.inf
    anywhere_site = -1
    passed: Sequence[tuple[int, str]] = ()  # better-scoring sites turned away, and why (the first PASSED_OVER_KEPT)
    n_passed = 0
    # A job paused through dirty hours (policies.migration) does not start again before its pause ends: only
    # later starts from then are searched; where none has room, it is decided as if not paused (_unpaused).
    paused_slots = (int(math.ceil((req.not_before_ts - hour0) / HOUR_S - 1e-9))
                    if req.not_before_ts is not None and req.not_before_ts > now_ts and not now_only else 0)
    if placement.placed and not paused_slots:
        # The best start now at any site the plan allows, (value, site) (policies._shift_search.
        # cheapest_fitting_now); (inf, -2) where there is one feasible site: never compared.
        other, at = (_search.cheapest_fitting_now(placement.feasible, ok, per_gpu, need, d_h, into_h, forecast, cum,
                                                  carbon, plan_free, col, reserve_all, kept, near, first, now_hours,
                                                  kept_price)
                     if placement.feasible.shape[0] > 1 else (math.inf, -2))
        # A job that can wait leaves the headroom (and the room kept for latency-bound jobs) free in every
        # hour of its run, now or later. The current hour is the sites' real free capacity, which the
        # profile's GPU-fit filter has already checked (shared GPUs included); for whole GPUs the headroom is
        # checked in it too. One compiled call (policies._shift_search.start_now): whether the plan has room
        # for a run starting now at the profile's site on the model it would start on, its value, the best
        # start now at any site the plan allows, and where there is no room, why.
        here, column = placement.site, placement.model
        rate = _rate_at(snap, column, here, carbon)
        fits, best_now, anywhere_now, anywhere_site, _, _ = _search.start_now(
            here, column, rate, ok, placement.feasible, per_gpu, need, d_h, into_h, forecast, cum, carbon, plan_free,
            col, reserve_all, kept, near, first, now_hours, kept_price, other, at, floor)
        if fits:
            now_site = placement.site
        else:  # (start_now gave inf, inf, -1): the profile's sites in score order, in one compiled walk
            models, room, free, columns, memory = _model_choice(placement, snap)
            site, model, best_now, anywhere_now, anywhere_site, turned, n_passed = _search.walk_now(
                placement.totals, models, room, free, columns, memory, TDP_KW, snap.usd_per_gpu_hour, ok,
                placement.feasible, per_gpu, need, d_h, into_h, forecast, cum, carbon, plan_free, col, reserve_all,
                kept, near, first, now_hours, kept_price, other, at, floor, PASSED_OVER_KEPT)
            if n_passed:
                passed = TurnedAway(turned[:min(n_passed, PASSED_OVER_KEPT)], why_not_now)
            if site >= 0:
                now_site = site
                # (made as dataclasses.replace would, without its field-by-field look-up: several µs less)
                chosen = type(placement)(
                    request=placement.request, site=site, model=model, n_sites=placement.n_sites,
                    passes=placement.passes, feasible=placement.feasible, terms=placement.terms,
                    totals=placement.totals, passed_over=passed, n_passed_over=n_passed,
                    steady=placement.steady, fit=placement.fit, over_plan=False)
    threshold = anywhere_now * (1.0 - policy.min_saving) - 1e-12

    # Later starts, at the sites that could beat the threshold at all (a lower bound: the run at the
    # cleanest forecast hour ahead, or its price), in batches from the lowest bound up, until no site left
    # could beat the best start found. Where the job can start now, a later start must also save
    # min_saving_abs, so the search looks no higher than that either (_later_bar).
    bar = _later_bar(threshold, now_site, anywhere_now, policy.min_saving_abs)
    if last_slot < 1 or not threshold > 0 or not bar > facts.least:
        if paused_slots:
            return _unpaused(req, snap, placement, policy, filter_codes)
        return chosen if now_site >= 0 else _over_plan(placement, passed, n_passed)
    cleanest = snap.derived(("shift-cleanest",), _cleanest_ahead, forecast) if carbon else per_gpu
    # The least (value, hour, site) of a start at a whole hour 1 .. last_slot with room in the plan, from
    # the sites with the lowest bound up (policies._shift_search).
    # A later start also pays for the risk it adds to the deadline, where that is priced (policies.runtime_risk).
    penalty, risk = runtime_risk.deferral_penalty(req, snap.run_time_errors, now_ts, hour0, last_slot,
                                                      policy.miss_cost)
    if policy.max_risk is not None and risk.size:  # a start riskier than that is not planned at all
        penalty = np.where(risk[1:] > policy.max_risk, np.inf, penalty)
    if paused_slots > 1:  # no start before the pause ends
        penalty = (penalty if penalty.shape[0] > last_slot else np.zeros(last_slot + 1)).copy()
        penalty[:min(paused_slots, last_slot + 1)] = np.inf
    value, slot, site, best_col, value_then = _search.search_later(
        ok, cleanest, bar, per_gpu, need, d_h, forecast, cum, carbon, plan_free, col, reserve_all, kept, near,
        last_slot, run_hours, min(hours, last_slot + run_hours), penalty, kept_price)
    if now_site >= 0 and math.isfinite(value) and anywhere_now - value < policy.min_saving_abs:
        value = math.inf  # too little saved for the risk a wait puts on the deadline: start now
    # (a later start only as good as starting now, within the tie tolerance, is not worth a wait: min_saving 0)
    if math.isfinite(value) and value < threshold and _search.lower(value, anywhere_now):
        return Deferral(
            request=req, site=site, model=best_col, slot=slot,
            start=datetime.fromtimestamp(hour0 + slot * HOUR_S, tz=UTC), objective=policy.objective,
            value_then=value_then, value_now=best_now, now_site=now_site, decided_at=snap.now,
            slots=run_hours, placement=placement, best_now=anywhere_now, best_now_site=anywhere_site,
            risk_now=float(risk[0]) if risk.size else math.nan,
            risk_then=float(risk[slot + 1]) if risk.size else math.nan,
            passed_over=passed, n_passed_over=n_passed,
            forecast_now=(_forecast_now(now_site, _rate_at(snap, chosen.model, now_site, carbon), need, d_h, into_h,
                                        forecast, cum, carbon, best_now) if now_site >= 0 and ok[now_site]
                          else best_now),
            forecast_best_now=(_forecast_now(anywhere_site, float(per_gpu[anywhere_site]), need, d_h, into_h,
                                             forecast, cum, carbon, anywhere_now) if anywhere_site >= 0
                               and ok[anywhere_site] else anywhere_now),
        )
    if paused_slots:
        return _unpaused(req, snap, placement, policy, filter_codes)
    if now_site >= 0:
        return chosen
    return _over_plan(placement, passed, n_passed)


def _unpaused(req: JobRequest, snap: Snapshot, placement: Placement, policy: ShiftPolicy,
              filter_codes: tuple[str, ...]) -> Placement | Deferral | None:
    """A paused job with no start after its pause that its deadline and the plan allow: decided as if it had
    not been paused, so a start now (or sooner) keeps the plan's promises as any other job's does, rather than
    taking the profile's choice over GPUs promised to deferred jobs."""
    return plan(replace(req, not_before_ts=None), snap, placement, policy, filter_codes)


def _rate_at(snap: Snapshot, column: int, site: int, carbon: bool) -> float:
    """kW per GPU of the model column (carbon), or its USD per GPU-hour at the site: ``start_now``'s rate."""
    return float(TDP_KW[column]) if carbon else float(np.nan_to_num(snap.usd_per_gpu_hour[site, column], nan=np.inf))


def _forecast_now(site: int, rate: float, need: float, d_h: float, into_h: float, forecast: np.ndarray,
                  cum: np.ndarray, carbon: bool, compared: float) -> float:
    """The objective of a run starting now at ``site``, as :func:`policies._shift_search.start_now` values it
    but without the price of the room kept for latency-bound jobs that it takes: what the explanation reports
    as the forecast. ``compared`` (the value the plan compared, price included) where it cannot be worked out."""
    if not carbon:
        return rate * need * d_h
    if forecast.shape[0] <= site or not forecast.shape[1]:
        return compared
    return rate * need * (_search._integral(cum, forecast, site, into_h + d_h)
                          - _search._integral(cum, forecast, site, into_h)) / 1000.0


def _over_plan(placement: Placement, passed: Sequence[tuple[int, str]], n_passed: int) -> Placement | None:
    """Where the plan turned away every site that could take the job now and no later start is planned: the
    profile's own choice, placed (it starts there, over the plan, rather than wait for nothing), marked so
    and naming the sites turned away; None where the profile places it nowhere."""
    if not placement.placed:
        return None
    if not n_passed:
        return placement
    return replace(placement, passed_over=passed, n_passed_over=n_passed, over_plan=True)


def unless_it_slips(req: JobRequest, snap: Snapshot, placement: Placement, deferral: Deferral,
                    policy: ShiftPolicy, filter_codes: tuple[str, ...]) -> Placement | Deferral | None:
    """``book_overruns``: ``deferral`` (from :func:`plan`), unless its run would take GPUs that running jobs
    past their estimates are expected to hold then (``Snapshot.plan_overrun``, which ``plan_free`` counts as
    free). Then the job is planned again on what is expected free (``plan_free`` less ``plan_overrun``), with
    everything :func:`plan` weighs: the value of each start, the risk a later start adds to the deadline
    (``miss_cost``, ``max_risk``), the latest start, the room kept. Where that plan also waits for the same
    site and model, at the hour the GPUs are expected free or later, the deferral stands: the job keeps its
    place in line there, and takes the GPUs as soon as they come free. Otherwise the new plan's outcome
    (another site, a later hour elsewhere, or a start now) is the decision. So a job with time to spare
    still waits for a clean site, and one whose deadline cannot take the wait is not planned on GPUs that are
    not coming free."""
    over = snap.plan_overrun
    if not over.size:
        return deferral
    lo, hi = deferral.slot, deferral.slot + deferral.slots
    row = snap.plan_free[deferral.site, deferral.model, lo:hi]
    if (row - over[deferral.site, deferral.model, lo:hi] >= req.charge - 1e-6).all():
        return deferral
    saved = snap.plan_free.copy()
    np.subtract(snap.plan_free, over, out=snap.plan_free)
    try:
        again = plan(req, snap, placement, policy, filter_codes)
    finally:
        np.copyto(snap.plan_free, saved)
    if isinstance(again, Deferral) and (again.site, again.model) == (deferral.site, deferral.model):
        return deferral
    return again


def held_back_for(req: JobRequest, snap: Snapshot,
                  policy: ShiftPolicy | None) -> tuple[np.ndarray, np.ndarray]:
    """(float32[n_sites, n_models]: the room kept for jobs with a latency objective at each site and model,
    float[n_sites, n_models, hours]: what they hold or have booked in each hour of the plan), which ``req``
    leaves free less the second (:mod:`policies.latency_reserve`); both empty when nothing is kept from it
    (it has a latency objective itself, the policy keeps no such room, or the snapshot does not know what
    they hold)."""
    if req.latency_slo_ms is not None:
        return _NOTHING_KEPT, _NOTHING_NEAR
    return _held_back(snap, policy)


def _held_back(snap: Snapshot, policy: ShiftPolicy | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`held_back_for` a job with no latency objective."""
    if (policy is None or policy.latency_reserve is None or not snap.near_samples.shape[0]
            or snap.near_booked.shape != snap.plan_free.shape):
        return _NOTHING_KEPT, _NOTHING_NEAR
    kept = snap.derived(("latency-reserve", policy.latency_reserve), latency_reserve.reserve, snap.near_samples,
                        policy.latency_reserve)
    return kept, snap.near_booked  # the pass's own near_booked, which assume, debit and credit keep up


def window(req: JobRequest, snap: Snapshot, policy: ShiftPolicy) -> tuple[int, int]:
    """(whole hours the run holds, the last whole hour it may start in, counted from now's hour): with the
    request's shape, all that decides whether a plan has room for it."""
    hour0 = math.floor(snap.now.timestamp() / HOUR_S) * HOUR_S
    latest = latest_start_ts(req, policy)
    last = int((latest - hour0) // HOUR_S) if latest is not None else 0
    return max(int(math.ceil(req.duration_s / HOUR_S - 1e-9)), 1), min(last, policy.horizon_h)


def shiftable(req: JobRequest, snap: Snapshot, policy: ShiftPolicy) -> bool:
    """Whether ``req`` may be deferred now: it does not ask to start at once (``deferrable``), it has a
    deadline whose latest start is at or after the next whole hour, and the pass has a plan."""
    if not req.deferrable:
        return False
    latest = latest_start_ts(req, policy)
    if latest is None or not snap.plan_free.size:
        return False
    next_hour = (math.floor(snap.now.timestamp() / HOUR_S) + 1) * HOUR_S
    return latest >= next_hour


def _steady(placement: Placement, filter_codes: tuple[str, ...]) -> np.ndarray | bool:
    """The sites every filter but "free now" passed: the decision's own answer when it kept one (True: all
    passed), else worked out from the filters' answers."""
    if placement.fit is not None:
        return True if placement.steady is None else placement.steady
    steady = np.ones(placement.n_sites, dtype=bool)
    for code, passed in zip(filter_codes, placement.passes, strict=True):
        if passed is not None and code != _CAPACITY_FILTER:
            steady &= passed
    return steady


_NO_MODELS = np.zeros(0, dtype=np.int64)
_NO_ROOM = np.zeros((0, 0), dtype=bool)
_NO_FREE = np.zeros((0, 0), dtype=np.int32)
_NO_MEMORY = np.zeros(0)
_ONE_MODEL = tuple(np.full(1, column, dtype=np.int64) for column in range(len(ids.GPU_MODEL_IDS)))


def _model_choice(placement: Placement,
                  snap: Snapshot) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`policies._shift_search.walk_now` needs to know the model each of the placement's feasible
    sites would start on, as :func:`_model_at` chooses it: (the models, one per feasible site, or one for all,
    where they are known without looking at the site: the request names one, or the decision kept no fit for
    this snapshot; else empty), and the decision's fit to choose from (room, free GPUs, usable columns, their
    memory per GPU; empty where not needed)."""
    req = placement.request
    fit = placement.fit
    if req.model is not None:  # one model, the same at every site
        return _ONE_MODEL[MODEL_INDEX[req.model]], _NO_ROOM, _NO_FREE, _NO_MODELS, _NO_MEMORY
    if fit is None or fit.snap is not snap:
        models = [_model_at(placement, snap, int(site)) for site in placement.feasible.tolist()]
        return np.array(models, dtype=np.int64), _NO_ROOM, _NO_FREE, _NO_MODELS, _NO_MEMORY
    usable = fit.usable
    return _NO_MODELS, fit.room, fit.free, usable.columns, usable.memory_array


def _model_at(placement: Placement, snap: Snapshot, site: int) -> int:
    """The model column the placement would use at ``site`` (``policies.pipeline.choose_model``), from the
    decision's fit when it kept one. The fit holds the free capacity ``decide`` saw: this is only right
    before anything is assumed on ``snap``, as :func:`plan` is called, straight after the decision."""
    if placement.request.model is None and placement.fit is not None and placement.fit.snap is snap:
        model = placement.fit.smallest_at(site)
        if model >= 0:
            return model
    from policies.pipeline import choose_model  # the pipeline imports this module

    return choose_model(placement.request, snap, site)


def warm_up() -> None:
    """Compile the search (``policies._shift_search``) and the pipeline's kernels (``policies._scores``) for
    the array types the broker hands them with the built-in profiles, so that the first job a fresh
    deployment decides does not wait for Numba (seconds, once: the code is cached on disk, in
    ``NUMBA_CACHE_DIR`` when set). A starting broker runs this in a worker thread; the container image runs
    it when it is built, with the room kept for latency-bound jobs of a profile with ``latency_reserve``.
    Not covered: the simulator's float32 forecasts, which compile at their first use (in the replay, not a
    live broker's scheduling pass)."""
    from datetime import timedelta

    from broker.models import Health, ModelCapacity, NodeGroup, SiteSpec, SiteState
    from policies.pipeline import default_pipeline
    from policies.profiles import profile_pipeline
    from policies.snapshot import build_snapshot, replace_forecast

    now = datetime(2026, 1, 1, 0, 30, tzinfo=UTC)
    # Two models per site: a job any model suits has several usable columns (column-major arrays), one
    # that names a model or asks for more memory than one of them has a single column; Numba compiles
    # each layout on its own.
    specs = [SiteSpec(name=f"s{i}", region="gcp:us-east1", grid_zone="US-MIDA-PJM", timezone="UTC", latitude=0,
                      longitude=0, gpus=[NodeGroup(model="l4", gpus_per_node=8, nodes=1),
                                         NodeGroup(model="a100-80gb", gpus_per_node=8, nodes=1)],
                      usd_per_gpu_hour={"l4": 1.0 + i, "a100-80gb": 3.0 + i}) for i in range(2)]
    states = {s.name: SiteState(site=s.name, health=Health.HEALTHY, capacity=[
        ModelCapacity(model="l4", total_gpus=8, free_gpus=8, used_gpus=0, memory_gib_per_gpu=24),
        ModelCapacity(model="a100-80gb", total_gpus=8, free_gpus=8, used_gpus=0, memory_gib_per_gpu=80)])
        for s in specs}
    snap = build_snapshot(now, specs, states)
    snap = replace_forecast(snap, np.array([[500.0] * 2 + [50.0] * 46, [400.0] * 48]))
    # Finished jobs that ran from half to twice their estimates: the profiles price a deferral's risk from them
    # (a read-only array, as RunTimeErrors hands every snapshot: Numba compiles read-only arrays on their own).
    errors = runtime_risk.RunTimeErrors()
    for ratio in np.linspace(0.5, 2.0, runtime_risk.MIN_SAMPLES):
        errors.add(3600.0, 3600.0 * float(ratio))
    snap = replace(snap, run_time_errors=errors.sorted())
    for name in ("green", "cheap"):
        pipeline = profile_pipeline(name)
        assert pipeline.shift is not None
        calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(now))
        fresh = replace(snap, plan_free=calendar.view(now, snap.free_gpus, snap.total_gpus, pipeline.shift.plan_hours))
        # And every site booked after this hour: the profile's choice does not fit the plan, so the search walks
        # the sites in score order (walk_now), compiled for a model named and for one chosen from the fit.
        booked_free = fresh.plan_free.copy()
        booked_free[:, :, 1:] = 0.0
        booked = replace(fresh, plan_free=booked_free)
        for model, memory_gib in ((None, 0.0), ("l4", 0.0), (None, 40.0)):
            req = JobRequest(job_id="warm-up", count=8, milli=1000, model=model, memory_gib=memory_gib,
                             allowed_regions=frozenset(), denied_regions=frozenset(), duration_s=4 * HOUR_S,
                             deadline_ts=(now + timedelta(hours=40)).timestamp(), submitted_ts=now.timestamp())
            plan(req, fresh, pipeline.decide(req, fresh), pipeline.shift, pipeline.filter_codes)
            plan(req, booked, pipeline.decide(req, booked), pipeline.shift, pipeline.filter_codes)
            default_pipeline().decide(req, fresh)  # the free-GPUs scorer's sum
    # The terms of a decision are normalised in one call over a tuple of read-only float64 arrays, compiled for
    # each number of terms a pipeline may have (one per scorer there is, at most).
    from policies import _scores
    from policies.pipeline import TIE_EPSILON
    from policies.profiles import SCORERS

    row = np.zeros(snap.n_sites)
    row.flags.writeable = False
    for n in range(1, len(SCORERS) + 1):
        _scores.gather_normalise((row,) * n, np.arange(snap.n_sites), np.zeros(n, dtype=bool), np.ones(n), TIE_EPSILON)
    # A move's check of room in the plan (policies.migration) calls the plan's room check on its own.
    _search.room_now(fresh.plan_free, 0, 0, 0, 1, 1.0, np.zeros(snap.n_sites, dtype=np.float32), _NOTHING_KEPT,
                     _NOTHING_NEAR)
    # A profile that keeps room for latency-bound jobs (``latency_reserve``) hands the search that room
    # read-only, with what they hold hour by hour: types Numba compiles on their own.
    green = profile_pipeline("green")
    assert green.shift is not None
    keeping = green.shift.model_copy(update={"latency_reserve": 0.9})
    calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(now))
    plan_free = calendar.view(now, snap.free_gpus, snap.total_gpus, keeping.plan_hours)
    near_snap = replace(snap, plan_free=plan_free, near_booked=calendar.near_view(now, keeping.plan_hours),
                        near_samples=np.ones((2,) + snap.total_gpus.shape, dtype=np.float32))
    # (On the A100s the later start saves more than green's min_saving_abs, so the search for it runs.)
    for model, memory_gib in ((None, 0.0), ("l4", 0.0), ("a100-80gb", 0.0)):
        req = JobRequest(job_id="warm-up", count=4, milli=1000, model=model, memory_gib=memory_gib,
                         allowed_regions=frozenset(), denied_regions=frozenset(), duration_s=4 * HOUR_S,
                         deadline_ts=(now + timedelta(hours=40)).timestamp(), submitted_ts=now.timestamp())
        plan(req, near_snap, green.decide(req, near_snap), keeping, green.filter_codes)
    kept, near = held_back_for(req, near_snap, keeping)
    _search.room_now(plan_free, 0, 0, 0, 1, 1.0, np.zeros(snap.n_sites, dtype=np.float32), kept, near)
    # Where the profile's best site (s0, the cleaner over the run) is booked within the run, the plan walks the
    # other sites in one compiled call (walk_now): with the models given (a named model) and chosen from the
    # decision's fit.
    calendar = Calendar(snap.n_sites, snap.total_gpus.shape[1], epoch_hour(now))
    for column in range(snap.total_gpus.shape[1]):
        calendar.book(0, column, 8.0, epoch_hour(now) + 1, epoch_hour(now) + 2)
    booked = replace(near_snap, plan_free=calendar.view(now, snap.free_gpus, snap.total_gpus, keeping.plan_hours))
    for model in (None, "l4"):
        req = JobRequest(job_id="warm-up", count=4, milli=1000, model=model, memory_gib=0.0,
                         allowed_regions=frozenset(), denied_regions=frozenset(), duration_s=4 * HOUR_S,
                         deadline_ts=(now + timedelta(hours=40)).timestamp(), submitted_ts=now.timestamp())
        plan(req, booked, green.decide(req, booked), keeping, green.filter_codes)
