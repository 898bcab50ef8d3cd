"""Site health: a site that is unhealthy, or that the broker has not heard from, takes no new jobs."""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import JobRequest, Snapshot


class HealthyFilter:
    code = "site-unhealthy"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return snap.healthy

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        return "site is not healthy (unreachable, or its last report is too old)"
