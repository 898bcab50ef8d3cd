"""The carbon ledger (``GET /v1/carbon``, the dashboard's headline): what the broker's choices emitted against a
carbon-agnostic choice, kept in the database so that a restart or a takeover does not start it from 0.

Two simulated sites with the shipped June 2022 carbon data: ``clean`` on Ontario's grid (CA-ON), the dearer,
and ``cheap`` on Tokyo's (JP-TK); ``green`` weighs carbon first, so it places on ``clean`` where a choice
without the carbon terms (price, telemetry) would have taken ``cheap``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest

from broker.carbon_ledger import CarbonLedger, Counted
from broker.cycle import CARBON_LEDGER_STATE
from broker.models import JobState, SimulatedAdapterConfig
from tests.builders import job, site
from tests.test_timeshift import GREEN_AT, green_broker, restoring

FAST = SimulatedAdapterConfig(dispatch_delay_s=1.0)
SITES = [site("clean", region="gcp:northamerica-northeast2", grid_zone="CA-ON", timezone="America/Toronto",
              adapter=FAST, usd_per_gpu_hour={"a100-80gb": 4.0}),
         site("cheap", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=FAST,
              usd_per_gpu_hour={"a100-80gb": 2.0})]


async def carbon(b) -> dict:
    """What ``GET /v1/carbon`` answers."""
    from aiohttp.test_utils import TestClient, TestServer

    from broker.api import create_app

    async with TestClient(TestServer(create_app(b))) as client:
        resp = await client.get("/v1/carbon")
        assert resp.status == 200
        return await resp.json()


async def green_broker_with_two_jobs_placed(tmp_path):  # noqa: ANN001, ANN201
    """A green broker over SITES that has placed two jobs, both admitted by their site (so counted)."""
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    for name in ("a", "b"):
        await b.book.submit(job(name=name, count=2, duration_s=3600))
    await b.cycle.run_once(full=True)
    await clock.advance(FAST.dispatch_delay_s)
    await b.cycle.drain()
    return b


KWH = 2 * 0.4  # a job of 2 A100s (0.4 kW each) for its hour's estimate


async def step(b, clock, seconds: float) -> None:  # noqa: ANN001
    """The clock, then the sites' events and the store's writes (as tests/test_live_moves.py's)."""
    await clock.advance(seconds)
    for _ in range(3):
        await asyncio.sleep(0.05)
        await b.cycle.drain()


async def admitted_job(b, clock):  # noqa: ANN001, ANN201
    """A 2-GPU, one-hour job submitted, placed by a full pass and admitted by its site (as submitted)."""
    j, _ = await b.book.submit(job(name="a", count=2, duration_s=3600))
    await b.cycle.run_once(full=True)
    await step(b, clock, FAST.dispatch_delay_s)
    return j


async def test_the_carbon_saved_runs_on_across_a_restart(tmp_path) -> None:
    b = await green_broker_with_two_jobs_placed(tmp_path)
    try:
        before = await carbon(b)
        assert before["jobs"] == 2 and before["moved_jobs"] == 2 and before["saved_grams"] > 0
        assert before["admissions"] == 2 and before["open_attempts"] == 2
        await b.clock.advance(600)  # (admitted at GREEN_AT + 1 s: the broker stops ten minutes into their hour)
    finally:
        await b.stop()
    # The broker comes back half an hour after it admitted them; the simulated sites, which ran in the broker's
    # process, forgot the two attempts when it stopped, and it requeues them: each is counted for the sixth of its
    # hour it ran until the broker that stopped last knew it on its site, not for its hour, nor up to the restart.
    again, clock = await green_broker(tmp_path, SITES, at=GREEN_AT + timedelta(seconds=1801),
                                      profiles={"default": "green"})
    try:
        after = await carbon(again)
        sixth = {k: pytest.approx(before[k] / 6, abs=1e-3) for k in ("energy_kwh", "grams", "agnostic_grams")}
        assert after == {**before, **sixth, "saved_grams": pytest.approx(before["saved_grams"] / 6, abs=1e-3),
                         "open_attempts": 0}
        # It goes on counting from there: a new job, and the two whose attempts the simulated sites lost with
        # the restart, placed again: three jobs (five admissions), not five.
        await again.book.submit(job(name="c", count=2, duration_s=3600))
        report = await again.cycle.run_once(full=True)
        await clock.advance(FAST.dispatch_delay_s)
        await again.cycle.drain()
        assert report.placed == 3
        ledger = await carbon(again)
        assert (ledger["jobs"], ledger["admissions"], ledger["moved_jobs"]) == (3, 5, 3), ledger
        assert ledger["energy_kwh"] == pytest.approx(2 * KWH / 6 + 3 * KWH, abs=1e-6)
        await again.cycle.keep_ledger()
        stored = json.loads(await again.store.get_state(CARBON_LEDGER_STATE))
        assert (stored["v"], stored["format"], stored["jobs"], stored["admissions"]) == (1, 2, 3, 5)
        assert len(stored["open"]) == 3
    finally:
        await again.stop()


async def test_a_job_preempted_halfway_and_resumed_is_counted_once_in_full(tmp_path) -> None:
    """Its site stops a checkpointable job halfway; placed again for the rest of its run, it is counted once,
    for the hour it ran in all: the first attempt's unrun half is taken back when it ends."""
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j, _ = await b.book.submit(job(name="a", count=2, duration_s=3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, FAST.dispatch_delay_s)
        first = await b.book.get(j.id)
        assert first.state == JobState.RUNNING and (await carbon(b))["energy_kwh"] == pytest.approx(KWH)
        await step(b, clock, 1800)
        grams = b.metrics.carbon_grams._value.get()
        await b.federation.get(first.site).adapter.preempt(j.id, 1, "reclaimed by the site")
        await step(b, clock, 0)
        assert (await b.book.get(j.id)).state == JobState.QUEUED
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 2, rel=1e-3) and ledger["open_attempts"] == 0
        assert b.metrics.carbon_grams._value.get() == grams  # (the counter never goes down)
        await b.cycle.run_once(full=True)
        await step(b, clock, FAST.dispatch_delay_s)
        assert (await b.book.get(j.id)).attempt == 2
        await step(b, clock, 3600)
        done = await b.book.get(j.id)
        assert done.state == JobState.SUCCEEDED
        ledger = await carbon(b)
        assert (ledger["jobs"], ledger["admissions"], ledger["open_attempts"]) == (1, 2, 0), ledger
        assert ledger["energy_kwh"] == pytest.approx(KWH, rel=1e-3)
    finally:
        await b.stop()


async def test_a_job_that_ran_a_quarter_of_its_estimate_counts_a_quarter(tmp_path) -> None:
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        for name in ("clean", "cheap"):  # the job is done in a quarter of the hour it asked for
            b.federation.get(name).adapter._run_seconds = lambda j: j.spec.duration_s / 4
        j = await admitted_job(b, clock)
        full = await carbon(b)
        await step(b, clock, 900)
        assert (await b.book.get(j.id)).state == JobState.SUCCEEDED
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 4)
        assert ledger["grams"] == pytest.approx(full["grams"] / 4, abs=1e-3)
        assert ledger["agnostic_grams"] == pytest.approx(full["agnostic_grams"] / 4, abs=1e-3)
        assert (ledger["jobs"], ledger["moved_jobs"], ledger["open_attempts"]) == (1, 1, 0)
    finally:
        await b.stop()


async def test_an_attempt_that_overran_is_charged_its_overrun_in_the_counters_too(tmp_path) -> None:
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        for name in ("clean", "cheap"):  # the job runs half as long again as it said
            b.federation.get(name).adapter._run_seconds = lambda j: j.spec.duration_s * 1.5
        j = await admitted_job(b, clock)
        grams = b.metrics.carbon_grams._value.get()
        await step(b, clock, 5400)
        assert (await b.book.get(j.id)).state == JobState.SUCCEEDED
        assert (await carbon(b))["energy_kwh"] == pytest.approx(1.5 * KWH)
        assert b.metrics.carbon_grams._value.get() == pytest.approx(1.5 * grams)
    finally:
        await b.stop()


@pytest.mark.parametrize("end", ["failed", "lost", "cancelled", "withdrawn"])
async def test_an_attempt_that_ends_early_any_way_is_counted_for_the_time_it_ran(tmp_path, end) -> None:
    """Failed with attempts left, lost with its site, cancelled while running, or withdrawn by the broker
    (``requeue_from``): ended 15 minutes into its hour, the attempt counts a quarter of it."""
    from adapters.base import EventKind, JobEvent

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j, _ = await b.book.submit(job(name="a", count=2, duration_s=3600, max_attempts=3))
        await b.cycle.run_once(full=True)
        await step(b, clock, FAST.dispatch_delay_s)
        await step(b, clock, 900)
        running = await b.book.get(j.id)
        if end == "cancelled":
            await b.lifecycle.cancel(j.id)
        elif end == "withdrawn":
            await b.lifecycle.requeue_from(running.site, j.id, running.attempt, "dropped the attempt")
        else:
            kind = EventKind.FAILED if end == "failed" else EventKind.LOST
            await b.lifecycle.on_event(running.site, JobEvent(j.id, running.attempt, kind, clock.now()))
        ended = await b.book.get(j.id)
        assert ended.state == (JobState.CANCELLED if end == "cancelled" else JobState.QUEUED)
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 4) and ledger["open_attempts"] == 0
        assert b.cycle.carbon.returning == ({} if end == "cancelled" else {j.id: True})
    finally:
        await b.stop()


async def test_an_attempt_that_ended_unheard_by_the_ledger_is_ended_when_a_broker_takes_charge(tmp_path) -> None:
    """The job was cancelled after the ledger was last saved (a crash, or a lost lease, lost the correction):
    the broker taking charge finds the attempt open in the stored ledger and ends it as of the job's end."""
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j = await admitted_job(b, clock)
        await b.cycle.keep_ledger()
        await step(b, clock, 1800)
        hook, b.book.on_attempt_end = b.book.on_attempt_end, None  # (unheard)
        await b.lifecycle.cancel(j.id)
        b.book.on_attempt_end = hook
        assert (await carbon(b))["open_attempts"] == 1
        await b.cycle.restore_learned()  # as the broker taking charge: the ledger as last saved
        assert await b.cycle.settle_ledger() == 1
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 2) and ledger["open_attempts"] == 0
    finally:
        await b.stop()


async def test_an_unheard_attempt_of_a_job_on_a_later_one_is_ended_when_it_left_its_site(tmp_path) -> None:
    """Its first attempt was lost a quarter of the way through, unheard by the ledger as last saved; the job ran
    again two hours later. The broker taking charge ends that attempt when it left its site (its stored
    transitions say), not at the job's last change, which would charge it two hours past its estimate."""
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j = await admitted_job(b, clock)
        site = (await b.book.get(j.id)).site
        await b.cycle.keep_ledger()  # attempt 1 open, as saved
        await step(b, clock, 900)
        assert await b.lifecycle.requeue_from(site, j.id, 1, "the site lost it") is not None
        await step(b, clock, 7200)
        await b.cycle.run_once(full=True)
        await step(b, clock, FAST.dispatch_delay_s)
        await step(b, clock, 60)
        again = await b.book.get(j.id)
        assert again.attempt == 2 and again.state == JobState.RUNNING
        await b.cycle.restore_learned()  # as the broker taking charge: the ledger as last saved
        assert (await carbon(b))["open_attempts"] == 1
        assert await b.cycle.settle_ledger() == 1
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH * 900 / 3600, rel=0.01) and ledger["open_attempts"] == 0
    finally:
        await b.stop()


def test_a_version_1_ledger_still_loads_with_nothing_open() -> None:
    """Saved before attempts were remembered: its ``jobs`` counted admissions, and nothing is left to correct."""
    doc = {"v": 1, "jobs": 4, "energy_kwh": 3.2, "grams": 100.0, "agnostic_grams": 400.0, "moved": 3}
    ledger = CarbonLedger.restore(doc)
    assert ledger.as_dict() == {"jobs": 4, "admissions": 4, "open_attempts": 0, "energy_kwh": 3.2, "grams": 100.0,
                                "agnostic_grams": 400.0, "saved_grams": 300.0, "saved_fraction": 0.75,
                                "moved_jobs": 3}
    again = CarbonLedger.restore(json.loads(json.dumps(ledger.state())))
    assert again.state() == {**doc, "format": 2, "admissions": 4, "open": {}, "returning": {}}


def _earlier_release_restore(doc: object) -> tuple[int, float, float, float, int]:
    """``CarbonLedger.restore`` of the release before open attempts were kept (80437f2), as it reads a document:
    version 1 only, its totals (jobs, kWh, grams, agnostic grams, moved), anything else read past."""
    if not isinstance(doc, dict) or doc.get("v") != 1:
        raise ValueError("not a carbon ledger document of version 1")
    return (int(doc["jobs"]), float(doc["energy_kwh"]), float(doc["grams"]), float(doc["agnostic_grams"]),
            int(doc["moved"]))


def test_a_broker_of_the_earlier_release_taking_over_goes_on_from_the_totals() -> None:
    """Replicas of two releases share the database (a rolling upgrade, or a rollback): a broker of the release
    before open attempts were kept reads version 1 only; given a document it cannot read, it starts its totals
    from 0 and saves that over them. It reads this release's document, and this release reads back what it
    saves (its totals, nothing open)."""
    ledger = CarbonLedger()
    ledger.add("j1", 1, Counted(1.0, 100.0, 400.0, True, 3600.0), 1000.0)
    ledger.add("j2", 1, Counted(2.0, 50.0, 50.0, False, 7200.0), 1000.0)
    ledger.end("j2", 1, 1000.0 + 1800.0, requeued=True)
    doc = json.loads(json.dumps(ledger.state()))
    assert _earlier_release_restore(doc) == (2, pytest.approx(1.5), pytest.approx(112.5), pytest.approx(412.5), 1)
    assert CarbonLedger.restore(doc) == ledger  # (and this release still reads all of it)
    jobs, kwh, grams, agnostic, moved = _earlier_release_restore(doc)
    saved_back = {"v": 1, "jobs": jobs, "energy_kwh": kwh, "grams": grams, "agnostic_grams": agnostic, "moved": moved}
    back = CarbonLedger.restore(saved_back)
    assert (back.jobs, back.admissions, back.open, back.grams) == (2, 2, {}, pytest.approx(112.5))


def test_attempts_being_dispatched_and_the_last_save_are_kept_where_earlier_releases_read_past_them() -> None:
    """The attempts sent to their site and not counted yet, and when the broker in charge saved the document, are
    keys beside the rest: the document stays version 1, format 2, its totals and open attempts as before (the
    release before this one reads exactly those, the one before that the totals), and what either saves back,
    without them, is read as nothing being dispatched and no last save known."""
    ledger = CarbonLedger()
    ledger.add("j1", 1, Counted(1.0, 100.0, 400.0, True, 3600.0), 1000.0)
    before = json.loads(json.dumps(ledger.state()))
    ledger.dispatch("j2", 1, Counted(2.0, 50.0, 50.0, False, 7200.0), 1500.0)
    doc = json.loads(json.dumps(ledger.state(seen_ts=2000.0)))
    assert {k: v for k, v in doc.items() if k not in ("dispatching", "seen_at")} == before
    assert doc["dispatching"] == {"j2": [1, 2.0, 50.0, 50.0, 7200.0, 1500.0, False]} and doc["seen_at"] == 2000.0
    assert _earlier_release_restore(doc) == (1, 1.0, 100.0, 400.0, 1)
    again = CarbonLedger.restore(doc)
    assert again == ledger and again.seen_ts == 2000.0
    assert again.admit("j2", 1, 1600.0) is not None and (again.jobs, again.admissions) == (2, 2)
    back = CarbonLedger.restore(before)
    assert (back.dispatching, back.seen_ts, back.open) == ({}, None, ledger.open)


def test_a_version_2_document_written_before_format_is_still_read() -> None:
    ledger = CarbonLedger()
    ledger.add("j1", 1, Counted(1.0, 100.0, 400.0, True, 3600.0), 1000.0)
    doc = {**json.loads(json.dumps(ledger.state())), "v": 2}
    del doc["format"]
    assert CarbonLedger.restore(doc) == ledger


async def test_a_version_1_ledger_in_the_store_is_taken_up(tmp_path) -> None:
    doc = '{"v": 1, "jobs": 4, "energy_kwh": 3.2, "grams": 100, "agnostic_grams": 400, "moved": 3}'
    async with restoring(tmp_path, SITES, CARBON_LEDGER_STATE, doc) as b:
        ledger = await carbon(b)
        assert (ledger["jobs"], ledger["admissions"], ledger["open_attempts"]) == (4, 4, 0)
        assert ledger["energy_kwh"] == 3.2


def test_open_attempts_and_jobs_between_attempts_are_kept_in_the_document() -> None:
    ledger = CarbonLedger()
    ledger.add("j1", 1, Counted(1.0, 100.0, 400.0, True, 3600.0), 1000.0)
    ledger.add("j2", 1, Counted(2.0, 50.0, 50.0, False, 7200.0), 1000.0)
    ledger.end("j2", 1, 1000.0 + 1800.0, requeued=True)  # a quarter of it ran; back in the queue
    again = CarbonLedger.restore(json.loads(json.dumps(ledger.state())))
    assert again == ledger and again.returning == {"j2": False}
    again.add("j2", 2, Counted(1.5, 37.5, 37.5, True, 5400.0), 5000.0)  # the same job again, placed elsewhere
    assert (again.jobs, again.admissions, again.moved) == (2, 3, 2)
    assert again.end("j1", 1, 1000.0 + 7200.0, requeued=False).kwh == pytest.approx(1.0)  # its overrun
    assert again.energy_kwh == pytest.approx(2.0 + 0.5 + 1.5)


async def test_a_placement_its_site_refuses_is_counted_once_where_it_runs(tmp_path, monkeypatch) -> None:
    """A site that refuses an attempt (a node draining, its own quota) sends the job back to be placed again:
    the ledger counted both placements, the one that never ran included."""
    from adapters.base import Admission

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        clean = b.federation.get("clean").adapter
        admit, refused = clean.submit, []

        async def refuse_once(attempt):
            if not refused:
                refused.append(attempt.id)
                return Admission(False, "node draining")
            return await admit(attempt)

        monkeypatch.setattr(clean, "submit", refuse_once)
        await b.book.submit(job(name="a", count=2, duration_s=3600))
        await b.cycle.run_once(full=True)
        await b.cycle.drain()  # (refused at once)
        assert refused and (await carbon(b))["jobs"] == 0
        await b.cycle.run_once(full=True)
        await clock.advance(FAST.dispatch_delay_s)
        await b.cycle.drain()
        ledger = await carbon(b)
        assert ledger["jobs"] == 1 and ledger["energy_kwh"] == pytest.approx(2 * 0.4, rel=0.01), ledger
        assert (await b.book.get(refused[0])).state.on_site
    finally:
        await b.stop()


async def test_placements_admitted_after_their_pass_are_saved_by_a_later_pass_with_nothing_to_do(tmp_path) -> None:
    """The ledger counts a placement when its site admits it, after the pass that made it: a broker with no
    more work saved it only at its next placement or a clean stop, so a crash or a lost lease lost it."""
    b = await green_broker_with_two_jobs_placed(tmp_path)
    try:
        assert (await carbon(b))["jobs"] == 2
        assert await b.store.get_state(CARBON_LEDGER_STATE) is None  # admitted after the pass: not saved yet
        report = await b.cycle.run_once(full=True)  # nothing left to decide
        assert report.decided == 0
        assert json.loads(await b.store.get_state(CARBON_LEDGER_STATE))["jobs"] == 2
    finally:
        await b.stop()


V2 = '{"v": 2, "jobs": 1, "admissions": 1, "energy_kwh": 1, "grams": 1, "agnostic_grams": 1, "moved": 0, '


@pytest.mark.parametrize("doc", ['{"v": 1, "jobs": -1, "energy_kwh": 0, "grams": 0, "agnostic_grams": 0, "moved": 0}',
                                 '{"v": 1, "jobs": 1}', "not json", '{"v": 2}', '{"v": 3}',
                                 '{"v": 1, "format": 3, "jobs": 1, "energy_kwh": 0, "grams": 0, "agnostic_grams": 0, '
                                 '"moved": 0}',
                                 V2 + '"open": {"j": [1, 1, 1, 1, 0, 0, false]}, "returning": {}}',  # (expected 0 s)
                                 V2 + '"open": {}, "returning": {"j": 1}}',
                                 V2 + '"open": {}, "returning": {}, "dispatching": []}',
                                 V2 + '"open": {}, "returning": {}, "seen_at": "yesterday"}'])
async def test_a_stored_ledger_that_cannot_be_read_is_ignored_with_a_warning(tmp_path, caplog, doc) -> None:
    async with restoring(tmp_path, SITES, CARBON_LEDGER_STATE, doc) as b:
        assert "ignoring the stored carbon ledger" in caplog.text
        assert (await carbon(b))["jobs"] == 0


async def test_a_ledger_the_store_could_not_read_at_first_is_kept_not_counted_again_from_0(tmp_path, monkeypatch) -> None:
    """The broker taking charge cannot read the stored ledger at its first try (the connection dropped for a
    moment): it must not start from 0 and then save that over the totals the last broker left."""
    from broker.store import StoreError
    from broker.store.sqlite import SQLiteStore

    b = await green_broker_with_two_jobs_placed(tmp_path)
    try:
        before = await carbon(b)
        await b.clock.advance(1800)
    finally:
        await b.stop()
    real, failed = SQLiteStore.get_state, []

    async def flaky(self, name):  # noqa: ANN001, ANN202
        if name == CARBON_LEDGER_STATE and not failed:
            failed.append(name)
            raise StoreError("cannot use PostgreSQL: ConnectionResetError: connection reset by peer")
        return await real(self, name)

    monkeypatch.setattr(SQLiteStore, "get_state", flaky)
    # (stopped half an hour after the two were admitted, back an hour after: the sites lost them with the broker
    # that stopped, so they are counted for that half hour)
    again, clock = await green_broker(tmp_path, SITES, at=GREEN_AT + timedelta(seconds=3601),
                                      profiles={"default": "green"})
    try:
        after = await carbon(again)
        assert failed and (after["jobs"], after["admissions"]) == (2, 2)
        assert after["energy_kwh"] == pytest.approx(before["energy_kwh"] / 2)
        await again.book.submit(job(name="c", count=2, duration_s=3600))
        await again.cycle.run_once(full=True)
        await clock.advance(FAST.dispatch_delay_s)
        await again.cycle.drain()
        await again.cycle.keep_ledger()
        stored = json.loads(await again.store.get_state(CARBON_LEDGER_STATE))
        assert (stored["jobs"], stored["admissions"]) == (3, 5)
    finally:
        await again.stop()


async def settle(b) -> None:  # noqa: ANN001
    """The sites' events and the store's writes, without waiting for dispatches in flight (``step`` does)."""
    for _ in range(5):
        await asyncio.sleep(0.02)


def hold_answers(monkeypatch, b):  # noqa: ANN001, ANN201
    """Both sites admit an attempt as usual but answer the dispatch only once the returned event is set."""
    answer = asyncio.Event()
    for name in ("clean", "cheap"):
        adapter = b.federation.get(name).adapter

        async def held(attempt, admit=adapter.submit):  # noqa: ANN001, ANN202
            admission = await admit(attempt)
            await answer.wait()
            return admission

        monkeypatch.setattr(adapter, "submit", held)
    return answer


@pytest.mark.parametrize("report", ["running then succeeded", "succeeded alone"])
async def test_an_attempt_whose_site_reports_it_done_before_its_admission_is_recorded_is_counted(
        tmp_path, monkeypatch, report) -> None:
    """The site's answer to the dispatch is slow (or lost and sent again): its reports of the attempt running and
    done, or of it done alone (an agent whose admission and end went out in one heartbeat), come first. The
    attempt ran ten minutes of its hour: counted once, for those ten minutes, from when the site said it began
    (it was never counted at all)."""
    from adapters.base import EventKind, JobEvent

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        answer = hold_answers(monkeypatch, b)
        j, _ = await b.book.submit(job(name="a", count=2, duration_s=3600))
        await b.cycle.run_once(full=True)
        site = (await b.book.get(j.id)).site
        if report == "running then succeeded":
            b.federation.get(site).adapter._run_seconds = lambda j: 600.0
            await clock.advance(FAST.dispatch_delay_s)  # admitted and running: the answer is held
            await settle(b)
            assert (await b.book.get(j.id)).state == JobState.RUNNING
            running = await carbon(b)  # (counted while it runs, for its expected run)
            assert (running["jobs"], running["open_attempts"], running["energy_kwh"]) == (1, 1, pytest.approx(KWH))
            await clock.advance(600)
            await settle(b)
        else:
            await clock.advance(FAST.dispatch_delay_s + 600)
            b.federation.get(site).adapter._runs.clear()  # (the site's own run is left out: its report stands for it)
            await b.lifecycle.on_event(site, JobEvent(j.id, 1, EventKind.SUCCEEDED, clock.now(), run_s=600.0))
        assert (await b.book.get(j.id)).state == JobState.SUCCEEDED
        answer.set()
        await b.cycle.drain()
        ledger = await carbon(b)
        assert (ledger["jobs"], ledger["admissions"], ledger["open_attempts"]) == (1, 1, 0), ledger
        assert ledger["energy_kwh"] == pytest.approx(KWH / 6, rel=1e-3)
        assert ledger["moved_jobs"] == 1 and ledger["saved_grams"] > 0
    finally:
        answer.set()
        await b.stop()


async def test_an_attempt_admitted_unheard_before_a_restart_is_counted_when_its_site_reports_it(
        tmp_path, monkeypatch) -> None:
    """The broker stopped while it dispatched the attempt (its answer never came): the broker taking charge finds
    the job still dispatching, and the site, which had admitted it, reports it running, then done twenty minutes
    later. It is counted for those twenty minutes (it was never counted)."""
    from adapters.base import EventKind, JobEvent

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        hold_answers(monkeypatch, b)
        j, _ = await b.book.submit(job(name="a", count=2, duration_s=3600))
        await b.cycle.run_once(full=True)
        await settle(b)
        await b.cycle.keep_ledger()  # the placement, sent, as saved
        assert await b.cycle.drain(0) == 1  # (cut off: the job stays dispatching)
        site = (await b.book.get(j.id)).site
        assert (await b.book.get(j.id)).state == JobState.DISPATCHING
        await b.cycle.restore_learned()  # as the broker taking charge: the ledger as last saved
        await b.cycle.settle_ledger()
        start = clock.now()
        await b.lifecycle.on_event(site, JobEvent(j.id, 1, EventKind.RUNNING, start))
        assert (await carbon(b))["open_attempts"] == 1  # (counted while it runs)
        await clock.advance(1200)
        await b.lifecycle.on_event(site, JobEvent(j.id, 1, EventKind.SUCCEEDED, clock.now(), run_s=1200.0))
        ledger = await carbon(b)
        assert (ledger["jobs"], ledger["admissions"], ledger["open_attempts"]) == (1, 1, 0), ledger
        assert ledger["energy_kwh"] == pytest.approx(KWH / 3, rel=1e-3)
    finally:
        await b.stop()


async def test_an_attempt_its_site_reports_stopped_while_no_broker_heard_is_counted_up_to_the_stop(tmp_path) -> None:
    """The site stopped the attempt (its own preemption, or its agent's lease running out) twenty minutes into its
    hour, while no broker heard; its report reaches the broker an hour later, sent again until one takes it. The
    attempt is counted for the twenty minutes it ran, not up to when the report came."""
    from adapters.base import EventKind, JobEvent

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j = await admitted_job(b, clock)
        running = await b.book.get(j.id)
        stopped = clock.now() + timedelta(seconds=1200)
        await b.federation.get(running.site).adapter.cancel(j.id, 1)  # (its own run is left out: the report stands)
        await clock.advance(3600)
        await b.lifecycle.on_event(running.site, JobEvent(j.id, 1, EventKind.PREEMPTED, stopped, run_s=1200.0,
                                                          reason="reclaimed by the site"))
        assert (await b.book.get(j.id)).state == JobState.QUEUED
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 3, rel=1e-3) and ledger["open_attempts"] == 0
    finally:
        await b.stop()


async def test_a_crashed_broker_s_last_sight_of_its_attempts_is_saved_every_minute(tmp_path) -> None:
    """A broker with attempts running and nothing else changing saves the ledger every minute all the same, so
    a broker taking charge after it crashed ends an attempt its site forgot meanwhile as of the last of those
    saves (the last time a broker knew it on its site), not when it took charge."""
    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j = await admitted_job(b, clock)
        for _ in range(15):  # quiet passes, a minute apart, for a quarter of an hour
            await clock.advance(60)
            b.cycle._carbon_saved_at -= 60  # (the monotonic clock, as it would have run)
            await b.cycle.run_once(full=True)
        # The broker crashes there; the next one takes charge an hour later, and the site has forgotten the attempt.
        await b.federation.get((await b.book.get(j.id)).site).adapter.cancel(j.id, 1)  # (silently)
        await clock.advance(3600)
        await b.cycle.restore_learned()
        assert await b.lifecycle.recover()
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 4, rel=1e-3) and ledger["open_attempts"] == 0
    finally:
        await b.stop()


async def test_a_restart_s_requeue_that_fails_does_not_cut_the_attempt_s_count_short_later(tmp_path) -> None:
    """At a restart, the site no longer knows an attempt, but the store refuses its requeue for the moment: the
    attempt stays where it was, and is requeued later, when the site answers again (with no time it was last
    seen). The ledger counts it up to that requeue, not up to the failed one's time, which nothing remembers."""
    from broker.store import StoreError

    b, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        j = await admitted_job(b, clock)
        running = await b.book.get(j.id)
        await b.federation.get(running.site).adapter.cancel(j.id, 1)  # (silently: the site forgets it)
        await clock.advance(600)
        transition = b.book.transition

        async def refused(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            raise StoreError("the database is restarting")
        b.book.transition = refused
        assert await b.lifecycle.reconcile(running.site, {j.id: running.version}, clock.now()) == [None]
        b.book.transition = transition
        assert b.lifecycle.left_at == {}  # (nothing left behind for an attempt that did not leave)
        await clock.advance(1200)
        [requeued] = await b.lifecycle.reconcile(running.site, {j.id: running.version})
        assert requeued is not None and requeued.state == JobState.QUEUED
        ledger = await carbon(b)
        assert ledger["energy_kwh"] == pytest.approx(KWH / 2, rel=1e-2) and ledger["open_attempts"] == 0
    finally:
        await b.stop()
