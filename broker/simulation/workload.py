"""The workload a simulation runs: a job trace plus the assumptions a trace does not record, drawn seeded.

A trace says when each job arrived, how long it ran and how many GPUs it held. The broker also needs where
a job comes from, by when it must finish, whether it has a latency objective, and what duration its
submitter *claims*. None of these are in public traces, so they are drawn here from
:class:`WorkloadAssumptions`, every draw from a seeded generator, and written out by :func:`dump_workload`
(``--dump-workload DIR``) so that anyone can check a run's inputs independently. Nothing is tuned to one
trace: every default below is a statement about workloads in general, and policies are judged on traces
that are not shipped.

The assumptions, their defaults and why:

- ``seed`` (default 0): every draw comes from ``numpy.random.default_rng([seed, stream])`` with one stream
  per assumption, so changing one assumption (say ``latency_fraction``) leaves the others' draws as they
  were, and raising a fraction keeps the jobs already chosen and adds more (a job is chosen when its
  uniform draw is below the fraction).
- ``origin_regions`` (no default in the model; :meth:`WorkloadAssumptions.for_sites` takes the regions of
  the federation's sites): the cloud regions jobs come from, each drawn with equal chance. Listed in any
  order (they are sorted), each once.
- ``origin_rule`` (default ``"tenant_home"``): each tenant gets one home region, drawn once from a
  generator seeded by ``seed`` and a hash of the tenant's name, and all its jobs come from there — a team
  submits from where its people and data are, so its jobs share an origin; the home does not depend on
  which other tenants or how much of the trace is in the window. ``"per_job"`` draws each job's origin
  on its own (jobs from everywhere, the hardest case for latency objectives).
- ``slack_factor`` (default 3.0, at least 1) and ``min_slack_s`` (default 3600 s): a flexible job's deadline
  is ``submit + true duration + max((slack_factor - 1) × true duration, min_slack_s)``, i.e. it may wait
  up to twice its run time, and at least an hour, before it has to start. The *true* duration is used, not
  the estimate, so every deadline can be met by starting the job at once: a missed deadline is then the
  policy's doing, never the workload's. The hour lets a short job wait for a cleaner or cheaper hour; the
  factor gives long jobs room in proportion to their length (the deadline-slack convention of the
  deadline-scheduling literature).
- ``inflexible_fraction`` (default 0.1): this share of jobs, drawn per job, has ``deadline = submit + true
  duration`` — it must start at once. It stands for interactive work (notebooks, debugging) that no trace
  marks; a tenth keeps time-shifting policies honest without letting rigid work dominate.
- ``declare_inflexible`` (default true): the inflexible jobs say so, as the person at a notebook would:
  ``JobSpec.deferrable`` false, so no profile defers them. Their deadline alone would not say it, since the
  policies see only the estimate: where it runs short (half of them), submit + true duration looks like
  slack, and any wait misses it. False: they give their deadline and nothing else (releases before
  2026-11-29 replayed them so).
- ``latency_fraction`` (default 0.1) and ``latency_slo_ms`` (default 50 ms): this share of jobs, drawn per
  job and independently of inflexibility, has a latency objective: it must run where the round-trip time
  from its origin region is at most ``latency_slo_ms``. 50 ms keeps a job within its part of a continent
  (measured GCP RTTs: us-central1–us-east1 33 ms, europe-west1–europe-west3 9 ms, but us-east1–us-west1
  64 ms and us-east4–europe-west3 81 ms); about one GCP region pair in seven is that close.
- ``estimate_sigma`` (default 0.5) and ``estimate_unbiased`` (default ``"median"``): the duration the
  policies see (``JobSpec.duration_s``) is ``true × exp(N(mu, estimate_sigma))``; the job really runs for
  the true duration. With ``"median"`` (mu = 0) half the estimates are high and half low, and their mean is
  ``exp(sigma²/2)`` times the truth (+13 % at sigma 0.5): users' run-time estimates are known to be off by
  a factor more often than by an amount, which a log-normal error models. ``"mean"`` sets mu = -sigma²/2
  so the mean estimate is right and the median is low. Sigma 0.5 puts two thirds of estimates within a
  factor of 1.65 of the truth; 0 gives exact estimates. Estimates are capped at 366 days, the longest a
  ``JobSpec`` accepts, and (when sigma is above 0) rounded to whole seconds, at least one, as a user gives
  them. That also takes the last bit of a vectorised ``exp`` out of a replay, short of an estimate that lands
  on a half second to the last bit: NumPy's AVX-512 one may round it differently from another CPU's, and
  one such bit can move a tie and from there a policy's figures. A trace that records what its submitters
  estimated (an ``estimate`` column, such as a Slurm dump's time limits) replaces the draw for every job
  that gives one (at least 1 s, capped as above); the others keep their draw, so mapping the column leaves
  every other draw as it was.

- ``checkpointable_fraction`` (default 0) and ``restart_s`` (default 600 s): this share of the jobs that are
  not inflexible, drawn per job, can be stopped and resumed from a checkpoint (``JobSpec.checkpointable``),
  which a profile that moves running work (``policies.migration``) may use; interactive work is not. A
  move costs the job ``restart_s`` of GPU time at its new site before it makes progress again (save,
  copy and restore the checkpoint, warm up): it ends that much later and uses that much more energy.
  Schedulers of training traces such as this one (Gandiva, Tiresias, Pollux) assume every training job
  can be checkpointed; 0 keeps the default replay whole-job, as every policy but a moving one sees it.

What is not assumed: priority, preemptibility, allowed regions and attempts stay at the
``JobSpec`` defaults, since nothing in a trace speaks to them. Trace GPU models are mapped to canonical ids
(an unknown model is an error); tenant names that are not valid ``JobSpec`` tenants are renamed by
:func:`tenant_slug`.

Units: ``submit_s`` and ``deadline_s`` are float seconds after ``Workload.start`` (aware UTC); durations are
seconds; ``latency_slo_ms`` is milliseconds, NaN for a job without one. Times in ``jobs.csv`` and in
``job_spec`` are rounded to the microsecond, the same way in both.

How to turn the assumptions off: ``estimate_sigma=0`` (exact estimates), ``inflexible_fraction=0``,
``latency_fraction=0`` (no latency objectives), and a large ``min_slack_s`` (deadlines that never bind).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from broker import ids
from broker.data.traces import Trace
from broker.models import GpuRequest, JobSpec, SiteSpec

MAX_ESTIMATE_S = 366 * 86400.0
"""Estimates are capped at this many seconds, the longest ``JobSpec.duration_s`` accepts."""

JOBS_CSV_COLUMNS = (
    "submit_utc", "true_duration_s", "estimated_duration_s", "gpus", "milli", "model", "tenant",
    "origin_region", "deadline_utc", "latency_slo_ms", "checkpointable", "deferrable",
)
"""The columns of ``jobs.csv``, in order; row ``i`` is job ``trace-<i>``."""

# One random stream per assumption, so that changing one leaves the others' draws unchanged.
_ESTIMATE, _INFLEXIBLE, _LATENCY, _ORIGIN_PER_JOB, _TENANT_HOME, _CHECKPOINT = 1, 2, 3, 4, 5, 6

_TENANT = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # the JobSpec tenant rule


# ---------------------------------------------------------------------------------------------------------
# Assumptions
# ---------------------------------------------------------------------------------------------------------


class WorkloadAssumptions(BaseModel):
    """What the simulator assumes about jobs beyond the trace; the module docstring gives each reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    origin_regions: tuple[str, ...]
    seed: int = 0
    origin_rule: Literal["tenant_home", "per_job"] = "tenant_home"
    slack_factor: float = 3.0
    min_slack_s: float = 3600.0
    inflexible_fraction: float = 0.1
    declare_inflexible: bool = True
    latency_fraction: float = 0.1
    latency_slo_ms: float = 50.0
    estimate_sigma: float = 0.5
    estimate_unbiased: Literal["median", "mean"] = "median"
    checkpointable_fraction: float = 0.0
    restart_s: float = 600.0

    @classmethod
    def for_sites(cls, sites: Sequence[SiteSpec], **overrides: Any) -> WorkloadAssumptions:
        """The defaults, with origins drawn from the regions of ``sites`` (each region once)."""
        overrides.setdefault("origin_regions", tuple({s.region for s in sites}))
        return cls(**overrides)

    @field_validator("origin_regions")
    @classmethod
    def _regions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("no origin region: give at least one region jobs come from (e.g. the sites' "
                             "regions, which WorkloadAssumptions.for_sites uses)")
        canonical = [ids.region(r) for r in value]
        twice = sorted({r for r in canonical if canonical.count(r) > 1})
        if twice:
            raise ValueError(f"{twice[0]} is listed more than once; regions are drawn with equal chance, "
                             "so list each once")
        return tuple(sorted(canonical))

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"must be 0 or more, got {value}")
        return value

    @field_validator("slack_factor")
    @classmethod
    def _slack(cls, value: float) -> float:
        if not (np.isfinite(value) and value >= 1):
            raise ValueError(f"must be at least 1 (a deadline sooner than submit + duration cannot be met), "
                             f"got {value}; use inflexible_fraction for jobs that must start at once")
        return value

    @field_validator("min_slack_s")
    @classmethod
    def _min_slack(cls, value: float) -> float:
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"must be seconds >= 0, got {value}")
        return value

    @field_validator("restart_s")
    @classmethod
    def _restart(cls, value: float) -> float:
        if not (np.isfinite(value) and 0 <= value <= 86400):
            raise ValueError(f"must be seconds within [0, 86400], got {value}")
        return value

    @field_validator("inflexible_fraction", "latency_fraction", "checkpointable_fraction")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"must be a share of jobs within [0, 1], got {value}")
        return value

    @field_validator("latency_slo_ms")
    @classmethod
    def _slo(cls, value: float) -> float:
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"must be a round-trip time in milliseconds above 0, got {value}")
        return value

    @field_validator("estimate_sigma")
    @classmethod
    def _sigma(cls, value: float) -> float:
        if not 0 <= value <= 5:
            raise ValueError(f"must be within [0, 5] (log-normal sigma; 0 = exact estimates, 5 = off by a "
                             f"factor of 150 at one sigma), got {value}")
        return value


# ---------------------------------------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """Jobs in submit order, one array element per job, aligned with the trace they came from.

    ``submit_s``, ``deadline_s``: float64 seconds after ``start`` (aware UTC). ``true_duration_s`` (what a
    job runs for) and ``estimated_duration_s`` (what policies see): float64 seconds. ``gpus``, ``milli``:
    int32. ``model``: object array of canonical GPU model ids or ``None`` (any). ``tenant``: int32 codes
    into ``tenant_names`` (valid ``JobSpec`` tenants; ``trace_tenant_names`` holds the names in the trace).
    ``origin_region``: int32 codes into ``region_names``. ``latency_slo_ms``: float64, NaN for none.
    ``inflexible``: bool, the jobs whose deadline is submit + true duration; ``start_at_once``: bool, those
    of them that ask to start at once (``JobSpec.deferrable`` false: the drawn ones, where the assumptions
    declare them). ``checkpointable``: bool, the jobs that may be stopped and resumed from a checkpoint.
    ``estimate_given``: bool, the jobs whose estimate is the trace's own (its ``estimate`` column), not drawn.
    """

    start: datetime
    submit_s: np.ndarray
    true_duration_s: np.ndarray
    estimated_duration_s: np.ndarray
    gpus: np.ndarray
    milli: np.ndarray
    model: np.ndarray
    tenant: np.ndarray
    tenant_names: tuple[str, ...]
    trace_tenant_names: tuple[str, ...]
    origin_region: np.ndarray
    region_names: tuple[str, ...]
    deadline_s: np.ndarray
    latency_slo_ms: np.ndarray
    inflexible: np.ndarray
    assumptions: WorkloadAssumptions
    checkpointable: np.ndarray | None = None  # None given: no job; always an array once built
    start_at_once: np.ndarray | None = None  # likewise: the jobs that ask to start at once (deferrable false)
    estimate_given: np.ndarray | None = None  # likewise: the jobs whose estimate is the trace's own, not drawn

    def __post_init__(self) -> None:
        for name in ("checkpointable", "start_at_once", "estimate_given"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.submit_s), dtype=bool))

    def __len__(self) -> int:
        return int(self.submit_s.shape[0])

    @property
    def held(self) -> np.ndarray:
        """float64[jobs]: the GPUs each job holds (a fractional job ``milli / 1000`` of one)."""
        return self.gpus.astype(np.float64) * np.where(self.milli < 1000, self.milli / 1000.0, 1.0)

    @property
    def deferrable(self) -> np.ndarray:
        """bool[jobs]: the jobs a profile may defer (``JobSpec.deferrable``): all but the ones that ask to
        start at once."""
        return ~self.start_at_once

    @property
    def slack_s(self) -> np.ndarray:
        """Seconds each job may wait and still meet its deadline: deadline - submit - true duration."""
        return self.deadline_s - self.submit_s - self.true_duration_s

    @property
    def has_latency_slo(self) -> np.ndarray:
        return ~np.isnan(self.latency_slo_ms)

    def submit_at(self, i: int) -> datetime:
        return self.start + timedelta(microseconds=int(_microseconds(self.submit_s[i])))

    def deadline_at(self, i: int) -> datetime:
        return self.start + timedelta(microseconds=int(_microseconds(self.deadline_s[i])))

    def job_spec(self, i: int) -> JobSpec:
        """Job ``i`` as the live cycle receives it: the estimate as ``duration_s``, the deadline, the origin,
        the latency objective when it has one; everything the trace does not speak to left at its default."""
        slo = float(self.latency_slo_ms[i])
        return JobSpec(
            tenant=self.tenant_names[int(self.tenant[i])],
            name=f"trace-{i}",
            gpus=GpuRequest(count=int(self.gpus[i]), model=self.model[i], milli=int(self.milli[i])),
            duration_s=float(self.estimated_duration_s[i]),
            deadline=self.deadline_at(i),
            latency_slo_ms=None if np.isnan(slo) else slo,
            origin_region=self.region_names[int(self.origin_region[i])],
            checkpointable=bool(self.checkpointable[i]),
            deferrable=bool(self.deferrable[i]),
        )

    @property
    def report(self) -> list[str]:
        """One sentence per fact a reader of a run should know about its workload."""
        n = len(self)
        if n == 0:
            return ["The workload has no jobs."]
        flexible = ~self.inflexible
        ratio = self.estimated_duration_s / self.true_duration_s
        lines = [
            f"{n} jobs from {self.start.isoformat()}; origins drawn by rule {self.assumptions.origin_rule!r} "
            f"from {len(self.region_names)} regions.",
            f"{self.has_latency_slo.mean():.1%} of jobs have a latency objective of "
            f"{self.assumptions.latency_slo_ms:g} ms.",
            f"{self.inflexible.mean():.1%} of jobs are inflexible (deadline = submit + duration); "
            + (f"{self.start_at_once.mean():.1%} of jobs ask to start at once (deferrable: false)."
               if self.start_at_once.any() else "none asks to start at once."),
        ]
        if self.checkpointable.any():
            lines.append(f"{self.checkpointable.mean():.1%} of jobs can be checkpointed and moved; a move costs "
                         f"{self.assumptions.restart_s:g} s of GPU time.")
        if flexible.any():
            slack_h = self.slack_s[flexible] / 3600.0
            lines.append(f"Flexible jobs may wait {slack_h.mean():.1f} h on average (median "
                         f"{np.median(slack_h):.1f} h) before they must start.")
        own = int(np.count_nonzero(self.estimate_given))
        source = ("drawn" if not own else "the trace's own" if own == n else
                  f"the trace's own for {own} job{'s' * (own != 1)}, drawn for {n - own}")
        lines.append(f"Estimated / true duration ({source}): median {np.median(ratio):.3f}, mean {ratio.mean():.3f}.")
        return lines


def tenant_slug(name: str) -> str:
    """A valid ``JobSpec`` tenant for a trace's tenant name: the name itself when it already is one
    (Philly's virtual clusters, e.g. ``6214e9``), else its lower-cased letters and digits joined by '-'
    (at most 54 characters) plus '-' and 8 hex digits of a BLAKE2b hash of the original name, so two names
    that differ only in case or punctuation stay apart (``Team A`` → ``team-a-<hash>``)."""
    if _TENANT.fullmatch(name):
        return name
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:54].strip("-") or "tenant"
    return f"{base}-{hashlib.blake2b(name.encode(), digest_size=4).hexdigest()}"


def build_workload(trace: Trace, assumptions: WorkloadAssumptions, *,
                   start: datetime | date | None = None) -> Workload:
    """Lay ``assumptions`` over ``trace``. ``start`` (``--start``; a date or time, naive = UTC) moves the
    trace's first instant there, keeping every offset; by default the trace's own start is kept.

    The same trace, assumptions and start always give the same arrays. Raises ``ValueError`` for a GPU
    model that is not known, a job asking for part of each of several GPUs (a ``JobSpec`` cannot say that),
    or two trace tenants whose names map to the same ``JobSpec`` tenant.
    """
    a = assumptions
    n = len(trace.submit_s)
    anchor = _as_utc(trace.start if start is None else start)
    submit_s = np.asarray(trace.submit_s, dtype=np.float64).copy()
    true_s = np.asarray(trace.duration_s, dtype=np.float64).copy()
    if n and not (true_s > 0).all():
        i = int(np.argmin(true_s > 0))
        raise ValueError(f"{trace.path}: line {int(trace.line[i])}: duration {true_s[i]} s is not above 0")
    gpus = np.asarray(trace.gpus, dtype=np.int32).copy()
    milli = np.asarray(trace.milli, dtype=np.int32).copy()
    split = (gpus > 1) & (milli < 1000)
    if split.any():
        i = int(np.argmax(split))
        raise ValueError(f"{trace.path}: {int(split.sum())} jobs ask for part of each of several GPUs (gpus > 1 "
                         f"with milli < 1000), which a JobSpec cannot express; first at line {int(trace.line[i])}")

    # Estimates: true × exp(N(mu, sigma)), capped at what a JobSpec accepts.
    mu = -a.estimate_sigma**2 / 2 if a.estimate_unbiased == "mean" else 0.0
    noise = _rng(a.seed, _ESTIMATE).standard_normal(n) * a.estimate_sigma + mu
    estimate_s = np.minimum(true_s * np.exp(noise), MAX_ESTIMATE_S)
    if a.estimate_sigma > 0:  # whole seconds (docstring); exact estimates stay the true durations
        estimate_s = np.maximum(np.rint(estimate_s), 1.0)
    given = np.zeros(n, dtype=bool)
    if trace.estimate_s is not None:  # the trace's own estimates (a time limit) replace the drawn ones
        own = np.asarray(trace.estimate_s, dtype=np.float64)
        given = np.isfinite(own)
        estimate_s = np.where(given, np.clip(own, 1.0, MAX_ESTIMATE_S), estimate_s)

    # Deadlines from the true duration: feasible when started at once.
    inflexible = _rng(a.seed, _INFLEXIBLE).random(n) < a.inflexible_fraction
    slack_s = np.maximum((a.slack_factor - 1.0) * true_s, a.min_slack_s)
    slack_s[inflexible] = 0.0
    deadline_s = (submit_s + true_s) + slack_s
    # The drawn inflexible jobs ask to start at once (declare_inflexible); a trace's own deadlines say nothing
    # of that, and which of them leave no slack the submitter could not know (it takes the true run time).
    start_at_once = inflexible & a.declare_inflexible
    if trace.deadline_s is not None:  # the trace's own deadlines replace the slack assumption
        deadline_s = np.asarray(trace.deadline_s, dtype=np.float64).copy()
        inflexible = deadline_s <= submit_s + true_s
        start_at_once = np.zeros(n, dtype=bool)

    checkpointable = (_rng(a.seed, _CHECKPOINT).random(n) < a.checkpointable_fraction) & ~inflexible

    latency = _rng(a.seed, _LATENCY).random(n) < a.latency_fraction
    latency_slo_ms = np.where(latency, a.latency_slo_ms, np.nan)

    regions = a.origin_regions
    tenant = np.asarray(trace.tenant, dtype=np.int32).copy()
    if a.origin_rule == "tenant_home":
        home = np.array([_tenant_home(a.seed, name, len(regions)) for name in trace.tenant_names], dtype=np.int32)
        origin = home[tenant] if n else np.zeros(0, dtype=np.int32)
    else:
        origin = _rng(a.seed, _ORIGIN_PER_JOB).integers(len(regions), size=n).astype(np.int32)

    slugs = tuple(tenant_slug(t) for t in trace.tenant_names)
    if len(set(slugs)) != len(slugs):
        same = next(s for s in slugs if slugs.count(s) > 1)
        names = [t for t, s in zip(trace.tenant_names, slugs) if s == same]
        raise ValueError(f"{trace.path}: tenants {names!r} would all be called {same!r}; rename one in the trace")

    return Workload(
        start=anchor, submit_s=submit_s, true_duration_s=true_s, estimated_duration_s=estimate_s, gpus=gpus,
        milli=milli, model=_canonical_models(trace), tenant=tenant, tenant_names=slugs,
        trace_tenant_names=tuple(trace.tenant_names), origin_region=origin, region_names=regions,
        deadline_s=deadline_s, latency_slo_ms=latency_slo_ms, inflexible=inflexible, assumptions=a,
        checkpointable=checkpointable, start_at_once=start_at_once, estimate_given=given,
    )


def dump_workload(workload: Workload, sites: Sequence[SiteSpec], directory: str | Path) -> None:
    """Write ``jobs.csv`` (columns :data:`JOBS_CSV_COLUMNS`; times ISO 8601 UTC, an empty ``model`` = any,
    an empty ``latency_slo_ms`` = none) and ``sites.json`` (each site's name, grid_zone, region,
    ``capacity_gpus`` by model and ``usd_per_gpu_hour`` by model) into ``directory``, created if missing;
    files already there are replaced."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    w = workload
    start_us = (w.start - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    columns = [
        _iso_times(start_us + _microseconds(w.submit_s)),
        w.true_duration_s.tolist(),
        w.estimated_duration_s.tolist(),
        w.gpus.tolist(),
        w.milli.tolist(),
        ["" if m is None else m for m in w.model.tolist()],
        np.asarray(w.tenant_names, dtype=object)[w.tenant].tolist() if len(w) else [],
        np.asarray(w.region_names, dtype=object)[w.origin_region].tolist() if len(w) else [],
        _iso_times(start_us + _microseconds(w.deadline_s)),
        ["" if np.isnan(v) else v for v in w.latency_slo_ms.tolist()],
        ["true" if c else "false" for c in w.checkpointable.tolist()],
        ["true" if d else "false" for d in w.deferrable.tolist()],
    ]
    with (out / "jobs.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(JOBS_CSV_COLUMNS)
        writer.writerows(zip(*columns, strict=True))
    listing = [
        {"name": s.name, "grid_zone": s.grid_zone, "region": s.region, "capacity_gpus": s.total_gpus(),
         "usd_per_gpu_hour": dict(s.usd_per_gpu_hour)}
        for s in sites
    ]
    (out / "sites.json").write_text(json.dumps(listing, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _rng(seed: int, stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream, *more]))


def _tenant_home(seed: int, name: str, regions: int) -> int:
    name_key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return int(_rng(seed, _TENANT_HOME, name_key).integers(regions))


def _canonical_models(trace: Trace) -> np.ndarray:
    raw = np.asarray(trace.model, dtype=object)
    named = {m for m in raw.tolist() if m is not None}
    if not named:
        return np.full(len(raw), None, dtype=object)
    canonical: dict[str | None, str | None] = {None: None}
    for m in sorted(named):
        try:
            canonical[m] = ids.gpu_model(m)
        except ids.UnknownIdentifier as exc:
            line = int(trace.line[int(np.argmax(raw == m))])
            raise ValueError(f"{trace.path}: line {line}: {exc}") from None
    return np.array([canonical[m] for m in raw.tolist()], dtype=object)


def _as_utc(value: datetime | date) -> datetime:
    if not isinstance(value, datetime):
        if not isinstance(value, date):
            raise ValueError(f"start: expected a date or time, got {value!r}")
        value = datetime(value.year, value.month, value.day)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _microseconds(seconds: np.ndarray | np.float64) -> np.ndarray:
    """Seconds rounded to whole microseconds (int64); ``jobs.csv`` and ``job_spec`` both round this way."""
    return np.round(np.asarray(seconds, dtype=np.float64) * 1e6).astype(np.int64)


def _iso_times(epoch_us: np.ndarray) -> list[str]:
    """ISO 8601 UTC texts ending in Z; whole seconds without a fraction, others to the microsecond."""
    at = epoch_us.astype("datetime64[us]")
    whole = epoch_us % 1_000_000 == 0
    text = np.where(whole, np.datetime_as_string(at, unit="s", timezone="UTC"),
                    np.datetime_as_string(at, unit="us", timezone="UTC"))
    return text.tolist()
