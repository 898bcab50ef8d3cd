"""Federation-wide tenant limits changed live, as a platform team edits a Kueue ClusterQueue's quota: the limits a
broker enforces are the configuration's (``broker.tenant_limits``, ``broker.default_tenant_limit``) with the
overrides set through the API (``PUT /v1/tenants/{tenant}/limit``, in GPUs; null: unlimited), which stand over
the configuration until deleted (``DELETE``). Kept in the store (table ``tenant_limits``), so they outlive restarts
and every replica sharing the store sees them; written by the leader alone (fenced, as the sites).

The broker in charge loads them when it takes charge and holds them in memory from then on (it is their only
writer). A replica that does not lead checks the submissions it takes itself: it reads them from the store at most
every ``CACHE_S`` seconds, so a change made on the leader is enforced there within that. Turn the feature off by
setting no override: the configuration's limits alone apply, as before."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from broker.clock import Clock
from broker.store import LimitOverride, Store, StoreError
from policies.tenant_limit import TenantLimits

log = logging.getLogger(__name__)

CACHE_S = 3.0
"""Seconds a replica that does not lead trusts the overrides it last read from the store (its submission check's
view of a limit changed on the leader lags by at most this much, plus a read)."""


class LiveTenantLimits:
    """The configuration's tenant limits (``config``) with the overrides of ``store``, as one broker knows them."""

    def __init__(self, config: TenantLimits, store: Store, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.overrides: dict[str, LimitOverride] = {}
        self.current = config  # the configuration's with ``overrides``
        self._read_at = -math.inf  # time.monotonic() of the last read from the store (a replica that does not lead)
        self._lock = asyncio.Lock()  # one change at a time: the store's order is memory's
        # Bumped by every load and change: a follower's read from the store that was under way meanwhile (this
        # replica taking charge, then changing a limit, before the read came back) is older, and is not held.
        self._gen = 0

    def _hold(self, overrides: dict[str, LimitOverride], changed: bool = True) -> TenantLimits:
        if changed:
            self._gen += 1
        self.overrides = overrides
        self.current = self.config.with_overrides({t: o.gpus for t, o in sorted(overrides.items())})
        return self.current

    async def load(self) -> TenantLimits:
        """Read the overrides from the store (a broker taking charge: from then on, it is their only writer)."""
        overrides = {o.tenant: o for o in await self.store.list_tenant_limits()}
        self._read_at = time.monotonic()
        if overrides:
            log.info("tenant limits set through the API stand over the configuration's: %s", ", ".join(
                f"{t} {'unlimited' if o.gpus is None else f'{o.gpus:g} GPUs'}" for t, o in sorted(overrides.items())))
        return self._hold(overrides)

    async def refreshed(self) -> TenantLimits:
        """The limits, the overrides read again from the store if the last read is ``CACHE_S`` old (a replica that
        does not lead). A store that does not answer leaves the last ones read in force, with a warning: the
        leader's cycle enforces the limits whatever a replica's submission check saw."""
        if time.monotonic() - self._read_at < CACHE_S:
            return self.current
        self._read_at = time.monotonic()  # (submissions meanwhile use the last ones read, not a read each)
        gen = self._gen
        try:
            overrides = {o.tenant: o for o in await self.store.list_tenant_limits()}
        except StoreError as e:
            log.warning("could not read the tenant limits set through the API (%s); submissions are checked "
                        "against those read before", e)
            return self.current
        if gen != self._gen:  # loaded or changed here meanwhile (this replica took charge): those are newer
            return self.current
        return self._hold(overrides, changed=False)

    def forget(self) -> None:
        """This broker no longer leads: read the overrides again at the next use (another replica changes them)."""
        self._read_at = -math.inf

    async def put(self, tenant: str, gpus: float | None) -> TenantLimits:
        """Store ``tenant``'s override (GPUs; None: unlimited), then hold it; the limits now in force."""
        if gpus is not None:
            gpus += 0.0  # (-0.0, which ``ge=0`` lets through, as 0)
        async with self._lock:
            override = LimitOverride(tenant, gpus, self.clock.now())
            await self.store.put_tenant_limit(override)
            return self._hold({**self.overrides, tenant: override})

    async def reset(self, tenant: str) -> TenantLimits | None:
        """Remove ``tenant``'s override (back to the configuration's limit); the limits now in force, or None if it
        had none. One the store holds that memory does not (a write whose answer was lost, though it landed) is
        deleted too: the next broker in charge would load it again otherwise."""
        async with self._lock:
            if tenant not in self.overrides and all(o.tenant != tenant for o in await self.store.list_tenant_limits()):
                return None
            await self.store.delete_tenant_limit(tenant)
            return self._hold({t: o for t, o in self.overrides.items() if t != tenant})
