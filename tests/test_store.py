"""The stores: optimistic concurrency, idempotency keys, pagination, job events, leadership and fencing on every
backend (SQLite, in-memory and PostgreSQL, through one parametrised fixture); durability, group commit and
migrations on SQLite and PostgreSQL (a server of the session's own: tests/postgres.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from broker.models import Job, JobSpec, JobState
from broker.store import (
    Conflict, DuplicateKey, Fenced, JobFilter, LimitOverride, Store, StoreError, decode_cursor, ended_at, open_store,
)
from broker.store import postgres as pg
from broker.store import sqlite as sq
from broker.store.memory import MemoryStore
from broker.store.postgres import PostgresStore
from broker.store.sqlite import SQLiteStore
from tests.builders import site
from tests import postgres as postgres_fixtures
from tests.postgres import PostgresServer, free_port

postgres_server = postgres_fixtures.postgres_server  # the session's PostgreSQL server (a fixture)
postgres_dsn = postgres_fixtures.postgres_dsn  # a fresh database on it (a fixture)

T0 = datetime(2022, 3, 1, 12, tzinfo=UTC)


def make_job(i: int, tenant: str = "t1", state: JobState = JobState.QUEUED, site: str | None = None) -> Job:
    spec = JobSpec(tenant=tenant, name=f"job-{i}", gpus={"count": 1}, duration_s=60)
    at = T0 + timedelta(seconds=i)
    return Job(id=f"job{i:05d}", spec=spec, state=state, site=site, created_at=at, updated_at=at)


@pytest.fixture(params=["sqlite", "memory", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):
    """Each backend, opened (PostgreSQL: a fresh database on the session's server); behavioural tests take this
    and run on all three."""
    s: Store
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        s = PostgresStore(await server.create_database())
    else:
        s = SQLiteStore(tmp_path / "h.db") if request.param == "sqlite" else MemoryStore()
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


async def test_a_scoped_listing_keeps_only_the_tenants_or_sites_named(store: Store):
    for i in range(12):
        await store.insert_job(make_job(i, tenant="abc"[i % 3], state=JobState.RUNNING, site=f"s{i % 4}"))
    two = await store.list_jobs(JobFilter(tenants=("a", "c")), limit=100)
    assert {j.spec.tenant for j in two.items} == {"a", "c"} and len(two.items) == 8
    sites = await store.list_jobs(JobFilter(sites=("s1",), tenants=("b",)), limit=100)
    assert [(j.spec.tenant, j.site) for j in sites.items] == [("b", "s1")]
    assert (await store.list_jobs(JobFilter(tenants=()), limit=100)).items == []


async def test_a_listing_by_labels_keeps_the_jobs_carrying_them_all_and_pages_by_cursor(store: Store):
    """``GET /v1/jobs?label=...``: every label named must be on the job (a key alone: any value); keys with dots,
    slashes, quotes and spaces are matched as written, not read as a JSON path."""
    odd = {"sweep.id": "s1", "team/x": 'a "b"', "it's odd": "y"}
    for i in range(30):
        labels = {**odd, "lr": "0.1" if i % 2 else "0.01"} if i % 3 == 0 else {"sweep": "s1", "lr": "0.1"}
        job = make_job(i, state=JobState.RUNNING if i % 4 == 0 else JobState.QUEUED, site="s1" if i % 4 == 0 else None)
        await store.insert_job(job.model_copy(update={"spec": job.spec.model_copy(update={"labels": labels})}))

    async def ids(*labels: tuple[str, str | None], **kw: object) -> list[int]:
        return [int(j.id[3:]) for j in (await store.list_jobs(JobFilter(labels=labels, **kw), 100)).items]

    assert await ids(("sweep.id", "s1")) == [i for i in reversed(range(30)) if i % 3 == 0]
    assert await ids(("sweep", "s1")) == [i for i in reversed(range(30)) if i % 3]  # not sweep.id's "s1"
    assert await ids(("sweep.id", "s1"), ("lr", "0.1")) == [27, 21, 15, 9, 3]
    assert await ids(("team/x", 'a "b"'), ("it's odd", None)) == await ids(("sweep.id", None))
    assert await ids(("sweep.id", "s2")) == [] and await ids(("lr", None), ("nope", None)) == []
    assert await ids(("sweep.id", None), states=(JobState.RUNNING,)) == [24, 12, 0]
    assert await ids(("sweep.id", None), states=(JobState.QUEUED, JobState.RUNNING), tenant="t2") == []
    seen, cursor = [], None
    while True:
        page = await store.list_jobs(JobFilter(labels=(("lr", "0.1"),)), limit=4, cursor=cursor)
        seen += [int(j.id[3:]) for j in page.items]
        if page.next is None:
            break
        cursor = page.next
    assert seen == [i for i in reversed(range(30)) if i % 3 or i % 2]


async def test_a_listing_by_labels_is_not_broken_by_a_job_whose_labels_hold_a_nul(store: Store):
    """A job's labels may hold a NUL (its spec's text is not cleaned; PostgreSQL's json refuses to take out as text
    any value in a document that holds one): a listing by labels still answers, for every job, on every store."""
    for i, labels in enumerate([{"sweep": "s1", "dir": "C:\\u0000"}, {"sweep": "s\x00", "k\x00ey": "v"},
                                {"sweep": "s1", "lr": "1"}]):
        job = make_job(i)
        await store.insert_job(job.model_copy(update={"spec": job.spec.model_copy(update={"labels": labels})}))

    async def ids(*labels: tuple[str, str | None]) -> list[int]:
        return [int(j.id[3:]) for j in (await store.list_jobs(JobFilter(labels=labels), 100)).items]

    assert await ids(("sweep", "s1")) == [2, 0]
    assert await ids(("sweep", None)) == [2, 1, 0]
    assert await ids(("lr", None)) == [2]
    assert await ids(("lr", None), ("sweep", "s1")) == [2]
    assert await ids(("dir", "C:\\u0000")) == [0]  # (a backslash, then "u0000": no NUL)


LABELLED = [{"sweep": "s1", "team": "a"}, {"sweep": "s2"}, {}, {"sweep": "s1", "dir": "C:\\u0000", "k\x00": "v\x00"}]
"""Labels of jobs 0 .. 3 (one with none; one with an escaped backslash and a NUL, which PostgreSQL's json refuses to
take out as text unless read as the listing reads it)."""


def labelled_job(i: int, state: JobState = JobState.QUEUED) -> Job:
    job = make_job(i)
    at = job.updated_at + timedelta(hours=1)
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"labels": LABELLED[i % len(LABELLED)]})})
    return job if state is JobState.QUEUED else job.transition(state, at)


async def sql_database(kind: str, request: pytest.FixtureRequest,
                       tmp_path: Path) -> tuple[Any, str, Callable[[], Store]]:
    """An empty database of the SQL store ``kind`` (``sqlite``, ``postgres``): the store's module (whose
    ``MIGRATIONS`` a test may cut to make the database as an earlier release did), where it is (a path or a URL),
    and a function that opens a store on it."""
    module = sq if kind == "sqlite" else pg
    place = str(tmp_path / "h.db") if module is sq else await request.getfixturevalue(
        "postgres_server").create_database()

    def opener() -> Store:
        return SQLiteStore(place) if module is sq else PostgresStore(place)

    return module, place, opener


async def made_at_migration(module: Any, opener: Callable[[], Store], n: int,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The database made by a release whose store had the first ``n`` migrations of ``module``'s."""
    with monkeypatch.context() as m:
        m.setattr(module, "MIGRATIONS", module.MIGRATIONS[:n])
        s = opener()
        await s.open()
        await s.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def sql_at_migration_5(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A database of each SQL store as the release before the labels' table (migration 6) left it, with jobs 0 .. 3
    of ``LABELLED`` (1 and 2 ended) as that release wrote them; a function that opens a store on it."""
    module, place, opener = await sql_database(request.param, request, tmp_path)
    await made_at_migration(module, opener, 5, monkeypatch)
    await write_as_an_earlier_release(place, [labelled_job(i, JobState.CANCELLED if i in (1, 2) else JobState.QUEUED)
                                              for i in range(4)])
    return opener


async def write_as_an_earlier_release(place: str, jobs: list[Job]) -> None:
    """Insert ``jobs``'s rows as a release before migration 6 does (the row alone: it knows no labels' table)."""
    rows = [(j.id, j.spec.tenant, j.state.value, j.site, j.spec.priority, None, None, j.version, j.model_dump_json(),
             ended_at(j)) for j in jobs]
    if not place.startswith("postgresql://"):
        with sqlite3.connect(place) as db:
            db.executemany(sq._INSERT_JOB, rows)
        return
    conn = await asyncpg.connect(place)
    try:
        await conn.executemany(pg._INSERT_JOB, rows)
    finally:
        await conn.close()


async def test_jobs_stored_before_the_labels_table_are_listed_by_label_once_migrated(sql_at_migration_5):
    """Migration 6 fills the labels' table from the jobs already stored: a listing by label finds them (and one
    submitted since, first), as it did before the upgrade."""
    s = sql_at_migration_5()
    await s.open()
    try:
        await s.insert_job(labelled_job(4))  # {"sweep": "s1", "team": "a"}
        # and one that a replica of the earlier release, still running, submits after the upgrade (PostgreSQL: an
        # SQLite file has one writer, and an earlier release refuses it once migrated, so this one writes it there)
        if isinstance(s, SQLiteStore):
            await s.insert_job(labelled_job(7))
        else:
            await write_as_an_earlier_release(s.dsn, [labelled_job(7)])

        async def ids(*labels: tuple[str, str | None], **kw: object) -> list[int]:
            return [int(j.id[3:]) for j in (await s.list_jobs(JobFilter(labels=labels, **kw), 100)).items]

        assert await ids(("sweep", "s1")) == [7, 4, 3, 0]  # (7: {"sweep": "s1", "dir": ...})
        assert await ids(("sweep", None)) == [7, 4, 3, 1, 0]
        assert await ids(("team", "a"), ("sweep", None)) == [4, 0]
        assert await ids(("dir", "C:\\u0000")) == [7, 3]
        assert await ids(("sweep", "s2"), state=JobState.CANCELLED) == [1]
        assert await ids(("sweep", None), tenant="t2") == []
        page = await s.list_jobs(JobFilter(labels=(("sweep", "s1"),)), 2)
        rest = await s.list_jobs(JobFilter(labels=(("sweep", "s1"),)), 2, page.next)
        assert [j.id for j in page.items] == ["job00007", "job00004"]
        assert [j.id for j in rest.items] == ["job00003", "job00000"] and rest.next is None
    finally:
        await s.close()


async def test_pruning_a_finished_job_removes_its_labels_with_it(sql_at_migration_5):
    """A job deleted by the retention of finished jobs leaves no labels behind (the labels' table would grow by
    every job ever submitted); an active job's stay."""
    s = sql_at_migration_5()
    await s.open()
    try:
        ended = labelled_job(5, JobState.CANCELLED)  # {"sweep": "s2"}, submitted since the upgrade
        await s.insert_job(ended)
        assert sorted(await s.prune_ended(T0 + timedelta(days=1), 10)) == ["job00001", "job00002", "job00005"]
        assert await labels_stored(s) == [("job00000", "sweep", "s1"), ("job00000", "team", "a"),
                                          ("job00003", "dir", "C:\\u0000"), ("job00003", "sweep", "s1")]
        assert [j.id for j in (await s.list_jobs(JobFilter(labels=(("sweep", None),)), 100)).items] == [
            "job00003", "job00000"]
    finally:
        await s.close()


async def test_postgres_a_job_an_earlier_release_submits_while_migration_6_runs_is_listed_by_its_labels(
        postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch):
    """A replica of the earlier release still submitting while this one migrates: a job it inserted as the labels'
    table was being filled (committed before the trigger could be made) is listed by its labels all the same."""
    place = await postgres_server.create_database()
    with monkeypatch.context() as m:
        m.setattr(pg, "MIGRATIONS", pg.MIGRATIONS[:5])
        s = PostgresStore(place)
        await s.open()
        await s.close()
    earlier = await asyncpg.connect(place)
    try:
        submitting = earlier.transaction()  # the earlier release's insert, not yet committed as the upgrade starts
        await submitting.start()
        job = labelled_job(0)
        await earlier.execute(pg._INSERT_JOB, job.id, job.spec.tenant, job.state.value, job.site, job.spec.priority,
                              None, None, job.version, job.model_dump_json(), ended_at(job))
        s = PostgresStore(place)
        opening = asyncio.create_task(s.open())
        for _ in range(200):  # until the migration waits for the earlier release's transaction
            waiting = await earlier.fetchval(  # (a transaction's view of the activity is read once: clear it)
                "SELECT pg_stat_clear_snapshot(), count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'", column=1)
            if waiting:
                break
            await asyncio.sleep(0.05)
        assert waiting
        await submitting.commit()
        await opening
    finally:
        await earlier.close()
    try:
        assert [j.id for j in (await s.list_jobs(JobFilter(labels=(("sweep", "s1"),)), 10)).items] == ["job00000"]
    finally:
        await s.close()


async def labels_stored(s: Store) -> list[tuple[str, str, str]]:
    """Every row of the labels' table, by job id (the NUL-holding label left out: stored as each store can)."""
    sql = "SELECT jobs.id, l.key, l.value FROM job_labels AS l JOIN jobs ON jobs.seq = l.seq ORDER BY 1, 2"
    count = "SELECT COUNT(*) FROM job_labels"
    if isinstance(s, SQLiteStore):
        rows, total = await s._all(sql, ()), (await s._one(count, ()))[0]
    else:
        rows, total = await s._all(sql), (await s._one(count))[0]
    kept = [tuple(r) for r in rows if not r[1].startswith("k")]
    assert total == len(rows)  # no row of a job that is gone
    return kept


async def test_tokens_are_kept_by_id_listed_and_updated(store: Store):
    await store.put_token("tok-2", "d" * 64, '{"id": "tok-2", "v": 1}')
    await store.put_token("tok-1", "e" * 64, '{"id": "tok-1"}')
    with pytest.raises(DuplicateKey):
        await store.put_token("tok-3", "d" * 64, '{"id": "tok-3"}')  # the same digest twice
    await store.update_token("tok-2", '{"id": "tok-2", "v": 2}')
    assert await store.list_tokens() == ['{"id": "tok-1"}', '{"id": "tok-2", "v": 2}']


def test_a_cursor_not_handed_out_by_the_store_is_rejected():
    with pytest.raises(ValueError, match="not a cursor"):
        decode_cursor("garbage!")


async def test_transitions_are_kept_as_job_events(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    d = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1, gpu_model="a100-80gb", usd_per_gpu_hour=2.5)
    await store.update_job(d, job.version, event_reason="placed on a")
    events = await store.job_events(job.id)
    assert [(e["state"], e["reason"]) for e in events] == [("queued", "submitted"), ("dispatching", "placed on a")]
    # each says what its attempt was placed on, and at what price (GET /v1/jobs/{id}/events)
    assert [(e["gpu_model"], e["usd_per_gpu_hour"]) for e in events] == [(None, None), ("a100-80gb", 2.5)]


async def test_each_transition_of_a_placed_attempt_gives_its_price_after_the_job_was_read_back(store: Store):
    # A leader that takes over (or restarts) reads the job back from the store, whose document has no price: the
    # transitions it writes store none, yet the usage report charges the attempt at the placement's, and so
    # GET /v1/jobs/{id}/events says; a job back in the queue, and an attempt placed where there was no price, have
    # none.
    job = make_job(1)
    await store.insert_job(job)
    d = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1, gpu_model="a100-80gb", usd_per_gpu_hour=2.5)
    await store.update_job(d, job.version)
    back = await store.get_job(job.id)
    assert back is not None
    steps = [(JobState.ADMITTED, {}), (JobState.RUNNING, {}), (JobState.QUEUED, {}),
             (JobState.DISPATCHING, {"site": "b", "attempt": 2, "gpu_model": "h100-80gb"}), (JobState.ADMITTED, {})]
    for state, changes in steps:
        new = back.transition(state, T0, **changes)
        await store.update_job(new, back.version)
        back = new
    events = await store.job_events(job.id)
    assert [(e["state"], e["attempt"], e["usd_per_gpu_hour"]) for e in events] == [
        ("queued", 0, None), ("dispatching", 1, 2.5), ("admitted", 1, 2.5), ("running", 1, 2.5), ("queued", 1, None),
        ("dispatching", 2, None), ("admitted", 2, None)]


async def test_a_reason_holding_a_nul_from_a_site_is_stored_on_every_backend(store: Store):
    """A site's text (a failed attempt's message, a refusal) may hold a NUL. PostgreSQL's text refuses it where
    SQLite takes it: the site's event was retried for ever, the job stuck running and every later event of
    that site held up behind it."""
    job = make_job(1)
    await store.insert_job(job)
    r = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1).transition(JobState.ADMITTED, T0)
    r = r.transition(JobState.RUNNING, T0)
    await store.update_job(r, job.version)
    failed = r.transition(JobState.FAILED, T0, reason="attempt 1 on a failed (exit\x00code 1)")
    await store.update_job(failed, r.version)
    stored = await store.get_job(job.id)
    assert stored.state == JobState.FAILED and stored.reason == "attempt 1 on a failed (exit?code 1)"
    assert (await store.job_events(job.id))[-1]["reason"] == stored.reason


async def test_a_lookup_by_a_name_holding_a_nul_finds_nothing_on_every_backend(store: Store):
    """``GET /v1/jobs/%00`` or ``?tenant=%00``: SQLite finds no such job (a 404, an empty page); PostgreSQL's
    text refused the parameter, and the API answered 503, the store's failure, for a client's typo."""
    job = make_job(1)
    await store.insert_job(job, "key")
    assert await store.get_job("job\x0000001") is None
    assert await store.job_events("job\x0000001") == [] and await store.get_decision("job\x0000001") is None
    assert await store.find_idempotent("t1", "k\x00") is None
    for flt in (JobFilter(tenant="t1\x00"), JobFilter(site="a\x00"), JobFilter(tenants=("t\x00",)),
                JobFilter(sites=("a\x00",)), JobFilter(state=JobState.QUEUED, tenant="\x00")):
        page = await store.list_jobs(flt, 10)
        assert page.items == [] and page.next is None
    assert [j.id for j in (await store.list_jobs(JobFilter(tenants=("t1", "t\x00")), 10)).items] == [job.id]


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


async def test_jobs_that_ended_before_the_cutoff_go_with_their_transitions_and_decision_first_ended_first(
        store: Store):
    # six jobs: four end at T0+10 min .. T0+40 min (succeeded, failed, cancelled, succeeded), one runs, one waits
    jobs = [make_job(i) for i in range(6)]
    for job in jobs:
        await store.insert_job(job, idempotency_key=f"key-{job.id}")
    ends = {0: (JobState.SUCCEEDED, 40), 1: (JobState.FAILED, 10), 2: (JobState.CANCELLED, 20),
            3: (JobState.SUCCEEDED, 30)}
    for i, (state, minutes) in ends.items():
        at = T0 + timedelta(minutes=minutes)
        running = jobs[i].transition(JobState.DISPATCHING, T0, site="a", attempt=1)
        await store.update_job(running, jobs[i].version, decision={"outcome": "placed", "site": "a"})
        if state == JobState.CANCELLED:
            await store.update_job(running.transition(state, at), running.version)
            continue
        admitted = running.transition(JobState.ADMITTED, T0)
        await store.update_job(admitted, running.version)
        on = admitted.transition(JobState.RUNNING, T0)
        await store.update_job(on, admitted.version)
        await store.update_job(on.transition(state, at), on.version)
    running = jobs[4].transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(running, jobs[4].version)

    # ended before T0+35 min: jobs 1, 2, 3, first ended first; at most 2 a call
    cutoff = T0 + timedelta(minutes=35)
    assert await store.prune_ended(cutoff, 2) == ["job00001", "job00002"]
    assert await store.prune_ended(cutoff, 2) == ["job00003"]
    assert await store.prune_ended(cutoff, 2) == []
    for gone in ("job00001", "job00002", "job00003"):
        assert await store.get_job(gone) is None
        assert await store.job_events(gone) == [] and await store.get_decision(gone) is None
        assert await store.find_idempotent("t1", f"key-{gone}") is None
    # what ended later, what runs and what waits are all there, listed as before
    assert await store.get_job("job00000") is not None and await store.get_decision("job00000") is not None
    assert [j.id for j in (await store.list_jobs(JobFilter(), 10)).items] == ["job00005", "job00004", "job00000"]
    assert [j.id for j in await store.active_jobs()] == ["job00004", "job00005"]
    # a key of a deleted job can be used again
    await store.insert_job(make_job(7), idempotency_key="key-job00001")
    assert await store.prune_ended(T0 + timedelta(days=1), 10) == ["job00000"]


async def test_a_job_is_dated_by_when_the_broker_stored_its_end_not_by_its_sites_clock(store: Store):
    """A job's ``finished_at`` is the time its site reported (``JobEvent.at``, by the site's clock); a site whose
    clock is 40 days behind must not have the job it just ended deleted at the next round of a 30-day retention."""
    job = make_job(1)
    await store.insert_job(job)
    running = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(running, job.version)
    now = T0 + timedelta(days=40)
    ended = running.transition(JobState.CANCELLED, now, finished_at=T0)  # (as the site's clock said)
    await store.update_job(ended, running.version)
    assert await store.prune_ended(now - timedelta(days=30), 10) == []
    assert await store.get_job(job.id) is not None
    assert await store.prune_ended(now + timedelta(seconds=1), 10) == [job.id]


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


async def test_postgres_lists_sites_in_the_byte_order_sqlite_does_whatever_the_databases_collation(
        postgres_server: PostgresServer, sqlite_store: SQLiteStore):
    """A database made with a collation that ignores punctuation (as glibc's en_US does; ICU here, so that the
    test needs no system locale) sorted "ab" before "a-c": the same sites listed in another order than on
    SQLite, and `heliotrope sites list` changing with the database."""
    conn = await asyncpg.connect(postgres_server.dsn(), timeout=30)
    name = f"icu{os.getpid()}"
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
                           "ICU_LOCALE 'en-u-ka-shifted' LOCALE 'C'")
    finally:
        await conn.close()
    store = PostgresStore(postgres_server.dsn(name))
    await store.open()
    try:
        for each in (store, sqlite_store):
            for n in ("ab", "a-c", "a-b"):
                await each.put_site(site(n))
        assert [s.name for s in await sqlite_store.list_sites()] == ["a-b", "a-c", "ab"]
        assert [s.name for s in await store.list_sites()] == ["a-b", "a-c", "ab"]
    finally:
        await store.close()
        # not dropped (as postgres_dsn's databases): DROP DATABASE forces a checkpoint, which late in a full run
        # writes out every database the session made (30 s); the whole server goes at the session's end


async def test_a_replica_seeding_a_site_from_its_config_leaves_one_already_stored_as_it_is(store: Store):
    # The leader cordoned zeta after this replica read the site list, and before it seeded it from its config.
    await store.put_site(site("zeta", cordoned=True, cordon_reason="driver upgrade"))
    await store.seed_site(site("zeta"))
    await store.seed_site(site("alpha"))
    assert [(s.name, s.cordoned) for s in await store.list_sites()] == [("alpha", False), ("zeta", True)]


async def test_learned_state_is_kept_by_name_and_replaced(store: Store):
    assert await store.get_state("latency-demand") is None
    await store.put_state("latency-demand", '{"hour": 1}')
    await store.put_state("other", "{}")
    await store.put_state("latency-demand", '{"hour": 2}')
    assert await store.get_state("latency-demand") == '{"hour": 2}' and await store.get_state("other") == "{}"


@pytest.mark.parametrize("backend", ["sqlite", "memory", "postgres"])
async def test_a_store_that_is_not_open_refuses_reads_and_writes(backend: str, tmp_path: Path):
    s: Store = {"sqlite": lambda: SQLiteStore(tmp_path / "h.db"), "memory": MemoryStore,
                "postgres": lambda: PostgresStore("postgresql://heliotrope@127.0.0.1:1/nowhere")}[backend]()
    with pytest.raises(StoreError, match="not open"):
        await s.insert_job(make_job(1))
    with pytest.raises(StoreError, match="not open"):
        await s.get_job("job00001")
    with pytest.raises(StoreError, match="not open"):
        await s.acquire_leadership("a", 1)


def test_open_store_picks_postgresql_for_a_url_and_sqlite_otherwise(tmp_path: Path):
    assert isinstance(open_store("postgresql://u@db.example:5433/h"), PostgresStore)
    assert isinstance(open_store("postgres://u@db.example/h"), PostgresStore)
    assert isinstance(open_store(str(tmp_path / "h.db")), SQLiteStore)
    assert isinstance(open_store(":memory:"), SQLiteStore)


# --- leadership and fencing, on every backend ---


async def test_the_first_holder_gets_epoch_1_and_a_new_one_each_time_it_acquires_again(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    assert await store.acquire_leadership("a", 30) == 1
    assert await store.renew_leadership("a", 1, 30) is True
    store.fence(1)
    # A replica that stepped down (it could not renew in time) and takes the lease again starts a new term:
    # the writes it queued in the last one carry the old epoch and are refused, not applied after it reloads.
    assert await store.acquire_leadership("a", 30) == 2
    assert await store.renew_leadership("a", 1, 30) is False
    with pytest.raises(Fenced, match=r"epoch 1; the store is at 2"):
        await store.update_job(job.transition(JobState.DISPATCHING, T0, site="a", attempt=1), job.version)
    assert await store.acquire_leadership("b", 30) is None
    assert await store.renew_leadership("a", 2, 30) is True


async def test_another_holder_gets_the_next_epoch_only_once_the_lease_expired(store: Store):
    assert await store.acquire_leadership("a", 0.3) == 1
    assert await store.acquire_leadership("b", 0.3) is None
    await asyncio.sleep(0.4)
    assert await store.renew_leadership("a", 1, 30) is False, "an expired lease was renewed"
    assert await store.acquire_leadership("b", 30) == 2
    assert await store.renew_leadership("a", 1, 30) is False, "a deposed holder renewed"
    assert await store.renew_leadership("b", 1, 30) is False, "a renewal with a stale epoch passed"
    assert await store.renew_leadership("b", 2, 30) is True
    assert await store.acquire_leadership("a", 30) is None


async def test_of_holders_racing_for_a_free_lease_exactly_one_wins(store: Store):
    epochs = await asyncio.gather(*(store.acquire_leadership(f"r{i}", 30) for i in range(8)))
    assert [e for e in epochs if e is not None] == [1], epochs


async def test_release_lets_another_holder_in_at_once(store: Store):
    assert await store.acquire_leadership("a", 30) == 1
    await store.release_leadership("a", 2)  # not its epoch: nothing happens
    await store.release_leadership("b", 1)  # not its lease: nothing happens
    assert await store.acquire_leadership("b", 30) is None
    await store.release_leadership("a", 1)
    assert await store.acquire_leadership("b", 30) == 2
    assert await store.renew_leadership("a", 1, 30) is False


async def test_a_fenced_store_whose_epoch_was_superseded_writes_nothing_but_still_takes_submissions(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    # A lease long enough for two writes on a loaded CI machine (0.3 s was not, once, with PostgreSQL).
    assert await store.acquire_leadership("a", 2.0) == 1
    store.fence(1)
    placed = job.transition(JobState.DISPATCHING, T0, site="a", attempt=1)
    await store.update_job(placed, job.version, decision={"outcome": "placed", "site": "a"})  # still the leader
    await store.put_site(site("alpha"))
    await asyncio.sleep(2.1)
    assert await store.acquire_leadership("b", 30) == 2  # another replica took over
    running = placed.transition(JobState.ADMITTED, T0)
    with pytest.raises(Fenced, match=r"no longer the leader \(epoch 1; the store is at 2\)"):
        await store.update_job(running, placed.version)
    with pytest.raises(Fenced):
        await store.save_decision(job.id, 2, {"outcome": "deferred"})
    with pytest.raises(Fenced):
        await store.put_site(site("beta"))
    with pytest.raises(Fenced):
        await store.delete_site("alpha")
    with pytest.raises(Fenced):  # what the cycle learned is the leader's to keep
        await store.put_state("latency-demand", "{}")
    assert await store.get_state("latency-demand") is None
    with pytest.raises(Fenced):  # and so are the tenant limits set through the API
        await store.put_tenant_limit(LimitOverride("t1", 4.0, T0))
    with pytest.raises(Fenced):
        await store.delete_tenant_limit("t1")
    assert await store.list_tenant_limits() == []
    assert await store.get_job(job.id) == placed, "a fenced update was applied"
    assert [e["state"] for e in await store.job_events(job.id)] == ["queued", "dispatching"]
    stored = await store.get_decision(job.id)
    assert stored is not None and stored.record == {"outcome": "placed", "site": "a"}
    assert [s.name for s in await store.list_sites()] == ["alpha"]
    await store.insert_job(make_job(2))  # submissions are any replica's: never fenced
    assert await store.get_job("job00002") is not None
    store.fence(2)
    await store.update_job(running, placed.version)
    store.fence(None)
    await store.save_decision(job.id, 2, {"outcome": "deferred"})
    assert (await store.get_decision(job.id)).record == {"outcome": "deferred"}


async def test_tenant_limits_set_live_are_stored_replaced_and_deleted(store: Store):
    """``PUT /v1/tenants/{tenant}/limit`` keeps an override per tenant (gpus null: unlimited); a second replaces the
    first, and a deletion of a tenant without one changes nothing."""
    await store.put_tenant_limit(LimitOverride("t2", None, T0))
    await store.put_tenant_limit(LimitOverride("t1", 4.0, T0))
    later = T0 + timedelta(minutes=5)
    await store.put_tenant_limit(LimitOverride("t1", 6.5, later))
    assert await store.list_tenant_limits() == [LimitOverride("t1", 6.5, later), LimitOverride("t2", None, T0)]
    await store.delete_tenant_limit("t2")
    await store.delete_tenant_limit("nobody")
    assert await store.list_tenant_limits() == [LimitOverride("t1", 6.5, later)]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_database_of_the_release_before_tenant_limits_takes_them_and_keeps_them_across_reopening(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Migration 9 adds the table to a database at migration 8; an override stored then is there after reopening (a
    broker's restart)."""
    module, _, opener = await sql_database(backend, request, tmp_path)
    await made_at_migration(module, opener, 8, monkeypatch)
    s = opener()
    await s.open()
    await s.put_tenant_limit(LimitOverride("vision", 12.5, T0))
    await s.close()
    s = opener()
    await s.open()
    try:
        assert await s.list_tenant_limits() == [LimitOverride("vision", 12.5, T0)]
    finally:
        await s.close()


async def test_a_fenced_store_whose_lease_expired_unclaimed_is_fenced_too(store: Store):
    job = make_job(1)
    await store.insert_job(job)
    store.fence(1)
    with pytest.raises(Fenced, match="the store has no leader"):
        await store.save_decision(job.id, 0, {"outcome": "deferred"})
    assert await store.acquire_leadership("a", 0.3) == 1
    await store.save_decision(job.id, 0, {"outcome": "deferred"})
    await asyncio.sleep(0.4)
    with pytest.raises(Fenced, match="lease expired"):
        await store.update_job(job.transition(JobState.CANCELLED, T0), job.version)
    assert (await store.get_job(job.id)).state == JobState.QUEUED


async def test_in_a_batch_every_fenced_write_fails_and_the_submissions_land(store: Store):
    jobs = [make_job(i) for i in range(20)]
    for job in jobs:
        await store.insert_job(job)
    assert await store.acquire_leadership("a", 0.3) == 1
    store.fence(1)
    await asyncio.sleep(0.4)
    assert await store.acquire_leadership("b", 30) == 2
    updates = [store.enqueue_update(j.transition(JobState.CANCELLED, T0), j.version) for j in jobs]
    inserts = [store.insert_job(make_job(i)) for i in range(100, 110)]
    results = await asyncio.gather(*updates, *inserts, return_exceptions=True)
    assert all(isinstance(r, Fenced) for r in results[:20]), results[:20]
    assert all(r is None for r in results[20:]), results[20:]
    assert [j.state for j in await store.active_jobs()].count(JobState.QUEUED) == 30


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
        assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(sq.MIGRATIONS)


async def test_jobs_that_ended_before_the_end_date_was_kept_are_dated_from_their_documents_and_pruned(
        tmp_path: Path):
    """Rows of jobs that ended before the release that keeps ``ended_at`` (or that a replica of an earlier release
    ended, which does not write it) have none: they are dated from their documents and pruned in their turn."""
    s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    old, recent = make_job(1), make_job(2)
    for job in (old, recent):
        await s.insert_job(job)
        await s.update_job(job.transition(JobState.CANCELLED, T0 + timedelta(hours=job is recent and 48 or 1)),
                           job.version)
    await s.close()
    with sqlite3.connect(tmp_path / "h.db") as db:  # as an earlier release left them
        db.execute("UPDATE jobs SET ended_at = NULL")
    s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    try:
        assert await s.prune_ended(T0 + timedelta(hours=24), 10) == []  # not dated yet: not found
        assert await s.date_ended(1) == 1 and await s.date_ended(10) == 1 and await s.date_ended(10) == 0
        assert await s.prune_ended(T0 + timedelta(hours=24), 10) == ["job00001"]
        assert await s.get_job("job00002") is not None
    finally:
        await s.close()


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


# --- PostgreSQL only: the server, its schema, its durability ---


async def test_postgres_stores_docs_as_the_same_text_as_sqlite(postgres_dsn: str):
    s = PostgresStore(postgres_dsn)
    await s.open()
    try:
        job = make_job(1).model_copy(update={"version": 2**62})
        await s.insert_job(job, idempotency_key="k", digest="d")
        conn = await asyncpg.connect(postgres_dsn)
        try:
            doc, version = await conn.fetchrow("SELECT doc, version FROM jobs WHERE id = $1", job.id)
        finally:
            await conn.close()
        assert (doc, version) == (job.model_dump_json(), 2**62)
        assert await s.get_job(job.id) == job
    finally:
        await s.close()


async def test_postgres_a_round_of_pruning_holds_up_a_submission_a_few_round_trips_not_thousands(
        postgres_dsn: str, monkeypatch: pytest.MonkeyPatch):
    """The store has one writer, and a submission is answered once its write commits. A round of pruning deletes
    1,000 jobs, their transitions and decisions, after dating those a replica of an earlier release ended: with a
    statement per job and table, that is 3,000 and more round trips, 6 s and more of a database 2 ms away, which
    every submission queued behind it waited out."""
    s = PostgresStore(postgres_dsn)
    await s.open()
    try:
        jobs = [make_job(i, state=JobState.CANCELLED) for i in range(1000)]
        await asyncio.gather(*(s.insert_job(j) for j in jobs))
        conn = await asyncpg.connect(postgres_dsn)
        try:  # half of them as an earlier release left them: no ended_at
            await conn.execute("UPDATE jobs SET ended_at = NULL WHERE id < 'job00500'")
        finally:
            await conn.close()
        execute = asyncpg.connection.Connection.execute
        under_way: dict[str, asyncio.Event] = {"UPDATE": asyncio.Event(), "DELETE": asyncio.Event()}

        async def far(self, sql, *args, **kwargs):  # a database 2 ms away
            for verb, seen in under_way.items():
                if sql.lstrip().startswith(verb):
                    seen.set()
            await asyncio.sleep(0.002)
            return await execute(self, sql, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "execute", far)
        async def round_() -> list[str]:  # as the broker's housekeeping runs one
            await s.date_ended(1000)
            return await s.prune_ended(T0 + timedelta(days=1), 1000)

        pruning = asyncio.create_task(round_())
        for i, verb in enumerate(under_way):  # a submission while the dates are written, one while the jobs go
            await asyncio.wait_for(under_way[verb].wait(), 30)
            started = asyncio.get_running_loop().time()
            await s.insert_job(make_job(5000 + i))
            assert asyncio.get_running_loop().time() - started < 1.0, verb
        assert sorted(await pruning) == sorted(j.id for j in jobs)
        assert await s.get_job("job00000") is None and await s.get_job("job00999") is None
        assert await s.job_events("job00000") == []
        assert await s.get_job("job05000") is not None and await s.get_job("job05001") is not None
    finally:
        await s.close()


async def test_postgres_reopening_applies_no_migration_twice_even_when_replicas_open_together(postgres_dsn: str):
    stores = [PostgresStore(postgres_dsn) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    await asyncio.gather(*(s.close() for s in stores))
    again = PostgresStore(postgres_dsn)
    await again.open()
    await again.close()
    conn = await asyncpg.connect(postgres_dsn)
    try:
        versions = [r[0] for r in await conn.fetch("SELECT version FROM schema_version ORDER BY version")]
    finally:
        await conn.close()
    assert versions == list(range(1, len(pg.MIGRATIONS) + 1))


async def test_postgres_a_database_from_a_newer_release_is_refused_with_a_clear_message(postgres_dsn: str):
    s = PostgresStore(postgres_dsn)
    await s.open()
    await s.close()
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("INSERT INTO schema_version VALUES (99)")
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="schema version 99, newer than this heliotrope"):
        await PostgresStore(postgres_dsn).open()


async def test_postgres_a_server_that_cannot_be_reached_is_named_in_the_error():
    port = free_port()
    s = PostgresStore(f"postgresql://heliotrope:secret@127.0.0.1:{port}/h", timeout_s=5)
    with pytest.raises(StoreError, match=f"cannot connect to PostgreSQL at postgresql://heliotrope@127.0.0.1:{port}/h"
                       ) as raised:
        await s.open()
    assert "secret" not in str(raised.value)


async def test_postgres_concurrent_writes_share_commits(postgres_dsn: str):
    s = PostgresStore(postgres_dsn)
    await s.open()
    try:
        await asyncio.gather(*(s.insert_job(make_job(i)) for i in range(600)))
        assert s.commits < 100, f"600 concurrent inserts took {s.commits} commits; group commit is not batching"
    finally:
        await s.close()


async def test_postgres_replicas_on_one_database_fence_each_other(postgres_dsn: str):
    """Two store objects (two replicas): the deposed one's scheduling writes fail, the new leader's land."""
    a, b = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn)
    await a.open()
    await b.open()
    try:
        job = make_job(1)
        await a.insert_job(job)
        assert await a.acquire_leadership("replica-a", 0.3) == 1
        a.fence(1)
        assert await b.acquire_leadership("replica-b", 30) is None
        await asyncio.sleep(0.4)
        epoch = await b.acquire_leadership("replica-b", 30)
        assert epoch == 2
        b.fence(epoch)
        with pytest.raises(Fenced):
            await a.update_job(job.transition(JobState.CANCELLED, T0), job.version)
        moved = job.transition(JobState.DISPATCHING, T0, site="x", attempt=1)
        await b.update_job(moved, job.version)
        assert await a.get_job(job.id) == moved
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_write_that_breaks_the_writer_fails_alone_on_every_durable_backend(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path,
):
    if backend == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        s: Store = PostgresStore(await server.create_database())
    else:
        s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    try:
        bad = make_job(1).model_copy(update={"version": 2**63})  # too large for a 64-bit integer
        results = await asyncio.gather(s.insert_job(bad), *(s.insert_job(make_job(i)) for i in range(2, 30)),
                                       return_exceptions=True)
        assert isinstance(results[0], StoreError) and all(r is None for r in results[1:]), results
        good = make_job(40)
        await asyncio.wait_for(s.insert_job(good), 5)
        assert await s.get_job(good.id) == good and await s.get_job(bad.id) is None
    finally:
        await s.close()


@pytest.mark.slow  # a server of its own, crashed and restarted: about 5 s
def test_postgres_a_write_that_returned_survives_a_crash_of_the_server():
    """A child process inserts jobs and prints each id once its write returned; we crash the server mid-stream
    (``pg_ctl stop -m immediate``: no flush, no checkpoint), start it again, and find every acknowledged job."""
    try:
        server = PostgresServer()
    except Exception as e:  # no binaries: as the fixture does
        from tests.services import missing

        missing("PostgreSQL", str(e))
        raise
    try:
        server.start()
        dsn = asyncio.run(server.create_database())
        child = textwrap.dedent(f"""
            import asyncio, sys
            sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
            from tests.test_store import make_job
            from broker.store.postgres import PostgresStore
            async def main():
                s = PostgresStore({dsn!r}, max_batch=256)
                await s.open()
                async def one(i):
                    await s.insert_job(make_job(i))
                    print(make_job(i).id, flush=True)
                await asyncio.gather(*(one(i) for i in range(20000)), return_exceptions=True)
            asyncio.run(main())
        """)
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        acked = []
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.append(line.strip())
            if len(acked) >= 2000:
                server.crash()
                break
        proc.kill()  # what it printed before it was killed still counts
        acked += [line.strip() for line in proc.stdout.read().splitlines() if line.strip()]
        proc.wait(30)
        server.start()

        async def ids() -> set[str]:
            conn = await asyncpg.connect(dsn)
            try:
                return {r[0] for r in await conn.fetch("SELECT id FROM jobs")}
            finally:
                await conn.close()

        on_disk = asyncio.run(ids())
        assert len(acked) >= 2000
        assert set(acked) <= on_disk, f"{len(set(acked) - on_disk)} acknowledged jobs were lost"
    finally:
        server.cleanup()


def test_without_the_postgresql_binaries_the_fixture_skips_but_fails_in_ci(monkeypatch: pytest.MonkeyPatch):
    import tests.postgres as fixture

    monkeypatch.setattr(fixture.shutil, "which", lambda name: None)
    monkeypatch.setattr(fixture.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(fixture.os, "access", lambda path, mode: False)
    with pytest.raises(fixture.PostgresMissing, match="apt-get install postgresql") as raised:
        fixture.find_bindir()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="must not be skipped in CI"):
        fixture.missing("PostgreSQL", str(raised.value))
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        fixture.missing("PostgreSQL", str(raised.value))


async def test_the_leader_is_named_while_its_lease_runs_and_nobody_after(store: Store):
    assert await store.leader() is None
    await store.acquire_leadership("http://replica-a:8080", 0.3)
    assert await store.leader() == "http://replica-a:8080"
    await asyncio.sleep(0.4)
    assert await store.leader() is None


async def test_active_jobs_after_a_row_come_oldest_first_without_the_finished(store: Store):
    jobs = [make_job(i) for i in range(5)]
    for j in jobs:
        await store.insert_job(j)
    done = jobs[1].model_copy(update={"state": JobState.CANCELLED, "version": jobs[1].version + 1})
    await store.update_job(done, jobs[1].version)
    everything = await store.active_after(0, 100)
    assert [j.id for _, j in everything] == [jobs[i].id for i in (0, 2, 3, 4)]
    seqs = [seq for seq, _ in everything]
    assert seqs == sorted(seqs)
    after = await store.active_after(seqs[1], 100)
    assert [j.id for _, j in after] == [jobs[3].id, jobs[4].id]
    assert [j.id for _, j in await store.active_after(0, 2)] == [jobs[0].id, jobs[2].id]


async def test_a_stored_site_an_earlier_release_wrote_with_a_null_number_stops_the_start_by_name(tmp_path: Path):
    """Releases before 2026-11-29 took NaN and Infinity in a site spec and stored them as null, which no spec
    reads: the broker then says which site and field, and exits rather than hang on its open store."""
    import threading

    from broker.config import BrokerSettings
    from broker.server import run
    from broker.store import UnreadableSite

    db = tmp_path / "h.db"
    s = SQLiteStore(db)
    await s.open()
    spec = site("paris", rtt_ms={"gcp:europe-west9": 4.0})
    await s.put_site(spec)
    await s.close()
    with sqlite3.connect(db) as conn:
        doc = spec.model_dump_json().replace('"gcp:europe-west9":4.0', '"gcp:europe-west9":null')
        assert doc != spec.model_dump_json()
        conn.execute("UPDATE sites SET doc = ? WHERE name = 'paris'", (doc,))
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(UnreadableSite, match=r"site 'paris' cannot be read \(rtt_ms\.gcp:europe-west9: Input should "
                                             r"be a valid number\); fix or delete its row of table sites"):
        await asyncio.wait_for(run(BrokerSettings(db=str(db), port=0), []), 60)
    await asyncio.sleep(0.1)
    left = [t for t in threading.enumerate()  # (the loop's own executor, asyncio_N, closes with the loop)
            if t.ident not in before and not t.daemon and not t.name.startswith("asyncio_")]
    assert left == [], "a thread the failed start opened would keep the process alive"


async def test_a_deposed_leaders_placement_that_matches_the_new_leaders_is_still_refused(tmp_path: Path):
    # Both place the job as attempt 1 at the same version; the new leader on site-b, the deposed one, which
    # woke after the takeover, on site-a. The store refuses the second (Fenced): it must not be taken for
    # written because the stored job looks like it by version, state and attempt.
    from broker.clock import SystemClock
    from broker.jobs import JobBook

    db = tmp_path / "h.db"
    a, b = SQLiteStore(db), SQLiteStore(db)
    await a.open()
    await b.open()
    try:
        job = make_job(1)
        await a.insert_job(job)
        assert await a.acquire_leadership("A", 0.2) == 1
        a.fence(1)
        book = JobBook(a, SystemClock())
        await book.load()
        await asyncio.sleep(0.3)  # A's lease lapses while it is paused
        assert await b.acquire_leadership("B", 30) == 2
        b.fence(2)
        await b.update_job(job.transition(JobState.DISPATCHING, T0, site="site-b", attempt=1), job.version)
        new, version = book.apply(job.id, JobState.DISPATCHING, site="site-a", attempt=1)
        with pytest.raises(Fenced):
            await book.write_soon(job, new, version)
        assert (await a.get_job(job.id)).site == "site-b"
    finally:
        await a.close()
        await b.close()
