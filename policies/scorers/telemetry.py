"""Telemetry: prefer sites whose GPUs run cooler and whose queues are short.

Raw value: a penalty, lower is better: the hottest GPU's temperature above 60 °C in units of 25 °C
(0 at or below 60 °C, 1 at 85 °C, where data-centre GPUs begin to throttle their clocks), plus the site's
queue depth per GPU it has. Sites that report no telemetry score 0 (no penalty). Clock-throttle reasons
are not in the penalty: a site's report (``SiteState.telemetry``) does not carry them; the NVML collector
(``adapters.nvml``) reads them per GPU, but no site adapter sends its samples yet, and the hottest GPU's
temperature stands for the heat that throttles clocks. Weight from the profile (``balanced`` 0.1,
``fast`` 0.25); 0 turns it off.
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
    return heat + queue
