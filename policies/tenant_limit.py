"""Federation-wide GPU limits per tenant, as Armada's per-queue limits and Kueue's ClusterQueue quotas bound a
tenant across a shared pool: a platform team caps how many GPUs each tenant's jobs may hold at once over every
site of the federation together (``broker.tenant_limits``, ``broker.default_tenant_limit``), whatever each site's
own quota would still allow. Units: GPUs, a fractional job counting its share and a MIG slice N/7 of a GPU
(:attr:`policies.snapshot.JobRequest.charge`), as site quotas count them.

A tenant holds the GPUs of its jobs on a site or on their way to one (dispatching, admitted, running); a job
whose start would take its tenant past its limit waits in the queue (:mod:`policies.filters.tenant_limit`
rejects every site, saying why), and starts once the tenant's running jobs end and leave room. Deferred starts
are not counted until they start. Pure: the broker counts what each tenant holds at the start of a pass
(:class:`TenantRoom`), and each placement of the pass is debited at once (``Snapshot.assume``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

EPS = 1e-9


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The limits as configured: GPUs per named tenant, and ``default`` for every other (None: unlimited)."""

    limits: Mapping[str, float] = field(default_factory=dict)
    default: float | None = None

    def of(self, tenant: str | None) -> float | None:
        """``tenant``'s limit in GPUs, or None where it has none."""
        if tenant is None:
            return None
        limit = self.limits.get(tenant)
        return self.default if limit is None else limit

    def __bool__(self) -> bool:
        return bool(self.limits) or self.default is not None


@dataclass(slots=True)
class TenantRoom:
    """What each tenant holds now across the federation (``held``, GPUs), against its limit (``limits``)."""

    limits: TenantLimits
    held: dict[str, float] = field(default_factory=dict)

    def room(self, tenant: str | None) -> float:
        """The GPUs ``tenant`` may still start (inf: no limit; never below 0)."""
        limit = self.limits.of(tenant)
        if limit is None:
            return math.inf
        return max(limit - self.held.get(tenant or "", 0.0), 0.0)

    def fits(self, tenant: str | None, charge: float) -> bool:
        return self.room(tenant) >= charge - EPS

    def debit(self, tenant: str | None, charge: float) -> None:
        """A job of ``tenant`` holding ``charge`` GPUs starts (placed in this pass)."""
        if tenant is not None and self.limits.of(tenant) is not None:
            self.held[tenant] = self.held.get(tenant, 0.0) + charge

    def credit(self, tenant: str | None, charge: float) -> None:
        """A job of ``tenant`` holding ``charge`` GPUs gives them back (:meth:`debit` undone)."""
        self.debit(tenant, -charge)

    def copy(self) -> TenantRoom:
        return TenantRoom(self.limits, dict(self.held))
