"""What happens to a job after dispatch: site events, cancellation, and recovery after a restart.

- ``running``, ``succeeded``: recorded as they come; a success also tells ``run_times`` how long the job ran
  against its estimate (:mod:`policies.runtime_risk`), seeded at start-up from the store (``learn_run_times``).
- ``failed``: the job is requeued while it has failed attempts left (``max_attempts``), else it fails.
- ``preempted``: recorded, then the job is requeued; a checkpointable job keeps its progress (``run_s``).
- ``lost``: the site no longer has the attempt; the job is requeued (a loss is not the job's failure). One lost
  before it ran (the site admitted it but could not start it: a Kubernetes Pod its scheduler found no room for)
  also has the site skipped for the job for ``refusal_ttl_s``, as a refusal at dispatch would. Losses are
  bounded apart from failures: at its ``max_lost_attempts``-th loss (the spec's, else the broker's; 0: no
  bound) the job fails, its reason naming the losses and their sites, rather than loop for ever (a job that
  brings its node down, or is evicted wherever it runs). So are the attempts a site no longer knows after a
  restart, or left on a site no longer registered. Preemptions, moves and refusals at dispatch do not count.
  The losses are counted from the job's stored transitions (:mod:`broker.losses`), so the count holds across
  restarts and takeovers, and takes in those stored by earlier releases.
Events for an attempt that is no longer current are ignored, so a late or repeated event never moves a
job twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from adapters.base import AttemptLookup, EventKind, EventReceipts, HeldAttempts, JobEvent
from broker.federation import Federation, Member
from broker.jobs import JobBook, JobNotFound
from broker.losses import lost_attempts, lost_reason, losses_told
from broker.metrics import Metrics
from broker.models import IllegalTransition, Job, JobState
from broker.store import JobFilter, Store, StoreError
from policies import runtime_risk
from policies.runtime_risk import RunTimeErrors

log = logging.getLogger(__name__)

LEARN_FROM = 5 * runtime_risk.KEEP
"""Successes read at start-up to find the latest to finish: the store lists jobs by submission, and a long job
submitted before thousands of short ones may be among the last to finish."""

STRANDED_SWEEP_S = 10.0
"""How often ``find_stranded`` looks for dispatching jobs that no dispatch is sending (monotonic seconds)."""


def actual_run_s(job: Job) -> float:
    """How long a succeeded job ran: what its attempts reported (``run_s``), or, when more, the time from its
    last attempt's start to its end. An adapter that re-adopted a running job after a broker restart reports
    only what it saw since, while ``started_at`` and ``finished_at`` are stored as the site reported them."""
    if job.started_at is not None and job.finished_at is not None:
        return max(job.run_s, (job.finished_at - job.started_at).total_seconds())
    return job.run_s

R, D, A = JobState.RUNNING, JobState.DISPATCHING, JobState.ADMITTED
ON_SITE = (D, A, R)


class Lifecycle:
    def __init__(
        self, book: JobBook, federation: Federation, cancel_timeout_s: float = 10.0, max_backoff_s: float = 60.0,
        max_lost_attempts: int | None = None,
    ) -> None:
        self.book = book
        self.federation = federation
        # Lost attempts a job is allowed where its spec does not say (BrokerSettings.max_lost_attempts; 0 or
        # None: no bound).
        self.max_lost_attempts = max_lost_attempts
        self.cancel_timeout_s = cancel_timeout_s
        self.pending_sites: dict[str, dict[str, int]] = {}  # site -> its jobs at start-up, to reconcile
        self._withdrawals: dict[tuple[str, int], str] = {}  # (job id, attempt) -> site yet to confirm
        self._requeues: dict[tuple[str, int], tuple[str, str]] = {}  # requeues to retry: -> (site, why)
        self._backoff: dict[str, tuple[float, float]] = {}  # site -> (next try, monotonic s; last delay s)
        self.max_backoff_s = max_backoff_s
        self.may_act: Callable[[], bool] = lambda: True  # among replicas: whether this one surely still leads
        self.metrics = Metrics()  # the broker passes its own
        # How finished jobs' run times compared with their estimates (every snapshot of the time-shift plan
        # carries it; policies.runtime_risk prices a deferral's risk to the deadline from it).
        self.run_times = RunTimeErrors(runtime_risk.KEEP)
        # Seconds a job's attempt resumed from a checkpoint spends restarting before it adds work: its
        # profile's move overhead (the broker sets this from its cycle; 0: none counted).
        self.restart_overhead_s: Callable[[Job], float] = lambda job: 0.0
        # When and why a site was asked to checkpoint and stop an attempt to move it (job id, attempt, site ->
        # (POSIX seconds, reason), or None), by this broker or the last one in charge: the broker sets this
        # from its cycle's moves in flight.
        self.stop_asked: Callable[[str, int, str], tuple[float, str] | None] = lambda job_id, attempt, site: None
        # Told of each attempt that ended otherwise than stopped (it succeeded, failed, was lost or withdrawn): a
        # move that was asking its site to stop it is over, with nothing checkpointed to restart elsewhere (the
        # broker sets this from its cycle's moves in flight).
        self.ended_unstopped: Callable[[str, int], None] = lambda job_id, attempt: None
        # Told of an attempt its site's report showed admitted (its report of it running or done overtook the
        # answer to its dispatch, or came after a restart cut the dispatch off), once that admission is stored:
        # the carbon ledger counts it (the cycle sets this).
        self.admitted_by_report: Callable[[Job], None] = lambda job: None
        # (job id, attempt) -> when the attempt left its site, where that is known to be earlier than the change
        # that records it: the time of a site's report of it stopped, lost or failed (which may come long after,
        # sent again until a broker takes it), or, for an attempt its site forgot while no broker was in charge,
        # ``unheard_since``. Read (and removed) by the carbon ledger as the change lands (JobBook.on_attempt_end).
        self.left_at: dict[tuple[str, int], datetime] = {}
        # When this broker took charge: the last time the broker then in charge knew the attempts on their sites
        # (when it last saved the carbon ledger; None: not known). An attempt a site no longer knows at start-up
        # (``recover``) ended after that, unheard; nothing says when, so it is taken as ended then.
        self.unheard_since: datetime | None = None
        # Set once the active jobs are loaded (the broker in charge): events wait for it, since one applied to a
        # book that does not hold its job yet would be dropped as stale.
        self.loaded = asyncio.Event()
        # Whether the cycle is sending attempt (job id, attempt) to its site now: the broker sets this from its cycle.
        # None: not known, and ``find_stranded`` takes no job for stranded.
        self.dispatching_now: Callable[[str, int], bool] | None = None
        # How long a job may be held as dispatching with nothing sending it before its site is asked whether it
        # holds the attempt: two dispatch timeouts and a withdrawal's (the broker gives its dispatch timeout as
        # ``cancel_timeout_s``).
        self.stranded_after_s = 3 * cancel_timeout_s
        self._stranded_since: dict[tuple[str, int], float] = {}  # -> monotonic time first seen so
        self._stranded: set[tuple[str, int]] = set()  # handed to the site's reconciliation (for its reason)
        self._swept_at = -float("inf")

    async def pump(self, member: Member) -> None:
        """Follow one site's event stream until the site is removed. An event whose write fails is retried
        with backoff until the store takes it: a site's report is never dropped."""
        site = member.spec.name
        await self.loaded.wait()
        async for event in member.adapter.events():
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(StoreError),
                    wait=wait_exponential(multiplier=0.1, max=5.0),
                    before_sleep=lambda rs, ev=event: log.warning(
                        "site %s: storing event %s failed (%s); retrying", site, ev, rs.outcome.exception()
                    ),
                ):
                    with attempt:
                        await self.on_event(site, event)
            except Exception:
                log.exception("site %s: could not apply event %s", site, event)
                continue
            if isinstance(member.adapter, EventReceipts):
                member.adapter.taken(event)

    async def on_event(self, site: str, ev: JobEvent) -> Job | None:
        job = self.book.active.get(ev.job_id)
        if job is None or job.site != site or job.attempt != ev.attempt:
            return None  # stale, repeated or for an attempt we withdrew
        if job.state == JobState.PREEMPTED and ev.kind == EventKind.PREEMPTED:
            # A retry of a preemption whose requeue did not reach the store the first time.
            return await self.book.transition(job.id, JobState.QUEUED, reason="requeued after preemption")
        if job.state not in ON_SITE:
            return None
        if job.state == D and ev.kind != EventKind.LOST:
            # The site's event overtook its answer to the dispatch: the event itself shows admission.
            job = await self.book.transition(job.id, A, reason=f"admitted by {site}")
            self.admitted_by_report(job)
            if not self._unmoved(job):
                # While the admission was stored, another task moved the job on (cancelled it, or requeued the
                # attempt, which a pass may have placed again): the rest of the event is of an attempt that is no
                # longer the job's, and must not move it a second time.
                return None
        if ev.kind in (EventKind.FAILED, EventKind.PREEMPTED, EventKind.LOST):
            self.left_at[(job.id, job.attempt)] = ev.at  # (its change is stored at the broker's time of it)
        match ev.kind:
            case EventKind.RUNNING:
                if job.state == R:
                    return None
                return await self.book.transition(job.id, R, reason=f"running on {site}", started_at=ev.at)
            case EventKind.SUCCEEDED:
                done = await self.book.transition(
                    job.id, JobState.SUCCEEDED, reason=f"succeeded on {site}", run_s=job.run_s + ev.run_s,
                    finished_at=ev.at,
                )
                self.run_times.add(job.spec.duration_s, actual_run_s(done))
                self.ended_unstopped(job.id, job.attempt)
                return done
            case EventKind.FAILED:
                failed = job.failed_attempts + 1
                why = ev.reason or "failed"
                if failed >= job.spec.max_attempts:
                    ended = await self.book.transition(
                        job.id, JobState.FAILED, failed_attempts=failed, finished_at=ev.at,
                        reason=f"attempt {job.attempt} on {site} failed ({why}); {failed} of "
                               f"{job.spec.max_attempts} attempts failed, giving up",
                    )
                else:
                    ended = await self.book.transition(
                        job.id, JobState.QUEUED, failed_attempts=failed,
                        reason=f"attempt {job.attempt} on {site} failed ({why}); requeued "
                               f"({failed} of {job.spec.max_attempts} attempts failed)",
                    )
                self.ended_unstopped(job.id, job.attempt)
                return ended
            case EventKind.PREEMPTED:
                kept = job.run_s + ev.run_s if job.spec.checkpointable else 0.0
                # Where this attempt resumed from a checkpoint (earlier ones kept some work), its run began
                # with a restart: up to the profile's overhead of it added no work.
                restart_s = (job.restart_s + (min(ev.run_s, self.restart_overhead_s(job)) if job.run_s > 0 else 0.0)
                             if kept else 0.0)
                await self.book.transition(
                    job.id, JobState.PREEMPTED, run_s=kept, restart_s=restart_s,
                    reason=f"preempted on {site}: {ev.reason or ''}".strip()
                )
                # Counted and told once the preemption is stored: a write that fails is tried again with the
                # whole event (pump), which must not count or tell it twice (a retry finds it preempted).
                self.metrics.preemptions.labels(site).inc()
                if self.book.events is not None:
                    self.book.events.publish("preemption", {
                        "job_id": job.id, "tenant": job.spec.tenant, "site": site, "attempt": job.attempt,
                        "reason": ev.reason, "at": ev.at.isoformat(),
                    }, tenant=job.spec.tenant, site=site, job_id=job.id)
                try:
                    return await self.book.transition(
                        job.id, JobState.QUEUED,
                        reason="requeued after preemption" + (" from its checkpoint" if kept else ""),
                    )
                except (JobNotFound, IllegalTransition):
                    return None  # cancelled, or moved on, between the two writes: that change settles the job
            case EventKind.LOST:
                if job.state != R:
                    # Lost before it ran: the site took the attempt but could not start it (its cluster's
                    # scheduler found no room, its agent gave it up): skipped for a while, as a site that refuses
                    # a dispatch, so the job goes elsewhere rather than straight back.
                    self.book.refuse(job.id, site, f"lost attempt {job.attempt} before it ran: {ev.reason or ''}")
                lost = await self.lose(job, site, ev.reason or "", at=ev.at)
                if lost is None:  # it moved on while its losses were read: the event is stale
                    self.left_at.pop((job.id, job.attempt), None)
                    return None
                self.ended_unstopped(job.id, job.attempt)
                return lost
        return None

    def lost_cap(self, job: Job) -> int:
        """How many lost attempts end ``job`` (0: no bound): its spec's ``max_lost_attempts``, else the broker's."""
        cap = job.spec.max_lost_attempts if job.spec.max_lost_attempts is not None else self.max_lost_attempts
        return cap or 0

    async def lose(self, job: Job, site: str, why: str, at: datetime | None = None) -> Job | None:
        """``site`` lost ``job``'s current attempt: requeue the job (none of its ``max_attempts`` spent), or, at
        its ``lost_cap``-th loss, fail it with a reason that names the losses and their sites. The losses are
        read from its stored transitions, so they count across restarts. None if the job moved on meanwhile
        (nothing changed). Raises as ``JobBook.transition`` does, and StoreError when the history cannot be read
        (nothing changed)."""
        lost = await self._lose(job, site, why, at)
        if lost is not None:
            self.metrics.lost.labels(site).inc()
        return lost

    async def _lose(self, job: Job, site: str, why: str, at: datetime | None) -> Job | None:
        reason = lost_reason(site, job.attempt, why)
        cap = self.lost_cap(job)
        if cap:
            lost = lost_attempts(await self.book.history(job.id))
            current = self.book.active.get(job.id)
            if current is None or current.version != job.version:
                return None
            lost[job.attempt] = site
            if len(lost) >= cap:
                told = losses_told(lost, cap)
                log.warning("job %s: %s; %s", job.id, reason, told)
                ended = {} if at is None else {"finished_at": at}
                if job.state != D:
                    return await self.book.transition(job.id, JobState.FAILED, reason=f"{told} (the last: {reason})",
                                                      **ended)
                # A dispatching job cannot fail where it is: the loss is stored as such, then the job fails from
                # the queue (should a pass place it again in between, it fails at its next loss).
                await self.book.transition(job.id, JobState.QUEUED, reason=reason)
                failed = await self.book.transition_if(job.id, (JobState.QUEUED,), job.attempt, JobState.FAILED,
                                                       reason=told, **ended)
                return failed or self.book.active.get(job.id)
        return await self.book.transition(job.id, JobState.QUEUED, reason=reason)

    async def cancel(self, job_id: str, why: str | None = None, withdraw_within_s: float | None = None) -> Job:
        """Cancel a job; if it holds GPUs at a site, withdraw it there (retried until the site confirms).
        ``why``: the caller's words, recorded after "cancelled by request". ``withdraw_within_s``: wait at most
        this long (and never beyond ``cancel_timeout_s``) for the site to confirm; then ``settle`` retries.

        Raises JobNotFound for an unknown id and AlreadyEnded for a job that has ended (or is ending).
        """
        job = await self.book.take_in(job_id)  # (one another replica accepted may not be taken in yet)
        if job is None:
            raise AlreadyEnded(await self.book.get(job_id))
        reason = "cancelled by request" + (f": {why}" if why else "")
        cancelled = await self.book.transition(job.id, JobState.CANCELLED, reason=reason)
        if job.state in ON_SITE and job.site:
            await self.withdraw(job, job.site, withdraw_within_s)
        return cancelled

    # --- withdrawals: an attempt a site must drop, retried until it confirms ---

    async def withdraw(self, job: Job, site: str, within_s: float | None = None) -> bool:
        """Ask ``site`` to drop ``job``'s attempt, waiting ``cancel_timeout_s`` at most (or ``within_s``, if
        shorter). True once it confirms (or the site is gone); otherwise the withdrawal is remembered and
        ``settle`` retries it."""
        if await self._cancel_at(site, job.id, job.attempt, within_s):
            self._withdrawals.pop((job.id, job.attempt), None)
            return True
        self._withdrawals[(job.id, job.attempt)] = site
        return False

    async def requeue_from(self, site: str, job_id: str, attempt: int, why: str) -> Job | None:
        """``site`` does not have (or no longer has) the attempt: skip the site for a while and route the
        job again, from any state of that attempt there, whatever a late event said. If the write fails,
        ``settle`` tries again, so the job cannot be left at a site that does not run it."""
        current = self.book.active.get(job_id)
        if current is None or current.attempt != attempt or current.site != site or current.state not in ON_SITE:
            self._requeues.pop((job_id, attempt), None)
            return None
        self.book.refuse(job_id, site, why)  # before the job is queued, so no pass re-picks the site
        try:
            job = await self.book.transition(job_id, JobState.QUEUED, reason=f"{site} {why}; routing again")
        except StoreError as e:
            log.error("job %s: could not requeue it from %s (%s); will try again", job_id, site, e)
            self._requeues[(job_id, attempt)] = (site, why)
            return None
        self._requeues.pop((job_id, attempt), None)
        self.ended_unstopped(job_id, attempt)
        return job

    async def settle(self, force: bool = False) -> None:
        """Retry what is not settled: requeues whose write failed, withdrawals sites have not confirmed,
        and reconciliations after a restart. Sites are asked in parallel, each call bounded by
        ``cancel_timeout_s``; a site that fails is left alone for a while (doubling, up to
        ``max_backoff_s``) unless ``force``."""
        await self.book.resync_suspects()
        for (job_id, attempt), (site, why) in list(self._requeues.items()):
            await self.requeue_from(site, job_id, attempt, why)
        self.find_strays()
        self.find_stranded()
        sites = set(self._withdrawals.values()) | set(self.pending_sites)
        now = time.monotonic()
        due = [s for s in sites if force or self._backoff.get(s, (0.0, 0.0))[0] <= now]
        await asyncio.gather(*(self._settle_site(site) for site in due))

    def find_strays(self) -> int:
        """Attempts a site says it holds that the broker no longer has there (requeued when its lease ran
        out, withdrawn, ended): each becomes a withdrawal, which ``settle`` sends until the site confirms.
        The broker moves a job to an attempt before dispatching it, so an attempt being dispatched is never
        taken for a stray. Returns how many new strays were found."""
        found = 0
        for name, member in self.federation.members.items():
            if not isinstance(member.adapter, HeldAttempts):
                continue
            for job_id, attempt in member.adapter.held_attempts():
                job = self.book.active.get(job_id)
                if job is not None and job.site == name and job.attempt == attempt and job.state in ON_SITE:
                    continue
                if (job_id, attempt) not in self._withdrawals:
                    log.warning("site %s holds attempt %d of job %s, which the broker no longer has there; "
                                "cancelling it", name, attempt, job_id)
                    self._withdrawals[(job_id, attempt)] = name
                    found += 1
        return found

    def find_stranded(self) -> int:
        """Jobs held as dispatching that nothing sends to their site, for ``stranded_after_s``: no dispatch is
        under way, no withdrawal or requeue of the attempt is pending, and no reconciliation is planned. A dispatch
        cut short (its leader unsure of its lease for a moment, then sure again), or a fault that left a job so,
        must not keep it there for ever: its site is asked, as after a restart (``reconcile``), and an attempt the
        site does not hold is requeued; one it holds goes on as its events say. Looked for every
        :data:`STRANDED_SWEEP_S`; a job counts as stranded once two looks at least ``stranded_after_s`` apart found
        it so. Returns how many were found now."""
        if self.dispatching_now is None:
            return 0
        now = time.monotonic()
        if now - self._swept_at < STRANDED_SWEEP_S:
            return 0
        self._swept_at = now
        seen: dict[tuple[str, int], float] = {}
        dispatching: set[tuple[str, int]] = set()
        found = 0
        for job in self.book.active.unqueued():
            if job.state != D or job.site is None:
                continue
            key = (job.id, job.attempt)
            dispatching.add(key)
            if (self.dispatching_now(*key) or key in self._withdrawals or key in self._requeues
                    or job.id in self.pending_sites.get(job.site, ())):
                continue
            since = seen[key] = self._stranded_since.get(key, now)
            if now - since >= self.stranded_after_s:
                log.warning("job %s: dispatching to %s for %.0f s with no dispatch under way; asking the site whether "
                            "it holds attempt %d", job.id, job.site, now - since, job.attempt)
                self.pending_sites.setdefault(job.site, {})[job.id] = job.version
                self._stranded.add(key)
                del seen[key]
                found += 1
        self._stranded_since = seen
        self._stranded &= dispatching
        return found

    async def _settle_site(self, site: str) -> None:
        ok = True
        for (job_id, attempt), where in list(self._withdrawals.items()):
            if where != site:
                continue
            if not await self._cancel_at(site, job_id, attempt):
                ok = False
                break  # the site is not answering: the rest wait for its next turn
            self._withdrawals.pop((job_id, attempt), None)  # another path may have settled it meanwhile
            await self.requeue_from(site, job_id, attempt, "dropped the attempt when asked again")
        if ok and site in self.pending_sites:
            if await self.reconcile(site, self.pending_sites[site]) is None:
                ok = False
            else:
                self.pending_sites.pop(site, None)
        if ok:
            self._backoff.pop(site, None)
        else:
            delay = min(self.max_backoff_s, max(1.0, 2 * self._backoff.get(site, (0.0, 0.0))[1]))
            if site not in self._backoff:
                log.warning("site %s does not answer; asking again in %.0f s, then less and less often", site, delay)
            self._backoff[site] = (time.monotonic() + delay, delay)

    async def _cancel_at(self, site: str, job_id: str, attempt: int, within_s: float | None = None) -> bool:
        member = self.federation.get(site)
        if member is None:
            return True  # the site is gone, and its attempts with it
        if not self.may_act():
            return False  # no longer sure it leads: the withdrawal waits (for this replica's next term)
        try:
            async with asyncio.timeout(self.cancel_timeout_s if within_s is None else min(within_s,
                                                                                          self.cancel_timeout_s)):
                await member.adapter.cancel(job_id, attempt)
            return True
        except Exception as e:
            log.debug("site %s: withdrawing attempt %d of %s failed: %s", site, attempt, job_id, e)
            return False

    @property
    def withdrawals(self) -> dict[tuple[str, int], str]:
        """(job id, attempt) -> site, for attempts a site has yet to confirm it dropped."""
        return dict(self._withdrawals)

    # --- after a restart ---

    async def learn_run_times(self, store: Store) -> int:
        """Start ``run_times`` from the jobs that succeeded before this broker took charge: of the latest
        ``LEARN_FROM`` successes the store holds (it lists jobs in submission order, newest first), the
        ``runtime_risk.KEEP`` that finished last, in the order they finished. Returns how many it read."""
        page = await store.list_jobs(JobFilter(state=JobState.SUCCEEDED), limit=LEARN_FROM)
        ended = sorted(page.items, key=lambda j: (j.finished_at or j.updated_at, j.id))[-runtime_risk.KEEP:]
        for job in ended:
            self.run_times.add(job.spec.duration_s, actual_run_s(job))
        return len(page.items)

    async def recover(self) -> list[Job]:
        """After a restart: requeue what was preempted or sits on a site no longer registered, then
        reconcile every site. A site that cannot answer now is retried by ``settle``, for the jobs it had
        at start-up only: jobs placed there later are settled by the usual dispatch and events."""
        requeued = []
        for job in self.book.active.unqueued():
            if job.state == JobState.PREEMPTED:
                requeued.append(await self._requeue(job, "requeued after preemption"))
            elif job.state in ON_SITE and job.site not in self.federation:
                requeued.append(await self._requeue(job, "the site is no longer registered; requeued",
                                                    lost_at=job.site))
        names = list(self.federation.members)
        snapshots = {
            name: {j.id: j.version for j in self.book.active.unqueued() if j.site == name and j.state in ON_SITE}
            for name in names
        }
        outcomes = await asyncio.gather(*(self.reconcile(name, snapshots[name], self.unheard_since)
                                          for name in names))
        for name, outcome in zip(names, outcomes):
            if outcome is None:
                self.pending_sites[name] = snapshots[name]
            else:
                requeued += outcome
        return [j for j in requeued if j is not None]

    async def reconcile(self, site: str, jobs: dict[str, int],
                        unheard_since: datetime | None = None) -> list[Job | None] | None:
        """Requeue those of ``jobs`` (id -> version at start-up) that ``site`` no longer has, if they have
        not moved since. None when the site cannot tell now.

        A site that can list its attempts (AttemptLookup) is asked; any attempt it does not know is
        requeued, as having left the site at ``unheard_since`` where given (``left_at``: at start-up, the last
        time a broker knew it there; a site that answers only later may have run it meanwhile, and is not given
        one). One the site had been asked to stop, to move it (``stop_asked``), is taken for stopped then, as
        its lost ``preempted`` event would have said: a checkpointable job keeps its run up to the stop.
        A site that cannot list them is asked to withdraw the attempts still being dispatched; admitted and
        running ones are settled by its events.
        """
        member = self.federation.get(site)
        if member is None:
            return []
        todo = [j for j in map(self.book.active.get, jobs) if j is not None and j.version == jobs[j.id]]
        adapter = member.adapter
        requeued: list[Job | None] = []
        if isinstance(adapter, AttemptLookup):
            try:
                async with asyncio.timeout(self.cancel_timeout_s):
                    known = await adapter.known_attempts()
            except Exception as e:
                log.debug("site %s: cannot list its attempts (%s)", site, e)
                return None
            for job in todo:
                if (job.id, job.attempt) not in known and self._unmoved(job):
                    asked = self.stop_asked(job.id, job.attempt, site) if job.state == R else None
                    if asked is not None:
                        requeued.append(await self._stopped_unheard(site, job, *asked))
                        continue
                    if unheard_since is not None:  # (read as the requeue lands: JobBook.on_attempt_end)
                        self.left_at[(job.id, job.attempt)] = unheard_since
                    why = ("its dispatch was cut short, and the site does not hold it; requeued"
                           if (job.id, job.attempt) in self._stranded else
                           "the site no longer knows it after a broker restart; requeued")
                    requeued.append(await self._requeue(job, why, lost_at=site))
                    if requeued[-1] is None:  # not requeued (the store refused it): the attempt has not left
                        self.left_at.pop((job.id, job.attempt), None)
            await self._withdraw_ended(site, known)
            return requeued
        for job in todo:
            if job.state != D:
                continue
            if not await self._cancel_at(site, job.id, job.attempt):
                return None
            if self._unmoved(job):
                cut = "cut short" if (job.id, job.attempt) in self._stranded else "cut off by a restart"
                requeued.append(await self._requeue(job, f"dispatch to {site} was {cut}; requeued"))
        return requeued

    async def _withdraw_ended(self, site: str, known: set[tuple[str, int]]) -> None:
        """After a restart: the attempts ``site`` still holds of jobs that have ended (a cancel whose withdrawal the
        site had not confirmed when the broker stopped: settle's retries are kept in memory) become withdrawals,
        which ``settle`` sends until the site confirms, so their GPUs are not held for ever. An attempt of a job the
        store does not have (another broker's) is left alone, as is one the store cannot be asked about now."""
        for job_id, attempt in known:
            if job_id in self.book.active or (job_id, attempt) in self._withdrawals:
                continue
            try:
                job = await self.book.get(job_id)
            except (JobNotFound, StoreError):
                continue
            if job.state.terminal:
                log.warning("site %s holds attempt %d of job %s, which is %s; cancelling it", site, attempt,
                            job_id, job.state.value)
                self._withdrawals[(job_id, attempt)] = site

    async def _stopped_unheard(self, site: str, job: Job, asked_ts: float, why: str) -> Job | None:
        """``job``'s attempt, which ``site`` was asked at ``asked_ts`` to checkpoint and stop, is gone from the
        site, and its ``preempted`` event never reached the broker (the broker went down first): applied as
        that event, with the run up to the stop."""
        at = datetime.fromtimestamp(asked_ts, UTC)
        # From this attempt's start: as the site reported it, unless that is after the broker stored it (clocks
        # apart); the broker's own time is later where it heard the start late.
        began = min(job.started_at or job.updated_at, job.updated_at)
        ran_s = max(asked_ts - began.timestamp(), 0.0)
        log.info("job %s: %s no longer knows attempt %d, which it was asked to stop at %s; taken for stopped "
                 "then, after %.0f s running", job.id, site, job.attempt, at.isoformat(), ran_s)
        try:
            return await self.on_event(site, JobEvent(
                job.id, job.attempt, EventKind.PREEMPTED, at, run_s=ran_s,
                reason=f"{why} (its end was not heard before a broker restart; taken as of the stop)"))
        except IllegalTransition:  # another change to the job got there first: it is no longer on the site
            return None
        except (JobNotFound, StoreError) as e:
            log.error("job %s: cannot requeue: %s", job.id, e)
            return None

    def _unmoved(self, job: Job) -> bool:
        current = self.book.active.get(job.id)
        return current is not None and current.version == job.version

    async def _requeue(self, job: Job, reason: str, lost_at: str | None = None) -> Job | None:
        """Requeue ``job`` unless it moved on meanwhile; as a loss (``lose``, which may fail it) where ``lost_at``
        names the site that lost its attempt."""
        current = self.book.active.get(job.id)
        if current is None or current.version != job.version:
            return None  # moved on meanwhile
        try:
            if lost_at is not None:
                requeued = await self.lose(current, lost_at, reason)
                if requeued is None:
                    return None
            else:
                requeued = await self.book.transition(job.id, JobState.QUEUED, reason=reason)
        except (IllegalTransition, JobNotFound, StoreError) as e:
            log.error("job %s: cannot requeue: %s", job.id, e)
            return None
        if current.state != JobState.PREEMPTED:  # (a preemption's requeue, stored half-way, is the stop's)
            self.ended_unstopped(job.id, job.attempt)
        return requeued


class AlreadyEnded(Exception):
    """The job has ended, or is ending: nothing to cancel."""

    def __init__(self, job: Job) -> None:
        state = job.state if job.state.terminal else "ending"
        super().__init__(f"job {job.id} is already {state}; it cannot be cancelled")
        self.job = job
