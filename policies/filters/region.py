"""Region constraints (data residency): the job's allowed regions (empty: any) and denied regions."""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import JobRequest, Snapshot


class RegionFilter:
    code = "region-not-allowed"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        if not req.allowed_regions and not req.denied_regions:
            return None
        # The same for every job with the same regions: computed once per snapshot and pair of sets.
        return snap.derived(("regions", req.allowed_regions, req.denied_regions), self._mask, req, snap)

    @staticmethod
    def _mask(req: JobRequest, snap: Snapshot) -> np.ndarray:
        table = np.fromiter(
            (
                (not req.allowed_regions or name in req.allowed_regions) and name not in req.denied_regions
                for name in snap.region_names
            ),
            dtype=bool,
            count=len(snap.region_names),
        )
        return table[snap.region_code]

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        region = view.regions[site]
        if region in req.denied_regions:
            return f"region {region} is denied by the job"
        return f"region {region} is not among the job's allowed regions ({', '.join(sorted(req.allowed_regions))})"


class RefusedFilter:
    """Sites that already refused the job's current attempt are skipped until the next attempt."""

    code = "site-refused"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        if not req.excluded_sites:
            return None
        ok = np.ones(snap.n_sites, dtype=bool)
        for name in req.excluded_sites:
            i = snap.index.get(name)
            if i is not None:
                ok[i] = False
        return ok

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        refusals = getattr(view, "refusals", None) or {}
        names = getattr(view, "sites", None)
        why = refusals.get(names[site]) if names is not None else None
        if why:
            return f"earlier, the site {why}; it is skipped until conditions change"
        return "site refused this job earlier; it is skipped until conditions change"
