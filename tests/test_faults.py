"""Faults around the cycle: failed writes, lost dispatch answers, sites that cannot answer after a
restart, expiring refusals. Each test states what a user would otherwise see go wrong."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.base import AdapterError, Admission
from adapters.simulated import SimulatedSite
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.models import Job, JobState, ModelCapacity, SimulatedAdapterConfig
from broker.service import Broker
from broker.store import StoreError
from tests.builders import job, site
from tests.test_cycle import FAST, T0, Harness


class LostAnswerSite(SimulatedSite):
    """Admits the attempt, then the connection drops before the answer arrives."""

    lose_answers = True

    async def submit(self, job: Job) -> Admission:
        admission = await super().submit(job)
        if self.lose_answers:
            self.set_reachable(False)
            raise AdapterError("connection reset")
        return admission


def broker_at(tmp_path: Path, clock: ManualClock, factory=None) -> Broker:
    return Broker(
        BrokerSettings(db=str(tmp_path / "h.db"), shutdown_grace_s=0.1),
        clock=clock,
        factory=(lambda spec: factory(spec, clock)) if factory else None,
    )


@pytest.fixture
async def brokers():
    started: list[Broker] = []
    yield started
    for b in started:
        await b.stop()


async def test_a_dispatch_whose_answer_was_lost_is_not_placed_elsewhere_until_the_site_confirms_it_dropped_it(
    tmp_path, brokers
):
    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock, lambda spec, c: (LostAnswerSite if spec.name == "alpha" else SimulatedSite)(spec, c))
    await b.start([site("alpha", gpus={"a100-80gb": 16}, adapter=FAST), site("beta", gpus={"a100-80gb": 8}, adapter=FAST)],
                  run_loop=False)
    brokers.append(b)
    h = Harness(b, clock)
    alpha = b.federation.get("alpha").adapter
    j = await h.submit(count=8, duration_s=600)
    await h.cycle()
    await h.step(1.0)
    # alpha runs the attempt, but the broker never heard "admitted" and cannot reach alpha to withdraw it.
    assert (await h.job(j.id)).state == JobState.DISPATCHING
    for _ in range(3):
        await b.cycle.settle()
        await h.cycle()
        await h.step(1.0)
    still = await h.job(j.id)
    assert still.state == JobState.DISPATCHING and still.site == "alpha", "it must not start a second copy on beta"
    # The partition heals: the withdrawal is confirmed, and only then does the job move on.
    alpha.lose_answers = False
    alpha.set_reachable(True)
    await b.cycle.settle()
    await h.quiet()
    assert (await h.job(j.id)).state == JobState.QUEUED
    assert await alpha.known_attempts() == set()
    await h.cycle()
    await h.step(1.0)
    moved = await h.job(j.id)
    assert moved.state == JobState.RUNNING and moved.attempt == 2


async def test_a_sites_event_is_kept_when_the_store_fails_to_write_it_once(tmp_path, brokers):
    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock)
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    brokers.append(b)
    h = Harness(b, clock)
    real_update = b.store.update_job
    failed = []

    async def flaky_update(job, expected_version, event_reason=None, decision=None):
        if job.state == JobState.SUCCEEDED and not failed:
            failed.append(job.id)
            raise StoreError("database is locked")
        return await real_update(job, expected_version, event_reason, decision)

    b.store.update_job = flaky_update  # type: ignore[method-assign]
    j = await h.submit(duration_s=60)
    await h.cycle()
    await h.step(1.0)
    await h.step(60)
    await asyncio.sleep(0.5)  # the pump retries with backoff
    assert failed == [j.id]
    done = await h.job(j.id)
    assert done.state == JobState.SUCCEEDED
    assert (await b.store.get_job(j.id)).state == JobState.SUCCEEDED  # on disk too, not only in memory


async def test_a_failed_cancel_write_leaves_the_job_as_stored_and_a_retry_succeeds(tmp_path, brokers):
    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock)
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    brokers.append(b)
    h = Harness(b, clock)
    j = await h.submit(duration_s=600)
    real_update = b.store.update_job

    async def broken_update(job, expected_version, event_reason=None, decision=None):
        raise StoreError("disk full")

    b.store.update_job = broken_update  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        await b.lifecycle.cancel(j.id)
    assert (await h.job(j.id)).state == JobState.QUEUED  # memory did not run ahead of the disk
    b.store.update_job = real_update  # type: ignore[method-assign]
    assert (await b.lifecycle.cancel(j.id)).state == JobState.CANCELLED
    assert (await b.store.get_job(j.id)).state == JobState.CANCELLED


async def test_jobs_on_a_site_that_cannot_answer_after_a_restart_are_requeued_once_it_does(tmp_path, brokers):
    clock = ManualClock(T0)
    first = broker_at(tmp_path, clock)
    await first.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    h = Harness(first, clock)
    j = await h.submit(duration_s=600)
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING
    await first.stop()

    class DownSite(SimulatedSite):
        def __init__(self, spec, c):
            super().__init__(spec, c)
            self.set_reachable(False)

    second = broker_at(tmp_path, clock, lambda spec, c: DownSite(spec, c))
    await second.start(run_loop=False)
    brokers.append(second)
    h2 = Harness(second, clock)
    assert (await h2.job(j.id)).state == JobState.RUNNING  # unknown yet: the site cannot say
    assert second.lifecycle.pending_sites == {"alpha"}
    second.federation.get("alpha").adapter.set_reachable(True)
    await second.lifecycle.reconcile_pending()
    requeued = await h2.job(j.id)
    assert requeued.state == JobState.QUEUED and "no longer knows attempt 1" in requeued.reason
    assert second.lifecycle.pending_sites == set()


async def test_an_expired_refusal_causes_one_full_pass_not_a_full_pass_every_time(tmp_path, brokers):
    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock)
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    brokers.append(b)
    b.cycle.full_pass_interval_s = 3600
    await b.cycle.run_once()
    b.book.refuse("some-job", "alpha", "no room")
    await clock.advance(b.book.refusal_ttl_s + 1)
    assert (await b.cycle.run_once()).full
    assert not (await b.cycle.run_once()).full
    assert not (await b.cycle.run_once()).full


async def test_a_duplicate_submission_of_a_pending_attempt_gets_the_same_answer(tmp_path):
    clock = ManualClock(T0)
    sim = SimulatedSite(site("alpha", gpus={"a100-80gb": 8}), clock, SimulatedAdapterConfig(dispatch_delay_s=1))
    big = Job(id="j1", spec=job(count=16), created_at=T0, updated_at=T0, attempt=1)
    first = asyncio.create_task(sim.submit(big))
    second = asyncio.create_task(sim.submit(big))
    await clock.advance(1.0)
    answers = [await first, await second]
    assert [a.admitted for a in answers] == [False, False]
    assert answers[0].reason == answers[1].reason
    assert await sim.known_attempts() == set()


async def test_a_site_reporting_a_vendor_gpu_name_is_understood_and_a_garbled_one_fails_only_that_site(tmp_path, brokers):
    assert ModelCapacity(model="NVIDIA A100-SXM4-80GB", total_gpus=8, free_gpus=8, used_gpus=0,
                         memory_gib_per_gpu=80).model == "a100-80gb"

    class GarbledSite(SimulatedSite):
        async def snapshot(self):
            state = await super().snapshot()
            return state.model_validate({**state.model_dump(), "capacity": [
                {**c.model_dump(), "model": "GPU-X 9000"} for c in state.capacity]})

    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock, lambda spec, c: (GarbledSite if spec.name == "bad" else SimulatedSite)(spec, c))
    await b.start([site("bad", gpus={"a100-80gb": 8}, adapter=FAST), site("good", gpus={"a100-80gb": 8}, adapter=FAST)],
                  run_loop=False)
    brokers.append(b)
    h = Harness(b, clock)
    j = await h.submit()
    await h.cycle()
    assert (await h.job(j.id)).site == "good"
    bad = b.federation.get("bad").public_state()
    assert bad.health != "healthy" and "unknown GPU model 'GPU-X 9000'" in (bad.reason or "")
