"""A simulated site: it owns GPUs as the site spec describes them and runs each admitted job for its
duration on the injected clock, so the live broker (system clock) and tests or the simulator (manual
clock) drive it the same way.

- Admission: after ``dispatch_delay_s`` the site decides with :class:`policies.admission.SiteAdmission`,
  the site-local policies every adapter applies: its GPU inventory (nodes, NVLink domains, shared GPUs, MIG
  slices; all of a job's GPUs or none) and its quotas (guarantee, burst, fair share). It admits the attempt,
  perhaps after preempting running jobs the quota book names (each gets a ``preempted`` event with the
  reason, and its run so far), or rejects it with the reason. A repeated submission of the same (job id,
  attempt) is admitted once.
- Quotas: the spec's ``quotas`` and ``fair_share`` are the starting point; the operator's changes
  (``set_quota``, ``remove_quota``) are kept in ``state_dir``/``NAME``/quota.json, so the site has them
  again after a restart (:mod:`adapters.quota_store`); so is the usage history its fair share weighs
  (``usage.json``, :class:`adapters.site_state.UsageJournal`).
- Failures: each attempt fails with probability ``failure_rate`` at a uniformly random point of its run,
  from a generator seeded by ``seed``, so runs repeat exactly.
- Telemetry is modelled from allocation: utilisation follows the share of GPU in use, power goes from
  10% of board power idle to 100% busy, temperature from 35 °C idle to 80 °C busy.
- Logs (``LogReader``): the site runs no container, so what an attempt "printed" is made up from its simulated
  run, the same each time: a line when it started (and, for a checkpointed job, from where it resumed), one
  at each tenth of its planned run that has passed on the clock, and one for how it ended (succeeded, failed
  with the reason, preempted, or withdrawn). The logs of the latest ``LOGS_KEPT`` attempts that ended are kept,
  in memory only. ``LogFollower``: the same log followed, each line sent when its time comes on the clock, until
  the attempt ends or the site is closed (removed from the federation, or the broker stops).
- ``set_reachable(False)`` makes the site unreachable (every call raises ``AdapterError`` and events are
  held back until it is reachable again), for fault tests; its running jobs keep running, as a real
  partitioned site's would.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from collections import OrderedDict
from datetime import UTC, datetime, timedelta

from pathlib import Path

from adapters.base import (AdapterError, Admission, EventKind, JobEvent, JobLogs, LogFollow, LogsNotFound,
                           tail_text)
from adapters.quota_store import QuotaOverrides, log_beyond_site
from adapters.site_state import UsageJournal
from broker import ids
from broker.clock import Clock
from broker.models import Health, Job, QuotaState, SimulatedAdapterConfig, SiteSpec, SiteState, Telemetry, TenantQuota
from policies.admission import Admitted, SiteAdmission


TOMBSTONE_TTL_S = 3600.0  # far longer than any dispatch timeout
LOGS_KEPT = 10_000
"""How many ended attempts' logs a simulated site keeps (the oldest go first)."""
PROGRESS_STEPS = 10  # a simulated log's progress lines: one per tenth of the planned run


@dataclass(slots=True)
class _Run:
    job: Job
    started: float  # POSIX seconds
    task: asyncio.Task[None] | None = None
    planned_s: float | None = None  # what the attempt has left to run, once it runs
    ended: float | None = None  # POSIX seconds
    outcome: str | None = None  # how it ended, as its log's last line says
    over: asyncio.Event = field(default_factory=asyncio.Event)  # set once it has ended (for those following its log)


def _stamp(posix_s: float) -> str:
    return datetime.fromtimestamp(posix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def simulated_log(site: str, run: _Run, now: float) -> str:
    """The log of a simulated attempt as of ``now`` (POSIX seconds): deterministic, from its run alone."""
    job = run.job
    gpus = job.spec.gpus
    what = f"{gpus.count} x {job.gpu_model or 'GPU'}" + (f" ({gpus.mig_profile} slices)" if gpus.mig_profile else "")
    lines = [f"{_stamp(run.started)} heliotrope simulated site {site}: attempt {job.attempt} of job {job.id} "
             f"(tenant {job.spec.tenant}) started on {what}; no container runs here, this log is simulated"]
    if job.spec.checkpointable and job.run_s > 0:
        lines.append(f"{_stamp(run.started)} resumed from its checkpoint at {job.run_s:.0f} s of work")
    until = min(now, run.ended) if run.ended is not None else now
    planned = run.planned_s
    if planned is not None and planned > 0:
        for step in range(1, PROGRESS_STEPS):
            at = run.started + planned * step / PROGRESS_STEPS
            if at > until:
                break
            lines.append(f"{_stamp(at)} progress {100 * step // PROGRESS_STEPS}%: {planned * step / PROGRESS_STEPS:.0f} s "
                         f"of {planned:.0f} s")
    if run.ended is not None and run.outcome is not None:
        lines.append(f"{_stamp(run.ended)} attempt {job.attempt} {run.outcome} after {run.ended - run.started:.0f} s")
    return "".join(line + "\n" for line in lines)


def _admission_key(job_id: str, attempt: int) -> str:
    return f"{job_id}/{attempt}"


class SimulatedSite:
    def __init__(
        self,
        spec: SiteSpec,
        clock: Clock,
        config: SimulatedAdapterConfig | None = None,
        run_seconds: Callable[[Job], float] | None = None,
        state_dir: str | Path | None = None,
    ) -> None:
        """``run_seconds(job)`` is how long a job really runs; by default its ``duration_s``. The simulator
        passes the trace's true duration, while the policies see only the estimate in the spec.
        ``state_dir``: where the site keeps what must outlive it (its operator's quota changes); None: the
        config's ``state_dir``, else nowhere (they last as long as the object)."""
        self.spec = spec
        self._run_seconds = run_seconds or (lambda job: job.spec.duration_s)
        self.name = spec.name
        self.config = config or spec.adapter
        self._clock = clock
        self._rng = random.Random(self.config.seed)
        folder = state_dir if state_dir is not None else self.config.state_dir
        self._overrides = QuotaOverrides(Path(folder) / spec.name / "quota.json" if folder is not None else None)
        self._admission = SiteAdmission(spec, self._overrides.apply(spec.quotas))
        log_beyond_site(self.name, self._admission.book)
        self._usage = UsageJournal(Path(folder) / spec.name / "usage.json" if folder is not None else None, self.name)
        self._usage.restore(self._admission.book, clock.now().timestamp())
        self._runs: dict[tuple[str, int], _Run] = {}
        self._ended: OrderedDict[tuple[str, int], _Run] = OrderedDict()  # for their logs: the latest LOGS_KEPT
        self._pending: dict[tuple[str, int], asyncio.Future[Admission]] = {}
        self._withdrawn: dict[tuple[str, int], datetime] = {}  # tombstones of cancelled attempts -> when
        self._events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._reachable = True
        self._link_up = asyncio.Event()  # events wait while the site is unreachable, as over a real link
        self._link_up.set()
        self._closed = False

    # --- life cycle ---

    async def start(self) -> None:
        self._closed = False

    async def close(self) -> None:
        if not self._closed:
            self._usage.save(self._admission.book, self._clock.now().timestamp(), force=True)
        self._closed = True
        for run in list(self._runs.values()):
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in self._runs.values() if r.task), return_exceptions=True)
        for run in self._runs.values():
            run.over.set()  # (their logs' follows end: no line comes any more)
        self._runs.clear()

    def set_reachable(self, reachable: bool) -> None:
        self._reachable = reachable
        if reachable:
            self._link_up.set()
        else:
            self._link_up.clear()

    # --- CapacityReporter ---

    async def snapshot(self) -> SiteState:
        self._check_reachable()
        now = self._clock.now()
        busy = power = mem_used = mem_total = 0.0
        gpus = 0
        for use in self._admission.inventory.usage().values():  # O(node groups), not O(GPUs)
            gpus += use.gpus
            busy += use.busy
            power += ids.GPU_MODEL_BY_ID[use.model].tdp_w * (0.1 * use.gpus + 0.9 * use.busy)
            mem_total += use.memory_kib / (1 << 20)
            mem_used += use.used_kib / (1 << 20) * 0.8
        util = min(100.0, 100.0 * busy / gpus) if gpus else 0.0
        state = SiteState(
            site=self.name,
            health=Health.HEALTHY,
            last_heard_at=now,
            capacity=[f.capacity() for _, f in sorted(self._admission.inventory.free().items())],
            telemetry=Telemetry(
                gpu_utilisation_pct=round(util, 2),
                memory_used_gib=round(mem_used, 2),
                memory_total_gib=round(mem_total, 2),
                temperature_c_max=round(35 + 45 * util / 100, 1),
                power_w=round(power, 1),
                queue_depth=len(self._pending),
            ),
            running_jobs=len(self._runs),
            quota=self._admission.report(now.timestamp()),
        )
        self._usage.save(self._admission.book, now.timestamp())
        return state

    # --- QuotaAdmin ---

    async def quota(self) -> QuotaState:
        self._check_reachable()
        return self._admission.report(self._clock.now().timestamp())

    async def set_quota(self, quota: TenantQuota) -> QuotaState:
        self._check_reachable()
        self._admission.book.check(quota)  # a quota it would refuse is not kept either
        self._overrides.set(quota)  # on disk first: a change the site forgets on restart was never made
        now = self._clock.now().timestamp()
        self._admission.set_quota(quota, now)
        return self._admission.report(now)

    async def remove_quota(self, tenant: str) -> QuotaState:
        self._check_reachable()
        if not self._admission.book.has_quota(tenant):
            raise KeyError(f"site {self.name} has no quota for tenant {tenant}")
        self._overrides.remove(tenant)
        now = self._clock.now().timestamp()
        self._admission.remove_quota(tenant, now)
        return self._admission.report(now)

    async def forget_quotas(self) -> None:
        self._overrides.forget()
        self._usage.forget()

    # --- JobRunner ---

    async def submit(self, job: Job) -> Admission:
        self._check_reachable()
        key = (job.id, job.attempt)
        if key in self._runs:
            return Admission.ok()
        if key in self._withdrawn:
            return Admission.rejected(f"attempt {job.attempt} was withdrawn")
        pending = self._pending.get(key)
        if pending is not None:  # the same attempt is being admitted: share its answer
            return await asyncio.shield(pending)
        answer: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._pending[key] = answer
        try:
            await self._clock.sleep(self.config.dispatch_delay_s)
            self._check_reachable()
            if key in self._withdrawn:
                admission = Admission.rejected(f"attempt {job.attempt} was withdrawn")
            else:
                admission = self._admit(job)
            answer.set_result(admission)
            return admission
        except BaseException as e:
            answer.set_exception(e)
            answer.exception()  # retrieved: duplicates re-raise it themselves
            raise
        finally:
            del self._pending[key]

    async def cancel(self, job_id: str, attempt: int) -> None:
        self._check_reachable()
        self._withdrawn[(job_id, attempt)] = self._clock.now()  # final: a submit of it, now or later, is refused
        self._forget_old_tombstones()
        run = self._runs.pop((job_id, attempt), None)
        if run is None:
            return
        self._admission.stop(_admission_key(job_id, attempt), self._clock.now().timestamp())
        self._ended_run(run, "was withdrawn by the broker")
        if run.task is not None and run.task is not asyncio.current_task():
            run.task.cancel()

    async def preempt(self, job_id: str, attempt: int, reason: str) -> None:
        """The broker's request to checkpoint and stop a running attempt (``Preempter``): as the site's own
        preemption, with a ``preempted`` event carrying how long it ran."""
        self._check_reachable()
        if (job_id, attempt) in self._runs:
            self._preempt(_admission_key(job_id, attempt), reason, self._clock.now().timestamp())

    # --- LogReader ---

    async def logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        """The simulated log of an attempt (see the module doc); ``LogsNotFound`` for one the site has not
        started, or whose log is no longer kept."""
        run = self._run_of(job_id, attempt)
        text, cut = tail_text(simulated_log(self.name, run, self._clock.now().timestamp()), tail_lines, limit_bytes)
        return JobLogs(text, cut, f"simulated run at site {self.name}")

    # --- LogFollower ---

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        """The simulated log's tail, then each later line when its time comes on the clock (a progress line at
        each tenth of the planned run, the outcome when it ends), until the attempt ends."""
        run = self._run_of(job_id, attempt)
        text = simulated_log(self.name, run, self._clock.now().timestamp())
        tail, cut = tail_text(text, tail_lines, limit_bytes)
        return LogFollow(cut, f"simulated run at site {self.name}", self._follow(run, tail, len(text)))

    async def _follow(self, run: _Run, tail: str, sent: int) -> AsyncGenerator[str, None]:
        """``tail``, then what the log gains (it only grows: its first ``sent`` characters are out) as the clock
        passes each next line's time, or the run ends, whichever is first."""
        if tail:
            yield tail
        while True:
            over = run.over.is_set()
            text = simulated_log(self.name, run, self._clock.now().timestamp())
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            if over:
                return
            due = self._next_line_s(run)
            ended = asyncio.ensure_future(run.over.wait())
            ticks = [ended] + ([asyncio.ensure_future(self._clock.sleep(due))] if due is not None else [])
            try:
                await asyncio.wait(ticks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for tick in ticks:
                    tick.cancel()

    def _next_line_s(self, run: _Run) -> float | None:
        """Seconds on the clock until the run's next progress line is due (None: none is, before it ends)."""
        planned = run.planned_s
        if planned is None or planned <= 0:
            return None if planned is not None else 0.0  # (its task starts at the next turn of the loop)
        now = self._clock.now().timestamp()
        for step in range(1, PROGRESS_STEPS):
            at = run.started + planned * step / PROGRESS_STEPS
            if at > now:
                return at - now + 0.001  # (a clock's sleep may round to the microsecond: not before the line)
        return None

    def _run_of(self, job_id: str, attempt: int) -> _Run:
        self._check_reachable()
        key = (job_id, attempt)
        run = self._runs.get(key) or self._ended.get(key)
        if run is None:
            why = "it is being admitted" if key in self._pending else \
                f"it never started here, or ended before the latest {LOGS_KEPT} whose logs the site keeps"
            raise LogsNotFound(f"site {self.name} has no log of attempt {attempt} of job {job_id}: {why}")
        return run

    # --- EventSource / AttemptLookup ---

    async def events(self) -> AsyncIterator[JobEvent]:
        while not self._closed:
            event = await self._events.get()
            await self._link_up.wait()
            yield event

    async def known_attempts(self) -> set[tuple[str, int]]:
        self._check_reachable()
        return set(self._runs) | set(self._pending)

    # --- internals ---

    def _forget_old_tombstones(self) -> None:
        """A submission still on its way arrives within seconds; a tombstone older than TOMBSTONE_TTL_S
        can no longer stop anything, so it is dropped (bounded memory in a long-running broker)."""
        if len(self._withdrawn) < 1024:
            return
        cutoff = self._clock.now() - timedelta(seconds=TOMBSTONE_TTL_S)
        for key in [k for k, at in self._withdrawn.items() if at < cutoff]:
            del self._withdrawn[key]

    def _check_reachable(self) -> None:
        if not self._reachable:
            raise AdapterError(f"site {self.name} is unreachable")

    def _admit(self, job: Job) -> Admission:
        now = self._clock.now().timestamp()
        decision = self._admission.admit(_admission_key(job.id, job.attempt), job.spec, now, model=job.gpu_model)
        if not isinstance(decision, Admitted):
            return Admission.rejected(decision.reason)
        for victim in decision.victims:
            self._preempt(victim, f"for job {job.id} of tenant {job.spec.tenant}, which {decision.reason}", now)
        self._admission.start(_admission_key(job.id, job.attempt), decision, now)
        run = _Run(job, now)
        self._runs[(job.id, job.attempt)] = run
        run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"sim-{self.name}-{job.id}")
        return Admission.ok()

    def _preempt(self, victim: str, reason: str, now: float) -> None:
        job_id, _, attempt = victim.rpartition("/")
        run = self._runs.pop((job_id, int(attempt)), None)
        self._admission.stop(victim, now)
        if run is None:
            return
        if run.task is not None:
            run.task.cancel()
        self._ended_run(run, f"was preempted ({reason})")
        self._emit(JobEvent(job_id, int(attempt), EventKind.PREEMPTED, self._clock.now(), reason=reason,
                            run_s=max(now - run.started, 0.0)))

    async def _run(self, run: _Run) -> None:
        job = run.job
        key = (job.id, job.attempt)
        remaining = self._run_seconds(job) - (job.run_s if job.spec.checkpointable else 0.0)
        remaining = max(remaining, 0.0)
        fails = self._rng.random() < self.config.failure_rate
        run_for = remaining * self._rng.random() if fails else remaining
        run.planned_s = remaining
        self._emit(JobEvent(job.id, job.attempt, EventKind.RUNNING, self._clock.now()))
        try:
            await self._clock.sleep(run_for)
        except asyncio.CancelledError:
            return
        if self._runs.pop(key, None) is None:
            return  # cancelled while finishing
        self._admission.stop(_admission_key(job.id, job.attempt), self._clock.now().timestamp())
        self._ended_run(run, "failed (simulated failure)" if fails else "succeeded")
        if fails:
            self._emit(JobEvent(job.id, job.attempt, EventKind.FAILED, self._clock.now(),
                                reason="simulated failure (failure_rate)", run_s=run_for))
        else:
            self._emit(JobEvent(job.id, job.attempt, EventKind.SUCCEEDED, self._clock.now(), run_s=run_for))

    def _ended_run(self, run: _Run, outcome: str) -> None:
        run.ended, run.outcome = self._clock.now().timestamp(), outcome
        run.over.set()
        self._ended[(run.job.id, run.job.attempt)] = run
        while len(self._ended) > LOGS_KEPT:
            self._ended.popitem(last=False)

    def _emit(self, event: JobEvent) -> None:
        self._events.put_nowait(event)
