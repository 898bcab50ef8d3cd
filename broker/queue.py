"""The queue, indexed so that a scheduling pass costs what it places, not what waits.

Queued jobs are grouped by everything placement reads of them (``policies.snapshot.JobRequest.shape``
without the sites that refused the job, its tenant, priority, profile, whether it is preemptible,
whether it has a deadline and whether it may be deferred). Within a pass capacity only shrinks, so once
one job of a group finds no site, the rest of the group finds none either: :class:`QueueWalk` then drops
the whole group for the pass (``fail_group``) instead of deciding each of its jobs. A pass over a million
queued jobs of a few dozen shapes that cannot run costs a few dozen decisions.

Order: each group holds its jobs sorted by ``order(job)`` (oldest first, or by urgency when some profile
defers jobs; the job id breaks ties), and a walk merges the groups' heads: higher priority first, then,
where the sites report fair shares, the tenant with the least held per entitled GPU (``policies.fair_order``,
re-ranked lazily as the walk places jobs), then the group order. That is the order the cycle always used;
only the jobs of groups that failed are no longer visited.

Each queued job costs the index one entry in a ``sortedcontainers.SortedList`` (insert and remove in
O(log n)) and one in a dict from id to (group, entry).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sortedcontainers import SortedList

from broker.models import Job
from policies.fair_order import Standing, rank
from policies.snapshot import JobRequest

Entry = tuple[Any, ...]
"""``(*order(job), job id)``: a job's place within its group."""


def group_key(job: Job) -> tuple[Any, ...]:
    """What placement reads of a queued job, apart from the sites that refused it (priority first: the walk
    orders groups by it)."""
    spec = job.spec
    shape = JobRequest.from_spec(job.id, spec).shape
    return (spec.priority, spec.tenant, spec.profile, spec.preemptible, spec.deadline is not None, spec.deferrable,
            shape)


def by_age(job: Job) -> tuple[Any, ...]:
    return (job.created_at.timestamp(),)


class QueueIndex:
    """The queued jobs by group, each group in ``order``."""

    __slots__ = ("groups", "_where", "_order", "_keys")

    def __init__(self, order: Callable[[Job], tuple[Any, ...]] = by_age) -> None:
        self.groups: dict[tuple[Any, ...], SortedList] = {}
        self._where: dict[str, tuple[tuple[Any, ...], Entry]] = {}
        self._order = order
        self._keys: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # one shared key object per group

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def add(self, job: Job) -> None:
        if job.id in self._where:
            self.discard(job.id)
        key = group_key(job)
        key = self._keys.setdefault(key, key)
        entry = (*self._order(job), job.id)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = SortedList()
        group.add(entry)
        self._where[job.id] = (key, entry)

    def discard(self, job_id: str) -> None:
        found = self._where.pop(job_id, None)
        if found is None:
            return
        key, entry = found
        group = self.groups[key]
        group.remove(entry)
        if not group:
            del self.groups[key]
            del self._keys[key]

    def clear(self) -> None:
        self.groups.clear()
        self._where.clear()
        self._keys.clear()

    def position(self, job_id: str) -> tuple[tuple[Any, ...], Entry] | None:
        """(group, entry) of a queued job; None if it is not queued."""
        return self._where.get(job_id)

    def reorder(self, order: Callable[[Job], tuple[Any, ...]], jobs: Callable[[str], Job | None]) -> None:
        """Sort every group by ``order`` from now on (``jobs`` reads a queued job by id)."""
        self._order = order
        queued = [j for j in map(jobs, list(self._where)) if j is not None]
        self.clear()
        for job in queued:
            self.add(job)

    def ids(self) -> Iterator[str]:
        """Every queued job's id, in no particular order."""
        return iter(self._where)

    def place_of(self, job: Job) -> tuple[tuple[Any, ...], Entry]:
        """(group, entry) ``job`` would have were it queued now; it is not added (a preview's job)."""
        return group_key(job), (*self._order(job), job.id)

    def walk(self, standing: Mapping[str, Standing] | None = None,
             extra: Sequence[tuple[tuple[Any, ...], Entry]] = ()) -> QueueWalk:
        return QueueWalk(self, standing, extra)


class QueueWalk:
    """One pass's walk over the queue, in scheduling order. After each job it yields, the caller may say
    ``placed(tenant, gpus)`` (fair order moves that tenant back) or ``fail_group()`` (the job found no site
    and neither will the rest of its group in this pass). Jobs added to a group behind the walk's position
    in it during the pass are left to the next pass (the cycle decides new jobs on their own anyway).

    ``extra``: the places (``QueueIndex.place_of``) of jobs not in the queue (a preview's), each yielded at the
    turn it would have were it queued, as a group of its own (a failure drops no other): a queued job level with
    it in every term of the order was queued first, and goes first; extras level with each other go in the order
    given, as jobs submitted one after another would. ``only_extra()`` passes over the rest of the queue."""

    def __init__(self, index: QueueIndex, standing: Mapping[str, Standing] | None,
                 extra: Sequence[tuple[tuple[Any, ...], Entry]] = ()) -> None:
        self._index = index
        self._fair = standing is not None
        self._standing = standing or {}
        self._held = {t: s.held for t, s in self._standing.items()}
        self._cursor: dict[tuple[Any, ...], Entry] = {}
        self._current: tuple[Any, ...] | None = None
        # each extra's group: its own key (a queued group's, with its place in ``extra``) and its one entry
        self._extra = {(*key, _Extra(n)): entry for n, (key, entry) in enumerate(extra, start=1)}
        self._heap: list[tuple[Any, ...]] = []
        for key, group in index.groups.items():
            self._heap.append(self._rank(key, group[0]))
        for key, entry in self._extra.items():
            self._heap.append(self._rank(key, entry))
        heapq.heapify(self._heap)
        self.visited = 0  # jobs yielded
        self.groups_failed = 0

    def _rank(self, key: tuple[Any, ...], entry: Entry) -> tuple[Any, ...]:
        fair = rank(self._standing, self._held, key[1]) if self._fair else (False, 0.0)
        extra = key[-1] if type(key[-1]) is _Extra else 0  # level in the order: queued jobs first
        return (-key[0], *fair, entry[:-1], extra, entry[-1], key)

    def _next_entry(self, key: tuple[Any, ...]) -> Entry | None:
        if type(key[-1]) is _Extra:
            return None if key in self._cursor else self._extra[key]
        group = self._index.groups.get(key)
        if not group:
            return None
        cursor = self._cursor.get(key)
        i = 0 if cursor is None else group.bisect_right(cursor)
        return group[i] if i < len(group) else None

    def placed(self, tenant: str, gpus: float) -> None:
        self._held[tenant] = self._held.get(tenant, 0.0) + gpus

    def fail_group(self) -> None:
        """The last job's group finds no site for the rest of this pass."""
        if self._current is not None:
            if type(self._current[-1]) is not _Extra:  # (an extra's group is done once yielded)
                self._cursor.pop(self._current, None)
            self._current = None
            self.groups_failed += 1

    def only_extra(self) -> None:
        """Yield only the extras not yet yielded from now on, at their turns among themselves."""
        self._current = None  # (an extra's group is done once yielded)
        self._heap = [ranked for ranked in self._heap if type(ranked[-1][-1]) is _Extra]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[str]:
        while True:
            heap = self._heap
            if self._current is not None:  # the last job's group goes on from after it
                entry = self._next_entry(self._current)
                if entry is not None:
                    heapq.heappush(heap, self._rank(self._current, entry))
                self._current = None
            if not heap:
                return
            ranked = heapq.heappop(heap)
            key = ranked[-1]
            entry = self._next_entry(key)
            if entry is None:
                continue  # emptied meanwhile
            now = self._rank(key, entry)
            if now > ranked:  # its tenant was placed since, or its head left: take its turn when it comes
                heapq.heappush(heap, now)
                continue
            self._cursor[key] = entry
            self._current = key
            self.visited += 1
            yield entry[-1]


class _Extra(int):
    """The place of a job not queued in a walk's ``extra`` (from 1), which ends its group's key."""

    __slots__ = ()
