"""Cheapest: prefer the site with the lowest price per GPU-hour of the GPUs the job can use.

SkyPilot's optimizer: the cheapest location with room, failing over to the next cheapest when it is full
(the filters remove full sites). Raw value: US dollars per GPU-hour of the cheapest model at the site that the job could use and that has
room for it now (the site spec's static price); lower is better; an unpriced site ranks after every
priced one. (The model a placement then uses is chosen by the pipeline: the smallest GPUs that fit.) Weight 1
in ``baseline-cheapest-first``; 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import Fit
from policies.scorers._usable import cheapest_known_last, unknown_price
from policies.snapshot import JobRequest, Snapshot


class CheapestScorer:
    name = "cheapest"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return self.raw_fit(Fit(req, snap))

    def raw_fit(self, fit: Fit) -> np.ndarray:
        return cheapest_known_last(fit)

    def unknown_fit(self, fit: Fit) -> np.ndarray:
        """Where the raw value stands in for an unknown price (no priced model with room)."""
        return unknown_price(fit)
