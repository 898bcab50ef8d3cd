"""Preemption-victim choice for one site's quota ledger (``policies.quota.QuotaBook``): which preemptible jobs to
stop, and in what order, so that a job that does not fit as things stand can start.

Pure functions of the ledger's accounts and of ``now`` (POSIX seconds, passed in): no I/O, no clock. The book
calls :func:`search` from ``QuotaBook.admit``, keeps each account's candidates in order with :func:`enqueue`
and :func:`dequeue`, and reports :func:`removable` in ``QuotaBook.state``.

Preemption (when the job does not fit as things stand)
    Candidates are preemptible jobs on the job's GPU model that have run at least their minimum run time
    (the job's ``min_run_s``, else the policy's; for a reclaim, at most the policy's, so a job cannot hold
    another tenant's guarantee longer than the site allows by asking for a long ``min_run_s``), from:

    - reclaim: when the tenant would stay within its guarantee (``in_use + gpus <= guaranteed``), other
      tenants holding more than their guarantee, any priority; then, where the asker's quota counts the job's
      model M only, tenants whose quotas count any model, within their own guarantees (below);
    - priority: jobs of lower effective priority of the tenant itself, and of other tenants over their fair
      share (``policies.fairshare``, with the demand the caller passes, the asking job included).

    Another tenant is never pushed below its guarantee: of each, only jobs that fit in what it holds above its
    guarantee are taken (walking the order, a job that would cross the line is skipped). Order: effective
    priority ascending, checkpointable jobs first (each writes its checkpoint as it stops and loses little of
    its run; any other job loses all of it, so the newest loses least), start descending (newest first), job
    id; for a reclaim, the borrowers' jobs in that
    order before the tenant's own (of lower priority), since stopping its own would leave it no nearer its
    guarantee. The caller's ``fits(victim_ids)`` says
    whether the job fits once those are gone (its inventory knows nodes, fractions, topology); releasing more
    never hurts, so the shortest prefix is found by galloping then binary search (O(log n) calls). Of that
    prefix, each job the others can do without is then spared (one on another node than where the job fits, a
    small one taken before a large one that alone makes room), trying the last but one back to the first (one
    call each), so no job is stopped for nothing. Without one, the refusal says why the job waits ("site full;
    6 GPUs could be freed from preemptible jobs over their share, 8 needed"). A tenant over its limit may only preempt its own lower-priority jobs.

    The one exception, for a reclaim by a tenant whose quota counts the job's model M only: after the
    borrowed candidates, the candidates of the tenants whose quotas count any model are walked again in the
    same order (those not taken yet), and a job may take such a tenant below its guarantee, or further
    below, as long as, after it, what all those tenants lack of their guarantees (guarantee minus the GPUs of
    any model they hold) is at most the idle GPUs of the site's other models, each model's less what its own
    model quotas lack of their guarantees (``QuotaBook._elsewhere``). GPUs other tenants hold there, even
    borrowed, count for nothing. So such a tenant can hold its guarantee again at once on idle GPUs of the
    other models that no other model quota's guarantee needs (counted in GPUs: its jobs' shapes are the
    inventory's to fit); between tenants whose quotas both count any model, and at a one-model site, nothing
    changes.

Cost: a lazy merge of per-tenant candidate lists kept sorted at start/stop, plus O(log n) ``fits`` calls and
one per victim.
Units: GPUs (a fractional job counts its share), POSIX seconds. There is no switch: a job that fits never
searches, and a site with only non-preemptible work has no candidates.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from policies.fairshare import EPS

if TYPE_CHECKING:
    from policies.quota import _Account, _Job

Fits = Callable[[Sequence[str]], bool]


def _order(job: _Job) -> tuple[int, int, float, str]:
    """A candidate's place in victim order: lowest priority, checkpointable first, newest, job id."""
    return job.priority, 0 if job.checkpointable else 1, -job.start, job.job_id


def enqueue(queue: list[tuple[int, int, float, str, _Job]], job: _Job) -> None:
    """Add a preemptible job to its account's candidates, kept in victim order."""
    bisect.insort(queue, (*_order(job), job))


def dequeue(queue: list[tuple[int, int, float, str, _Job]], job: _Job) -> None:
    """Remove a preemptible job from its account's candidates."""
    i = bisect.bisect_left(queue, _order(job))
    del queue[i]


def search(acct: _Account, g: float, model: str, p: int, now: float, fits: Fits, reclaim: bool, over_limit: bool,
           accounts: Iterable[_Account], shares: Mapping[_Account, float] | None, reclaim_min_run_s: float,
           elsewhere: float = 0.0) -> tuple[tuple[str, ...] | None, float, float]:
    """Shortest prefix of the candidates after which the job fits, less the jobs of it the rest can do without
    (:func:`_spare`): (ids or None, own GPUs freed, GPUs freed).
    ``accounts``: every account of the book; ``shares``: fair shares (GPUs) with the asking job counted in,
    needed unless ``reclaim`` or ``over_limit``; ``reclaim_min_run_s``: the site policy's ``min_run_s``, the
    longest a reclaim spares a job; ``elsewhere``: for a reclaim of a guarantee for ``model``, the GPUs by which
    the tenants whose quotas count any model may together fall below their guarantees (``QuotaBook._elsewhere``:
    what the site's other models can hold for them); 0 for none."""
    mine = _stream(acct.queue, model, now, p) if acct.queue else iter(())
    streams = [] if reclaim else [mine]
    lenders = []
    if not over_limit:
        for o in accounts:
            if o is acct or not o.queue:
                continue
            if reclaim and elsewhere > EPS and _lends(o):
                lenders.append(_stream(o.queue, model, now, None, reclaim_min_run_s))
            if o.in_use <= o.guaranteed + EPS:
                continue
            if reclaim:
                streams.append(_stream(o.queue, model, now, None, reclaim_min_run_s))
            elif o.in_use > shares[o] + EPS:
                streams.append(_stream(o.queue, model, now, p))
    # borrowed GPUs first (a reclaim takes them before the tenant's own jobs of lower priority, which it would
    # otherwise stop to hold no more than before); then, in the same order, what the lenders can hold elsewhere
    merged = itertools.chain(heapq.merge(*streams), mine) if reclaim else heapq.merge(*streams)
    taken = _capped(acct, merged, heapq.merge(*lenders), elsewhere)
    ids: list[str] = []
    jobs: list[_Job] = []
    own = [0.0]
    freed = [0.0]

    def grow(n: int) -> bool:
        while len(ids) < n:
            job = next(taken, None)
            if job is None:
                return False
            ids.append(job.job_id)
            jobs.append(job)
            own.append(own[-1] + (job.gpus if job.account is acct else 0.0))
            freed.append(freed[-1] + job.gpus)
        return True

    def ok(n: int) -> bool:
        return acct.in_use - own[n] + g <= acct.limit + EPS and fits(tuple(ids[:n]))

    lo, n, hi = 0, 1, None  # ok(lo) is known false: the job did not fit as things stand
    while True:
        if not grow(n):
            n = len(ids)
            if n > lo and ok(n):
                hi = n
            break
        if ok(n):
            hi = n
            break
        lo, n = n, 2 * n
    if hi is None:
        return None, own[-1], freed[-1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return _spare(acct, g, fits, jobs[:hi])


def _spare(acct: _Account, g: float, fits: Fits, victims: list[_Job]) -> tuple[tuple[str, ...], float, float]:
    """The prefix ``victims`` less each job the others can do without (a job on another node than the one the
    new job gets, a small one taken before the large one that alone makes room), tried from the last but one
    back to the first, so the most protected of them are spared first (Kueue's fill-back). The last one stays:
    the prefix without it did not fit. Taking fewer never pushes anyone further below a guarantee. One ``fits``
    call per victim."""
    kept = list(victims)
    for j in range(len(kept) - 2, -1, -1):
        trial = kept[:j] + kept[j + 1:]
        own = sum(v.gpus for v in trial if v.account is acct)
        if acct.in_use - own + g <= acct.limit + EPS and fits(tuple(v.job_id for v in trial)):
            kept = trial
    return (tuple(v.job_id for v in kept), sum(v.gpus for v in kept if v.account is acct),
            sum(v.gpus for v in kept))


def removable(accounts: Iterable[_Account], now: float, reclaim_min_run_s: float
              ) -> tuple[dict[tuple[_Account, str], float], dict[str, float]]:
    """For reports: GPUs each account could lose to a reclaim now without falling below its guarantee, per
    model; and per model, the GPUs of the rest of the candidates of the tenants whose quotas count any model
    (what a guarantee for that model may also take, as far as ``elsewhere`` in :func:`search` allows; the book
    caps it). ``reclaim_min_run_s`` as in :func:`search`."""
    out: dict[tuple[_Account, str], float] = {}
    lend: dict[str, float] = {}
    for o in accounts:
        room = o.in_use - o.guaranteed
        lends = _lends(o)
        for *_, job in o.queue:
            if room <= EPS and not lends:
                break
            if now - job.start < min(job.min_run_s, reclaim_min_run_s):
                continue
            if job.gpus <= room + EPS:
                room -= job.gpus
                out[(o, job.model)] = out.get((o, job.model), 0.0) + job.gpus
            elif lends:
                lend[job.model] = lend.get(job.model, 0.0) + job.gpus
    return out, lend


def _stream(queue: list[tuple[int, int, float, str, _Job]], model: str, now: float, below: int | None,
            min_run_cap_s: float = float("inf")) -> Iterator[tuple[int, int, float, str, _Job]]:
    for item in queue:
        if below is not None and item[0] >= below:
            return
        job = item[4]
        if job.model == model and now - job.start >= min(job.min_run_s, min_run_cap_s):
            yield item


def _lends(o: _Account) -> bool:
    """Whether a reclaim of a model's guarantee may take ``o`` below its own: a tenant whose quota counts any
    model, as far as the site's other models can hold its guarantee (``elsewhere`` in :func:`search`)."""
    return o.listed and o.pool is None


def _capped(acct: _Account, merged: Iterator[tuple[int, int, float, str, _Job]],
            lenders: Iterator[tuple[int, int, float, str, _Job]], elsewhere: float) -> Iterator[_Job]:
    """Candidates in order, skipping any that would push another tenant below its guarantee; then the
    ``lenders``' candidates (tenants whose quotas count any model; those not taken already), in order, skipping
    any that would push one further below its guarantee than the ``elsewhere`` left (shared by all of them)."""
    left: dict[_Account, float] = {}
    taken: set[str] = set()
    for spare, items in ((0.0, merged), (elsewhere, lenders)):
        for *_, job in items:
            if job.job_id in taken:
                continue
            o = job.account
            if o is not acct:
                room = left.get(o, o.in_use - o.guaranteed)
                below = job.gpus - max(0.0, room)  # how much further below its guarantee taking it leaves o
                if below > spare + EPS:
                    left[o] = room
                    continue
                spare -= max(0.0, below)
                left[o] = room - job.gpus
            taken.add(job.job_id)
            yield job
