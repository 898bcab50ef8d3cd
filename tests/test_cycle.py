"""The scheduling cycle against simulated sites on a manual clock: placement, dispatch, confirm or undo,
site events, retries, cancellation and unhealthy sites."""

from __future__ import annotations

import ast
import asyncio
import math
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from adapters.simulated import SimulatedSite
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.cycle import work_done
from broker.models import Job, JobState, SimulatedAdapterConfig, SiteSpec, SiteState
from broker.service import Broker
from broker.jobs import JobNotFound
from broker.store import StoreError
from policies import explain
from policies.snapshot import MODEL_INDEX, JobRequest
from tests.builders import job, site

T0 = datetime(2022, 6, 1, 12, tzinfo=UTC)
FAST = SimulatedAdapterConfig(dispatch_delay_s=1.0)


async def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait (in real time) for store writes and event pumps to catch up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def failing_writes(store, fail: Callable[[Job], BaseException | None]) -> Callable[[], None]:
    """Make the store's job updates fail wherever ``fail(job)`` returns an error; returns an undo."""
    real = store.enqueue_update

    def enqueue(job, expected_version, event_reason=None, decision=None):
        error = fail(job)
        if error is None:
            return real(job, expected_version, event_reason, decision)
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(error)
        return failed

    store.enqueue_update = enqueue
    return lambda: setattr(store, "enqueue_update", real)


def fail_first_write(store, state: JobState, error: str = "database is locked") -> list[str]:
    """Fail the first write that moves a job into ``state``; returns the ids it failed (at most one)."""
    failed: list[str] = []

    def fail(job):
        if job.state == state and not failed:
            failed.append(job.id)
            return StoreError(error)
        return None

    failing_writes(store, fail)
    return failed


class Harness:
    def __init__(self, broker: Broker, clock: ManualClock) -> None:
        self.broker, self.clock = broker, clock

    async def submit(self, **kw) -> Job:
        j, _ = await self.broker.book.submit(job(**kw))
        return j

    async def job(self, job_id: str) -> Job:
        return await self.broker.book.get(job_id)

    async def cycle(self) -> None:
        await self.broker.cycle.run_once()

    async def step(self, seconds: float) -> None:
        """Let dispatches start, move the clock, and wait for the resulting writes. A dispatch begins once its
        placement's write lands (on the store's thread, in real time): the clock moves only after, so its wait at
        the site starts at the time it was placed, however slow the machine (it started after the jump, under
        load, and a job then ran a step late)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while self.broker.book.writes_pending() and loop.time() < deadline:
            await asyncio.sleep(0.005)
        await self.clock.advance(seconds)
        await self.quiet()

    async def quiet(self) -> None:
        await asyncio.sleep(0.05)
        await self.broker.cycle.drain()
        await asyncio.sleep(0.02)

    async def states(self, job_id: str) -> list[str]:
        return [e["state"] for e in await self.broker.store.job_events(job_id)]

    def free(self, site_name: str, model: str) -> int:
        state = self.broker.federation.get(site_name).state
        return next(c.free_gpus for c in state.capacity if c.model == model)

    async def decision(self, job_id: str):
        j = await self.job(job_id)
        stored = await self.broker.decision(j)
        req = JobRequest.from_spec(j.id, j.spec, frozenset(stored.record["excluded"]))
        return explain.render(stored.record, req, self.broker.cycle.filters, stored.attempt)


@pytest.fixture
async def make(tmp_path: Path):
    brokers: list[Broker] = []

    async def _make(*sites: SiteSpec, factory=None, **settings) -> Harness:
        """``factory(spec, clock)`` builds adapters; default: simulated sites on the harness clock.
        ``settings``: more BrokerSettings."""
        clock = ManualClock(T0)
        b = Broker(
            BrokerSettings(db=str(tmp_path / "h.db"), shutdown_grace_s=0.1, **settings),
            clock=clock,
            factory=(lambda spec: factory(spec, clock)) if factory else None,
        )
        await b.start(list(sites), run_loop=False)
        brokers.append(b)
        return Harness(b, clock)

    yield _make
    for b in brokers:
        await b.stop()


async def test_a_job_goes_from_queued_to_succeeded_through_every_state(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=2, duration_s=600)
    await h.cycle()
    assert (await h.job(j.id)).state == JobState.DISPATCHING
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING
    await h.cycle()
    assert h.free("alpha", "a100-80gb") == 6
    await h.step(600)
    done = await h.job(j.id)
    assert done.state == JobState.SUCCEEDED and done.site == "alpha" and done.attempt == 1
    assert await h.states(j.id) == ["queued", "dispatching", "admitted", "running", "succeeded"]
    await h.cycle()
    assert h.free("alpha", "a100-80gb") == 8


async def test_finished_jobs_are_deleted_job_retention_h_after_they_ended_and_nothing_active_is(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST), job_retention_h=24)
    done = await h.submit(count=1, duration_s=600)
    cancelled = await h.submit(count=1, duration_s=600)
    waiting = await h.submit(count=16, duration_s=600)  # more than the site has: queued for ever
    await h.broker.lifecycle.cancel(cancelled.id)
    await h.cycle()
    await h.step(1.0)
    await h.step(600)
    assert (await h.job(done.id)).state == JobState.SUCCEEDED
    long = await h.submit(count=1, duration_s=3 * 86400)  # runs past the retention
    await h.cycle()
    await h.step(1.0)

    # `cancelled` ended at T0, `done` at T0 + 601 s
    await h.broker._settle()  # housekeeping looks, finds nothing, and looks again 5 minutes on
    await h.step(86400 - 700)
    await h.broker._settle()  # a day less 700 s: nothing is a day old
    assert (await h.job(cancelled.id)).state == JobState.CANCELLED
    await h.step(200)
    await h.broker._settle()  # `cancelled` is a day old, but housekeeping looked less than 5 minutes ago
    assert (await h.job(cancelled.id)).state == JobState.CANCELLED
    await h.step(200)
    await h.broker._settle()
    with pytest.raises(JobNotFound):
        await h.job(cancelled.id)
    assert (await h.job(done.id)).state == JobState.SUCCEEDED  # ended 601 s later: not a day old yet
    await h.step(400)
    await h.broker._settle()
    for gone in (done, cancelled):
        with pytest.raises(JobNotFound):
            await h.job(gone.id)
        assert await h.broker.store.job_events(gone.id) == []
    assert (await h.job(waiting.id)).state == JobState.QUEUED
    assert (await h.job(long.id)).state == JobState.RUNNING
    assert h.broker.metrics.registry.get_sample_value("heliotrope_jobs_pruned_total") == 2

    kept = await make(site("beta", gpus={"a100-80gb": 8}, adapter=FAST), job_retention_h=0)
    j = await kept.submit(count=1, duration_s=60)
    await kept.broker.lifecycle.cancel(j.id)
    await kept.step(365 * 86400)
    await kept.broker._settle()
    assert (await kept.job(j.id)).state == JobState.CANCELLED


async def test_deleting_finished_jobs_goes_on_at_once_after_a_full_round_and_waits_after_a_failed_one(
        make, monkeypatch: pytest.MonkeyPatch):
    import broker.service as service
    monkeypatch.setattr(service, "PRUNE_BATCH", 2)
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST), job_retention_h=1)
    jobs = [await h.submit(count=1, duration_s=60) for _ in range(5)]
    for j in jobs:
        await h.broker.lifecycle.cancel(j.id)
    await h.step(2 * 3600)
    for expected_left in (3, 1, 0):  # two a round, and the next round at the next housekeeping while rounds are full
        await h.broker._settle()
        left = [j for j in jobs if await h.broker.store.get_job(j.id) is not None]
        assert len(left) == expected_left

    calls = []

    async def failing(before, limit, keep=()):
        calls.append(before)
        raise StoreError("database is locked")

    monkeypatch.setattr(h.broker.store, "prune_ended", failing)
    await h.step(300)
    for _ in range(3):  # one failure is logged, then the next try 5 minutes on, not at every housekeeping
        await h.broker._settle()
    assert len(calls) == 1
    await h.step(301)
    await h.broker._settle()
    assert len(calls) == 2


async def test_a_job_no_site_can_fit_stays_queued_and_its_decision_names_every_sites_reason(make):
    h = await make(
        site("alpha", gpus={"a100-80gb": 8}, adapter=FAST),
        site("beta", gpus={"l4": 8}, region="gcp:europe-west3", adapter=FAST),
    )
    j = await h.submit(count=16, model="a100-80gb")
    await h.cycle()
    await h.step(10)
    await h.cycle()
    assert (await h.job(j.id)).state == JobState.QUEUED
    d = await h.decision(j.id)
    assert d.outcome == "unplaceable"
    reasons = {v.site: v.reasons for v in d.sites}
    assert reasons["alpha"] == ["gpus-do-not-fit: job needs 16 a100-80gb; 8 free"]
    assert reasons["beta"] == ["gpus-do-not-fit: site has no a100-80gb"]


async def test_a_tenant_at_its_federation_limit_waits_while_others_run_and_starts_when_its_jobs_end(make):
    """``broker.tenant_limits``: t1 may hold 4 GPUs across both sites together (each site alone would take more);
    its third job waits, saying why at every site, while t2's job (no limit named; the default, 8) starts, and it
    starts once one of t1's jobs ends. A fractional job counts its share."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST),
                   site("beta", gpus={"a100-80gb": 8}, region="gcp:europe-west3", adapter=FAST),
                   tenant_limits={"t1": {"gpus": 4}}, default_tenant_limit={"gpus": 8})
    short = await h.submit(tenant="t1", name="short", count=2, duration_s=600)
    long = await h.submit(tenant="t1", name="long", count=1, duration_s=7200)
    share = await h.submit(tenant="t1", name="share", milli=500, duration_s=7200)
    # (decided last: jobs submitted at the same time of the manual clock are ordered by id, and ids made within the
    # same millisecond are in random order)
    third = await h.submit(tenant="t1", name="third", count=1, duration_s=600, priority=-1)
    other = await h.submit(tenant="t2", name="other", count=4, duration_s=600)
    await h.cycle()
    await h.step(1.0)
    await h.cycle()
    states = {j.id: (await h.job(j.id)).state for j in (short, long, share, third, other)}
    assert states == {short.id: JobState.RUNNING, long.id: JobState.RUNNING, share.id: JobState.RUNNING,
                      third.id: JobState.QUEUED, other.id: JobState.RUNNING}
    d = await h.decision(third.id)
    assert d.outcome == "unplaceable"
    why = ("tenant-limit: tenant t1 holds 3.5 GPUs across the federation and may hold at most 4 "
           "(broker.tenant_limits); the job needs 1")
    assert {v.site: v.reasons for v in d.sites} == {"alpha": [why], "beta": [why]}
    [(req, record, _)] = h.broker.cycle.previews([job(tenant="t1", name="more", count=1)])  # as a submission
    assert record["site"] is None and record["tenant_limit"] == [4.0, 3.5]
    assert explain.render(record, req, h.broker.cycle.filters, 0).sites[0].reasons == [why]
    [(_, record, _)] = h.broker.cycle.previews([job(tenant="t1", name="half", milli=500)])  # its share fits
    assert record["site"] is not None
    usage = h.broker.book.active.by_tenant()  # what GET /v1/tenants and the metrics read
    assert {t: (u.jobs, u.gpus_held) for t, u in usage.items()} == {
        "t1": ({"queued": 1, "running": 3}, 3.5), "t2": ({"running": 1}, 4.0)}
    await h.step(600)  # the 2-GPU job ends
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(third.id)).state == JobState.RUNNING
    assert (await h.job(short.id)).state == JobState.SUCCEEDED


async def test_the_higher_priority_job_gets_scarce_gpus_first(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    low = await h.submit(name="low", count=8, priority=0)
    high = await h.submit(name="high", count=8, priority=100)
    await h.cycle()
    assert (await h.job(high.id)).state == JobState.DISPATCHING
    assert (await h.job(low.id)).state == JobState.QUEUED


class StaleSite(SimulatedSite):
    """Keeps reporting its first snapshot: the broker's view lags what really runs there."""

    first: SiteState | None = None

    async def snapshot(self) -> SiteState:
        if self.first is None:
            self.first = await super().snapshot()
        return self.first


async def test_a_site_that_refuses_a_job_is_skipped_and_the_job_is_routed_elsewhere(make):
    h = await make(
        site("alpha", gpus={"a100-80gb": 16}, adapter=FAST),
        site("beta", gpus={"a100-80gb": 8}, adapter=FAST),
        factory=lambda spec, clock: (StaleSite if spec.name == "alpha" else SimulatedSite)(spec, clock),
    )
    # Local users fill alpha behind the broker's back; alpha still reports 16 free.
    foreign = Job(id="local", spec=job(count=16), created_at=T0, updated_at=T0)
    admit = asyncio.create_task(h.broker.federation.get("alpha").adapter.submit(foreign))
    await h.clock.advance(1.0)
    assert (await admit).admitted

    j = await h.submit(count=8)
    await h.cycle()
    assert (await h.job(j.id)).site == "alpha"  # most free GPUs, as far as the broker knows
    await h.step(1.0)
    refused = await h.job(j.id)
    assert refused.state == JobState.QUEUED and "alpha refused it: no room" in refused.reason
    await h.cycle()
    rerouted = await h.job(j.id)
    assert rerouted.state == JobState.DISPATCHING and rerouted.site == "beta" and rerouted.attempt == 2
    d = await h.decision(j.id)
    assert d.site == "beta"
    assert any(r.startswith("site-refused") for r in next(v for v in d.sites if v.site == "alpha").reasons)


async def test_a_failing_job_is_retried_until_max_attempts_then_fails(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=SimulatedAdapterConfig(dispatch_delay_s=1, failure_rate=1.0)))
    j = await h.submit(duration_s=100, max_attempts=2)
    for _ in range(2):
        await h.cycle()
        await h.step(1.0)
        await h.step(100)
    final = await h.job(j.id)
    assert final.state == JobState.FAILED
    assert final.failed_attempts == 2 and final.attempt == 2
    assert await h.states(j.id) == [
        "queued", "dispatching", "admitted", "running", "queued",
        "dispatching", "admitted", "running", "failed",
    ]
    assert "2 of 2 attempts failed" in final.reason


async def test_cancelling_a_running_job_stops_it_and_frees_its_gpus(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=4, duration_s=600)
    await h.cycle()
    await h.step(1.0)
    await h.cycle()
    assert h.free("alpha", "a100-80gb") == 4
    cancelled = await h.broker.lifecycle.cancel(j.id)
    assert cancelled.state == JobState.CANCELLED
    await h.cycle()
    assert h.free("alpha", "a100-80gb") == 8
    await h.step(700)
    assert (await h.job(j.id)).state == JobState.CANCELLED  # no late "succeeded"


async def test_a_job_cancelled_while_dispatching_is_withdrawn_from_the_site_that_admits_it(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=8, duration_s=600)
    await h.cycle()
    await h.broker.lifecycle.cancel(j.id)
    await h.step(1.0)
    await h.cycle()
    assert (await h.job(j.id)).state == JobState.CANCELLED
    assert h.free("alpha", "a100-80gb") == 8


async def test_a_job_cancelled_while_its_site_was_unreachable_is_withdrawn_once_the_site_admits_it(make):
    """The cancel's withdrawal did not reach the site; the site then admitted the attempt. The dispatch finds
    the job no longer dispatching and withdraws the attempt at once, so the cancelled job holds no GPUs."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=8, duration_s=600)
    await h.cycle()
    await asyncio.sleep(0.05)  # the dispatch is on its way (the site admits after dispatch_delay_s)
    adapter = h.broker.federation.get("alpha").adapter
    adapter.set_reachable(False)
    await h.broker.lifecycle.cancel(j.id)  # its withdrawal fails: remembered, to be retried
    adapter.set_reachable(True)
    await h.step(1.0)  # the site admits the attempt
    assert (await h.job(j.id)).state == JobState.CANCELLED
    assert h.broker.lifecycle.withdrawals == {}
    await h.cycle()
    assert h.free("alpha", "a100-80gb") == 8


async def test_a_job_whose_dispatch_was_cut_short_is_requeued_once_its_site_says_it_does_not_hold_it(
        make, monkeypatch):
    """A leader unsure of its lease for a moment calls no site: the dispatch under way gave up, and the job, stored
    as dispatching, was left so for ever once the leader was sure again. The housekeeping asks the site after
    ``stranded_after_s`` and routes the job again."""
    import broker.lifecycle as lifecycle_module

    monkeypatch.setattr(lifecycle_module, "STRANDED_SWEEP_S", 0.0)
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    sure = True
    h.broker.cycle.may_act = lambda: sure
    j = await h.submit(count=1, duration_s=600)
    sure = False
    await h.cycle()
    await h.step(1.0)
    sure = True
    lifecycle = h.broker.lifecycle
    lifecycle.stranded_after_s = 0.2
    await lifecycle.settle()  # first seen stranded
    assert (await h.job(j.id)).state == JobState.DISPATCHING
    await asyncio.sleep(0.25)
    await lifecycle.settle()  # still: the site is asked, and does not hold it
    requeued = await h.job(j.id)
    assert requeued.state == JobState.QUEUED and "dispatch was cut short" in requeued.reason
    await h.cycle()
    await h.step(1.0)
    again = await h.job(j.id)
    assert again.state == JobState.RUNNING and again.attempt == 2 and again.site == "alpha"


async def test_a_job_being_dispatched_is_not_taken_for_stranded(make, monkeypatch):
    """A slow site: the dispatch is still waiting for its answer when the sweep looks twice."""
    import broker.lifecycle as lifecycle_module

    monkeypatch.setattr(lifecycle_module, "STRANDED_SWEEP_S", 0.0)
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))  # (admits 1 s later, on the harness clock)
    j = await h.submit(count=1, duration_s=600)
    await h.cycle()
    lifecycle = h.broker.lifecycle
    lifecycle.stranded_after_s = 0.1
    await asyncio.sleep(0.05)
    assert lifecycle.find_stranded() == 0
    await asyncio.sleep(0.2)
    assert lifecycle.find_stranded() == 0 and lifecycle.pending_sites == {}
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING


async def test_an_unreachable_site_is_marked_unhealthy_and_new_jobs_go_elsewhere(make):
    h = await make(
        site("alpha", gpus={"a100-80gb": 16}, adapter=FAST),
        site("beta", gpus={"a100-80gb": 8}, adapter=FAST),
    )
    h.broker.federation.get("alpha").adapter.set_reachable(False)
    j = await h.submit(count=1)
    await h.cycle()
    placed = await h.job(j.id)
    assert placed.site == "beta"
    d = await h.decision(j.id)
    alpha = next(v for v in d.sites if v.site == "alpha")
    assert alpha.reasons and alpha.reasons[0].startswith("site-unhealthy")
    status = h.broker.federation.get("alpha").public_state()
    assert status.health == "unhealthy" and "unreachable" in status.reason


async def test_fractional_jobs_share_one_gpu(make):
    h = await make(site("alpha", gpus={"t4": 1}, adapter=FAST))
    jobs = [await h.submit(name=f"infer-{i}", milli=250, duration_s=600) for i in range(5)]
    await h.cycle()
    await h.step(1.0)
    await h.cycle()
    states = [(await h.job(j.id)).state for j in jobs]
    assert states.count(JobState.RUNNING) == 4
    assert states.count(JobState.QUEUED) == 1


async def test_a_placement_the_store_cannot_write_is_not_dispatched_and_the_job_stays_queued(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=8, duration_s=600)
    failures = fail_first_write(h.broker.store, JobState.DISPATCHING, "disk full")
    await h.cycle()
    await h.step(1.0)
    assert failures == [j.id]
    assert (await h.job(j.id)).state == JobState.QUEUED
    assert await h.broker.federation.get("alpha").adapter.known_attempts() == set()  # never dispatched
    # The next cycle places it for real.
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(j.id)).state == JobState.RUNNING


async def test_a_placement_that_landed_though_its_write_was_reported_failed_is_dispatched(make):
    # The commit went through, then the answer was lost (the connection dropped, or it timed out): the job
    # is in the store as dispatching, and nobody else would ever act on it.
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    j = await h.submit(count=8, duration_s=600)
    store = h.broker.store
    real = store.enqueue_update

    def lost_answer(job, expected_version, event_reason=None, decision=None):
        landed = real(job, expected_version, event_reason, decision)
        if job.state != JobState.DISPATCHING:
            return landed

        async def then_fail():
            await landed
            raise StoreError("connection reset by peer")

        return asyncio.ensure_future(then_fail())

    store.enqueue_update = lost_answer
    await h.cycle()
    await h.step(1.0)
    store.enqueue_update = real
    assert (await h.job(j.id)).state == JobState.RUNNING
    assert (await h.job(j.id)).attempt == 1
    assert await h.states(j.id) == ["queued", "dispatching", "admitted", "running"]


async def test_a_waiting_job_is_placed_in_the_pass_right_after_capacity_frees(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    h.broker.cycle.full_pass_interval_s = 3600  # no periodic full pass during the test
    first = await h.submit(name="first", count=8, duration_s=100)
    await h.cycle()
    await h.step(1.0)
    second = await h.submit(name="second", count=8, duration_s=100)
    report = await h.broker.cycle.run_once()
    assert not report.full and report.decided == 1 and report.placed == 0  # only the new job was looked at
    await h.step(100)  # the first job finishes: its GPUs are free
    assert (await h.job(first.id)).state == JobState.SUCCEEDED
    report = await h.broker.cycle.run_once()
    assert report.full and report.placed == 1
    assert (await h.job(second.id)).state == JobState.DISPATCHING


async def test_a_periodic_full_pass_over_a_full_federation_does_not_walk_the_queue_again(make):
    """Nothing changed since the last full pass placed nothing (same reports, same hour, no job moved): the
    interval's pass decides only new jobs. A job that ends changes that, and the queue is walked again."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    first = await h.submit(name="first", count=8, duration_s=100)
    await h.cycle()
    await h.step(1.0)
    waiting = [await h.submit(name=f"waiting-{i}", count=1, duration_s=60) for i in range(40)]
    report = await h.broker.cycle.run_once(full=True)
    assert report.decided == 1 and report.placed == 0  # one shape: the first that found no site speaks for all
    await h.clock.advance(h.broker.cycle.full_pass_interval_s)
    report = await h.broker.cycle.run_once()
    assert report.full and report.decided == 0  # the 40 were not decided again
    late = await h.submit(name="late", count=1, duration_s=60)
    await h.clock.advance(h.broker.cycle.full_pass_interval_s)
    report = await h.broker.cycle.run_once()
    assert report.full and report.decided == 1 and report.placed == 0  # only the new job
    await h.step(100)  # the first job ends
    assert (await h.job(first.id)).state == JobState.SUCCEEDED
    report = await h.broker.cycle.run_once()
    assert report.full and report.decided >= 8 and report.placed == 8
    placed = [j for j in waiting + [late] if (await h.job(j.id)).state == JobState.DISPATCHING]
    assert len(placed) == 8


async def test_a_full_pass_decides_one_job_per_group_that_cannot_run_and_explains_the_rest(make):
    """A full pass stops at the first job of a group (same shape, tenant, priority) that finds no site: the
    rest of the group could not run either. They are explained by that decision, and once capacity frees
    they are placed in the queue's order, across groups."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    blocker = await h.submit(name="blocker", count=8, duration_s=100)
    await h.cycle()
    await h.step(1.0)
    queued = []
    for i in range(30):  # three groups, interleaved by age
        tenant, count = [("t1", 1), ("t2", 1), ("t1", 2)][i % 3]
        queued.append(await h.submit(tenant=tenant, name=f"w-{i}", count=count, duration_s=60))
        await h.clock.advance(0.001)
    report = await h.broker.cycle.run_once(full=True)
    assert report.full and report.decided == 3 and report.placed == 0
    last = queued[-1]  # never decided: its group failed at its first job
    assert await h.broker.store.get_decision(last.id) is None
    d = await h.decision(last.id)
    assert d.outcome == "unplaceable"
    assert d.sites[0].reasons == ["gpus-do-not-fit: job needs 2 GPUs of any model; 0 free"]
    await h.step(100)  # the blocker ends: 8 GPUs free
    assert (await h.job(blocker.id)).state == JobState.SUCCEEDED
    report = await h.broker.cycle.run_once()
    placed = [j for j in queued if (await h.job(j.id)).state == JobState.DISPATCHING]
    # oldest first across the groups: 1 + 1 + 2 + 1 + 1 + 2 = 8 GPUs
    assert [j.spec.name for j in placed] == [f"w-{i}" for i in range(6)]
    assert report.placed == 6


async def test_a_job_submitted_after_its_group_failed_is_explained_by_its_own_decision(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    await h.submit(name="blocker", count=8, duration_s=1000)
    await h.cycle()
    await h.step(1.0)
    early = [await h.submit(name=f"early-{i}", count=1) for i in range(3)]
    await h.broker.cycle.run_once(full=True)  # fails the group at early-0
    assert (await h.decision(early[2].id)).outcome == "unplaceable"  # explained by early-0's failure
    await h.clock.advance(5.0)
    late = await h.submit(name="late", count=1)
    assert await h.broker.decision(late) is None  # not decided yet: the earlier failure is not its own
    await h.broker.cycle.run_once(full=False)
    d = await h.decision(late.id)
    assert d.outcome == "unplaceable" and d.decided_at == h.clock.now()


class RefusesOnce(SimulatedSite):
    """Turns the first attempt away (a passing reason), then admits as usual."""

    refused = False

    async def submit(self, job: Job):  # noqa: ANN201
        if not self.refused:
            self.refused = True
            from adapters.base import Admission

            return Admission.rejected("draining a node for maintenance")
        return await super().submit(job)


async def test_a_job_a_site_refused_is_placed_there_once_the_refusal_expires_even_when_all_else_is_quiet(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST),
                   factory=lambda spec, clock: RefusesOnce(spec, clock))
    j = await h.submit(count=8, duration_s=60)
    await h.cycle()
    await h.step(1.0)  # alpha refuses it: it waits, alpha skipped for refusal_ttl_s
    assert (await h.job(j.id)).state == JobState.QUEUED
    for _ in range(3):  # periodic passes with nothing changing: remembered as quiet
        await h.clock.advance(h.broker.cycle.full_pass_interval_s)
        await h.cycle()
    await h.clock.advance(h.broker.book.refusal_ttl_s)
    await h.cycle()  # the refusal has run out: the job is decided again and goes to alpha
    assert (await h.job(j.id)).state == JobState.DISPATCHING


async def test_jobs_of_one_shape_that_cannot_fit_all_get_the_reasons(make):
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    jobs = [await h.submit(name=f"big-{i}", count=16) for i in range(3)]
    await h.cycle()
    for j in jobs:
        d = await h.decision(j.id)
        assert d.outcome == "unplaceable"
        assert d.sites[0].reasons == ["gpus-do-not-fit: job needs 16 GPUs of any model; 8 free"]


async def test_a_simulated_site_runs_a_job_for_its_true_duration_not_the_estimate(tmp_path):
    clock = ManualClock(T0)
    sim = SimulatedSite(site("alpha"), clock, FAST, run_seconds=lambda job: 50.0)
    j = Job(id="j", spec=job(duration_s=500), created_at=T0, updated_at=T0, attempt=1)
    admit = asyncio.create_task(sim.submit(j))
    await clock.advance(1.0)
    assert (await admit).admitted
    assert clock.next_wakeup() == T0 + timedelta(seconds=51)  # when the job will end: a simulation jumps there
    await clock.advance(50.0)
    assert await sim.known_attempts() == set()
    assert clock.next_wakeup() is None


async def test_job_ids_come_from_the_injected_generator_so_replays_repeat(tmp_path):
    ids = iter(f"sim-{i:06d}" for i in range(100))
    b = Broker(BrokerSettings(db=str(tmp_path / "h.db")), clock=ManualClock(T0), new_id=lambda: next(ids))
    await b.start([], run_loop=False)
    try:
        first, _ = await b.book.submit(job(name="a"))
        second, _ = await b.book.submit(job(name="b"))
        assert (first.id, second.id) == ("sim-000000", "sim-000001")
    finally:
        await b.stop()


async def test_round_robin_turns_across_passes_of_the_live_cycle(make):
    """The cursor is carried from pass to pass (and in-flight debits do not move it)."""
    from policies.baselines import policy

    h = await make(*(site(n, gpus={"a100-80gb": 8}, adapter=FAST) for n in ("alpha", "bravo", "charlie")))
    h.broker.cycle.pipeline = policy("baseline-round-robin")
    placed = []
    for _ in range(4):
        j = await h.submit(count=1, duration_s=600)
        await h.cycle()  # one pass per job: the cursor must survive between passes
        placed.append((await h.job(j.id)).site)
    assert placed == ["alpha", "bravo", "charlie", "alpha"]


async def test_a_configured_profile_routes_live_jobs(tmp_path):
    """``broker.profiles.default: cheap`` makes the live cycle place by price."""
    clock = ManualClock(T0)
    settings = BrokerSettings(db=str(tmp_path / "p.db"), shutdown_grace_s=0.1, profiles={"default": "cheap"})
    b = Broker(settings, clock=clock)
    dear = site("alpha", gpus={"a100-80gb": 8}, adapter=FAST).model_copy(update={"usd_per_gpu_hour": {"a100-80gb": 9.0}})
    cheap = site("bravo", gpus={"a100-80gb": 8}, adapter=FAST).model_copy(update={"usd_per_gpu_hour": {"a100-80gb": 3.0}})
    await b.start([dear, cheap], run_loop=False)
    try:
        assert [w.scorer.name for w in b.cycle.pipeline.scorers][0] == "cost"
        j, _ = await b.book.submit(job(count=2, duration_s=600))
        await b.cycle.run_once()
        assert (await b.book.get(j.id)).site == "bravo"  # a tie would go to alpha, first by name
    finally:
        await b.stop()


async def test_a_tenant_that_used_the_site_yesterday_yields_todays_scarce_gpus_to_one_that_did_not(make):
    quotas = [{"tenant": "a", "burst_gpus": 8}, {"tenant": "b", "burst_gpus": 8}]  # equal weights, no guarantee
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas))
    burst = await h.submit(tenant="a", name="burst", count=8, duration_s=10 * 3600)
    await h.cycle()
    await h.step(1.0)
    await h.step(10 * 3600)
    assert (await h.job(burst.id)).state == JobState.SUCCEEDED
    await h.step(3600)  # the site re-weights usage hourly
    # a queues first, b second: the plain order (priority, then age) would give a the site again
    a_jobs = [await h.submit(tenant="a", name=f"a{i}", count=4) for i in range(2)]
    b_jobs = [await h.submit(tenant="b", name=f"b{i}", count=4) for i in range(2)]
    await h.cycle()
    states = {j.spec.name: (await h.job(j.id)).state for j in a_jobs + b_jobs}
    assert states == {"a0": JobState.QUEUED, "a1": JobState.QUEUED,
                      "b0": JobState.DISPATCHING, "b1": JobState.DISPATCHING}, states
    quota = h.broker.federation.get("alpha").state.quota
    used = {t.tenant: t.decayed_usage_gpu_h for t in quota.tenants}
    assert used["a"] > 30 and used["b"] == 0  # 80 GPU-hours, decayed over 6 h half-lives


async def test_a_checkpointed_job_reclaimed_by_the_guarantees_owner_resumes_with_its_progress(make):
    quotas = [{"tenant": "a", "burst_gpus": 8}, {"tenant": "b", "guaranteed_gpus": 8}]
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas))
    borrower = await h.submit(tenant="a", name="long", count=8, duration_s=2 * 3600, preemptible=True,
                              checkpointable=True)
    await h.cycle()
    await h.step(1.0)
    await h.step(3600)  # an hour of its two done
    owner = await h.submit(tenant="b", name="owner", count=8, duration_s=3600)
    await h.cycle()  # the site is full, but b reclaims its guarantee there
    await h.step(1.0)
    assert (await h.job(owner.id)).state == JobState.RUNNING
    preempted = await h.job(borrower.id)
    assert preempted.state == JobState.QUEUED and preempted.run_s == pytest.approx(3600, abs=2)
    events = await h.broker.store.job_events(borrower.id)
    assert any(e["state"] == "preempted" and "reclaims its guarantee (8 GPUs)" in e["reason"] for e in events)
    await h.step(3600)  # the owner's hour ends; the borrower goes back and runs only what it had left
    await h.cycle()
    await h.step(1.0)
    await h.step(3600 + 1)
    done = await h.job(borrower.id)
    assert done.state == JobState.SUCCEEDED and done.attempt == 2
    assert done.run_s == pytest.approx(2 * 3600, abs=5)


@pytest.mark.parametrize("quotas", [[{"tenant": "a", "guaranteed_gpus": 8}], [{"tenant": "a", "burst_gpus": 8}],
                                    [{"tenant": "a", "guaranteed_gpus": 4, "burst_gpus": 4},
                                     {"tenant": "b", "guaranteed_gpus": 4}]],
                         ids=["all guaranteed", "all burst", "half and half"])
@pytest.mark.parametrize("preemptible", [True, False], ids=["preemptible", "not preemptible"])
async def test_a_job_of_higher_priority_is_routed_to_where_its_tenant_at_its_limit_preempts_its_own(
        make, quotas, preemptible):
    """A tenant whose preemptible job of low priority holds all it may hold at the only site: a job of its own of
    higher priority is placed there, and the site preempts the low one for it (a tenant at its limit may preempt
    its own jobs of lower priority). The broker used to skip the site (its quota "may hold 0 more GPUs"), and the
    urgent job waited for the low one to end. The low one is not checkpointable: it starts again from zero."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas,
                        fair_share={"mode": "time", "min_run_s": 600}))
    low = await h.submit(tenant="a", name="low", count=8, duration_s=2 * 3600, preemptible=True)
    await h.cycle()
    await h.step(1.0)
    await h.step(1800)
    urgent = await h.submit(tenant="a", name="urgent", count=4, duration_s=3600, priority=10, preemptible=preemptible)
    await h.cycle()
    await h.step(1.0)
    assert ((await h.job(urgent.id)).state, (await h.job(urgent.id)).site) == (JobState.RUNNING, "alpha")
    preempted = await h.job(low.id)
    assert (preempted.state, preempted.attempt, preempted.run_s) == (JobState.QUEUED, 1, 0.0)
    events = await h.broker.store.job_events(low.id)
    assert any(e["state"] == "preempted" and "priority 10: preempts 1 job" in e["reason"] for e in events)
    # Once the urgent job is done, the low one runs its two hours again, from the start.
    await h.step(3600)
    await h.cycle()
    await h.step(1.0)
    again = await h.job(low.id)
    assert (again.state, again.attempt) == (JobState.RUNNING, 2)
    await h.step(2 * 3600 - 10)
    assert (await h.job(low.id)).state == JobState.RUNNING
    await h.step(20)
    done = await h.job(low.id)
    assert done.state == JobState.SUCCEEDED and done.run_s == pytest.approx(2 * 3600, abs=5)


@pytest.mark.parametrize("model,routed", [("a100-80gb", False), ("h100-80gb", True)],
                         ids=["not for a job on another model", "for a job on that model"])
async def test_a_tenant_at_its_limit_is_sent_a_job_to_preempt_its_own_only_on_their_model(make, model, routed):
    """Tenant a holds all its quota lets it at alpha in one preemptible job on the H100s; the A100s are free. The site
    preempts for a job only jobs on the model it gives it, so an urgent A100 job of a's would be refused there: the
    broker, which used to count a's preemptible GPUs over every model and send it, keeps it queued, quoting the
    quota. An urgent H100 job is sent, and preempts the low one."""
    h = await make(site("alpha", gpus={"a100-80gb": 8, "h100-80gb": 8}, adapter=FAST,
                        quotas=[{"tenant": "a", "guaranteed_gpus": 8}]))
    low = await h.submit(tenant="a", name="low", count=8, model="h100-80gb", duration_s=2 * 3600, preemptible=True)
    await h.cycle()
    await h.step(1.0)
    await h.step(1800)
    urgent = await h.submit(tenant="a", name="urgent", count=4, model=model, duration_s=3600, priority=10)
    await h.cycle()
    await h.step(1.0)
    if routed:
        assert ((await h.job(urgent.id)).state, (await h.job(low.id)).state) == (JobState.RUNNING, JobState.QUEUED)
        return
    assert ((await h.job(urgent.id)).state, (await h.job(low.id)).state) == (JobState.QUEUED, JobState.RUNNING)
    verdict = (await h.decision(urgent.id)).sites[0]
    assert verdict.reasons == ["quota-refuses: tenant a may hold 0 more GPUs here; the job needs 4"]


@pytest.mark.parametrize("model,routed", [("a100-80gb", False), ("h100-80gb", True)],
                         ids=["not for a job on another model", "for a job on that model"])
async def test_a_tenant_is_sent_a_job_to_reclaim_its_guarantee_only_on_the_model_borrowers_hold(make, model, routed):
    """Tenant a holds its 8 guaranteed GPUs on alpha's A100s and borrows the 8 H100s with preemptible work; b,
    guaranteed 8 GPUs of any model, holds none. The site reclaims for a job only borrowers' jobs on the model it
    gives it, so a job of b's on the A100s would be refused there: the broker, which used to count b's 8
    reclaimable GPUs for every model and send it, keeps it queued. A job of b's on the H100s is sent, and
    reclaims b's guarantee from a's borrowed work."""
    quotas = [{"tenant": "a", "guaranteed_gpus": 8, "burst_gpus": 8}, {"tenant": "b", "guaranteed_gpus": 8}]
    h = await make(site("alpha", gpus={"a100-80gb": 8, "h100-80gb": 8}, adapter=FAST, quotas=quotas))
    held = await h.submit(tenant="a", name="held", count=8, model="a100-80gb", duration_s=2 * 3600)
    borrowed = await h.submit(tenant="a", name="borrowed", count=8, model="h100-80gb", duration_s=2 * 3600,
                              preemptible=True)
    await h.cycle()
    await h.step(1.0)
    await h.step(1800)
    owner = await h.submit(tenant="b", name="owner", count=4, model=model, duration_s=3600)
    await h.cycle()
    await h.step(1.0)
    states = [(await h.job(j.id)).state for j in (owner, held, borrowed)]
    if routed:
        assert states == [JobState.RUNNING, JobState.RUNNING, JobState.QUEUED]
        events = await h.broker.store.job_events(borrowed.id)
        assert any(e["state"] == "preempted" and "reclaims its guarantee (8 GPUs)" in e["reason"] for e in events)
        return
    assert states == [JobState.QUEUED, JobState.RUNNING, JobState.RUNNING]
    verdict = (await h.decision(owner.id)).sites[0]
    assert verdict.reasons == ["gpus-do-not-fit: job needs 4 a100-80gb; 0 free"]
    assert [e["state"] for e in await h.broker.store.job_events(owner.id)] == ["queued"]  # never sent, never refused


async def test_a_job_of_higher_priority_is_not_routed_to_preempt_what_its_tenants_ceiling_keeps_it_from(make):
    """The same, with the tenant's priority ceiling at the low job's priority: the site would not preempt (both
    count as priority 5 there), so the broker does not route the job there to be refused."""
    quotas = [{"tenant": "a", "guaranteed_gpus": 8, "priority_ceiling": 5}]
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas))
    low = await h.submit(tenant="a", name="low", count=8, duration_s=2 * 3600, preemptible=True, priority=5)
    await h.cycle()
    await h.step(1.0)
    await h.step(1800)
    urgent = await h.submit(tenant="a", name="urgent", count=4, duration_s=3600, priority=10)
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(urgent.id)).state == JobState.QUEUED
    assert (await h.job(low.id)).state == JobState.RUNNING
    verdict = (await h.decision(urgent.id)).sites[0]
    # Nor do its GPUs count as free for it: what the site may preempt for it is below its ceiling there.
    assert verdict.reasons == ["quota-refuses: tenant a may hold 0 more GPUs here; the job needs 4",
                               "gpus-do-not-fit: job needs 4 GPUs of any model; 0 free"]


@pytest.mark.parametrize("second_run_s", [3600.0, 200.0])
async def test_a_job_checkpointed_twice_counts_the_restart_it_spent_in_its_second_attempt_as_no_work(
        make, second_run_s):
    """run_s is the time a job ran; the work it kept is that less what its attempts that resumed from a
    checkpoint spent restarting (``restart_s``: each one's run, up to its profile's overhead, 600 s for
    ``green``), and a move's estimate of the work done (work_done) counts this attempt's restart too."""
    quotas = [{"tenant": "a", "burst_gpus": 8}, {"tenant": "b", "guaranteed_gpus": 8}]
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas), profiles={"default": "green"})
    borrower = await h.submit(tenant="a", name="long", count=8, duration_s=4 * 3600, preemptible=True,
                              checkpointable=True)
    await h.step(2800)  # so that the third attempt starts late in an hour (see the plan's end below)
    await h.cycle()
    await h.step(1.0)
    for n, ran in enumerate((3600.0, second_run_s)):  # a run, then the guarantee's owner takes the site an hour
        await h.step(ran)
        owner = await h.submit(tenant="b", name=f"owner{n}", count=8, duration_s=3600)
        await h.cycle()
        await h.step(1.0)
        assert (await h.job(owner.id)).state == JobState.RUNNING
        await h.step(3600)
        await h.cycle()
        await h.step(1.0)
    job = await h.job(borrower.id)
    assert job.state == JobState.RUNNING and job.attempt == 3
    assert job.run_s == pytest.approx(3600 + second_run_s, abs=5)
    restarted = min(second_run_s, 600.0)  # the first attempt started afresh; the second resumed
    assert job.restart_s == pytest.approx(restarted, abs=5)
    now = job.updated_at + timedelta(seconds=1800)
    assert work_done(job, now, 600.0) == pytest.approx(3600 + second_run_s - restarted + 1800 - 600, abs=5)
    # The time-shift plan holds its GPUs until its expected end: this attempt's restart, then the rest of the
    # four hours' work, counted from this attempt's start.
    began = job.updated_at.timestamp()
    end_h = math.ceil((began + 600 + 4 * 3600 - (3600 + second_run_s - restarted)) / 3600)
    assert end_h > math.ceil((began + 4 * 3600 - job.run_s) / 3600)  # later than if every second run were work
    snap = h.broker.cycle._with_plan(h.broker.federation.freeze(job.updated_at))
    held = snap.plan_free[snap.index["alpha"], MODEL_INDEX["a100-80gb"]]
    h0 = int(began // 3600)
    assert held[end_h - h0 - 1] == 0 and held[end_h - h0] == 8


def test_a_starting_broker_compiles_the_decision_kernels_before_it_takes_charge(tmp_path: Path) -> None:
    """The first call of a Numba kernel compiles it (seconds on a fresh install), once per array layout: the
    broker does that in a worker thread while it starts, so no scheduling pass stalls the event loop, and
    with it heartbeats and lease grants, for a compiler. Checked in a fresh process, where nothing has called
    a kernel yet: after start every kernel holds compiled code, the scorers' for jobs that any of several
    models suits (column-major arrays) and for jobs with one usable model."""
    probe = f"""
import asyncio
from broker.config import BrokerSettings
from broker.service import Broker
import policies._scores as scores, policies._shift_search as search, policies.runtime_risk as risk
names = ("gather_normalise", "least_scaled", "window_mean_rows", "free_where", "search_later", "start_now", "room_now",
         "walk_now", "_penalty")
def compiled():
    return {{n: [tuple(getattr(t, "layout", "") for t in sig) for sig in getattr(getattr(scores, n, None) or
            getattr(search, n, None) or getattr(risk, n), "signatures", [])] for n in names}}
assert not any(compiled().values()), "compiled before the broker started"
async def main():
    broker = Broker(BrokerSettings(db={str(tmp_path / 'h.db')!r}))
    await broker.start([], run_loop=False)
    await broker.stop()
asyncio.run(main())
# A profile of the operator's own (any set of scorers, in any order) decides without compiling anything.
from policies.profiles import pipeline_for
from policies.snapshot import JobRequest, build_snapshot
from tests.builders import NOW, job, site, site_state
specs = [site("a"), site("b", region="aws:eu-central-1")]
snap = build_snapshot(NOW, specs, {{s.name: site_state(s) for s in specs}})
before = len(scores.gather_normalise.signatures)
for weights in ({{"round_robin": 1.0, "carbon": 1.0}}, {{"telemetry": 0.1, "carbon": 1.0, "cost": 0.05}},
                {{"least_loaded": 1.0, "carbon": 0.5, "free_gpus": 0.2, "latency": 0.3}}):
    pipeline_for(weights).decide(JobRequest.from_spec("j", job()), snap)
assert len(scores.gather_normalise.signatures) == before, "a custom profile compiled the normalisation"
print(([sig[0].mutable for sig in risk._penalty.signatures],
       [sig[12].mutable for sig in search.search_later.signatures]))
print(compiled())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    compiled = ast.literal_eval(out.stdout.strip().split("\n")[-1])
    # The run-time errors every snapshot carries are read-only, a type Numba compiles on its own; so is the
    # room a profile with latency_reserve keeps for latency-bound jobs.
    errors, kept = ast.literal_eval(out.stdout.strip().split("\n")[-2])
    assert False in errors and False in kept
    assert all(compiled[name] for name in compiled), compiled  # every kernel has compiled code
    rooms = {layouts[0] for layouts in compiled["least_scaled"]}
    assert rooms == {"C", "F"}, compiled["least_scaled"]  # one usable column, and several
    # The walk over a profile's sites turned away now: models given (a named model), and chosen from the fit.
    assert {layouts[2] for layouts in compiled["walk_now"]} == {"C", "F"}, compiled["walk_now"]


async def test_a_broker_says_at_start_which_profiles_move_running_jobs(tmp_path, caplog):
    """``green`` moves running checkpointable jobs (tests/test_live_moves.py): a live broker offering it says
    so at start, naming only the profiles that would move work."""
    import logging

    clock = ManualClock(T0)
    settings = BrokerSettings(db=str(tmp_path / "m.db"), shutdown_grace_s=0.1,
                              profiles={"default": "fast", "job_may_choose": ["green", "cheap"]})
    b = Broker(settings, clock=clock)
    with caplog.at_level(logging.INFO, logger="broker.service"):
        await b.start([site("alpha", gpus={"a100-80gb": 8}, adapter=FAST)], run_loop=False)
    try:
        assert "profiles green move running checkpointable jobs to where the rest of their run is" in caplog.text
        assert "cheap" not in caplog.text.split("move running")[0].split("profiles")[-1]
    finally:
        await b.stop()


async def test_a_waiting_jobs_explanation_quotes_figures_at_most_a_minute_old(make):
    # Its decision was recorded again only when which filters turned which sites away changed: the GPUs freed
    # since did not change that, and `heliotrope explain` quoted the free GPUs of when it first waited, for hours.
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    blocker = await h.submit(name="blocker", count=4, duration_s=100)
    await h.cycle()
    await h.step(1.0)
    big = await h.submit(name="big", count=16)
    await h.cycle()
    assert (await h.decision(big.id)).sites[0].reasons == ["gpus-do-not-fit: job needs 16 GPUs of any model; 4 free"]
    await h.step(100)  # the blocker ends: 8 free, the same filter fails at the same site
    assert (await h.job(blocker.id)).state == JobState.SUCCEEDED
    await h.clock.advance(60)
    await h.broker.cycle.run_once(full=True)
    d = await h.decision(big.id)
    assert d.sites[0].reasons == ["gpus-do-not-fit: job needs 16 GPUs of any model; 8 free"]
    assert d.decided_at == h.clock.now()
    # ... while the event stream heard that it waits once, not once a minute
    told = [e for e in h.broker.events.recent if e.type == "decision" and e.job_id == big.id]
    assert [e.data["outcome"] for e in told] == ["unplaceable"]


async def test_a_preempted_job_back_in_the_queue_is_decided_at_the_next_pass_not_the_next_full_one(make):
    """A pass that runs between a preemption and its requeue (the site's report of the stop comes in two stored
    steps) must not leave the requeued job, and the tenant's room it gave back, to a full pass up to
    cycle_interval_s later."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    job = await h.submit(tenant="a", name="long", count=8, duration_s=3600, preemptible=True)
    await h.cycle()
    await h.step(1.0)
    assert (await h.job(job.id)).state == JobState.RUNNING
    book, cycle = h.broker.book, h.broker.cycle
    await book.transition(job.id, JobState.PREEMPTED, reason="preempted on alpha: test")
    await h.cycle()  # a full pass: the preemption freed the site
    assert not cycle.full_pass_due(h.clock.now())
    await book.transition(job.id, JobState.QUEUED, reason="requeued after preemption")
    assert cycle.full_pass_due(h.clock.now())
