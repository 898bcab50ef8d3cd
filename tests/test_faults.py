"""Faults around the cycle: failed writes, lost dispatch answers, sites that cannot answer after a
restart, expiring refusals. Each test states what a user would otherwise see go wrong."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.base import AdapterError, Admission
from adapters.simulated import SimulatedSite
from broker.clock import ManualClock, SystemClock
from broker.config import BrokerSettings
from broker.models import Job, JobState, ModelCapacity, SimulatedAdapterConfig
from broker.service import Broker
from broker.store import JobFilter, StoreError
from broker.store.memory import MemoryStore
from tests.builders import job, site
from tests.test_cycle import FAST, T0, Harness, fail_first_write, failing_writes


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


def two_sites() -> list:
    """alpha with 16 A100-80GB, beta with 8, both simulated with a 1 s dispatch delay."""
    return [site("alpha", gpus={"a100-80gb": 16}, adapter=FAST), site("beta", gpus={"a100-80gb": 8}, adapter=FAST)]


async def started(tmp_path: Path, brokers: list[Broker], sites: list, factory=None) -> Harness:
    """A broker on a manual clock with ``sites``, started without its loop, stopped after the test."""
    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock, factory)
    await b.start(sites, run_loop=False)
    brokers.append(b)
    return Harness(b, clock)


@pytest.fixture
async def brokers():
    started: list[Broker] = []
    yield started
    for b in started:
        await b.stop()


async def test_a_dispatch_whose_answer_was_lost_is_not_placed_elsewhere_until_the_site_confirms_it_dropped_it(
    tmp_path, brokers
):
    h = await started(
        tmp_path, brokers, two_sites(),
        factory=lambda spec, c: (LostAnswerSite if spec.name == "alpha" else SimulatedSite)(spec, c),
    )
    b = h.broker
    alpha = b.federation.get("alpha").adapter
    j = await h.submit(count=8, duration_s=600)
    await h.cycle()
    await h.step(1.0)
    # alpha runs the attempt, but the broker never heard "admitted" and cannot reach alpha to withdraw it.
    assert (await h.job(j.id)).state == JobState.DISPATCHING
    for _ in range(3):
        await b.lifecycle.settle(force=True)
        await h.cycle()
        await h.step(1.0)
    still = await h.job(j.id)
    assert still.state == JobState.DISPATCHING and still.site == "alpha", "it must not start a second copy on beta"
    # The partition heals: the withdrawal is confirmed, and only then does the job move on.
    alpha.lose_answers = False
    alpha.set_reachable(True)
    await b.lifecycle.settle(force=True)
    await h.quiet()
    assert (await h.job(j.id)).state == JobState.QUEUED
    assert await alpha.known_attempts() == set()
    await h.cycle()
    await h.step(1.0)
    moved = await h.job(j.id)
    assert moved.state == JobState.RUNNING and moved.attempt == 2


async def test_a_sites_event_is_kept_when_the_store_fails_to_write_it_once(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    failed = fail_first_write(b.store, JobState.SUCCEEDED)
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
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    j = await h.submit(duration_s=600)
    restore = failing_writes(b.store, lambda job: StoreError("disk full"))
    with pytest.raises(StoreError):
        await b.lifecycle.cancel(j.id)
    assert (await h.job(j.id)).state == JobState.QUEUED  # memory did not run ahead of the disk
    restore()
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
    assert set(second.lifecycle.pending_sites) == {"alpha"}
    second.federation.get("alpha").adapter.set_reachable(True)
    await second.lifecycle.settle(force=True)
    requeued = await h2.job(j.id)
    assert requeued.state == JobState.QUEUED and "alpha lost attempt 1: the site no longer knows it" in requeued.reason
    assert not second.lifecycle.pending_sites


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

    h = await started(
        tmp_path, brokers,
        [site("bad", gpus={"a100-80gb": 8}, adapter=FAST), site("good", gpus={"a100-80gb": 8}, adapter=FAST)],
        factory=lambda spec, c: (GarbledSite if spec.name == "bad" else SimulatedSite)(spec, c),
    )
    b = h.broker
    j = await h.submit()
    await h.cycle()
    assert (await h.job(j.id)).site == "good"
    bad = b.federation.get("bad").public_state()
    assert bad.health != "healthy" and "unknown GPU model 'GPU-X 9000'" in (bad.reason or "")


# --- second review: reconciliation, withdrawals, backoff ---


class SlowLinkSite(SimulatedSite):
    """Unreachable at first; its attempts can be listed only once it is back."""

    def __init__(self, spec, clock):
        super().__init__(spec, clock)
        self.set_reachable(False)


async def test_a_job_placed_on_a_site_after_it_comes_back_is_not_requeued_by_the_old_reconciliation(tmp_path, brokers):
    clock = ManualClock(T0)
    first = broker_at(tmp_path, clock)
    await first.start(two_sites(), run_loop=False)
    h = Harness(first, clock)
    old = await h.submit(name="old", duration_s=600, allowed_regions=["gcp:us-east1"])
    await h.cycle()
    await h.step(1.0)
    await first.stop()

    second = broker_at(tmp_path, clock, lambda spec, c: SlowLinkSite(spec, c))
    await second.start(run_loop=False)
    brokers.append(second)
    h2 = Harness(second, clock)
    for name in ("alpha", "beta"):
        second.federation.get(name).adapter.set_reachable(True)
    new = await h2.submit(name="new", count=8, duration_s=600)
    await h2.cycle()  # the new job is dispatched to a site that is back
    placed_on = (await h2.job(new.id)).site
    await second.lifecycle.settle(force=True)  # reconciles only what the sites had at start-up
    await h2.step(1.0)
    await h2.cycle()
    await h2.step(1.0)
    now_new = await h2.job(new.id)
    assert now_new.state == JobState.RUNNING and now_new.site == placed_on and now_new.attempt == 1
    runs = {name: await second.federation.get(name).adapter.known_attempts() for name in ("alpha", "beta")}
    assert sum((new.id, a) in runs[s] for s in runs for a in (1, 2)) == 1, f"the new job runs once: {runs}"
    assert (await h2.job(old.id)).attempt == 2  # the old one was requeued and placed again


async def a_preemptible_job_running(tmp_path, brokers):  # noqa: ANN001, ANN201
    """A broker with one site running one preemptible job: (harness, broker, job)."""
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    j = await h.submit(duration_s=600, preemptible=True)
    await h.cycle()
    await h.step(1.0)
    return h, h.broker, j


async def test_a_half_applied_preemption_is_requeued_when_the_event_is_retried(tmp_path, brokers):
    from adapters.base import EventKind, JobEvent

    h, b, j = await a_preemptible_job_running(tmp_path, brokers)
    restore = failing_writes(
        b.store, lambda job: StoreError("database is locked") if job.state == JobState.QUEUED else None
    )
    ev = JobEvent(j.id, 1, EventKind.PREEMPTED, T0, reason="higher priority job")
    with pytest.raises(StoreError):
        await b.lifecycle.on_event("alpha", ev)
    assert (await h.job(j.id)).state == JobState.PREEMPTED
    restore()
    await b.lifecycle.on_event("alpha", ev)  # what the pump's retry does
    assert (await h.job(j.id)).state == JobState.QUEUED


async def test_a_preemption_whose_write_is_retried_is_counted_and_told_once(tmp_path, brokers):
    from adapters.base import EventKind, JobEvent

    h, b, j = await a_preemptible_job_running(tmp_path, brokers)
    assert b.book.events is not None
    sub, _, _ = b.book.events.subscribe(lambda event: event.type == "preemption")
    before = b.metrics.preemptions.labels("alpha")._value.get()
    restore = failing_writes(
        b.store, lambda job: StoreError("database is locked") if job.state == JobState.PREEMPTED else None
    )
    ev = JobEvent(j.id, 1, EventKind.PREEMPTED, T0, reason="higher priority job")
    with pytest.raises(StoreError):
        await b.lifecycle.on_event("alpha", ev)  # the write of "preempted" fails: nothing happened yet
    restore()
    await b.lifecycle.on_event("alpha", ev)  # what the pump's retry does
    assert (await h.job(j.id)).state == JobState.QUEUED
    assert b.metrics.preemptions.labels("alpha")._value.get() - before == 1
    told = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [e.data["job_id"] for e in told] == [j.id]
    sub.close()


async def test_when_the_store_can_neither_write_nor_read_memory_keeps_the_last_good_state(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    j = await h.submit(duration_s=600)

    async def broken(*args, **kwargs):
        raise StoreError("I/O error")

    real_get = b.store.get_job
    failing_writes(b.store, lambda job: StoreError("I/O error"))
    b.store.get_job = broken  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        await b.lifecycle.cancel(j.id)
    assert b.book.active[j.id].state == JobState.QUEUED
    b.store.get_job = real_get  # type: ignore[method-assign]


async def test_a_cancel_the_site_cannot_hear_is_retried_until_the_site_drops_the_job(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    j = await h.submit(count=8, duration_s=86400)
    await h.cycle()
    await h.step(1.0)
    alpha = b.federation.get("alpha").adapter
    alpha.set_reachable(False)
    assert (await b.lifecycle.cancel(j.id)).state == JobState.CANCELLED
    assert b.lifecycle.withdrawals == {(j.id, 1): "alpha"}
    alpha.set_reachable(True)
    await b.lifecycle.settle(force=True)
    assert b.lifecycle.withdrawals == {}
    assert await alpha.known_attempts() == set()  # its 8 GPUs are free again


async def test_a_withdrawal_left_to_settle_is_sent_by_the_broker_that_restarts_before_the_site_confirmed_it(
        tmp_path, brokers):
    """A cancel of many waits for a site only until its bound, and settle retries the rest from memory: a broker
    that restarts meanwhile still has the site drop the cancelled job's attempt (whose 8 GPUs it held for ever),
    and leaves the attempts of jobs it has still there, and those of jobs it never had, alone."""
    clock = ManualClock(T0)
    kept: dict[str, SimulatedSite] = {}

    class KeptSite(SimulatedSite):
        async def close(self) -> None:
            """The site runs on while its broker restarts."""

    def factory(spec, c):
        return kept.setdefault(spec.name, KeptSite(spec, c))

    first = broker_at(tmp_path, clock, factory)
    await first.start([site("alpha", gpus={"a100-80gb": 16}, adapter=FAST)], run_loop=False)
    h = Harness(first, clock)
    gone, stays = await h.submit(name="gone", count=8, duration_s=86400), await h.submit(name="stays", count=4,
                                                                                          duration_s=86400)
    await h.cycle()
    await h.step(1.0)
    alpha = kept["alpha"]
    alpha.set_reachable(False)
    assert (await first.lifecycle.cancel(gone.id, withdraw_within_s=0.0)).state == JobState.CANCELLED
    assert first.lifecycle.withdrawals == {(gone.id, 1): "alpha"}
    await first.stop()
    alpha.set_reachable(True)
    theirs = asyncio.create_task(alpha.submit(Job(id="another-brokers", spec=job(count=2), created_at=T0,
                                                  updated_at=T0, attempt=1)))
    await clock.advance(1.0)
    assert (await theirs).admitted
    second = broker_at(tmp_path, clock, factory)
    await second.start(run_loop=False)
    brokers.append(second)
    await second.lifecycle.settle(force=True)
    assert await alpha.known_attempts() == {(stays.id, 1), ("another-brokers", 1)}  # gone's 8 GPUs are free
    assert (await Harness(second, clock).job(stays.id)).state == JobState.RUNNING


async def test_a_site_that_never_answers_does_not_hold_up_start_up(tmp_path, brokers):
    class HangingSite(SimulatedSite):
        async def known_attempts(self):
            await asyncio.Event().wait()

    clock = ManualClock(T0)
    first = broker_at(tmp_path, clock)
    await first.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    await Harness(first, clock).submit(duration_s=600)
    await first.cycle.run_once()
    await first.stop()
    second = Broker(BrokerSettings(db=str(tmp_path / "h.db"), shutdown_grace_s=0.1, dispatch_timeout_s=0.2),
                    clock=clock, factory=lambda spec: HangingSite(spec, clock))
    await asyncio.wait_for(second.start(run_loop=False), 5)
    brokers.append(second)
    assert set(second.lifecycle.pending_sites) == {"alpha"}


async def test_retries_to_a_dead_site_back_off(tmp_path, brokers):
    calls = []

    class DeadSite(SimulatedSite):
        async def cancel(self, job_id, attempt):
            calls.append(job_id)
            raise AdapterError("connection refused")

    clock = ManualClock(T0)
    b = broker_at(tmp_path, clock, lambda spec, c: DeadSite(spec, c))
    await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    brokers.append(b)
    for i in range(50):
        fake = Job(id=f"j{i}", spec=job(), created_at=T0, updated_at=T0, attempt=1, site="alpha")
        assert not await b.lifecycle.withdraw(fake, "alpha")
    calls.clear()
    for _ in range(20):
        await b.lifecycle.settle()
    assert len(calls) <= 1, f"{len(calls)} calls to a site that is down"


async def test_a_site_being_removed_is_offered_to_no_job(tmp_path, brokers):
    h = await started(tmp_path, brokers, two_sites())
    b = h.broker
    b.federation.set_leaving("alpha", True)
    j = await h.submit(count=1)
    await h.cycle()
    assert (await h.job(j.id)).site == "beta"


def test_an_undo_made_stale_by_a_later_change_is_not_applied():
    from broker.jobs import JobBook

    book = JobBook(store=None, clock=ManualClock(T0))  # type: ignore[arg-type]
    j = Job(id="j", spec=job(), created_at=T0, updated_at=T0)
    book.active["j"] = j
    first, _ = book.apply("j", JobState.DISPATCHING, site="a", attempt=1)
    mark = book.mark("j")
    book.apply("j", JobState.CANCELLED)  # a later change, written separately
    assert not book.undo(j, mark)
    assert "j" not in book.active


# --- third review: requeue retries, site text, write order, in-flight accounting ---


class RefusingSite(SimulatedSite):
    reason = "no room"

    async def submit(self, job):
        return Admission.rejected(self.reason)


async def test_a_requeue_whose_write_fails_is_retried_until_it_lands(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)],
                      factory=lambda spec, c: RefusingSite(spec, c))
    b = h.broker
    j = await h.submit()
    restore = failing_writes(b.store, lambda job: StoreError("locked") if job.state == JobState.QUEUED else None)
    await h.cycle()
    await h.step(1.0)
    assert (await b.store.get_job(j.id)).state == JobState.DISPATCHING  # the requeue did not land
    restore()
    await b.lifecycle.settle(force=True)
    assert (await b.store.get_job(j.id)).state == JobState.QUEUED
    assert b.book.active[j.id].state == JobState.QUEUED


async def test_a_refusal_reason_with_broken_unicode_is_stored_cleaned(tmp_path, brokers):
    class Garbled(RefusingSite):
        reason = "quota \udc80 exceeded"

    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)],
                      factory=lambda spec, c: Garbled(spec, c))
    j = await h.submit()
    await h.cycle()
    await h.step(1.0)
    stored = await h.broker.store.get_job(j.id)
    assert stored.state == JobState.QUEUED and "quota ? exceeded" in stored.reason


async def test_a_cancel_arriving_while_a_pass_is_deciding_lands_after_the_placement(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    # More than one yield's worth of jobs, all created at one manual-clock instant; the highest priority
    # makes the victim the first one decided, whatever the ids' order.
    first = await h.submit(name="victim", count=1, priority=10)
    for i in range(299):
        await h.submit(name=f"j{i}", count=1)
    outcome = {}

    async def cancel_at_first_yield():
        # Wait until the pass has placed the job in memory and yields mid-loop, before its write lands.
        for _ in range(100_000):
            await asyncio.sleep(0)
            if b.book.active[first.id].state == JobState.DISPATCHING:
                break
        outcome["seen"] = b.book.active[first.id].state
        try:
            outcome["cancel"] = (await b.lifecycle.cancel(first.id)).state
        except Exception as e:  # what the user would see as an error
            outcome["cancel"] = e

    task = asyncio.create_task(cancel_at_first_yield())
    await h.cycle()
    await task
    assert outcome["seen"] == JobState.DISPATCHING  # the race this test is about did happen
    assert outcome["cancel"] == JobState.CANCELLED
    assert (await b.store.get_job(first.id)).state == JobState.CANCELLED
    assert first.id not in b.book.active


async def test_a_running_job_whose_running_write_failed_once_is_not_counted_twice(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    failed = fail_first_write(b.store, JobState.RUNNING)
    j1 = await h.submit(name="first", count=4, duration_s=3600)
    await h.cycle()
    await h.step(1.0)
    await asyncio.sleep(0.5)  # the pump retries the event
    assert failed == [j1.id] and (await h.job(j1.id)).state == JobState.RUNNING
    await h.step(2.0)
    j2 = await h.submit(name="second", count=4, duration_s=60)
    await h.cycle()  # alpha has 4 free: the second job must fit there
    assert (await h.job(j2.id)).state == JobState.DISPATCHING


async def test_tombstones_of_long_gone_attempts_are_dropped(tmp_path):
    from adapters.simulated import TOMBSTONE_TTL_S

    clock = ManualClock(T0)
    sim = SimulatedSite(site("alpha"), clock, FAST)
    for i in range(1100):
        await sim.cancel(f"old-{i}", 1)
    await clock.advance(TOMBSTONE_TTL_S + 1)
    await sim.cancel("new", 1)
    assert len(sim._withdrawn) < 1024  # noqa: SLF001 - the bound is what this test is about
    late = Job(id="new", spec=job(), created_at=T0, updated_at=T0, attempt=1)
    assert not (await sim.submit(late)).admitted  # a recent tombstone still stops a late submission


# --- fourth review: closing store, chained failures, a pass that fails part-way ---


async def test_a_write_queued_while_the_store_closes_fails_instead_of_hanging(tmp_path):
    from broker.store.sqlite import SQLiteStore
    from tests.test_store import make_job

    store = SQLiteStore(tmp_path / "c.db")
    await store.open()
    await store.insert_job(make_job(1))
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0)  # close() has begun
    with pytest.raises(StoreError):
        await asyncio.wait_for(store.update_job(make_job(1).transition(JobState.CANCELLED, T0), 0), 5)
    await closing


async def test_memory_heals_once_the_store_can_be_read_again_after_chained_write_failures(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    j = await h.submit(duration_s=600)

    async def unreadable(*args, **kwargs):
        raise StoreError("I/O error")

    real_get = b.store.get_job
    restore = failing_writes(b.store, lambda job: StoreError("I/O error"))
    b.store.get_job = unreadable  # type: ignore[method-assign]
    await h.cycle()  # the placement's write fails and cannot be read back
    assert j.id in b.book.suspect
    restore()
    b.store.get_job = real_get  # type: ignore[method-assign]
    await b.lifecycle.settle(force=True)
    assert b.book.active[j.id].state == (await b.store.get_job(j.id)).state == JobState.QUEUED
    assert not b.book.suspect


async def test_placements_made_before_a_pass_fails_part_way_are_still_stored_and_dispatched(tmp_path, brokers):
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    b = h.broker
    # Both are created at the same manual-clock instant; priority fixes which one is decided first.
    first = await h.submit(name="first", count=1, duration_s=60, priority=10)
    second = await h.submit(name="second", count=2, duration_s=60)
    real_decide = b.cycle.pipeline.decide
    calls = []

    def decide_then_break(req, snap):
        calls.append(req.job_id)
        if len(calls) == 2:
            raise RuntimeError("a bug in a policy")
        return real_decide(req, snap)

    b.cycle.pipeline.decide = decide_then_break  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await h.cycle()
    b.cycle.pipeline.decide = real_decide  # type: ignore[method-assign]
    assert calls == [first.id, second.id]
    await h.step(1.0)
    assert (await h.job(first.id)).state == JobState.RUNNING  # placed before the failure: stored and dispatched
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(second.id)).state == JobState.RUNNING


async def test_a_site_whose_adapter_starts_late_runs_jobs_and_its_events_reach_the_broker(tmp_path: Path) -> None:
    """The first adapter the broker makes for a stored site cannot start (its cluster is down at the
    broker's start); a later collect makes a fresh one that starts. The job then placed there runs to the
    end: the broker follows the events of the adapter that works, not of the one that never started."""
    from broker.clock import SystemClock

    made: list[SimulatedSite] = []

    class DownAtFirst(SimulatedSite):
        async def start(self) -> None:
            if len(made) == 1:
                raise AdapterError("cluster unreachable")
            await super().start()

    def factory(spec):  # noqa: ANN001, ANN202
        adapter = DownAtFirst(spec, SystemClock(), state_dir=str(tmp_path / "sites"))
        made.append(adapter)
        return adapter

    spec = site("late", adapter=SimulatedAdapterConfig(dispatch_delay_s=0.01))
    b = Broker(BrokerSettings(db=str(tmp_path / "b.db"), cycle_interval_s=0.05, shutdown_grace_s=0.5), factory=factory)
    b.federation.restart_after_s = 0.1
    await b.start([spec])
    try:
        assert "could not start" in (b.federation.get("late").public_state().reason or "")
        j, _ = await b.book.submit(job(count=1, duration_s=0.2))
        for _ in range(200):
            if (await b.book.get(j.id)).state == JobState.SUCCEEDED:
                break
            await asyncio.sleep(0.05)
        assert (await b.book.get(j.id)).state == JobState.SUCCEEDED
        assert len(made) >= 2 and b.federation.get("late").adapter is made[-1]
    finally:
        await b.stop()


async def test_a_site_whose_adapter_cannot_even_be_made_leaves_the_broker_serving_and_joins_when_it_can(
        tmp_path: Path) -> None:
    """Making the adapter of a stored site fails (its constructor raises: a state folder that cannot be read,
    say). The broker still starts, serves the other site, shows the failing one unhealthy with the reason,
    and takes it in once a later collect can make its adapter."""
    from broker.clock import SystemClock

    tries: list[str] = []

    def factory(spec):  # noqa: ANN001, ANN202
        if spec.name == "broken":
            tries.append(spec.name)
            if len(tries) < 3:
                raise OSError(f"cannot read {tmp_path / 'sites' / 'broken'}: permission denied")
        return SimulatedSite(spec, SystemClock(), state_dir=str(tmp_path / "sites"))

    fast = SimulatedAdapterConfig(dispatch_delay_s=0.01)
    b = Broker(BrokerSettings(db=str(tmp_path / "b.db"), cycle_interval_s=0.05, shutdown_grace_s=0.5), factory=factory)
    b.federation.restart_after_s = 0.1
    await b.start([site("ok", adapter=fast), site("broken", adapter=fast)])
    try:
        reason = b.federation.get("broken").public_state().reason or ""
        assert "could not start: cannot read" in reason and "permission denied" in reason
        j, _ = await b.book.submit(job(count=1, duration_s=0.1))
        for _ in range(200):
            if (await b.book.get(j.id)).state == JobState.SUCCEEDED and b.federation.get("broken").started:
                break
            await asyncio.sleep(0.05)
        assert (await b.book.get(j.id)).state == JobState.SUCCEEDED
        assert b.federation.get("broken").started and len(tries) == 3
    finally:
        await b.stop()


async def test_a_site_whose_adapter_cannot_be_made_holds_up_no_other_sites_housekeeping(tmp_path: Path) -> None:
    # The stand-in for an adapter that could not be made answered every call with a coroutine, the sync ones too:
    # the stray check iterated one (TypeError), and each round of housekeeping (withdrawals, requeues whose
    # write failed, reconciliations) stopped there, for every site, for as long as that one could not be made.
    def factory(spec):  # noqa: ANN001, ANN202
        if spec.name == "broken":
            raise OSError("cannot read its state folder: permission denied")
        return SimulatedSite(spec, SystemClock(), state_dir=str(tmp_path / "sites"))

    b = Broker(BrokerSettings(db=str(tmp_path / "b.db"), cycle_interval_s=0.05, shutdown_grace_s=0.5), factory=factory)
    await b.start([site("ok"), site("broken")], run_loop=False)
    try:
        assert b.lifecycle.find_strays() == 0
        await b.lifecycle.settle(force=True)
        assert [e async for e in b.federation.get("broken").adapter.events()] == []
    finally:
        await b.stop()


async def test_a_submission_stored_though_its_write_was_reported_failed_is_accepted_and_runs_once(
        tmp_path, brokers):
    # The insert committed, then its answer was lost (the connection dropped, or it timed out). Answering "not
    # accepted, try again" would have the client submit it again: two jobs where it asked for one, and the
    # first one unseen by the broker until its next start.
    h = await started(tmp_path, brokers, [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)])
    store = h.broker.store
    real = store.insert_job

    async def lost_answer(job, idempotency_key=None, digest=None):
        await real(job, idempotency_key, digest)
        raise StoreError("connection reset by peer")

    store.insert_job = lost_answer
    j = await h.submit(duration_s=60)  # accepted: no StoreError for the caller
    store.insert_job = real
    assert (await store.get_job(j.id)).state == JobState.QUEUED
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING
    page = await store.list_jobs(JobFilter(), 10)
    assert [x.id for x in page.items] == [j.id]


class UnplacedSite(SimulatedSite):
    """Admits attempts whose Pods then never start (a Kubernetes site whose scheduler finds no room for them),
    until ``give_up`` withdraws one as the Kubernetes adapter does after ``unschedulable_after_s``."""

    async def _run(self, run) -> None:  # noqa: ANN001 - never running: no `running` event
        await asyncio.Event().wait()

    def give_up(self, job_id: str, attempt: int) -> None:
        from adapters.base import EventKind, JobEvent

        run = self._runs.pop((job_id, attempt))
        if run.task is not None:
            run.task.cancel()
        self._admission.stop(f"{job_id}/{attempt}", self._clock.now().timestamp())
        self._emit(JobEvent(job_id, attempt, EventKind.LOST, self._clock.now(),
                            reason="the cluster's scheduler found no room for its Pod for 300 s"))


async def test_an_attempt_a_site_admitted_but_lost_before_it_ran_is_routed_elsewhere_without_a_failure(
        tmp_path, brokers):
    # A Kubernetes site admitted the job, then its scheduler found no room for the Pod (a taint, fragmentation,
    # another scheduler's Pods) and the adapter gave the attempt up: the job went straight back to the same site,
    # whose inventory still showed the GPUs free, and waited there again.
    sites = [site("alpha", gpus={"a100-80gb": 8}, adapter=FAST), site("beta", gpus={"a100-80gb": 8}, adapter=FAST)]
    h = await started(tmp_path, brokers, sites, factory=lambda spec, clock: UnplacedSite(spec, clock))
    j = await h.submit(count=8, duration_s=600, max_attempts=1)
    await h.cycle()
    await h.step(1.0)
    first = await h.job(j.id)
    assert first.state == JobState.ADMITTED
    h.broker.federation.get(first.site).adapter.give_up(j.id, 1)
    await h.quiet()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.QUEUED
    await h.cycle()
    await h.step(1.0)
    again = await h.job(j.id)
    other = ({"alpha", "beta"} - {first.site}).pop()
    assert (again.state, again.site, again.attempt, again.failed_attempts) == (JobState.ADMITTED, other, 2, 0)


async def test_a_sites_late_report_of_an_attempt_requeued_while_its_admission_was_stored_leaves_the_next_alone():
    """A site's report that overtook its answer to the dispatch is applied in two writes: the admission it shows,
    then what it reports. While the first was on its way, the dispatch's own path requeued the attempt (its site
    had confirmed it dropped it) and the next pass placed the job elsewhere. The report, of an attempt that is no
    longer the job's, must move it no further (it requeued the new placement, as a failure of the old attempt, and
    its site then had the new attempt withdrawn)."""
    from datetime import timedelta

    from adapters.base import EventKind, JobEvent
    from broker.federation import Federation
    from broker.jobs import JobBook
    from broker.lifecycle import Lifecycle
    from broker.store.memory import MemoryStore

    class SlowAnswer(MemoryStore):
        during = None

        def enqueue_update(self, job: Job, expected_version: int, **extra):  # noqa: ANN003, ANN201
            landed = super().enqueue_update(job, expected_version, **extra)
            if self.during is None or job.state != JobState.ADMITTED:
                return landed
            during, self.during = self.during, None

            async def answer() -> None:
                await during()  # stored; the caller has not heard yet
                await landed

            return asyncio.ensure_future(answer())

    store = SlowAnswer()
    await store.open()
    clock = ManualClock(T0)
    book = JobBook(store, clock)
    await book.load()
    lifecycle = Lifecycle(book, Federation(clock, lambda spec: None))
    submitted, _ = await book.submit(job(max_attempts=3))
    await book.transition(submitted.id, JobState.DISPATCHING, site="a", attempt=1, reason="placed on a")

    async def requeued_and_placed_again() -> None:
        await lifecycle.requeue_from("a", submitted.id, 1, "dispatch failed (no answer in time); withdrawn")
        await book.transition(submitted.id, JobState.DISPATCHING, site="b", attempt=2, reason="placed on b")

    store.during = requeued_and_placed_again
    report = JobEvent(submitted.id, 1, EventKind.FAILED, T0 + timedelta(seconds=5), reason="exit code 1")
    await lifecycle.on_event("a", report)
    now = book.active[submitted.id]
    assert (now.state, now.site, now.attempt, now.failed_attempts) == (JobState.DISPATCHING, "b", 2, 0), now
    assert (await store.get_job(submitted.id)) == now



class HoldsCancels(MemoryStore):
    """A store that holds each 'cancelled' write, unanswered and not committed, until ``commit_behind``."""

    behind: tuple[Job, int, asyncio.Future[None]] | None = None

    def enqueue_update(self, job: Job, expected_version: int, **extra):  # noqa: ANN003, ANN201
        if job.state == JobState.CANCELLED:
            self.behind = (job, expected_version, asyncio.get_running_loop().create_future())
            return self.behind[2]
        return super().enqueue_update(job, expected_version, **extra)

    def commit_behind(self) -> None:
        assert self.behind is not None
        job, version, fut = self.behind
        self._update(job, version, None, None)
        fut.set_result(None)


async def admitted_at_a(store: MemoryStore):  # noqa: ANN201
    """A job book on ``store`` (opened here) holding one job, admitted at site a."""
    from broker.jobs import JobBook

    await store.open()
    book = JobBook(store, ManualClock(T0))
    await book.load()
    submitted, _ = await book.submit(job())
    await book.transition(submitted.id, JobState.DISPATCHING, site="a", attempt=1, reason="placed on a")
    await book.transition(submitted.id, JobState.ADMITTED, reason="admitted by a")
    return book, submitted

async def test_a_write_whose_answer_was_lost_leaves_memory_to_the_change_queued_behind_it():
    """The site's report of the job running was stored, then its answer was lost (the connection dropped); a cancel,
    made meanwhile, was queued behind it. Reading the job back to learn whether the first write landed found it
    running (the cancel had not committed yet), and memory was set to that: the job was shown running for as long
    as the broker ran, though it was cancelled and withdrawn from its site (which could not be removed, busy)."""
    class Writer(HoldsCancels):
        """Commits the 'running' write at once, its answer held; holds the 'cancelled' write (behind it)."""

        answer: asyncio.Future[None] | None = None

        def enqueue_update(self, job: Job, expected_version: int, **extra):  # noqa: ANN003, ANN201
            if job.state == JobState.RUNNING:
                super().enqueue_update(job, expected_version, **extra)  # committed
                self.answer = asyncio.get_running_loop().create_future()
                return self.answer
            return super().enqueue_update(job, expected_version, **extra)

    store = Writer()
    book, submitted = await admitted_at_a(store)
    running = asyncio.ensure_future(book.transition(submitted.id, JobState.RUNNING, reason="running on a"))
    await asyncio.sleep(0)
    cancel = asyncio.ensure_future(book.transition(submitted.id, JobState.CANCELLED, reason="cancelled by request"))
    await asyncio.sleep(0)
    assert store.answer is not None and store.behind is not None
    store.answer.set_exception(StoreError("connection reset by peer"))  # after the commit
    assert (await running).state == JobState.RUNNING  # it landed: taken as written
    store.commit_behind()
    await cancel
    assert (await book.get(submitted.id)).state == JobState.CANCELLED
    assert book.on_site("a") == []


async def test_a_job_read_again_after_the_store_came_back_keeps_the_change_still_on_its_way():
    """Housekeeping reads again a job whose state could not be read back after a failed write; a cancel of it, made
    meanwhile, was still on its way to the store. The read found the job as it was before the cancel, and memory was
    set to that: the job was shown running for as long as the broker ran, though it was cancelled."""
    class Flaky(HoldsCancels):
        """Fails the next update and the read after it; holds a 'cancelled' write until told to commit it."""

        failing = False

        def enqueue_update(self, job: Job, expected_version: int, **extra):  # noqa: ANN003, ANN201
            if self.failing and job.state != JobState.CANCELLED:
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(StoreError("connection reset by peer"))
                return failed
            return super().enqueue_update(job, expected_version, **extra)

        async def get_job(self, job_id: str) -> Job | None:
            if self.failing:
                self.failing = False
                raise StoreError("connection refused")
            return await super().get_job(job_id)

    store = Flaky()
    book, submitted = await admitted_at_a(store)
    await book.transition(submitted.id, JobState.RUNNING, reason="running on a")
    store.failing = True
    with pytest.raises(StoreError):
        await book.transition(submitted.id, JobState.SUCCEEDED, reason="succeeded on a")
    assert submitted.id in book.suspect
    cancel = asyncio.ensure_future(book.transition(submitted.id, JobState.CANCELLED, reason="cancelled by request"))
    await asyncio.sleep(0)
    await book.resync_suspects()  # the store answers reads again; the cancel is still on its way
    store.commit_behind()
    await cancel
    assert (await book.get(submitted.id)).state == JobState.CANCELLED


async def test_a_cancel_between_a_preemptions_two_writes_leaves_the_job_cancelled_and_the_report_taken():
    """A site's report of a preemption is stored in two writes: the job preempted, then requeued. A cancel that lands
    between them ended the job; the requeue then raised (the job was gone), the report was logged as one that could
    not be applied, with a traceback, and left unacknowledged, to be sent again."""
    from adapters.base import EventKind, JobEvent
    from broker.federation import Federation
    from broker.lifecycle import Lifecycle

    class CancelsAfterPreemption(MemoryStore):
        lifecycle: Lifecycle | None = None
        cancelling: asyncio.Future | None = None

        def enqueue_update(self, job: Job, expected_version: int, **extra):  # noqa: ANN003, ANN201
            landed = super().enqueue_update(job, expected_version, **extra)
            if job.state != JobState.PREEMPTED or self.lifecycle is None:
                return landed
            lifecycle, self.lifecycle = self.lifecycle, None
            loop = asyncio.get_running_loop()
            self.cancelling = asyncio.ensure_future(lifecycle.cancel(job.id))  # made in memory before the answer
            answer = loop.create_future()
            loop.call_soon(answer.set_result, None)
            return answer

    store = CancelsAfterPreemption()
    book, submitted = await admitted_at_a(store)
    await book.transition(submitted.id, JobState.RUNNING, reason="running on a")
    lifecycle = Lifecycle(book, Federation(ManualClock(T0), lambda spec: None))
    store.lifecycle = lifecycle
    preempted = JobEvent(submitted.id, 1, EventKind.PREEMPTED, T0, reason="a higher priority job", run_s=60.0)
    assert await lifecycle.on_event("a", preempted) is None  # taken: the cancel settles the job
    assert store.cancelling is not None
    await store.cancelling
    assert (await store.get_job(submitted.id)).state == JobState.CANCELLED
    assert submitted.id not in book.active
