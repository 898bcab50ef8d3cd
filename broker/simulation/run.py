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
    7. Solve the offline bound (``broker.simulation.bound``) on windows from each job's submit to its
       deadline, and for a policy that finished jobs after their deadlines, the same LP with those jobs'
       windows reaching their actual ends: every policy is measured against a bound that holds for it
       (details in :func:`_offline` and :func:`_per_run_bounds`).
    8. With ``oracle``, pack the whole-job oracle (``broker.simulation.oracle``), guided by the first LP's
       prices of capacity, and bound it as a policy.
    9. Search the whole-job bound (``broker.simulation.whole_job_bound``) from the first LP's prices of
       capacity, on the same windows: every job whole, at one site, in one stretch (checkpointable jobs,
       which a policy may move, as divisible work). A run that ended jobs past the windows is held to the
       higher of its fluid bound and the value at the prices found on its own windows, so this bound too
       holds for every policy it is set against (details in :func:`_whole_job`).
    10. Compute the metrics (``broker.simulation.metrics``).

Defaults: prices, latency and region coordinates come from the copies shipped in ``data/`` (see
``data/SOURCES.md``) unless ``--prices``, ``--latency`` or ``--regions`` name other files.
"""

from __future__ import annotations

import calendar
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np

from broker import ids
from broker.config import load_config
from broker.data.carbon import CarbonData, load_carbon
from broker.data.latency import load_latency
from broker.data.prices import PriceTable, load_gcp_prices
from broker.data.regions import load_gcp_regions
from broker.data.traces import ColumnMapping, Trace, load_trace
from broker.models import SiteSpec
from broker.simulation import engine
from broker.simulation.bound import BoundInfeasible, offline_bound
from broker.simulation.defaults import DEFAULT_LATENCY, DEFAULT_PRICES, DEFAULT_REGIONS
from broker.simulation.federation import DEFAULT_GPU_MODEL, build_default_federation
from broker.simulation.forecasts import HORIZON_H, forecast_rows
from broker.simulation.metrics import gap, policy_metrics
from broker.simulation.oracle import whole_job_oracle
from broker.simulation.results import SimulationResult, SiteFacts
from broker.simulation.whole_job_bound import WholeJobBoundError, lagrangian_value, whole_job_bound
from broker.simulation.workload import Workload, WorkloadAssumptions, build_workload
from policies.baselines import policy
from policies.profiles import BUILTIN as PROFILES
from policies.tenant_limit import TenantLimits


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
    oracle: bool = False  # also pack the whole-job oracle (broker.simulation.oracle) as a reference row
    whole_job_steps: int = 300  # steps of the whole-job bound's search (with bound; 0: the LP's prices only)
    zone_regions: dict[str, str] = field(default_factory=dict)  # zone -> cloud region, beyond ZONE_REGIONS
    cpu_jobs: str = "error"  # rows of 0 GPUs in the trace: an error, or "drop" (reported)
    time_zone: str | None = None  # IANA zone of the trace's times without an offset (None: UTC)
    # The GPU model of every site of the default federation; None: the one model the trace's jobs name, where
    # every job that names a model names the same one, else DEFAULT_GPU_MODEL (_default_site_model)
    site_model: str | None = None
    workers: int | None = None  # processes replaying policies side by side (default: one per core)
    assumptions: dict[str, object] = field(default_factory=dict)  # WorkloadAssumptions overrides
    # GPUs each tenant's jobs may hold at once across the federation (broker.default_tenant_limit); None: no limit
    tenant_limit: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.whole_job_steps, bool) or not isinstance(self.whole_job_steps, int) \
                or self.whole_job_steps < 0:
            raise ValueError(f"whole_job_steps must be a whole number, 0 or more, not {self.whole_job_steps!r}")


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
    fitting: np.ndarray  # bool[n_jobs, n_sites]: where each job fits and meets its latency objective
    tenant_limits: TenantLimits | None = None  # what every policy holds tenants to (SimulationSpec.tenant_limit)


def prepare(spec: SimulationSpec) -> Prepared:
    for name in spec.policies:
        policy(name)  # unknown names fail before any loading
    report: list[str] = []
    origin = spec.origin
    if spec.time_format == "seconds" and origin is None:
        origin = datetime(1970, 1, 1, tzinfo=UTC)
        report.append("trace times are seconds after the Unix epoch (no --origin given)")
    trace = load_trace(spec.trace, spec.mapping, time_format=spec.time_format, origin=origin,  # type: ignore[arg-type]
                       trace_from=spec.trace_from, days=spec.days, cpu_jobs=spec.cpu_jobs,  # type: ignore[arg-type]
                       time_zone=spec.time_zone)
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

    # --start maps the window's first instant (--trace-from, else the UTC midnight before the first submit, so
    # that every job keeps its hour of the day against the carbon data's hours); every offset is kept. Without
    # --start the first submit is the first instant: the trace keeps its dates and times where the carbon data
    # covers them, else its month, day and time in another year.
    if spec.trace_from is not None:
        anchor = trace.span[0]
    elif spec.start is not None:
        anchor = trace.start.replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        anchor = trace.start
    lead_s = (trace.start - anchor).total_seconds()
    needed_s = lead_s + float((trace.submit_s + trace.duration_s).max())
    mapped = _choose_start(spec.start, anchor, carbon, zones, needed_s, report)
    first_job_at = mapped + timedelta(seconds=lead_s)
    hour0 = mapped.replace(minute=0, second=0, microsecond=0)  # time 0 of the run: carbon data is hourly
    data_end = min(carbon.span(z)[1] for z in zones)
    hours = int((data_end - hour0) // timedelta(hours=1))
    intensity = {z: carbon.series(z, hour0, hours) for z in zones}
    if site_file is not None:
        sites = _with_own_region_rtt(site_file)
        report.append(f"sites: {len(sites)} from {spec.sites}")
        given = [s.name for s, f in zip(sites, site_file, strict=True) if s is not f]
        if given:
            report.append(f"sites: {', '.join(given)} list no RTT from their own region; a job from there reaches "
                          "them in 0 ms in this run, as in the default federation (jobs come from the sites' regions)")
    else:
        prices = load_gcp_prices(spec.prices)
        latency = load_latency(spec.latency)
        regions = load_gcp_regions(spec.regions)
        default = build_default_federation(
            zones, trace_mean_gpus_busy=trace.mean_gpus_busy(_busy_window(trace)), prices=prices, latency=latency, regions=regions,
            largest_job_gpus=int(trace.gpus.max()), utilisation=spec.utilisation, zone_regions=spec.zone_regions,
            model=spec.site_model if spec.site_model is not None else _default_site_model(trace, prices, report),
        )
        sites = default.sites
        report += [f"sites: {r}" for r in default.report]

    assumptions = WorkloadAssumptions.for_sites(sites, seed=spec.seed, **spec.assumptions)
    workload = _rebase(build_workload(trace, assumptions, start=first_job_at), hour0)
    report += [f"workload: {r}" for r in workload.report]
    forecasts = None
    if any(name in PROFILES for name in spec.policies):  # profiles read forecasts; the baselines do not
        forecasts = {z: forecast_rows(carbon, z, hour0, hours, report) for z in dict.fromkeys(s.grid_zone for s in sites)}
    federation = engine.build_federation(sites, intensity, hour0, forecasts, HORIZON_H)
    for s in sites:
        unpriced = sorted(set(s.total_gpus()) - set(s.usd_per_gpu_hour))
        if unpriced:
            report.append(f"prices: site {s.name} has no price for {', '.join(unpriced)}; jobs run on them cost "
                          "0 USD in this run (and in the cost bound)")
    requests = engine.requests_of(workload)
    fitting = engine.sites_fitting(requests, federation)
    left_out = ~fitting.any(axis=1)
    if left_out.any():
        bound = int(np.count_nonzero(~np.isnan(workload.latency_slo_ms[left_out])))
        report.append(f"left out: {int(left_out.sum())} jobs fit no site even when it is empty, or none that "
                      f"meets their latency objective (largest asks {int(workload.gpus[left_out].max())} GPUs; "
                      f"{bound} of them have a latency objective{models_no_site_has(workload, sites, left_out)}); "
                      "no policy runs them")
    limits = None
    if spec.tenant_limit is not None:
        limits = TenantLimits(default=spec.tenant_limit)
        larger = ~left_out & (np.array([r.charge for r in requests]) > spec.tenant_limit + 1e-9)
        if larger.any():
            report.append(f"left out: {int(larger.sum())} jobs ask more GPUs than --tenant-limit "
                          f"{spec.tenant_limit:g} lets a tenant hold (a broker refuses them at submission); no "
                          "policy runs them")
            left_out = left_out | larger
        report.append(f"tenant limit: every tenant's jobs hold at most {spec.tenant_limit:g} GPUs at once across "
                      "the federation, in every policy's replay (broker.default_tenant_limit); the bounds and the "
                      "whole-job oracle do not hold tenants to it")
    rtt = np.array([[s.rtt_ms.get(r, np.nan) for r in workload.region_names] for s in federation.specs],
                   dtype=np.float64).reshape(len(federation.specs), len(workload.region_names))
    return Prepared(workload, sites, federation, requests, left_out, rtt, report, fitting, limits)


def _default_site_model(trace: Trace, prices: PriceTable, report: list[str]) -> str:
    """The default federation's GPU model where ``--site-model`` does not give one: the model the trace's jobs
    name, where every job that names a model names the same one (a Slurm dump of one cluster's H100 jobs would
    otherwise be left out whole) and the price list prices it on demand somewhere, else
    :data:`DEFAULT_GPU_MODEL`; the choice is reported."""
    named = set()
    for m in {m for m in trace.model.tolist() if m is not None}:
        try:
            named.add(ids.gpu_model(m))
        except ids.UnknownIdentifier:
            return DEFAULT_GPU_MODEL  # the workload's build names it, with its line
    if len(named) != 1 or (only := next(iter(named))) == DEFAULT_GPU_MODEL:
        return DEFAULT_GPU_MODEL
    if not prices.regions_with(only):
        report.append(f"sites: every job of the trace that names a GPU model names {only}, which the price list "
                      f"does not price on demand, so the default sites are {DEFAULT_GPU_MODEL} (--site-model "
                      f"chooses a model it prices: {', '.join(prices.models)}; --sites gives sites of any model)")
        return DEFAULT_GPU_MODEL
    report.append(f"sites: every job of the trace that names a GPU model names {only}, so the default sites are "
                  f"{only} (--site-model chooses another)")
    return only


def _with_own_region_rtt(sites: Sequence[SiteSpec]) -> list[SiteSpec]:
    """Each site with an RTT of 0 ms from its own region where its spec gives none (other sites returned as
    they are, the same objects).

    The workload draws every job's origin from the sites' regions (``WorkloadAssumptions.for_sites``), and a
    latency objective is met only where an RTT from the origin is given; a broker config lists the RTTs
    measured from *other* regions (``config/demo.yaml``), so without this every latency-bound job whose
    origin no site lists would fit no site and be left out of every policy (10 % of a run by default). A job
    from a site's own region is the one case whose RTT needs no measurement; the default federation gives it
    0 ms too (``federation._Rtt.between``). An RTT the file gives for its own region is kept."""
    return [s if s.region in s.rtt_ms else s.model_copy(update={"rtt_ms": {**s.rtt_ms, s.region: 0.0}})
            for s in sites]


def models_no_site_has(workload: Workload, sites: Sequence[SiteSpec], jobs: np.ndarray) -> str:
    """A clause naming the GPU models that ``jobs`` (a bool mask) ask for and no site has, or "": the
    reason such jobs are left out, which their GPU count alone would not say."""
    held = {m for s in sites for m in s.total_gpus()}
    asked = sorted({m for m in workload.model[jobs].tolist() if m is not None} - held)
    if not asked:
        return ""
    return (f"; jobs ask for {', '.join(asked)}, which no site has: the sites have {', '.join(sorted(held))}"
            " (--site-model names the default sites' model)")


def _busy_window(trace: Trace) -> tuple[datetime, datetime]:
    """The window the default sites are sized over: the trace's span, or, when every job was submitted at
    one instant, from then until the last job would end."""
    lo, hi = trace.span
    if hi <= lo:
        hi = lo + timedelta(seconds=float((trace.submit_s + trace.duration_s).max()))
    return lo, hi


def _rebase(workload: Workload, hour0: datetime) -> Workload:
    """The same jobs with time 0 at ``hour0`` (the hour the run starts in), so that hour ``h`` of the run is
    hour ``h`` of the carbon data; every job keeps its absolute submit time and deadline."""
    shift = (workload.start - hour0).total_seconds()
    return replace(workload, start=hour0, submit_s=workload.submit_s + shift, deadline_s=workload.deadline_s + shift)


def _choose_start(given: date | datetime | None, anchor: datetime, carbon: CarbonData, zones: list[str],
                  needed_s: float, report: list[str]) -> datetime:
    """Where the trace window's first instant (``anchor``) goes in the carbon data's time."""
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
    if lo <= anchor and anchor + need <= hi:
        return anchor
    for year in range(lo.year, hi.year + 1):
        day = min(anchor.day, calendar.monthrange(year, anchor.month)[1])
        start = anchor.replace(year=year, day=day)
        if lo <= start and start + need <= hi:
            report.append(f"start: the trace window's first instant ({anchor.isoformat()}) is mapped to "
                          f"{start.isoformat()}, the same date in the first year of carbon data that covers the "
                          "whole window (give --start to choose)")
            return start
    raise engine.SimulationError(
        f"the carbon data ({lo.isoformat()} .. {hi.isoformat()}) cannot hold the trace window starting "
        f"{anchor.isoformat()}, {need.total_seconds() / 86400:.1f} days from its first instant to the end of the "
        "last job; pick a shorter window with --trace-from/--days, give --start (and --origin for --time-format "
        "seconds), or load more years of carbon data"
    )


def _check_covered(start: datetime, need: timedelta, lo: datetime, hi: datetime, zones: list[str], flag: str) -> None:
    if start < lo or start + need > hi:
        raise engine.SimulationError(
            f"{flag} {start.isoformat()}: the run needs carbon data from then until "
            f"{(start + need).isoformat()} (every job run at once), but zones {', '.join(zones)} all have data only "
            f"for {lo.isoformat()} .. {hi.isoformat()}; choose a --start inside that span"
        )


def simulate(spec: SimulationSpec, *, progress: bool = False, prepared: Prepared | None = None) -> SimulationResult:
    """Steps 1-8; returns every policy's replay with its metrics, and the bound. ``prepared``: steps 1-5
    already done (by :func:`prepare` on the same ``spec``)."""
    prep = prepared or prepare(spec)
    w = prep.workload
    facts = prep.federation.facts()
    held = w.held
    result = SimulationResult(start=w.start, sites=facts, submit_s=w.submit_s, deadline_s=w.deadline_s, gpus=held,
                              tenant=w.tenant, tenant_names=w.tenant_names, left_out=prep.left_out,
                              report=prep.report)
    workers = min(len(spec.policies), spec.workers or os.cpu_count() or 1)
    if workers > 1 and int((~prep.left_out).sum()) >= PARALLEL_FROM_JOBS:
        result.policies.update(_replay_in_parallel(prep, list(spec.policies), workers, progress))
    else:
        for name in spec.policies:
            bar = _bar(name, int((~prep.left_out).sum())) if progress else None
            try:
                run = engine.replay(name, policy(name), w, prep.federation, prep.requests, prep.left_out,
                                    progress=None if bar is None else (lambda n, b=bar: b.update(n - b.n)),
                                    tenant_limits=prep.tenant_limits)
            finally:
                if bar is not None:
                    bar.close()
            result.policies[name] = run
    ran = ~prep.left_out
    bounds: dict[str, dict[str, object]] = {}
    whole: dict[str, float] = {}
    if ran.any() and result.policies:
        last_end = max(float(np.nanmax(r.end_s)) for r in result.policies.values())
        shown = min(int(np.ceil(last_end / 3600.0)) + 1, facts.hours)
        result.sites = replace(facts, intensity=facts.intensity[:, :shown])  # the run's hours, for the plots
    runs = dict(result.policies)
    if ran.any() and (result.policies or spec.oracle):
        offline = windows = shadow = None
        if spec.bound:
            offline, windows, shadow = _offline(facts, w, ran, held, prep.fitting[ran], shadow_prices=True)
            result.offline_bound = offline
        if spec.oracle:
            try:
                result.oracle = whole_job_oracle(w, prep.federation, prep.fitting, prep.left_out,
                                                 shadow_kg_per_gpu_hour=shadow if spec.bound else None)
                runs[result.oracle.name] = result.oracle
            except engine.SimulationError as e:  # a reference row: the policies' figures stand without it
                result.report.append(f"not packed: {e}")
        if offline is not None and windows is not None:
            bounds = _per_run_bounds(facts, w, ran, held, prep.fitting[ran], offline, windows, runs)
            try:
                result.whole_job_bound, whole = _whole_job(facts, w, ran, prep.fitting[ran], windows, shadow, runs,
                                                           bounds, spec.whole_job_steps)
            except WholeJobBoundError as e:  # a reference: the policies' figures stand without it
                result.report.append(f"no whole-job bound: {e}")
    for name, run in runs.items():
        m = policy_metrics(run, facts, submit_s=w.submit_s, deadline_s=w.deadline_s, gpus=held, tenant=w.tenant,
                           rtt_ms=prep.rtt_ms, origin=w.origin_region, latency_slo_ms=w.latency_slo_ms)
        b = bounds.get(name)
        m["gap_to_bound"] = gap(m["carbon_kg"], float(b["carbon_kg"])) if b else None  # type: ignore[arg-type]
        m["cost_gap_to_bound"] = gap(m["cost_usd"], float(b["cost_usd"])) if b else None  # type: ignore[arg-type]
        m["bound_carbon_kg"] = b["carbon_kg"] if b else None
        whole_kg = whole.get(name)
        m["whole_job_bound_carbon_kg"] = whole_kg
        m["gap_to_whole_job_bound"] = gap(m["carbon_kg"], whole_kg) if whole_kg is not None else None
        m["bound_cost_usd"] = b["cost_usd"] if b else None
        m["replay_s"] = round(run.wall_s, 3)
        run.metrics = m
    if result.oracle is not None:
        result.oracle.metrics["guided_by_shadow_prices"] = shadow is not None
    return result


PARALLEL_FROM_JOBS = 5_000
"""Below this many jobs the policies replay one after the other: starting worker processes (about a
second each) would cost more than the replays."""

_SHARED: Prepared | None = None  # what a worker process replays (sent once, when it starts)


def _worker_init(prep: Prepared) -> None:
    global _SHARED
    _SHARED = prep


def _replay_one(name: str) -> engine.PolicyRun:
    assert _SHARED is not None
    p = _SHARED
    return engine.replay(name, policy(name), p.workload, p.federation, p.requests, p.left_out,
                         tenant_limits=p.tenant_limits)


def _replay_in_parallel(prep: Prepared, names: list[str], workers: int, progress: bool) -> dict[str, engine.PolicyRun]:
    """Each policy in a worker process (replays are independent; fresh "spawn" processes, so no thread or
    lock of this one is inherited); results in ``names`` order."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(prep,)) as pool:
        futures = {name: pool.submit(_replay_one, name) for name in names}
        bar = _bar("policies", len(names), unit="policy") if progress else None
        try:
            for _ in as_completed(futures.values()):
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return {name: futures[name].result() for name in names}


def _offline(facts: SiteFacts, w: Workload, ran: np.ndarray, held: np.ndarray, allowed: np.ndarray,
             shadow_prices: bool = False) -> tuple[dict[str, object], np.ndarray, np.ndarray | None]:
    """The offline bound on the jobs' own windows, those windows, and (``shadow_prices``) its carbon LP's
    price of each site-hour's capacity.

    Each job may use only the sites it fits and that meet its latency objective (``allowed``, bool[jobs
    that ran, sites]), the sites every policy is held to. The windows run from submit to deadline. When
    the sites cannot serve every job by its deadline even fluidly, every deadline is pushed back by the
    same extension (1 h, then doubling) until they can; the extension is reported. The carbon data's end
    closes every window: every policy finished before it.
    """
    horizon = facts.hours * 3600.0
    release = w.submit_s[ran]
    work = held[ran] * w.true_duration_s[ran] / 3600.0
    deadline = np.minimum(w.deadline_s[ran], horizon)
    extension = 0.0
    while True:
        windows = np.minimum(deadline + extension, horizon)
        try:
            solved = offline_bound(facts, release_s=release, end_s=windows, gpu_hours=work, allowed_sites=allowed,
                                   shadow_prices=shadow_prices)
            break
        except BoundInfeasible:
            if (windows >= horizon).all():
                raise
            extension = 3600.0 if extension == 0 else extension * 2
    offline = solved.as_dict()
    offline["deadline_extension_s"] = extension
    offline["windows"] = ("submit to deadline" if extension == 0 else
                          f"submit to deadline + {extension / 3600:g} h (no schedule meets every deadline)")
    return offline, windows, solved.shadow_kg_per_gpu_hour


def capacity_prices(prep: Prepared) -> np.ndarray:
    """float64[sites, hours of carbon data]: the offline bound's carbon LP's price of each site-hour's capacity
    (kg CO2e per GPU-hour: what one more GPU there and then would save), on the jobs' own windows as
    :func:`simulate` solves it. It reads the whole workload, the jobs still to come included: a reference
    for what knowing them is worth (``bench/green_sensitivity.py``), never an input to a policy."""
    w = prep.workload
    ran = ~prep.left_out
    _, _, shadow = _offline(prep.federation.facts(), w, ran, w.held, prep.fitting[ran], shadow_prices=True)
    assert shadow is not None
    return shadow


def _per_run_bounds(facts: SiteFacts, w: Workload, ran: np.ndarray, held: np.ndarray, allowed: np.ndarray,
                    offline: dict[str, object], windows: np.ndarray,
                    runs: dict[str, engine.PolicyRun]) -> dict[str, dict[str, object]]:
    """The bound each run is measured against: a run whose jobs all ended inside the offline bound's
    ``windows`` gets that bound; one that ran a job later gets the same LP with that job's window reaching
    its actual end, so that no policy can beat its bound by running late, and a policy's gap does not
    depend on which other policies ran."""
    horizon = facts.hours * 3600.0
    release = w.submit_s[ran]
    work = held[ran] * w.true_duration_s[ran] / 3600.0
    per_run: dict[str, dict[str, object]] = {}
    late_ends: dict[str, np.ndarray] = {}
    for name, run in runs.items():
        ends = run.end_s[ran]
        if (ends <= windows + 1e-6).all():
            per_run[name] = offline
        else:
            late_ends[name] = ends

    def own_bound(ends: np.ndarray) -> dict[str, object]:
        own = offline_bound(facts, release_s=release, end_s=np.minimum(np.fmax(windows, ends), horizon),
                            gpu_hours=work, allowed_sites=allowed).as_dict()
        late = int((ends > windows + 1e-6).sum())
        own["windows"] = f"as the offline bound, with the {late} jobs this policy finished later reaching their end"
        return own

    # Each bound solves its two LPs in two threads (HiGHS releases the GIL): as many bounds at once as
    # there are pairs of cores.
    with ThreadPoolExecutor(max_workers=max(1, min(len(late_ends), (os.cpu_count() or 2) // 2))) as pool:
        futures = {name: pool.submit(own_bound, ends) for name, ends in late_ends.items()}
        per_run.update({name: future.result() for name, future in futures.items()})
    return per_run


def _whole_job(facts: SiteFacts, w: Workload, ran: np.ndarray, allowed: np.ndarray, windows: np.ndarray,
               prices: np.ndarray | None, runs: dict[str, engine.PolicyRun], fluid: dict[str, dict[str, object]],
               steps: int) -> tuple[dict[str, object], dict[str, float]]:
    """The whole-job bound on the offline bound's ``windows``, searched from its LP's ``prices``, and each run's
    own: a run whose jobs all ended inside ``windows`` gets that bound; one that ran a job later gets the
    higher of its own fluid bound (``fluid``) and the value at the prices found with that job's window
    reaching its actual end (any prices give a valid bound, though prices found for the deadlines may be
    poor for wider windows), so that no policy can beat its bound by running late. Checkpointable jobs
    count as divisible work (a policy may move them).

    When no run met every window, the search stops once it rises above the cleanest of them: the windows
    may admit no whole-job schedule at all, and the bound is then reported without a figure (``carbon_kg``
    None, ``above_known`` true); each run keeps its own."""
    horizon = facts.hours * 3600.0
    jobs = {"release_s": w.submit_s[ran], "duration_s": w.true_duration_s[ran], "gpus": w.held[ran],
            "allowed_sites": allowed, "splittable": w.checkpointable[ran]}
    fits = {name: bool((run.end_s[ran] <= windows + 1e-6).all()) for name, run in runs.items()}
    carbons = {name: float(run.carbon_kg[ran].sum()) for name, run in runs.items()}
    found = whole_job_bound(facts, end_s=windows, start_prices=prices, max_iterations=steps,
                            upper_kg=min(carbons.values(), default=None), upper_fits=any(fits.values()), **jobs)
    bound = found.as_dict()
    bound["windows"] = "as the offline bound"
    if found.above_known:
        bound["carbon_kg"] = None
        bound["note"] = ("no replayed schedule met every window and the search rose above the cleanest of them: "
                         "no whole-job schedule may fit the windows at all, so no figure is given")
    per_run: dict[str, float] = {}
    for name, run in runs.items():
        if fits[name]:
            per_run[name] = found.carbon_kg
            continue
        own = lagrangian_value(facts, found.prices_kg_per_gpu_hour,
                               end_s=np.minimum(np.fmax(windows, run.end_s[ran]), horizon), **jobs)
        per_run[name] = max(own, float(fluid[name]["carbon_kg"]))  # type: ignore[arg-type]
    return bound, per_run


def _bar(name: str, total: int, unit: str = "job"):  # noqa: ANN202 - tqdm's type
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit=unit, disable=None, leave=False, mininterval=0.5)


def as_json(result: SimulationResult) -> dict[str, object]:
    """``{"policies": {NAME: metrics}, "offline_bound": {...}, "whole_job_bound": {...}, "oracle": {...} or null,
    "sites": [...], "report": [...]}``."""
    return {
        "policies": {name: run.metrics for name, run in result.policies.items()},
        "offline_bound": result.offline_bound,
        "whole_job_bound": result.whole_job_bound,
        "oracle": None if result.oracle is None else result.oracle.metrics,
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

