"""Live events: what the broker does, as it does it, for ``GET /v1/events`` (server-sent events) and
``heliotrope watch``.

Types (``Event.type``) and their ``data``:

- ``transition``: a job changed state, once its change is in the store: ``job_id, tenant, site, state,
  previous, attempt, reason, at``. A job's transitions are published in the order they were stored, starting
  with ``queued`` when the broker takes it in.
- ``decision``: the cycle placed a job, or found no site for it (published only when that answer changed):
  ``job_id, tenant, attempt, outcome (placed | unplaceable), site, model, summary, at``.
- ``deferral``: the cycle held a flexible job for a cleaner or cheaper window: ``..., site, deferred_until``.
- ``preemption``: a site preempted an attempt: ``job_id, tenant, site, attempt, reason, at``.
- ``site``: a site's health changed, or it joined or left: ``site, health, previous, reason, at``.

Each event gets an increasing integer id. Ids start from the broker's start time in microseconds, so they
keep increasing across restarts and a client that reconnects with ``Last-Event-ID`` is sent what it missed
from the last :data:`KEEP` events held in memory (a ``gap`` event says when some are no longer held).

A subscriber that falls :data:`QUEUE` events behind is cut off with a ``lost`` event (its position), so a
stalled client never holds the broker's memory; it reconnects from there. Events live in the leader's
memory only: a replica that does not lead relays the leader's stream (``broker.api``), and a leader that
steps down ends its streams, so clients reconnect to whoever leads next.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KEEP = 10_000
"""Events held for replay to clients that reconnect."""

QUEUE = 5_000
"""Events a subscriber may fall behind before it is cut off."""

TYPES = ("transition", "decision", "deferral", "preemption", "site")


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    type: str
    data: dict[str, Any]
    tenant: str | None = None
    site: str | None = None
    job_id: str | None = None


Visible = Callable[[Event], bool]


class Subscription:
    """One client's view: the events it may see and asked for, in order."""

    def __init__(self, hub: EventHub, wants: Visible) -> None:
        self._hub = hub
        self.wants = wants
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.lost = False

    def offer(self, event: Event) -> None:
        if self.lost or not self.wants(event):
            return
        if self.queue.qsize() >= QUEUE:
            self.lost = True  # cut off: the stream ends with a 'lost' event at the last one delivered
            self.queue.put_nowait(Event(-1, "lost", {}))
            return
        self.queue.put_nowait(event)

    def close(self) -> None:
        self._hub.subscribers.discard(self)


class EventHub:
    def __init__(self, keep: int = KEEP) -> None:
        self.recent: deque[Event] = deque(maxlen=keep)
        self.subscribers: set[Subscription] = set()
        self._next = int(time.time() * 1_000_000)
        self._start = self._next  # ids below it were handed out before this hub (another replica, a restart)
        self._dropped: int | None = None  # the newest id no longer held
        self.published = 0

    @property
    def last_id(self) -> int:
        return self._next - 1

    def publish(self, type_: str, data: dict[str, Any], *, tenant: str | None = None, site: str | None = None,
                job_id: str | None = None) -> Event:
        # Ids follow the clock (microseconds) when it is ahead, so a replica that takes over later never
        # hands out ids below those its predecessor did.
        self._next = max(self._next, time.time_ns() // 1000)
        event = Event(self._next, type_, data, tenant, site, job_id)
        self._next += 1
        self.published += 1
        if len(self.recent) == self.recent.maxlen:
            self._dropped = self.recent[0].id
        self.recent.append(event)
        for sub in tuple(self.subscribers):
            sub.offer(event)
        return event

    def end_streams(self) -> None:
        """End every subscription (the server is stopping): each stream closes after what it was sent."""
        for sub in tuple(self.subscribers):
            sub.queue.put_nowait(Event(-1, "end", {}))
        self.subscribers.clear()

    def subscribe(self, wants: Visible, after: int | None = None) -> tuple[Subscription, list[Event], bool]:
        """A new subscription, the held events after id ``after`` that it wants (a reconnecting client's
        ``Last-Event-ID``), and whether some events after ``after`` are no longer held."""
        sub = Subscription(self, wants)
        replay: list[Event] = []
        gap = False
        if after is not None:
            # Some events after ``after`` are gone where this hub dropped one, or where ``after`` is an id
            # handed out before it (they may have had more); ``after`` 0 asks for all that is held. Ids follow
            # the clock, so a jump between held ids is no gap.
            gap = bool(self.recent) and after < self.last_id and (
                (self._dropped is not None and after < self._dropped) or 0 < after < self._start)
            replay = [e for e in self.recent if e.id > after and wants(e)]
        self.subscribers.add(sub)
        return sub, replay, gap

    def follow(self, wants: Visible, after: int | None = None, heartbeat_s: float = 15.0) -> Following:
        """Subscribe now; iterate the result for the events as they come (see :class:`Following`) and close
        it when done."""
        sub, replay, gap = self.subscribe(wants, after)
        return Following(sub, replay, self.recent[0].id if gap else None, heartbeat_s)


class Following:
    """A subscription read as an async iterator: a ``gap`` event first if some events after ``after`` are
    no longer held, the held events it missed, then each new one (``None`` every ``heartbeat_s`` without one,
    for a keepalive). It ends after a ``lost`` event, or when the streams are ended; ``close`` unsubscribes
    (also done when the iteration ends)."""

    def __init__(self, sub: Subscription, replay: list[Event], oldest: int | None, heartbeat_s: float) -> None:
        self._sub = sub
        self._heartbeat_s = heartbeat_s
        self._pending: deque[Event] = deque(replay)
        if oldest is not None:
            self._pending.appendleft(Event(oldest - 1, "gap", {"oldest_held": oldest}))
        self._done = False

    def __aiter__(self) -> Following:
        return self

    async def __anext__(self) -> Event | None:
        if self._done:
            raise StopAsyncIteration
        if self._pending:
            return self._pending.popleft()
        try:
            event = await asyncio.wait_for(self._sub.queue.get(), self._heartbeat_s)
        except TimeoutError:
            return None
        if event.type == "end":
            self.close()
            raise StopAsyncIteration
        if event.type == "lost":
            self.close()
        return event

    def close(self) -> None:
        self._done = True
        self._sub.close()


def frame(event: Event, last_id: int | None = None) -> bytes:
    """``event`` as a server-sent-events frame (``lost`` carries the id to resume from)."""
    if event.type == "lost":
        data = json.dumps({"resume_after": last_id, "why": "this client fell too far behind; reconnect with "
                                                           "Last-Event-ID to resume"})
        return f"event: lost\ndata: {data}\n\n".encode()
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.data, default=str)}\n\n".encode()
