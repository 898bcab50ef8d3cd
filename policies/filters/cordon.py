"""Cordon: a site its operator has cordoned (``POST /v1/sites/{name}/cordon``) takes no new jobs; what runs
there runs on, and the site still reports its capacity and health. ``uncordon`` gives it back to routing."""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import JobRequest, Snapshot


class CordonFilter:
    code = "site-cordoned"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        if not snap.cordoned.size:
            return None  # no site is cordoned: every site passes, at no cost
        return snap.derived(("not-cordoned",), np.logical_not, snap.cordoned)

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        return "its operator cordoned the site: it takes no new jobs until uncordoned"
