"""Prometheus metrics (``GET /metrics``), one registry per broker.

Counters and the decision-latency histogram are updated where things happen (the cycle, the job book, the
lifecycle). Everything that is a level (jobs by state, the sites' GPUs, carbon, prices, health, how old
their telemetry is, the estimated carbon and cost of running work) is read from the broker's state when
Prometheus scrapes, by :class:`BrokerCollector`, so it costs nothing between scrapes and is never stale.

Names follow Prometheus' conventions: ``heliotrope_`` prefix, base units (seconds, grams, US dollars),
``_total`` for counters. Label sets are bounded by the configuration (sites, GPU models, tenants with jobs,
job states), never by job ids.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.ids import GPU_MODEL_IDS
from broker.models import JobState
from policies.snapshot import MODEL_INDEX, TDP_KW, JobRequest

if TYPE_CHECKING:
    from broker.service import Broker

DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class Metrics:
    """The broker's counters and histogram, in a registry of its own (two brokers in one process, as the
    tests run them, never share figures)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("heliotrope_decisions", "Placement decisions made by the scheduling cycle, by "
                                 "outcome (placed, deferred, unplaceable)", ["outcome"], registry=r)
        self.placed = self.decisions.labels("placed")
        self.deferred = self.decisions.labels("deferred")
        self.unplaceable = self.decisions.labels("unplaceable")
        self.groups_skipped = Counter("heliotrope_queue_groups_skipped", "Queue groups a full pass stopped "
                                      "deciding after one of their jobs found no site", registry=r)
        self.decision_seconds = Histogram("heliotrope_decision_seconds", "Time to decide one job (the placement "
                                          "pipeline and the time-shift search)", buckets=DECISION_BUCKETS,
                                          registry=r)
        self.passes = Counter("heliotrope_scheduling_passes", "Scheduling passes, by kind (full: the whole queue; "
                              "new: only jobs submitted since)", ["kind"], registry=r)
        self.transitions = Counter("heliotrope_job_transitions", "Job state changes, by the state entered",
                                   ["state"], registry=r)
        self.finished = Counter("heliotrope_jobs_finished", "Jobs that ended, by final state and tenant",
                                ["state", "tenant"], registry=r)
        self.pruned = Counter("heliotrope_jobs_pruned", "Finished jobs deleted, with their transitions and decision, "
                              "job_retention_h after they ended", registry=r)
        self.carbon_grams = Counter("heliotrope_placed_carbon_grams", "Estimated emissions of the jobs placed "
                                    "(GPUs x board power x expected duration x the chosen site's grid intensity "
                                    "at the decision), for each admission, plus the overrun of an attempt that "
                                    "ran past its estimate; never taken back for one that ended early (GET "
                                    "/v1/carbon is)", registry=r)
        self.carbon_agnostic_grams = Counter("heliotrope_placed_carbon_agnostic_grams", "What the same jobs "
                                             "would have emitted where a carbon-agnostic choice put them, counted "
                                             "likewise (broker.carbon_ledger)", registry=r)
        self.preemptions = Counter("heliotrope_preemptions", "Attempts a site preempted, by site", ["site"],
                                   registry=r)
        self.lost = Counter("heliotrope_lost_attempts", "Attempts a site lost (a site gone, a node drained or "
                            "lost, an eviction, a Pod it could not place, an attempt it forgot across a restart), "
                            "by site; a job fails at its max_lost_attempts-th loss", ["site"], registry=r)
        self.moves = Counter("heliotrope_moves", "Running jobs the cycle asked their site to checkpoint and stop, "
                             "by site and why: to restart where the rest of the run saves (saving), to make "
                             "room for a job near its users (room), or to wait for cleaner hours (pause)",
                             ["site", "why"], registry=r)

    def bind(self, broker: Broker) -> None:
        """Read the broker's levels at every scrape."""
        self.registry.register(BrokerCollector(broker))


class ScopedView:
    """What a site operator may read of a registry: samples labelled with one of its own ``sites``, and the
    platform's aggregates (samples with neither a ``site`` nor a ``tenant`` label); never a sample labelled
    with a tenant (tenants' figures are theirs and the platform's) or with another site. A registry-like
    object for ``generate_latest``."""

    def __init__(self, registry: CollectorRegistry, sites: frozenset[str]) -> None:
        self.registry, self.sites = registry, sites

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = [s for s in family.samples if "tenant" not in s.labels
                    and ("site" not in s.labels or s.labels["site"] in self.sites)]
            if not kept and family.samples:
                continue
            scoped = Metric(family.name, family.documentation, family.type, family.unit)
            scoped.samples = kept
            yield scoped


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class BrokerCollector(Collector):
    """The levels, read from the broker when scraped."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def describe(self) -> list[Metric]:
        return []  # levels are computed at collect time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        b = self.broker
        jobs = _gauge("heliotrope_jobs", "Unfinished jobs by state and tenant", ["state", "tenant"])
        usage = b.book.active.by_tenant()
        for tenant, tenant_usage in sorted(usage.items()):
            for state, n in sorted(tenant_usage.jobs.items()):
                jobs.add_metric([state, tenant], n)
        running = [job for job in b.book.active.unqueued()
                   if job.state in (JobState.ADMITTED, JobState.RUNNING) and job.site is not None]
        yield jobs
        holding = _gauge("heliotrope_tenant_gpus_held", "GPUs the tenant's jobs hold across the federation "
                         "(dispatching, admitted, running, preempted until requeued; a fractional job its share), "
                         "as broker.tenant_limits counts them", ["tenant"])
        for tenant, tenant_usage in sorted(usage.items()):
            if tenant_usage.gpus_held or any(state != JobState.QUEUED.value for state in tenant_usage.jobs):
                holding.add_metric([tenant], tenant_usage.gpus_held)
        limit = _gauge("heliotrope_tenant_gpus_limit", "The GPUs broker.tenant_limits, or a limit set through PUT "
                       "/v1/tenants/{tenant}/limit, lets the tenant hold across the federation (tenants either names "
                       "and limits; broker.default_tenant_limit for the rest is not listed)", ["tenant"])
        limits = b.limits.current
        for tenant in sorted(limits.named()):
            if (gpus := limits.of(tenant)) is not None:
                limit.add_metric([tenant], gpus)
        yield holding
        yield limit
        yield from self._sites(running)

    def _sites(self, running: list) -> Iterator[Metric]:
        b = self.broker
        now = b.clock.now()
        free = _gauge("heliotrope_site_free_gpus", "Whole GPUs with nothing on them, as the site last reported",
                      ["site", "model"])
        total = _gauge("heliotrope_site_gpus", "GPUs the site has, as it last reported", ["site", "model"])
        healthy = _gauge("heliotrope_site_healthy", "1 when the broker may place jobs on the site (healthy, heard "
                         "from within site_stale_after_s, not being removed, not cordoned)", ["site"])
        age = _gauge("heliotrope_site_telemetry_age_seconds", "Seconds since the site was last heard from",
                     ["site"])
        hottest = _gauge("heliotrope_site_gpu_temperature_max_celsius", "The site's hottest GPU, as it last "
                         "reported (sites that report no temperature are left out)", ["site"])
        throttled = _gauge("heliotrope_site_gpus_throttled_ratio", "Share (0..1) of the site's GPUs whose clocks "
                           "heat or power held down at its last reading (sites that do not read clock-event "
                           "reasons are left out)", ["site"])
        carbon = _gauge("heliotrope_site_carbon_intensity_grams_per_kwh", "The site's grid carbon intensity now "
                        "(gCO2e/kWh), as routing sees it", ["site", "zone"])
        price = _gauge("heliotrope_site_price_usd_per_gpu_hour", "Price of one GPU-hour, as routing sees it",
                       ["site", "model"])
        carbon_rate = _gauge("heliotrope_running_carbon_grams_per_hour", "Estimated emissions of the work running "
                             "on the site: GPUs held x board power x the grid's intensity now", ["site"])
        cost_rate = _gauge("heliotrope_running_cost_usd_per_hour", "Estimated cost of the work running on the "
                           "site: GPUs held x price (sites running GPUs that have no price are left out)", ["site"])
        for name, member in sorted(b.federation.members.items()):
            state = member.public_state()
            if member.last_heard_at is not None:
                age.add_metric([name], max((now - member.last_heard_at).total_seconds(), 0.0))
            for cap in state.capacity:
                free.add_metric([name, cap.model], cap.free_gpus)
                total.add_metric([name, cap.model], cap.total_gpus)
            if state.telemetry.temperature_c_max > 0:
                hottest.add_metric([name], state.telemetry.temperature_c_max)
            if state.telemetry.throttled_pct is not None:
                throttled.add_metric([name], state.telemetry.throttled_pct / 100.0)
        snap = b.federation.freeze(now) if b.federation.members else None
        if snap is not None:
            for i, name in enumerate(snap.sites):
                spec = b.federation.members[name].spec
                # What routing sees: stale reports count, and a cordoned site takes no new jobs.
                cordoned = bool(snap.cordoned[i]) if snap.cordoned.size else False
                healthy.add_metric([name], float(snap.healthy[i] and not cordoned))
                intensity = float(snap.carbon_g_per_kwh[i]) if snap.carbon_g_per_kwh.size else math.nan
                if math.isfinite(intensity):
                    carbon.add_metric([name, spec.grid_zone], intensity)
                for m in np.flatnonzero(snap.total_gpus[i] > 0):
                    usd = float(snap.usd_per_gpu_hour[i, m])
                    if math.isfinite(usd):
                        price.add_metric([name, GPU_MODEL_IDS[m]], usd)
            grams: Tally[str] = Tally()
            usd_h: Tally[str] = Tally()
            unpriced: set[str] = set()  # sites running work whose GPUs have no price: their cost is unknown
            for job in running:
                i, m = snap.index.get(job.site), MODEL_INDEX.get(job.gpu_model or "")
                if i is None or m is None:
                    continue
                gpus = JobRequest.from_spec(job.id, job.spec).charge  # a share of one GPU for a fractional job
                intensity = float(snap.carbon_g_per_kwh[i]) if snap.carbon_g_per_kwh.size else math.nan
                if math.isfinite(intensity):
                    grams[job.site] += gpus * TDP_KW[m] * intensity
                usd = float(snap.usd_per_gpu_hour[i, m])
                if math.isfinite(usd):
                    usd_h[job.site] += gpus * usd
                else:
                    unpriced.add(job.site)
            for name in snap.sites:
                if snap.carbon_g_per_kwh.size and math.isfinite(float(snap.carbon_g_per_kwh[snap.index[name]])):
                    carbon_rate.add_metric([name], grams[name])
                if name not in unpriced:  # (0 where nothing runs: that costs nothing, priced or not)
                    cost_rate.add_metric([name], usd_h[name])
        kept = _gauge("heliotrope_site_latency_reserve_gpus", "Protection level for jobs with a latency objective "
                      "(ShiftPolicy.latency_reserve: this quantile of the GPUs they held at the site, hour by hour "
                      "over the last week); deferred work without one leaves it free less what they hold in each "
                      "hour", ["site", "model", "quantile"])
        for (name, m, q), gpus in sorted(b.cycle.latency_reserve().items()):
            kept.add_metric([name, GPU_MODEL_IDS[m], f"{q:g}"], gpus)
        yield from (free, total, healthy, age, hottest, throttled, carbon, price, carbon_rate, cost_rate, kept)

