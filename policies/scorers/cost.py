"""Cost: prefer the site where the job costs least.

Raw value: US dollars = price per GPU-hour of the cheapest model at the site that the job can use and that
has room now × GPUs held (``milli / 1000`` of one for a fractional job) × the job's expected duration in
hours. Lower is better; an unpriced site ranks after every priced one. Prices are the snapshot's
``usd_per_gpu_hour``: the site spec's static prices, or a price provider's when one is configured
(``broker.providers.prices``). Weight from the profile (``cheap`` 1.0, ``balanced`` 0.5); 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import Fit
from policies.scorers._usable import cheapest_known_last, unknown_price
from policies.snapshot import JobRequest, Snapshot


class CostScorer:
    name = "cost"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return self.raw_fit(Fit(req, snap))

    def raw_fit(self, fit: Fit) -> np.ndarray:
        # In the order of ``cheapest_with_room(req, snap) * req.charge * duration_s / 3600``, unknown last.
        return cheapest_known_last(fit, (fit.req.charge, fit.req.duration_s), 3600.0)

    def unknown_fit(self, fit: Fit) -> np.ndarray:
        """Where the raw value stands in for an unknown price (no priced model with room)."""
        return unknown_price(fit)
