"""How a leading replica takes in the jobs other replicas stored (``JobBook.pull_new``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from broker.clock import ManualClock
from broker.jobs import JobBook
from broker.models import Job, JobState
from broker.store.memory import MemoryStore
from tests.builders import NOW, job


def stored(i: int) -> Job:
    return Job(id=f"job-{i:03d}", spec=job(name=f"j{i}"), created_at=NOW, updated_at=NOW)


async def started() -> tuple[JobBook, MemoryStore]:
    store = MemoryStore()
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    return book, store


async def test_jobs_another_replica_stored_are_taken_in_once_and_queued_for_the_cycle() -> None:
    book, store = await started()
    for i in range(3):
        await store.insert_job(stored(i))  # as another replica's API does
    assert await book.pull_new() == 3
    assert [j.id for j in book.take_fresh()] == ["job-000", "job-001", "job-002"]
    await store.insert_job(stored(3))
    assert await book.pull_new() == 1  # only the new one
    assert await book.pull_new() == 0


async def test_a_job_this_book_finished_does_not_come_back_from_an_older_read() -> None:
    book, store = await started()
    await store.insert_job(stored(0))
    await book.pull_new()
    book.take_fresh()
    book.apply("job-000", JobState.CANCELLED, reason="cancelled")  # in memory; its write not yet made
    assert "job-000" not in book.active
    assert await book.pull_new() == 0  # the store still says queued: it is not taken in again
    assert "job-000" not in book.active


class OutOfOrder(MemoryStore):
    """Row 2 commits after row 3 was read (row numbers are handed out before commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: set[int] = set()

    async def active_after(self, seq: int, limit: int):  # noqa: ANN201
        return [(s, j) for s, j in await super().active_after(seq, limit) if s not in self.hidden]

    async def active_at(self, seqs: list[int]):  # noqa: ANN201
        return [(s, j) for s, j in await super().active_at(seqs) if s not in self.hidden]

    async def active_jobs(self):  # noqa: ANN201
        return [j for s, j in await super().active_after(0, 1 << 30) if s not in self.hidden]


async def test_a_row_committed_after_a_later_one_was_read_is_still_taken_in() -> None:
    store = OutOfOrder()
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await store.insert_job(stored(1))
    assert await book.pull_new() == 1
    await store.insert_job(stored(2))
    await store.insert_job(stored(3))
    store.hidden = {2}  # job 2's row: its insert has not committed yet
    assert await book.pull_new() == 1  # job 3
    store.hidden = set()  # now it commits
    book._gaps_checked = float("-inf")  # skipped rows are looked up at most once a second: due now
    assert await book.pull_new() == 1  # job 2, although a later row was read before it
    assert {j.id for j in book.take_fresh()} == {"job-001", "job-002", "job-003"}


async def test_a_takeover_during_a_burst_takes_in_a_row_that_commits_after_the_load() -> None:
    store = OutOfOrder()
    await store.open()
    for i in (1, 2, 3):
        await store.insert_job(stored(i))
    store.hidden = {2}  # job 2's insert took its row number but commits only after the new leader loaded
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    assert set(book.active) == {"job-001", "job-003"}
    store.hidden = set()
    book._gaps_checked = float("-inf")  # the next look at skipped rows is due
    assert await book.pull_new() == 1
    assert "job-002" in book.active


async def test_two_replicas_racing_on_one_idempotency_key_both_answer_with_the_first_job() -> None:
    """Replica B looked the key up before replica A's insert committed; its own insert then collides."""
    store = MemoryStore()
    await store.open()
    a, b = JobBook(store, ManualClock(NOW)), JobBook(store, ManualClock(NOW))
    real_find = store.find_idempotent
    calls = 0

    async def find_late(tenant: str, key: str):  # noqa: ANN202 - the first lookup misses A's insert
        nonlocal calls
        calls += 1
        return None if calls == 1 else await real_find(tenant, key)

    first, created = await a.submit(job(name="once"), "key-1")
    assert created
    store.find_idempotent = find_late  # type: ignore[method-assign]
    again, created_again = await b.submit(job(name="once"), "key-1")
    assert (again.id, created_again) == (first.id, False)


async def test_a_job_a_follower_just_accepted_can_be_cancelled_at_the_leader_before_the_next_pass() -> None:
    """The leader takes in other replicas' jobs once a pass; a cancel that comes first must not be refused as
    for a job that is ending (409) while the job goes on to run."""
    from broker.federation import Federation
    from broker.lifecycle import AlreadyEnded, Lifecycle

    book, store = await started()
    follower = JobBook(store, ManualClock(NOW))
    follower.tracking = False  # a replica that does not lead: it only stores what it is sent
    accepted, _ = await follower.submit(job(name="changed-my-mind"))
    lifecycle = Lifecycle(book, Federation(ManualClock(NOW), lambda spec: None))
    cancelled = await lifecycle.cancel(accepted.id)
    assert cancelled.state == JobState.CANCELLED
    assert (await store.get_job(accepted.id)).state == JobState.CANCELLED
    assert await book.pull_new() == 0 and book.take_fresh() == []  # the next pass has nothing to run
    try:
        await lifecycle.cancel(accepted.id)
    except AlreadyEnded as e:
        assert "already cancelled" in str(e)
    else:
        raise AssertionError("a second cancel must say the job has ended")


async def test_a_job_whose_end_lands_while_a_read_is_under_way_does_not_come_back_from_it() -> None:
    """The read began before the cancel's write and answered after it had landed (and the book had let the
    job go): the job came back as queued, a spurious event, and a placement that then failed on a conflict."""

    class SlowRead(MemoryStore):
        during: Callable[[], Awaitable[None]] | None = None

        async def active_after(self, seq: int, limit: int):  # noqa: ANN201
            rows = await super().active_after(seq, limit)
            if self.during is not None:
                during, self.during = self.during, None
                await during()  # the cancel lands now; the rows were read before it
            return rows

    store = SlowRead()
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    for i in (1, 2):
        await store.insert_job(stored(i))  # as another replica's API does

    async def cancel() -> None:  # the cancel sent to the leader at once (Lifecycle.cancel takes the job in)
        assert await book.take_in("job-001") is not None
        await book.transition("job-001", JobState.CANCELLED, reason="cancelled by request")

    store.during = cancel
    assert await book.pull_new() == 1  # job-002; job-001's queued row was read before its cancel landed
    assert "job-001" not in book.active and (await store.get_job("job-001")).state == JobState.CANCELLED
    assert await book.take_in("job-001") is None


async def test_the_ends_a_book_remembers_are_kept_a_minute_not_for_the_life_of_the_process(monkeypatch) -> None:  # noqa: ANN001
    """A lone broker never pulls, so nothing else ever let the remembered ends go: one entry per job it ran."""
    import broker.jobs as jobs_module

    import time
    from types import SimpleNamespace

    now = [1000.0]  # (the module's clock only: asyncio's stays the real one)
    monkeypatch.setattr(jobs_module, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    book, store = await started()
    for i in range(4):
        made, _ = await book.submit(job(name=f"j{i}"))
        if i == 3:
            now[0] += jobs_module.GAP_TTL_S + 1
        await book.transition(made.id, JobState.CANCELLED, reason="cancelled")
    assert len(book._ended) == 1


async def test_a_leaders_own_submission_taken_in_by_a_pull_before_its_insert_returned_keeps_its_placement() -> None:
    """The insert committed; before the submitting call resumed, the leader's pass pulled the row in and placed
    the job. The submission must not put its queued copy back over the placement: the next pass placed the job
    again, that write failed on a conflict, and the job was left dispatching with no dispatch on its way (seen in
    CI: a new leader, taking submissions at once, kept a job in 'dispatching' for ever)."""

    class SlowAnswer(MemoryStore):
        during: Callable[[], Awaitable[None]] | None = None

        async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None:
            await super().insert_job(job, idempotency_key, digest)
            if self.during is not None:
                during, self.during = self.during, None
                await during()  # committed; the caller has not heard yet

    store = SlowAnswer()
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    placed: list[Job] = []

    async def pass_meanwhile() -> None:
        assert await book.pull_new() == 1
        (fresh,) = book.take_fresh()
        new, version = book.apply(fresh.id, JobState.DISPATCHING, site="a", attempt=1, reason="placed on a")
        await book.write_soon(fresh, new, version)
        placed.append(new)

    store.during = pass_meanwhile
    submitted, created = await book.submit(job(name="mine"))
    assert created and placed and placed[0].id == submitted.id
    assert book.active[submitted.id].state == JobState.DISPATCHING  # the placement stands, in memory as stored
    assert (await store.get_job(submitted.id)).state == JobState.DISPATCHING
    assert book.take_fresh() == []  # and no pass is offered it again as a queued job


async def test_a_job_cancelled_before_its_submission_call_returned_stays_cancelled() -> None:
    """A cancel that reached the leader between the insert's commit and the submitting call's resumption (a client
    that learned the id from the event stream) ended the job; the submission must not bring it back queued."""
    from broker.federation import Federation
    from broker.lifecycle import Lifecycle

    class SlowAnswer(MemoryStore):
        during: Callable[[str], Awaitable[None]] | None = None

        async def insert_job(self, job: Job, idempotency_key: str | None = None, digest: str | None = None) -> None:
            await super().insert_job(job, idempotency_key, digest)
            if self.during is not None:
                during, self.during = self.during, None
                await during(job.id)

    store = SlowAnswer()
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    lifecycle = Lifecycle(book, Federation(ManualClock(NOW), lambda spec: None))

    async def cancel(job_id: str) -> None:
        assert (await lifecycle.cancel(job_id)).state == JobState.CANCELLED

    store.during = cancel
    submitted, _ = await book.submit(job(name="changed-my-mind"))
    assert submitted.id not in book.active and book.take_fresh() == []
    assert (await store.get_job(submitted.id)).state == JobState.CANCELLED
