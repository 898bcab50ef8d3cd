"""The figures each policy is judged by, computed from where and when its jobs ran.

Over the jobs that ran (jobs left out for every policy are not counted by any):

- ``energy_kwh``, ``carbon_kg``, ``cost_usd``: sums of the per-job accounting (``broker.simulation.engine``).
- ``jobs``: jobs run to completion.
- ``wait_mean_s``, ``wait_p50_s``, ``wait_p95_s``, ``wait_p99_s``: seconds from submit to start.
- ``slowdown_mean``: mean bounded slowdown, ``max(1, (wait + run) / max(run, 10 s))`` — the 10 s bound keeps
  a few-second job that waited a minute from dominating the mean.
- ``deadline_misses``: jobs that finished after their deadline; ``deferred_misses``: those of them that a
  time-shifting profile had deferred for a saving at least once, when there was room to start them. With
  the simulator's own deadlines, which leave room for the true run (``broker.simulation.workload``), each
  would have met its deadline by starting then; a trace's own deadlines need not.
- ``latency_violations``: jobs with a latency objective that ran where the RTT from their origin exceeds it
  (``latency_unknown``: such jobs at a site with no RTT from their origin, not counted either way).
- ``utilisation``: busy GPU-hours over all sites / (all GPUs × the run's length, first submit to last end);
  ``utilisation_by_site``: the same per site.
- ``jain_fairness``: Jain's index, (Σx)² / (n Σx²), over tenants of their mean bounded slowdown: 1 when every
  tenant is slowed alike, 1/n when one tenant bears it all.
- ``preemptions``, ``requeues``: how often a running job was stopped, and how often a job went back to the
  queue: in this release only a checkpointable job stopped to make room for a latency-bound one
  (``policies.migration``, ``suspend``), which is both.
- ``migrations``: how often a running job was stopped and restarted from its checkpoint at another site
  (``policies.migration``; only a profile with ``migrate`` and a workload with checkpointable jobs move any).
  Its pieces count where each ran (``utilisation_by_site``), and every piece's energy, carbon and cost,
  the restart's included, is in the job's.
- ``gap_to_bound``, ``cost_gap_to_bound``: carbon (cost) above the offline bound's, as a fraction of it.
- ``whole_job_bound_carbon_kg``, ``gap_to_whole_job_bound``: the whole-job bound that holds for this run
  (``broker.simulation.whole_job_bound``: no job split over hours or sites), and the carbon above it, as a
  fraction of it; filled in by ``broker.simulation.run`` with the bound, None without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from broker.simulation.results import PolicyRun, SiteFacts

SLOWDOWN_BOUND_S = 10.0


def policy_metrics(run: PolicyRun, sites: SiteFacts, *, submit_s: np.ndarray, deadline_s: np.ndarray,
                   gpus: np.ndarray, tenant: np.ndarray, rtt_ms: np.ndarray, origin: np.ndarray,
                   latency_slo_ms: np.ndarray) -> dict[str, Any]:
    """``rtt_ms``: float64[n_sites, n_origins] (NaN unmeasured); ``origin``: int per job into its columns."""
    ran = run.ran
    out: dict[str, Any] = {
        "jobs": int(ran.sum()),
        "energy_kwh": float(run.energy_kwh[ran].sum()),
        "carbon_kg": float(run.carbon_kg[ran].sum()),
        "cost_usd": float(run.cost_usd[ran].sum()),
    }
    if not ran.any():
        return out | {"wait_mean_s": 0.0, "wait_p50_s": 0.0, "wait_p95_s": 0.0, "wait_p99_s": 0.0,
                      "slowdown_mean": 1.0, "deadline_misses": 0, "latency_violations": 0, "latency_unknown": 0,
                      "utilisation": 0.0, "utilisation_by_site": {n: 0.0 for n in sites.names},
                      "jain_fairness": 1.0, "preemptions": run.preemptions, "requeues": run.requeues,
                      "migrations": run.migrations,
                      "deferred_jobs": run.deferred, "deferred_misses": 0}
    start, end, sub = run.start_s[ran], run.end_s[ran], submit_s[ran]
    wait = np.maximum(start - sub, 0.0)
    run_s = end - start
    slowdown = np.maximum(1.0, (wait + run_s) / np.maximum(run_s, SLOWDOWN_BOUND_S))
    p50, p95, p99 = np.percentile(wait, [50, 95, 99])
    site = run.site[ran]
    slo = latency_slo_ms[ran]
    has_slo = ~np.isnan(slo)
    rtt = rtt_ms[site[has_slo], origin[ran][has_slo]]
    # The run's length from the first submit, not from time 0: that is the hour the run starts in, or the start of
    # the --trace-from window, which may come hours or days before the first job (3.4 days in the Evidence).
    span_s = float(end.max() - sub.min())
    p_job, p_site, p_start, p_end = run.pieces()
    busy = np.bincount(p_site, weights=gpus[p_job] * (p_end - p_start), minlength=sites.n_sites) / 3600.0
    capacity_h = sites.capacity_gpus.astype(np.float64) * span_s / 3600.0
    by_site = np.divide(busy, capacity_h, out=np.zeros(sites.n_sites), where=capacity_h > 0)
    t = tenant[ran]
    per_tenant = np.bincount(t, weights=slowdown) / np.maximum(np.bincount(t), 1)
    x = per_tenant[np.bincount(t) > 0]
    jain = float(x.sum() ** 2 / (x.size * (x**2).sum())) if x.size else 1.0
    return out | {
        "wait_mean_s": float(wait.mean()),
        "wait_p50_s": float(p50),
        "wait_p95_s": float(p95),
        "wait_p99_s": float(p99),
        "slowdown_mean": float(slowdown.mean()),
        "deadline_misses": int((end > deadline_s[ran] + 1e-6).sum()),
        "deferred_misses": (int(((end > deadline_s[ran] + 1e-6) & run.was_deferred[ran]).sum())
                            if run.was_deferred is not None else 0),
        "latency_violations": int((rtt > slo[has_slo]).sum()),
        "latency_unknown": int(np.isnan(rtt).sum()),
        "utilisation": float(busy.sum() / capacity_h.sum()) if capacity_h.sum() > 0 else 0.0,
        "utilisation_by_site": {n: float(u) for n, u in zip(sites.names, by_site, strict=True)},
        "jain_fairness": jain,
        "preemptions": run.preemptions,
        "requeues": run.requeues,
        "migrations": run.migrations,
        "deferred_jobs": run.deferred,
    }


def gap(value: float, bound: float) -> float | None:
    """How far above the bound ``value`` is, as a fraction of the bound (None without a positive bound)."""
    return (value - bound) / bound if bound > 0 else None
