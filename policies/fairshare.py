"""Two-phase, time-based fair share of one site's GPUs (used by ``policies.quota``).

What it computes
    Each tenant's *fair share* in GPUs, a function of what every tenant demands now (running + waiting).

    1. Guarantees first: ``deserved = min(demand, guaranteed)``.
    2. The rest, ``C - sum(deserved)``, is divided among tenants whose demand is not yet met, by
       water-filling in proportion to a *share weight*, each capped at ``min(demand, guaranteed + burst)``.

    Phase 1 is never scaled down: if the guarantees a site hands out sum to more than it has, the shares do
    too (as KAI-scheduler does), and phase 2 then has nothing to divide.

The share weight (``FairSharePolicy.mode``)
    - ``instant``: the tenant's ``fair_share_weight`` alone.
    - ``time``: the weight moved by the tenant's decayed past usage, with KAI-scheduler's formula
      (``pkg/scheduler/plugins/proportion/resource_division/resource_division.go``, ``calcShareWeights``;
      design in ``docs/developer/designs/time-aware-fairness/time-aware-fairness.md``, user docs in
      ``docs/timeaware/README.md``, github.com/NVIDIA/KAI-Scheduler)::

          W'_i = w_i / sum(w_j over tenants still unsatisfied in this round)
          U'_i = decayed GPU-seconds of i over the window / decayed GPU-seconds the site could have given
          P_i  = max(0, W'_i + k * (W'_i - U'_i))           k = FairSharePolicy.k (KAI's kValue)
          share of the round's capacity = P_i / sum(P_j)

      With no past usage it is the ``instant`` division; a tenant that used more than its weight's fraction
      of the site gets less of what is left over, one that used less gets more. Normalising usage by the
      site's capacity over the same (decayed) period, not by total usage, means using an otherwise idle
      site costs little. Under constant demand the division converges to the weights: with the site full,
      sum(U') = 1 and sum(P) = 1, so a steady allocation fraction a_i satisfies a_i = (1+k)W'_i - k*a_i,
      i.e. a_i = W'_i. Where every remaining tenant's P is 0 (all used far more than their weight) KAI
      stops dividing; here the round falls back to the plain weights so idle capacity is still shared out.
    - ``off``: no division by weight: a fair share is the guarantee part only (phase 1), so "over its
      share" means "borrowing above its guarantee". ``policies.quota`` then orders by priority and arrival.

    Rounds are progressive filling: every tenant whose remaining need fits in its proportional part is
    satisfied and leaves, the weights are renormalised over those left (W' depends on who is left, as in
    KAI), and the last round hands the rest out in proportion. It takes as many rounds as there are
    distinct levels at which tenants saturate (usually one to three), not one per tenant.

Usage over time (:class:`UsageLedger`)
    GPU-seconds per account in buckets ``reweight_h`` long. A tenant's decayed usage at a reweight boundary
    ``E`` is ``sum(bucket × 0.5 ** ((E - bucket midpoint) / half_life))`` over the buckets whose midpoint lies
    in ``[E - window_h, E)``. Shares are re-weighted at each boundary (``floor(now / reweight_h)``) and the
    usage weights stay fixed until the next one; a change of demand re-runs phases 1 and 2 only. Usage
    accrues on change: each account's open interval (its GPUs held since its last change) is closed when it
    starts or stops a job, and every open interval is closed at a reweight boundary when weights are computed,
    so no ``advance(now)`` call is needed. The site's own capacity is integrated the same way from the first
    moment the ledger saw, which normalises usage (U').

Units: GPUs (fractions count as their share), GPU-seconds, POSIX seconds. Turn it off with
``FairSharePolicy(mode="off")``; ``mode="instant"`` or ``k=0`` keeps weights but ignores history.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Claim:
    """One tenant's standing in a division: what it is guaranteed, may hold at most, weighs, wants, used."""

    guaranteed_gpus: float
    limit_gpus: float  # guaranteed + burst; math.inf for no limit
    weight: float
    demand_gpus: float
    usage_fraction: float = 0.0  # U': decayed usage over decayed capacity, 0..1


def weight_fractions(weights: Sequence[float]) -> list[float]:
    """Each weight over their sum (none where the sum is not above 0). Weights near the largest float are taken
    over the largest first: their sum overflows, their ratios do not."""
    total = sum(weights)
    if not math.isfinite(total):
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    return [w / total for w in weights] if total > 0 else []


def divide(capacity_gpus: float, claims: Sequence[Claim], k: float, *, by_weight: bool = True) -> list[float]:
    """Fair share in GPUs of each claim, in order. ``k`` = 0 ignores usage; ``by_weight`` False stops after
    phase 1 (mode ``off``)."""
    n = len(claims)
    shares = [0.0] * n
    need = [0.0] * n
    remaining = capacity_gpus
    for i, c in enumerate(claims):
        want = min(max(c.demand_gpus, 0.0), c.limit_gpus)
        first = min(want, c.guaranteed_gpus)
        shares[i] = first
        need[i] = want - first
        remaining -= first
    if not by_weight or remaining <= EPS:
        return shares
    active = [i for i in range(n) if need[i] > EPS and claims[i].weight > 0]
    while active and remaining > EPS:
        fractions = weight_fractions([claims[i].weight for i in active])
        portions = [max(0.0, w + k * (w - claims[i].usage_fraction)) if k else w
                    for i, w in zip(active, fractions, strict=True)]
        total_p = sum(portions)
        if total_p <= EPS:  # everyone left used far more than its weight: share by weight alone
            portions = fractions
            total_p = 1.0
        satisfied = []
        still = []
        for i, p in zip(active, portions, strict=True):
            part = remaining * p / total_p
            (satisfied if need[i] <= part + EPS else still).append((i, part))
        if not satisfied:
            for i, part in still:
                shares[i] += part
            break
        for i, _ in satisfied:
            shares[i] += need[i]
            remaining -= need[i]
        active = [i for i, _ in still]
    return shares


class UsageLedger:
    """GPU-seconds per account in fixed buckets, and decayed sums at reweight boundaries."""

    __slots__ = ("bucket_s", "window_s", "half_life_s", "origin", "_buckets")

    def __init__(self, bucket_s: float, window_s: float, half_life_s: float) -> None:
        if bucket_s <= 0 or window_s <= 0 or half_life_s <= 0:
            raise ValueError("bucket, window and half-life must all be positive durations")
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.half_life_s = half_life_s
        self.origin: float | None = None  # the first moment seen; capacity is integrated from here
        self._buckets: dict[Hashable, dict[int, float]] = {}

    def add(self, key: Hashable, gpus: float, t0: float, t1: float) -> None:
        """``gpus`` held by ``key`` from ``t0`` to ``t1`` (POSIX seconds), split at bucket boundaries."""
        if gpus <= 0 or t1 <= t0:
            return
        buckets = self._buckets.setdefault(key, {})
        r = self.bucket_s
        while t0 < t1:
            i = math.floor(t0 / r)
            end = min((i + 1) * r, t1)
            buckets[i] = buckets.get(i, 0.0) + gpus * (end - t0)
            t0 = end

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move ``old``'s history to ``new`` (a tenant's account changed key, e.g. its quota changed model)."""
        moved = self._buckets.pop(old, None)
        if moved:
            into = self._buckets.setdefault(new, {})
            for i, v in moved.items():
                into[i] = into.get(i, 0.0) + v

    def take(self, other: UsageLedger) -> None:
        """``other``'s history (and first moment) in place of this one's (a book rebuilt takes its predecessor's)."""
        self.origin = other.origin
        self._buckets = {key: dict(buckets) for key, buckets in other._buckets.items()}

    def buckets(self) -> dict[Hashable, dict[int, float]]:
        """A copy of the GPU-seconds per account per period index."""
        return {key: dict(buckets) for key, buckets in self._buckets.items()}

    def replace(self, buckets: Mapping[Hashable, Mapping[int, float]], origin: float | None) -> None:
        """``buckets`` (as :meth:`buckets` gives them) and ``origin`` in place of this ledger's history."""
        self.origin = origin
        self._buckets = {key: {int(i): float(v) for i, v in b.items() if v > 0} for key, b in buckets.items() if b}

    def factors(self, epoch: int) -> dict[int, float]:
        """Decay factor per bucket index counted at the boundary ``epoch × bucket_s``: the buckets whose middle
        lies within the window, and at least the last one (a window shorter than half a bucket would count
        no usage at all, and keep every bucket)."""
        r = self.bucket_s
        boundary = epoch * r
        first = min(math.ceil((boundary - self.window_s) / r - 0.5), epoch - 1)
        return {i: 0.5 ** ((boundary - (i + 0.5) * r) / self.half_life_s) for i in range(first, epoch)}

    def decayed(self, factors: dict[int, float]) -> dict[Hashable, float]:
        """Decayed GPU-seconds per account; forgets buckets older than the window."""
        out: dict[Hashable, float] = {}
        first = min(factors) if factors else 0
        for key, buckets in list(self._buckets.items()):
            stale = [i for i in buckets if i < first]
            for i in stale:
                del buckets[i]
            if not buckets:
                del self._buckets[key]
                continue
            out[key] = sum(v * factors.get(i, 0.0) for i, v in buckets.items())
        return out

    def capacity(self, gpus: float, factors: dict[int, float]) -> float:
        """Decayed GPU-seconds a site of ``gpus`` GPUs could have given over the window (since ``origin``)."""
        if self.origin is None:
            return 0.0
        r = self.bucket_s
        total = 0.0
        for i, f in factors.items():
            held = (i + 1) * r - max(i * r, self.origin)
            if held > 0:
                total += min(held, r) * f
        return gpus * total
