"""The stores: optimistic concurrency, idempotency keys, pagination and job events on every backend (SQLite
and in-memory, through one parametrised fixture); durability, group commit and migrations on SQLite."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from broker.models import Job, JobSpec, JobState
from broker.store import Conflict, DuplicateKey, JobFilter, Store, StoreError, decode_cursor
from broker.store.memory import MemoryStore
from broker.store.sqlite import SQLiteStore
from tests.builders import site

T0 = datetime(2022, 3, 1, 12, tzinfo=UTC)


def make_job(i: int, tenant: str = "t1", state: JobState = JobState.QUEUED, site: str | None = None) -> Job:
    spec = JobSpec(tenant=tenant, name=f"job-{i}", gpus={"count": 1}, duration_s=60)
    at = T0 + timedelta(seconds=i)
    return Job(id=f"job{i:05d}", spec=spec, state=state, site=site, created_at=at, updated_at=at)


@pytest.fixture(params=["sqlite", "memory"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):
    """Each backend, opened; behavioural tests take this and run on both."""
    s: Store = SQLiteStore(tmp_path / "h.db") if request.param == "sqlite" else MemoryStore()
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path):
    """The SQLite store alone, for what only it has: a file, WAL, group commit, migrations."""
    s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    yield s
    await s.close()


async def test_concurrent_writes_all_land(store: Store):
    jobs = [make_job(i) for i in range(600)]
    await asyncio.gather(*(store.insert_job(j) for j in jobs))
    page = await store.list_jobs(JobFilter(), limit=1000)
    assert len(page.items) == 600 and page.next is None


async def test_an_update_from_a_stale_version_is_refused(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    moved = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(moved, expected_version=job.version)
    stale = job.transition(JobState.CANCELLED, T0)
    with pytest.raises(Conflict):
        await store.update_job(stale, expected_version=job.version)
    assert (await store.get_job(job.id)).state == JobState.DISPATCHING


async def test_one_failing_write_in_a_batch_does_not_fail_the_others(store: Store):
    first = make_job(1)
    await store.insert_job(first, idempotency_key="k")
    dup = make_job(2)
    others = [make_job(i) for i in range(3, 40)]
    results = await asyncio.gather(
        store.insert_job(dup, idempotency_key="k"), *(store.insert_job(j) for j in others), return_exceptions=True
    )
    assert isinstance(results[0], DuplicateKey)
    assert all(r is None for r in results[1:])
    assert await store.get_job(dup.id) is None
    assert all([await store.get_job(j.id) is not None for j in others])


async def test_idempotency_keys_are_scoped_to_the_tenant(store: Store):
    await store.insert_job(make_job(1, tenant="a"), idempotency_key="same", digest="d1")
    await store.insert_job(make_job(2, tenant="b"), idempotency_key="same", digest="d2")
    found = await store.find_idempotent("b", "same")
    assert found is not None and found[0].id == "job00002" and found[1] == "d2"
    assert await store.find_idempotent("c", "same") is None


async def test_listing_pages_newest_first_and_filters(store: Store):
    for i in range(25):
        await store.insert_job(make_job(i, tenant="a" if i % 2 else "b",
                                        state=JobState.RUNNING if i % 5 == 0 else JobState.QUEUED,
                                        site="s1" if i % 5 == 0 else None))
    seen, cursor = [], None
    while True:
        page = await store.list_jobs(JobFilter(), limit=10, cursor=cursor)
        seen += [j.id for j in page.items]
        if page.next is None:
            break
        cursor = page.next
    assert seen == [f"job{i:05d}" for i in reversed(range(25))]
    tenant_a = await store.list_jobs(JobFilter(tenant="a"), limit=100)
    assert {j.spec.tenant for j in tenant_a.items} == {"a"} and len(tenant_a.items) == 12
    running = await store.list_jobs(JobFilter(state=JobState.RUNNING, site="s1"), limit=100)
    assert [j.id for j in running.items] == ["job00020", "job00015", "job00010", "job00005", "job00000"]


def test_a_cursor_not_handed_out_by_the_store_is_rejected():
    with pytest.raises(ValueError, match="not a cursor"):
        decode_cursor("garbage!")


async def test_transitions_are_kept_as_job_events(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    d = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(d, job.version, event_reason="placed on a")
    events = await store.job_events(job.id)
    assert [(e["state"], e["reason"]) for e in events] == [("queued", "submitted"), ("dispatching", "placed on a")]


async def test_a_job_id_taken_twice_is_a_duplicate_key_and_the_first_job_stands(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    with pytest.raises(DuplicateKey):
        await store.insert_job(make_job(1, tenant="other"))
    assert await store.get_job(job.id) == job
    assert len(await store.job_events(job.id)) == 1


async def test_an_update_of_a_job_that_does_not_exist_is_a_conflict(store: Store):
    ghost = make_job(1).transition(JobState.CANCELLED, T0)
    with pytest.raises(Conflict):
        await store.update_job(ghost, expected_version=0)
    assert await store.get_job(ghost.id) is None


async def test_a_decision_given_with_an_update_is_stored_with_it_and_not_when_the_update_is_refused(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    placed = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(placed, job.version, decision={"outcome": "placed", "site": "a"})
    stale = job.transition(JobState.DISPATCHING, T0, site="b", attempt=2)
    with pytest.raises(Conflict):
        await store.update_job(stale, job.version, event_reason="placed on b",
                               decision={"outcome": "placed", "site": "b"})
    stored = await store.get_decision(job.id)
    assert stored is not None and (stored.attempt, stored.record) == (1, {"outcome": "placed", "site": "a"})
    assert [e["site"] for e in await store.job_events(job.id)] == [None, "a"], "a refused update left an event"


async def test_a_decision_saved_alone_replaces_the_last_one_for_the_job(store: Store):
    assert await store.get_decision("job00001") is None
    await store.save_decision("job00001", 0, {"outcome": "unplaceable"})
    await store.save_decision("job00001", 0, {"outcome": "deferred"})
    stored = await store.get_decision("job00001")
    assert stored is not None and stored.record == {"outcome": "deferred"}


async def test_active_jobs_are_the_unfinished_ones_oldest_first(store: Store):
    jobs = [make_job(i) for i in range(4)]
    for job in jobs:
        await store.insert_job(job)
    await store.update_job(jobs[1].transition(JobState.CANCELLED, T0), jobs[1].version)
    running = jobs[2].transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(running, jobs[2].version)
    assert [j.id for j in await store.active_jobs()] == ["job00000", "job00002", "job00003"]
    assert (await store.get_job("job00002")) == running


async def test_a_cursor_keeps_the_filter_and_a_full_last_page_has_no_next(store: Store):
    for i in range(12):
        await store.insert_job(make_job(i, tenant="a" if i % 2 else "b"))
    first = await store.list_jobs(JobFilter(tenant="a"), limit=4)
    assert first.next is not None
    rest = await store.list_jobs(JobFilter(tenant="a"), limit=2, cursor=first.next)
    assert [j.id for j in first.items + rest.items] == ["job00011", "job00009", "job00007", "job00005",
                                                        "job00003", "job00001"]
    assert rest.next is None
    with pytest.raises(ValueError, match="not a cursor"):
        await store.list_jobs(JobFilter(), limit=2, cursor="garbage!")


async def test_sites_are_listed_by_name_replaced_in_place_and_deleted(store: Store):
    await store.put_site(site("zeta"))
    await store.put_site(site("alpha"))
    await store.put_site(site("zeta", region="gcp:europe-west3"))
    await store.delete_site("nowhere")
    assert [(s.name, s.region) for s in await store.list_sites()] == [("alpha", "gcp:us-east1"),
                                                                     ("zeta", "gcp:europe-west3")]
    await store.delete_site("alpha")
    assert [s.name for s in await store.list_sites()] == ["zeta"]


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
async def test_a_store_that_is_not_open_refuses_reads_and_writes(backend: str, tmp_path: Path):
    s: Store = SQLiteStore(tmp_path / "h.db") if backend == "sqlite" else MemoryStore()
    with pytest.raises(StoreError, match="not open"):
        await s.insert_job(make_job(1))
    with pytest.raises(StoreError, match="not open"):
        await s.get_job("job00001")


# --- SQLite only: the file, its durability and its schema ---


async def test_a_stored_job_reads_back_equal_after_reopening(tmp_path: Path):
    s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    job = make_job(1)
    await s.insert_job(job)
    await s.close()
    s2 = SQLiteStore(tmp_path / "h.db")
    await s2.open()
    try:
        assert await s2.get_job(job.id) == job
        assert [j.id for j in await s2.active_jobs()] == [job.id]
    finally:
        await s2.close()


async def test_concurrent_writes_share_commits(sqlite_store: SQLiteStore):
    store = sqlite_store
    await asyncio.gather(*(store.insert_job(make_job(i)) for i in range(600)))
    assert store.commits < 100, f"600 concurrent inserts took {store.commits} commits; group commit is not batching"


async def test_the_database_runs_in_wal_mode_with_full_sync(sqlite_store: SQLiteStore, tmp_path: Path):
    with sqlite3.connect(tmp_path / "h.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_database_from_a_newer_release_is_refused_with_a_clear_message(tmp_path: Path):
    path = tmp_path / "h.db"
    s = SQLiteStore(path)
    await s.open()
    await s.close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO schema_version VALUES (99)")
    with pytest.raises(StoreError, match="newer than this heliotrope"):
        await SQLiteStore(path).open()


async def test_reopening_applies_no_migration_twice(tmp_path: Path):
    for _ in range(3):
        s = SQLiteStore(tmp_path / "h.db")
        await s.open()
        await s.close()
    with sqlite3.connect(tmp_path / "h.db") as db:
        assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 1


def test_a_write_that_returned_is_on_disk_when_the_process_is_killed(tmp_path: Path):
    """A child process inserts jobs and prints each id once its write returned; we SIGKILL it mid-stream."""
    db = tmp_path / "k.db"
    child = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from tests.test_store import make_job
        from broker.store.sqlite import SQLiteStore
        async def main():
            s = SQLiteStore({str(db)!r})
            await s.open()
            async def one(i):
                await s.insert_job(make_job(i))
                print(make_job(i).id, flush=True)
            await asyncio.gather(*(one(i) for i in range(100000)))
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    acked = []
    assert proc.stdout is not None
    for line in proc.stdout:
        acked.append(line.strip())
        if len(acked) >= 2000:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(10)
    acked += [line.strip() for line in proc.stdout.read().splitlines() if line.strip()]
    with sqlite3.connect(db) as conn:
        on_disk = {r[0] for r in conn.execute("SELECT id FROM jobs")}
    assert len(acked) >= 2000
    assert set(acked) <= on_disk


async def test_a_write_that_breaks_the_writer_fails_alone_and_later_writes_still_land(sqlite_store: SQLiteStore):
    store = sqlite_store
    bad = make_job(1).model_copy(update={"version": 2**63})  # too large for an SQLite integer
    with pytest.raises(StoreError):
        await store.insert_job(bad)
    good = make_job(2)
    await asyncio.wait_for(store.insert_job(good), 5)
    assert await store.get_job(good.id) == good
