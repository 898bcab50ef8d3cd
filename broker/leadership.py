"""One leader among broker replicas, elected through the shared store, with a fencing token.

Every replica serves the API; only the leader runs the scheduling cycle, talks to the sites and changes
jobs. The leader holds a lease row in the store (``Store.acquire_leadership``) and renews it every third of
``lease_s``; the store bumps an *epoch* at every acquisition. The leader's store object is fenced with
its epoch (``Store.fence``), so each of its writes checks, in the same transaction, that the epoch is still
current: a leader that was paused or cut off past its lease and wakes up finds every write refused
(``Fenced``), never dispatches (a dispatch is written before the site is called) and steps down.

A replica that cannot renew for most of a lease steps down on its own before anyone else can take over;
the others try to acquire every third of a lease, so a dead leader is replaced within about
``lease_s × 4/3`` (the default 6 s lease gives under 10 s).

The holder's name is the URL its API is served at, then ``#`` and a token unique to the process, so two
replicas can never share one (``0.0.0.0:8080`` in every pod) and a restarted process is a new holder with a
new epoch. Followers send what only the leader may do to the URL part (``Leadership.leader_url``).

Site calls are not store writes, so the fence cannot stop them: before each one, the cycle and the
lifecycle ask :meth:`Leadership.certain`, which holds only while less than two thirds of a lease has passed
since the last renewal that succeeded was *sent*. A leader paused past that (the monotonic clock runs on
through ``SIGSTOP``) calls no site when it wakes; no other replica can have taken over before a whole lease
passed. A call already under way when the pause came can still arrive; sites that list what they hold
(agents over MQTT) have such a stray attempt cancelled by the next leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from broker.store import Store, StoreError

log = logging.getLogger(__name__)

SHUTTING_DOWN = "shutting down"
"""The reason a replica gives when it stops leading because it stops: it may let work on its way finish."""


class Leadership:
    def __init__(self, store: Store, url: str, lease_s: float,
                 elected: Callable[[int], Awaitable[None]], deposed: Callable[[str], Awaitable[None]]) -> None:
        self.store = store
        self.url = url
        self.holder = f"{url}#{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.epoch: int | None = None
        self._elected, self._deposed = elected, deposed
        self._renewed = 0.0  # monotonic time a successful acquire or renew was sent
        self.ready = False  # leading, and done taking over (the book is loaded, the sites joined)
        self._task: asyncio.Task[None] | None = None
        self._stepping: asyncio.Task[None] | None = None
        self._taking: asyncio.Task[None] | None = None  # the takeover under way
        self._quiet_until = 0.0  # monotonic: after a failed takeover, leave the lease to others until then
        self._lock = asyncio.Lock()

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    def certain(self) -> bool:
        """Whether this replica may call a site now: it leads, and its lease was renewed recently enough that
        no other replica can lead yet (see the module doc). False steps it down."""
        if self.epoch is None:
            return False
        if time.monotonic() - self._renewed < self.lease_s * 2 / 3:
            return True
        if self._task is not None and (self._stepping is None or self._stepping.done()):
            self._stepping = asyncio.get_running_loop().create_task(
                self.step_down("its lease may have run out (not renewed in time)"))
        return False

    async def leader_url(self) -> str | None:
        """Where the current leader serves its API (None: no leader now, or this replica)."""
        holder = await self.store.leader()
        if holder is None or holder == self.holder:
            return None
        return holder.split("#", 1)[0]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leadership")

    async def stop(self) -> None:
        if self._task is not None:
            # A step-down under way (a renewal that failed, in the task itself) runs to its end first: cancelled
            # inside it, the deposed broker would leave its sites, event pumps and MQTT connection open.
            async with self._lock:
                task, self._task = self._task, None  # (certain() starts no step-down of its own from now on)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._stepping is not None:  # one that certain() began
            await asyncio.gather(self._stepping, return_exceptions=True)
        if self.epoch is not None:
            epoch = self.epoch
            await self.step_down(SHUTTING_DOWN)
            with contextlib.suppress(StoreError, OSError, TimeoutError):
                await self.store.release_leadership(self.holder, epoch)  # the next replica need not wait

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("leadership: a round failed; trying again")
            await asyncio.sleep(self.lease_s / 3)

    async def _tick(self) -> None:
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self.lease_s / 3):
                if self.epoch is None:
                    if time.monotonic() < self._quiet_until:
                        return
                    epoch = await self.store.acquire_leadership(self.holder, self.lease_s)
                else:
                    epoch, ok = None, await self.store.renew_leadership(self.holder, self.epoch, self.lease_s)
        except (StoreError, OSError, TimeoutError) as e:
            if self.epoch is not None and time.monotonic() - self._renewed > self.lease_s * 2 / 3:
                await self.step_down(f"could not renew the lease for {time.monotonic() - self._renewed:.1f} s ({e})")
            return
        if self.epoch is None:
            if epoch is not None:
                self._renewed = sent
                await self._become_leader(epoch)  # not under the timeout: taking over may take a while
        elif ok:
            self._renewed = sent
        else:
            await self.step_down("another replica holds the lease now")

    async def _become_leader(self, epoch: int) -> None:
        """Lead from now: fence the store, then take over in a task of its own, so that the lease is renewed
        while the takeover (loading jobs, asking every site) takes as long as it takes."""
        async with self._lock:
            self.epoch = epoch
            self.store.fence(epoch)
            log.warning("leadership: this replica (%s) leads now, epoch %d", self.holder, epoch)
            self._taking = asyncio.get_running_loop().create_task(self._take_over(epoch), name="take-over")

    async def _take_over(self, epoch: int) -> None:
        try:
            await self._elected(epoch)
        except Exception as e:
            log.exception("leadership: taking over failed")
            await self.step_down(f"taking over failed: {e}")
            with contextlib.suppress(StoreError, OSError, TimeoutError):
                await self.store.release_leadership(self.holder, epoch)  # let another replica try
            self._quiet_until = time.monotonic() + self.lease_s  # and do not take it straight back
            return
        if self.epoch == epoch:
            self.ready = True

    async def step_down(self, why: str) -> None:
        """Stop leading now (idempotent). The store stays fenced with the old epoch: a write still on its
        way is refused."""
        async with self._lock:
            await self._step_down_locked(why)

    async def _step_down_locked(self, why: str) -> None:
        if self.epoch is None:
            return
        log.warning("leadership: stepping down from epoch %d: %s", self.epoch, why)
        self.epoch = None
        self.ready = False
        taking = self._taking
        if taking is not None and not taking.done() and taking is not asyncio.current_task():
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
        await self._deposed(why)
