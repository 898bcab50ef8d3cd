"""Site-local quotas: one site's ledger of who holds what (:class:`QuotaBook`), and whom it preempts.

A site (its adapter or agent) asks :meth:`QuotaBook.admit` whether a job may start, starts it with
:meth:`~QuotaBook.start` once its inventory has placed it, and reports its end or preemption with
:meth:`~QuotaBook.stop`. Everything is a pure function of what was recorded and of ``now`` (POSIX seconds,
passed in; never read from a clock): no I/O, no awaits, deterministic.

The rules, per tenant (``broker.models.TenantQuota``)
    - A tenant holds at most ``guaranteed + burst`` GPUs; a job that would take it past that is refused
      with the numbers ("tenant vision holds 58 of its 60 GPUs (20 guaranteed + 40 burst); this job needs
      4") unless preempting its own lower-priority jobs makes room.
    - A job's priority at the site is ``min(priority, priority_ceiling)``.
    - Non-preemptible work never makes a guarantee unreclaimable: with ``N_t`` tenant t's non-preemptible
      GPUs and ``G_t`` its guarantee, ``sum(max(G_t, N_t)) <= C`` must hold after a non-preemptible job
      starts (for the whole site, and for each model a model-specific quota names). So non-preemptible jobs
      burst only into capacity nobody is guaranteed; preemptible jobs may borrow anything idle. Where the
      guarantees add up to more than C (allowed), a tenant's non-preemptible jobs may still take its own
      unheld guarantee, which leaves the sum where it was, and nothing more.
    - Idle capacity is lent (work-conserving): a job that fits within its tenant's limit is admitted even
      when the tenant is over its fair share; fairness acts through :meth:`~QuotaBook.order` and preemption.
    - A quota with ``model=None`` counts GPUs of any model, one with a model counts only that model
      (capacity C is then that model's GPUs). A listed tenant's job on another model, and any job of a tenant
      the list does not name, follows ``FairSharePolicy.unlisted_tenants``: refused, or best-effort
      (guaranteed nothing, no burst limit, weight 1). A site with no quotas at all admits whatever fits.
    - A quota naming a model the site lacks, or guaranteeing more GPUs than its pool has, is refused where
      changes come in (the API, the simulated site: :meth:`~QuotaBook.check`); one the site was built with
      (stored by an earlier release), or one :meth:`~QuotaBook.set_quota` is given while the site lacks those
      GPUs (a Kubernetes Node cordoned just then), is logged and its guarantee counts only the pool's GPUs
      (none for a model the site lacks).

Preemption (when the job does not fit as things stand)
    ``policies.preemption`` chooses the victims: by reclaim (the tenant stays within its guarantee) or by
    priority, never pushing another tenant below its guarantee, but for one exception: a reclaim for a quota
    that counts the job's model may take tenants whose quotas count any model below theirs, as far as the
    site's idle GPUs of other models can hold them (:meth:`~QuotaBook._elsewhere` says how far); see that
    module for the candidates and order.

Cost: admission is O(1) plus, when preemption is needed, one fair-share division (O(tenants)) or, for a
reclaim of a model's guarantee, one pass over the tenants and models (:meth:`~QuotaBook._elsewhere`), and the
victim search of ``policies.preemption``. Units: GPUs (a fractional job counts its share), POSIX seconds. With an
empty quota list there are no limits (everything that fits is admitted) and no reclaim; a higher-priority job
may still preempt lower-priority preemptible work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.models import FairSharePolicy, JobSpec, QuotaState, TenantQuota, TenantQuotaState
from policies.fairshare import EPS, Claim, UsageLedger, divide
from policies import preemption
from policies.preemption import Fits

_INF = math.inf


def _n(x: float) -> str:
    """A GPU amount for a message: 58, 0.25, 12.5."""
    return f"{round(x, 6):g}"


@dataclass(frozen=True, slots=True)
class Ask:
    """A job asking to start at this site: ``gpus`` it counts (a fraction for a share of one GPU) of ``model``."""

    job_id: str
    tenant: str
    gpus: float
    model: str
    priority: int = 0
    preemptible: bool = False
    min_run_s: float | None = None  # None: the policy's min_run_s
    checkpointable: bool = False

    @classmethod
    def of(cls, job_id: str, spec: JobSpec, model: str, gpus: float | None = None) -> Ask:
        """From a job spec placed on ``model``. ``gpus`` defaults to ``count`` whole GPUs, or ``milli / 1000``
        of one; pass the inventory's charge (``policies.inventory.Inventory.charge``) for a memory-sized
        share or MIG slices, which only the inventory can size."""
        req = spec.gpus
        charge = gpus if gpus is not None else (req.milli / 1000 if req.milli < 1000 else float(req.count))
        return cls(job_id, spec.tenant, charge, model, spec.priority, spec.preemptible, spec.min_run_s,
                   spec.checkpointable)


@dataclass(frozen=True, slots=True)
class Verdict:
    """``victims``: job ids to preempt first, in order; ``borrowed``: the job runs above its tenant's guarantee;
    ``reason``: why it was refused, or, when it preempts, on what grounds (reclaim or priority); else None."""

    admitted: bool
    reason: str | None = None
    victims: tuple[str, ...] = ()
    borrowed: bool = False


@dataclass(frozen=True, slots=True)
class TenantState:
    """Where one tenant stands (the fields of ``broker.models.TenantQuotaState``, plus non-preemptible GPUs).
    A listed tenant's jobs on a model its quota does not count appear as a second, unlisted entry."""

    tenant: str
    listed: bool
    model: str | None
    guaranteed_gpus: float
    burst_gpus: float | None  # None: no limit
    fair_share_weight: float
    priority_ceiling: int | None
    in_use_gpus: float
    borrowed_gpus: float
    nonpreemptible_gpus: float
    fair_share_gpus: float
    decayed_usage_gpu_h: float
    waiting_reason: str | None
    room_gpus: float | None  # more GPUs it may hold (None: no limit)
    nonpreemptible_room_gpus: float | None
    reclaimable_gpus: float  # GPUs it would get back now by reclaiming its guarantee
    # GPUs its own preemptible jobs past their minimum run time hold, by effective priority: what a job of its own
    # of higher priority may take even at its limit (guarantee + burst), where it may preempt only its own jobs
    preemptible_gpus_by_priority: dict[int, float] = field(default_factory=dict)
    # The same per GPU model, then by priority: the site preempts for a job only jobs on the model it gives it
    preemptible_gpus_by_model: dict[str, dict[int, float]] = field(default_factory=dict)
    # reclaimable_gpus per GPU model (models with none left out): a reclaim takes only borrowers' jobs on the
    # model the site gives the job, so a guarantee counting any model is reclaimed on one model at a time
    reclaimable_gpus_by_model: dict[str, float] = field(default_factory=dict)
    # The guarantee as configured, where the site counts less of it (``guaranteed_gpus``: at most the GPUs its
    # pool has now, a Node away or a model gone); None where it counts it whole
    configured_guaranteed_gpus: float | None = None


class QuotaBeyondSite(ValueError):
    """A site refuses a tenant's quota: its ``field`` (``model``, ``guaranteed_gpus``) asks for GPUs the site
    does not have (``problem`` says which)."""

    def __init__(self, tenant: str, field: str, problem: str) -> None:
        super().__init__(f"tenant {tenant}'s quota: {field}: {problem}")
        self.tenant, self.field, self.problem = tenant, field, problem


@dataclass(frozen=True, slots=True)
class UsageHistory:
    """A book's usage history, for a site to keep across its restarts (:meth:`QuotaBook.history`,
    :meth:`QuotaBook.restore`): GPU-seconds per account ((tenant, pool): the model its quota counts, or None
    for any) per period index (periods of ``bucket_s`` seconds, index ``floor(t / bucket_s)``), counted up to
    ``saved_at`` (POSIX seconds); ``origin``: the first moment the book saw, from which the site's own capacity
    over the window is counted."""

    bucket_s: float
    origin: float | None
    saved_at: float
    usage: Mapping[tuple[str, str | None], Mapping[int, float]]


@dataclass(slots=True, eq=False)
class _Job:
    job_id: str
    account: _Account
    gpus: float
    model: str
    asked: int  # priority as submitted
    priority: int  # effective: capped by the tenant's ceiling
    preemptible: bool
    min_run_s: float
    start: float
    checkpointable: bool = False


@dataclass(slots=True, eq=False)
class _Account:
    """One tenant's GPUs in one pool (its quota's model, or None for any)."""

    tenant: str
    pool: str | None
    listed: bool
    guaranteed: float = 0.0
    burst: float | None = None
    weight: float = 1.0
    ceiling: int | None = None
    since: float | None = None  # usage accrued up to here
    in_use: float = 0.0
    nonpre: float = 0.0
    jobs: dict[str, _Job] = field(default_factory=dict)
    queue: list[tuple[int, int, float, str, _Job]] = field(default_factory=list)  # preemptible, in victim order

    @property
    def limit(self) -> float:
        return _INF if self.burst is None else self.guaranteed + self.burst

    @property
    def gap(self) -> float:
        """Guaranteed GPUs not held by its non-preemptible jobs (reserved for it)."""
        return max(0.0, self.guaranteed - self.nonpre)

    def effective(self, priority: int) -> int:
        return priority if self.ceiling is None else min(priority, self.ceiling)


class QuotaBook:
    """One site's quota ledger. ``capacity``: GPUs per model. See the module docstring for the rules."""

    def __init__(self, quotas: Sequence[TenantQuota], policy: FairSharePolicy, capacity: Mapping[str, float]) -> None:
        self.policy = policy
        self._capacity = {m: float(c) for m, c in capacity.items()}
        self._total = sum(self._capacity.values())
        self._quotas: dict[str, TenantQuota] = {}
        self._accounts: dict[tuple[str, str | None], _Account] = {}
        self._jobs: dict[str, _Job] = {}
        self._used: dict[str, float] = {}  # GPUs held per model
        self._np: dict[str, float] = {}  # non-preemptible GPUs per model
        self._gap: dict[str | None, float] = {}  # unheld guarantees per pool
        self._ledger = UsageLedger(policy.reweight_h * 3600, policy.window_h * 3600, policy.half_life_h * 3600)
        self._now: float | None = None
        # GPUs of a model idle in the site's inventory (``SiteAdmission`` sets it): what the book does not see
        # is taken too (a Kubernetes site's Pods outside heliotrope). None: what the book does not count is idle.
        self.idle_gpus: Callable[[str], float] | None = None
        self._epoch: int | None = None
        self._usage_s: dict[object, float] = {}
        self._capacity_s: dict[str | None, float] = {}
        self._refusals: dict[tuple[str, str | None], str] = {}
        for q in quotas:
            if q.tenant in self._quotas:
                raise ValueError(f"quotas: tenant {q.tenant} appears twice; give each tenant one quota per site")
            self._quotas[q.tenant] = q  # (one beyond the site is a stored one, which must still load: beyond_site)
            self._open(self._listed(q), None)

    def has_quota(self, tenant: str) -> bool:
        return tenant in self._quotas

    @property
    def enforced(self) -> bool:
        """False when the site lists no quotas (it admits whatever fits)."""
        return bool(self._quotas)

    # --- recording ------------------------------------------------------------------------------------

    def start(self, ask: Ask, now: float) -> None:
        """Record an admitted job as running (preempt its verdict's victims with :meth:`stop` first)."""
        now = self._clock(now)
        self._check(ask)
        acct = self._resolve(ask.tenant, ask.model)
        if isinstance(acct, str):
            raise ValueError(f"job {ask.job_id} cannot start here: {acct}")
        min_run = ask.min_run_s if ask.min_run_s is not None else self.policy.min_run_s
        job = _Job(ask.job_id, acct, ask.gpus, ask.model, ask.priority, acct.effective(ask.priority), ask.preemptible,
                   min_run, now, ask.checkpointable)
        self._record(job, acct, now)

    def stop(self, job_id: str, now: float) -> None:
        """A running job ended or was preempted."""
        now = self._clock(now)
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"job {job_id} is not running at this site (never started, or already stopped)")
        acct = job.account
        self._unrecord(job, now)
        if not acct.listed and not acct.jobs:  # a best-effort account with nothing left; its usage stays
            del self._accounts[(acct.tenant, acct.pool)]

    def set_quota(self, quota: TenantQuota, now: float) -> None:
        """An operator's change (or a new tenant). Running jobs keep running, even above a lowered limit.
        Where it asks for GPUs the site does not have now (:meth:`check`, which the API and the simulated site
        apply before they keep a change), it is taken and its guarantee counts what the site has, as for a
        stored quota (:meth:`beyond_site`): a cluster's GPUs come and go with its Nodes (a cordoned one), and a
        change checked against the site's spec must not fail half made."""
        now = self._clock(now)
        old = self._quotas.get(quota.tenant)
        self._quotas[quota.tenant] = quota
        self._rehome(quota.tenant, None if old is None else old.model, quota.model, now)

    def take_usage(self, old: QuotaBook, now: float) -> None:
        """Carry ``old``'s usage history over to this book, which replaces it (a site's ledgers rebuilt when its
        GPUs changed: a Kubernetes Node came or went), with its running jobs already re-entered here. Usage is
        the old book's up to ``now`` and accrues here from ``now``: what re-entering the jobs at their starts
        counted is dropped, or it would count twice. Without this a rebuild forgets every tenant's past usage,
        and the fair share with it. A history kept in periods of another length is not taken (a changed
        ``fair_share`` rebuilds the site without it)."""
        if old._ledger.bucket_s != self._ledger.bucket_s:
            return
        now = self._clock(old._clock(now))
        for acct in old._accounts.values():  # close its open intervals: its history up to now
            old._accrue(acct, now)
        self._ledger.take(old._ledger)
        for acct in self._accounts.values():
            acct.since = now
        self._epoch = None

    def history(self, now: float) -> UsageHistory:
        """The usage history up to ``now`` (each account's open interval counted to it), periods older than the
        window left out: what a site keeps so that a restart does not forget every tenant's past usage."""
        now = self._clock(now)
        for acct in self._accounts.values():
            self._accrue(acct, now)
        first = math.floor((now - self._ledger.window_s) / self._ledger.bucket_s) - 1
        usage = {key: {i: v for i, v in buckets.items() if i >= first}
                 for key, buckets in self._ledger.buckets().items()}
        return UsageHistory(self._ledger.bucket_s, self._ledger.origin, now, {k: b for k, b in usage.items() if b})

    def restore(self, kept: UsageHistory, now: float) -> str | None:
        """Take ``kept`` (:meth:`history`, saved before a restart) as this book's usage history; this book's
        running jobs, re-entered at their starts, count from ``kept.saved_at`` on (what re-entering them
        counted before it is dropped, or it would count twice), so their run while no one watched counts too.
        A tenant whose quota now counts another model than its kept history's account takes that history.
        Saved after ``now`` (the clock stepped back across the restart), the book holds its time at
        ``kept.saved_at`` until the clock catches up, as :meth:`_clock` does, or the kept run would count again;
        saved more than a period after ``now``, it is not taken (a clock that far off would stop the book's usage).
        Returns why ``kept`` was not taken (periods of another length: the site's ``fair_share`` changed; saved
        that far ahead), else None."""
        if kept.bucket_s != self._ledger.bucket_s:
            return (f"it was kept in periods of {kept.bucket_s:g} s and the site's fair share now reweighs every "
                    f"{self._ledger.bucket_s:g} s")
        if kept.saved_at > self._clock(now) + self._ledger.bucket_s:
            return (f"it was saved {kept.saved_at - self._clock(now):.0f} s after the site's clock reads now (more "
                    f"than one period of {self._ledger.bucket_s:g} s): the clock was stepped back, or the file "
                    "came from a host whose clock is ahead")
        now = self._clock(max(now, kept.saved_at))
        usage = {key: dict(buckets) for key, buckets in kept.usage.items()}
        # its quota changed model, or was set or removed, meanwhile: its history moves as _rehome moves it. A kept
        # account of a model was its quota's; one of any model too where it had no other, else its best-effort one.
        for tenant in {t for t, _ in kept.usage}:
            q = self._quotas.get(tenant)
            main = q.model if q is not None else None
            keys = [key for key in usage if key[0] == tenant]
            moved = [key for key in keys if key[1] is not None and key[1] != main]
            if main is not None and keys == [(tenant, None)]:
                moved = keys
            for key in moved:
                into = usage.setdefault((tenant, main), {})
                for i, v in usage.pop(key).items():
                    into[i] = into.get(i, 0.0) + v
        origin = self._ledger.origin
        self._ledger.replace(usage, kept.origin if origin is None or kept.origin is None else min(origin, kept.origin))
        for job in self._jobs.values():
            acct = job.account
            self._ledger.add((acct.tenant, acct.pool), job.gpus, max(job.start, kept.saved_at), now)
        for acct in self._accounts.values():
            acct.since = now
        self._epoch = None
        return None

    def beyond_site(self) -> list[str]:
        """Each quota asking for GPUs the site does not have (``TenantQuota.beyond``: one stored by an earlier
        release, or set while the GPUs are away), in words; its guarantee counts only what the site has. For
        the adapters to log: a policy keeps no log."""
        out = []
        for q in self._quotas.values():
            beyond = q.beyond(self._capacity)
            if beyond is not None:
                out.append(f"tenant {q.tenant}'s quota asks for GPUs this site does not have ({beyond[0]}: "
                           f"{beyond[1]}); its guarantee counts as {_n(self._pool_gpus(q.model))} GPUs, what the "
                           "site has of it")
        return out

    def check(self, quota: TenantQuota) -> None:
        """:class:`QuotaBeyondSite` (a ValueError naming the field) where ``quota`` names a model the site lacks or
        guarantees more GPUs than the site (or that model) has (``TenantQuota.beyond``)."""
        beyond = quota.beyond(self._capacity)
        if beyond is not None:
            raise QuotaBeyondSite(quota.tenant, *beyond)

    def remove_quota(self, tenant: str, now: float) -> None:
        """The tenant becomes unlisted; its running jobs stay (as best-effort) whatever ``unlisted_tenants`` says."""
        now = self._clock(now)
        old = self._quotas.pop(tenant, None)
        if old is None:
            raise KeyError(f"tenant {tenant} has no quota at this site")
        self._rehome(tenant, old.model, None, now)

    # --- decisions ------------------------------------------------------------------------------------

    def admit(self, ask: Ask, now: float, fits: Fits, demand: Mapping[str, float] | None = None) -> Verdict:
        """May ``ask`` start now, and after preempting whom? ``fits(victim_ids)``: the inventory's answer to
        "does the job fit once these are gone". ``demand``: GPUs each tenant wants in all (running + waiting;
        default: what it runs), for the fair shares that decide who is over its share. Changes nothing but
        caches and the refusal reason :meth:`state` reports (until the tenant starts a job, any job stops, or
        a quota changes)."""
        now = self._clock(now)
        self._check(ask)
        acct = self._resolve(ask.tenant, ask.model)
        if isinstance(acct, str):
            return self._refuse(ask.tenant, self._main(ask.tenant).pool, acct)
        g, model = ask.gpus, ask.model
        cap = self._capacity.get(model, 0.0)
        if g > cap + EPS:
            return self._refuse_acct(acct, f"the site has {_n(cap)} {model} GPUs; this job needs {_n(g)}")
        if not ask.preemptible and self._quotas and (why := self._np_blocks(acct, g, model)):
            over = acct.in_use + g > acct.limit + EPS  # the tenant's own limit is the first reason
            return self._refuse_acct(acct, self._limit_reason(acct, g) if over else why)
        over_limit = acct.in_use + g > acct.limit + EPS
        if not over_limit and fits(()):
            return Verdict(True, None, (), acct.in_use + g > acct.guaranteed + EPS)
        reclaim = not over_limit and acct.in_use + g <= acct.guaranteed + EPS
        p = acct.effective(ask.priority)
        shares = None
        if not over_limit and not reclaim:  # who is over its fair share, this job counted in
            wants = self._wants(demand or {}, acct)
            wants[acct] = max(wants.get(acct, acct.in_use), acct.in_use + g)
            shares = self._division(now, wants)
        elsewhere = self._elsewhere(model) if reclaim and acct.pool == model else 0.0
        found = preemption.search(acct, g, model, p, now, fits, reclaim, over_limit, self._accounts.values(), shares,
                                  self.policy.min_run_s, elsewhere)
        victims, own_freed, freed = found
        if victims is not None:
            held = acct.in_use - own_freed + g
            why = (f"reclaims its guarantee ({_n(acct.guaranteed)} GPUs)" if reclaim else f"priority {p}") + \
                  f": preempts {len(victims)} job{'s' * (len(victims) != 1)}" + self._lent(acct, victims)
            return Verdict(True, why, victims, held > acct.guaranteed + EPS)
        if over_limit and acct.in_use - own_freed + g > acct.limit + EPS:
            return self._refuse_acct(acct, self._limit_reason(acct, g))
        free = cap - self._used.get(model, 0.0)
        if free + freed >= g - EPS:
            why = (f"site full for this job's shape: {_n(max(free, 0))} {model} GPUs are free and {_n(freed)} more "
                   f"could be freed from preemptible jobs over their share, but not where the job fits")
        else:
            why = (f"site full; {_n(freed)} GPUs could be freed from preemptible jobs over their share, "
                   f"{_n(g - max(free, 0))} needed")
        return self._refuse_acct(acct, why)

    def fair_shares(self, now: float, demand: Mapping[str, float]) -> dict[str, float]:
        """Fair share in GPUs per tenant for ``demand`` (GPUs wanted in all; tenants left out want what they run)."""
        now = self._clock(now)
        shares = self._division(now, self._wants(demand))
        return {self._name(a): s for a, s in shares.items()}

    def order(self, pending: Sequence[Ask], now: float) -> list[Ask]:
        """The site's queue order for ``pending`` (all waiting here): tenants furthest below their fair share
        first, re-ranked as each job is counted in (mode ``off``: priority, then arrival); within a tenant,
        priority then arrival. Jobs of tenants the site refuses come last."""
        now = self._clock(now)
        if self.policy.mode == "off":
            ranked = sorted(pending, key=lambda a: -self._eff(a))
            return ([a for a in ranked if not isinstance(self._resolve(a.tenant, a.model), str)]
                    + [a for a in ranked if isinstance(self._resolve(a.tenant, a.model), str)])
        queues: dict[_Account, list[tuple[int, int, Ask]]] = {}
        refused: list[Ask] = []
        wants: dict[_Account, float] = {a: a.in_use for a in self._accounts.values()}
        new: dict[tuple[str, str | None], _Account] = {}  # one account per tenant not seen before
        for i, ask in enumerate(pending):
            acct = self._resolve(ask.tenant, ask.model)
            if isinstance(acct, str):
                refused.append(ask)
                continue
            if (acct.tenant, acct.pool) not in self._accounts:
                acct = new.setdefault((acct.tenant, acct.pool), acct)
            queues.setdefault(acct, []).append((-acct.effective(ask.priority), i, ask))
            wants[acct] = wants.get(acct, acct.in_use) + ask.gpus
        shares = self._division(now, wants)
        heap = []
        seq = {acct: i for i, acct in enumerate(queues)}  # the last tie-break: first seen in pending
        for acct, q in queues.items():
            q.sort(key=lambda e: (e[0], e[1]), reverse=True)  # pop() from the end: best first
            heap.append((*self._rank(acct, acct.in_use, shares[acct], q[-1][2].gpus), seq[acct], acct))
        heapq.heapify(heap)
        out: list[Ask] = []
        held = {acct: acct.in_use for acct in queues}
        while heap:
            *_, acct = heapq.heappop(heap)
            ask = queues[acct].pop()[2]
            out.append(ask)
            held[acct] += ask.gpus
            if queues[acct]:
                nxt = queues[acct][-1][2].gpus
                heapq.heappush(heap, (*self._rank(acct, held[acct], shares[acct], nxt), seq[acct], acct))
        return out + refused

    def state(self, now: float, demand: Mapping[str, float] | None = None) -> list[TenantState]:
        """Every tenant the site lists or runs jobs for, listed first, by name."""
        now = self._clock(now)
        wants = self._wants(demand or {})
        shares = self._division(now, wants)
        removable, lendable = preemption.removable(self._accounts.values(), now, self.policy.min_run_s)
        elsewhere = {m: self._elsewhere(m) for m, gpus in lendable.items() if gpus > EPS}
        out = []
        for acct in sorted(self._accounts.values(), key=lambda a: (not a.listed, a.tenant, a.pool or "")):
            room = None if acct.burst is None else max(0.0, acct.limit - acct.in_use)
            np_room = _np_room(self._total, sum(self._np.values()), sum(self._gap.values()), acct.gap)
            if acct.pool is not None:
                np_room = min(np_room, _np_room(self._capacity.get(acct.pool, 0.0), self._np.get(acct.pool, 0.0),
                                                self._gap.get(acct.pool, 0.0), acct.gap))
            np_room = np_room if room is None else min(np_room, room)
            short = max(0.0, acct.guaranteed - acct.in_use)
            back = sum(v for (o, m), v in removable.items() if o is not acct and (acct.pool is None or m == acct.pool))
            on: dict[str, float] = {}  # the same per model: the victim search takes only the job's model's
            for (o, m), v in removable.items():
                if o is not acct and (acct.pool is None or m == acct.pool):
                    on[m] = on.get(m, 0.0) + v
            if acct.pool in elsewhere:  # what tenants counting any model can hold elsewhere (a hint: see search)
                lent = min(lendable[acct.pool], elsewhere[acct.pool])
                back += lent
                on[acct.pool] = on.get(acct.pool, 0.0) + lent
            usage_s = self._usage_s.get((acct.tenant, acct.pool), 0.0)
            waiting = self._refusals.get((acct.tenant, acct.pool))
            if waiting is None and wants.get(acct, 0.0) > acct.in_use + EPS:
                waiting = self._waiting(acct, shares.get(acct, 0.0))
            out.append(TenantState(
                acct.tenant, acct.listed, acct.pool, acct.guaranteed, acct.burst, acct.weight, acct.ceiling,
                acct.in_use, max(0.0, acct.in_use - acct.guaranteed), acct.nonpre, shares.get(acct, 0.0),
                usage_s / 3600, waiting, room, np_room, min(short, back),
                *_by_priority_and_model((priority, job) for priority, _, _, _, job in acct.queue
                                        if now - job.start >= job.min_run_s),
                {m: _tidy(min(short, g)) for m, g in sorted(on.items()) if min(short, g) > EPS},
                self._configured(acct)))
        return out

    def _configured(self, acct: _Account) -> float | None:
        """A listed tenant's guarantee as configured, where its account counts less of it (``_listed``)."""
        q = self._quotas.get(acct.tenant) if acct.listed else None
        if q is None or q.model != acct.pool or not q.guaranteed_gpus > acct.guaranteed:
            return None
        return float(q.guaranteed_gpus)

    def report(self, now: float, demand: Mapping[str, float] | None = None) -> QuotaState:
        """What the site reports to the broker (``GET /v1/sites/{name}/quota``)."""
        enforced = bool(self._quotas)
        refuse = enforced and self.policy.unlisted_tenants == "refuse"
        free_of_guarantees = max(0.0, self._total - sum(self._np.values()) - sum(self._gap.values()))
        tenants = [TenantQuotaState(
            tenant=s.tenant, listed=s.listed, model=s.model, guaranteed_gpus=s.guaranteed_gpus,
            burst_gpus=s.burst_gpus, fair_share_weight=s.fair_share_weight, priority_ceiling=s.priority_ceiling,
            in_use_gpus=s.in_use_gpus, borrowed_gpus=s.borrowed_gpus, fair_share_gpus=s.fair_share_gpus,
            decayed_usage_gpu_h=s.decayed_usage_gpu_h, waiting_reason=s.waiting_reason, room_gpus=s.room_gpus,
            nonpreemptible_room_gpus=s.nonpreemptible_room_gpus, reclaimable_gpus=s.reclaimable_gpus,
            preemptible_gpus_by_priority=s.preemptible_gpus_by_priority,
            preemptible_gpus_by_model=s.preemptible_gpus_by_model,
            reclaimable_gpus_by_model=s.reclaimable_gpus_by_model,
            configured_guaranteed_gpus=s.configured_guaranteed_gpus,
        ) for s in self.state(now, demand)]
        by_priority, by_model = _by_priority_and_model(
            (job.priority, job) for job in self._jobs.values() if job.preemptible and now - job.start >= job.min_run_s)
        return QuotaState(
            enforced=enforced, fair_share=self.policy, capacity_gpus=self._total, tenants=tenants,
            unlisted_room_gpus=0.0 if refuse else None,
            unlisted_nonpreemptible_room_gpus=(0.0 if refuse else free_of_guarantees) if enforced else None,
            preemptible_gpus_by_priority=by_priority, preemptible_gpus_by_model=by_model)

    # --- rules and reasons ----------------------------------------------------------------------------

    def _np_blocks(self, acct: _Account, g: float, model: str) -> str | None:
        """Why a non-preemptible job of ``g`` GPUs would make a guarantee unreclaimable, or None."""
        checks = [(self._total, sum(self._np.values()), sum(self._gap.values()), "", True)]
        if acct.pool == model or self._gap.get(model):  # the site, then the model's own guarantees
            checks.append((self._capacity.get(model, 0.0), self._np.get(model, 0.0), self._gap.get(model, 0.0),
                           f" {model}", acct.pool == model))
        for cap, np_now, gap, kind, mine in checks:
            room = _np_room(cap, np_now, gap, acct.gap if mine else 0.0)
            if g > room + EPS:
                return (f"tenant {acct.tenant}: non-preemptible jobs may take only {_n(room)} more of the site's "
                        f"{_n(cap)}{kind} GPUs without making another tenant's guarantee unreclaimable; this job "
                        f"needs {_n(g)} (run it preemptible to borrow idle capacity)")
        return None

    def _elsewhere(self, model: str) -> float:
        """GPUs by which the tenants whose quotas count any model may, all together, fall further below their
        guarantees when a guarantee for ``model`` is reclaimed from them, and still hold their guarantees on the
        site's other models: the idle GPUs of each other model that the unheld guarantees of that model's own
        quotas leave, less the GPUs the any-model tenants already lack of their guarantees; 0 at a one-model
        site. Idle only: GPUs others hold, even borrowed ones, count for nothing, nor do those the inventory holds
        for work outside the book (``idle_gpus``). O(tenants + models)."""
        lack: dict[str | None, float] = {}
        for a in self._accounts.values():
            lack[a.pool] = lack.get(a.pool, 0.0) + max(0.0, a.guaranteed - a.in_use)
        idle = 0.0
        for m, cap in self._capacity.items():
            if m != model:
                free = cap - self._used.get(m, 0.0)
                if self.idle_gpus is not None:  # GPUs held outside the book are not idle either
                    free = min(free, self.idle_gpus(m))
                idle += max(0.0, free - lack.get(m, 0.0))
        return max(0.0, idle - lack.get(None, 0.0))

    def _lent(self, acct: _Account, victims: Sequence[str]) -> str:
        """The tenants a reclaim leaves below their guarantees (those whose quotas count any model), in words."""
        taken: dict[_Account, float] = {}
        for job_id in victims:
            job = self._jobs[job_id]
            if job.account is not acct:
                taken[job.account] = taken.get(job.account, 0.0) + job.gpus
        left = [f"tenant {o.tenant}, left with {_n(_tidy(o.in_use - t))} of its {_n(o.guaranteed)} guaranteed GPUs, "
                "can hold them on the site's idle GPUs of other models"
                for o, t in taken.items() if o.in_use - t < o.guaranteed - EPS]
        return f" ({'; '.join(left)})" if left else ""

    def _limit_reason(self, acct: _Account, g: float) -> str:
        kind = f" {acct.pool}" if acct.pool else ""
        return (f"tenant {acct.tenant} holds {_n(acct.in_use)} of its {_n(acct.limit)}{kind} GPUs "
                f"({_n(acct.guaranteed)} guaranteed + {_n(acct.burst or 0)} burst); this job needs {_n(g)}")

    def _waiting(self, acct: _Account, share: float) -> str:
        if acct.in_use + EPS >= acct.limit:
            return f"at its limit: holds {_n(acct.in_use)} of its {_n(acct.limit)} GPUs"
        pool_cap = self._total if acct.pool is None else self._capacity.get(acct.pool, 0.0)
        pool_used = sum(self._used.values()) if acct.pool is None else self._used.get(acct.pool, 0.0)
        if pool_used + EPS < pool_cap:
            return "waits in the site's queue order behind tenants further below their fair share"
        return f"site full; it holds {_n(acct.in_use)} GPUs, its fair share is {_n(share)}"

    def _refuse_acct(self, acct: _Account, why: str) -> Verdict:
        return self._refuse(acct.tenant, acct.pool, why)

    def _refuse(self, tenant: str, pool: str | None, why: str) -> Verdict:
        self._refusals[(tenant, pool)] = why
        return Verdict(False, why)

    def _rank(self, acct: _Account, held: float, share: float, nxt: float) -> tuple[int, float, float, str]:
        """Queue rank of a tenant holding ``held`` whose next job is ``nxt`` GPUs: within its guarantee first,
        then the lowest held/share, then the furthest below its share, then by name."""
        tier = 0 if held + nxt <= acct.guaranteed + EPS else 1
        ratio = held / share if share > EPS else _INF
        return tier, ratio, held - share, acct.tenant

    # --- bookkeeping ----------------------------------------------------------------------------------

    def _clock(self, now: float) -> float:
        """``now``, never before the latest time seen: a wall clock stepped back (NTP) must not undo usage
        already accrued, so the book holds its time until the clock catches up."""
        if not math.isfinite(now):
            raise ValueError(f"now must be POSIX seconds, got {now}")
        if self._now is None:
            self._ledger.origin = now
        self._now = now if self._now is None else max(self._now, now)
        return self._now

    def _check(self, ask: Ask) -> None:
        if not (ask.gpus > 0 and math.isfinite(ask.gpus)):
            raise ValueError(f"job {ask.job_id}: gpus must be a positive number of GPUs, got {ask.gpus}")
        if ask.job_id in self._jobs:
            raise ValueError(f"job {ask.job_id} is already running at this site")

    def _listed(self, q: TenantQuota) -> _Account:
        """The account of a listed tenant; its guarantee counts at most the GPUs its pool has (a stored quota
        naming a model the site lacks guarantees nothing, so it keeps no one else's work out)."""
        return _Account(q.tenant, q.model, True, min(float(q.guaranteed_gpus), self._pool_gpus(q.model)),
                        float(q.burst_gpus), q.fair_share_weight, q.priority_ceiling)

    def _pool_gpus(self, pool: str | None) -> float:
        return self._total if pool is None else self._capacity.get(pool, 0.0)

    def _resolve(self, tenant: str, model: str) -> _Account | str:
        """The account a job of ``tenant`` on ``model`` counts against (a new best-effort one is not stored
        until a job starts), or why the site refuses it."""
        q = self._quotas.get(tenant)
        if q is not None and (q.model is None or q.model == model):
            return self._accounts[(tenant, q.model)]
        if self._quotas and self.policy.unlisted_tenants == "refuse":
            if q is None:
                return f"the site has no quota for tenant {tenant} and refuses tenants it does not list"
            return f"tenant {tenant}'s quota here counts {q.model} GPUs only; this job asks for {model}"
        return self._accounts.get((tenant, None)) or _Account(tenant, None, False)

    def _main(self, tenant: str) -> _Account:
        q = self._quotas.get(tenant)
        key = (tenant, q.model if q is not None else None)
        return self._accounts.get(key) or _Account(tenant, None, False)

    def _name(self, acct: _Account) -> str:
        return acct.tenant if acct.listed or acct.tenant not in self._quotas else f"{acct.tenant}@any"

    def _eff(self, ask: Ask) -> int:
        acct = self._resolve(ask.tenant, ask.model)
        return ask.priority if isinstance(acct, str) else acct.effective(ask.priority)

    def _open(self, acct: _Account, now: float | None) -> _Account:
        acct.since = now
        self._accounts[(acct.tenant, acct.pool)] = acct
        self._gap[acct.pool] = self._gap.get(acct.pool, 0.0) + acct.gap
        return acct

    def _accrue(self, acct: _Account, t: float) -> None:
        if acct.since is not None and t > acct.since:
            self._ledger.add((acct.tenant, acct.pool), acct.in_use, acct.since, t)
        if acct.since is None or t > acct.since:
            acct.since = t

    def _record(self, job: _Job, acct: _Account, now: float) -> None:
        if (acct.tenant, acct.pool) not in self._accounts:
            self._open(acct, now)
        self._accrue(acct, now)
        job.account = acct
        self._refusals.pop((acct.tenant, acct.pool), None)  # what it held changed: the old reason may not hold
        acct.jobs[job.job_id] = job
        acct.in_use += job.gpus
        self._used[job.model] = self._used.get(job.model, 0.0) + job.gpus
        if job.preemptible:
            preemption.enqueue(acct.queue, job)
        else:
            before = acct.gap
            acct.nonpre += job.gpus
            self._gap[acct.pool] += acct.gap - before
            self._np[job.model] = self._np.get(job.model, 0.0) + job.gpus
        self._jobs[job.job_id] = job

    def _unrecord(self, job: _Job, now: float) -> None:
        acct = job.account
        self._accrue(acct, now)
        self._refusals.clear()  # GPUs were freed: no refusal reason may still hold, whoever it was for
        del self._jobs[job.job_id]
        del acct.jobs[job.job_id]
        acct.in_use = _tidy(acct.in_use - job.gpus)
        self._used[job.model] = _tidy(self._used[job.model] - job.gpus)
        if job.preemptible:
            preemption.dequeue(acct.queue, job)
        else:
            before = acct.gap
            acct.nonpre = _tidy(acct.nonpre - job.gpus)
            self._gap[acct.pool] += acct.gap - before
            self._np[job.model] = _tidy(self._np[job.model] - job.gpus)

    def _rehome(self, tenant: str, old_pool: str | None, new_pool: str | None, now: float) -> None:
        """Rebuild ``tenant``'s accounts after a quota change; its running jobs move with their usage."""
        self._refusals.clear()  # a changed guarantee or limit may undo any tenant's refusal
        jobs: list[_Job] = []
        for key in [(tenant, old_pool), (tenant, None)]:
            acct = self._accounts.pop(key, None)
            if acct is None:
                continue
            jobs.extend(acct.jobs.values())
            for job in list(acct.jobs.values()):
                self._unrecord(job, now)
            self._gap[acct.pool] = _tidy(self._gap[acct.pool] - acct.gap)
        if old_pool != new_pool:
            self._ledger.rename((tenant, old_pool), (tenant, new_pool))
        self._epoch = None  # weights again at the next decision: the pools or the weights changed
        q = self._quotas.get(tenant)
        if q is not None:
            self._open(self._listed(q), now)
        for job in jobs:
            acct = self._resolve(tenant, job.model)
            if isinstance(acct, str):  # a running job is never dropped: it stays, best-effort
                acct = self._accounts.get((tenant, None)) or _Account(tenant, None, False)
            job.priority = acct.effective(job.asked)
            self._record(job, acct, now)

    def _wants(self, demand: Mapping[str, float], asking: _Account | None = None) -> dict[_Account, float]:
        """GPUs each account wants: what it runs, or the tenant's ``demand`` where that is more. ``asking``: the
        account of a job being admitted; a tenant new here (no account stored yet) is that one account, not a
        second one for its demand, or the division would count it twice and shrink every other share."""
        wants = {a: a.in_use for a in self._accounts.values()}
        for tenant, d in demand.items():
            acct = self._main(tenant)
            if asking is not None and (acct.tenant, acct.pool) == (asking.tenant, asking.pool):
                acct = asking
            wants[acct] = max(float(d), acct.in_use)
        return wants

    def _division(self, now: float, wants: Mapping[_Account, float]) -> dict[_Account, float]:
        """Fair shares of the accounts in ``wants``, pool by pool."""
        self._reweight(now)
        mode = self.policy.mode
        k = self.policy.k if mode == "time" else 0.0
        pools: dict[str | None, list[_Account]] = {}
        for acct in wants:
            pools.setdefault(acct.pool, []).append(acct)
        out: dict[_Account, float] = {}
        for pool, accts in pools.items():
            cap = self._total if pool is None else self._capacity.get(pool, 0.0)
            cap_s = self._capacity_s.get(pool, 0.0)
            claims = [Claim(a.guaranteed, a.limit, a.weight, wants[a],
                            self._usage_s.get((a.tenant, a.pool), 0.0) / cap_s if cap_s > 0 else 0.0)
                      for a in accts]
            out.update(zip(accts, divide(cap, claims, k, by_weight=mode != "off"), strict=True))
        return out

    def _reweight(self, now: float) -> None:
        """Usage weights at the last reweight boundary: every open interval is closed there first."""
        bucket = self._ledger.bucket_s
        epoch = math.floor(now / bucket)
        if epoch == self._epoch:
            return
        boundary = epoch * bucket
        for acct in self._accounts.values():
            if acct.since is not None and acct.since < boundary:
                self._accrue(acct, boundary)
        factors = self._ledger.factors(epoch)
        self._usage_s = self._ledger.decayed(factors)
        pools = {None} | {q.model for q in self._quotas.values()}
        self._capacity_s = {p: self._ledger.capacity(self._total if p is None else self._capacity.get(p, 0.0),
                                                     factors) for p in pools}
        self._epoch = epoch


def _np_room(cap: float, np_now: float, gap: float, own_gap: float) -> float:
    """GPUs a tenant's non-preemptible jobs may still take in a pool of ``cap`` GPUs where non-preemptible jobs
    hold ``np_now`` and guarantees not held by them add up to ``gap`` (``own_gap`` of it the tenant's own): its
    own unheld guarantee, plus what no guarantee needs. Where the guarantees add up to more than the pool
    (allowed), that is its own unheld guarantee alone: a job there does not make any guarantee less
    reclaimable than it already is."""
    return own_gap + max(0.0, cap - np_now - gap)


def _tidy(x: float) -> float:
    """Clear float dust from sums of fractions (0.1 + 0.2 - 0.3)."""
    return 0.0 if abs(x) < EPS else x


def _by_priority_and_model(jobs: Iterable[tuple[int, _Job]]) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """GPUs ``jobs`` (each with its effective priority) hold, by priority, and per GPU model by priority: what a
    job of higher priority might take (the broker's hint; the victim search decides, on the job's model only)."""
    by_priority: dict[int, float] = {}
    by_model: dict[str, dict[int, float]] = {}
    for priority, job in jobs:
        by_priority[priority] = by_priority.get(priority, 0.0) + job.gpus
        on = by_model.setdefault(job.model, {})
        on[priority] = on.get(priority, 0.0) + job.gpus
    return ({p: _tidy(g) for p, g in sorted(by_priority.items())},
            {m: {p: _tidy(g) for p, g in sorted(on.items())} for m, on in sorted(by_model.items())})
