"""The carbon the broker's choices saved against a carbon-agnostic baseline (``GET /v1/carbon``, the
dashboard's headline, ``heliotrope_placed_carbon_grams_total`` and
``heliotrope_placed_carbon_agnostic_grams_total``).

For each placement its site admitted (counted when the site says so: a placement the site refuses, or
one whose dispatch fails, is routed again and counted once, where it runs) the baseline is the site the same decision would have chosen with its carbon terms
(the ``carbon`` and ``carbon_now`` scorers) left out: every other term (price, latency, follow-the-sun,
free GPUs...) weighted as configured, among the same feasible sites. When the chosen site ties for first
without the carbon terms, the baseline is the chosen site and nothing is claimed.

Estimate, in grams of CO2e: energy = GPUs charged x the placed model's board power (TDP) x the job's
expected duration; emissions = energy x the grid intensity each site had at the moment of the decision.
Both sites are charged the same energy (the placed model's power). What is counted is each admission, for its
whole expected run (of a job resumed from a checkpoint, the rest of it): an attempt that ends early is not
taken back, so a job preempted, moved, lost with its site or failed with attempts left, and admitted again, is
counted again (``jobs`` counts admissions, not distinct jobs). Savings from deferring a job to a
cleaner hour are not in this figure: it compares sites at the same moment, so it never credits a forecast
that may not come true. The leader keeps the totals in its database (``broker_state``) at the end of a
pass once they changed, at most every 10 s, and when it stops, so they run on across restarts and takeovers
(a crash loses at most the last 10 s of them); replicas that do not lead pass ``GET /v1/carbon`` on to the leader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies.pipeline import TIE_EPSILON, Placement
from policies.snapshot import TDP_KW, Snapshot

CARBON_SCORERS = frozenset({"carbon", "carbon_now"})


@dataclass(frozen=True, slots=True)
class Counted:
    """What one placement adds to the ledger: kWh, grams at its site and at the baseline's, and whether the
    two differ."""

    kwh: float
    grams: float
    agnostic_grams: float
    moved: bool


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
    return Counted(kwh, kwh * here, kwh * there, baseline != chosen)


@dataclass(slots=True)
class CarbonLedger:
    jobs: int = 0
    energy_kwh: float = 0.0
    grams: float = 0.0
    agnostic_grams: float = 0.0
    moved: int = 0  # placements whose site differs from the baseline's

    def add(self, counted: Counted) -> None:
        """Count a placement :func:`assess` valued (when its site admitted it)."""
        self.jobs += 1
        self.energy_kwh += counted.kwh
        self.grams += counted.grams
        self.agnostic_grams += counted.agnostic_grams
        self.moved += counted.moved

    def state(self) -> dict[str, float | int]:
        """The totals, as the store keeps them (:meth:`restore` reads them back)."""
        return {"v": 1, "jobs": self.jobs, "energy_kwh": self.energy_kwh, "grams": self.grams,
                "agnostic_grams": self.agnostic_grams, "moved": self.moved}

    @classmethod
    def restore(cls, doc: object) -> CarbonLedger:
        """Totals from :meth:`state`'s document; ValueError when it is not one (a count below 0, a total
        that is not a finite number)."""
        if not isinstance(doc, dict) or doc.get("v") != 1:
            raise ValueError("not a carbon ledger document of version 1")
        try:
            ledger = cls(int(doc["jobs"]), float(doc["energy_kwh"]), float(doc["grams"]),
                         float(doc["agnostic_grams"]), int(doc["moved"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a carbon ledger document that cannot be read: {e}") from None
        totals = (ledger.energy_kwh, ledger.grams, ledger.agnostic_grams)
        if min(ledger.jobs, ledger.moved) < 0 or not all(math.isfinite(t) and t >= 0 for t in totals):
            raise ValueError("a carbon ledger document with a negative or non-finite total")
        return ledger

    def as_dict(self) -> dict[str, float | int]:
        saved = self.agnostic_grams - self.grams
        return {
            "jobs": self.jobs, "energy_kwh": round(self.energy_kwh, 6), "grams": round(self.grams, 3),
            "agnostic_grams": round(self.agnostic_grams, 3), "saved_grams": round(saved, 3),
            "saved_fraction": round(saved / self.agnostic_grams, 6) if self.agnostic_grams > 0 else 0.0,
            "moved_jobs": self.moved,
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
