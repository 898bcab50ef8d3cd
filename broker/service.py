"""The broker service: store, federation, job book, scheduling cycle and lifecycle, wired together.

Start-up: open the store; register the sites of the configuration (the configuration is the starting
point: a site in it is written to the store) and those registered earlier over the API; load active jobs;
requeue attempts that the sites no longer know; start the live signals (carbon forecasts, when
``broker.carbon`` is set, from those the store kept until the provider answers; prices, when
``broker.prices`` is set); then run the cycle whenever work may have changed, and at least every
``cycle_interval_s``. A provider that cannot be built (a missing folder, an unset
token variable) stops the start with a :class:`~broker.config.ConfigError` naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path
from datetime import UTC, datetime, timedelta
from collections.abc import AsyncIterator, Callable

from pydantic import TypeAdapter

from adapters.base import AdapterError, SiteAdapter
from adapters.remote import MqttHub, RemoteSite
from adapters.simulated import SimulatedSite
from broker.clock import Clock, SystemClock
from broker.config import BrokerSettings, ConfigError, ReplicaSettings, is_shared_database, tenant_limits
from broker.cycle import SchedulingCycle
from policies.profiles import profile_pipeline
from broker.federation import Federation, Member, QuotaRefused, needs_rebuild
from broker.jobs import JobBook
from broker.leadership import SHUTTING_DOWN, Leadership
from broker.limits import LiveTenantLimits
from broker.lifecycle import Lifecycle
from broker.auth import TokenBook
from broker.events import EventHub
from broker.metrics import Metrics
from broker.models import Health, Job, JobChange, SiteSpec, TenantQuota
from broker.providers.carbon import CarbonProvider, ProviderError, build_carbon_provider
from broker.providers.prices import PriceProvider, build_price_provider
from broker.signals import GridSignals
from policies.tenant_limit import TenantLimits
from broker.store import Fenced, Store, StoredDecision, StoreError, open_store

log = logging.getLogger(__name__)

FIRST_PASS_WAIT_S = 30.0
"""The longest the first scheduling pass waits for the first round of carbon forecasts (or fetch_timeout_s)."""
QUOTA_PASSES_STATE = "file-quota-passes"
"""The store's name (``Store.put_state``) for the quotas the config file changed that a site has not taken yet."""
PRUNE_BATCH = 1000
"""Finished jobs deleted at most per housekeeping round (``Broker.prune_ended``)."""
PRUNE_EVERY_S = 300.0
"""How often housekeeping looks for finished jobs past ``job_retention_h``, once a round found fewer than
``PRUNE_BATCH`` (a full one is followed by another at the next round)."""
_QUOTA_PASSES = TypeAdapter(dict[str, dict[str, TenantQuota | None]])


class SiteConflict(ValueError):
    """A site change that would strand jobs, or a name already taken."""


class SiteUnsupported(ValueError):
    """A site this broker cannot run: an agent-run site (adapter kind mqtt) without ``broker.mqtt``."""


def check_supported(spec: SiteSpec, hub: MqttHub | None) -> None:
    """Raise SiteUnsupported for a site this broker cannot run: one run by an agent, with no MQTT connection."""
    if spec.adapter.kind == "mqtt" and hub is None:
        raise SiteUnsupported(f"site {spec.name} is run by a site agent over MQTT, but this broker has no MQTT "
                              "connection: set broker.mqtt in its configuration")


def adapter_factory(clock: Clock, state_dir: str | Path | None = None,
                    hub: MqttHub | None = None) -> Callable[[SiteSpec], SiteAdapter]:
    """``state_dir``: where sites without a ``state_dir`` of their own keep what must outlive a restart;
    ``hub``: the broker's MQTT connection, for sites run by an agent."""

    def make(spec: SiteSpec) -> SiteAdapter:
        match spec.adapter.kind:
            case "simulated":
                return SimulatedSite(spec, clock, state_dir=spec.adapter.state_dir or state_dir)
            case "kubernetes":
                from adapters.kubernetes import KubernetesSite  # the kubernetes client only where it is used

                return KubernetesSite(spec, clock, state_dir=spec.adapter.state_dir or state_dir)
            case "mqtt":
                check_supported(spec, hub)
                assert hub is not None
                return RemoteSite(spec, clock, hub)
        raise ValueError(f"site {spec.name}: unknown adapter kind {spec.adapter.kind!r}")

    return make


def site_state_dir(db: str) -> Path | None:
    """Where the simulated sites keep their state: ``sites/`` beside the database file (none in memory).

    With a PostgreSQL URL there is no file to stand beside: ``var/sites`` under the working directory, where
    the default database (``var/heliotrope.db``) would have put it. That state is the replica's own (each
    replica runs its own site adapters); set ``adapter.state_dir`` on a site to put it elsewhere."""
    if db == ":memory:" or db.startswith("file::memory:"):
        return None
    if db.startswith(("postgresql://", "postgres://")):
        return Path("var/sites").resolve()
    return Path(db).resolve().parent / "sites"


_KERNELS_READY = False


async def _compile_decision_kernels() -> None:
    """Compile the Numba kernels that decisions run (``policies.timeshift.warm_up``) in a worker thread,
    before the broker takes charge. The first call of each kernel compiles it: seconds on a fresh install
    (then loaded from the disk cache: under a second), which inside a scheduling pass would stall the event
    loop, and with it heartbeats, lease grants and the API. Once per process; later calls return at once."""
    global _KERNELS_READY
    if _KERNELS_READY:
        return
    from policies.timeshift import warm_up

    began = time.perf_counter()
    compiling = asyncio.ensure_future(asyncio.to_thread(warm_up))
    done, _ = await asyncio.wait({compiling}, timeout=2.0)
    if not done:  # not in the disk cache: say why the start pauses
        log.info("compiling the decision kernels (Numba; the first start after an install only)")
    await compiling
    _KERNELS_READY = True
    took = time.perf_counter() - began
    if took >= 1.0:
        log.info("decision kernels ready in %.1f s (cached on disk for the next start)", took)


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
        self.store: Store = store or open_store(self.settings.db)
        self.replicas: ReplicaSettings | None = self.settings.replicas or (
            ReplicaSettings() if is_shared_database(self.settings.db) else None)
        mqtt = self.settings.mqtt
        if mqtt is not None and self.replicas is not None:  # each replica its own MQTT session
            mqtt = mqtt.model_copy(update={"client_id": f"{mqtt.client_id or 'heliotrope-broker'}-{uuid.uuid4().hex[:8]}"})
        self.hub: MqttHub | None = MqttHub(mqtt) if mqtt is not None else None
        self.federation = Federation(
            self.clock,
            factory or adapter_factory(self.clock, site_state_dir(self.settings.db), self.hub),
            stale_after_s=self.settings.site_stale_after_s,
            collect_timeout_s=self.settings.collect_timeout_s,
        )
        self.federation.adapter_started = self._follow_new_adapter
        self._new_id = new_id
        self.metrics = Metrics()
        self.events = EventHub()
        self.tokens = TokenBook(self.store, self.settings.auth, self.clock)
        self.limits = LiveTenantLimits(tenant_limits(self.settings), self.store, self.clock)
        self._fresh_term()
        self.metrics.bind(self)
        self._carbon_provider, self._price_provider = carbon, prices
        self.signals: GridSignals | None = None  # carbon forecasts per zone; None without a carbon provider
        self._pumps: dict[str, asyncio.Task[None]] = {}
        # one change of a site at a time, check and write together; a site's own lock, so a change that waits
        # (a rebuild waiting for a cancelled job's dispatch) holds up no other site's (a cordon in an incident)
        self._site_locks: dict[str, asyncio.Lock] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self.cycles = 0
        self.leadership: Leadership | None = None  # set by elect(), among replicas
        self._terms = 0  # terms this replica has led
        # per site, the quotas the config file changed while the broker was down and the site has not taken yet:
        # tenant -> its quota before the change (None: it had none); kept in the store (QUOTA_PASSES_STATE)
        self._quota_passes: dict[str, dict[str, TenantQuota | None]] = {}
        self._quota_passes_warned: set[str] = set()
        self._prune_due = datetime.min.replace(tzinfo=UTC)  # when housekeeping next looks for jobs to delete
        self._pruning = asyncio.Lock()
        self._run_loop = True
        self._in_pass = asyncio.Event()  # set while the loop runs a scheduling pass
        self._pass_over = asyncio.Event()  # set when that pass has ended
        self._stepping: asyncio.Task[None] | None = None
        self._providers_built: tuple[CarbonProvider | None, PriceProvider | None] = (None, None)

    def _fresh_term(self) -> None:
        """The job book, lifecycle and cycle of one term in charge: built at construction, and again when a
        replica is elected after having led before (nothing of the earlier term's memory is trusted)."""
        self.book = JobBook(self.store, self.clock, refusal_ttl_s=self.settings.refusal_ttl_s,
                            **({"new_id": self._new_id} if self._new_id else {}))
        self.lifecycle = Lifecycle(self.book, self.federation, cancel_timeout_s=self.settings.dispatch_timeout_s,
                                   max_lost_attempts=self.settings.max_lost_attempts)
        self.cycle = SchedulingCycle(
            self.clock, self.federation, self.book, self.store, self.lifecycle,
            dispatch_timeout_s=self.settings.dispatch_timeout_s, full_pass_interval_s=self.settings.cycle_interval_s,
            pipeline=profile_pipeline(self.settings.profiles.default, self.settings.profiles),
            profiles={name: profile_pipeline(name, self.settings.profiles)
                      for name in self.settings.profiles.job_may_choose},
            tenant_limits=self.limits.current,
        )
        self.cycle.may_act = self.lifecycle.may_act = self.may_act
        self.lifecycle.restart_overhead_s = self.cycle.restart_overhead_s
        self.lifecycle.stop_asked = self.cycle.stop_asked
        self.lifecycle.ended_unstopped = self.cycle.move_over
        self.lifecycle.dispatching_now = self.cycle.dispatching
        self.book.metrics = self.cycle.metrics = self.lifecycle.metrics = self.metrics
        self.book.events = self.cycle.events = self.events

    def may_act(self) -> bool:
        """Whether this broker may call a site now: always when alone; among replicas, while it surely leads."""
        return self.leadership is None or self.leadership.certain()

    # --- life cycle ---

    @property
    def in_charge(self) -> bool:
        """Whether this broker runs the cycle and the sites: always when alone, while leading as a replica."""
        return self.leadership is None or (self.leadership.leading and self.leadership.ready)

    async def start(self, sites: list[SiteSpec] | None = None, run_loop: bool = True) -> None:
        """Open the store and register the configured sites; then take charge at once, or, as one of several
        replicas (``settings.replicas``), when :meth:`elect` makes this one the leader."""
        await _compile_decision_kernels()
        moving = sorted({name for name in {self.settings.profiles.default, *self.settings.profiles.job_may_choose}
                         if name is not None and self.settings.profiles.migrate(name) is not None})
        if moving:  # policies.migration: the cycle asks sites to checkpoint and stop the jobs it moves
            log.info("profiles %s move running checkpointable jobs to where the rest of their run is cleaner or "
                     "cheaper, and out of the way of jobs near their users, at sites whose adapter can stop a "
                     "job on request", ", ".join(moving))
        self._providers_built = await self._providers()
        self._run_loop = run_loop
        await self.store.open()
        if self.replicas is None:
            # The file's spec wins, but not over a cordon: taking a site out of routing is its operator's act
            # (``sites cordon``), undone by ``uncordon``, and a restart must not send jobs to it meanwhile.
            stored = {s.name: s for s in await self.store.list_sites()}
            self._quota_passes = await self._kept_quota_passes()
            specs = []
            for spec in sites or []:
                was = stored.get(spec.name)
                if was is not None and was.cordoned and not spec.cordoned:
                    spec = spec.model_copy(update={"cordoned": True, "cordon_reason": was.cordon_reason})
                if was is not None:  # the quotas the file changed are passed to the site once it can take them
                    self._note_quota_pass(was, spec)
                specs.append(spec)
            await self._save_quota_passes()  # (first: once the file's specs are stored, only this tells the changes)
            for spec in specs:
                await self.store.put_site(spec)
        else:  # the shared store's sites are the truth (the leader changes them); the config only seeds it
            known = {s.name for s in await self.store.list_sites()}
            for spec in sites or []:
                if spec.name not in known:  # (one the leader stored meanwhile stays as the leader has it)
                    await self.store.seed_site(spec)
        if self.replicas is None:
            await self._take_charge()
        else:
            self.book.tracking = False  # until elected: submissions are stored for the leader to take in

    def elect(self, advertise_url: str) -> None:
        """As one of several replicas: compete for leadership under the name ``advertise_url`` (where this
        replica's API is served; followers send the leader's requests there)."""
        assert self.replicas is not None
        self.leadership = Leadership(self.store, advertise_url, self.replicas.lease_s,
                                     elected=self._elected, deposed=self._give_up_charge)
        self.leadership.start()

    async def _elected(self, epoch: int) -> None:
        if self._terms:
            self._fresh_term()
        self._terms += 1
        await self._take_charge()

    async def _take_charge(self) -> None:
        """Join the sites, load the active jobs, reconcile with the sites, start signals and the loop."""
        carbon, prices = self._providers_built
        self.book.tracking = True
        # Before any site's events are pumped: a job that succeeds from here on is learned once, live.
        await self.lifecycle.learn_run_times(self.store)
        await self.cycle.restore_learned()  # the carbon ledger and the latency demand, as the last leader left them
        self.cycle.set_tenant_limits(await self.limits.load())  # with those set through the API
        for spec in await self.store.list_sites():
            try:
                check_supported(spec, self.hub)
            except SiteUnsupported as e:
                raise ConfigError(str(e)) from None
            member = await self._join(spec, tolerate_failure=True)
            if spec.name in self._quota_passes:
                async with self.site_lock(spec.name):
                    await self._pass_file_quotas(member)
        if self.hub is not None:  # only the broker in charge talks to the agents
            # Once its sites have joined: the MQTT broker hands over what it kept for this broker's session
            # (the agents' heartbeats and events while no broker was in charge) as soon as it connects, and a
            # message for a site not attached yet would be dropped as one of a site not registered here.
            await self.hub.start()  # connects in the background, and reconnects by itself
            if not await self.hub.wait_connected(self.settings.collect_timeout_s):
                log.warning("mqtt: not connected to %s:%d yet; agent-run sites stay unhealthy until it is",
                            self.hub.settings.host, self.hub.settings.port)
        await self.book.load()
        await self.cycle.settle_ledger()  # attempts the ledger holds open whose end it did not hear of
        self.lifecycle.loaded.set()  # the sites' events flow from here on
        requeued = await self.lifecycle.recover()
        if requeued:
            log.warning("requeued %d jobs whose attempts were lost while the broker was down", len(requeued))
        self.federation.set_prices(prices)
        if carbon is not None:
            # (start() takes up the forecasts the store keeps: a provider that is down now is not a blind start)
            self.signals = GridSignals(carbon, self.settings.carbon_forecast, self.clock, zones=self._grid_zones,
                                       store=self.store, may_act=self.may_act)
            self.federation.signals = self.signals
            await self.signals.start()
        if self._run_loop:
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
        if self.leadership is not None:
            if self.leadership.leading:
                # While it still leads (a replica that has given up its lease may call no site): let the pass
                # in progress hand its placements to the sites and the dispatches on their way land, within
                # the grace, so a rolling restart leaves no attempt dispatching for the next leader to mend.
                await self._end_loop(grace=True)
                cut = await self.cycle.drain(self.settings.shutdown_grace_s)
                if cut:
                    log.warning("%d dispatches were still in flight at shutdown; the next leader reconciles them", cut)
            await self.leadership.stop()  # gives up charge, and the lease, so another replica takes over at once
            if self._stepping is not None:  # a step-down the loop began (Fenced) has ended too
                await asyncio.gather(self._stepping, return_exceptions=True)
        else:
            await self._give_up_charge(SHUTTING_DOWN)
        await self.store.close()

    async def _end_loop(self, *, grace: bool) -> None:
        """Stop the scheduling loop; with ``grace``, a pass whose placements are stored but not yet dispatched
        first hands them to the sites (within the grace), so a clean stop leaves no attempt stranded as
        dispatching."""
        task = self._loop_task
        if task is None:
            return
        if grace and self._in_pass.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.shutdown_grace_s):
                    await self._pass_over.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self._loop_task is task:
            self._loop_task = None

    async def _give_up_charge(self, why: str) -> None:
        """Stop the loop, the signals and the sites' event pumps, let dispatches in flight finish, and close
        the sites: what a deposed leader and a stopping broker both do. Jobs stay as the store has them."""
        await self._end_loop(grace=why == SHUTTING_DOWN)
        if self.signals is not None:
            # cancels a refresh in progress, keeps the forecasts in the store (when stopping) and closes the provider
            await self.signals.stop(keep=why == SHUTTING_DOWN)
            self.federation.signals = self.signals = None
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
            self._housekeeping = None
        # A deposed leader must not call a site again: what has not reached one is dropped at once (the next
        # leader reconciles). A broker shutting down lets dispatches on their way finish.
        cut = await self.cycle.drain(self.settings.shutdown_grace_s if why == SHUTTING_DOWN else 0.0)
        if why == SHUTTING_DOWN:
            await self.cycle.keep_ledger(final=True)  # the last seconds' placements, counted
            await self.cycle.keep_moves(final=True)  # and the moves in flight, as they stand
        if cut:
            log.warning("%d dispatches were still in flight at shutdown; they are reconciled at the next start", cut)
        for task in self._pumps.values():
            task.cancel()
        await asyncio.gather(*self._pumps.values(), return_exceptions=True)
        self._pumps.clear()
        await self.federation.clear()
        if self.hub is not None:
            await self.hub.close()
        self.events.end_streams()  # the clients follow whoever leads next
        self.book.active.clear()  # what a follower reads comes from the store, which the leader keeps current
        self.limits.forget()  # likewise the tenant limits set through the API
        self.lifecycle.loaded.clear()
        self.book.tracking = self.replicas is None

    async def _loop(self) -> None:
        """Run a pass when work may have changed, at least every ``cycle_interval_s``, and at most one
        every ``min_cycle_gap_s``, so a burst of submissions shares passes instead of starting one each."""
        settings = self.settings
        if self.signals is not None:
            # The first pass decides with the forecasts: after a restart it decides every queued job again, and
            # one seen without them (a job deferred for a cleaner hour) would start at once. Not for long: jobs
            # that must start now wait too (a zone's fetch may take fetch_timeout_s, its fit more). Meanwhile,
            # and while the provider is down, the forecasts the store kept stand in (GridSignals.restore).
            wait_s = min(settings.carbon_forecast.fetch_timeout_s, FIRST_PASS_WAIT_S)
            started = time.monotonic()
            try:
                async with asyncio.timeout(wait_s):
                    await self.signals.wait_ready()
            except TimeoutError:
                kept = self.signals.kept_in_use(self.clock.now())
                if kept:
                    log.warning("the first carbon forecasts are not in after %g s; scheduling with those the "
                                "store kept (%d zones) until they come", wait_s, kept)
                else:
                    log.warning("the first carbon forecasts are not in after %g s; scheduling without them until "
                                "they come (a job deferred before the restart may start now)", wait_s)
            else:
                if time.monotonic() - started > 1.0:
                    log.info("the first scheduling pass waited %.1f s for the first carbon forecasts",
                             time.monotonic() - started)
        while True:
            self.book.changed.clear()
            try:
                if self.leadership is not None:
                    await self.book.pull_new()  # jobs the other replicas took in
                try:
                    await self.book.settle_waiting()  # jobs whose dependencies ended (broker.after)
                except StoreError as e:  # (Fenced passes: this replica no longer leads)
                    if isinstance(e, Fenced):
                        raise
                    log.error("jobs waiting for others could not be settled (%s); trying again next cycle", e)
                self._pass_over.clear()
                self._in_pass.set()
                try:
                    await self.cycle.run_once()
                finally:
                    self._in_pass.clear()
                    self._pass_over.set()
                self.cycles += 1
            except Fenced as e:
                # Another replica leads now: nothing this one writes lands. Step down (from another task:
                # stepping down stops this loop).
                if self.leadership is not None:
                    self._stepping = asyncio.get_running_loop().create_task(self.leadership.step_down(str(e)),
                                                                            name="step-down")
                return
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
        if self.settings.job_retention_h and self.clock.now() >= self._prune_due:
            later = self.clock.now() + timedelta(seconds=PRUNE_EVERY_S)
            try:
                more, _ = await self._prune_round()
            except Fenced:
                return  # another replica leads now: the loop steps down at its next write
            except Exception:
                log.exception("deleting finished jobs past broker.job_retention_h failed; trying again in %.0f "
                              "minutes", PRUNE_EVERY_S / 60)
                more = False
            if not more:  # (after a full round the next comes at the next housekeeping, not 5 minutes on)
                self._prune_due = later
        for name in list(self._quota_passes):  # a site that could not take its file's quotas before: again
            # (under the site's lock: a change of the site made meanwhile, its quotas passed, must not be followed
            # by the file's older ones; a site whose lock is held, a rebuild waiting out a dispatch, is tried at the
            # next round rather than hold up the others' and the next round's retries)
            if self.site_lock(name).locked():
                continue
            async with self.site_lock(name):
                member = self.federation.get(name)
                if member is not None:
                    try:
                        await self._pass_file_quotas(member)
                    except Exception:
                        log.exception("site %s: passing the quotas of the config file failed; trying again", name)

    async def prune_ended(self) -> int:
        """Delete up to ``PRUNE_BATCH`` jobs that ended more than ``job_retention_h`` ago, with their transitions
        and decisions (as Armada's Lookout pruner and Slurm's ``MinJobAge``: the store holds what runs and what
        ended lately, not every job ever sent). Returns how many; none where the retention is 0 or null."""
        return (await self._prune_round())[1] if self.settings.job_retention_h else 0

    async def _prune_round(self) -> tuple[bool, int]:
        """One round of :meth:`prune_ended`: first up to ``PRUNE_BATCH`` rows that ended undated are dated (before
        the release that dates them, or by a replica of an earlier one), then up to ``PRUNE_BATCH`` jobs deleted.
        Returns whether either batch was full (more to do at once), and how many jobs were deleted."""
        kept = self.settings.job_retention_h or 0.0
        async with self._pruning:  # one round at a time, so that no two count the same jobs
            dated = await self.store.date_ended(PRUNE_BATCH)
            # (not a job that waiting jobs run after: its end, which the store holds, decides them: broker.after)
            waited_for = set(self.book.active.dependents)
            ids = await self.store.prune_ended(self.clock.now() - timedelta(hours=kept), PRUNE_BATCH, waited_for)
        if ids:
            self.metrics.pruned.inc(len(ids))
            log.info("deleted %d finished job(s) that ended more than %g h ago (broker.job_retention_h)",
                     len(ids), kept)
        return dated == PRUNE_BATCH or len(ids) == PRUNE_BATCH, len(ids)

    async def decision(self, job: Job) -> StoredDecision | None:
        """The decision that explains ``job`` now: its own last recorded one, or, if newer, the one its
        queue group failed at in the last full pass, which did not decide the rest of the group
        (``broker.queue``). None: not decided yet."""
        stored = await self.store.get_decision(job.id)
        skipped = self.cycle.skipped_decision(job.id)
        if skipped is not None and (stored is None or datetime.fromisoformat(skipped["decided_at"])
                                    > datetime.fromisoformat(stored.record["decided_at"])):
            return StoredDecision(job.attempt, skipped)
        return stored

    def wake(self) -> None:
        self.book.changed.set()

    # --- tenant limits (broker.limits) ---

    async def tenant_limits_now(self) -> TenantLimits:
        """The federation-wide tenant limits a submission is checked against: those the cycle enforces where this
        broker is in charge; on a replica that does not lead, the configuration's with the overrides read from the
        shared store, at most ``broker.limits.CACHE_S`` seconds old."""
        return self.limits.current if self.in_charge else await self.limits.refreshed()

    async def set_tenant_limit(self, tenant: str, gpus: float | None) -> TenantLimits:
        """``PUT /v1/tenants/{tenant}/limit`` (GPUs; None: unlimited), on the broker in charge: stored (fenced: a
        deposed leader's is refused), then enforced from the next pass, a full one that runs at once and decides
        the whole queue again (``SchedulingCycle.set_tenant_limits``)."""
        limits = await self.limits.put(tenant, gpus)
        self.cycle.set_tenant_limits(limits)
        self.wake()
        return limits

    async def reset_tenant_limit(self, tenant: str) -> TenantLimits | None:
        """``DELETE /v1/tenants/{tenant}/limit``: the configuration's limit again, as :meth:`set_tenant_limit`
        changes one; None where the tenant had no override (nothing changed)."""
        limits = await self.limits.reset(tenant)
        if limits is not None:
            self.cycle.set_tenant_limits(limits)
            self.wake()
        return limits

    async def change_job(self, job_id: str, change: JobChange) -> Job:
        """A queued job's priority, deadline or profile changed (``PATCH /v1/jobs/{id}``): stored, then decided
        again at the next pass as a new job would be (a deferral planned for it is dropped: its new deadline or
        profile may not allow it)."""
        await self.book.take_in(job_id)  # (one another replica accepted may not be taken in yet, as a cancel)
        try:
            job, what = await self.book.amend(job_id, change)
        except StoreError:  # memory went back; a pass may have planned for the change meanwhile: not kept
            self.cycle.replan(job_id)
            self.wake()
            raise
        if what is not None:
            self.cycle.replan(job_id)
            self.wake()
        return job

    # --- sites ---

    async def _kept_quota_passes(self) -> dict[str, dict[str, TenantQuota | None]]:
        raw = await self.store.get_state(QUOTA_PASSES_STATE)
        if not raw:
            return {}
        try:
            return _QUOTA_PASSES.validate_json(raw)
        except ValueError as e:
            log.error("the quota changes of the config file not yet passed to their sites cannot be read (%s); "
                      "set them again with heliotrope quota SITE --set where a site did not take them", e)
            return {}

    async def _save_quota_passes(self) -> None:
        await self.store.put_state(QUOTA_PASSES_STATE, _QUOTA_PASSES.dump_json(self._quota_passes).decode())

    def _note_quota_pass(self, was: SiteSpec, spec: SiteSpec) -> None:
        """The config file's ``spec`` replaces the stored ``was``: each tenant whose quota it changes is to be
        passed to the site (added to what an earlier start noted and the site has not taken yet, whose quota
        before stays the one the site last took); a tenant changed back to what the site has needs nothing."""
        pending = self._quota_passes.get(spec.name, {})
        before = {q.tenant: q for q in was.quotas}
        after = {q.tenant: q for q in spec.quotas}
        for tenant in before.keys() | after.keys():
            if tenant not in pending and before.get(tenant) != after.get(tenant):
                pending[tenant] = before.get(tenant)
        pending = {t: q for t, q in pending.items() if q != after.get(t)}
        if pending:
            self._quota_passes[spec.name] = pending
        else:
            self._quota_passes.pop(spec.name, None)

    async def quota_set_by_operator(self, site: str, tenant: str) -> None:
        """The site's operator set or removed ``tenant``'s quota through the API: that change is the latest, so
        the config file's older one for the tenant, not passed yet, is not passed over it."""
        pending = self._quota_passes.get(site)
        if pending is None or tenant not in pending:
            return
        del pending[tenant]
        if not pending:
            self._quota_passes.pop(site)
        await self._save_quota_passes()

    async def _pass_file_quotas(self, member: Member) -> None:
        """The config file changed the site's quotas while the broker was down: the changes go to the site as a
        PUT of the spec would pass them (the latest change wins), or the site would go on enforcing an older
        change made through the quota API while its spec says otherwise. A site that cannot take them now (its
        adapter not started; an agent-run site whose agent has not reported yet) gets them once it can: the
        housekeeping after each pass tries again, and the store keeps them across restarts."""
        name = member.spec.name
        pending = self._quota_passes.get(name)
        if not pending:
            return
        ready = member.started and (member.spec.adapter.kind != "mqtt" or (  # (its agent answers now)
            member.error is None and member.state is not None and member.state.health == Health.HEALTHY))
        if not ready:
            if name not in self._quota_passes_warned:
                self._quota_passes_warned.add(name)
                log.warning("site %s: its quotas changed in the config file (%s); the site cannot take them now and "
                            "keeps those it had until it can: they are passed then", name, ", ".join(sorted(pending)))
            return
        kept = {q.tenant: q for q in member.spec.quotas if q.tenant not in pending}
        was = member.spec.model_copy(update={"quotas": [*kept.values(), *(q for q in pending.values() if q)]})
        try:
            await self.federation.pass_quotas(name, was)
        except QuotaRefused as e:  # (the site's own GPUs: asking again will not change its answer)
            log.error("site %s: %s; it keeps the quota it had for %s (set one it can give with heliotrope quota)",
                      name, e, e.tenant)
            pending.pop(e.tenant, None)
            for tenant in e.taken:
                pending.pop(tenant, None)
            if not pending:
                self._quota_passes.pop(name, None)
            await self._save_quota_passes()
            return
        except AdapterError as e:
            if name not in self._quota_passes_warned:
                self._quota_passes_warned.add(name)
                log.warning("site %s: %s; it keeps the quotas it had until it takes them (tried again after each "
                            "pass)", name, e)
            return
        self._quota_passes.pop(name, None)
        self._quota_passes_warned.discard(name)
        await self._save_quota_passes()
        log.info("site %s: the quotas its config file changed are passed to it (%s)", name, ", ".join(sorted(pending)))

    async def _join(self, spec: SiteSpec, tolerate_failure: bool = False) -> Member:
        member = await self.federation.add(spec, tolerate_failure)
        self._start_pump(member)
        return member

    def _follow_new_adapter(self, name: str) -> None:
        """A site that joined without a working adapter has a fresh one that started: its events pump
        follows the new adapter's events from now on."""
        old = self._pumps.pop(name, None)
        if old is not None:
            old.cancel()
        member = self.federation.get(name)
        if member is not None:
            self._start_pump(member)

    def _start_pump(self, member: Member) -> None:
        """Follow the site's events (its adapter's) into the job book."""
        self._pumps[member.spec.name] = asyncio.get_running_loop().create_task(
            self.lifecycle.pump(member), name=f"events-{member.spec.name}")

    def site_lock(self, name: str) -> asyncio.Lock:
        """The lock that orders the changes of site ``name`` (its registration and removal included)."""
        lock = self._site_locks.get(name)
        if lock is None:
            if len(self._site_locks) >= 2 * len(self.federation.members) + 16:
                self._drop_idle_site_locks()
            lock = self._site_locks[name] = asyncio.Lock()
        return lock

    def _drop_idle_site_locks(self) -> None:
        """Forget the locks of names no site has now (removed sites, registrations refused) that nobody holds or
        waits for, so names tried and gone do not pile up. Safe without a lock of its own: a caller takes the
        lock :meth:`site_lock` returns before it yields to another task."""
        for name, lock in list(self._site_locks.items()):
            if name not in self.federation and not lock.locked() and not getattr(lock, "_waiters", None):
                del self._site_locks[name]

    async def register_site(self, spec: SiteSpec) -> Member:
        async with self.site_lock(spec.name):
            return await self._register_site(spec)

    async def _register_site(self, spec: SiteSpec) -> Member:
        if spec.name in self.federation:
            raise SiteConflict(f"site {spec.name} is already registered; update it with PUT")
        check_supported(spec, self.hub)
        member = await self._join(spec)  # an adapter that cannot start raises here: nothing is stored
        try:
            await self.store.put_site(spec)
        except BaseException:
            await self._stop_pump(spec.name)
            await self.federation.remove(spec.name)
            raise
        self.wake()
        return member

    async def update_site(self, spec: SiteSpec,
                          prepare: Callable[[SiteSpec, SiteSpec], SiteSpec] | None = None) -> Member:
        """Take a site's new spec. ``prepare(spec, current)``, called under the lock with the spec the site has
        when the change is made, gives the spec to write (or raises to refuse it): the API keeps the secrets a
        PUT leaves out and checks who may change credentials there, so an update under way is neither undone
        by a copy of the spec from before it nor let through as no change. KeyError: no such site."""
        if prepare is None:
            async with self.site_lock(spec.name):
                return await self._update_site(spec)
        return await self._change_site(spec.name, lambda current: prepare(spec, current))

    async def cordon_site(self, name: str, cordon: bool, reason: str | None = None) -> Member:
        """Cordon (or uncordon) a site, its spec otherwise as it is when the change is made (``_change_site``).
        Cordoned again with no reason, the first reason stands. KeyError: no such site."""

        def cordoned(current: SiteSpec) -> SiteSpec:
            why = current.cordon_reason if cordon and reason is None and current.cordoned else reason
            return current.model_copy(update={"cordoned": cordon, "cordon_reason": why if cordon else None})

        return await self._change_site(name, cordoned)

    async def _change_site(self, name: str, change: Callable[[SiteSpec], SiteSpec]) -> Member:
        """Site ``name``'s spec made by ``change`` from the one it has when the change is made: read under the
        lock that orders the site's changes, so an update under way is not undone by a spec copied before it.
        KeyError: no such site."""
        async with self.site_lock(name):
            member = self.federation.get(name)
            if member is None:
                raise KeyError(name)
            return await self._update_site(change(member.spec))

    async def _update_site(self, spec: SiteSpec) -> Member:
        member = self.federation.get(spec.name)
        if member is None:
            raise KeyError(spec.name)
        check_supported(spec, self.hub)
        if not needs_rebuild(member.spec, spec):
            # The site takes the changed quotas first (a site that does not answer raises QuotaNotTaken and
            # nothing is stored: a spec refused must not come back at the next start), then the store.
            old = member.spec
            member = await self.federation.replace(spec)
            try:
                await self.store.put_site(spec)
            except BaseException:
                with contextlib.suppress(AdapterError):
                    await self.federation.replace(old)
                raise
            self.wake()
            return member
        async with self._site_leaving(spec.name, "its GPU inventory, adapter and fair-share policy can change only "
                                                 "when no jobs run there"):
            old = member.spec
            await self._stop_pump(spec.name)
            try:
                # An adapter that cannot start with the new spec raises, and the site keeps its old one.
                member = await self.federation.replace(spec)
                try:
                    await self.store.put_site(spec)
                except BaseException:
                    member = await self.federation.replace(old)
                    raise
            finally:
                self._start_pump(member)
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
            # Jobs cancelled while the site was still admitting them: their attempts are withdrawn through the
            # adapter that sent them (a dispatch is bounded by dispatch_timeout_s, its withdrawal by as much).
            left = await self.cycle.dispatches_to(name, 2 * self.settings.dispatch_timeout_s + 5)
            if left:
                raise SiteConflict(f"site {name} is still being sent {left} cancelled jobs; {what} (wait)")
            yield
        finally:
            self.federation.set_leaving(name, False)

    async def remove_site(self, name: str) -> None:
        async with self.site_lock(name):
            await self._remove_site(name)

    async def _remove_site(self, name: str) -> None:
        if name not in self.federation:
            raise KeyError(name)
        async with self._site_leaving(name, "a site can be removed only when none run there"):
            await self.store.delete_site(name)
            if self._quota_passes.pop(name, None) is not None:  # (a new site of its name starts afresh)
                await self._save_quota_passes()
            await self._stop_pump(name)
            await self.federation.remove(name)

    async def _stop_pump(self, name: str) -> None:
        task = self._pumps.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
