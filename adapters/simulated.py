"""A simulated site: it owns GPUs as the site spec describes them and runs each admitted job for its
duration on the injected clock, so the live broker (system clock) and tests or the simulator (manual
clock) drive it the same way.

- Admission: after ``dispatch_delay_s`` the site admits the attempt if its GPUs fit now, else it rejects
  it with a reason. A repeated submission of the same (job id, attempt) is admitted once.
- Allocation: whole-GPU jobs take GPUs with nothing on them; a fractional job (``milli`` < 1000) goes on
  the fullest shared GPU it fits on (best fit), else on an empty GPU.
- Failures: each attempt fails with probability ``failure_rate`` at a uniformly random point of its run,
  from a generator seeded by ``seed``, so runs repeat exactly.
- Telemetry is modelled from allocation: utilisation follows the share of GPU in use, power goes from
  10% of board power idle to 100% busy, temperature from 35 °C idle to 80 °C busy.
- ``set_reachable(False)`` makes the site unreachable (every call raises ``AdapterError`` and events are
  held back until it is reachable again), for fault tests; its running jobs keep running, as a real
  partitioned site's would.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from adapters.base import AdapterError, Admission, EventKind, JobEvent
from broker import ids
from broker.clock import Clock
from broker.models import Health, Job, ModelCapacity, SimulatedAdapterConfig, SiteSpec, SiteState, Telemetry


TOMBSTONE_TTL_S = 3600.0  # far longer than any dispatch timeout


@dataclass(slots=True)
class _Run:
    job: Job
    model: str
    gpus: list[int]  # indices into the model's GPU list
    milli: int
    task: asyncio.Task[None] | None = None


class SimulatedSite:
    def __init__(
        self,
        spec: SiteSpec,
        clock: Clock,
        config: SimulatedAdapterConfig | None = None,
        run_seconds: Callable[[Job], float] | None = None,
    ) -> None:
        """``run_seconds(job)`` is how long a job really runs; by default its ``duration_s``. The simulator
        passes the trace's true duration, while the policies see only the estimate in the spec."""
        self.spec = spec
        self._run_seconds = run_seconds or (lambda job: job.spec.duration_s)
        self.name = spec.name
        self.config = config or spec.adapter
        self._clock = clock
        self._rng = random.Random(self.config.seed)
        self._used: dict[str, list[int]] = {m: [0] * n for m, n in spec.total_gpus().items()}
        self._memory: dict[str, float] = {}
        for g in spec.gpus:
            self._memory[g.model] = max(self._memory.get(g.model, 0.0), g.gpu_memory_gib)
        self._runs: dict[tuple[str, int], _Run] = {}
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
        self._closed = True
        for run in list(self._runs.values()):
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in self._runs.values() if r.task), return_exceptions=True)
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
        capacity = []
        busy_milli = 0
        total = 0
        power = 0.0
        mem_used = 0.0
        mem_total = 0.0
        for model, used in self._used.items():
            shared = [1000 - u for u in used if 0 < u < 1000]
            capacity.append(
                ModelCapacity(
                    model=model,
                    total_gpus=len(used),
                    free_gpus=sum(1 for u in used if u == 0),
                    used_gpus=sum(1 for u in used if u > 0),
                    shared_free_milli=max(shared, default=0),
                    memory_gib_per_gpu=self._memory[model],
                )
            )
            tdp = ids.GPU_MODEL_BY_ID[model].tdp_w
            for u in used:
                share = u / 1000
                power += tdp * (0.1 + 0.9 * share)
                mem_used += self._memory[model] * share * 0.8
            busy_milli += sum(used)
            total += len(used)
            mem_total += self._memory[model] * len(used)
        util = busy_milli / (10 * total) if total else 0.0
        return SiteState(
            site=self.name,
            health=Health.HEALTHY,
            last_heard_at=self._clock.now(),
            capacity=capacity,
            telemetry=Telemetry(
                gpu_utilisation_pct=round(util, 2),
                memory_used_gib=round(mem_used, 2),
                memory_total_gib=mem_total,
                temperature_c_max=round(35 + 45 * util / 100, 1),
                power_w=round(power, 1),
                queue_depth=len(self._pending),
            ),
            running_jobs=len(self._runs),
        )

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
            placed = f"attempt {job.attempt} was withdrawn" if key in self._withdrawn else self._allocate(job)
            if isinstance(placed, str):
                admission = Admission.rejected(placed)
            else:
                model, gpus, milli = placed
                run = _Run(job, model, gpus, milli)
                self._runs[key] = run
                run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"sim-{self.name}-{job.id}")
                admission = Admission.ok()
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
        self._release(run)
        if run.task is not None and run.task is not asyncio.current_task():
            run.task.cancel()

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

    def _allocate(self, job: Job) -> tuple[str, list[int], int] | str:
        g = job.spec.gpus
        chosen = job.gpu_model or g.model  # the broker names the model it placed the job on
        models = [chosen] if chosen else sorted(self._used, key=lambda m: self._memory[m])
        reasons = []
        for model in models:
            used = self._used.get(model)
            if used is None:
                reasons.append(f"no {model} at this site")
                continue
            if g.memory_gib and self._memory[model] < g.memory_gib:
                reasons.append(f"{model} has {self._memory[model]:g} GiB per GPU, job needs {g.memory_gib:g}")
                continue
            if g.milli < 1000:
                fitting = [i for i, u in enumerate(used) if 0 < u and u + g.milli <= 1000]
                if fitting:
                    best = max(fitting, key=lambda i: used[i])
                else:
                    empty = [i for i, u in enumerate(used) if u == 0]
                    if not empty:
                        reasons.append(f"no {model} has {g.milli}/1000 free")
                        continue
                    best = empty[0]
                used[best] += g.milli
                return model, [best], g.milli
            empty = [i for i, u in enumerate(used) if u == 0]
            if len(empty) < g.count:
                reasons.append(f"{g.count} {model} needed, {len(empty)} free")
                continue
            chosen = empty[: g.count]
            for i in chosen:
                used[i] = 1000
            return model, chosen, 1000
        return "no room: " + "; ".join(reasons)

    def _release(self, run: _Run) -> None:
        used = self._used[run.model]
        for i in run.gpus:
            used[i] -= run.milli

    async def _run(self, run: _Run) -> None:
        job = run.job
        key = (job.id, job.attempt)
        remaining = self._run_seconds(job) - (job.run_s if job.spec.checkpointable else 0.0)
        remaining = max(remaining, 0.0)
        fails = self._rng.random() < self.config.failure_rate
        run_for = remaining * self._rng.random() if fails else remaining
        self._emit(JobEvent(job.id, job.attempt, EventKind.RUNNING, self._clock.now()))
        try:
            await self._clock.sleep(run_for)
        except asyncio.CancelledError:
            return
        if self._runs.pop(key, None) is None:
            return  # cancelled while finishing
        self._release(run)
        if fails:
            self._emit(JobEvent(job.id, job.attempt, EventKind.FAILED, self._clock.now(),
                                reason="simulated failure (failure_rate)", run_s=run_for))
        else:
            self._emit(JobEvent(job.id, job.attempt, EventKind.SUCCEEDED, self._clock.now(), run_s=run_for))

    def _emit(self, event: JobEvent) -> None:
        self._events.put_nowait(event)
