"""Builders for the objects tests need: a site, what the broker last heard from it, and a job.

Every builder fills in sensible defaults so a test names only what it is about::

    spec = site("berlin", gpus={"a100-80gb": 16})           # two nodes of 8 A100-80GB
    state = site_state(spec, free={"a100-80gb": 3})          # 3 of the 16 free, healthy
    spec_job = job(count=2, model="a100-80gb")               # tenant t1, two whole GPUs

The objects are the real pydantic models, so a builder given something invalid fails the same way a
user's request would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from broker.models import Health, JobSpec, ModelCapacity, NodeGroup, SiteSpec, SiteState

# A fixed instant for tests that need one: 2026-07-30 12:00 UTC, a Thursday.
NOW = datetime(2026, 7, 30, 12, 0, tzinfo=UTC)

GPUS_PER_NODE = 8


def node_groups(gpus: Mapping[str, int]) -> list[NodeGroup]:
    """``{"a100-80gb": 16}`` → one node group of 8-GPU nodes (2 nodes); fewer than 8 GPUs is one node."""
    groups = []
    for model, count in gpus.items():
        per_node = min(count, GPUS_PER_NODE)
        if count < 1 or count % per_node:
            raise ValueError(f"{model}: {count} GPUs is not whole nodes of {per_node}; pass an explicit list")
        groups.append(NodeGroup(model=model, gpus_per_node=per_node, nodes=count // per_node))
    return groups


def site(
    name: str,
    *,
    region: str = "gcp:us-east1",
    grid_zone: str = "US-MIDA-PJM",
    timezone: str = "America/New_York",
    latitude: float = 33.2,
    longitude: float = -80.0,
    gpus: Mapping[str, int] | Sequence[NodeGroup | Mapping[str, Any]] | None = None,
    **more: Any,
) -> SiteSpec:
    """A site spec. ``gpus`` is ``{model: gpu count}`` (8 GPUs a node) or an explicit list of node groups;
    the default is 8 A100-80GB. ``more`` sets any other SiteSpec field (usd_per_gpu_hour, quotas, ...)."""
    if gpus is None:
        gpus = {"a100-80gb": 8}
    groups = node_groups(gpus) if isinstance(gpus, Mapping) else list(gpus)
    return SiteSpec.model_validate(
        {
            "name": name,
            "region": region,
            "grid_zone": grid_zone,
            "timezone": timezone,
            "latitude": latitude,
            "longitude": longitude,
            "gpus": groups,
            **more,
        }
    )


def site_state(
    spec: SiteSpec,
    *,
    free: Mapping[str, int] | None = None,
    healthy: bool = True,
    shared: Mapping[str, int] | None = None,
    heard_at: datetime = NOW,
) -> SiteState:
    """What the broker last heard from ``spec``'s site: one ModelCapacity per model the site has.

    ``free`` gives free whole GPUs per model (a model left out is entirely free); ``shared`` gives the
    largest free share, in thousandths, of a GPU already shared by fractional jobs (default 0).
    """
    free = dict(free or {})
    shared = dict(shared or {})
    totals = spec.total_gpus()
    stray = (set(free) | set(shared)) - set(totals)
    if stray:
        raise ValueError(f"site {spec.name} has no {', '.join(sorted(stray))}; it has {', '.join(totals)}")
    memory = {}
    for g in spec.gpus:
        memory[g.model] = max(memory.get(g.model, 0.0), g.gpu_memory_gib)
    capacity = []
    for model, total in totals.items():
        n_free = free.get(model, total)
        if not 0 <= n_free <= total:
            raise ValueError(f"site {spec.name}: {n_free} free {model} is not between 0 and {total}")
        n_used = total - n_free
        capacity.append(
            ModelCapacity(
                model=model,
                total_gpus=total,
                free_gpus=n_free,
                used_gpus=n_used,
                shared_free_milli=shared.get(model, 0),
                memory_gib_per_gpu=memory[model],
            )
        )
    return SiteState(
        site=spec.name,
        health=Health.HEALTHY if healthy else Health.UNHEALTHY,
        last_heard_at=heard_at,
        capacity=capacity,
        reason=None if healthy else "unreachable",
    )


def job(
    tenant: str = "t1",
    name: str = "job-1",
    count: int = 1,
    model: str | None = None,
    memory_gib: float | None = None,
    milli: int = 1000,
    *,
    duration_s: float = 3600,
    **more: Any,
) -> JobSpec:
    """A job spec asking for ``count`` GPUs (or ``milli`` thousandths of one); ``more`` sets any other
    JobSpec field (priority, deadline, allowed_regions, ...)."""
    gpus: dict[str, Any] = {"count": count, "milli": milli}
    if model is not None:
        gpus["model"] = model
    if memory_gib is not None:
        gpus["memory_gib"] = memory_gib
    return JobSpec.model_validate(
        {"tenant": tenant, "name": name, "gpus": gpus, "duration_s": duration_s, **more}
    )


def placed_in_one_pass(spec: SiteSpec, state: SiteState, jobs: Sequence[JobSpec]) -> list[Any]:
    """``jobs`` decided in order in one pass of the default pipeline at ``spec``'s site, each placement assumed
    before the next job is decided, as the broker's pass does: each job's placement, or None where it was not
    placed."""
    from broker.cycle import PassDecider
    from policies.pipeline import default_pipeline
    from policies.snapshot import JobRequest, build_snapshot

    decider = PassDecider(default_pipeline(), build_snapshot(NOW, [spec], {spec.name: state}).working_copy(NOW))
    out: list[Any] = []
    for i, spec_ in enumerate(jobs):
        placement = decider.decide(JobRequest.from_spec(f"job-{i}", spec_))
        if placement.placed:
            decider.assume(placement)  # type: ignore[arg-type]
        out.append(placement if placement.placed else None)
    return out
