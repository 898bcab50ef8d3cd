"""Leader election among replicas (``broker.leadership``) on the memory store: who leads, for how long, and
what a leader that is no longer sure of its lease may still do."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from broker.leadership import Leadership
from broker.store.memory import MemoryStore


async def store() -> MemoryStore:
    s = MemoryStore()
    await s.open()
    return s


def replica(s: MemoryStore, url: str, lease_s: float, log: list[str], take_over_s: float = 0.0) -> Leadership:
    async def elected(epoch: int) -> None:
        log.append(f"{url} elected {epoch}")
        await asyncio.sleep(take_over_s)

    async def deposed(why: str) -> None:
        log.append(f"{url} deposed: {why}")

    return Leadership(s, url, lease_s, elected, deposed)


async def test_two_replicas_with_the_same_address_never_both_lead() -> None:
    """Every pod serves on 0.0.0.0:8080: the address alone must not make two processes one holder."""
    s, log = await store(), []
    a, b = replica(s, "http://0.0.0.0:8080", 0.6, log), replica(s, "http://0.0.0.0:8080", 0.6, log)
    a.start()
    b.start()
    await asyncio.sleep(0.5)
    assert [a.leading, b.leading].count(True) == 1
    assert a.holder != b.holder
    await a.stop()
    await b.stop()


async def test_a_takeover_slower_than_a_renewal_period_still_ends_ready_to_lead() -> None:
    s, log = await store(), []
    a = replica(s, "http://a", 0.6, log, take_over_s=0.5)  # longer than lease / 3
    a.start()
    await asyncio.sleep(1.0)
    assert a.leading and a.ready and a.certain()
    await a.stop()


async def test_a_leader_that_was_not_renewed_in_time_is_not_sure_and_steps_down() -> None:
    s, log = await store(), []
    a = replica(s, "http://a", 0.6, log)
    a.start()
    await asyncio.sleep(0.3)
    assert a.certain()
    a._task.cancel()  # as if the process were paused: no renewal goes out
    await asyncio.sleep(0.5)
    assert not a.certain()  # two thirds of a lease passed since the last renewal was sent
    await asyncio.sleep(0.05)
    assert not a.leading and any("may have run out" in line for line in log)
    b = replica(s, "http://b", 0.6, log)
    b.start()
    await asyncio.sleep(0.5)
    assert b.leading and await b.store.leader() == b.holder
    await b.stop()


async def test_a_replica_whose_takeover_fails_lets_another_take_over() -> None:
    s, log = await store(), []

    async def broken(epoch: int) -> None:
        raise RuntimeError("a site's adapter would not start")

    async def deposed(why: str) -> None:
        log.append(why)

    a = Leadership(s, "http://a", 0.6, broken, deposed)
    a.start()
    await asyncio.sleep(0.3)
    b = replica(s, "http://b", 0.6, log)
    b.start()
    await asyncio.sleep(0.6)
    assert b.leading and not a.leading
    assert any("taking over failed" in line for line in log)
    await a.stop()
    await b.stop()


async def leading_broker(s: MemoryStore, cycle_interval_s: float = 0.05):  # noqa: ANN201
    """A broker elected leader among replicas (alone on ``s``), in charge, with no site."""
    from broker.config import BrokerSettings, ReplicaSettings
    from broker.service import Broker

    broker = Broker(BrokerSettings(db=":memory:", cycle_interval_s=cycle_interval_s,
                                   replicas=ReplicaSettings(lease_s=30.0)), store=s)
    await broker.start([])
    broker.elect("http://127.0.0.1:1")
    for _ in range(100):
        if broker.in_charge:
            return broker
        await asyncio.sleep(0.05)
    await broker.stop()
    raise AssertionError("the broker never took charge")


async def test_a_cancel_refused_after_its_leader_stepped_down_leaves_no_copy_of_the_job_on_the_follower() -> None:
    """A follower reads jobs from the store, which the new leader keeps current: its book is emptied when it stops
    leading. A cancel whose write was on its way then, and was refused (a newer leader fenced it), put the job back
    in that book, where it stayed: the replica answered with that copy ('queued') for as long as it followed,
    whatever the new leader did with the job."""
    from broker.models import JobState
    from broker.store import Fenced, StoreError
    from tests.builders import job

    s = await store()
    broker = await leading_broker(s)
    try:
        assert broker.leadership is not None
        submitted, _ = await broker.book.submit(job())  # queued: there is no site
        leadership, enqueue = broker.leadership, s.enqueue_update

        def refused_after_the_step_down(*args: object, **kw: object) -> asyncio.Future[None]:
            async def answer() -> None:
                await leadership.step_down("another replica holds the lease now")
                raise Fenced("another replica leads now (epoch 2)")
            return asyncio.ensure_future(answer())

        s.enqueue_update = refused_after_the_step_down  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            await broker.lifecycle.cancel(submitted.id)
        s.enqueue_update = enqueue  # type: ignore[method-assign]
        assert not broker.in_charge
        # The new leader runs the job; this replica answers for it as the store has it.
        stored = await s.get_job(submitted.id)
        assert stored is not None
        placed = stored.transition(JobState.DISPATCHING, stored.updated_at, site="alpha", attempt=1, reason="placed")
        await s.enqueue_update(placed, stored.version)
        assert (await broker.book.get(submitted.id)).state == JobState.DISPATCHING
    finally:
        await broker.stop()


async def test_a_change_reading_the_job_from_the_store_as_its_leader_stepped_down_leaves_no_copy_behind() -> None:
    """The same for a job another replica accepted, which the leader's book had not taken in yet: the change read it
    from the store, and its replica stopped leading during that read. Taken in then, the job (changed, in the
    emptied book) was what the follower answered with from then on."""
    from datetime import UTC, datetime

    from broker.jobs import JobNotFound
    from broker.models import Job, JobChange, JobState
    from tests.builders import job

    s = await store()
    broker = await leading_broker(s, cycle_interval_s=60.0)  # (no pass takes the job in before the change does)
    try:
        assert broker.leadership is not None
        now = datetime.now(UTC)
        theirs = Job(id="01theirs0000000000", spec=job(), created_at=now, updated_at=now, reason="waiting")
        await s.insert_job(theirs)  # accepted by another replica
        leadership, get_job = broker.leadership, s.get_job

        async def stepped_down_meanwhile(job_id: str) -> Job | None:
            found = await get_job(job_id)
            await leadership.step_down("another replica holds the lease now")
            return found

        s.get_job = stepped_down_meanwhile  # type: ignore[method-assign]
        with contextlib.suppress(JobNotFound):  # (this replica no longer leads: the change is not made here)
            await broker.change_job(theirs.id, JobChange(priority=5))
        s.get_job = get_job  # type: ignore[method-assign]
        assert not broker.in_charge
        stored = await s.get_job(theirs.id)
        assert stored is not None
        placed = stored.transition(JobState.DISPATCHING, now, site="alpha", attempt=1, reason="placed")
        await s.enqueue_update(placed, stored.version)  # by the new leader
        assert (await broker.book.get(theirs.id)).state == JobState.DISPATCHING
    finally:
        await broker.stop()
