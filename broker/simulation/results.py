"""What a simulation run produces: per policy, where and when every job ran, and the figures over them.

Everything is arrays aligned with the workload's jobs (index ``i`` is job ``i`` of the workload, in submit
order). Times are float seconds after :attr:`SimulationResult.start` (aware UTC). A job left out of the run
(no site fits it even when empty: too many GPUs, a model no site has, or no site near enough for its
latency objective) has ``site == -1`` and NaN times for every policy alike.

Units: energy in kWh, carbon in kg CO2e, cost in US dollars, intensity in g CO2e per kWh, GPUs as a float
count (a fractional job holds ``milli / 1000`` of one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SiteFacts:
    """The simulated sites, in the simulator's site order (sorted by name)."""

    names: tuple[str, ...]
    zones: tuple[str, ...]  # grid zone per site
    regions: tuple[str, ...]  # cloud region per site
    capacity_gpus: np.ndarray  # int64[n_sites]: GPUs per site (all models)
    usd_per_gpu_hour: np.ndarray  # float64[n_sites]: price of the site's GPUs (the cheapest model it has)
    power_kw_per_gpu: np.ndarray  # float64[n_sites]: power per busy GPU (the lowest of the site's models)
    intensity: np.ndarray  # float64[n_sites, hours]: g/kWh, hour h = [start + h h, start + (h+1) h)

    @property
    def n_sites(self) -> int:
        return len(self.names)

    @property
    def hours(self) -> int:
        return int(self.intensity.shape[1])


@dataclass
class PolicyRun:
    """One policy's replay. ``metrics`` holds the figures of the JSON report (see ``broker.simulation.metrics``)."""

    name: str
    site: np.ndarray  # int32[n_jobs]: site index, -1 when left out
    start_s: np.ndarray  # float64[n_jobs]: when the job first started (its wait ends there)
    end_s: np.ndarray  # float64[n_jobs]: when it finished
    energy_kwh: np.ndarray  # float64[n_jobs]
    carbon_kg: np.ndarray  # float64[n_jobs]
    cost_usd: np.ndarray  # float64[n_jobs]
    metrics: dict[str, Any] = field(default_factory=dict)
    preemptions: int = 0  # running jobs stopped (no policy of this release preempts)
    requeues: int = 0  # jobs sent back to the queue after they were placed
    deferred: int = 0  # jobs deferred at least once for a saving (time-shifting profiles)
    wall_s: float = 0.0  # how long the replay took
    model: np.ndarray | None = None  # int64[n_jobs]: the GPU model index (policies.snapshot.MODEL_INDEX) it ran on
    was_deferred: np.ndarray | None = None  # bool[n_jobs]: deferred at least once for a saving
    # A job moved while it ran (policies.migration) ran in pieces: ``site`` and ``model`` are where its last
    # piece ran, from ``last_start_s`` (NaN: never moved, from ``start_s``) to ``end_s``; ``moved`` holds the
    # earlier pieces, one row each: job, site, model, start, end (float64[k, 5]).
    last_start_s: np.ndarray | None = None
    moved: np.ndarray | None = None

    @property
    def migrations(self) -> int:
        """Moves of a running job to another site (the pieces a move ended, less those a stop ended)."""
        return 0 if self.moved is None else int(self.moved.shape[0]) - self.preemptions

    def pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every stretch a job ran at one site: (job, site, start, end), the jobs that ran first in job
        order (their last piece), then the earlier pieces of moved jobs."""
        jobs = np.flatnonzero(self.ran)
        start = self.start_s[jobs]
        if self.last_start_s is not None:
            start = np.where(np.isnan(self.last_start_s[jobs]), start, self.last_start_s[jobs])
        site, end = self.site[jobs].astype(np.int64), self.end_s[jobs]
        if self.moved is None or not self.moved.shape[0]:
            return jobs, site, start, end
        m = self.moved
        return (np.concatenate([jobs, m[:, 0].astype(np.int64)]), np.concatenate([site, m[:, 1].astype(np.int64)]),
                np.concatenate([start, m[:, 3]]), np.concatenate([end, m[:, 4]]))

    @property
    def ran(self) -> np.ndarray:
        return self.site >= 0


@dataclass
class SimulationResult:
    start: datetime  # aware UTC: time 0 of the run
    sites: SiteFacts
    submit_s: np.ndarray  # float64[n_jobs]
    deadline_s: np.ndarray  # float64[n_jobs]
    gpus: np.ndarray  # float64[n_jobs]: GPUs held (milli / 1000 for a fractional job)
    tenant: np.ndarray  # int32[n_jobs]
    tenant_names: tuple[str, ...]
    left_out: np.ndarray  # bool[n_jobs]: no site fits it even when empty; run by no policy
    policies: dict[str, PolicyRun] = field(default_factory=dict)
    offline_bound: dict[str, Any] | None = None
    whole_job_bound: dict[str, Any] | None = None  # broker.simulation.whole_job_bound, with the offline bound
    oracle: PolicyRun | None = None  # the whole-job oracle's schedule (``--oracle``), metrics filled in
    report: list[str] = field(default_factory=list)  # what a reader should know about the run's inputs
