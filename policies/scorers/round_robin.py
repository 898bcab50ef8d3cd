"""Round-robin: the next site after the last one placed on, in name order, that can take the job.

The baseline of the simplest federations. Raw value: how many steps after the last placement's site a site
comes in the cyclic name order (1 = next, n = the last site itself); lower is better. The cursor is the
snapshot's ``last_placed`` (carried from pass to pass). Weight 1 in ``baseline-round-robin``; on its own
the pipeline then takes the first feasible site after the cursor. 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies.snapshot import JobRequest, Snapshot


class RoundRobinScorer:
    name = "round_robin"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        n = snap.n_sites
        last = int(snap.last_placed[0])
        return (np.arange(n) - last - 1) % n + 1 if last >= 0 else np.arange(n) + 1
