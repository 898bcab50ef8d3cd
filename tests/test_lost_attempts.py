"""A job its sites keep losing (it brings its node down, it is evicted wherever it runs, every site it fits
withdraws it) fails at its ``max_lost_attempts``-th loss, rather than be requeued for ever; preemptions, moves and
refusals at dispatch do not count, and the count holds across a broker restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.base import EventKind, JobEvent
from adapters.simulated import SimulatedSite
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.losses import lost_attempts
from broker.models import Job, JobState
from broker.service import Broker
from tests.builders import site
from tests.test_cycle import FAST, T0, Harness
from tests.test_faults import RefusingSite, broker_at, brokers, started  # noqa: F401 - brokers: a fixture

ALPHA_AND_BETA = [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST), site("beta", gpus={"a100-80gb": 8}, adapter=FAST)]


class LosingSite(SimulatedSite):
    """A simulated site whose running attempts can be lost, as a Kubernetes site loses one whose node is drained."""

    def lose(self, job_id: str, attempt: int, reason: str = "its node was drained") -> None:
        run = self._runs.pop((job_id, attempt))
        if run.task is not None:
            run.task.cancel()
        self._admission.stop(f"{job_id}/{attempt}", self._clock.now().timestamp())
        self._emit(JobEvent(job_id, attempt, EventKind.LOST, self._clock.now(), reason=reason))


def losing(spec, clock) -> LosingSite:  # noqa: ANN001
    return LosingSite(spec, clock)


async def run_and_lose(h: Harness, job_id: str) -> Job:
    """Place the job, let it start, then have its site lose it; returns the job as it then stands."""
    await h.cycle()
    await h.step(1.0)
    running = await h.job(job_id)
    assert running.state == JobState.RUNNING, running
    h.broker.federation.get(running.site).adapter.lose(job_id, running.attempt)
    await h.quiet()
    return await h.job(job_id)


async def test_a_job_lost_at_every_site_fails_at_its_max_lost_attempts_naming_the_losses_and_the_sites(
        tmp_path, brokers):  # noqa: F811
    h = await started(tmp_path, brokers, ALPHA_AND_BETA, factory=losing)
    j = await h.submit(count=8, duration_s=600, max_lost_attempts=3)
    for _ in range(2):
        again = await run_and_lose(h, j.id)
        assert (again.state, again.failed_attempts) == (JobState.QUEUED, 0)  # requeued, no failure spent
    first = again.reason.split()[0]
    await h.broker.cordon_site(first, True, "drained")  # its third attempt runs at the other site
    failed = await run_and_lose(h, j.id)
    assert failed.state == JobState.FAILED and failed.failed_attempts == 0
    other = ({"alpha", "beta"} - {first}).pop()
    assert failed.reason == (
        f"3 attempts lost, the most max_lost_attempts allows (3): 2 at {first} (attempts 1, 2), 1 at {other} "
        f"(attempt 3); giving up, as it would likely be lost again (a larger max_lost_attempts, or 0, lets it go "
        f"on) (the last: {other} lost attempt 3: its node was drained)")
    assert (await h.states(j.id))[-1] == "failed"
    assert h.free("alpha", "a100-80gb") == 8 and h.free("beta", "a100-80gb") == 8
    lost = {s: h.broker.metrics.registry.get_sample_value("heliotrope_lost_attempts_total", {"site": s})
            for s in (first, other)}
    assert lost == {first: 2.0, other: 1.0}  # /metrics counts them by site
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.FAILED  # not placed again


async def test_a_checkpointable_job_preempted_again_and_again_is_never_failed_and_its_losses_alone_count(
        tmp_path, brokers):  # noqa: F811
    h = await started(tmp_path, brokers, ALPHA_AND_BETA, factory=losing)
    j = await h.submit(count=8, duration_s=3600, checkpointable=True, preemptible=True, max_lost_attempts=2)
    for _ in range(5):
        await h.cycle()
        await h.step(1.0)
        running = await h.job(j.id)
        assert running.state == JobState.RUNNING
        await h.step(60)
        await h.broker.federation.get(running.site).adapter.preempt(j.id, running.attempt, "reclaimed")
        await h.quiet()
        assert (await h.job(j.id)).state == JobState.QUEUED
    kept = await h.job(j.id)
    assert kept.attempt == 5 and kept.run_s >= 5 * 60  # the work of every preempted attempt is kept
    once = await run_and_lose(h, j.id)
    assert once.state == JobState.QUEUED  # one loss of two allowed: five preemptions did not count
    assert (await run_and_lose(h, j.id)).state == JobState.FAILED


async def test_refusals_at_dispatch_do_not_count_as_losses(tmp_path, brokers):  # noqa: F811
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)],
                      factory=lambda spec, c: RefusingSite(spec, c))
    j = await h.submit(max_lost_attempts=1)
    for _ in range(4):
        await h.cycle()
        await h.step(1.0)
        assert (await h.job(j.id)).state == JobState.QUEUED
        await h.step(h.broker.book.refusal_ttl_s + 1)
    assert (await h.job(j.id)).attempt == 4


@pytest.mark.parametrize(
    ("broker_default", "spec", "losses", "state"),
    [
        pytest.param(2, {}, 2, JobState.FAILED, id="the broker's max_lost_attempts applies where the spec has none"),
        pytest.param(2, {"max_lost_attempts": 3}, 2, JobState.QUEUED, id="the spec's own bound overrides it"),
        pytest.param(2, {"max_lost_attempts": 0}, 4, JobState.QUEUED, id="a spec's 0 means no bound"),
        pytest.param(0, {}, 4, JobState.QUEUED, id="the broker's 0 means no bound"),
        pytest.param(None, {}, 4, JobState.QUEUED, id="the broker's null means no bound"),
    ],
)
async def test_which_bound_applies(tmp_path: Path, broker_default: int | None, spec: dict, losses: int,
                                   state: JobState) -> None:
    clock = ManualClock(T0)
    b = Broker(BrokerSettings(db=str(tmp_path / "h.db"), shutdown_grace_s=0.1, max_lost_attempts=broker_default),
               clock=clock, factory=lambda spec: LosingSite(spec, clock))
    await b.start(ALPHA_AND_BETA, run_loop=False)
    try:
        h = Harness(b, clock)
        j = await h.submit(count=8, duration_s=600, **spec)
        for _ in range(losses):
            last = await run_and_lose(h, j.id)
        assert last.state == state
    finally:
        await b.stop()


def test_the_broker_allows_ten_losses_by_default() -> None:
    assert BrokerSettings().max_lost_attempts == 10


async def test_the_losses_are_counted_across_a_restart_with_those_a_site_forgot_meanwhile(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    first = broker_at(tmp_path, clock, losing)
    await first.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    h = Harness(first, clock)
    j = await h.submit(duration_s=600, max_lost_attempts=2)
    assert (await run_and_lose(h, j.id)).state == JobState.QUEUED
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING
    await first.stop()
    # The next broker's site does not know attempt 2 (the site restarted too): a second loss, and the last allowed.
    second = broker_at(tmp_path, clock, losing)
    await second.start(run_loop=False)
    try:
        failed = await Harness(second, clock).job(j.id)
        assert failed.state == JobState.FAILED, failed.reason
        assert failed.reason.startswith("2 attempts lost, the most max_lost_attempts allows (2): 2 at alpha "
                                        "(attempts 1, 2)")
        assert "no longer knows it after a broker restart" in failed.reason
    finally:
        await second.stop()


async def test_a_job_lost_while_dispatching_at_its_last_allowed_loss_fails_from_the_queue(
        tmp_path, brokers):  # noqa: F811
    # The site's report of the loss overtook its answer to the dispatch. A dispatching job has no edge to failed:
    # the loss is stored as a requeue, then the job fails; the site's late answer finds it gone.
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    j = await h.submit(max_lost_attempts=1)
    await h.cycle()
    assert (await h.job(j.id)).state == JobState.DISPATCHING
    await h.broker.lifecycle.on_event("alpha", JobEvent(j.id, 1, EventKind.LOST, h.clock.now(), reason="gone"))
    await h.step(1.0)
    failed = await h.job(j.id)
    assert failed.state == JobState.FAILED
    assert (await h.states(j.id))[-2:] == ["queued", "failed"]
    assert failed.reason.startswith("1 attempt lost, the most max_lost_attempts allows (1): 1 at alpha (attempt 1)")
    await h.broker.lifecycle.settle(force=True)
    assert await h.broker.federation.get("alpha").adapter.known_attempts() == set()


@pytest.mark.parametrize(
    ("reason", "lost"),
    [
        pytest.param("alpha lost attempt 3: its node was drained", {3: "alpha"}, id="a site's lost event"),
        pytest.param("alpha no longer knows attempt 3 after a broker restart; requeued", {3: "alpha"},
                     id="an attempt a site forgot across a restart, as earlier releases wrote it"),
        pytest.param("site alpha is no longer registered; requeued", {3: "alpha"},
                     id="an attempt left on a site removed while no broker ran, as earlier releases wrote it"),
        pytest.param("alpha refused it: no room; routing again", {}, id="a refusal at dispatch is not a loss"),
        pytest.param("requeued after preemption from its checkpoint", {}, id="a preemption is not a loss"),
        pytest.param("attempt 3 on alpha failed (exit 1); requeued (1 of 3 attempts failed)", {},
                     id="a failure is not a loss"),
        pytest.param("dispatch to alpha was cut off by a restart; requeued", {},
                     id="a dispatch the broker withdrew after a restart is not a loss"),
    ],
)
def test_which_stored_requeues_count_as_losses(reason: str, lost: dict[int, str]) -> None:
    history = [{"at": T0.isoformat(), "state": "queued", "site": None, "attempt": 0, "reason": "submitted"},
               {"at": T0.isoformat(), "state": "queued", "site": None, "attempt": 3, "reason": reason}]
    assert lost_attempts(history) == lost


def test_a_loss_counts_once_however_often_its_requeue_was_stored() -> None:
    row = {"at": T0.isoformat(), "state": "queued", "site": None, "attempt": 1, "reason": "beta lost attempt 1: x"}
    assert lost_attempts([row, dict(row)]) == {1: "beta"}
