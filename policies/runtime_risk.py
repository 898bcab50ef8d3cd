"""The risk that a deferral makes a job miss its deadline, learned from how long finished jobs really ran.

A submitter's run time is an estimate; a deferred job that runs longer than estimated may miss a deadline it
would have met by starting at once. ``ShiftPolicy.duration_safety`` bounds the wait (latest start =
deadline - duration_safety × the estimate), but the same bound for every job either wastes the slack of the
many or risks the deadlines of the few. Pricing the risk does better: a later start must save, on top of
the objective's own bar, ``ShiftPolicy.miss_cost`` (kg CO2e or USD) for each whole unit of probability of a
miss it adds. A large job's deferral saves kilograms and may take a few points of risk; a small job's saves
grams and may take only a sliver.

The probability (:func:`miss_probability`)
    P(a job that starts at ``t`` misses its deadline ``D``) = P(actual run > D - t) = P(actual / estimate >
    (D - t) / estimate), read off the *empirical* distribution of ``log(actual / estimate)`` over the last
    finished jobs (:class:`RunTimeErrors`; ``Snapshot.run_time_errors``, sorted): the share of them that
    ran longer than that ratio. No distribution is assumed, so it holds for submitters who estimate well,
    badly, or always short. Until :data:`MIN_SAMPLES` jobs have finished nothing is priced and
    ``duration_safety`` alone guards the deadline.

The penalty (:func:`deferral_penalty`)
    For a start ``k`` whole hours after the hour containing now: ``miss_cost × max(P(miss | start then) -
    P(miss | start now), 0)``, so only the risk the wait *adds* is charged (a job whose estimate already
    leaves no room risks its deadline anyway). It is added to the objective of every later start in the
    time-shift search (:func:`policies.timeshift.plan`), which therefore still finds the least value,
    penalty included; the explanation of a deferral gives both probabilities.

The expected end (:func:`expected_ratio`)
    Of a job that has run ``r`` × its estimate so far: the median ``actual / estimate`` of the finished jobs
    that ran longer than ``r`` × theirs (in log terms). With ``ShiftPolicy.book_overruns`` the time-shift
    plan knows that a running job whose estimate has run out holds its GPUs until then, and a deferral onto
    them is planned again on what is expected free (``policies.timeshift.unless_it_slips``).

Caveat: jobs that overran their estimates by most are also the last to finish, so right after a change in
how submitters estimate, the window under-counts long overruns until they finish. Units: probabilities in
[0, 1]; times in POSIX seconds; ``miss_cost`` in the objective's unit per unit of probability.
Turning it off: ``miss_cost: 0`` (the default of :class:`~policies.timeshift.ShiftPolicy`).
"""

from __future__ import annotations

import math

import numpy as np

from policies._shift_search import _jit
from policies.snapshot import JobRequest

MIN_SAMPLES = 50
"""Finished jobs needed before the risk is priced: below it, one job's luck would set the price."""

KEEP = 2000
"""How many of the latest finished jobs :class:`RunTimeErrors` keeps: recent enough to follow a change in how
submitters estimate, enough for a probability of 1 in 200 to rest on ten jobs."""

_NONE = np.zeros(0)


class RunTimeErrors:
    """The last ``keep`` finished jobs' ``log(actual run time / estimate)``, in the order they finished.
    ``sorted()`` is what a snapshot carries (``Snapshot.run_time_errors``). Not thread-safe; one per
    scheduling loop."""

    __slots__ = ("_ring", "_count", "_sorted")

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._ring = np.empty(keep)
        self._count = 0
        self._sorted: np.ndarray | None = None

    def add(self, estimate_s: float, actual_s: float) -> None:
        """One finished job: the run time it was submitted with and how long it ran (a job with either not
        above 0 says nothing about the ratio and is ignored)."""
        if not (estimate_s > 0 and actual_s > 0 and math.isfinite(estimate_s) and math.isfinite(actual_s)):
            return
        self._ring[self._count % self._ring.size] = math.log(actual_s / estimate_s)
        self._count += 1
        self._sorted = None

    def __len__(self) -> int:
        return min(self._count, self._ring.size)

    def sorted(self) -> np.ndarray:
        """float64[len(self)], ascending (a new array after each ``add``; the same one until then)."""
        if self._sorted is None:
            self._sorted = np.sort(self._ring[:len(self)])
            self._sorted.flags.writeable = False  # every snapshot of a pass shares it
        return self._sorted


def miss_probability(errors: np.ndarray, room_s: np.ndarray, estimate_s: float) -> np.ndarray:
    """P(a job estimated at ``estimate_s`` runs longer than ``room_s``) for each entry of ``room_s`` (seconds
    from a start to the deadline; at or below 0: 1), from ``errors`` (sorted ``log(actual / estimate)``): the
    share of them above ``log(room_s / estimate_s)``."""
    if errors.size == 0:
        raise ValueError("no finished jobs to judge by: miss_probability needs at least one run-time error")
    room = np.asarray(room_s, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        bar = np.log(np.maximum(room, 0.0) / estimate_s)  # -inf where there is no room at all
    above = errors.size - np.searchsorted(errors, bar, side="right")
    return above / errors.size


def expected_ratio(errors: np.ndarray, ran_ratio: float) -> float | None:
    """How long a job that has already run ``ran_ratio`` × its estimate is expected to run in all, as a
    multiple of its estimate: over the finished jobs (``errors``, sorted ``log(actual / estimate)``) that ran
    longer than that (all of them where it has not run at all), the median of ``log(actual / estimate)``,
    as a ratio (for an even count, the geometric mean of the middle two). None when fewer than
    :data:`MIN_SAMPLES` jobs have finished or none of them ran that long (nothing to judge by)."""
    n = errors.size
    if n < MIN_SAMPLES:
        return None
    i = int(np.searchsorted(errors, math.log(ran_ratio), side="right")) if ran_ratio > 0 else 0
    if i >= n:
        return None
    mid = i + (n - i - 1) // 2  # the lower middle of errors[i:]
    return math.exp(0.5 * (float(errors[mid]) + float(errors[i + (n - i) // 2])))


def deferral_penalty(req: JobRequest, errors: np.ndarray, now_ts: float, hour0_ts: float, last_slot: int,
                     miss_cost: float) -> tuple[np.ndarray, np.ndarray]:
    """(penalty per start ``k`` = 0 .. ``last_slot`` whole hours after ``hour0_ts``, in the objective's unit;
    the probabilities of a miss: starting now first, then at each of those starts). Both empty when nothing
    is priced: ``miss_cost`` 0, fewer than :data:`MIN_SAMPLES` errors, or a request with no deadline or
    estimate. The probabilities are :func:`miss_probability`'s, in one compiled pass (a few microseconds for
    a week of starts)."""
    if not miss_cost > 0 or errors.size < MIN_SAMPLES or req.deadline_ts is None or not req.duration_s > 0:
        return _NONE, _NONE
    return _penalty(errors, float(req.deadline_ts), float(req.duration_s), float(now_ts), float(hour0_ts),
                    int(last_slot), float(miss_cost))


@_jit(inline="always")
def _share_above(errors: np.ndarray, room_s: float, estimate_s: float) -> float:
    """:func:`miss_probability` for one start: the share of ``errors`` above ``log(room_s / estimate_s)``."""
    if not room_s > 0:
        return 1.0
    i = np.searchsorted(errors, np.log(room_s / estimate_s), side="right")
    return (errors.shape[0] - i) / errors.shape[0]


@_jit()
def _penalty(errors: np.ndarray, deadline_ts: float, estimate_s: float, now_ts: float, hour0_ts: float,
             last_slot: int, miss_cost: float) -> tuple[np.ndarray, np.ndarray]:
    risk = np.empty(last_slot + 2)
    risk[0] = _share_above(errors, deadline_ts - now_ts, estimate_s)
    out = np.empty(last_slot + 1)
    for k in range(last_slot + 1):
        risk[k + 1] = _share_above(errors, deadline_ts - (hour0_ts + k * 3600.0), estimate_s)
        added = risk[k + 1] - risk[0]
        out[k] = miss_cost * added if added > 0 else 0.0
    return out, risk
