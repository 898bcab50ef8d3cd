"""Least loaded: prefer the site with the largest share of its usable GPUs free (earliest start).

The baseline of Slurm's federation and MultiKueue's all-at-once dispatch, where the job starts on the
cluster that can start it first: every site that passes the filters can start the job now, and among them
the least loaded is the one whose queue a real cluster would clear first. Raw value: free GPUs of the
models the job can use divided by the site's GPUs of those models (a fraction, 0..1); higher is better.
Weight 1 in ``baseline-least-loaded``; 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.filters.gpu_fit import Fit
from policies.snapshot import JobRequest, Snapshot


class LeastLoadedScorer:
    name = "least_loaded"
    higher_is_better = True

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return self.raw_fit(Fit(req, snap))

    def raw_fit(self, fit: Fit) -> np.ndarray:
        # Only the usable columns can add anything to either sum.
        snap, usable = fit.snap, fit.usable
        total = snap.derived(("usable-gpus", usable.key), usable.total, snap.total_gpus)
        free = (np.maximum(fit.free, 0) * usable.mask).sum(axis=1)
        return np.divide(free, total, out=np.zeros(snap.n_sites), where=total > 0)
