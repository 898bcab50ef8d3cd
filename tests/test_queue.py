"""The queue index (broker.queue) and the book's compact queued jobs (broker.jobs.ActiveJobs)."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.jobs import ActiveJobs
from broker.models import Job, JobState
from broker.queue import QueueIndex
from policies.fair_order import FairOrder, Standing
from tests.builders import NOW, job


def queued(i: int, tenant: str = "t1", count: int = 1, priority: int = 0, age_s: float = 0.0, **more) -> Job:
    at = NOW - timedelta(seconds=age_s)
    return Job(id=f"j{i:05d}", spec=job(tenant=tenant, name=f"n{i}", count=count, priority=priority, **more),
               created_at=at, updated_at=at)


def plain_order(jobs: list[Job]) -> list[str]:
    """The cycle's order before the index: priority, then oldest, then id."""
    return [j.id for j in sorted(jobs, key=lambda j: (-j.spec.priority, j.created_at, j.id))]


job_lists = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from([1, 2, 4]), st.sampled_from([0, 10]),
              st.integers(0, 50)),
    max_size=60,
).map(lambda rows: [queued(i, t, c, p, float(age)) for i, (t, c, p, age) in enumerate(rows)])


@given(job_lists)
@settings(max_examples=60, deadline=None)
def test_a_walk_that_fails_nothing_visits_every_job_in_the_plain_order(jobs):
    index = QueueIndex()
    for j in jobs:
        index.add(j)
    assert list(index.walk()) == plain_order(jobs)


@given(job_lists, st.lists(st.tuples(st.sampled_from(["a", "e"]), st.sampled_from([1, 3]),
                                     st.sampled_from([0, 5, 10, 20]), st.integers(0, 50)), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_jobs_not_queued_are_walked_at_their_turns_queued_jobs_first_on_a_tie_and_each_other_in_order(jobs, mine):
    """A preview's walk (``extra``): each job not queued comes where the plain order puts it, after a queued job
    of the same priority and age (queued first), and after the extras before it of the same priority and age
    (submitted first); none is added to the queue, and one that finds no site drops no other."""
    index = QueueIndex()
    for j in jobs:
        index.add(j)
    extra = [queued(99990 + n, t, c, p, float(age)).model_copy(update={"id": f"preview {n}"})
             for n, (t, c, p, age) in enumerate(mine)]
    walk = index.walk(extra=[index.place_of(j) for j in extra])
    seen = []
    for job_id in walk:
        seen.append(job_id)
        if job_id.startswith("preview"):
            walk.fail_group()
    level = {j.id: (0, n) for n, j in enumerate(jobs)} | {j.id: (1, n) for n, j in enumerate(extra)}
    expected = sorted(jobs + extra, key=lambda j: (-j.spec.priority, j.created_at, *level[j.id]))
    assert seen == [j.id for j in expected]
    assert not any(j.id in index for j in extra) and len(index) == len(jobs)


def test_a_walk_told_to_pass_over_the_queue_yields_only_the_jobs_not_queued_left():
    index = QueueIndex()
    jobs = [queued(i, age_s=100 - i) for i in range(4)]
    for j in jobs:
        index.add(j)
    extra = [queued(10 + n, priority=p, age_s=0).model_copy(update={"id": f"preview {n}"})
             for n, p in enumerate([0, 5, 0])]
    walk = index.walk(extra=[index.place_of(j) for j in extra])
    seen = []
    for job_id in walk:
        seen.append(job_id)
        if job_id == "j00000":
            walk.only_extra()
    assert seen == ["preview 1", "j00000", "preview 0", "preview 2"]


@given(job_lists, st.data())
@settings(max_examples=60, deadline=None)
def test_a_failed_group_is_skipped_for_the_rest_of_the_walk_and_nothing_else_is(jobs, data):
    index = QueueIndex()
    for j in jobs:
        index.add(j)
    by_id = {j.id: j for j in jobs}
    shape = lambda j: (j.spec.priority, j.spec.tenant, j.spec.gpus.count)  # noqa: E731  # what the groups key on here
    failing = data.draw(st.sets(st.sampled_from(sorted({shape(j) for j in jobs}) or [(0, "a", 1)])))
    walk = index.walk()
    seen = []
    for job_id in walk:
        seen.append(job_id)
        if shape(by_id[job_id]) in failing:
            walk.fail_group()
    # expected: the plain order, keeping only the first job of each failing shape
    expected, failed = [], set()
    for job_id in plain_order(jobs):
        s = shape(by_id[job_id])
        if s in failed:
            continue
        expected.append(job_id)
        if s in failing:
            failed.add(s)
    assert seen == expected
    assert walk.groups_failed == len(failed)


@given(job_lists, st.data())
@settings(max_examples=60, deadline=None)
def test_with_fair_shares_the_walk_serves_tenants_as_fair_order_does(jobs, data):
    standing = {"a": Standing(data.draw(st.sampled_from([0.0, 4.0, 8.0])), 8.0, True), "b": Standing(2.0, 8.0, True),
                "d": Standing(0.0, 0.0, True)}  # d: listed, its usage took its entitlement; c: listed nowhere
    placed = data.draw(st.sets(st.sampled_from([j.id for j in jobs] or ["none"])))
    index = QueueIndex()
    for j in jobs:
        index.add(j)
    by_id = {j.id: j for j in jobs}
    walk = index.walk(standing)
    seen = []
    for job_id in walk:
        seen.append(job_id)
        if job_id in placed:
            walk.placed(by_id[job_id].spec.tenant, 1.0)
    reference = FairOrder(jobs, lambda j: j.spec.tenant, lambda j: j.spec.priority,
                          lambda j: (j.created_at, j.id), standing)
    expected = []
    for j in reference:
        expected.append(j.id)
        if j.id in placed:
            reference.placed(j.spec.tenant, 1.0)
    assert seen == expected


def test_jobs_placed_or_cancelled_during_a_walk_are_not_visited_and_the_walk_goes_on():
    index = QueueIndex()
    jobs = [queued(i, age_s=100 - i) for i in range(6)]  # one group, oldest first: j00000 .. j00005
    for j in jobs:
        index.add(j)
    seen = []
    for job_id in index.walk():
        seen.append(job_id)
        index.discard(job_id)  # placed
        if job_id == "j00001":
            index.discard("j00003")  # cancelled meanwhile
    assert seen == ["j00000", "j00001", "j00002", "j00004", "j00005"]
    assert len(index) == 0 and not index.groups


def test_a_job_added_twice_is_indexed_once_and_removing_an_absent_job_is_harmless():
    index = QueueIndex()
    j = queued(1)
    index.add(j)
    index.add(j)
    assert len(index) == 1 and list(index.walk()) == [j.id]
    index.discard("nope")
    index.discard(j.id)
    index.discard(j.id)
    assert len(index) == 0


def test_reordering_by_urgency_puts_the_nearest_deadline_first():
    index = QueueIndex()
    soon = queued(1, age_s=0, deadline=NOW + timedelta(hours=3))
    late = queued(2, age_s=60, deadline=NOW + timedelta(hours=30))
    jobs = {j.id: j for j in (soon, late)}
    for j in jobs.values():
        index.add(j)
    assert list(index.walk()) == [late.id, soon.id]  # oldest first
    index.reorder(lambda j: (j.spec.deadline.timestamp(), j.created_at.timestamp()), jobs.get)
    assert list(index.walk()) == [soon.id, late.id]


# --- ActiveJobs: queued jobs held compactly --------------------------------------------------------------


varied_jobs = st.builds(
    lambda i, count, priority, deadline_h, labels, regions, preemptible, run_s, attempt: Job(
        id=f"j{i}", spec=job(name=f"n{i}", count=count, priority=priority, labels=labels, allowed_regions=regions,
                             preemptible=preemptible, checkpointable=preemptible,
                             deadline=None if deadline_h is None else NOW + timedelta(hours=deadline_h, microseconds=7)),
        created_at=NOW - timedelta(microseconds=i), updated_at=NOW, run_s=run_s, attempt=attempt,
        failed_attempts=min(attempt, 1), reason="requeued after preemption" if attempt else None),
    st.integers(0, 10_000), st.integers(1, 8), st.integers(-5, 100), st.one_of(st.none(), st.integers(2, 48)),
    st.dictionaries(st.sampled_from(["team", "run", "ü"]), st.text(max_size=5), max_size=2),
    st.lists(st.sampled_from(["gcp:us-east1", "aws:eu-west-1"]), unique=True, max_size=2), st.booleans(),
    st.floats(0, 1e6, allow_nan=False), st.integers(0, 3),
)


@given(varied_jobs)
@settings(max_examples=100, deadline=None)
def test_a_queued_job_reads_back_equal_to_what_was_stored(j):
    active = ActiveJobs()
    active[j.id] = j
    assert active[j.id] == j and active.get(j.id) == j
    assert j.id in active and len(active) == 1 and active.queued_count() == 1 and j.id in active.queue


def test_a_job_moves_between_the_queue_and_the_rest_as_its_state_changes():
    active = ActiveJobs()
    j = queued(1)
    active[j.id] = j
    dispatching = j.transition(JobState.DISPATCHING, NOW, site="alpha", attempt=1)
    active[j.id] = dispatching
    assert active[j.id] is dispatching and j.id not in active.queue and list(active.unqueued()) == [dispatching]
    back = dispatching.transition(JobState.QUEUED, NOW)
    active[j.id] = back
    assert active[j.id] == back and j.id in active.queue and list(active.unqueued()) == []
    del active[j.id]
    assert j.id not in active and len(active) == 0 and len(active.queue) == 0
    other = queued(2)
    active[other.id] = other
    active.clear()
    assert len(active) == 0 and not active.queue.groups


def test_a_job_that_must_start_at_once_fails_its_own_group_not_one_that_may_be_deferred() -> None:
    # The same shape and deadline: when the first (deferrable false) finds no site, the cycle drops the rest
    # of its group; the second may still be deferred to a later start, so it is walked.
    deadline = NOW + timedelta(hours=30)
    at_once = queued(1, deadline=deadline, deferrable=False, age_s=1.0)  # the older: walked first
    later = queued(2, deadline=deadline)
    index = QueueIndex()
    for j in (at_once, later):
        index.add(j)
    walk = index.walk()
    seen = []
    for job_id in walk:
        seen.append(job_id)
        if job_id == at_once.id:
            walk.fail_group()
    assert seen == [at_once.id, later.id]
