"""Injected clocks: the live broker runs on ``SystemClock``; tests and the simulator on ``ManualClock``.

Nothing outside this module reads the wall clock. Policies never read a clock at all: the snapshot they
receive carries ``now``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall-clock time in UTC; sleeps on the event loop."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told: ``advance(seconds)`` wakes every sleeper whose time has come,
    in time order, letting each run before moving on, so event order is deterministic."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2022, 1, 1, tzinfo=UTC)
        if self._now.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start time")
        self._sleepers: list[tuple[datetime, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> datetime:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + timedelta(seconds=seconds), next(self._seq), fut))
        await fut

    def next_wakeup(self) -> datetime | None:
        """When the earliest sleeper is due (None when nobody sleeps): where a simulation jumps next."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)  # cancelled sleepers
        return self._sleepers[0][0] if self._sleepers else None

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking sleepers in order and yielding to them."""
        target = self._now + timedelta(seconds=seconds)
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            when, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, when)
            if not fut.done():
                fut.set_result(None)
            await _settle()
        self._now = target
        await _settle()


async def _settle(rounds: int = 20) -> None:
    """Let ready tasks run: a few trips round the event loop."""
    for _ in range(rounds):
        await asyncio.sleep(0)
