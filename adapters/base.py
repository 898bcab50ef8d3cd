"""What the broker needs of a site, as one small protocol per capability.

- ``CapacityReporter``: a snapshot of capacity and telemetry.
- ``JobRunner``: submit an attempt (admitted, or rejected with a reason) and cancel one.
- ``EventSource``: a stream of job events (running, succeeded, failed, preempted, lost). ``lost`` is no failure of
  the job's; an attempt lost before it was reported running is one the site admitted but could not start (a
  Kubernetes Pod its scheduler finds no room for), and the broker skips the site for the job a while.
- ``QuotaAdmin`` (optional): the site's quota state, and its operator's changes to it, which the site keeps
  across restarts. The broker only relays them: the site owns its quotas.
- ``AttemptLookup`` (optional): which attempts the site still knows, for reconciliation after a broker
  restart: the broker requeues the attempts the site no longer has. Without it, the broker withdraws the
  attempts that were still being dispatched and requeues them; admitted and running attempts are settled
  by the site's events.
- ``HeldAttempts`` (optional): the attempts the site says it holds now, known without a call (a remote
  site's heartbeat lists them). The broker cancels any of them it no longer has at that site: an agent back
  from a partition, or restarted, is reconciled without running anything twice.
- ``Preempter`` (optional): checkpoint and stop a running attempt when the broker asks, as the site's own
  preemption does, so a checkpointable job can move to a cleaner or cheaper site, or make room for a job
  that must run near its users (``policies.migration``). Sites without it never have a job moved away.
- ``LogReader`` (optional): what an attempt printed (the end of it: ``tail_lines``, ``limit_bytes``), for
  ``GET /v1/jobs/{id}/logs``. It raises :class:`LogsUnsupported` where the site cannot give logs at all,
  :class:`LogsNotFound` where it has none for the attempt (not started yet, or gone), and ``AdapterError``
  where it cannot answer now.
- ``LogFollower`` (optional): the same tail, then what the attempt prints after it as it prints it, until the
  attempt ends, for ``GET /v1/jobs/{id}/logs?follow=true``. Sites without it answer that with 501 (their logs can
  still be read, and polled, with ``tail``).

Submissions are keyed by (job id, attempt): submitting the same attempt twice must not run it twice.
A cancel is final for its attempt: the site drops it if it has it, and refuses it if its submission
arrives later (it may still be on its way), so a withdrawn attempt can never start.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from broker.models import Job, QuotaState, SiteState, TenantQuota


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    reason: str | None = None

    @classmethod
    def ok(cls) -> Admission:
        return cls(True)

    @classmethod
    def rejected(cls, reason: str) -> Admission:
        return cls(False, reason)


class EventKind(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class JobEvent:
    job_id: str
    attempt: int
    kind: EventKind
    at: datetime
    reason: str | None = None
    run_s: float = 0.0  # seconds the attempt ran (for checkpointed progress)


@runtime_checkable
class CapacityReporter(Protocol):
    async def snapshot(self) -> SiteState: ...


@runtime_checkable
class JobRunner(Protocol):
    async def submit(self, job: Job) -> Admission: ...

    async def cancel(self, job_id: str, attempt: int) -> None: ...


@runtime_checkable
class EventSource(Protocol):
    def events(self) -> AsyncIterator[JobEvent]: ...


@runtime_checkable
class EventReceipts(Protocol):
    def taken(self, event: JobEvent) -> None:
        """The consumer of :meth:`EventSource.events` has kept ``event`` (the broker stored it, or, for a site
        agent, the broker acknowledged it): an adapter that keeps what it must report across its own restarts
        may forget it now. An event never said to be taken may be reported again by the next adapter."""
        ...


@runtime_checkable
class AttemptLookup(Protocol):
    async def known_attempts(self) -> set[tuple[str, int]]: ...


@runtime_checkable
class HeldAttempts(Protocol):
    def held_attempts(self) -> set[tuple[str, int]]: ...


@runtime_checkable
class Preempter(Protocol):
    async def preempt(self, job_id: str, attempt: int, reason: str) -> None:
        """Stop a running attempt as the site's own preemption does: the job is signalled (and given the
        site's grace period, in which a checkpointable job saves its checkpoint), its GPUs are freed, and the
        site sends a ``preempted`` event with ``reason`` and how long the attempt ran. An attempt the site
        no longer runs is left alone (its own event, if any, stands)."""
        ...


@dataclass(frozen=True, slots=True)
class JobLogs:
    """What an attempt printed, as a site gives it: ``text`` (UTF-8, invalid bytes replaced), whether lines or
    bytes before it were left out (``truncated``: by ``tail_lines``, ``limit_bytes`` or a message size), and
    where it came from (``source``: a Pod and its container, or the simulated run)."""

    text: str
    truncated: bool = False
    source: str | None = None


@runtime_checkable
class LogReader(Protocol):
    async def logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        """The last ``tail_lines`` lines (None: all) of what attempt ``attempt`` of job ``job_id`` printed, at
        most its last ``limit_bytes`` bytes. :class:`LogsNotFound` where the site has nothing for that attempt,
        :class:`LogsUnsupported` where it cannot give logs, ``AdapterError`` where it cannot answer now."""
        ...


@dataclass(frozen=True, slots=True)
class LogFollow:
    """A log being followed: whether lines or bytes before its start were left out (``truncated``, as
    :class:`JobLogs` says it), where it comes from (``source``), and ``chunks``: the tail first, then the text the
    attempt prints as it prints it (UTF-8 decoded, in pieces of any size, not split at lines), until the attempt
    ends. Closing ``chunks`` early (``aclose``: the reader left) ends what it reads from the site."""

    truncated: bool
    source: str | None
    chunks: AsyncGenerator[str, None]


@runtime_checkable
class LogFollower(Protocol):
    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        """Follow what attempt ``attempt`` of job ``job_id`` prints: first its last ``tail_lines`` lines (None:
        all), at most about ``limit_bytes`` bytes of them, as :meth:`LogReader.logs` gives them, then more as it is
        written, until the attempt ends (an attempt that has ended: its tail, then the end). Raises as
        :meth:`LogReader.logs` does before the first chunk; ``AdapterError`` from ``chunks`` where the site stops
        answering on the way. The adapter holds no more than a chunk of the text at once."""
        ...


@runtime_checkable
class QuotaAdmin(Protocol):
    async def quota(self) -> QuotaState: ...

    async def set_quota(self, quota: TenantQuota) -> QuotaState: ...

    async def remove_quota(self, tenant: str) -> QuotaState: ...

    async def forget_quotas(self) -> None:
        """The site leaves the federation: drop what it kept of its own (its quota changes, and where it keeps them
        its usage history and stops not yet reported), so a new site of its name starts afresh."""
        ...


@runtime_checkable
class SiteAdapter(CapacityReporter, JobRunner, EventSource, Protocol):
    """Everything a member site must offer. ``start`` and ``close`` bracket its life."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class AdapterError(RuntimeError):
    """A site could not be reached or answered nonsense; the broker treats the call as failed."""


class LogsUnsupported(AdapterError):
    """The site cannot give logs: its adapter has no ``LogReader``, or its agent is of an earlier release."""


class LogsNotFound(AdapterError):
    """The site has no logs of the attempt: it has not started there, or what it ran is gone (the message
    says which)."""


def tail_text(text: str, tail_lines: int | None, limit_bytes: int) -> tuple[str, bool]:
    """The end of ``text``: its last ``tail_lines`` lines (None: all), then at most its last ``limit_bytes``
    bytes of UTF-8 (a character cut in two is dropped); and whether anything was left out. Lines end at ``\n``
    only, as a kubelet's ``tailLines`` counts them (a progress bar redrawn with ``\r`` is one line)."""
    cut = False
    if tail_lines is not None:
        lines = text.split("\n")
        count = len(lines) - 1 if lines[-1] == "" else len(lines)  # (a last newline starts no line)
        if count > tail_lines:
            text, cut = "\n".join(lines[count - tail_lines:]) if tail_lines else "", True
    data = text.encode()
    if len(data) > limit_bytes:
        text, cut = data[len(data) - limit_bytes:].decode(errors="ignore") if limit_bytes > 0 else "", True
    return text, cut
