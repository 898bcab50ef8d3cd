"""Most free GPUs: prefer the site with the most free GPUs the job could use, spreading load.

Raw value: free whole GPUs of the requested model (every model with enough memory per GPU when the job
names none), in GPUs. Higher is better. Weight from the profile (default 1.0); 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies import _scores
from policies.filters.gpu_fit import Fit
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot


class FreeGpusScorer:
    name = "free_gpus"
    higher_is_better = True

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        if req.model is not None:
            return snap.free_gpus[:, MODEL_INDEX[req.model]]
        return self.raw_fit(Fit(req, snap))

    def raw_fit(self, fit: Fit) -> np.ndarray:
        if fit.req.model is not None:
            return fit.snap.free_gpus[:, MODEL_INDEX[fit.req.model]]
        # Only the usable columns can add anything.
        return _scores.free_where(fit.free, fit.usable.mask)  # (fit.free * mask).sum(axis=1), compiled
