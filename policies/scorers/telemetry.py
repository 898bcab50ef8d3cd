"""Telemetry: prefer sites whose GPUs run cooler and less throttled, and whose queues are short.

Raw value: a penalty, lower is better, the sum of three parts, each 0 when all is well:
- heat: the hottest GPU's temperature above 60 °C in units of 25 °C (0 at or below 60 °C, 1 at 85 °C, where
  data-centre GPUs begin to throttle their clocks);
- throttling: the share (0..1) of the site's GPUs whose clocks heat or power held down at the last sample
  (``Telemetry.throttled_pct``: thermal slowdown, hardware slowdown or the power brake, as NVML or DCGM
  reports them; neither an idle GPU's low clocks nor a busy GPU at its own power cap count), so a site with
  every GPU held down weighs as much as one at 85 °C;
- congestion: the site's queue depth per GPU it has.
A site that reports no telemetry, or no clock-event reasons, scores 0 for that part (no penalty: an
unmeasured site is not ranked below a measured one). Weight from the profile (``balanced`` 0.1, ``fast``
0.25, ``green`` and ``cheap`` 0.05); 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.snapshot import JobRequest, Snapshot

COOL_C = 60.0
THROTTLE_SPAN_C = 25.0


class TelemetryScorer:
    name = "telemetry"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        if snap.temperature_c.size != snap.n_sites:
            return snap.zeros()  # every site alike
        return snap.derived(("telemetry",), penalty, snap)


def penalty(snap: Snapshot) -> np.ndarray:
    """The raw value per site (the same for every job, so computed once per snapshot)."""
    heat = np.maximum(snap.temperature_c - COOL_C, 0.0) / THROTTLE_SPAN_C
    gpus = snap.total_gpus.sum(axis=1)
    queue = np.divide(snap.queue_depth, gpus, out=np.zeros(snap.n_sites), where=gpus > 0)
    throttled = snap.throttled if snap.throttled.size == snap.n_sites else 0.0
    return heat + throttled + queue
