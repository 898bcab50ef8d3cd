"""The broker service: store, federation, job book, scheduling cycle and lifecycle, wired together.

Start-up: open the store; register the sites of the configuration (the configuration is the starting
point: a site in it is written to the store) and those registered earlier over the API; load active jobs;
requeue attempts that the sites no longer know; start the live signals (carbon forecasts, when
``broker.carbon`` is set; prices, when ``broker.prices`` is set); then run the cycle whenever work may have
changed, and at least every ``cycle_interval_s``. A provider that cannot be built (a missing folder, an unset
token variable) stops the start with a :class:`~broker.config.ConfigError` naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from collections.abc import AsyncIterator, Callable

from adapters.base import SiteAdapter
from adapters.simulated import SimulatedSite
from broker.clock import Clock, SystemClock
from broker.config import BrokerSettings, ConfigError
from broker.cycle import SchedulingCycle
from policies.profiles import profile_pipeline
from broker.federation import Federation, Member, needs_rebuild
from broker.jobs import JobBook
from broker.lifecycle import Lifecycle
from broker.models import SiteSpec
from broker.providers.carbon import CarbonProvider, ProviderError, build_carbon_provider
from broker.providers.prices import PriceProvider, build_price_provider
from broker.signals import GridSignals
from broker.store import Store
from broker.store.sqlite import SQLiteStore

log = logging.getLogger(__name__)


class SiteConflict(ValueError):
    """A site change that would strand jobs, or a name already taken."""


def adapter_factory(clock: Clock, state_dir: str | Path | None = None) -> Callable[[SiteSpec], SiteAdapter]:
    """``state_dir``: where sites without a ``state_dir`` of their own keep what must outlive a restart."""

    def make(spec: SiteSpec) -> SiteAdapter:
        match spec.adapter.kind:
            case "simulated":
                return SimulatedSite(spec, clock, state_dir=spec.adapter.state_dir or state_dir)
            case "kubernetes":
                from adapters.kubernetes import KubernetesSite  # the kubernetes client only where it is used

                return KubernetesSite(spec, clock, state_dir=spec.adapter.state_dir or state_dir)
        raise ValueError(f"site {spec.name}: unknown adapter kind {spec.adapter.kind!r}")

    return make


def site_state_dir(db: str) -> Path | None:
    """Where the simulated sites keep their state: ``sites/`` beside the database file (none in memory)."""
    if db == ":memory:" or db.startswith("file::memory:"):
        return None
    return Path(db).resolve().parent / "sites"


class Broker:
    def __init__(
        self,
        settings: BrokerSettings | None = None,
        store: Store | None = None,
        clock: Clock | None = None,
        factory: Callable[[SiteSpec], SiteAdapter] | None = None,
        new_id: Callable[[], str] | None = None,
        carbon: CarbonProvider | None = None,
        prices: PriceProvider | None = None,
    ) -> None:
        """``carbon`` and ``prices``: providers to use instead of building those ``settings`` configure."""
        self.settings = settings or BrokerSettings()
        self.clock = clock or SystemClock()
        self.store: Store = store or SQLiteStore(self.settings.db)
        self.federation = Federation(
            self.clock,
            factory or adapter_factory(self.clock, site_state_dir(self.settings.db)),
            stale_after_s=self.settings.site_stale_after_s,
            collect_timeout_s=self.settings.collect_timeout_s,
        )
        self.book = JobBook(self.store, self.clock, refusal_ttl_s=self.settings.refusal_ttl_s,
                            **({"new_id": new_id} if new_id else {}))
        self.lifecycle = Lifecycle(self.book, self.federation, cancel_timeout_s=self.settings.dispatch_timeout_s)
        self.cycle = SchedulingCycle(
            self.clock, self.federation, self.book, self.store, self.lifecycle,
            dispatch_timeout_s=self.settings.dispatch_timeout_s, full_pass_interval_s=self.settings.cycle_interval_s,
            pipeline=profile_pipeline(self.settings.profiles.default, self.settings.profiles),
            profiles={name: profile_pipeline(name, self.settings.profiles)
                      for name in self.settings.profiles.job_may_choose},
        )
        self._carbon_provider, self._price_provider = carbon, prices
        self.signals: GridSignals | None = None  # carbon forecasts per zone; None without a carbon provider
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._sites_lock = asyncio.Lock()  # one site change at a time: check and write stay together
        self._loop_task: asyncio.Task[None] | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self.cycles = 0

    # --- life cycle ---

    async def start(self, sites: list[SiteSpec] | None = None, run_loop: bool = True) -> None:
        carbon, prices = await self._providers()
        await self.store.open()
        for spec in sites or []:
            await self.store.put_site(spec)
        for spec in await self.store.list_sites():
            await self._join(spec)
        await self.book.load()
        requeued = await self.lifecycle.recover()
        if requeued:
            log.warning("requeued %d jobs whose attempts were lost while the broker was down", len(requeued))
        self.federation.set_prices(prices)
        if carbon is not None:
            self.signals = GridSignals(carbon, self.settings.carbon_forecast, self.clock, zones=self._grid_zones)
            self.federation.signals = self.signals
            await self.signals.start()
        if run_loop:
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="scheduling-loop")

    async def _providers(self) -> tuple[CarbonProvider | None, PriceProvider | None]:
        """The carbon and price providers: those given, else those the settings configure (files are read in
        a thread). Raises ConfigError naming the setting when one cannot be built."""
        carbon, prices = self._carbon_provider, self._price_provider
        try:
            if prices is None and self.settings.prices is not None:
                prices = await asyncio.to_thread(build_price_provider, self.settings.prices)
        except (ValueError, OSError) as e:
            raise ConfigError(f"broker.prices: {e}") from None
        try:
            if carbon is None and self.settings.carbon is not None:
                carbon = await asyncio.to_thread(build_carbon_provider, self.settings.carbon, clock=self.clock)
        except (ValueError, OSError, ProviderError) as e:
            raise ConfigError(f"broker.carbon: {e}") from None
        return carbon, prices

    def _grid_zones(self) -> set[str]:
        return {m.spec.grid_zone for m in self.federation.members.values()}

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self.signals is not None:
            await self.signals.stop()  # cancels a refresh in progress and closes the provider
            self.federation.signals = self.signals = None
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
            self._housekeeping = None
        cut = await self.cycle.drain(self.settings.shutdown_grace_s)
        if cut:
            log.warning("%d dispatches were still in flight at shutdown; they are reconciled at the next start", cut)
        for task in self._pumps.values():
            task.cancel()
        await asyncio.gather(*self._pumps.values(), return_exceptions=True)
        self._pumps.clear()
        await self.federation.close()
        await self.store.close()

    async def _loop(self) -> None:
        """Run a pass when work may have changed, at least every ``cycle_interval_s``, and at most one
        every ``min_cycle_gap_s``, so a burst of submissions shares passes instead of starting one each."""
        settings = self.settings
        while True:
            self.book.changed.clear()
            try:
                await self.cycle.run_once()
                self.cycles += 1
            except Exception:
                log.exception("scheduling cycle failed; trying again")
            if self._housekeeping is None or self._housekeeping.done():
                # Slow sites must not hold up scheduling: retries of unconfirmed withdrawals and of
                # reconciliations run beside the loop, one round at a time.
                self._housekeeping = asyncio.get_running_loop().create_task(self._settle(), name="housekeeping")
            await asyncio.sleep(settings.min_cycle_gap_s)
            try:
                async with asyncio.timeout(settings.cycle_interval_s):
                    await self.book.changed.wait()
            except TimeoutError:
                pass

    async def _settle(self) -> None:
        try:
            await self.lifecycle.settle()
        except Exception:
            log.exception("retrying withdrawals and reconciliations failed; trying again next cycle")

    def wake(self) -> None:
        self.book.changed.set()

    # --- sites ---

    async def _join(self, spec: SiteSpec) -> Member:
        member = await self.federation.add(spec)
        self._pumps[spec.name] = asyncio.get_running_loop().create_task(
            self.lifecycle.pump(member), name=f"events-{spec.name}"
        )
        return member

    async def register_site(self, spec: SiteSpec) -> Member:
        async with self._sites_lock:
            return await self._register_site(spec)

    async def _register_site(self, spec: SiteSpec) -> Member:
        if spec.name in self.federation:
            raise SiteConflict(f"site {spec.name} is already registered; update it with PUT")
        await self.store.put_site(spec)
        member = await self._join(spec)
        self.wake()
        return member

    async def update_site(self, spec: SiteSpec) -> Member:
        async with self._sites_lock:
            return await self._update_site(spec)

    async def _update_site(self, spec: SiteSpec) -> Member:
        member = self.federation.get(spec.name)
        if member is None:
            raise KeyError(spec.name)
        if not needs_rebuild(member.spec, spec):
            await self.store.put_site(spec)
            member = await self.federation.replace(spec)
            self.wake()
            return member
        async with self._site_leaving(spec.name, "its GPU inventory, adapter and fair-share policy can change only "
                                                 "when no jobs run there"):
            await self.store.put_site(spec)
            await self._stop_pump(spec.name)
            member = await self.federation.replace(spec)
            self._pumps[spec.name] = asyncio.get_running_loop().create_task(
                self.lifecycle.pump(member), name=f"events-{spec.name}"
            )
        self.wake()
        return member

    @contextlib.asynccontextmanager
    async def _site_leaving(self, name: str, what: str) -> AsyncIterator[None]:
        """Take a site out of placement first, then check it is idle, so no pass slips a job onto it while
        it is removed or rebuilt. Raises SiteConflict (and puts it back) if jobs are active there."""
        self.federation.set_leaving(name, True)
        try:
            busy = self.book.on_site(name)
            if busy:
                raise SiteConflict(f"site {name} has {len(busy)} active jobs; {what} (cancel them or wait)")
            yield
        finally:
            self.federation.set_leaving(name, False)

    async def remove_site(self, name: str) -> None:
        async with self._sites_lock:
            await self._remove_site(name)

    async def _remove_site(self, name: str) -> None:
        if name not in self.federation:
            raise KeyError(name)
        async with self._site_leaving(name, "a site can be removed only when none run there"):
            await self.store.delete_site(name)
            await self._stop_pump(name)
            await self.federation.remove(name)

    async def _stop_pump(self, name: str) -> None:
        task = self._pumps.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
