"""The federation view: every member site's spec, its adapter, and the latest state it reported.

``collect`` asks every site for a snapshot concurrently, each bounded by a timeout; a site that fails or
stays silent past ``stale_after_s`` is marked unhealthy with the reason. ``freeze`` turns the view into the
arrays the policies decide on, with the live signals the broker has: each site's carbon-intensity forecast
(``signals``, :class:`broker.signals.GridSignals`) and a price provider's prices (``prices``), which override
the site specs' ``usd_per_gpu_hour``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from adapters.base import AdapterError, QuotaAdmin, SiteAdapter
from broker.auth import SECRET_FIELDS
from broker.clock import Clock
from broker.models import Health, SiteSpec, SiteState
from broker.providers.prices import PriceProvider
from broker.signals import ForecastRows, price_matrix
from policies.quota import QuotaBeyondSite
from policies.snapshot import Snapshot, build_snapshot, replace_forecast

log = logging.getLogger(__name__)

AdapterFactory = Callable[[SiteSpec], SiteAdapter]


@dataclass(slots=True)
class Member:
    spec: SiteSpec
    adapter: SiteAdapter
    state: SiteState | None = None
    last_heard_at: datetime | None = None
    error: str | None = None
    started: bool = True  # False: its adapter could not start; collects try a fresh one every restart_after_s
    start_tried_at: datetime | None = None

    def public_state(self) -> SiteState:
        """The state the API shows: the last report, with the broker's verdict on health."""
        if self.state is None:
            return SiteState(site=self.spec.name, health=Health.UNKNOWN, reason=self.error or "not heard from yet")
        return self.state


def not_started(error: Exception) -> str:
    """A site's health reason while its adapter cannot start."""
    return f"its adapter could not start: {error}"


def without_secrets(spec: SiteSpec, text: str) -> str:
    """``text`` (an adapter's error, shown as the site's health reason to everyone who may see the site) with
    the site's secrets (``broker.auth.SECRET_FIELDS``: a Kubernetes site's kubeconfig path) named by their
    field instead; the broker's log keeps the full text."""
    for name in SECRET_FIELDS.get(spec.adapter.kind, ()):
        value = getattr(spec.adapter, name, None)
        if value:
            for form in {str(value), str(Path(str(value)).expanduser())}:
                text = text.replace(form, f"<adapter.{name}>")
    return text


class Unbuilt:
    """Stands for a site's adapter that could not even be made (the adapter's constructor raised: a state
    folder that cannot be read, say), so that a stored site joins unhealthy like one whose adapter cannot
    start, and the broker still serves the others. It cannot start; every other call fails as the site's."""

    def __init__(self, site: str, error: Exception) -> None:
        self.site, self.error = site, error

    async def start(self) -> None:
        raise self.error

    async def close(self) -> None:
        return None

    async def events(self) -> AsyncIterator[Any]:
        """None: an adapter that was never made has nothing to report (the one made later has its own stream)."""
        return
        yield

    def held_attempts(self) -> set[tuple[str, int]]:
        """None: it holds nothing the broker could take for a stray."""
        return set()

    def __getattr__(self, name: str) -> Any:
        # Every other call is a coroutine of the adapter's (submit, cancel, snapshot, ...): it fails as the site.
        async def fail(*args: Any, **kwargs: Any) -> Any:
            raise AdapterError(f"site {self.site}: {not_started(self.error)}")
        return fail


class QuotaNotTaken(AdapterError):
    """A spec's changed quotas could not be passed to its site (it did not answer): the spec is not taken.
    ``taken``: the tenants whose change the site took before it stopped answering."""

    def __init__(self, site: str, taken: list[str], why: str) -> None:
        self.site, self.taken, self.why = site, taken, why
        kept = (f"; it took the changes for {', '.join(taken)} before that (the site keeps them)"
                if taken else "")
        super().__init__(f"site {site} did not take the spec's quota changes ({why}){kept}")


class QuotaRefused(QuotaNotTaken):
    """The site refuses one of the spec's changed quotas for its own GPUs (an agent's site with fewer than the
    spec says: ``policies.quota.QuotaBeyondSite``): ``tenant``'s ``field``, with the ``problem``."""

    def __init__(self, site: str, taken: list[str], refused: QuotaBeyondSite) -> None:
        super().__init__(site, taken, f"it refuses tenant {refused.tenant}'s quota: {refused.field}: {refused.problem}")
        self.tenant, self.field, self.problem = refused.tenant, refused.field, refused.problem


def needs_rebuild(old: SiteSpec, new: SiteSpec) -> bool:
    """A spec change the running adapter cannot take: its GPUs, its adapter settings, its fair-share policy."""
    return old.gpus != new.gpus or old.adapter != new.adapter or old.fair_share != new.fair_share


class Federation:
    def __init__(
        self,
        clock: Clock,
        adapter_factory: AdapterFactory,
        stale_after_s: float = 15.0,
        collect_timeout_s: float = 2.0,
    ) -> None:
        self._clock = clock
        self._factory = adapter_factory
        self.stale_after_s = stale_after_s
        self.collect_timeout_s = collect_timeout_s
        self.restart_after_s = 10.0  # how often a site whose adapter could not start is given a fresh one
        # Called with a site's name when a collect has given it a fresh adapter that started: whoever follows
        # the site's events (the broker's pump) must follow the new adapter's.
        self.adapter_started: Callable[[str], None] = lambda name: None
        self.members: dict[str, Member] = {}
        self._base: Snapshot | None = None  # arrays of the last reports; rebuilt when they change
        self.membership_changed = False  # a site joined, changed or left since the last full pass
        self.leaving: set[str] = set()  # sites being removed or rebuilt: offered to no job
        self.last_placed_site: str | None = None  # where the last pass placed its last job (round-robin's cursor)
        self.signals: ForecastRows | None = None  # carbon forecasts per zone, when the broker has a carbon provider
        self.prices: PriceProvider | None = None  # overrides the specs' prices, when configured
        self._site_arrays: tuple[tuple[str, ...], np.ndarray | None] | None = None  # zones and prices, by name

    def __contains__(self, name: str) -> bool:
        return name in self.members

    def get(self, name: str) -> Member | None:
        return self.members.get(name)

    async def add(self, spec: SiteSpec, tolerate_failure: bool = False) -> Member:
        """Start the site's adapter and take the site in. An adapter that cannot start raises, unless
        ``tolerate_failure`` (a stored site at the broker's start: a cluster that is down must not keep the
        broker from serving the others): then the site joins unhealthy, with the error as its reason, and
        every collect tries to start the adapter again."""
        if spec.name in self.members:
            raise KeyError(spec.name)
        try:
            adapter = self._factory(spec)
        except Exception as e:
            if not tolerate_failure:
                raise
            adapter = Unbuilt(spec.name, e)  # (its start fails below, with this error)
        try:
            await adapter.start()
        except Exception as e:
            if not tolerate_failure:
                raise
            log.error("site %s: its adapter could not start (%s); the site stays unhealthy and the broker tries "
                      "again every %g s", spec.name, e, self.restart_after_s)
            member = Member(spec, adapter, error=without_secrets(spec, not_started(e)), started=False,
                            start_tried_at=self._clock.now())
            self.members[spec.name] = member
            self._base = self._site_arrays = None
            self.membership_changed = True
            return member
        member = Member(spec, adapter)
        self.members[spec.name] = member
        self._base = self._site_arrays = None
        self.membership_changed = True
        await self._collect_one(member)
        return member

    async def replace(self, spec: SiteSpec) -> Member:
        """Swap a site's spec; the adapter is rebuilt when its inventory, adapter settings or fair-share policy
        change. Changed quotas are passed to the site as its operator's changes would be (the latest change
        wins, whether made through the spec or through the quota API). Either the whole spec is taken or the
        site keeps its old one: an adapter that cannot start raises, and a site that does not take the quota
        changes raises QuotaNotTaken, with the spec unchanged (and a rebuilt adapter given up again)."""
        member = self.members[spec.name]
        old = member.spec
        if needs_rebuild(old, spec):
            await member.adapter.close()
            adapter = self._factory(spec)
            try:
                await adapter.start()
                await self._pass_quotas(adapter, old, spec)
            except Exception:
                # The new settings do not work: the site goes on with its old adapter (or, if even that
                # cannot start again now, joins the sites whose adapter each collect tries to start).
                with contextlib.suppress(Exception):
                    await adapter.close()
                member.adapter = self._factory(old)
                try:
                    await member.adapter.start()
                    member.started = True
                except Exception as e:
                    member.started, member.error, member.state = False, without_secrets(old, not_started(e)), None
                raise
            member.adapter, member.started = adapter, True
            member.state = None
        else:
            await self._pass_quotas(member.adapter, old, spec)
        member.spec = spec
        self._base = self._site_arrays = None
        self.membership_changed = True
        await self._collect_one(member)
        return member

    async def pass_quotas(self, name: str, old: SiteSpec) -> None:
        """Pass the site's quotas that differ from ``old``'s (the spec it had before) to it, as :meth:`replace`
        does: the site's spec changed while the broker was down (its config file edited). Raises QuotaNotTaken
        as :meth:`replace` does."""
        member = self.members[name]
        await self._pass_quotas(member.adapter, old, member.spec)

    @staticmethod
    async def _pass_quotas(adapter: SiteAdapter, old: SiteSpec, spec: SiteSpec) -> None:
        """Pass the quotas that changed from ``old`` to ``spec`` to the site. A site that does not answer
        raises QuotaNotTaken, naming the changes it took before it stopped answering (those stay: the site's
        quota state is its own, ``GET /v1/sites/{name}/quota``)."""
        if spec.quotas == old.quotas or not isinstance(adapter, QuotaAdmin):
            return
        before = {q.tenant: q for q in old.quotas}
        after = {q.tenant: q for q in spec.quotas}
        taken: list[str] = []
        try:
            for tenant, quota in after.items():
                if before.get(tenant) != quota:
                    await adapter.set_quota(quota)
                    taken.append(tenant)
            for tenant in before.keys() - after.keys():
                with contextlib.suppress(KeyError):  # the operator removed it already
                    await adapter.remove_quota(tenant)
                taken.append(tenant)
        except QuotaBeyondSite as e:
            raise QuotaRefused(spec.name, taken, e) from e
        except AdapterError as e:
            raise QuotaNotTaken(spec.name, taken, str(e)) from e

    def set_leaving(self, name: str, leaving: bool) -> None:
        """Stop (or resume) offering a site to jobs while it is being removed or rebuilt."""
        if leaving:
            self.leaving.add(name)
        else:
            self.leaving.discard(name)
        self._base = None

    async def remove(self, name: str) -> None:
        member = self.members.pop(name)
        self.leaving.discard(name)
        self._base = self._site_arrays = None
        self.membership_changed = True
        if isinstance(member.adapter, QuotaAdmin):
            await member.adapter.forget_quotas()
        await member.adapter.close()

    async def clear(self) -> None:
        """Close every site's adapter and forget them all (they stay registered in the store): a broker giving
        up charge of the sites."""
        await self.close()
        self.members.clear()
        self.leaving.clear()
        self._base = self._site_arrays = None
        self.membership_changed = True

    async def close(self) -> None:
        await asyncio.gather(*(m.adapter.close() for m in self.members.values()), return_exceptions=True)

    async def collect(self) -> None:
        """Step 1 of the cycle: refresh every site's state, concurrently and with a timeout each."""
        await asyncio.gather(*(self._collect_one(m) for m in list(self.members.values())))

    async def _collect_one(self, member: Member) -> None:
        now = self._clock.now()
        self._base = None
        if not member.started:
            if (member.start_tried_at is not None
                    and (now - member.start_tried_at).total_seconds() < self.restart_after_s):
                return  # unhealthy, with the start's error as its reason, until the next try
            member.start_tried_at = now
            with contextlib.suppress(Exception):
                await member.adapter.close()
            try:
                member.adapter = self._factory(member.spec)  # a fresh one: credentials and clients read anew
            except Exception as e:  # it cannot even be made: unhealthy, and tried again as one that cannot start
                member.adapter = Unbuilt(member.spec.name, e)
        try:
            async with asyncio.timeout(self.collect_timeout_s):
                if not member.started:
                    await member.adapter.start()
                    member.started = True
                    log.info("site %s: its adapter started", member.spec.name)
                    self.adapter_started(member.spec.name)
                state = await member.adapter.snapshot()
        except TimeoutError:
            member.error = full = f"no report within {self.collect_timeout_s:g} s"
        except Exception as e:  # an adapter's failure is the site's health, not the broker's crash
            full = f"report failed: {e}" if member.started else not_started(e)
            member.error = without_secrets(member.spec, full)
        else:
            member.state, member.last_heard_at, member.error = state, now, None
            return
        log.warning("site %s: %s", member.spec.name, full)
        # A site that does not answer takes no new work at once; what runs there stays accounted to it.
        if member.state is not None:
            member.state = member.state.model_copy(update={"health": Health.UNHEALTHY, "reason": member.error})

    def freeze(self, now: datetime) -> Snapshot:
        """Step 2 of the cycle: the frozen arrays the policies decide on, with free capacity of their own.

        The arrays are built once per set of reports and copied for each cycle; staleness is judged when
        they are built (every collect), so a silent site turns unhealthy at the next collect. Prices from a
        price provider are computed once per set of sites; the carbon forecast is read for every snapshot,
        from the hour containing ``now``.
        """
        if self._base is None:
            specs = [m.spec for m in self.members.values()]
            states = {name: None if name in self.leaving else self.fresh_state(m, now)
                      for name, m in self.members.items()}
            base = build_snapshot(now, specs, states)
            prices = self._site_facts()[1]
            self._base = base if prices is None else replace(base, usd_per_gpu_hour=prices)
        snap = self._base.working_copy(now)
        if self.signals is not None:
            zones = self._site_facts()[0]
            snap = replace_forecast(snap, self.signals.forecast_rows(zones, now),
                                    model_h=self.signals.model_hours(zones, now))
        snap.last_placed[0] = snap.index.get(self.last_placed_site, -1) if self.last_placed_site else -1
        return snap

    def _site_facts(self) -> tuple[tuple[str, ...], np.ndarray | None]:
        """Per site in snapshot order (by name): its grid zone, and the price provider's price matrix (None
        without a provider). Computed once per change of the set of sites."""
        if self._site_arrays is None:
            specs = sorted((m.spec for m in self.members.values()), key=lambda s: s.name)
            prices = price_matrix(specs, self.prices) if self.prices is not None else None
            self._site_arrays = (tuple(s.grid_zone for s in specs), prices)
        return self._site_arrays

    def set_prices(self, provider: PriceProvider | None) -> None:
        """Use ``provider``'s prices from the next snapshot on (None: the specs' own)."""
        self.prices = provider
        self._base = self._site_arrays = None

    def remember_pass(self, snap: Snapshot) -> None:
        """Carry a pass's last placement over to the next pass's snapshot."""
        if snap.last_placed[0] >= 0:
            self.last_placed_site = snap.sites[int(snap.last_placed[0])]

    def fresh_state(self, member: Member, now: datetime) -> SiteState | None:
        """The member's state, marked unhealthy when its last report is older than ``stale_after_s``."""
        state = member.state
        if state is None or member.last_heard_at is None:
            return state
        silent_s = (now - member.last_heard_at).total_seconds()
        if silent_s > self.stale_after_s and state.health == Health.HEALTHY:
            state = state.model_copy(
                update={"health": Health.UNHEALTHY, "reason": f"silent for {silent_s:.0f} s"}
            )
            member.state = state
        return state
