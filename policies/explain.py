"""Turn a placement into a compact, JSON-ready record, and a record into a per-site explanation.

The record keeps the arrays the decision saw (failure masks, free GPUs, memory, every score term), so
``render`` can explain any site later without re-running the decision. Recording costs a few list
conversions; rendering builds one verdict per site and runs only when someone asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from broker import ids
from broker.models import Decision, ScoreTerm, SiteVerdict
from policies.filters import Filter
from policies.pipeline import TIE_EPSILON, Pipeline, Placement
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot

RECORD_VERSION = 1


def record(pipeline: Pipeline, placement: Placement, snap: Snapshot) -> dict[str, Any]:
    """A compact record of ``placement``; call it before the placement is assumed into ``snap``."""
    req = placement.request
    if req.model is not None:
        col = MODEL_INDEX[req.model]
        free = snap.free_gpus[:, col]
        shared = snap.shared_free_milli[:, col]
        memory = snap.memory_gib[:, col]
    else:
        usable = snap.memory_gib >= req.memory_gib if req.memory_gib else snap.total_gpus > 0
        free = np.where(usable, snap.free_gpus, 0).max(axis=1)
        shared = np.where(usable, snap.shared_free_milli, 0).max(axis=1)
        memory = snap.memory_gib.max(axis=1)
    feasible = placement.failures == 0
    return {
        "v": RECORD_VERSION,
        "decided_at": snap.now.isoformat(),
        "sites": list(snap.sites),
        "regions": list(snap.regions),
        "filters": [f.code for f in pipeline.filters],
        "failures": placement.failures.tolist(),
        "free": free.tolist(),
        "shared": shared.tolist(),
        "memory_gib": memory.astype(float).tolist(),
        "excluded": sorted(req.excluded_sites),
        "terms": [
            {"scorer": t.scorer, "weight": t.weight, "raw": t.raw.tolist(), "normalised": t.normalised.tolist()}
            for t in placement.terms
        ],
        "totals": [float(x) if ok else None for x, ok in zip(placement.totals.tolist(), feasible.tolist())],
        "site": snap.sites[placement.site] if placement.placed else None,
        "model": ids.GPU_MODEL_IDS[placement.model] if placement.placed else None,
    }


@dataclass(frozen=True, slots=True)
class _View:
    free: list[int]
    shared: list[int]
    memory_gib: list[float]
    regions: list[str]


def render(
    rec: dict[str, Any],
    req: JobRequest,
    filters: dict[str, Filter],
    attempt: int,
    deferred_until: datetime | None = None,
) -> Decision:
    """Explain a record: every site with its rejection reasons, or its score terms and total."""
    view = _View(rec["free"], rec["shared"], rec["memory_gib"], rec["regions"])
    codes: list[str] = rec["filters"]
    verdicts: list[SiteVerdict] = []
    rejected_by: dict[str, int] = {}
    for i, site in enumerate(rec["sites"]):
        mask = rec["failures"][i]
        if mask:
            reasons = []
            for bit, code in enumerate(codes):
                if mask >> bit & 1:
                    f = filters.get(code)
                    text = f.describe(req, view, i) if f is not None else "rejected"
                    reasons.append(f"{code}: {text}")
                    rejected_by[code] = rejected_by.get(code, 0) + 1
            verdicts.append(SiteVerdict(site=site, feasible=False, reasons=reasons))
            continue
        terms = [
            ScoreTerm(
                scorer=t["scorer"],
                raw=t["raw"][i],
                normalised=t["normalised"][i],
                weight=t["weight"],
                weighted=t["weight"] * t["normalised"][i],
            )
            for t in rec["terms"]
        ]
        verdicts.append(SiteVerdict(site=site, feasible=True, terms=terms, score=rec["totals"][i]))

    n_feasible = sum(v.feasible for v in verdicts)
    if rec["site"] is not None:
        outcome = "placed"
        score = rec["totals"][rec["sites"].index(rec["site"])]
        tied = [v.site for v in verdicts if v.feasible and v.site != rec["site"] and v.score >= score - TIE_EPSILON]
        summary = (
            f"placed on {rec['site']} ({rec['model']}, score {score:.3f}): "
            f"best of {n_feasible} feasible of {len(verdicts)} sites"
        )
        if tied:
            summary += f"; tied with {', '.join(tied)}, and ties go to the first site by name"
    elif deferred_until is not None:
        outcome = "deferred"
        summary = f"deferred until {deferred_until.isoformat()}"
    else:
        outcome = "unplaceable"
        if not verdicts:
            summary = "no site is registered"
        else:
            counts = ", ".join(f"{n} {code}" for code, n in sorted(rejected_by.items(), key=lambda kv: -kv[1]))
            summary = f"no site can take the job now ({counts}); it stays queued and is decided again"
    return Decision(
        job_id=req.job_id,
        attempt=attempt,
        decided_at=datetime.fromisoformat(rec["decided_at"]),
        outcome=outcome,
        site=rec["site"],
        deferred_until=deferred_until,
        summary=summary,
        sites=verdicts,
    )
