"""Site-local admission: the one decision every adapter makes before it accepts a job.

It joins the site's two pure ledgers:

- :class:`policies.inventory.Inventory`: whether and where the job's GPUs fit, all or none (nodes, NVLink
  domains, shared GPUs, MIG slices);
- :class:`policies.quota.QuotaBook`: whether the job's tenant may hold them (guarantee, burst, the
  non-preemptible rule, fair share) and, when the site is full, which running jobs to preempt for it.

``admit`` decides and changes nothing; the adapter then preempts the victims it names (``stop`` each,
after telling the broker), and ``start``\\ s the job. A job naming no model (and none chosen by the broker)
tries the site's models from the least memory per GPU up, and takes the first that admits it without
preempting anyone, else the first that admits it at all.

Time is POSIX seconds, passed in; nothing here reads a clock, so the live adapter, the tests and the
simulator drive it alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.models import JobSpec, QuotaState, SiteSpec, TenantQuota
from policies.inventory import Inventory, Placement
from policies.quota import Ask, QuotaBook


@dataclass(frozen=True, slots=True)
class Admitted:
    """Start the job at ``placement`` once ``victims`` (job ids, in order) are preempted. ``reason`` says why
    they are preempted (a reclaim of a guarantee, or a higher priority); ``borrowed``: the job runs above its
    tenant's guarantee, so the site may reclaim it."""

    placement: Placement
    ask: Ask
    victims: tuple[str, ...] = ()
    reason: str | None = None
    borrowed: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


class SiteAdmission:
    def __init__(self, spec: SiteSpec, quotas: Sequence[TenantQuota] | None = None) -> None:
        """``quotas``: the quotas in force (the configured ones with the operator's changes); default the
        spec's."""
        self.spec = spec
        self.inventory = Inventory.from_spec(spec)
        capacity = self.inventory.capacity()
        self.book = QuotaBook(spec.quotas if quotas is None else quotas, spec.fair_share, capacity)
        self.book.idle_gpus = self._idle_gpus
        memory: dict[str, float] = {}
        for g in spec.gpus:  # a model's memory is its largest node group's, as the inventory counts it
            memory[g.model] = max(memory.get(g.model, 0.0), g.gpu_memory_gib)
        self._models = sorted(capacity, key=lambda m: (memory[m], m))

    def _idle_gpus(self, model: str) -> float:
        """GPUs of ``model`` nothing holds in the inventory, the work the quota book does not count included (a
        Kubernetes site's Pods outside heliotrope, ``adapters.kubernetes``)."""
        use = self.inventory.usage().get(model)
        return 0.0 if use is None else max(0.0, use.gpus - use.busy)

    def admit(self, job_id: str, spec: JobSpec, now: float, model: str | None = None,
              demand: Mapping[str, float] | None = None) -> Admitted | Refused:
        """May the job start now, on ``model`` (the broker's choice) or any model here, and after preempting
        whom? ``demand``: GPUs each tenant wants here in all (running and waiting), for the fair shares; by
        default what each runs."""
        req = spec.gpus
        chosen = model or req.model
        if chosen is not None and chosen not in self._models:
            return Refused(f"no {chosen} at this site")
        best: Admitted | None = None
        reasons = []
        for m in [chosen] if chosen else self._models:
            found = self.inventory.find(req, m)
            ask = Ask.of(job_id, spec, m, gpus=self.inventory.charge(req, m))

            def fits(victims: Sequence[str], m: str = m, found: Placement | str = found) -> bool:
                if not victims:
                    return isinstance(found, Placement)
                return isinstance(self.inventory.find(req, m, releasing=victims), Placement)

            verdict = self.book.admit(ask, now, fits, demand)
            if not verdict.admitted:
                why = verdict.reason or "refused"
                if isinstance(found, Placement):
                    reasons.append(why)
                else:  # the inventory's reason first; the quota book's adds only where quotas are kept
                    reasons.append(f"no room: {found}" + (f"; {why}" if self.book.enforced else ""))
                continue
            if verdict.victims:
                placement = self.inventory.find(req, m, releasing=verdict.victims)
                assert isinstance(placement, Placement), "the quota book's victims must make room"
                if best is None:
                    best = Admitted(placement, ask, verdict.victims, verdict.reason, verdict.borrowed)
                continue
            assert isinstance(found, Placement)
            return Admitted(found, ask, (), verdict.reason, verdict.borrowed)
        if best is not None:
            return best
        return Refused("; ".join(dict.fromkeys(reasons)) or "no GPU model here can take the job")

    def start(self, job_id: str, admitted: Admitted, now: float) -> None:
        """Record an admitted job as running; its victims must have been ``stop``\\ ped first."""
        self.inventory.commit(job_id, admitted.placement)
        self.book.start(admitted.ask, now)

    def stop(self, job_id: str, now: float) -> Placement | None:
        """The job ended, failed, was cancelled or preempted: its GPUs and quota are free again."""
        placement = self.inventory.release(job_id)
        if placement is not None:
            self.book.stop(job_id, now)
        return placement

    def set_quota(self, quota: TenantQuota, now: float) -> None:
        self.book.set_quota(quota, now)

    def remove_quota(self, tenant: str, now: float) -> None:
        self.book.remove_quota(tenant, now)

    def report(self, now: float, demand: Mapping[str, float] | None = None) -> QuotaState:
        return self.book.report(now, demand)

    def order(self, pending: Sequence[Ask], now: float) -> list[Ask]:
        """The site's own queue order (tenants furthest below their fair share first)."""
        return self.book.order(pending, now)
