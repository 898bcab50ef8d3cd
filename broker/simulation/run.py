"""``heliotrope simulate``: load the data, build the sites and the workload, replay each policy, bound them.

Steps
    1. Load the trace (column mapping or preset, optional window ``trace_from`` + ``days``) and the carbon
       data (every zone in the folder for the default federation, or the zones the ``--sites`` file names).
    2. Choose the run's start: ``--start`` when given; otherwise the trace's own start when the carbon data
       covers it, else the same month, day and time in the first year of the carbon data that covers the
       whole trace window (seasons line up; reported).
    3. Build the sites: ``--sites FILE`` (the broker's YAML config format; every site needs a ``grid_zone``
       with carbon data), or the default federation (``broker.simulation.federation``), one site per zone,
       sized for ``--utilisation``.
    4. Lay the workload assumptions over the trace (``broker.simulation.workload``, seeded by ``--seed``).
    5. Leave out jobs that fit no site even when it is empty, for every policy alike (reported).
    6. Replay each policy (``broker.simulation.engine``) until every job has finished.
    7. Solve the offline bound (``broker.simulation.bound``). Its windows run from each job's submit to its
       deadline, or to the latest end any replayed policy gave the job when that is later: a policy that
       missed a deadline may not beat the bound by running late, so the bound holds for every policy run.
       A window is cut at the end of the carbon data, where every replayed policy has finished.
    8. Compute the metrics (``broker.simulation.metrics``).

Defaults: prices, latency and region coordinates come from the copies shipped in ``data/`` (see
``data/SOURCES.md``) unless ``--prices``, ``--latency`` or ``--regions`` name other files.
"""

from __future__ import annotations

import calendar
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np

from broker.config import load_config
from broker.data.carbon import CarbonData, load_carbon
from broker.data.latency import load_latency
from broker.data.prices import load_gcp_prices
from broker.data.regions import load_gcp_regions
from broker.data.traces import ColumnMapping, Trace, load_trace
from broker.models import SiteSpec
from broker.simulation import engine
from broker.simulation.bound import offline_bound
from broker.simulation.federation import build_default_federation
from broker.simulation.metrics import gap, policy_metrics
from broker.simulation.results import SimulationResult
from broker.simulation.workload import Workload, WorkloadAssumptions, build_workload
from policies.baselines import COMPARED, policy

DATA = Path(__file__).resolve().parents[2] / "data"
DEFAULT_PRICES = DATA / "prices" / "gcp_gpu_instance_prices.csv"
DEFAULT_LATENCY = DATA / "network" / "gcp-latency.csv"
DEFAULT_REGIONS = DATA / "regions" / "regions.json"


@dataclass
class SimulationSpec:
    """Everything ``heliotrope simulate`` was asked, as values (the CLI flags of the same names)."""

    trace: Path
    mapping: ColumnMapping
    carbon: Path
    policies: Sequence[str]
    time_format: str = "iso"
    origin: datetime | None = None
    prices: Path = DEFAULT_PRICES
    latency: Path = DEFAULT_LATENCY
    regions: Path = DEFAULT_REGIONS
    sites: Path | None = None
    utilisation: float = 0.5
    trace_from: date | datetime | None = None
    days: float | None = None
    start: date | datetime | None = None
    seed: int = 0
    lifecycle: bool = False
    bound: bool = True
    assumptions: dict[str, object] = field(default_factory=dict)  # WorkloadAssumptions overrides


@dataclass
class Prepared:
    """Steps 1-5: what every policy replays."""

    workload: Workload
    sites: list[SiteSpec]
    federation: engine.Federation
    requests: list
    left_out: np.ndarray
    rtt_ms: np.ndarray  # [n_sites (name order), n_origin_regions]
    report: list[str]


def prepare(spec: SimulationSpec) -> Prepared:
    for name in spec.policies:
        policy(name)  # unknown names fail before any loading
    report: list[str] = []
    origin = spec.origin
    if spec.time_format == "seconds" and origin is None:
        origin = datetime(1970, 1, 1, tzinfo=UTC)
        report.append("trace times are seconds after the Unix epoch (no --origin given)")
    trace = load_trace(spec.trace, spec.mapping, time_format=spec.time_format, origin=origin,  # type: ignore[arg-type]
                       trace_from=spec.trace_from, days=spec.days)
    if len(trace) == 0:
        raise engine.SimulationError(f"{spec.trace}: no jobs in the chosen window; widen --trace-from/--days")
    report += [f"trace: {r}" for r in trace.report]

    site_file: list[SiteSpec] | None = None
    if spec.sites is not None:
        site_file = list(load_config(spec.sites).sites)
        if not site_file:
            raise engine.SimulationError(f"{spec.sites}: the file lists no sites")
        zones = list(dict.fromkeys(s.grid_zone for s in site_file))
        carbon = load_carbon(spec.carbon, lifecycle=spec.lifecycle, zones=zones)
    else:
        carbon = load_carbon(spec.carbon, lifecycle=spec.lifecycle)
        zones = list(carbon.zones())
        if not zones:
            raise engine.SimulationError(f"{spec.carbon}: no carbon data found (expected <ZONE>/*.csv folders "
                                         "or <zone>_ci.csv files)")
    report += [f"carbon: {r}" for r in carbon.report]

    needed_s = float((trace.submit_s + trace.duration_s).max())
    start = _choose_start(spec.start, trace, carbon, zones, needed_s, report)
    data_end = min(carbon.span(z)[1] for z in zones)
    hours = int((data_end - start) // timedelta(hours=1))
    intensity = {z: carbon.series(z, start, hours) for z in zones}

    if site_file is not None:
        sites = site_file
        report.append(f"sites: {len(sites)} from {spec.sites}")
    else:
        prices = load_gcp_prices(spec.prices)
        latency = load_latency(spec.latency)
        regions = load_gcp_regions(spec.regions)
        default = build_default_federation(
            zones, trace_mean_gpus_busy=trace.mean_gpus_busy(_busy_window(trace)), prices=prices, latency=latency, regions=regions,
            largest_job_gpus=int(trace.gpus.max()), utilisation=spec.utilisation,
        )
        sites = default.sites
        report += [f"sites: {r}" for r in default.report]

    assumptions = WorkloadAssumptions.for_sites(sites, seed=spec.seed, **spec.assumptions)
    workload = build_workload(trace, assumptions, start=start)
    report += [f"workload: {r}" for r in workload.report]
    federation = engine.build_federation(sites, intensity, start)
    requests = engine.requests_of(workload)
    left_out = ~engine.fits_anywhere(requests, federation)
    if left_out.any():
        report.append(f"left out: {int(left_out.sum())} jobs fit no site even when it is empty (largest asks "
                      f"{int(workload.gpus[left_out].max())} GPUs); no policy runs them")
    rtt = np.array([[s.rtt_ms.get(r, np.nan) for r in workload.region_names] for s in federation.specs],
                   dtype=np.float64).reshape(len(federation.specs), len(workload.region_names))
    return Prepared(workload, sites, federation, requests, left_out, rtt, report)


def _busy_window(trace: Trace) -> tuple[datetime, datetime]:
    """The window the default sites are sized over: the trace's span, or, when every job was submitted at
    one instant, from then until the last job would end."""
    lo, hi = trace.span
    if hi <= lo:
        hi = lo + timedelta(seconds=float((trace.submit_s + trace.duration_s).max()))
    return lo, hi


def _choose_start(given: date | datetime | None, trace: Trace, carbon: CarbonData, zones: list[str],
                  needed_s: float, report: list[str]) -> datetime:
    lo = max(carbon.span(z)[0] for z in zones)
    hi = min(carbon.span(z)[1] for z in zones)
    if hi <= lo:
        raise engine.SimulationError(f"the carbon data of zones {', '.join(zones)} has no hour in common")
    need = timedelta(seconds=needed_s)
    if given is not None:
        start = given if isinstance(given, datetime) else datetime(given.year, given.month, given.day)
        start = start.replace(tzinfo=UTC) if start.tzinfo is None else start.astimezone(UTC)
        _check_covered(start, need, lo, hi, zones, "--start")
        return start
    first = trace.start
    if lo <= first and first + need <= hi:
        return first
    for year in range(lo.year, hi.year + 1):
        day = min(first.day, calendar.monthrange(year, first.month)[1])
        start = first.replace(year=year, day=day)
        if lo <= start and start + need <= hi:
            report.append(f"start: the trace's first job ({first.isoformat()}) is mapped to {start.isoformat()}, "
                          f"the same date in the first year of carbon data that covers the whole window")
            return start
    raise engine.SimulationError(
        f"the carbon data ({lo.isoformat()} .. {hi.isoformat()}) cannot hold the trace window of "
        f"{need.total_seconds() / 86400:.1f} days from submit of the first job to the end of the last; "
        "pick a shorter window with --trace-from/--days or load more years of carbon data"
    )


def _check_covered(start: datetime, need: timedelta, lo: datetime, hi: datetime, zones: list[str], flag: str) -> None:
    if start < lo or start + need > hi:
        raise engine.SimulationError(
            f"{flag} {start.isoformat()}: the run needs carbon data from then until "
            f"{(start + need).isoformat()} (every job run at once), but zones {', '.join(zones)} all have data only "
            f"for {lo.isoformat()} .. {hi.isoformat()}; choose a --start inside that span"
        )


def simulate(spec: SimulationSpec, *, progress: bool = False) -> SimulationResult:
    """Steps 1-8; returns every policy's replay with its metrics, and the bound."""
    prep = prepare(spec)
    w = prep.workload
    facts = prep.federation.facts()
    held = w.gpus.astype(np.float64) * np.where(w.milli < 1000, w.milli / 1000.0, 1.0)
    result = SimulationResult(start=w.start, sites=facts, submit_s=w.submit_s, deadline_s=w.deadline_s, gpus=held,
                              tenant=w.tenant, tenant_names=w.tenant_names, left_out=prep.left_out,
                              report=prep.report)
    for name in spec.policies:
        bar = _bar(name, int((~prep.left_out).sum())) if progress else None
        try:
            run = engine.replay(name, policy(name), w, prep.federation, prep.requests, prep.left_out,
                                progress=None if bar is None else (lambda n, b=bar: b.update(n - b.n)))
        finally:
            if bar is not None:
                bar.close()
        result.policies[name] = run
    ran = ~prep.left_out
    window_end = w.deadline_s.copy()
    for run in result.policies.values():
        window_end = np.fmax(window_end, run.end_s)
    # Every replayed policy finished inside the carbon data (the engine checks), so a window cut at the
    # data's end still holds every policy's schedule: the bound stays below each of them.
    window_end = np.minimum(window_end, facts.hours * 3600.0)
    if ran.any():  # the hours the run and its bound look at, not the whole carbon data
        needed = min(int(np.ceil(float(window_end[ran].max()) / 3600.0)) + 1, facts.hours)
        facts = replace(facts, intensity=facts.intensity[:, :needed])
        result.sites = facts
    if spec.bound and result.policies:
        bound = offline_bound(facts, release_s=w.submit_s[ran], end_s=window_end[ran],
                              gpu_hours=held[ran] * w.true_duration_s[ran] / 3600.0)
        result.offline_bound = bound.as_dict()
    for run in result.policies.values():
        m = policy_metrics(run, facts, submit_s=w.submit_s, deadline_s=w.deadline_s, gpus=held, tenant=w.tenant,
                           rtt_ms=prep.rtt_ms, origin=w.origin_region, latency_slo_ms=w.latency_slo_ms)
        b = result.offline_bound
        m["gap_to_bound"] = gap(m["carbon_kg"], b["carbon_kg"]) if b else None
        m["cost_gap_to_bound"] = gap(m["cost_usd"], b["cost_usd"]) if b else None
        m["replay_s"] = round(run.wall_s, 3)
        run.metrics = m
    return result


def _bar(name: str, total: int):  # noqa: ANN202 - tqdm's type
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="job", disable=None, leave=False, mininterval=0.5)


def as_json(result: SimulationResult) -> dict[str, object]:
    """``{"policies": {NAME: metrics}, "offline_bound": {...}, "sites": [...], "report": [...]}``."""
    return {
        "policies": {name: run.metrics for name, run in result.policies.items()},
        "offline_bound": result.offline_bound,
        "start": result.start.isoformat(),
        "jobs": int((~result.left_out).sum()),
        "left_out": int(result.left_out.sum()),
        "sites": [
            {"name": n, "grid_zone": z, "region": r, "gpus": int(c), "usd_per_gpu_hour": float(p)}
            for n, z, r, c, p in zip(result.sites.names, result.sites.zones, result.sites.regions,
                                     result.sites.capacity_gpus, result.sites.usd_per_gpu_hour, strict=True)
        ],
        "report": result.report,
    }


ALL_POLICIES = COMPARED
