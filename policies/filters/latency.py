"""Latency objective: a job with ``latency_slo_ms`` runs only where the round-trip time from its
``origin_region`` is at most that. Units: milliseconds. A site with no measured RTT from the job's origin
cannot show it meets the objective and is rejected. Jobs without an objective pass everywhere (None).
Turn it off by leaving it out of the pipeline's filters."""

from __future__ import annotations

import math

import numpy as np

from policies.filters import FitView
from policies.snapshot import JobRequest, Snapshot


class LatencyFilter:
    code = "latency-objective"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        if req.latency_slo_ms is None:
            return None
        column = snap.origin_index.get(req.origin_region or "")
        if column is None:
            return np.zeros(snap.n_sites, dtype=bool)
        return snap.derived(("latency-objective", column, req.latency_slo_ms), _within, snap.rtt_ms[:, column],
                            req.latency_slo_ms)

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        rtt = getattr(view, "rtt_ms", None)  # None: a record of an earlier release, which kept no RTT
        if rtt is None:
            return (f"the RTT from {req.origin_region} is over the job's latency objective of "
                    f"{req.latency_slo_ms:g} ms (or not measured)")
        if not math.isfinite(rtt[site]):
            return (f"no RTT from {req.origin_region} to this site is measured, so it cannot show that it meets "
                    f"the job's latency objective of {req.latency_slo_ms:g} ms")
        return (f"the RTT from {req.origin_region} is {rtt[site]:g} ms, over the job's latency objective of "
                f"{req.latency_slo_ms:g} ms")


def _within(rtt_ms: np.ndarray, slo_ms: float) -> np.ndarray:
    return ~np.isnan(rtt_ms) & (rtt_ms <= slo_ms)
