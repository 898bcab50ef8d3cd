"""GPU usage for chargeback (``GET /v1/usage``, ``heliotrope usage``, :mod:`broker.usage`): what each attempt held,
cut at the window's hours, kept across the deletion of finished jobs, on every store."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings, strategies as st

from broker import usage
from broker.api import create_app
from broker.config import BrokerSettings
from broker.models import Job, JobSpec, JobState
from broker.service import Broker
from broker.store import Store
from broker.store.memory import MemoryStore
from broker.store.postgres import PostgresStore
from broker.store.sqlite import SQLiteStore
from tests import postgres as postgres_fixtures
from tests.test_store import sql_database
from tests.test_api import MINIMAL, client, register, site_body, wait_for  # noqa: F401 (client: a fixture)

postgres_server = postgres_fixtures.postgres_server

T0 = datetime(2022, 3, 1, 12, 30, tzinfo=UTC)  # half past an hour: attempts straddle hours
A100 = "a100-80gb"
H100 = "h100-80gb"
EVERYTHING = ("tenant", "site", "gpu_model")


def near(x: float, abs: float = 2e-6) -> Any:
    """``x`` as a report gives it (rounded to 6 decimals)."""
    return pytest.approx(x, abs=abs)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


async def run_job(store: Store, job_id: str, tenant: str, gpus: dict[str, Any],
                  steps: list[tuple[float, JobState, dict[str, Any]]], t0: datetime = T0) -> Job:
    """Store a job submitted at ``t0`` and its transitions at the minutes after it given (the broker's records)."""
    job = Job(id=job_id, spec=JobSpec(tenant=tenant, name=job_id, gpus=gpus, duration_s=3600),
              created_at=t0, updated_at=t0)
    await store.insert_job(job)
    for minute, state, changes in steps:
        new = job.transition(state, t0 + timedelta(minutes=minute), **changes)
        await store.update_job(new, job.version)
        job = new
    return job


def dispatch(site: str, attempt: int, model: str, usd: float | None = None) -> dict[str, Any]:
    """A placement's changes, as the cycle makes them: the price routing saw there (``usd``; by default the one
    PRICES gives, which the reports charge the rest at; None where it gives none)."""
    return {"site": site, "attempt": attempt, "gpu_model": model,
            "usd_per_gpu_hour": usd if usd is not None else PRICES.get(site, {}).get(model)}


def ev(job_id: str, minute: float, state: str, site: str | None, attempt: int, model: str | None,
       usd: float | None = None) -> usage.Event:
    """A transition as a store gives it (:data:`broker.usage.Event`), at ``minute`` after T0."""
    return (job_id, at(minute).isoformat(), state, site, attempt, model, usd)


async def history(store: Store) -> None:
    """Three tenants' jobs: one preempted at s1 and finished at s2 on another model; a MIG job; a job still running
    (at 'now', T0 + 5 h); one refused at dispatch (never held GPUs); one cancelled while admitted."""
    D, A, R, P, Q = JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.QUEUED
    await run_job(store, "moved", "vision", {"count": 4}, [
        (1, D, dispatch("s1", 1, A100)), (2, A, {}), (3, R, {}), (93, P, {}), (94, Q, {}),
        (100, D, dispatch("s2", 2, H100)), (101, A, {}), (102, R, {}), (162, JobState.SUCCEEDED, {})])
    await run_job(store, "mig", "nlp", {"count": 2, "mig_profile": "3g.40gb"}, [
        (0, D, dispatch("s1", 1, A100)), (1, A, {}), (2, R, {}), (242, JobState.FAILED, {})])
    await run_job(store, "running", "nlp", {"count": 1}, [(200, D, dispatch("s2", 1, H100)), (201, A, {}),
                                                          (210, R, {})])
    await run_job(store, "refused", "audio", {"count": 8}, [(5, D, dispatch("s1", 1, A100)), (6, Q, {})])
    await run_job(store, "cancelled", "audio", {"count": 1, "milli": 250}, [
        (10, D, dispatch("s2", 1, H100)), (20, A, {}), (50, JobState.CANCELLED, {})])


NOW = at(300)
PRICES = {"s1": {A100: 2.0}, "s2": {H100: 4.0}}


async def report(store: Store, start: datetime, end: datetime, by: tuple[str, ...] = EVERYTHING,
                 **kw: Any) -> dict[str, Any]:
    records = await store.usage_records(start.timestamp(), end.timestamp())
    return usage.report(records, start, end, NOW, by, PRICES, **kw)


def rows(body: dict[str, Any]) -> dict[tuple[str, ...], tuple[float, int]]:
    return {tuple(i[k] for k in body["by"]): (i["gpu_hours"], i["attempts"]) for i in body["items"]}


@pytest.fixture(params=["sqlite", "memory", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):
    s: Store
    if request.param == "postgres":
        s = PostgresStore(await request.getfixturevalue("postgres_server").create_database())
    else:
        s = SQLiteStore(tmp_path / "h.db") if request.param == "sqlite" else MemoryStore()
    await s.open()
    yield s
    await s.close()


async def test_each_attempt_is_charged_from_its_admission_to_its_end_at_its_own_site_and_model(store: Store):
    await history(store)
    day = await report(store, datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))
    assert rows(day) == {
        # 4 GPUs for 91 min at s1 (admitted at 2, preempted at 93), then 61 min at s2 on the other model
        ("vision", "s1", A100): (near(4 * 91 / 60), 1),
        ("vision", "s2", H100): (near(4 * 61 / 60), 1),
        # two 3g slices: 6/7 of a GPU for 241 minutes
        ("nlp", "s1", A100): (near(6 / 7 * 241 / 60), 1),
        # admitted at 201, running at 'now' (300)
        ("nlp", "s2", H100): (near(99 / 60), 1),
        # a quarter of a GPU from its admission (20) to its cancel (50); the refused dispatch held nothing
        ("audio", "s2", H100): (near(0.25 * 30 / 60), 1),
    }
    assert day["total"]["attempts"] == 5
    assert day["total"]["gpu_hours"] == near(sum(h for h, _ in rows(day).values()))
    by_tenant = rows(await report(store, datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC),
                                  by=("tenant",)))
    assert by_tenant[("vision",)] == (near(4 * 152 / 60), 2)
    first = day["items"][0]  # largest first: vision at s1, 6.07 GPU-hours of A100 at 2 USD, 0.4 kW each
    assert (first["tenant"], first["site"]) == ("vision", "s1")
    assert first["cost_usd"] == near(2.0 * 4 * 91 / 60, abs=0.01)
    assert first["energy_kwh"] == near(0.4 * 4 * 91 / 60)


async def test_a_window_counts_only_its_own_hours_and_the_attempts_begun_in_it(store: Store):
    await history(store)
    # 13:00-14:00 (minutes 30 to 90 after T0): vision at s1 and mig all hour, the cancelled job's last 20 minutes
    # (admitted 12:50, cancelled 13:20); nothing began then
    hour = await report(store, datetime(2022, 3, 1, 13, tzinfo=UTC), datetime(2022, 3, 1, 14, tzinfo=UTC))
    assert rows(hour) == {("vision", "s1", A100): (near(4.0), 0),
                          ("nlp", "s1", A100): (near(6 / 7), 0),
                          ("audio", "s2", H100): (near(0.25 * 20 / 60), 0)}
    # A window given inside hours is widened to them, and says so
    widened = await report(store, *usage.window(datetime(2022, 3, 1, 13, 20, tzinfo=UTC),
                                                datetime(2022, 3, 1, 13, 40, tzinfo=UTC), NOW))
    assert (widened["from"], widened["to"]) == ("2022-03-01T13:00:00+00:00", "2022-03-01T14:00:00+00:00")
    assert rows(widened) == rows(hour)


async def test_jobs_deleted_after_their_retention_are_still_in_every_report(store: Store):
    """The retention deletes finished jobs with their transitions; what they held is added up per hour first, so
    no report over whole hours changes, whatever its window and grouping."""
    await history(store)
    windows = [(datetime(2022, 3, 1, h0, tzinfo=UTC), datetime(2022, 3, 1, h1, tzinfo=UTC))
               for h0, h1 in ((0, 23), (12, 13), (13, 14), (14, 16), (15, 18))]
    groupings = [EVERYTHING, ("tenant",), ("site",), ("gpu_model", "tenant")]
    before = [await report(store, *w, by=g) for w in windows for g in groupings]
    deleted = await store.prune_ended(at(290), 100)
    assert sorted(deleted) == ["cancelled", "mig", "moved"]  # the running job and the requeued one are kept
    after = [await report(store, *w, by=g) for w in windows for g in groupings]
    for b, a in zip(before, after):
        assert rows(a) == {k: (near(h), n) for k, (h, n) in rows(b).items()}
        assert a["total"]["cost_usd"] == near(b["total"]["cost_usd"], abs=0.011)
    # ... and a second deletion round adds nothing twice
    assert await store.prune_ended(at(290), 100) == []
    assert rows(await report(store, *windows[0])) == rows(after[0])


async def test_a_report_narrowed_to_tenants_or_a_site_leaves_the_others_out(store: Store):
    await history(store)
    day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))
    mine = await report(store, *day, by=("tenant", "site"), tenants={"nlp", "audio"})
    assert set(rows(mine)) == {("nlp", "s1"), ("nlp", "s2"), ("audio", "s2")}
    at_s1 = await report(store, *day, by=("tenant",), site="s1")
    assert rows(at_s1) == {("vision",): (near(4 * 91 / 60), 1), ("nlp",): (near(6 / 7 * 241 / 60), 1)}


def test_a_site_without_a_price_for_the_model_gives_no_cost_rather_than_a_wrong_one():
    records = usage.UsageRecords(usage.holds(
        {"j": ("t", '{"count": 1}', A100), "k": ("t", '{"count": 1}', H100)},
        [ev("j", 0, "admitted", "s1", 1, A100), ev("j", 60, "succeeded", "s1", 1, A100),
         ev("k", 0, "admitted", "gone", 1, H100),
         ev("k", 60, "succeeded", "gone", 1, H100)]),
        [])
    body = usage.report(records, *usage.window(at(0), at(120), NOW), NOW, ("site",), PRICES)
    by_site = {i["site"]: i for i in body["items"]}
    assert by_site["s1"]["cost_usd"] == near(2.0) and "cost_usd" not in by_site["gone"]
    assert "cost_usd" not in body["total"]  # (part of it unpriced: no total that looks whole)


def test_a_transition_of_an_earlier_release_without_a_model_is_charged_to_the_jobs_model_or_unknown():
    records = usage.UsageRecords(usage.holds(
        {"j": ("t", '{"count": 2}', H100), "k": ("t", '{"count": 1, "shared": true, "memory_gib": 20}', None)},
        [ev("j", 0, "running", "s2", 1, None), ev("j", 30, "succeeded", "s2", 1, None),
         ev("k", 0, "running", "s1", 1, None), ev("k", 30, "succeeded", "s1", 1, None)]),
        [])
    body = usage.report(records, *usage.window(at(0), at(60), NOW), NOW, ("gpu_model",), PRICES)
    got = {i["gpu_model"]: i["gpu_hours"] for i in body["items"]}
    # a GPU shared by memory is charged its share of the largest GPU's memory where its model is unknown
    largest = max(m.memory_gib for m in usage.ids.GPU_MODELS)
    assert got == {H100: near(1.0), usage.UNKNOWN_MODEL: near(0.5 * math.ceil(1000 * 20 / largest) / 1000)}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.floats(0, 30 * 3600), st.floats(0, 20 * 3600),
                          st.sampled_from([0.25, 1.0, 8.0]), st.sampled_from([None, 1.5, 3.0])),
                min_size=1, max_size=12),
       st.integers(0, 40), st.integers(1, 40))
def test_hours_rolled_up_report_what_the_attempts_themselves_report(attempts, first_hour, hours):
    """For any set of ended attempts (each at the price it was placed at, or none recorded) and any window of
    whole hours, the report from their rolled-up hours equals the report from the attempts, costs and notes too,
    and the attempts read from transitions streamed in two pieces are those read at once."""
    base = 1_646_000_000 // 3600 * 3600
    held = [usage.Held(f"t{t}", f"s{s}", A100, gpus, base + start, base + start + length, usd)
            for t, s, start, length, gpus, usd in attempts]
    jobs, events = {}, []
    for i, h in enumerate(held):
        jobs[f"j{i:02d}"] = (h.tenant, f'{{"count": {int(h.gpus)}}}' if h.gpus >= 1 else '{"count": 1, "milli": 250}',
                             A100)
        events += [(f"j{i:02d}", datetime.fromtimestamp(h.start, UTC).isoformat(), "running", h.site, 1, A100,
                    h.usd_per_gpu_hour),
                   (f"j{i:02d}", datetime.fromtimestamp(h.end, UTC).isoformat(), "succeeded", h.site, 1, A100, None)]
    live = usage.UsageRecords(usage.holds(jobs, events), [])
    for cut in range(len(events) + 1):  # a store streams the transitions in pieces: any cut reads the same
        reader = usage.Holds()
        for job_id, (tenant, gpus, model) in jobs.items():
            reader.job(job_id, tenant, gpus, model)
        reader.feed(events[:cut])
        reader.feed(events[cut:])
        assert reader.done() == live.held
    rolled = usage.UsageRecords([], [(*k, *figures) for k, figures in usage.roll_up(live.held).items()])
    start = datetime.fromtimestamp(base + first_hour * 3600, UTC)
    end = start + timedelta(hours=hours)
    now = datetime.fromtimestamp(base + 100 * 3600, UTC)
    today = {f"s{s}": {A100: 2.0} for s in range(3)}
    for by in (EVERYTHING, ("tenant",), ("site",)):
        a = usage.report(live, start, end, now, by, today)
        b = usage.report(rolled, start, end, now, by, today)
        assert rows(b) == {k: (near(h, abs=1e-5), n) for k, (h, n) in rows(a).items()}
        assert [i["cost_usd"] for i in b["items"]] == [near(i["cost_usd"], abs=0.011) for i in a["items"]]
        assert ("notes" in b) == ("notes" in a)  # (GPU-hours with no price recorded: said the same way)


# --- over HTTP and the CLI ---


async def test_a_tenants_jobs_run_at_sites_show_in_its_usage_with_the_sites_price(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {A100: 8}, usd_per_gpu_hour={A100: 3.0}))
    done = await (await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 2}, "duration_s": 1})).json()
    other = await (await client.post("/v1/jobs", json={**MINIMAL, "tenant": "t2", "duration_s": 600})).json()
    await wait_for(client, done["id"], {"succeeded"})
    await wait_for(client, other["id"], {"running"})
    events = (await (await client.get(f"/v1/jobs/{done['id']}/events")).json())["items"]
    held_s = (datetime.fromisoformat(events[-1]["at"])
              - datetime.fromisoformat(next(e["at"] for e in events if e["state"] == "admitted"))).total_seconds()
    r = await client.get("/v1/usage", params={"by": "tenant,site,gpu_model"})
    assert r.status == 200, await r.text()
    body = await r.json()
    mine = next(i for i in body["items"] if i["tenant"] == "t1")
    assert (mine["site"], mine["gpu_model"], mine["attempts"]) == ("berlin", A100, 1)
    assert mine["gpu_hours"] == near(2 * held_s / 3600, abs=1e-5)
    assert mine["cost_usd"] == near(3.0 * mine["gpu_hours"], abs=0.01)
    running = next(i for i in body["items"] if i["tenant"] == "t2")
    assert running["gpu_hours"] > 0  # still running: counted up to now
    end = datetime.fromisoformat(body["to"])
    assert end - datetime.fromisoformat(body["from"]) == timedelta(days=30) and end.minute == end.second == 0
    only = await (await client.get("/v1/usage", params={"tenant": "t2"})).json()
    assert [i["tenant"] for i in only["items"]] == ["t2"]


@pytest.mark.parametrize("query, field, words", [
    ({"from": "yesterday"}, "from", "is not a time"),
    ({"to": "2026-11-01T00:00:00"}, "to", "no time zone"),
    # an offset's + written as is in the URL, which the query reads as a space
    ({"from": "2026-11-01T00:00:00 01:00"}, "from", "is not a time (ISO 8601, e.g. 2026-11-01 or "
                                                    "2026-11-01T09:00:00Z); a + in a URL's query reads as a space"),
    ({"from": "2026-11-02", "to": "2026-11-01"}, "to", "must end after it starts"),
    ({"from": "2024-01-01", "to": "2026-01-01"}, "to", "at most 400 days"),
    # a from alone: the window ends at the end of the current hour, and from is what is wrong
    ({"from": "9000-01-01"}, "from", "must end after it starts"),
    ({"from": "2001-01-01"}, "from", "at most 400 days"),
    ({"by": "tenant,region"}, "by", "'region' is not one of tenant, site, gpu_model"),
    ({"by": "site,site"}, "by", "names a key twice"),
    ({"tenant": ""}, "tenant", "is empty"),
    ({"month": "11"}, "month", "unknown query parameter"),
])
async def test_a_bad_usage_query_gets_a_400_naming_the_parameter(client: TestClient, query, field, words):
    r = await client.get("/v1/usage", params=query)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["fields"][0]["field"] == field and words in error["message"]


async def test_a_usage_query_repeating_a_parameter_is_refused(client: TestClient):
    r = await client.get("/v1/usage?tenant=a&tenant=b")
    assert r.status == 400 and (await r.json())["error"]["fields"][0]["field"] == "tenant"


async def test_heliotrope_usage_prints_a_row_per_tenant_and_the_total(client: TestClient, capsys):
    from broker import cli
    await register(client, site_body("berlin", "gcp:europe-west3", {A100: 8}, usd_per_gpu_hour={A100: 3.0}))
    job = await (await client.post("/v1/jobs", json={**MINIMAL, "duration_s": 1})).json()
    await wait_for(client, job["id"], {"succeeded"})
    server = str(client.make_url("")).rstrip("/")
    code = await asyncio.to_thread(cli.main, ["usage", "--server", server, "--by", "tenant,site"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].startswith("usage from ") and lines[1].split() == ["TENANT", "SITE", "GPU_HOURS", "ATTEMPTS",
                                                                        "ENERGY_KWH", "COST_USD"]
    assert lines[2].split()[:2] == ["t1", "berlin"] and lines[-1].split()[0] == "total"
    code = await asyncio.to_thread(cli.main, ["usage", "--server", server, "--from", "last week"])
    out = capsys.readouterr()
    assert code == 1 and "from: 'last week' is not a time" in out.err and "Traceback" not in out.err


@pytest.mark.parametrize("query, field", [
    ({"to": "9999-12-31T23:30:00Z"}, "to"),  # its hour ends in year 10000
    ({"to": "0001-01-05"}, "from"),  # 30 days before it is before year 1
    ({"to": "9999-12-31T23:00-10:00"}, "to"),  # in UTC, year 10000
])
async def test_a_window_at_the_ends_of_the_calendar_is_a_400_not_a_server_error(client: TestClient, query, field):
    r = await client.get("/v1/usage", params=query)
    assert r.status == 400
    assert (await r.json())["error"]["fields"][0]["field"] == field


EVENT_COLUMNS = ("job_id", "at", "state", "site", "attempt", "reason", "gpu_model", "usd_per_gpu_hour")


def insert_event(kind: str, columns: tuple[str, ...]) -> str:
    """A store's INSERT_EVENT as an earlier release wrote it, naming ``columns`` alone."""
    marks = ", ".join("?" if kind == "sqlite" else f"${i}" for i in range(1, len(columns) + 1))
    return f"INSERT INTO job_events ({', '.join(columns)}) VALUES ({marks})"


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_transitions_an_earlier_release_stored_are_charged_once_the_store_is_migrated(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A database of the release before usage (migration 6, transitions without a GPU model) opens, and its jobs'
    attempts are charged to each job's model; deleting them rolls them up."""
    from broker.store import sql
    module, _, opener = await sql_database(kind, request, tmp_path)

    old_event = insert_event(kind, EVENT_COLUMNS[:6])
    with monkeypatch.context() as m:
        m.setattr(module, "MIGRATIONS", module.MIGRATIONS[:6])
        m.setattr(type(opener()), "INSERT_EVENT", old_event)
        m.setattr(sql, "event_row", lambda job, reason: (job.id, job.updated_at.isoformat(), job.state.value,
                                                         job.site, job.attempt, reason or job.reason))
        s = opener()
        await s.open()
        await run_job(s, "old", "vision", {"count": 2}, [
            (0, JobState.DISPATCHING, dispatch("s1", 1, A100)), (1, JobState.ADMITTED, {}),
            (31, JobState.SUCCEEDED, {})])
        await s.close()
    s = opener()
    await s.open()
    try:
        day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))
        assert rows(await report(s, *day)) == {("vision", "s1", A100): (near(1.0), 1)}
        assert await s.prune_ended(at(100), 10) == ["old"]
        assert rows(await report(s, *day)) == {("vision", "s1", A100): (near(1.0), 1)}
    finally:
        await s.close()


# The statement with which a leader of the release before migration 8 adds a roll-up: GPU-seconds alone.
ADD_USAGE_7 = {
    "sqlite": "INSERT INTO usage_hours (hour, tenant, site, gpu_model, gpu_seconds, attempts)"
              " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (hour, tenant, site, gpu_model) DO UPDATE SET"
              " gpu_seconds = gpu_seconds + excluded.gpu_seconds, attempts = attempts + excluded.attempts",
    "postgres": "INSERT INTO usage_hours AS u (hour, tenant, site, gpu_model, gpu_seconds, attempts)"
                " SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::double precision[],"
                " $6::bigint[]) ON CONFLICT (hour, tenant, site, gpu_model) DO UPDATE SET"
                " gpu_seconds = u.gpu_seconds + excluded.gpu_seconds, attempts = u.attempts + excluded.attempts"}


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_database_of_migration_7_keeps_its_usage_and_charges_what_had_no_price_at_todays(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A database the release before prices were recorded made (migration 7: transitions with a model and no
    price, hours rolled up without a cost) opens at migration 8 with its rows: what they hold is charged at today's
    price, and the note says how much; an attempt placed since, at its own. A leader of that release rolling up
    after the migration (as while replicas of two releases share the database) adds GPU-seconds without a price,
    charged at today's price too, not for nothing."""
    from broker.store import sql
    module, _, opener = await sql_database(kind, request, tmp_path)

    cls = type(opener())
    added = cls._usage_added

    def as_release_7(m: pytest.MonkeyPatch) -> None:
        """This process writes as the release before migration 8 did."""
        m.setattr(cls, "INSERT_EVENT", insert_event(kind, EVENT_COLUMNS[:7]))
        m.setattr(sql, "event_row", lambda job, reason: (job.id, job.updated_at.isoformat(), job.state.value,
                                                         job.site, job.attempt, reason or job.reason, job.gpu_model))
        m.setattr(cls, "ADD_USAGE", ADD_USAGE_7[kind])
        m.setattr(cls, "_usage_added", lambda self, rows: added(self, [r[:6] for r in rows]))

    D, A, S = JobState.DISPATCHING, JobState.ADMITTED, JobState.SUCCEEDED
    with monkeypatch.context() as m:
        m.setattr(module, "MIGRATIONS", module.MIGRATIONS[:7])
        m.setattr(module, "_EVENT_COLUMNS", ", ".join(EVENT_COLUMNS[:5]) + ", gpu_model, NULL")
        as_release_7(m)
        s = opener()
        await s.open()
        # 1 GPU-hour rolled up by that release; half a GPU-hour still kept with its transitions
        await run_job(s, "rolled", "a", {"count": 1}, [(0, D, dispatch("s1", 1, A100)), (0, A, {}), (60, S, {})])
        await run_job(s, "kept", "b", {"count": 1}, [(0, D, dispatch("s1", 1, A100)), (0, A, {}), (30, S, {})])
        assert await s.prune_ended(at(61), 10, keep={"kept"}) == ["rolled"]
        await s.close()
    today = {"s1": {A100: 4.0}}
    day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))

    async def costs() -> tuple[dict[str, float], list[str]]:
        body = usage.report(await s.usage_records(day[0].timestamp(), day[1].timestamp()), *day, NOW, ("tenant",),
                            today)
        return {i["tenant"]: i["cost_usd"] for i in body["items"]}, body.get("notes", [])

    s = opener()
    await s.open()
    try:
        await run_job(s, "new", "c", {"count": 1}, [(0, D, dispatch("s1", 1, A100, usd=1.0)), (0, A, {}),
                                                    (60, S, {})])
        assert await costs() == ({"a": near(4.0), "b": near(2.0), "c": near(1.0)}, [
            "cost_usd: 1.5 GPU-hours were placed before prices were recorded (before this release, or where their "
            "site had no price then) and are charged at today's price"])
        assert await s.prune_ended(at(100), 10, keep={"new"}) == ["kept"]  # (rolled up at no price: today's)
        assert (await costs())[0] == {"a": near(4.0), "b": near(2.0), "c": near(1.0)}
        with monkeypatch.context() as m:  # a leader of release 7 deletes "new": its price is lost, not its hours
            as_release_7(m)
            assert await s.prune_ended(at(100), 10) == ["new"]
        assert await costs() == ({"a": near(4.0), "b": near(2.0), "c": near(4.0)}, [
            "cost_usd: 2.5 GPU-hours were placed before prices were recorded (before this release, or where their "
            "site had no price then) and are charged at today's price"])
    finally:
        await s.close()


async def test_each_attempt_is_charged_at_the_price_it_was_placed_at_before_and_after_the_retention(store: Store):
    """s1's A100s cost 2 USD a GPU-hour when "early" was placed and 5 from when "late" was; an attempt with no price
    recorded (placed by an earlier release) is charged at today's, 5, and said to be. The retention deleting them
    changes no figure."""
    D, A, R, S = JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING, JobState.SUCCEEDED
    await run_job(store, "early", "e", {"count": 2}, [(0, D, dispatch("s1", 1, A100, usd=2.0)), (0, A, {}),
                                                      (1, R, {}), (60, S, {})])
    await run_job(store, "late", "l", {"count": 2}, [(120, D, dispatch("s1", 1, A100, usd=5.0)), (120, A, {}),
                                                     (180, S, {})])
    await run_job(store, "old", "o", {"count": 1}, [(0, D, {"site": "s1", "attempt": 1, "gpu_model": A100}),
                                                    (0, A, {}), (30, S, {})])
    today = {"s1": {A100: 5.0}}
    day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))

    async def bill(by: tuple[str, ...]) -> dict[str, Any]:
        return usage.report(await store.usage_records(day[0].timestamp(), day[1].timestamp()), *day, NOW, by, today)

    before = [await bill(by) for by in (("tenant",), EVERYTHING, ("site",))]
    assert {i["tenant"]: i["cost_usd"] for i in before[0]["items"]} == {
        "e": near(2.0 * 2), "l": near(5.0 * 2), "o": near(5.0 * 0.5)}
    assert before[2]["items"][0]["cost_usd"] == near(16.5) and before[2]["total"]["cost_usd"] == near(16.5)
    assert before[0]["notes"] == ["cost_usd: 0.5 GPU-hours were placed before prices were recorded (before this "
                                  "release, or where their site had no price then) and are charged at today's price"]
    assert sorted(await store.prune_ended(at(290), 100)) == ["early", "late", "old"]
    after = [await bill(by) for by in (("tenant",), EVERYTHING, ("site",))]
    for b, a in zip(before, after):
        assert [(i["cost_usd"], i["gpu_hours"]) for i in a["items"]] == [
            (near(i["cost_usd"], abs=0.011), near(i["gpu_hours"])) for i in b["items"]]
        assert a["total"]["cost_usd"] == near(b["total"]["cost_usd"], abs=0.011) and a["notes"] == b["notes"]


async def test_the_cycle_records_the_price_at_placement_so_a_price_changed_later_does_not_rewrite_the_bill(
        client: TestClient):
    """A job placed while berlin's A100s cost 3 USD a GPU-hour keeps that price after the site's spec says 7; one
    placed after the change is charged 7."""
    await register(client, site_body("berlin", "gcp:europe-west3", {A100: 8}, usd_per_gpu_hour={A100: 3.0}))
    first = await (await client.post("/v1/jobs", json={**MINIMAL, "gpus": {"count": 8}, "duration_s": 1})).json()
    await wait_for(client, first["id"], {"succeeded"})
    r = await client.put("/v1/sites/berlin", json=site_body("berlin", "gcp:europe-west3", {A100: 8},
                                                             usd_per_gpu_hour={A100: 7.0}))
    assert r.status == 200, await r.text()
    second = await (await client.post("/v1/jobs", json={**MINIMAL, "tenant": "t2", "gpus": {"count": 8},
                                                        "duration_s": 1})).json()
    await wait_for(client, second["id"], {"succeeded"})
    now = datetime.now(UTC)
    records = await client.broker.store.usage_records((now - timedelta(hours=1)).timestamp(), now.timestamp())
    assert {h.tenant: h.usd_per_gpu_hour for h in records.held} == {"t1": 3.0, "t2": 7.0}
    body = await (await client.get("/v1/usage", params={"by": "tenant"})).json()
    held = {h.tenant: (h.end - h.start) * h.gpus / 3600 for h in records.held}  # type: ignore[operator]
    assert {i["tenant"]: i["cost_usd"] for i in body["items"]} == {
        "t1": near(round(3.0 * held["t1"], 2), abs=0.006), "t2": near(round(7.0 * held["t2"], 2), abs=0.006)}
    assert "notes" not in body


def test_a_placed_jobs_document_has_no_price_so_an_earlier_release_still_reads_it():
    """Job forbids keys it does not know in every release: the price lives in the transitions, not the document,
    and a job back in the queue has none."""
    job = Job(id="j", spec=JobSpec(tenant="t", name="j", gpus={"count": 1}, duration_s=60), created_at=T0,
              updated_at=T0)
    placed = job.transition(JobState.DISPATCHING, at(1), **dispatch("s1", 1, A100, usd=2.5))
    assert placed.usd_per_gpu_hour == 2.5 and "usd_per_gpu_hour" not in placed.model_dump_json()
    assert "usd_per_gpu_hour" not in Job.model_json_schema(mode="serialization")["properties"]
    assert placed.transition(JobState.QUEUED, at(2)).usd_per_gpu_hour is None


# --- carbon: the grid's measured intensity where and when the GPUs were held ---

SLICE_NOW = datetime(2022, 6, 15, 12, 20, tzinfo=UTC)  # inside the shipped carbon slice (2022-06-01 .. 06-21)
CARBON_DIR = Path(__file__).resolve().parent.parent / "data" / "carbon"


@pytest.fixture
async def green_client(tmp_path: Path):
    from broker.clock import ManualClock
    from tests.builders import site
    sites = [site("frankfurt", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin",
                  usd_per_gpu_hour={A100: 2.0}),
             site("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo"),
             site("paris", region="gcp:europe-west9", grid_zone="FR", timezone="Europe/Paris")]  # (no data for FR)
    settings = BrokerSettings.model_validate({
        "db": str(tmp_path / "g.db"), "shutdown_grace_s": 0.1,
        "carbon": {"kind": "files", "path": str(CARBON_DIR)}, "carbon_forecast": {"history_h": 336}})
    broker = Broker(settings, clock=ManualClock(SLICE_NOW))
    await broker.start(sites, run_loop=False)
    await asyncio.wait_for(broker.signals.wait_ready(), 30)
    async with TestClient(TestServer(create_app(broker))) as c:
        c.broker = broker  # type: ignore[attr-defined]
        yield c
    await broker.stop()


async def test_a_tenants_carbon_is_its_energy_hour_by_hour_at_the_grids_measured_intensity(green_client):
    from broker.data.carbon import load_carbon
    broker = green_client.broker
    D, A, R, S = JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING, JobState.SUCCEEDED
    morning = SLICE_NOW.replace(hour=8, minute=30)
    # 2 A100s at frankfurt 08:30 -> 10:30; 1 A100 at tokyo from 11:30, running now (12:20)
    await run_job(broker.store, "fra", "vision", {"count": 2}, [
        (0, D, dispatch("frankfurt", 1, A100, usd=2.0)), (0, A, {}), (1, R, {}), (120, S, {})], t0=morning)
    await run_job(broker.store, "tyo", "nlp", {"count": 1}, [
        (180, D, dispatch("tokyo", 1, A100)), (180, A, {}), (181, R, {})], t0=morning)
    r = await green_client.get("/v1/usage", params={"from": "2022-06-15", "to": "2022-06-16", "by": "tenant"})
    assert r.status == 200, await r.text()
    body = await r.json()
    data = load_carbon(CARBON_DIR)

    def measured(zone: str, hour: int) -> float:
        return data.intensity(zone, SLICE_NOW.replace(hour=hour, minute=0))

    kw = 0.4  # an A100 80GB's board power
    fra_g = 2 * kw * (0.5 * measured("DE-LU", 8) + measured("DE-LU", 9) + 0.5 * measured("DE-LU", 10))
    forecast_now = float(broker.signals.forecast_rows(["JP-TK"], SLICE_NOW)[0][0])
    tyo_g = kw * (0.5 * measured("JP-TK", 11) + (20 / 60) * forecast_now)
    got = {i["tenant"]: i for i in body["items"]}
    assert got["vision"]["co2e_kg"] == near(fra_g / 1000)
    assert got["nlp"]["co2e_kg"] == near(tyo_g / 1000)
    assert body["total"]["co2e_kg"] == near((fra_g + tyo_g) / 1000)
    assert "notes" not in body  # (paris, whose zone has no data, held no GPUs: its intensity is not asked for)
    # A window reaching back before the data: only the hours GPUs were held in are asked for
    wide = await (await green_client.get("/v1/usage", params={"from": "2022-05-01", "to": "2022-06-16",
                                                               "by": "tenant"})).json()
    assert "notes" not in wide and wide["total"]["co2e_kg"] == body["total"]["co2e_kg"]
    # a zone with no data: the note says why, and the rows with energy there have no carbon figure
    await run_job(broker.store, "par", "vision", {"count": 1}, [
        (0, D, dispatch("paris", 1, A100)), (0, A, {}), (60, S, {})], t0=morning)
    again = await (await green_client.get("/v1/usage", params={"from": "2022-06-15", "by": "tenant,site"})).json()
    assert [n.split(":")[:2] for n in again["notes"]] == [["co2e_kg", " zone FR"]]
    by_site = {(i["tenant"], i["site"]): i for i in again["items"]}
    assert "co2e_kg" not in by_site[("vision", "paris")] and by_site[("vision", "frankfurt")]["co2e_kg"] > 0
    assert "co2e_kg" not in again["total"]


def test_the_cli_table_shows_carbon_where_the_broker_has_it_and_says_why_it_does_not():
    from broker.cli import show_usage
    report = {"from": "2022-06-15T00:00:00+00:00", "to": "2022-06-16T00:00:00+00:00", "by": ["tenant"],
              "items": [{"tenant": "vision", "gpu_hours": 5.0, "attempts": 2, "energy_kwh": 2.0, "cost_usd": 10.0,
                         "co2e_kg": 0.9},
                        {"tenant": "nlp", "gpu_hours": 1.0, "attempts": 1, "energy_kwh": 0.4}],
              "total": {"gpu_hours": 6.0, "attempts": 3, "energy_kwh": 2.4},
              "notes": ["co2e_kg: zone FR: carbon provider: no data"]}
    lines = show_usage(report).splitlines()
    assert lines[1].split() == ["TENANT", "GPU_HOURS", "ATTEMPTS", "ENERGY_KWH", "COST_USD", "CO2E_KG"]
    assert lines[2].split() == ["vision", "5.00", "2", "2.0", "10.00", "0.9"]
    assert lines[3].split() == ["nlp", "1.00", "1", "0.4", "-", "-"]
    assert lines[4].split() == ["total", "6.00", "3", "2.4", "-", "-"]
    assert lines[5] == "note: co2e_kg: zone FR: carbon provider: no data"
    del report["notes"], report["items"][0]["co2e_kg"]
    assert "CO2E_KG" not in show_usage(report)  # a broker without a carbon provider


async def test_with_a_price_provider_the_cost_is_at_the_price_routing_sees(tmp_path: Path):
    """A site priced by the broker's price provider alone (no usd_per_gpu_hour in its spec) is costed at that
    price, as GET /v1/sites' signals give it, not left out."""
    prices = Path(__file__).resolve().parent.parent / "data" / "prices" / "gcp_gpu_instance_prices.csv"
    settings = BrokerSettings.model_validate({"db": str(tmp_path / "p.db"), "shutdown_grace_s": 0.1,
                                              "prices": {"kind": "files", "path": str(prices)}})
    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            await register(c, site_body("iowa", "gcp:us-central1", {A100: 8}))
            site = await (await c.get("/v1/sites/iowa")).json()
            price = site["signals"]["usd_per_gpu_hour"][A100]
            assert price > 0
            D, A, S = JobState.DISPATCHING, JobState.ADMITTED, JobState.SUCCEEDED
            await run_job(broker.store, "ran", "t1", {"count": 2}, [
                (0, D, dispatch("iowa", 1, A100)), (0, A, {}), (90, S, {})], t0=datetime.now(UTC) - timedelta(hours=3))
            body = await (await c.get("/v1/usage")).json()
            assert body["items"] == [{"tenant": "t1", "gpu_hours": near(3.0), "attempts": 1, "energy_kwh": near(1.2),
                                      "cost_usd": near(3.0 * price, abs=0.006)}]
    finally:
        await broker.stop()


def test_the_cli_gives_the_report_as_csv_for_a_spreadsheet():
    import csv
    from broker.cli import usage_csv
    report = {"from": "2026-11-01T00:00:00+00:00", "to": "2026-12-01T00:00:00+00:00", "by": ["tenant", "site"],
              "items": [{"tenant": "vision", "site": "berlin", "gpu_hours": 12480.123456, "attempts": 311,
                         "energy_kwh": 4992.05, "cost_usd": 37440.37, "co2e_kg": 1497.6},
                        {"tenant": "nlp, team \"b\"", "site": "oregon", "gpu_hours": 3.5, "attempts": 2,
                         "energy_kwh": 1.4}],
              "total": {"gpu_hours": 12483.623456, "attempts": 313, "energy_kwh": 4993.45}}
    rows = list(csv.DictReader(usage_csv(report).splitlines()))
    assert rows == [
        {"from": "2026-11-01T00:00:00+00:00", "to": "2026-12-01T00:00:00+00:00", "tenant": "vision",
         "site": "berlin", "gpu_hours": "12480.123456", "attempts": "311", "energy_kwh": "4992.05",
         "cost_usd": "37440.37", "co2e_kg": "1497.6"},
        {"from": "2026-11-01T00:00:00+00:00", "to": "2026-12-01T00:00:00+00:00", "tenant": 'nlp, team "b"',
         "site": "oregon", "gpu_hours": "3.5", "attempts": "2", "energy_kwh": "1.4", "cost_usd": "", "co2e_kg": ""}]


def test_a_stored_request_this_release_cannot_read_is_counted_by_its_count_not_in_the_retentions_way(caplog):
    """The roll-up runs before the retention deletes jobs: a request it cannot read must not stop the deletion."""
    jobs = {"odd": ("t", '{"count": 3, "milli": 5000}', A100), "junk": ("t", "not json", A100)}
    events = [ev(j, m, state, "s1", 1, A100) for j in ("odd", "junk")
              for m, state in ((0, "running"), (60, "succeeded"))]
    held = usage.holds(jobs, events)
    assert sorted(h.gpus for h in held) == [1.0, 3.0]
    assert "its GPU request cannot be read" in caplog.text

# --- found in review ---


async def test_a_job_stored_with_a_nul_in_a_label_is_still_charged(store: Store):
    """An earlier release accepted a NUL in a label; the job's document holds it escaped (\\u0000), which
    PostgreSQL's json refuses to take anything out of: the report must still read the job."""
    job = Job(id="nul", spec=JobSpec(tenant="t", name="nul", gpus={"count": 1}, duration_s=60,
                                     labels={"k": "a\x00b", "path": "C:\\u0000"}), created_at=T0, updated_at=T0)
    await store.insert_job(job)
    for minute, state, changes in [(0, JobState.DISPATCHING, dispatch("s1", 1, A100)), (0, JobState.ADMITTED, {}),
                                   (60, JobState.SUCCEEDED, {})]:
        new = job.transition(state, at(minute), **changes)
        await store.update_job(new, job.version)
        job = new
    day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))
    assert rows(await report(store, *day)) == {("t", "s1", A100): (near(1.0), 1)}
    assert await store.prune_ended(at(100), 10) == ["nul"]
    assert rows(await report(store, *day)) == {("t", "s1", A100): (near(1.0), 1)}


async def test_a_full_deletion_round_rolls_up_on_an_sqlite_that_binds_at_most_999_variables(tmp_path: Path):
    """SQLite before 3.32 binds at most 999 variables in a statement; the retention deletes up to
    PRUNE_BATCH (1000) jobs a round, whose attempts it reads first."""
    import sqlite3
    from broker.service import PRUNE_BATCH
    s = SQLiteStore(tmp_path / "h.db")
    await s.open()
    try:
        reader = s._reader
        assert reader is not None
        await reader._execute(reader._conn.setlimit, sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)

        async def one(i: int) -> None:
            await run_job(s, f"j{i:05d}", "t", {"count": 1}, [
                (0, JobState.DISPATCHING, dispatch("s1", 1, A100)), (0, JobState.ADMITTED, {}),
                (6, JobState.SUCCEEDED, {})])

        await asyncio.gather(*(one(i) for i in range(PRUNE_BATCH)))
        assert len(await s.prune_ended(at(100), PRUNE_BATCH)) == PRUNE_BATCH
        day = (datetime(2022, 3, 1, tzinfo=UTC), datetime(2022, 3, 2, tzinfo=UTC))
        assert rows(await report(s, *day)) == {("t", "s1", A100): (near(PRUNE_BATCH * 0.1, abs=1e-4), PRUNE_BATCH)}
    finally:
        await s.close()


def test_an_earlier_releases_attempt_on_another_site_is_charged_to_an_unknown_model_not_the_jobs_last():
    """Transitions stored before usage carry no model; only the job's current attempt is known to be on the job's
    model (README: ``unknown`` for an attempt placed before this release, where the job has moved on since)."""
    records = usage.UsageRecords(usage.holds(
        {"j": ("t", '{"count": 1}', H100)},
        [ev("j", 0, "running", "s1", 1, None), ev("j", 30, "queued", None, 1, None),
         ev("j", 30, "dispatching", "s2", 2, None), ev("j", 30, "running", "s2", 2, None),
         ev("j", 60, "succeeded", "s2", 2, None)]), [])
    body = usage.report(records, *usage.window(at(0), at(60), NOW), NOW, ("site", "gpu_model"), PRICES)
    assert rows(body) == {("s1", usage.UNKNOWN_MODEL): (near(0.5), 1), ("s2", H100): (near(0.5), 1)}


def test_an_attempt_begun_before_the_upgrade_takes_the_model_a_later_transition_of_it_names():
    """Admitted before migration 7 (no model), preempted after it (the transition names the model): the attempt was
    on that model, though the job has moved on since."""
    records = usage.UsageRecords(usage.holds(
        {"j": ("t", '{"count": 1}', H100)},
        [ev("j", 0, "running", "s1", 1, None), ev("j", 30, "preempted", "s1", 1, A100),
         ev("j", 30, "queued", None, 1, None), ev("j", 30, "dispatching", "s2", 2, H100),
         ev("j", 30, "running", "s2", 2, H100), ev("j", 60, "succeeded", "s2", 2, H100)]),
        [])
    body = usage.report(records, *usage.window(at(0), at(60), NOW), NOW, ("site", "gpu_model"), PRICES)
    assert rows(body) == {("s1", A100): (near(0.5), 1), ("s2", H100): (near(0.5), 1)}


async def test_an_offset_whose_plus_the_url_turned_into_a_space_gets_a_400_that_says_so(client: TestClient):
    r = await client.get("/v1/usage?from=2026-11-01T00:00:00+01:00")  # (as curl sends it, unencoded)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["fields"][0]["field"] == "from" and "write it %2B" in error["message"]
    r = await client.get("/v1/usage?from=2026-11-01T00:00:00%2B01:00&to=2026-11-02T00:00:00%2B01:00")
    assert r.status == 200 and (await r.json())["from"] == "2026-10-31T23:00:00+00:00"


@pytest.mark.parametrize("start, end", [("20261101", "20261102"), ("2026-W44-7", "2026-W45-1")])
async def test_a_date_in_iso_8601s_other_forms_is_its_midnight_utc_too(client: TestClient, start: str, end: str):
    """A date in ISO 8601's basic or week form is a date too (it was refused as a time without a zone, and adding
    the Z the answer asked for made it no time at all)."""
    r = await client.get("/v1/usage", params={"from": start, "to": end})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert (body["from"], body["to"]) == ("2026-11-01T00:00:00+00:00", "2026-11-02T00:00:00+00:00")


def test_gpu_hours_on_an_unrecorded_model_are_said_to_count_no_energy_and_a_part_that_held_no_time_costs_nothing():
    held = [usage.Held("t", "s1", A100, 1.0, at(0).timestamp(), at(60).timestamp(), 2.0),
            usage.Held("t", "s1", usage.UNKNOWN_MODEL, 2.0, at(0).timestamp(), at(30).timestamp()),
            usage.Held("t", "gone", H100, 4.0, at(10).timestamp(), at(10).timestamp())]  # (no time held)
    body = usage.report(usage.UsageRecords(held, []), *usage.window(at(0), at(120), NOW), NOW, ("tenant",),
                        PRICES)
    row = body["items"][0]
    assert row["gpu_hours"] == near(2.0) and row["energy_kwh"] == near(0.4) and row["attempts"] == 3
    assert body["notes"] == ["energy_kwh, co2e_kg: 1 GPU-hours were held on a GPU model nobody recorded "
                             "(gpu_model unknown: placed before this release) and count no energy"]
    assert "cost_usd" not in row  # (the unknown model has no price at s1)
    priced = usage.report(usage.UsageRecords([held[0], held[2]], []), *usage.window(at(0), at(120), NOW), NOW,
                          ("tenant",), PRICES)
    assert priced["items"][0]["cost_usd"] == near(2.0) and "notes" not in priced  # ('gone' held nothing)
