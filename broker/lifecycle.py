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

from adapters.base import AttemptLookup, EventKind, JobEvent
from broker.federation import Federation, Member
from broker.jobs import JobBook, JobNotFound
from broker.models import IllegalTransition, Job, JobState

log = logging.getLogger(__name__)

R, D, A = JobState.RUNNING, JobState.DISPATCHING, JobState.ADMITTED
ON_SITE = (D, A, R)


class Lifecycle:
    def __init__(self, book: JobBook, federation: Federation, cancel_timeout_s: float = 10.0) -> None:
        self.book = book
        self.federation = federation
        self.cancel_timeout_s = cancel_timeout_s

    async def pump(self, member: Member) -> None:
        """Follow one site's event stream until the site is removed."""
        async for event in member.adapter.events():
            try:
                await self.on_event(member.spec.name, event)
            except Exception:
                log.exception("site %s: could not apply event %s", member.spec.name, event)

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
        """Cancel a job; if it holds GPUs at a site, withdraw it there too. Raises IllegalTransition if final."""
        job = await self.book.get(job_id)
        if job.state.terminal:
            raise IllegalTransition(job.id, job.state, JobState.CANCELLED)
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
        """After a restart: requeue every attempt its site no longer knows. Returns the requeued jobs."""
        known: dict[str, set[tuple[str, int]]] = {}
        for name, member in self.federation.members.items():
            if isinstance(member.adapter, AttemptLookup):
                try:
                    known[name] = await member.adapter.known_attempts()
                except Exception as e:
                    log.warning("site %s: cannot list its attempts (%s); its jobs stay until it answers", name, e)
        requeued = []
        for job in list(self.book.active.values()):
            if job.state == JobState.PREEMPTED:
                requeued.append(await self.book.transition(job.id, JobState.QUEUED,
                                                           reason="requeued after preemption"))
                continue
            if job.state not in ON_SITE or job.site not in known:
                continue
            if (job.id, job.attempt) in known[job.site]:
                continue
            try:
                requeued.append(await self.book.transition(
                    job.id, JobState.QUEUED,
                    reason=f"{job.site} no longer knows attempt {job.attempt} after a broker restart; requeued",
                ))
            except (IllegalTransition, JobNotFound) as e:
                log.error("job %s: cannot requeue: %s", job.id, e)
        # Jobs on sites that are gone from the federation altogether are requeued too.
        for job in list(self.book.active.values()):
            if job.state in ON_SITE and job.site not in self.federation:
                requeued.append(await self.book.transition(
                    job.id, JobState.QUEUED, reason=f"site {job.site} is no longer registered; requeued"
                ))
        return requeued
