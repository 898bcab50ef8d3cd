"""Moving running work in the live cycle (profiles with ``migrate``; ``policies.migration``): the broker asks
a site to checkpoint and stop a running job, the site's ``preempted`` event requeues it with its progress
kept, and the next pass restarts it where the move chose; and room made for a job near its users.

Two simulated sites with the shipped June 2022 carbon data: ``clean`` on Ontario's grid (CA-ON, mostly
hydro and nuclear) and ``dirty`` on Tokyo's (JP-TK, mostly gas and coal), 8 A100s each, starting a job a
second after it is dispatched. The clock is manual: each step advances it, then lets the sites' events in.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta

import pytest
from prometheus_client import generate_latest

from broker.clock import ManualClock
from broker.cycle import MOVES_STATE
from broker.models import JobState, SimulatedAdapterConfig
from broker.service import Broker
from policies import explain
from policies.snapshot import JobRequest
from tests.builders import job, site
from tests.test_timeshift import GREEN_AT, green_broker, restoring

FAST = SimulatedAdapterConfig(dispatch_delay_s=1.0)


LIVE_SITES = [site("clean", region="gcp:northamerica-northeast2", grid_zone="CA-ON", timezone="America/Toronto",
                   adapter=FAST, rtt_ms={"gcp:northamerica-northeast2": 2.0}),
              site("dirty", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=FAST,
                   rtt_ms={"gcp:northamerica-northeast2": 160.0})]


@pytest.fixture
async def live(tmp_path):
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    yield b, clock
    await b.stop()


async def step(b: Broker, clock: ManualClock, seconds: float) -> None:
    """As tests/test_cycle.py's Harness: the clock, then the sites' events and the store's writes."""
    await clock.advance(seconds)
    for _ in range(3):
        await asyncio.sleep(0.05)
        await b.cycle.drain()


async def decision(b: Broker, job_id: str):
    stored = await b.store.get_decision(job_id)
    spec = (await b.book.get(job_id)).spec
    return explain.render(stored.record, JobRequest.from_spec(job_id, spec), b.cycle.filters, stored.attempt)


async def started_at_the_dirty_site(b: Broker, clock: ManualClock):
    """The clean site full for half an hour (a blocker), so a ten-hour checkpointable job (the mover)
    starts at the dirty one. Returns both jobs as submitted."""
    blocker, _ = await b.book.submit(job(name="blocker", count=8, duration_s=1800))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    mover, _ = await b.book.submit(job(name="mover", count=8, duration_s=10 * 3600, checkpointable=True))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    return blocker, mover


async def test_a_checkpointable_job_started_at_the_dirty_site_moves_to_the_clean_one_once_it_has_room(live) -> None:
    b, clock = live
    blocker, mover = await started_at_the_dirty_site(b, clock)
    started = await b.book.get(mover.id)
    assert (started.state, started.site, started.attempt) == (JobState.RUNNING, "dirty", 1)
    assert (await b.book.get(blocker.id)).site == "clean"
    # Passes within the hour move nothing (moves that save are looked for once an hour).
    await step(b, clock, 1800)
    await b.cycle.run_once(full=True)
    assert (await b.book.get(blocker.id)).state == JobState.SUCCEEDED
    assert (await b.book.get(mover.id)).site == "dirty"
    # The next hour's first full pass asks the dirty site to checkpoint and stop it; its event requeues it
    # with the work done kept, and the next pass restarts it at the clean site, from its checkpoint.
    await step(b, clock, 3600 - (clock.now() - GREEN_AT.replace(minute=0)).total_seconds() % 3600)
    ran_s = (clock.now() - started.updated_at).total_seconds()
    await b.cycle.run_once(full=True)
    await step(b, clock, 1.0)
    requeued = await b.book.get(mover.id)
    assert requeued.state == JobState.QUEUED and requeued.run_s == pytest.approx(ran_s, abs=2.0)
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    moved = await b.book.get(mover.id)
    assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "clean", 2)
    why = await decision(b, mover.id)
    assert why.site == "clean"
    assert why.summary.startswith("placed on clean (a100-80gb, score ")
    assert "moved from dirty to clean from its checkpoint because carbon forecast for the rest of its run" in why.summary
    history = [e["reason"] for e in await b.store.job_events(mover.id)]
    assert any(r and r.startswith("preempted on dirty: moved from dirty to clean") for r in history), history
    scraped = generate_latest(b.metrics.registry).decode()
    assert 'heliotrope_moves_total{site="dirty",why="saving"} 1.0' in scraped
    # It finishes at the clean site after the rest of its run, not the whole of it again.
    await step(b, clock, 10 * 3600 - ran_s - 60)
    assert (await b.book.get(mover.id)).state == JobState.RUNNING
    await step(b, clock, 120)
    assert (await b.book.get(mover.id)).state == JobState.SUCCEEDED


async def filled_then_urgent(b: Broker, clock: ManualClock):
    """A ten-hour checkpointable job (the filler) fills the clean site (the cleanest, so green's choice); then
    a job 2 ms from it (160 ms from the other) that must start within the hour to meet its deadline (near)
    is submitted. Returns both jobs as submitted."""
    filler, _ = await b.book.submit(job(name="filler", count=8, duration_s=10 * 3600, checkpointable=True))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    assert (await b.book.get(filler.id)).site == "clean"
    near, _ = await b.book.submit(job(name="near", count=8, duration_s=3600, origin_region="gcp:northamerica-northeast2",
                                      latency_slo_ms=50.0, deadline=clock.now() + timedelta(hours=2)))
    return filler, near


async def test_room_is_made_at_the_only_site_near_a_job_that_can_wait_no_longer_and_kept_for_it(live) -> None:
    b, clock = live
    filler, near = await filled_then_urgent(b, clock)
    await b.cycle.run_once(full=True)  # no room: the filler is asked to move out, to the dirty site
    await step(b, clock, 1.0)
    assert (await b.book.get(filler.id)).state == JobState.QUEUED
    # A job of higher priority that could run anywhere arrives meanwhile: the room made is not its to take,
    # nor is the dirty site, where the filler is to restart.
    grabber, _ = await b.book.submit(job(name="grabber", count=8, duration_s=3600, priority=10))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    placed, moved = await b.book.get(near.id), await b.book.get(filler.id)
    assert (placed.state, placed.site) == (JobState.RUNNING, "clean")
    assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "dirty", 2) and moved.run_s > 0
    assert (await b.book.get(grabber.id)).state == JobState.QUEUED
    why = await decision(b, filler.id)
    assert f"to make room for {near.id}, which must run near its users and can wait no longer" in why.summary
    scraped = generate_latest(b.metrics.registry).decode()
    assert 'heliotrope_moves_total{site="clean",why="room"} 1.0' in scraped


async def test_a_job_in_the_way_with_nowhere_to_go_waits_in_the_queue_off_the_room_it_made(live) -> None:
    b, clock = live
    # The dirty site is full for ten hours with work that cannot move; the clean one with a checkpointable
    # job. Room for the job near its users is made by putting that job back in the queue, from its
    # checkpoint: it may not take that room back, and waits.
    await b.book.submit(job(name="stuck", count=8, duration_s=10 * 3600, allowed_regions=["gcp:asia-northeast1"]))
    filler, near = await filled_then_urgent(b, clock)
    for _ in range(3):
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
    assert ((await b.book.get(near.id)).state, (await b.book.get(near.id)).site) == (JobState.RUNNING, "clean")
    waiting = await b.book.get(filler.id)
    assert waiting.state == JobState.QUEUED and waiting.run_s > 0
    assert [e["reason"] for e in await b.store.job_events(filler.id)][-2].startswith(
        f"preempted on clean: stopped on clean and requeued from its checkpoint to make room for {near.id}")
    # Once the job near its users is done, the room is the filler's again, and it resumes from its checkpoint.
    await step(b, clock, 3600)
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    back = await b.book.get(filler.id)
    assert (back.state, back.site, back.attempt) == (JobState.RUNNING, "clean", 2)


async def test_a_job_that_is_not_checkpointable_is_never_moved(live) -> None:
    b, clock = live
    await b.book.submit(job(name="blocker", count=8, duration_s=1800))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    stays, _ = await b.book.submit(job(name="stays", count=4, duration_s=10 * 3600))
    goes, _ = await b.book.submit(job(name="goes", count=4, duration_s=10 * 3600, checkpointable=True))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    assert {(await b.book.get(j.id)).site for j in (stays, goes)} == {"dirty"}
    for _ in range(3):
        await step(b, clock, 3600)
        await b.cycle.run_once(full=True)
        await step(b, clock, 1.0)
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
    kept, moved = await b.book.get(stays.id), await b.book.get(goes.id)
    assert (kept.state, kept.site, kept.attempt) == (JobState.RUNNING, "dirty", 1)
    assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "clean", 2)


async def test_a_site_that_cannot_stop_the_job_keeps_it_running_and_says_why(live, caplog) -> None:
    from adapters.base import AdapterError

    b, clock = live
    _, mover = await started_at_the_dirty_site(b, clock)

    async def refuse(job_id: str, attempt: int, reason: str) -> None:
        raise AdapterError("site dirty: the cluster is unreachable")

    b.federation.get("dirty").adapter.preempt = refuse
    await step(b, clock, 3600)
    await b.cycle.run_once(full=True)
    await step(b, clock, 1.0)
    kept = await b.book.get(mover.id)
    assert (kept.state, kept.site, kept.attempt) == (JobState.RUNNING, "dirty", 1)
    assert f"job {mover.id}: dirty could not stop it to move it (site dirty: the cluster is unreachable)" in caplog.text
    assert not b.cycle._moving  # not left waiting for an event that will not come: tried again next hour


async def test_room_half_made_stays_kept_while_the_rest_of_it_is_being_freed(live) -> None:
    b, clock = live
    # Two 4-GPU checkpointable jobs fill the clean site; the job near its users needs all 8. Both are asked to
    # move out, but the second takes its time to checkpoint: the 4 GPUs the first freed stay kept for the job
    # near its users, and a small job that could use them is not given them.
    fillers = [(await b.book.submit(job(name=f"filler-{i}", count=4, duration_s=10 * 3600, checkpointable=True)))[0]
               for i in range(2)]
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    assert {(await b.book.get(f.id)).site for f in fillers} == {"clean"}
    clean = b.federation.get("clean").adapter
    stop_now = clean.preempt
    slow = asyncio.Event()

    async def checkpoint_slowly(job_id: str, attempt: int, reason: str) -> None:
        if job_id == fillers[1].id:
            await slow.wait()
        await stop_now(job_id, attempt, reason)

    clean.preempt = checkpoint_slowly
    near, _ = await b.book.submit(job(name="near", count=8, duration_s=3600, origin_region="gcp:northamerica-northeast2",
                                      latency_slo_ms=50.0, deadline=clock.now() + timedelta(hours=2)))
    await b.cycle.run_once(full=True)  # both asked to move; only the first has stopped
    await asyncio.sleep(0.1)
    small, _ = await b.book.submit(job(name="small", count=2, duration_s=3600))
    await b.cycle.run_once(full=True)
    await asyncio.sleep(0.1)
    assert (await b.book.get(small.id)).site != "clean" and (await b.book.get(near.id)).state == JobState.QUEUED
    slow.set()  # the second has checkpointed: the room is whole, and the job near its users gets it
    await asyncio.sleep(0.1)
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    placed = await b.book.get(near.id)
    assert (placed.state, placed.site) == (JobState.RUNNING, "clean")


async def test_a_broker_that_takes_charge_keeps_the_moves_in_flight_and_the_room_they_made(tmp_path) -> None:
    # The broker in charge asks the clean site to move the filler out for the job near its users, then
    # stops before either restarts. The broker that takes charge from the same database restarts the filler
    # where its move chose and keeps the room made for the near job: the job of higher priority that arrives
    # meanwhile takes neither.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        filler, near = await filled_then_urgent(b, clock)
        await b.cycle.run_once(full=True)  # no room: the filler is asked to move out, to the dirty site
        await step(b, clock, 1.0)
        assert (await b.book.get(filler.id)).state == JobState.QUEUED
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        await clock.advance(2.0)  # the new broker's clock starts at GREEN_AT again: within the move's time
        stored = json.loads(await again.store.get_state(MOVES_STATE))
        assert set(stored["moving"]) == {filler.id} and set(stored["holds"]) == {filler.id, near.id}
        grabber, _ = await again.book.submit(job(name="grabber", count=8, duration_s=3600, priority=10))
        await again.cycle.run_once(full=True)
        await step(again, clock, 2.0)
        placed, moved = await again.book.get(near.id), await again.book.get(filler.id)
        assert (placed.state, placed.site) == (JobState.RUNNING, "clean")
        assert (moved.state, moved.site) == (JobState.RUNNING, "dirty") and moved.run_s > 0
        assert (await again.book.get(grabber.id)).state == JobState.QUEUED
        why = await decision(again, filler.id)
        assert f"to make room for {near.id}, which must run near its users and can wait no longer" in why.summary
        # Both restarted: at the next pass nothing is in flight any more, and the store says so.
        await again.cycle.run_once(full=True)
        assert json.loads(await again.store.get_state(MOVES_STATE)) == {"moving": {}, "holds": {}, "cannot_stop": {},
                                                                       "delivered": []}
    finally:
        await again.stop()


@pytest.mark.parametrize("doc", ["not json", "[]", "null", "5", '{"moving": []}', '{"holds": {}}'])
async def test_stored_moves_that_cannot_be_read_are_ignored_with_a_warning(tmp_path, caplog, doc) -> None:
    async with restoring(tmp_path, LIVE_SITES, MOVES_STATE, doc) as b:
        assert "ignoring the stored moves in flight" in caplog.text
        await b.cycle.run_once(full=True)
        assert not b.cycle._moving and not b.cycle._holds


@pytest.mark.parametrize("hold", [{"model": 999}, {"model": 1}, {"duration_s": "nan"}, {"duration_s": -5},
                                  {"until_ts": "inf"}, {"attempt": True}, {"site": 5}],
                         ids=["an index out of range", "a model by index, not by id", "a NaN run", "a negative run",
                              "no end", "a boolean attempt", "a site that is not a name"])
async def test_a_stored_hold_with_a_bad_value_is_dropped_and_the_others_taken_up(tmp_path, caplog, hold) -> None:
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        bad, _ = await b.book.submit(job(name="bad", count=2, duration_s=3600))
        good, _ = await b.book.submit(job(name="good", count=8, duration_s=3600))
        until = clock.now().timestamp() + 600
        ok = {"site": "clean", "model": "a100-80gb", "duration_s": 3600.0, "attempt": 0, "until_ts": until}
        await b.store.put_state(MOVES_STATE, json.dumps({
            "moving": {}, "holds": {bad.id: {**ok, **hold}, good.id: ok},
            "cannot_stop": {"dirty": 1e308, "clean": "soon"}}))
        await b.cycle.restore_learned()
        report = await b.cycle.run_once(full=True)  # passes go on
        assert f"ignoring a stored hold for job {bad.id}" in caplog.text
        assert set(b.cycle._holds) == {good.id} and (await b.book.get(good.id)).site == "clean"
        assert report.placed == 2
        # A site's time out of moves is bounded by how long one is ever left out.
        assert b.cycle._cannot_stop == {"dirty": pytest.approx(clock.now().timestamp() + 3600)}
    finally:
        await b.stop()


async def test_a_stored_move_whose_job_still_runs_where_it_was_is_left_to_the_next_search(tmp_path) -> None:
    # The stop may never have reached its site (the last broker went down as it asked): the job runs on,
    # nothing is held for it or for the job it was making room for, and it is kept off the site it was
    # leaving only in case a stop on its way there does come.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        filler, near = await filled_then_urgent(b, clock)
        now = clock.now().timestamp()
        await b.store.put_state(MOVES_STATE, json.dumps({
            "moving": {filler.id: {"origin": "clean", "attempt": 1, "site": "dirty", "model": "a100-80gb",
                                   "reason": "to make room", "for_job": near.id, "asked_ts": now}},
            "holds": {filler.id: {"site": "dirty", "model": "a100-80gb", "duration_s": 36000.0, "attempt": 1,
                                  "until_ts": now + 1800},
                      near.id: {"site": "clean", "model": "a100-80gb", "duration_s": 3600.0, "attempt": 0,
                                "until_ts": now + 1800}},
            "cannot_stop": {}}))
        await b.cycle.restore_learned()
        # The pass makes room for the near job afresh (it would wait out the stale move otherwise): the filler
        # is asked to move out, and both start where that search chose.
        await b.cycle.run_once(full=True)
        assert "clean" in b.book.refused_sites(filler.id)
        await step(b, clock, 1.0)
        assert (await b.book.get(filler.id)).state == JobState.QUEUED
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        assert ((await b.book.get(near.id)).site, (await b.book.get(filler.id)).site) == ("clean", "dirty")
    finally:
        await b.stop()


async def test_a_move_whose_stop_the_broker_never_heard_of_keeps_the_work_done_after_a_restart(tmp_path) -> None:
    # The clean site stops the filler as asked, but its `preempted` event never reaches the broker, which goes
    # down first. The broker that takes charge finds the attempt gone from the site: the stop its last leader
    # asked for (the moves in flight it kept) says the job was checkpointed then, so it keeps the half hour it
    # ran and restarts where the move chose, rather than starting over as a lost attempt does.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        clean = b.federation.members["clean"].adapter
        stop = clean.preempt

        async def stop_then_lose_the_link(job_id: str, attempt: int, reason: str) -> None:
            await stop(job_id, attempt, reason)
            clean.set_reachable(False)  # its `preempted` waits for a link the broker will not see again

        clean.preempt = stop_then_lose_the_link
        filler, _ = await b.book.submit(job(name="filler", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        started = await b.book.get(filler.id)
        assert (started.state, started.site) == (JobState.RUNNING, "clean")
        await step(b, clock, 1800.0)
        near, _ = await b.book.submit(job(name="near", count=8, duration_s=3600, deadline=clock.now() + timedelta(hours=2),
                                          origin_region="gcp:northamerica-northeast2", latency_slo_ms=50.0))
        await b.cycle.run_once(full=True)  # no room: the filler is asked to move out, to the dirty site
        await step(b, clock, 1.0)
        asked_ts = b.cycle._moving[filler.id].asked_ts
        assert (await b.book.get(filler.id)).state == JobState.RUNNING  # the stop is done; the broker does not know
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        await clock.advance(2.0)
        stopped = await again.book.get(filler.id)
        assert stopped.state == JobState.QUEUED and stopped.attempt == 1
        assert 1800 < stopped.run_s <= asked_ts - started.created_at.timestamp()  # its half hour and a second
        history = [e["reason"] for e in await again.store.job_events(filler.id)]
        assert any("its end was not heard before a broker restart" in (r or "") for r in history)
        await again.cycle.run_once(full=True)
        await step(again, clock, 2.0)
        placed, moved = await again.book.get(near.id), await again.book.get(filler.id)
        assert (placed.state, placed.site) == (JobState.RUNNING, "clean")
        assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "dirty", 2)
        assert moved.run_s == stopped.run_s
    finally:
        await again.stop()


@pytest.mark.parametrize("delivered", [True, False], ids=["the site took the stop", "the stop never reached it"])
async def test_after_a_restart_only_a_stop_the_site_took_keeps_the_work_of_an_attempt_gone_from_it(
        tmp_path, delivered: bool) -> None:
    # The last broker kept a move of the filler in flight. Its attempt is gone from the clean site after the
    # restart. Where the site had taken the stop, the job keeps its run up to it; where the request never
    # reached the site, the attempt went for some other reason, with no checkpoint to trust: it starts over.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        filler, _ = await b.book.submit(job(name="filler", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 3600.0)
        running = await b.book.get(filler.id)
        assert (running.state, running.site) == (JobState.RUNNING, "clean")
        await b.store.put_state(MOVES_STATE, json.dumps({
            "moving": {filler.id: {"origin": "clean", "attempt": 1, "site": "dirty", "model": "a100-80gb",
                                   "reason": "to save carbon", "for_job": None, "asked_ts": clock.now().timestamp()}},
            "holds": {}, "cannot_stop": {}, "delivered": [filler.id] if delivered else []}))
    finally:
        await b.stop()
    again, _ = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        requeued = await again.book.get(filler.id)
        assert requeued.state == JobState.QUEUED
        if delivered:
            assert 3590 < requeued.run_s <= 3600 and requeued.reason == "requeued after preemption from its checkpoint"
        else:
            assert requeued.run_s == 0 and "lost attempt 1: the site no longer knows it" in (requeued.reason or "")
    finally:
        await again.stop()


async def test_a_job_resumed_from_its_checkpoint_is_placed_for_the_rest_of_its_run(live) -> None:
    from policies.snapshot import MODEL_INDEX, TDP_KW

    b, clock = live
    j, _ = await b.book.submit(job(name="long", count=8, duration_s=10 * 3600, checkpointable=True))
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    first = await b.book.get(j.id)
    assert first.state == JobState.RUNNING
    await step(b, clock, 9 * 3600)
    # Its site stops it (as for its own quotas) with 9 of its 10 hours done: requeued from its checkpoint.
    await b.federation.get(first.site).adapter.preempt(j.id, 1, "reclaimed by the site")
    await step(b, clock, 1.0)
    queued = await b.book.get(j.id)
    assert queued.state == JobState.QUEUED and queued.run_s == pytest.approx(9 * 3600, abs=5.0)
    before = b.cycle.carbon.energy_kwh
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    resumed = await b.book.get(j.id)
    assert (resumed.state, resumed.attempt) == (JobState.RUNNING, 2)
    # Placed (and counted in GET /v1/carbon) for the hour left and its restart (green's overhead_s, 600 s),
    # as the simulator places a job back in the queue from its checkpoint, not for the whole ten hours again.
    rest_h = (10 * 3600 - queued.run_s + 600) / 3600
    kw = 8 * float(TDP_KW[MODEL_INDEX[resumed.gpu_model]])
    assert b.cycle.carbon.energy_kwh - before == pytest.approx(kw * rest_h, rel=1e-6)


async def _a_stored_move(b: Broker, job_id: str, now: float, reason: str, delivered: bool) -> None:
    """The moves in flight as a broker going down leaves them in the store: ``job_id``'s attempt 1 asked to stop at
    clean and move to dirty at ``now`` (POSIX s), its GPUs held there for half an hour; ``delivered``: the stop
    reached the site."""
    await b.store.put_state(MOVES_STATE, json.dumps({
        "moving": {job_id: {"origin": "clean", "attempt": 1, "site": "dirty", "model": "a100-80gb",
                            "reason": reason, "for_job": None, "asked_ts": now}},
        "holds": {job_id: {"site": "dirty", "model": "a100-80gb", "duration_s": 33000.0, "attempt": 1,
                           "until_ts": now + 1800}},
        "cannot_stop": {}, "delivered": [job_id] if delivered else []}))


async def test_a_stop_the_last_broker_asked_for_keeps_its_work_after_a_restart_with_profiles_that_move_nothing(
        tmp_path) -> None:
    # The last broker (green, which moves running work) asked the clean site to stop the filler, and the site took
    # the request; the broker went down before the `preempted` event reached it. Restarted with a configuration
    # whose profiles move nothing, the broker still takes that stop for done, keeping the hour the filler ran,
    # restarts it where the move chose, and then clears the moves in flight it took up from the store.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        filler, _ = await b.book.submit(job(name="filler", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 3600.0)
        assert ((await b.book.get(filler.id)).state, (await b.book.get(filler.id)).site) == (JobState.RUNNING, "clean")
        now = clock.now().timestamp()
        await _a_stored_move(b, filler.id, now, "to save carbon", delivered=True)
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "balanced", "job_may_choose": []})
    try:
        assert not again.cycle._migrating
        requeued = await again.book.get(filler.id)
        assert requeued.state == JobState.QUEUED
        assert 3590 < requeued.run_s <= 3600 and requeued.reason == "requeued after preemption from its checkpoint"
        await clock.advance(2.0)
        await again.cycle.run_once(full=True)
        await step(again, clock, 2.0)
        moved = await again.book.get(filler.id)
        assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "dirty", 2)
        assert moved.run_s == requeued.run_s
        await again.book.submit(job(name="next", count=1, duration_s=3600))
        await again.cycle.run_once(full=True)  # the next pass that decides anything finds the move over
        assert json.loads(await again.store.get_state(MOVES_STATE)) == {"moving": {}, "holds": {}, "cannot_stop": {},
                                                                       "delivered": []}
    finally:
        await again.stop()


async def test_a_move_whose_job_fails_on_its_own_meanwhile_is_over_and_its_restart_is_not_called_a_move(live) -> None:
    # The dirty site takes its time to checkpoint the mover, and the job fails there meanwhile (its own error).
    # Nothing was checkpointed for the move: the job is placed again as any other job (it may go back to dirty),
    # from the work it had kept (none), and its decision does not say it was moved from its checkpoint.
    from adapters.base import EventKind, JobEvent

    b, clock = live
    _, mover = await started_at_the_dirty_site(b, clock)
    dirty = b.federation.get("dirty").adapter
    stop_now = dirty.preempt
    slow = asyncio.Event()

    async def checkpoint_slowly(job_id: str, attempt: int, reason: str) -> None:
        await slow.wait()
        await stop_now(job_id, attempt, reason)

    dirty.preempt = checkpoint_slowly
    await step(b, clock, 3600)
    await b.cycle.run_once(full=True)  # the hour's moves: the mover is asked to move to the clean site
    assert b.cycle._moving[mover.id].site == "clean" and mover.id in b.cycle._holds
    await dirty.cancel(mover.id, 1)
    dirty._emit(JobEvent(mover.id, 1, EventKind.FAILED, clock.now(), reason="out of memory", run_s=3600.0))
    await asyncio.sleep(0.1)
    failed = await b.book.get(mover.id)
    assert (failed.state, failed.failed_attempts, failed.run_s) == (JobState.QUEUED, 1, 0.0)
    assert mover.id not in b.cycle._moving and mover.id not in b.cycle._holds
    assert "dirty" not in b.book.refused_sites(mover.id)
    slow.set()
    await b.cycle.run_once(full=True)
    await step(b, clock, 2.0)
    again = await b.book.get(mover.id)
    assert (again.state, again.attempt, again.run_s) == (JobState.RUNNING, 2, 0.0)
    assert "moved from" not in (await decision(b, mover.id)).summary


async def test_a_stored_move_whose_attempt_was_lost_rather_than_stopped_is_not_taken_up(tmp_path) -> None:
    # The last broker asked the clean site to stop the filler, but the request never reached it; after the restart
    # the site no longer knows the attempt (lost, with nothing checkpointed): the job starts over, placed as any
    # other, and its decision does not say it was moved from its checkpoint.
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        filler, _ = await b.book.submit(job(name="filler", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 3600.0)
        now = clock.now().timestamp()
        await _a_stored_move(b, filler.id, now, "moved from clean to dirty from its checkpoint to save carbon",
                             delivered=False)
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"})
    try:
        lost = await again.book.get(filler.id)
        assert (lost.state, lost.run_s) == (JobState.QUEUED, 0.0)
        await clock.advance(2.0)
        await again.cycle.run_once(full=True)
        await step(again, clock, 2.0)
        placed = await again.book.get(filler.id)
        assert (placed.state, placed.attempt, placed.run_s) == (JobState.RUNNING, 2, 0.0)
        assert "moved from" not in (await decision(again, filler.id)).summary
    finally:
        await again.stop()


async def test_a_job_of_a_tenant_at_its_federation_limit_still_moves_to_the_clean_site(tmp_path) -> None:
    """``broker.tenant_limits``: the mover's tenant holds as many GPUs as its limit allows, all of them the mover's
    own, which it gives back as it moves: the move takes it no further past the limit, so it is made as without
    one (the limit judged the move as a job more of the tenant's starting: it held every running job of a tenant
    at its limit where it was)."""
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"},
                                  tenant_limits={"t1": {"gpus": 8}})
    try:
        blocker, _ = await b.book.submit(job(tenant="t2", name="blocker", count=8, duration_s=1800))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        mover, _ = await b.book.submit(job(name="mover", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        assert (await b.book.get(mover.id)).site == "dirty"
        await step(b, clock, 1800)
        await b.cycle.run_once(full=True)
        assert (await b.book.get(blocker.id)).state == JobState.SUCCEEDED
        await step(b, clock, 3600 - (clock.now() - GREEN_AT.replace(minute=0)).total_seconds() % 3600)
        await b.cycle.run_once(full=True)
        await step(b, clock, 1.0)
        assert (await b.book.get(mover.id)).state == JobState.QUEUED  # stopped at the dirty site to move
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        moved = await b.book.get(mover.id)
        assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "clean", 2)
    finally:
        await b.stop()


async def test_a_moved_job_keeps_its_tenants_room_until_it_restarts_where_its_move_chose(tmp_path) -> None:
    """``broker.tenant_limits``: the mover's tenant is at its limit with the mover alone, and another of its jobs
    (of a higher priority: decided first) waits for room. Stopped to move, the mover is back in the queue; the room
    under its tenant's limit is kept for it with the GPUs at its target, so it restarts there: the waiting job took
    that room, and the move, made to save carbon, left the mover waiting in the queue instead."""
    b, clock = await green_broker(tmp_path, LIVE_SITES, profiles={"default": "green"},
                                  tenant_limits={"t1": {"gpus": 8}})
    try:
        blocker, _ = await b.book.submit(job(tenant="t2", name="blocker", count=8, duration_s=1800))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        mover, _ = await b.book.submit(job(name="mover", count=8, duration_s=10 * 3600, checkpointable=True))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        waiting, _ = await b.book.submit(job(name="waiting", count=8, duration_s=600, priority=1))
        await b.cycle.run_once(full=True)
        await step(b, clock, 1800)
        await b.cycle.run_once(full=True)
        assert (await b.book.get(blocker.id)).state == JobState.SUCCEEDED
        assert (await b.book.get(waiting.id)).state == JobState.QUEUED  # t1 holds 8: the mover's
        await step(b, clock, 3600 - (clock.now() - GREEN_AT.replace(minute=0)).total_seconds() % 3600)
        await b.cycle.run_once(full=True)
        await step(b, clock, 1.0)
        assert (await b.book.get(mover.id)).state == JobState.QUEUED  # stopped at the dirty site to move
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        moved = await b.book.get(mover.id)
        assert (moved.state, moved.site, moved.attempt) == (JobState.RUNNING, "clean", 2)
        assert (await b.book.get(waiting.id)).state == JobState.QUEUED
    finally:
        await b.stop()


async def test_a_job_running_into_dirty_hours_is_paused_and_resumed_from_its_checkpoint_when_the_grid_is_clean(
        tmp_path) -> None:
    """One site on California's grid (CAISO: ~110 g/kWh under the afternoon sun, ~190 through the night, in the
    shipped June 2022 data). A 20-hour checkpointable job with three days of slack starts at 14:10 UTC, in the
    clean hours; as the night comes, the rest of its run is forecast far dirtier than from the next afternoon,
    so green pauses it: the site checkpoints and stops it, it goes back to the queue with its work kept, is
    deferred to the clean hours, and restarts there for the rest of its run."""
    sun = [site("cal", region="gcp:us-west2", grid_zone="US-CAL-CISO", timezone="America/Los_Angeles", adapter=FAST)]
    from policies.profiles import BUILTIN, SHIFTS

    pausing = {"weights": BUILTIN["green"], "shift": SHIFTS["green"].model_dump(), "migrate": {"pause": True}}
    b, clock = await green_broker(tmp_path, sun, at=GREEN_AT.replace(hour=14),
                                  profiles={"default": "pausing", "definitions": {"pausing": pausing}})
    try:
        long, _ = await b.book.submit(job(name="long", count=8, duration_s=20 * 3600, checkpointable=True,
                                          deadline=clock.now() + timedelta(hours=72)))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        first = await b.book.get(long.id)
        assert (first.state, first.attempt) == (JobState.RUNNING, 1)
        paused = None
        for _ in range(20):  # hour by hour, the first full pass of each
            await step(b, clock, 3600 - clock.now().timestamp() % 3600 + 1)
            await b.cycle.run_once(full=True)
            await step(b, clock, 1.0)
            paused = await b.book.get(long.id)
            if paused.state != JobState.RUNNING:
                break
        assert paused is not None and paused.state == JobState.QUEUED, "never paused"
        ran_s = paused.run_s
        assert 3600 < ran_s < 20 * 3600 - 2 * 3600  # paused with more than the 2 h a pause needs left
        history = [e["reason"] or "" for e in await b.store.job_events(long.id)]
        paused_why = next((r for r in history if r.startswith("preempted on cal: paused on cal until ")), None)
        assert paused_why is not None, history
        until = datetime.fromisoformat(paused_why.split()[7])
        assert "and requeued from its checkpoint: the next " in paused_why and until > clock.now()
        assert 'heliotrope_moves_total{site="cal",why="pause"} 1.0' in generate_latest(b.metrics.registry).decode()
        # The next pass defers the rest of its run to the clean hours it was paused for.
        await b.cycle.run_once(full=True)
        await step(b, clock, 1.0)
        assert (await b.book.get(long.id)).state == JobState.QUEUED
        why = await decision(b, long.id)
        assert why.outcome == "deferred" and why.summary.startswith("deferred until "), why.summary
        resume_at = why.deferred_until
        assert resume_at >= until and why.summary.startswith(
            f"deferred until {resume_at:%Y-%m-%dT%H:%MZ}: paused through dirty hours, it restarts no sooner than "
            f"{until:%Y-%m-%dT%H:%MZ}; planned on cal from "), why.summary
        # Decided again each hour as the forecast moves on, it restarts at a later hour, for the rest of its run.
        paused_at = clock.now()
        resumed = await b.book.get(long.id)
        while resumed.state == JobState.QUEUED and clock.now() < resume_at + timedelta(minutes=1):
            await step(b, clock, 3600 - clock.now().timestamp() % 3600 + 1)
            await b.cycle.run_once(full=True)
            await step(b, clock, 2.0)
            resumed = await b.book.get(long.id)
        assert (resumed.state, resumed.attempt, resumed.site) == (JobState.RUNNING, 2, "cal")
        assert clock.now() >= until and clock.now() - paused_at > timedelta(hours=1)
        assert resumed.run_s == pytest.approx(ran_s, abs=5.0)  # the work done before the pause is kept
    finally:
        await b.stop()


async def test_a_broker_that_takes_charge_keeps_a_pause_and_the_paused_job_on_its_own_site(tmp_path) -> None:
    """The broker in charge pauses the 20-hour job on California's grid (as above), then stops before any pass
    decides it again. The broker that takes charge from the same database still holds it to its pause: it is
    deferred, no sooner than the hour it was paused until, on the site it was paused on (a pause, unlike a move,
    does not keep the job off that site)."""
    sun = [site("cal", region="gcp:us-west2", grid_zone="US-CAL-CISO", timezone="America/Los_Angeles", adapter=FAST)]
    from policies.profiles import BUILTIN, SHIFTS

    pausing = {"weights": BUILTIN["green"], "shift": SHIFTS["green"].model_dump(), "migrate": {"pause": True}}
    profiles = {"default": "pausing", "definitions": {"pausing": pausing}}
    b, clock = await green_broker(tmp_path, sun, at=GREEN_AT.replace(hour=14), profiles=profiles)
    try:
        long, _ = await b.book.submit(job(name="long", count=8, duration_s=20 * 3600, checkpointable=True,
                                          deadline=clock.now() + timedelta(hours=72)))
        await b.cycle.run_once(full=True)
        await step(b, clock, 2.0)
        for _ in range(20):
            await step(b, clock, 3600 - clock.now().timestamp() % 3600 + 1)
            await b.cycle.run_once(full=True)
            await step(b, clock, 1.0)
            if (await b.book.get(long.id)).state != JobState.RUNNING:
                break
        assert (await b.book.get(long.id)).state == JobState.QUEUED, "never paused"
        history = [e["reason"] or "" for e in await b.store.job_events(long.id)]
        paused_why = next(r for r in history if r.startswith("preempted on cal: paused on cal until "))
        until = datetime.fromisoformat(paused_why.split()[7])
        now = clock.now()
    finally:
        await b.stop()
    again, clock = await green_broker(tmp_path, sun, at=now + timedelta(seconds=1), profiles=profiles)
    try:
        await again.cycle.run_once(full=True)
        await step(again, clock, 1.0)
        assert (await again.book.get(long.id)).state == JobState.QUEUED
        why = await decision(again, long.id)
        assert why.outcome == "deferred" and why.summary.startswith(
            f"deferred until {why.deferred_until:%Y-%m-%dT%H:%MZ}: paused through dirty hours, it restarts no sooner "
            f"than {until:%Y-%m-%dT%H:%MZ}; planned on cal from "), why.summary
    finally:
        await again.stop()
