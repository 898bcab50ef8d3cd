"""Carbon now: prefer the site whose grid is cleanest at this moment (no forecast, no waiting).

The carbon-greedy baseline: the lowest current grid intensity among the sites with room. Raw value: the
site's grid carbon intensity now, in g CO2e/kWh; lower is better; a site whose intensity is unknown ranks
after every site whose intensity is known. Weight 1 in ``baseline-carbon-greedy``; 0 turns it off.

Where the intensity comes from: the simulator sets ``Snapshot.carbon_g_per_kwh`` from the loaded carbon
data every hour. The live broker has no intensity source yet (carbon providers come with the routing
policies), so live, every site is unknown and this scorer ranks them all alike (first by name).
"""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import Fit
from policies.scorers._usable import unknown_last
from policies.snapshot import JobRequest, Snapshot


class CarbonNowScorer:
    name = "carbon_now"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        if snap.carbon_g_per_kwh.size != snap.n_sites:
            return snap.zeros()  # every site alike
        return snap.derived(("carbon-now",), unknown_last, snap.carbon_g_per_kwh)

    def unknown_fit(self, fit: Fit) -> np.ndarray:
        """Where the raw value stands in for an unknown intensity now."""
        snap = fit.snap
        if snap.carbon_g_per_kwh.size != snap.n_sites:
            return np.zeros(snap.n_sites, dtype=bool)
        return np.isnan(snap.carbon_g_per_kwh)
