"""Spillover: a fixed site order; a job goes to the first site in it that has room.

MultiKueue's incremental dispatch and Karmada's ordered cluster affinities: fill the preferred cluster,
spill to the next. Raw value: the site's position in the configured order (0 = first; for the simulator's
default federation, the order of its zone list); lower is better. Weight 1 in ``baseline-spillover``; 0
turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.snapshot import JobRequest, Snapshot


class SpilloverScorer:
    name = "spillover"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return snap.rank if snap.rank.size == snap.n_sites else np.arange(snap.n_sites)
