"""What happens to a job after dispatch: site events, cancellation, and recovery after a restart.

- ``running``, ``succeeded``: recorded as they come.
- ``failed``: the job is requeued while it has failed attempts left (``max_attempts``), else it fails.
- ``preempted``: recorded, then the job is requeued; a checkpointable job keeps its progress (``run_s``).
- ``lost``: the site no longer has the attempt; the job is requeued (a loss is not the job's failure).
Events for an attempt that is no longer current are ignored, so a late or repeated event never moves a
job twice.
"""

from __future__ import annotations

import asyncio
import logging

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from adapters.base import AttemptLookup, EventKind, JobEvent
from broker.federation import Federation, Member
from broker.jobs import JobBook, JobNotFound
from broker.models import IllegalTransition, Job, JobState
from broker.store import StoreError

log = logging.getLogger(__name__)

R, D, A = JobState.RUNNING, JobState.DISPATCHING, JobState.ADMITTED
ON_SITE = (D, A, R)


class Lifecycle:
    def __init__(self, book: JobBook, federation: Federation, cancel_timeout_s: float = 10.0) -> None:
        self.book = book
        self.federation = federation
        self.cancel_timeout_s = cancel_timeout_s
        self.pending_sites: set[str] = set()  # sites to reconcile once they answer

    async def pump(self, member: Member) -> None:
        """Follow one site's event stream until the site is removed. An event whose write fails is retried
        with backoff until the store takes it: a site's report is never dropped."""
        site = member.spec.name
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

    async def on_event(self, site: str, ev: JobEvent) -> Job | None:
        job = self.book.active.get(ev.job_id)
        if job is None or job.site != site or job.attempt != ev.attempt or job.state not in ON_SITE:
            return None  # stale, repeated or for an attempt we withdrew
        if job.state == D and ev.kind != EventKind.LOST:
            # The site's event overtook its answer to the dispatch: the event itself shows admission.
            job = await self.book.transition(job.id, A, reason=f"admitted by {site}")
        match ev.kind:
            case EventKind.RUNNING:
                if job.state == R:
                    return None
                return await self.book.transition(job.id, R, reason=f"running on {site}", started_at=ev.at)
            case EventKind.SUCCEEDED:
                return await self.book.transition(
                    job.id, JobState.SUCCEEDED, reason=f"succeeded on {site}", run_s=job.run_s + ev.run_s,
                    finished_at=ev.at,
                )
            case EventKind.FAILED:
                failed = job.failed_attempts + 1
                why = ev.reason or "failed"
                if failed >= job.spec.max_attempts:
                    return await self.book.transition(
                        job.id, JobState.FAILED, failed_attempts=failed, finished_at=ev.at,
                        reason=f"attempt {job.attempt} on {site} failed ({why}); {failed} of "
                               f"{job.spec.max_attempts} attempts failed, giving up",
                    )
                return await self.book.transition(
                    job.id, JobState.QUEUED, failed_attempts=failed,
                    reason=f"attempt {job.attempt} on {site} failed ({why}); requeued "
                           f"({failed} of {job.spec.max_attempts} attempts failed)",
                )
            case EventKind.PREEMPTED:
                kept = job.run_s + ev.run_s if job.spec.checkpointable else 0.0
                await self.book.transition(
                    job.id, JobState.PREEMPTED, run_s=kept, reason=f"preempted on {site}: {ev.reason or ''}".strip()
                )
                return await self.book.transition(
                    job.id, JobState.QUEUED,
                    reason="requeued after preemption" + (" from its checkpoint" if kept else ""),
                )
            case EventKind.LOST:
                return await self.book.transition(
                    job.id, JobState.QUEUED, reason=f"{site} lost attempt {job.attempt}: {ev.reason}"
                )
        return None

    async def cancel(self, job_id: str) -> Job:
        """Cancel a job; if it holds GPUs at a site, withdraw it there too.

        Raises JobNotFound for an unknown id and AlreadyEnded for a job that has ended (or is ending).
        """
        job = self.book.active.get(job_id)
        if job is None:
            raise AlreadyEnded(await self.book.get(job_id))
        cancelled = await self.book.transition(job.id, JobState.CANCELLED, reason="cancelled by request")
        if job.state in ON_SITE and job.site:
            member = self.federation.get(job.site)
            if member is not None:
                try:
                    async with asyncio.timeout(self.cancel_timeout_s):
                        await member.adapter.cancel(job.id, job.attempt)
                except Exception as e:
                    log.error("job %s: site %s did not confirm the cancel: %s", job.id, job.site, e)
        return cancelled

    async def recover(self) -> list[Job]:
        """After a restart: requeue what was preempted or sits on a site no longer registered, then
        reconcile every site. Sites that cannot answer now are retried by ``reconcile_pending``."""
        requeued = []
        for job in list(self.book.active.values()):
            if job.state == JobState.PREEMPTED:
                requeued.append(await self._requeue(job, "requeued after preemption"))
            elif job.state in ON_SITE and job.site not in self.federation:
                requeued.append(await self._requeue(job, f"site {job.site} is no longer registered; requeued"))
        for name in list(self.federation.members):
            outcome = await self.reconcile(name)
            if outcome is None:
                self.pending_sites.add(name)
            else:
                requeued += outcome
        return [j for j in requeued if j is not None]

    async def reconcile_pending(self) -> None:
        """Ask again, in parallel, every site that could not be reconciled yet."""
        names = list(self.pending_sites)
        outcomes = await asyncio.gather(*(self.reconcile(name) for name in names))
        for name, outcome in zip(names, outcomes):
            if outcome is not None:
                self.pending_sites.discard(name)

    async def reconcile(self, site: str) -> list[Job | None] | None:
        """Requeue the attempts ``site`` no longer has. None when the site cannot tell now.

        A site that can list its attempts (AttemptLookup) is asked; any attempt it does not know is
        requeued. A site that cannot list them is asked to withdraw the attempts still being dispatched;
        admitted and running ones are settled by its events.
        """
        member = self.federation.get(site)
        if member is None:
            return []
        jobs = [j for j in self.book.active.values() if j.site == site and j.state in ON_SITE]
        adapter = member.adapter
        requeued: list[Job | None] = []
        if isinstance(adapter, AttemptLookup):
            try:
                known = await adapter.known_attempts()
            except Exception as e:
                log.warning("site %s: cannot list its attempts (%s); will ask again", site, e)
                return None
            for job in jobs:
                if (job.id, job.attempt) not in known:
                    requeued.append(await self._requeue(
                        job, f"{site} no longer knows attempt {job.attempt} after a broker restart; requeued"))
            return requeued
        for job in jobs:
            if job.state != D:
                continue
            try:
                async with asyncio.timeout(self.cancel_timeout_s):
                    await adapter.cancel(job.id, job.attempt)
            except Exception as e:
                log.warning("site %s: cannot withdraw attempt %d of %s (%s); will ask again", site, job.attempt, job.id, e)
                return None
            requeued.append(await self._requeue(job, f"dispatch to {site} was cut off by a restart; requeued"))
        return requeued

    async def _requeue(self, job: Job, reason: str) -> Job | None:
        current = self.book.active.get(job.id)
        if current is None or current.version != job.version:
            return None  # moved on meanwhile
        try:
            return await self.book.transition(job.id, JobState.QUEUED, reason=reason)
        except (IllegalTransition, JobNotFound, StoreError) as e:
            log.error("job %s: cannot requeue: %s", job.id, e)
            return None


class AlreadyEnded(Exception):
    """The job has ended, or is ending: nothing to cancel."""

    def __init__(self, job: Job) -> None:
        state = job.state if job.state.terminal else "ending"
        super().__init__(f"job {job.id} is already {state}; it cannot be cancelled")
        self.job = job
