"""Turn a placement into a compact, JSON-ready record, and a record into a per-site explanation.

The record keeps the arrays the decision saw (failure masks, free GPUs, memory, every score term's raw
values), so ``render`` can explain any site later without re-running the decision. Recording costs a few
array packings; rendering builds one verdict per site and runs only when someone asks.

Record versions (``v``): 3 keeps each term's raw values and whether lower is better, and ``render`` works
the normalised values and totals out again from them with the same arithmetic as the pipeline's compiled
pass (:func:`normalise`), so they are the decision's to the bit; the regions are each site's index into the
distinct region names. That is a third less than version 2, which stored the normalised values and totals
as well, and every region name once per site (156 KiB at a thousand sites and seven scorers, against 104).
``render`` reads both versions: records already stored keep their explanations. A term may also name the sites
whose raw value only stood in for an unknown one (``unknown``: a zone with no forecast, a site with no price),
which ``render`` gives no raw value; records without it (earlier releases') show the stand-ins as they did. The
record of a job with a latency objective keeps the round-trip time from its origin to each site (``rtt_ms``), which
the latency filter's reasons quote; records without it (earlier releases') give those reasons without the figure. A change to how the
pipeline normalises (``policies.pipeline.TIE_EPSILON`` included) needs a new record version, so that the
records already stored are read as they were decided.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from broker import ids
from broker.models import DeadlineRisk, Decision, DeferralPlan, ScoreTerm, SiteVerdict
from policies.filters import Filter
from policies.filters.gpu_fit import Fit
from policies.pipeline import TIE_EPSILON, Pipeline, Placement
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot
from policies.timeshift import Deferral, passed_over_text

RECORD_VERSION = 3
READABLE_VERSIONS = (2, 3)


class RecordVersionError(ValueError):
    """A decision record of a version this release does not read: written by a later release (a replica of
    it shares the database), or not a record at all."""


def pack(values: np.ndarray, dtype: str) -> str:
    """An array as base64 of its little-endian bytes: compact, and cheap to encode and decode."""
    return base64.b64encode(np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def unpack(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.dtype(dtype).newbyteorder("<"))


def record_deferral(pipeline: Pipeline, deferral: Deferral, snap: Snapshot) -> dict[str, Any]:
    """The record of a deferral: the profile's view of every site now, no site chosen, and the plan
    (``deferred``: site, start, objective values and the reason in words)."""
    rec = record(pipeline, deferral.placement, snap)
    rec["site"] = rec["model"] = None
    rec["deferred"] = deferral.as_dict(snap.sites)
    rec.update(_passed_over_record(deferral.passed_over, deferral.n_passed_over, snap))
    return rec


def record(pipeline: Pipeline, placement: Placement, snap: Snapshot) -> dict[str, Any]:
    """A compact record of ``placement``; call it before the placement is assumed into ``snap``.

    Per-site arrays are packed (``pack``). Each term keeps its raw values over every site and whether lower
    is better; the normalised values and totals over the feasible sites (whose failure mask is 0, in site
    order) are worked out again when the record is read (:func:`normalise`). Where a term's raw values are
    of a type the pipeline normalises on its other path (not float64 or integers: a custom scorer's), the
    record keeps the normalised values and totals as well, as version 2 did.
    """
    req = placement.request
    if req.model is not None:
        col = MODEL_INDEX[req.model]
        free = snap.free_gpus[:, col]
        shared = snap.shared_free_milli[:, col]
        memory = snap.memory_gib[:, col]
    else:
        usable = snap.memory_gib >= req.memory_gib if req.memory_gib else snap.has_model
        free = (snap.free_gpus * usable).max(axis=1)
        shared = (snap.shared_free_milli * usable).max(axis=1)
        memory = snap.memory_gib.max(axis=1)
    lower = pipeline.lower_is_better
    terms = placement.terms
    exact = all(_normalised_again(t.raw) for t in terms)
    unknown = _unknown_record(pipeline, placement, snap)
    return {
        "v": RECORD_VERSION,
        "decided_at": snap.now.isoformat(),
        **snap.derived(("record-sites",), _site_fields, snap),
        "filters": [f.code for f in pipeline.filters],
        "failures": pack(placement.failures, "u2"),
        "free": pack(free, "i4"),
        "shared": pack(shared, "i2"),
        "memory_gib": pack(memory, "f4"),
        "excluded": sorted(req.excluded_sites),
        "terms": [
            {"scorer": t.scorer, "weight": t.weight, "lower": lower[t.scorer], "raw": pack(t.raw, "f8"),
             **({} if exact else {"normalised": pack(t.normalised, "f8")}),
             **({"unknown": unknown[t.scorer]} if t.scorer in unknown else {})}
            for t in terms
        ],
        **({} if exact else {"totals": pack(placement.totals, "f8")}),
        "site": snap.sites[placement.site] if placement.placed else None,
        "model": ids.GPU_MODEL_IDS[placement.model] if placement.placed else None,
        **_quota_record(req, snap),
        **_tenant_record(req, snap),
        **_rtt_record(req, snap),
        **_passed_over_record(placement.passed_over, placement.n_passed_over, snap),
        **({"over_plan": True} if placement.over_plan else {}),
    }


def _unknown_record(pipeline: Pipeline, placement: Placement, snap: Snapshot) -> dict[str, str]:
    """Scorer name -> the sites whose raw value stands in for an unknown one (``Scorer.unknown_fit``: a zone
    with no forecast, a site with no price), as packed bits (``numpy.packbits``, little-endian bit order), for
    the terms that have any. The stand-in only ranks such a site after the known ones; it is no value in the
    scorer's units, so an explanation gives none there."""
    asks = [(w.scorer.name, w.scorer.unknown_fit) for w in pipeline.scorers if hasattr(w.scorer, "unknown_fit")]
    if not asks:
        return {}
    fit = placement.fit if placement.fit is not None else Fit(placement.request, snap)
    out = {}
    for name, unknown_fit in asks:
        mask = np.asarray(unknown_fit(fit), dtype=bool)
        if mask.any():
            out[name] = pack(np.packbits(mask, bitorder="little"), "u1")
    return out


def _unknown_sites(term: dict[str, Any], n_sites: int) -> np.ndarray:
    """bool[n_sites]: a recorded term's sites whose raw value stood in for an unknown one (none in records
    that say nothing of it: those of earlier releases)."""
    if "unknown" not in term:
        return np.zeros(n_sites, dtype=bool)
    return np.unpackbits(unpack(term["unknown"], "u1"), count=n_sites, bitorder="little").astype(bool)


def _normalised_again(raw: np.ndarray) -> bool:
    """Whether :func:`normalise` gives the pipeline's own normalised values for these raw values: float64 or
    integers, which the pipeline normalises in its compiled pass (``Pipeline._normalise``)."""
    return raw.dtype.char == "d" or raw.dtype.kind in "iu"


def _site_fields(snap: Snapshot) -> dict[str, str]:
    """The sites' names and regions as a record keeps them (the same for every decision of a snapshot): the
    names one per line; the distinct region names one per line and each site's index among them, packed
    (the region names themselves one per site where there are too many distinct ones for two bytes)."""
    fields = {"sites": "\n".join(snap.sites)}
    if len(snap.region_names) <= 0xFFFF:
        fields["region_names"] = "\n".join(snap.region_names)
        fields["region_code"] = pack(snap.region_code, "u2")
    else:
        fields["regions"] = "\n".join(snap.regions)
    return fields


def normalise(raws: Sequence[np.ndarray], lower: Sequence[bool], weights: Sequence[float],
              feasible: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Each term's raw values (float64 over every site) normalised over the ``feasible`` sites, and the
    weighted totals, as the pipeline works them out (``policies._scores.gather_normalise``), operation for
    operation, so the numbers are the same to the bit: negated where lower is better, then
    ``(r - min) / (max - min)``, or all 0 where that span is not above ``TIE_EPSILON`` or a value is NaN;
    the totals add ``row × weight`` in term order."""
    with np.errstate(invalid="ignore", over="ignore"):  # infinite raw values: NaN as in the kernel, which is silent
        return _normalise(raws, lower, weights, feasible)


def _normalise(raws: Sequence[np.ndarray], lower: Sequence[bool], weights: Sequence[float],
               feasible: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    norms: list[np.ndarray] = []
    totals = np.zeros(feasible.shape[0])
    for i, (raw, low, weight) in enumerate(zip(raws, lower, weights, strict=True)):
        row = raw[feasible]
        if low:
            row = -row
        # The first least and greatest values in site order, as the kernel takes them (of 0.0 and -0.0, the
        # first: min and max may give either, and the sign of a zero survives into the normalised values).
        if row.size and not np.isnan(row).any() and (
                span := row[row.argmax()] - (lo := row[row.argmin()])) > TIE_EPSILON:
            row = (row - lo) / span
        else:
            row = np.zeros(row.shape[0])
        norms.append(row)
        totals = row * weight if i == 0 else totals + row * weight
    return norms, totals


def _passed_over_record(passed: Sequence[tuple[int, str]], n_passed: int, snap: Snapshot) -> dict[str, Any]:
    """The better-scoring sites a time-shifting plan turned away now (site -> why), and how many in all."""
    if not n_passed:
        return {}
    return {"passed_over": {snap.sites[site]: why for site, why in passed}, "n_passed_over": n_passed}


def _quota_record(req: JobRequest, snap: Snapshot) -> dict[str, Any]:
    """The tenant's quota room per site (what the quota filter's reasons quote), when sites report quotas."""
    if snap.quota is None:
        return {}
    room, np_room = snap.quota.rooms(req.tenant)
    return {"quota_room": pack(room, "f8"), "quota_np_room": pack(np_room, "f8"),
            "quota_listed": req.tenant in snap.quota.room}


def _tenant_record(req: JobRequest, snap: Snapshot) -> dict[str, Any]:
    """The tenant's federation-wide limit and what it held then, [GPUs, GPUs] (what the tenant-limit filter's reason
    quotes), for a tenant that has a limit."""
    room = snap.tenant_room
    limit = room.limits.of(req.tenant) if room is not None else None
    if room is None or limit is None:
        return {}
    record: dict[str, Any] = {"tenant_limit": [limit, round(room.held.get(req.tenant or "", 0.0), 6)]}
    if req.tenant is not None and (source := room.limits.source(req.tenant)) != "config":
        record["tenant_limit_source"] = source  # (its own key, left out for config: earlier releases read the pair)
    return record


def _rtt_record(req: JobRequest, snap: Snapshot) -> dict[str, Any]:
    """For a job with a latency objective, the round-trip time in ms from its origin to each site (NaN: not
    measured), which the latency filter's reasons quote."""
    if req.latency_slo_ms is None:
        return {}
    column = snap.origin_index.get(req.origin_region or "")
    rtt = snap.rtt_ms[:, column] if column is not None else np.full(snap.n_sites, np.nan)
    return {"rtt_ms": pack(rtt, "f8")}


@dataclass(frozen=True, slots=True)
class _View:
    free: list[int]
    shared: list[int]
    memory_gib: list[float]
    regions: list[str]
    quota_room: list[float] | None = None  # the tenant's quota room per site (policies.filters.quota)
    quota_np_room: list[float] | None = None
    quota_listed: bool = True
    refusals: dict[str, str] | None = None  # site -> why it refused the job's attempt (RefusedFilter)
    sites: list[str] | None = None  # site names, in row order
    rtt_ms: list[float] | None = None  # the RTT from the job's origin per site (NaN: not measured); None: not recorded
    tenant_limit: list[float] | None = None  # [limit, held], GPUs (policies.filters.tenant_limit); None: no limit
    tenant_limit_source: str = "config"  # where that limit comes from (policies.tenant_limit.LimitSource)


def scores(rec: dict[str, Any], failures: np.ndarray | None = None
           ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """A record's score terms: each term's raw values over every site, its normalised values over the
    feasible sites, and the totals per feasible site, as the decision had them. ``failures``: the record's
    failure masks, where the caller has unpacked them."""
    raws = [unpack(t["raw"], "f8") for t in rec["terms"]]
    if "totals" in rec:  # version 2, or a term whose raw values the pipeline normalises on its other path
        return raws, [unpack(t["normalised"], "f8") for t in rec["terms"]], unpack(rec["totals"], "f8")
    if failures is None:
        failures = unpack(rec["failures"], "u2")
    norms, totals = normalise(raws, [t["lower"] for t in rec["terms"]], [t["weight"] for t in rec["terms"]],
                              np.flatnonzero(failures == 0))
    return raws, norms, totals


def _regions(rec: dict[str, Any]) -> list[str]:
    """Each site's region from a record: the names one per site (version 2), or each site's index among the
    distinct names (version 3)."""
    if "region_code" in rec:
        names = rec["region_names"].split("\n") if rec["region_names"] else []
        return [names[i] for i in unpack(rec["region_code"], "u2").tolist()]
    return rec["regions"].split("\n") if rec["regions"] else []


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def render(
    rec: dict[str, Any],
    req: JobRequest,
    filters: dict[str, Filter],
    attempt: int,
    deferred_until: datetime | None = None,
    ended: str | None = None,
) -> Decision:
    """Explain a record: every site with its rejection reasons, or its score terms and total. ``ended``: how
    the job ended since, where it ended while queued (e.g. ``"cancelled: cancelled by request"``): a deferral
    or a wait the record describes then says that it was cut short, not that the job starts later or is
    decided again."""
    if rec.get("v") not in READABLE_VERSIONS:
        raise RecordVersionError(f"decision record version {rec.get('v')} is not one this release reads "
                                 f"({', '.join(map(str, READABLE_VERSIONS))})")
    sites = rec["sites"].split("\n") if rec["sites"] else []
    failures_array = unpack(rec["failures"], "u2")
    failures = failures_array.tolist()
    view = _View(
        unpack(rec["free"], "i4").tolist(),
        unpack(rec["shared"], "i2").tolist(),
        unpack(rec["memory_gib"], "f4").tolist(),
        _regions(rec),
        unpack(rec["quota_room"], "f8").tolist() if "quota_room" in rec else None,
        unpack(rec["quota_np_room"], "f8").tolist() if "quota_np_room" in rec else None,
        rec.get("quota_listed", True),
        rec.get("refusals"),
        sites,
        unpack(rec["rtt_ms"], "f8").tolist() if "rtt_ms" in rec else None,
        rec.get("tenant_limit"),
        rec.get("tenant_limit_source", "config"),
    )
    raws, norms, totals_array = scores(rec, failures_array)
    # A stand-in for an unknown raw value (it only ranked the site last) is shown as no value, as a NaN is.
    # The stand-in itself is given as what the site was ranked as (``ranked_as``): the normalised values of every
    # feasible site are worked out with it, so without it they could not be worked out again from the raw values.
    unknowns = [_unknown_sites(t, len(sites)) for t in rec["terms"]]
    terms = [(t["scorer"], t["weight"], np.where(unknown, np.nan, raw).tolist(), norm.tolist(),
              np.where(unknown, raw, np.nan).tolist())
             for t, raw, norm, unknown in zip(rec["terms"], raws, norms, unknowns, strict=True)]
    totals = totals_array.tolist()
    codes: list[str] = rec["filters"]
    passed: dict[str, str] = rec.get("passed_over") or {}
    verdicts: list[SiteVerdict] = []
    rejected_by: dict[str, int] = {}
    k = 0  # position among the feasible sites
    for i, site in enumerate(sites):
        mask = failures[i]
        if mask:
            reasons = []
            for bit, code in enumerate(codes):
                if mask >> bit & 1:
                    f = filters.get(code)
                    text = f.describe(req, view, i) if f is not None else "rejected"
                    reasons.append(f"{code}: {text}")
                    rejected_by[code] = rejected_by.get(code, 0) + 1
            unranked = [ScoreTerm(scorer=name, raw=_finite(raw[i]), normalised=None, weight=weight, weighted=None)
                        for name, weight, raw, _, _ in terms]
            verdicts.append(SiteVerdict(site=site, feasible=False, reasons=reasons, terms=unranked))
            continue
        site_terms = [
            ScoreTerm(scorer=name, raw=_finite(raw[i]), normalised=norm[k], weight=weight, weighted=weight * norm[k],
                      ranked_as=_finite(stand_in[i]))
            for name, weight, raw, norm, stand_in in terms
        ]
        verdicts.append(SiteVerdict(site=site, feasible=True, terms=site_terms, score=totals[k],
                                    passed_over=passed.get(site)))
        k += 1

    n_feasible = k
    if rec["site"] is not None:
        outcome = "placed"
        score = next(v.score for v in verdicts if v.site == rec["site"])
        tied = [v.site for v in verdicts if v.feasible and v.site != rec["site"] and v.site not in passed
                and abs(v.score - score) <= TIE_EPSILON]
        summary = f"placed on {rec['site']} ({rec['model']}, score {score:.3f}): "
        if rec.get("moved"):  # the restart of a running job moved here (policies.migration)
            summary += rec["moved"]
        else:
            summary += f"best of {n_feasible} feasible of {len(verdicts)} sites"
            if passed and rec.get("over_plan"):  # every site that could take it now was turned away
                n_passed = rec.get("n_passed_over", len(passed))
                which = "the one site" if n_passed == 1 else f"all {n_passed} sites"
                summary += (f", started over the plan, which turned away {which} that could take it now: "
                            + passed_over_text(list(passed.items()), n_passed)
                            + "; it starts at the profile's choice rather than wait")
            elif passed:
                n_passed = rec.get("n_passed_over", len(passed))
                summary += (f" once the plan turned away {n_passed} that ranked above it: "
                            + passed_over_text(list(passed.items()), n_passed))
            if tied:
                summary += f"; tied with {', '.join(tied)}, and ties go to the first site by name"
        if not req.deferrable:
            summary += "; the job asks to start at once (deferrable: false): no later start is weighed for it"
    elif deferred_until is not None or rec.get("deferred"):
        outcome = "deferred"
        planned = rec.get("deferred") or {}
        if deferred_until is None:
            deferred_until = datetime.fromisoformat(planned["start"])
        summary = planned.get("reason") or f"deferred until {deferred_until.isoformat()}"
        if ended is not None:
            summary += f"; the job ended before that start ({ended}), so it will not start"
    else:
        outcome = "unplaceable"
        if not verdicts:
            summary = "no site is registered"
        else:
            counts = ", ".join(f"{n} {code}" for code, n in sorted(rejected_by.items(), key=lambda kv: -kv[1]))
            summary = f"no site can take the job now ({counts}); " + (
                "it stays queued and is decided again" if ended is None
                else f"it waited, and then ended ({ended}): it is decided no more")
    return Decision(
        job_id=req.job_id,
        attempt=attempt,
        decided_at=datetime.fromisoformat(rec["decided_at"]),
        outcome=outcome,
        site=rec["site"],
        deferred_until=deferred_until,
        summary=summary,
        sites=verdicts,
        deferral=_plan(rec.get("deferred")) if outcome == "deferred" else None,
    )


def _plan(planned: dict[str, Any] | None) -> DeferralPlan | None:
    """A record's ``deferred`` as the API gives it; records of earlier releases lack the later keys."""
    if not planned or "site" not in planned or "start" not in planned:
        return None
    risk = planned.get("deadline_risk")
    return DeferralPlan(
        site=planned["site"], start=datetime.fromisoformat(planned["start"]),
        objective=planned.get("objective", "carbon"), value_then=planned.get("value_then"),
        value_now=planned.get("value_now"), room_price_now=planned.get("room_price_now"),
        now_site=planned.get("now_site"),
        deadline_risk=DeadlineRisk(now=risk["now"], then=risk["then"]) if risk else None,
    )
