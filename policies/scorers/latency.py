"""Latency: prefer the site nearest the job's users and data.

Raw value: round-trip time from the job's ``origin_region`` to the site, in milliseconds (lower is
better); a site with no measurement ranks after every measured one; a job without an origin scores every
site alike (0). The objective itself (``latency_slo_ms``) is the hard filter ``latency-objective``; this
scorer only orders the sites that pass. Weight from the profile (``fast`` 1.0, ``balanced`` 0.25); 0 turns
it off.
"""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import Fit
from policies.scorers._usable import unknown_last
from policies.snapshot import JobRequest, Snapshot


class LatencyScorer:
    name = "latency"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        column = snap.origin_index.get(req.origin_region or "")
        if column is None:
            return snap.zeros()  # every site alike
        return snap.derived(("latency", column), _from_origin, snap.rtt_ms, column)

    def unknown_fit(self, fit: Fit) -> np.ndarray:
        """Where the raw value stands in for an unmeasured round trip from the job's origin."""
        column = fit.snap.origin_index.get(fit.req.origin_region or "")
        if column is None:
            return np.zeros(fit.snap.n_sites, dtype=bool)
        return np.isnan(fit.snap.rtt_ms[:, column])


def _from_origin(rtt_ms: np.ndarray, column: int) -> np.ndarray:
    return unknown_last(rtt_ms[:, column])
