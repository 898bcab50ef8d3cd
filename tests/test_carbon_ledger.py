"""The carbon ledger (``GET /v1/carbon``, the dashboard's headline): what the broker's choices emitted against a
carbon-agnostic choice, kept in the database so that a restart or a takeover does not start it from 0.

Two simulated sites with the shipped June 2022 carbon data: ``clean`` on Ontario's grid (CA-ON), the dearer,
and ``cheap`` on Tokyo's (JP-TK); ``green`` weighs carbon first, so it places on ``clean`` where a choice
without the carbon terms (price, telemetry) would have taken ``cheap``.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from broker.cycle import CARBON_LEDGER_STATE
from broker.models import SimulatedAdapterConfig
from tests.builders import job, site
from tests.test_timeshift import green_broker, restoring

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


async def test_the_carbon_saved_runs_on_across_a_restart(tmp_path) -> None:
    b = await green_broker_with_two_jobs_placed(tmp_path)
    try:
        before = await carbon(b)
        assert before["jobs"] == 2 and before["moved_jobs"] == 2 and before["saved_grams"] > 0
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        after = await carbon(again)
        assert after == before
        # It goes on counting from there: a new job, and the two whose attempts the simulated sites lost
        # with the restart, placed again (a placement counts each time a site admits it).
        await again.book.submit(job(name="c", count=2, duration_s=3600))
        report = await again.cycle.run_once(full=True)
        await clock.advance(FAST.dispatch_delay_s)
        await again.cycle.drain()
        assert report.placed == 3 and (await carbon(again))["jobs"] == 5
        await again.cycle.keep_ledger()
        assert json.loads(await again.store.get_state(CARBON_LEDGER_STATE))["jobs"] == 5
    finally:
        await again.stop()


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


@pytest.mark.parametrize("doc", ['{"v": 1, "jobs": -1, "energy_kwh": 0, "grams": 0, "agnostic_grams": 0, "moved": 0}',
                                 '{"v": 1, "jobs": 1}', "not json", '{"v": 2}'])
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
    finally:
        await b.stop()
    real, failed = SQLiteStore.get_state, []

    async def flaky(self, name):  # noqa: ANN001, ANN202
        if name == CARBON_LEDGER_STATE and not failed:
            failed.append(name)
            raise StoreError("cannot use PostgreSQL: ConnectionResetError: connection reset by peer")
        return await real(self, name)

    monkeypatch.setattr(SQLiteStore, "get_state", flaky)
    again, clock = await green_broker(tmp_path, SITES, profiles={"default": "green"})
    try:
        assert failed and await carbon(again) == before
        await again.book.submit(job(name="c", count=2, duration_s=3600))
        await again.cycle.run_once(full=True)
        await clock.advance(FAST.dispatch_delay_s)
        await again.cycle.drain()
        await again.cycle.keep_ledger()
        assert json.loads(await again.store.get_state(CARBON_LEDGER_STATE))["jobs"] == 5
    finally:
        await again.stop()
