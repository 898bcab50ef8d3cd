"""Site quotas, as the sites report them: skip a site whose quota for the job's tenant would refuse it.

A site that enforces quotas reports, per tenant, how many more GPUs its preemptible jobs may hold
(guarantee + burst, less what it holds) and how many more its non-preemptible jobs may hold without making
anyone's guarantee unreclaimable (``policies.quota``). A tenant the site does not list gets the site's
figures for unlisted tenants (none if the site refuses them); so does a tenant whose quota counts one GPU
model only, for a job on another model (a job naming no model passes: the site picks the model). Units:
GPUs, a fractional job counting its share. The site still decides (its figures may have moved since it reported); a refusal is recorded as the
reason and the job is routed again. Turn it off by leaving ``quota`` out of a profile's filters.
"""

from __future__ import annotations

import numpy as np

from policies.filters import FitView
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot

EPS = 1e-9


class QuotaFilter:
    code = "quota-refuses"

    def passes(self, req: JobRequest, snap: Snapshot) -> np.ndarray | None:
        quota = snap.quota
        if quota is None:
            return None
        room, np_room = quota.rooms(req.tenant)
        below = quota.own_below(req, MODEL_INDEX[req.model] if req.model is not None else None)
        if below is not None:
            room, np_room = self._beyond_limit(room, np_room, below)
        ok = self._fits(req, room, np_room)
        counted = quota.model.get(req.tenant) if req.tenant is not None else None
        if counted is not None:  # where its quota counts one model only, other models are not limited by it
            elsewhere = counted >= 0
            if req.model is None:  # the site picks the model: it decides
                ok = ok | elsewhere
            else:
                elsewhere &= counted != MODEL_INDEX[req.model]
                ok = np.where(elsewhere, self._fits(req, quota.unlisted_room, quota.unlisted_np_room), ok)
        return ok

    @staticmethod
    def _beyond_limit(room: np.ndarray, np_room: np.ndarray, below: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tenant's rooms counting the GPUs its own preemptible jobs of lower priority hold (``below``), which
        a site preempts for a job of its own of higher priority even where the tenant is at its limit. A site
        reports the non-preemptible room capped by the room: where it is below the room, the guarantees bound it,
        and preempting preemptible jobs frees none of what they reserve, so it stays; where the room bound it, it
        grows with the room (a hint: the guarantees may bound it in between, and the site decides)."""
        more = room + below
        return more, np.where(np_room < room - EPS, np_room, more)

    @staticmethod
    def _fits(req: JobRequest, room: np.ndarray, np_room: np.ndarray) -> np.ndarray:
        ok = room >= req.charge - EPS
        if not req.preemptible:
            ok &= np_room >= req.charge - EPS
        return ok

    def describe(self, req: JobRequest, view: FitView, site: int) -> str:
        room = getattr(view, "quota_room", None)
        np_room = getattr(view, "quota_np_room", None)
        if room is None or np_room is None:
            return f"the site's quota for tenant {req.tenant} refuses the job"
        listed = getattr(view, "quota_listed", True)
        who = f"tenant {req.tenant}" + ("" if listed else " (not in the site's quota list)")
        if room[site] < req.charge - EPS:
            return f"{who} may hold {max(room[site], 0.0):g} more GPUs here; the job needs {req.charge:g}"
        return (f"{who}'s non-preemptible jobs may hold {max(np_room[site], 0.0):g} more GPUs here without taking "
                f"another tenant's guarantee; the job needs {req.charge:g} (preemptible jobs may borrow more)")
