"""Federation-wide GPU limits per tenant, as Armada's per-queue limits and Kueue's ClusterQueue quotas bound a
tenant across a shared pool: a platform team caps how many GPUs each tenant's jobs may hold at once over every
site of the federation together (``broker.tenant_limits``, ``broker.default_tenant_limit``), whatever each site's
own quota would still allow, and changes a tenant's limit live (``PUT /v1/tenants/{tenant}/limit``: an override,
kept in the store, that stands over the configuration until it is deleted; :mod:`broker.limits`). Units: GPUs, a
fractional job counting its share and a MIG slice N/7 of a GPU (:attr:`policies.snapshot.JobRequest.charge`), as
site quotas count them.

A tenant holds the GPUs of its jobs on a site or on their way to one (dispatching, admitted, running); a job
whose start would take its tenant past its limit waits in the queue (:mod:`policies.filters.tenant_limit`
rejects every site, saying why), and starts once the tenant's running jobs end and leave room. Deferred starts
are not counted until they start. Pure: the broker counts what each tenant holds at the start of a pass
(:class:`TenantRoom`), and each placement of the pass is debited at once (``Snapshot.assume``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

EPS = 1e-9


LimitSource = Literal["config", "default", "override"]
"""Where a tenant's limit comes from: its own entry of ``broker.tenant_limits``, ``broker.default_tenant_limit``
(which may be none: unlimited), or an override set through the API."""

SOURCE_WORDS: dict[str, str] = {"config": "broker.tenant_limits", "default": "broker.default_tenant_limit",
                                "override": "set through PUT /v1/tenants/{tenant}/limit"}
"""How a message names where a tenant's limit comes from (``.format(tenant=...)``): the submission check's 422 and
the tenant-limit filter's reason say it alike."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The limits in force: GPUs per named tenant (``broker.tenant_limits``), ``default`` for every other (None:
    unlimited), and ``overrides``, set live by the API, which stand over both (a None override: unlimited)."""

    limits: Mapping[str, float] = field(default_factory=dict)
    default: float | None = None
    overrides: Mapping[str, float | None] = field(default_factory=dict)

    def of(self, tenant: str | None) -> float | None:
        """``tenant``'s limit in GPUs, or None where it has none."""
        if tenant is None:
            return None
        if tenant in self.overrides:
            return self.overrides[tenant]
        limit = self.limits.get(tenant)
        return self.default if limit is None else limit

    def source(self, tenant: str) -> LimitSource:
        """Where ``tenant``'s limit (:meth:`of`) comes from."""
        if tenant in self.overrides:
            return "override"
        return "config" if tenant in self.limits else "default"

    def named(self) -> set[str]:
        """The tenants the configuration or an override names (the default's are every other)."""
        return set(self.limits) | set(self.overrides)

    def with_overrides(self, overrides: Mapping[str, float | None]) -> TenantLimits:
        """These limits with ``overrides`` (tenant -> GPUs, None: unlimited) in place of the ones they have."""
        return TenantLimits(self.limits, self.default, dict(overrides))

    def __bool__(self) -> bool:
        """Whether any tenant has a limit (with none, the pass counts nothing)."""
        return (bool(set(self.limits) - set(self.overrides)) or self.default is not None
                or any(gpus is not None for gpus in self.overrides.values()))


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
