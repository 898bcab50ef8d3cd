"""Placement filters, one rule per module. A filter answers, for every site at once, whether the site can
take the job (a boolean array over the snapshot's sites, or ``None`` when every site passes, which saves
the work), and describes in words why a site could not.

The pipeline records every failing filter of every site as a bit, so "why not there?" always has an
answer. A filter is turned off by leaving it out of the pipeline's filter list. A filter that looks at free
capacity may also offer ``passes_fit(fit)``, the same answer from the decision's shared
:class:`~policies.filters.gpu_fit.Fit`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from policies.snapshot import JobRequest, Snapshot


class FitView(Protocol):
    """The per-site figures a filter's description may quote, as the decision saw them."""

    free: list[int]
    shared: list[int]
    memory_gib: list[float]
    regions: list[str]


class Filter(Protocol):
    code: str  # a constant reason id, stable across releases

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None: ...

    def describe(self, req: JobRequest, view: FitView, site: int) -> str: ...


def standard_filters() -> tuple:
    """Every filter of this release, in the order a decision records them: health, cordon, region, latency
    objective, refused, site quota, GPU fit, tenant limit (each profile and baseline runs all of them; the tenant
    limit last, so that the filters before it keep the bits they have in records of earlier releases)."""
    from policies.filters.cordon import CordonFilter
    from policies.filters.gpu_fit import GpuFitFilter
    from policies.filters.health import HealthyFilter
    from policies.filters.latency import LatencyFilter
    from policies.filters.quota import QuotaFilter
    from policies.filters.region import RefusedFilter, RegionFilter
    from policies.filters.tenant_limit import TenantLimitFilter

    return (HealthyFilter(), CordonFilter(), RegionFilter(), LatencyFilter(), RefusedFilter(), QuotaFilter(),
            GpuFitFilter(), TenantLimitFilter())
