"""Federation-wide tenant limits (:mod:`policies.tenant_limit`): a job whose start would take its tenant past the
GPUs the platform lets it hold across every site together waits, and every site says why. Units: GPUs, a
fractional job counting its share. Jobs of tenants without a limit pass everywhere (None), as do all jobs where no
limit is configured. Turn it off by configuring no limit (``broker.tenant_limits``, ``broker.default_tenant_limit``)."""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import JobRequest, Snapshot
from policies.tenant_limit import SOURCE_WORDS


class TenantLimitFilter:
    code = "tenant-limit"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        room = snap.tenant_room
        if room is None or room.fits(req.tenant, req.charge):
            return None
        return np.zeros(snap.n_sites, dtype=bool)

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        figures = getattr(view, "tenant_limit", None)  # [limit, held] as the decision saw them
        if figures is None:
            return f"tenant {req.tenant} holds as many GPUs across the federation as its limit allows"
        limit, held = figures
        where = SOURCE_WORDS[getattr(view, "tenant_limit_source", "config")].format(tenant=req.tenant)
        return (f"tenant {req.tenant} holds {held:g} GPUs across the federation and may hold at most {limit:g} "
                f"({where}); the job needs {req.charge:g}")
