"""The carbon the broker's choices saved against a carbon-agnostic baseline (``GET /v1/carbon``, the
dashboard's headline, ``heliotrope_placed_carbon_grams_total`` and
``heliotrope_placed_carbon_agnostic_grams_total``).

For each placement its site admitted (counted when the site says so: a placement the site refuses, or
one whose dispatch fails, is routed again and counted once, where it runs; one whose admission the broker learns
of from the site's reports of it running or done, which overtook the answer to its dispatch, or came after a
restart cut the dispatch off, is counted from when the site says it began, at its end where that came first:
:attr:`CarbonLedger.dispatching`) the baseline is the site the same decision would have chosen with its carbon terms
(the ``carbon`` and ``carbon_now`` scorers) left out: every other term (price, latency, follow-the-sun,
free GPUs...) weighted as configured, among the same feasible sites. When the chosen site ties for first
without the carbon terms, the baseline is the chosen site and nothing is claimed.

Estimate, in grams of CO2e: energy = GPUs charged x the placed model's board power (TDP) x the time the attempt held
its GPUs; emissions = energy x the grid intensity each site had at the moment of the decision. Both sites are
charged the same energy (the placed model's power). An admitted attempt is counted at once for its expected run (of
a job resumed from a checkpoint, what it has left to run), and remembered until it ends, however it ends (succeeded,
failed, cancelled, preempted, moved, lost with its site, withdrawn, requeued after a broker restart): its figures
are then corrected to the time it held its GPUs, from its admission to its end as the broker recorded them (the
site's reported end for one that succeeded or failed for good, or whose report of it stopped, lost or failed came
late; for one its site forgot while no broker was in charge, the last time one knew it there:
:attr:`CarbonLedger.seen_ts`), at the intensities of its decision. So an attempt that ended early is taken back down
to what it ran, one that overran is charged its overrun, and a job preempted halfway and resumed from its checkpoint
is counted once in full; an attempt still running stays counted for its whole expected run until it ends
(``open_attempts`` says how many). ``jobs`` counts distinct jobs placed (a job admitted again is not counted again;
``moved_jobs`` likewise counts the jobs one of whose attempts was placed away from the baseline's site),
``admissions`` every admission.

The two Prometheus counters never go down: each admission adds its estimate, and an attempt that overran
adds its overrun when it ends; one that ended early is not taken back there. They count the estimates of
admissions (at least), where ``GET /v1/carbon`` is the corrected figure.

Savings from deferring a job to a cleaner hour are not in this figure: it compares sites at the same moment, so it
never credits a forecast that may not come true. The leader keeps the totals, with the attempts still open, those
being dispatched and the jobs between two counted attempts, in its database (``broker_state``) at the end of a pass
once they changed, at most every 10 s, and while attempts are open at least every minute, and when it stops (when it
saved them is the last time it knew those attempts on their sites), so they run on across restarts and takeovers (a
crash loses at most the last 10 s of them; an attempt that ended after the last save, unheard by the broker that
takes over, is ended by it as of the job's end or last change, or when it left its site where the job has had a
later attempt since: ``SchedulingCycle.settle_ledger``). A document of version 1 (before attempts were remembered:
its ``jobs`` counted admissions) is read with nothing open. The document is written as version 1 with the rest
beside the totals (``format`` 2: :data:`LEDGER_VERSION`), so that a broker of an earlier release taking over goes on
from the totals; the attempts being dispatched and when it was saved (``dispatching``, ``seen_at``) are keys beside
them, which earlier releases read past. Replicas that do not lead pass ``GET /v1/carbon`` on to the leader."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from policies.pipeline import TIE_EPSILON, Placement
from policies.snapshot import TDP_KW, Snapshot

CARBON_SCORERS = frozenset({"carbon", "carbon_now"})
LEDGER_VERSION = 2
"""The format of the ledger document :meth:`CarbonLedger.state` writes (1: totals only, no open attempts). It is
written as key ``format``, beside ``"v": 1``: a broker of an earlier release reads documents of version 1 only,
and only their totals (it reads past the rest), so one that takes over from this release (replicas of two
releases sharing a database, or a rollback) goes on from the totals rather than start from 0 and save that over
them. What it saves back has no ``format``: this release reads it as version 1, with nothing open."""


@dataclass(frozen=True, slots=True)
class Counted:
    """What one placement adds to the ledger at its admission: kWh, grams at its site and at the baseline's,
    whether the two differ, and the run they were estimated for (seconds)."""

    kwh: float
    grams: float
    agnostic_grams: float
    moved: bool
    expected_s: float

    def scaled(self, factor: float) -> Counted:
        """These figures times ``factor`` (for the same expected run)."""
        return Counted(self.kwh * factor, self.grams * factor, self.agnostic_grams * factor, self.moved,
                       self.expected_s)


def assess(placement: Placement, snap: Snapshot) -> Counted | None:
    """A placement's figures for the ledger (none counted yet), or None where it is not placed or an
    intensity is unknown."""
    if not placement.placed or snap.carbon_g_per_kwh.size == 0:
        return None
    chosen = placement.site
    baseline = agnostic_choice(placement)
    here, there = float(snap.carbon_g_per_kwh[chosen]), float(snap.carbon_g_per_kwh[baseline])
    if not (math.isfinite(here) and math.isfinite(there)):
        return None
    req = placement.request
    kwh = req.charge * float(TDP_KW[placement.model]) * req.duration_s / 3600.0
    return Counted(kwh, kwh * here, kwh * there, baseline != chosen, float(req.duration_s))


@dataclass(frozen=True, slots=True)
class OpenAttempt:
    """An admitted attempt the ledger counted for its expected run, until it ends (:meth:`CarbonLedger.end`).
    ``counted.moved``: whether this attempt or an earlier counted one of its job was placed away from the
    baseline's site (the job is then counted once in ``moved``)."""

    attempt: int
    counted: Counted
    admitted_ts: float  # POSIX seconds, the broker's clock

    def doc(self) -> list[float | int | bool]:
        c = self.counted
        return [self.attempt, c.kwh, c.grams, c.agnostic_grams, c.expected_s, self.admitted_ts, c.moved]

    @classmethod
    def from_doc(cls, doc: object) -> OpenAttempt:
        if not (isinstance(doc, list) and len(doc) == 7 and isinstance(doc[6], bool)
                and type(doc[0]) is int and doc[0] >= 0
                and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in doc[1:6])
                and min(doc[1:4]) >= 0 and doc[4] > 0):
            raise ValueError(f"an open attempt that cannot be read: {str(doc)[:80]}")
        attempt, kwh, grams, agnostic, expected_s, admitted_ts, moved = doc
        return cls(attempt, Counted(float(kwh), float(grams), float(agnostic), moved, float(expected_s)),
                   float(admitted_ts))


@dataclass(slots=True)
class CarbonLedger:
    jobs: int = 0  # distinct jobs counted
    energy_kwh: float = 0.0
    grams: float = 0.0
    agnostic_grams: float = 0.0
    moved: int = 0  # jobs one of whose counted attempts went to another site than the baseline's
    admissions: int = 0  # attempts counted (a job admitted again counts again here)
    open: dict[str, OpenAttempt] = field(default_factory=dict)  # job id -> its attempt counted, not ended yet
    # Job id -> its attempt sent to its site, valued, not counted yet (its ``admitted_ts``: when it was sent): counted
    # once the broker records its admission (:meth:`admit`), or at its end where that came first (a site's report
    # of it running, or done, that overtook the answer to the dispatch).
    dispatching: dict[str, OpenAttempt] = field(default_factory=dict)
    # Jobs between two attempts that an earlier counted attempt already counted (requeued, preempted): job id ->
    # whether one of them was moved. Admitted again, such a job is not counted again in ``jobs``.
    returning: dict[str, bool] = field(default_factory=dict)
    revision: int = field(default=0, compare=False)  # counts changes: the broker saves the ledger when it changed
    # When the broker in charge last saved the ledger (POSIX seconds, its clock; None: a document without it): it
    # had heard of no end of the attempts open in it by then (:meth:`state`'s ``seen_at``).
    seen_ts: float | None = field(default=None, compare=False)

    def add(self, job_id: str, attempt: int, counted: Counted, admitted_ts: float) -> None:
        """Count an attempt :func:`assess` valued when its site admitted it (at ``admitted_ts``), for its
        expected run, and remember it until it ends (:meth:`end`)."""
        held = self.open.get(job_id)
        if held is not None:  # an end this ledger did not hear of: that attempt ended before this admission
            self.end(job_id, held.attempt, admitted_ts, requeued=True)
        moved_before = self.returning.pop(job_id, None)
        self.jobs += moved_before is None
        self.moved += counted.moved and not moved_before
        self.admissions += 1
        self._count(counted)
        self.open[job_id] = OpenAttempt(attempt, Counted(counted.kwh, counted.grams, counted.agnostic_grams,
                                                         bool(counted.moved or moved_before), counted.expected_s),
                                        admitted_ts)
        self.revision += 1

    def dispatch(self, job_id: str, attempt: int, counted: Counted, sent_ts: float) -> None:
        """``job_id``'s ``attempt``, valued ``counted``, is being sent to its site (at ``sent_ts``): counted once
        the site admits it (:meth:`admit`)."""
        self.dispatching[job_id] = OpenAttempt(attempt, counted, sent_ts)
        self.revision += 1

    def admit(self, job_id: str, attempt: int, admitted_ts: float) -> Counted | None:
        """Count ``job_id``'s ``attempt``, dispatched (:meth:`dispatch`), as admitted at ``admitted_ts``
        (:meth:`add`). Returns what it added, or None where it was not being dispatched (not valued, or counted
        already)."""
        sent = self.dispatching.get(job_id)
        if sent is None or sent.attempt != attempt:
            return None
        del self.dispatching[job_id]
        self.add(job_id, attempt, sent.counted, admitted_ts)
        return sent.counted

    def undispatch(self, job_id: str, attempt: int) -> None:
        """``job_id``'s ``attempt`` left its site before its admission was recorded or heard of: not counted."""
        sent = self.dispatching.get(job_id)
        if sent is not None and sent.attempt <= attempt:
            del self.dispatching[job_id]
            self.revision += 1

    def end(self, job_id: str, attempt: int, ended_ts: float, requeued: bool,
            ran_s: float = 0.0) -> Counted | None:
        """``job_id``'s ``attempt`` ended at ``ended_ts`` (POSIX seconds): if the ledger counted it, correct its
        figures to the time it held its GPUs (counted x ran / expected: the unrun part taken back, an overrun
        charged; ran: from its admission to ``ended_ts``, or ``ran_s``, the run its site reported, where longer:
        an admission the broker recorded late), and remember the job as counted while it is ``requeued`` (it may
        be admitted again). An earlier counted attempt whose end was not heard (a later one, not counted, is
        ending) is taken as ended by then. Returns the overrun added (what the Prometheus counters, which never go down, add), or None."""
        held = self.open.get(job_id)
        if held is None or held.attempt > attempt:
            return None
        del self.open[job_id]
        if requeued:
            self.returning[job_id] = held.counted.moved
        ran_s = max(ended_ts - held.admitted_ts, ran_s if held.attempt == attempt else 0.0, 0.0)
        factor = ran_s / held.counted.expected_s - 1.0 if held.counted.expected_s > 0 else 0.0
        self._count(held.counted.scaled(factor))
        self.revision += 1
        return held.counted.scaled(factor) if factor > 0 else None

    def forget(self, job_id: str) -> None:
        """``job_id`` ended for good (cancelled or failed while in the queue): it will not be admitted again."""
        if self.returning.pop(job_id, None) is not None:
            self.revision += 1

    def _count(self, c: Counted) -> None:
        # (a correction that takes a whole attempt back may leave a rounding error below 0)
        self.energy_kwh = max(self.energy_kwh + c.kwh, 0.0)
        self.grams = max(self.grams + c.grams, 0.0)
        self.agnostic_grams = max(self.agnostic_grams + c.agnostic_grams, 0.0)

    def state(self, seen_ts: float | None = None) -> dict[str, object]:
        """The totals, the open attempts and the jobs between attempts, as the store keeps them
        (:meth:`restore` reads them back). An open attempt is a list: attempt, kWh, grams, agnostic grams,
        expected seconds, admitted at (POSIX seconds), moved. Beside them, keys that earlier releases read past:
        ``dispatching`` (attempts sent to their site, not counted yet, as open ones, sent at for admitted at) where
        there are any, and ``seen_at`` (``seen_ts``: POSIX seconds, when the broker in charge saves it) where
        given."""
        doc: dict[str, object] = {
            "v": 1, "format": LEDGER_VERSION, "jobs": self.jobs, "admissions": self.admissions,
            "energy_kwh": self.energy_kwh, "grams": self.grams, "agnostic_grams": self.agnostic_grams,
            "moved": self.moved, "open": {job_id: a.doc() for job_id, a in self.open.items()},
            "returning": self.returning}
        if self.dispatching:
            doc["dispatching"] = {job_id: a.doc() for job_id, a in self.dispatching.items()}
        if seen_ts is not None:
            doc["seen_at"] = seen_ts
        return doc

    @classmethod
    def restore(cls, doc: object) -> CarbonLedger:
        """The ledger from :meth:`state`'s document (``"v": 1`` with ``format`` 2, or ``"v": 2``), or from one of
        version 1 without ``format`` (totals only, where ``jobs`` counted admissions; it had no open attempts, so
        there is nothing to correct); ValueError when it is not one (a count below 0, a total that is not a finite
        number, an open attempt that cannot be read)."""
        if not isinstance(doc, dict) or doc.get("v") not in (1, LEDGER_VERSION):
            raise ValueError(f"not a carbon ledger document of version 1 or {LEDGER_VERSION}")
        # (``"v": 2`` alone: written by this release before it wrote ``format``, which earlier releases cannot read)
        version = LEDGER_VERSION if doc["v"] == LEDGER_VERSION else doc.get("format", 1)
        if version not in (1, LEDGER_VERSION):
            raise ValueError(f"a carbon ledger document of format {str(version)[:20]}, where this release reads 1 "
                             f"or {LEDGER_VERSION}")
        try:
            ledger = cls(int(doc["jobs"]), float(doc["energy_kwh"]), float(doc["grams"]),
                         float(doc["agnostic_grams"]), int(doc["moved"]))
            if version == 1:
                ledger.admissions = ledger.jobs
            else:
                ledger.admissions = int(doc["admissions"])
                opened, returning = doc["open"], doc["returning"]
                if not (isinstance(opened, dict) and isinstance(returning, dict)
                        and all(isinstance(m, bool) for m in returning.values())):
                    raise ValueError("open or returning is not an object of jobs")
                ledger.open = {job_id: OpenAttempt.from_doc(a) for job_id, a in opened.items()}
                ledger.returning = dict(returning)
                sent, seen = doc.get("dispatching", {}), doc.get("seen_at")
                if not isinstance(sent, dict):
                    raise ValueError("dispatching is not an object of jobs")
                ledger.dispatching = {job_id: OpenAttempt.from_doc(a) for job_id, a in sent.items()}
                if seen is not None:
                    if not (isinstance(seen, int | float) and not isinstance(seen, bool) and math.isfinite(seen)):
                        raise ValueError(f"seen_at is not a number of seconds: {str(seen)[:40]}")
                    ledger.seen_ts = float(seen)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a carbon ledger document that cannot be read: {e}") from None
        totals = (ledger.energy_kwh, ledger.grams, ledger.agnostic_grams)
        if min(ledger.jobs, ledger.moved, ledger.admissions) < 0 or not all(math.isfinite(t) and t >= 0 for t in totals):
            raise ValueError("a carbon ledger document with a negative or non-finite total")
        return ledger

    def as_dict(self) -> dict[str, float | int]:
        saved = self.agnostic_grams - self.grams
        return {
            "jobs": self.jobs, "energy_kwh": round(self.energy_kwh, 6), "grams": round(self.grams, 3),
            "agnostic_grams": round(self.agnostic_grams, 3), "saved_grams": round(saved, 3),
            "saved_fraction": round(saved / self.agnostic_grams, 6) if self.agnostic_grams > 0 else 0.0,
            "moved_jobs": self.moved, "admissions": self.admissions, "open_attempts": len(self.open),
        }


def agnostic_choice(placement: Placement) -> int:
    """The site index the decision would have picked without its carbon terms."""
    feasible = placement.feasible
    if len(feasible) <= 1 or not any(t.scorer in CARBON_SCORERS for t in placement.terms):
        return placement.site
    totals = placement.totals.astype(np.float64, copy=True)
    for term in placement.terms:
        if term.scorer in CARBON_SCORERS:
            totals -= term.weight * np.nan_to_num(term.normalised, nan=0.0)
    where = np.flatnonzero(feasible == placement.site)
    if where.size and totals[where[0]] >= totals.max() - TIE_EPSILON:
        return placement.site
    return int(feasible[int(np.argmax(totals))])
