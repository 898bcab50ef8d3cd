"""The broker's queue order across tenants, from the fair shares the sites report.

Sites with quotas divide their GPUs by fair share (``policies.quota``, ``policies.fairshare``): in mode
``time`` each tenant's weight is moved by its decayed usage, ``P = max(0, W + k·(W − U))`` with W its share
of the pool's weights and U its decayed usage (here: its share of the decayed GPU-hours the pool's listed
tenants report; KAI-scheduler's time-aware fairness); in mode ``instant`` ``P = W``. A site divides pool by
pool: the tenants whose quotas count any model share all its GPUs, those whose quotas count one model share
that model's GPUs (the site's capacity report says how many). The broker holds the queue, so it is the broker
that must offer jobs in that order, or a site can only act on fairness by preempting:

- a tenant's *entitlement* is the sum over sites of ``pool GPUs × P / ΣP``, ΣP over the listed tenants of
  its pool there: a tenant whose quota counts a site's 8 H100 is entitled to a share of those 8, not of
  the site's every GPU, and it does not shrink the shares of the tenants counting any model (nor they its);
- it *holds* the sum of the GPUs it runs there, of any model (best-effort jobs beyond its quota's model too);
- within one priority, the queue goes to the tenant with the least held per entitled GPU first, re-ranked
  as each of its jobs is placed (the placement's GPUs count at once), then to its oldest job; a tenant no
  site lists is entitled to nothing and comes after every listed one, even one whose usage brought its
  entitlement to 0 (it still gets what they leave).

Why ``held`` counts every GPU and the rank ignores the job's model: the order is one per tenant, decided
before placement, and most jobs do not name a model (a site may give them any), so a rank per model would
have no model to use for them; the queue's walk (``broker.queue``) ranks groups by tenant too. With one
number per tenant, both sides are the tenant's whole: what its quotas entitle it to, against everything it
holds at those sites. GPUs it holds beyond its pool (best-effort jobs on another model) then move it back,
as they should: it already has more than its quotas count. A tenant with a one-model quota at one site and
an any-model quota at another adds both entitlements, as before.

Sites whose mode is ``off`` and sites
without quotas add nothing; with no entitlement anywhere the order is the plain one (priority, then the
caller's key). Units: GPUs. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

from broker.models import QuotaState, TenantQuotaState
from policies.fairshare import weight_fractions

T = TypeVar("T")


class Standing(NamedTuple):
    """One tenant over the sites: GPUs it holds, GPUs it is entitled to, and whether any site lists it."""

    held: float
    entitled: float
    listed: bool


def rank(standing: Mapping[str, Standing], held: Mapping[str, float], tenant: str) -> tuple[bool, float]:
    """A tenant's place across tenants within one priority: listed ones first, then the least held per
    entitled GPU (a listed tenant entitled to nothing, after the other listed ones)."""
    s = standing.get(tenant)
    entitled = s.entitled if s is not None else 0.0
    ratio = held.get(tenant, 0.0) / entitled if entitled > 0 else float("inf")
    return (s is None or not s.listed), ratio


def standings(reports: Sequence[QuotaState],
              capacities: Sequence[Mapping[str, float] | None] | None = None) -> dict[str, Standing]:
    """Per tenant: GPUs held, GPUs entitled and whether it is listed, over the sites' quota reports.
    ``capacities[i]``: the GPUs of each model at the site of ``reports[i]`` (its capacity report), which sizes
    the pools of its one-model quotas; None (or left out): every listed tenant there shares ``capacity_gpus``."""
    out: dict[str, list[float]] = {}
    for i, q in enumerate(reports):
        if not q.enforced or q.fair_share.mode == "off":
            continue
        entitled: dict[str, float] = {}
        for cap, listed in _pools(q, capacities[i] if capacities is not None else None):
            entitled.update(_divide(q, cap, listed))
        if not entitled:  # no listed tenant weighs anything here
            continue
        for t in q.tenants:
            entry = out.setdefault(t.tenant, [0.0, 0.0, False])
            entry[0] += t.in_use_gpus
            if t.listed and t.tenant in entitled:
                entry[1] += entitled[t.tenant]
                entry[2] = True
    return {t: Standing(held, entitled, listed) for t, (held, entitled, listed) in out.items()}


def _pools(q: QuotaState, by_model: Mapping[str, float] | None) -> list[tuple[float, list[TenantQuotaState]]]:
    """The pools a site divides by fair share, as ``policies.quota`` does: (its GPUs, the listed tenants whose
    quotas count it), one pool per model a quota counts (that model's GPUs in ``by_model``) and one of
    ``capacity_gpus`` for quotas counting any model. Without ``by_model``, one pool of every listed tenant."""
    listed = [t for t in q.tenants if t.listed]
    if by_model is None:
        return [(q.capacity_gpus, listed)]
    pools: dict[str | None, list[TenantQuotaState]] = {}
    for t in listed:
        pools.setdefault(t.model, []).append(t)
    return [(q.capacity_gpus if pool is None else by_model.get(pool, 0.0), tenants) for pool, tenants in pools.items()]


def _divide(q: QuotaState, capacity_gpus: float, listed: Sequence[TenantQuotaState]) -> dict[str, float]:
    """GPUs each of ``listed`` (one pool's tenants) is entitled to of the pool's ``capacity_gpus``: its share
    ``P / ΣP``, U its share of the pool's decayed usage."""
    fractions = weight_fractions([t.fair_share_weight for t in listed])
    if not fractions:
        return {}
    usage = sum(t.decayed_usage_gpu_h for t in listed)
    p = {}
    for t, w in zip(listed, fractions, strict=True):
        u = t.decayed_usage_gpu_h / usage if usage > 0 else w
        p[t.tenant] = max(0.0, w + q.fair_share.k * (w - u)) if q.fair_share.mode == "time" else w
    total = sum(p.values()) or 1.0
    return {t: capacity_gpus * share / total for t, share in p.items()}


class FairOrder(Generic[T]):
    """Iterate ``items`` in fair-share order; call :meth:`placed` after an item is placed (before asking
    for the next) so its tenant's standing moves. ``key(item)``: the order within a tenant and the last
    tie-break (e.g. urgency, then age); ``priority(item)``: higher first, across tenants."""

    def __init__(self, items: Sequence[T], tenant: Callable[[T], str], priority: Callable[[T], int],
                 key: Callable[[T], Hashable], standing: Mapping[str, Standing]) -> None:
        self._priority = priority
        self._key = key
        self._standing = standing
        self._held = {t: s.held for t, s in standing.items()}
        queues: dict[str, list[T]] = {}
        for item in items:
            queues.setdefault(tenant(item), []).append(item)
        self._queues = {t: sorted(q, key=lambda i: (-priority(i), key(i)), reverse=True) for t, q in queues.items()}
        self._heap = [self._entry(t) for t in self._queues]
        heapq.heapify(self._heap)

    def _entry(self, tenant: str) -> tuple:
        head = self._queues[tenant][-1]
        return (-self._priority(head), *rank(self._standing, self._held, tenant), self._key(head), tenant)

    def placed(self, tenant: str, gpus: float) -> None:
        self._held[tenant] = self._held.get(tenant, 0.0) + gpus

    def __iter__(self) -> Iterator[T]:
        while self._heap:
            tenant = heapq.heappop(self._heap)[-1]
            yield self._queues[tenant].pop()
            if self._queues[tenant]:  # re-ranked with what ``placed`` added meanwhile
                heapq.heappush(self._heap, self._entry(tenant))
