"""``POST /v1/preview`` (``heliotrope submit --dry-run``) decides a job at the place the queue would give it, as
Slurm's ``sbatch --test-only`` does: the queued jobs the next pass would decide before it are decided first, on a
scratch snapshot, and take their room; nothing of the broker's own state changes."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from broker import cycle as cycle_module
from broker.models import JobState
from policies import explain
from tests.builders import job, site
from tests.test_cycle import FAST, make  # noqa: F401 - the harness fixture

EAST, WEST = "gcp:us-east1", "gcp:europe-west3"


def previewed(h, **spec):
    """The rendered decision a preview of ``job(**spec)`` gives now, and what it decided ahead of it."""
    req, record, ahead = h.broker.cycle.preview("preview", job(**spec))
    return explain.render(record, req, h.broker.cycle.filters, 0), ahead


CASES = [
    pytest.param([dict(name="head", count=8)], dict(count=4), ("unplaceable", None, 1),
                 id="a queue whose head takes the only free room makes the preview wait"),
    pytest.param([dict(name="head", count=8)], dict(count=4, priority=10), ("placed", "alpha", 0),
                 id="a job of higher priority than the queue still sees the room"),
    pytest.param([dict(name="head", count=4)], dict(count=4), ("placed", "alpha", 1),
                 id="a job the head leaves room for is placed beside it"),
    pytest.param([dict(name="head", count=8, allowed_regions=[EAST])], dict(count=8), ("placed", "beta", 1),
                 id="a head that takes one site's room sends the preview to the other"),
    pytest.param([dict(name="too-big", count=16), dict(name="head", count=8)], dict(count=4),
                 ("unplaceable", None, 2), id="a job ahead that fits nowhere takes nothing, the one behind it does"),
    pytest.param([dict(name=f"w-{i}", tenant="t2", count=16) for i in range(50)] + [dict(name="head", count=8)],
                 dict(count=4), ("unplaceable", None, 2),
                 id="a group that found no site is decided once, as a pass decides it"),
]


@pytest.mark.parametrize(("queued", "spec", "expected"), CASES)
async def test_a_preview_decides_the_job_after_the_queued_jobs_a_pass_decides_before_it(make, queued, spec, expected):
    sites = [site("alpha", region=EAST, gpus={"a100-80gb": 8}, adapter=FAST)]
    if any(j.get("allowed_regions") for j in queued):
        sites.append(site("beta", region=WEST, gpus={"a100-80gb": 8}, adapter=FAST))
    h = await make(*sites)
    await h.cycle()  # the sites' reports
    for kw in queued:
        await h.submit(duration_s=600, **kw)
        await h.clock.advance(0.001)
    d, ahead = previewed(h, duration_s=600, **spec)
    assert (d.outcome, d.site, ahead.decided) == expected
    assert not ahead.capped


async def test_a_tenant_below_its_fair_share_is_previewed_before_the_queued_jobs_of_one_above_it(make):
    """The pass's order across tenants (``policies.fair_order``): tenant a used the site all yesterday, b not at
    all; b's job is decided before a's older queued one, and gets the room, where a's new one comes after it."""
    quotas = [{"tenant": "a", "burst_gpus": 8}, {"tenant": "b", "burst_gpus": 8}]  # equal weights, no guarantee
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST, quotas=quotas))
    await h.submit(tenant="a", name="burst", count=8, duration_s=10 * 3600)
    await h.cycle()
    await h.step(1.0)
    await h.step(10 * 3600)
    await h.step(3600)  # the site re-weights usage hourly
    await h.broker.cycle.run_once(full=True)  # its report with the usage
    await h.submit(tenant="a", name="a0", count=8, duration_s=600)
    d, ahead = previewed(h, tenant="b", count=8, duration_s=600)
    assert (d.outcome, d.site, ahead.decided) == ("placed", "alpha", 0)
    d, ahead = previewed(h, tenant="a", count=8, duration_s=600)
    assert (d.outcome, d.site, ahead.decided) == ("unplaceable", None, 1)


async def test_the_next_pass_does_what_the_preview_said_and_the_preview_changed_nothing(make):
    """The queue's head takes alpha's room at the next pass, as the preview said; before it, nothing the broker
    keeps moved: the queue, the decisions stored, the job events, the live events, the metrics, the placements in
    flight, the deferrals and holds."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    await h.cycle()
    waiting = await h.submit(name="waiting", count=16, duration_s=600)
    await h.cycle()  # decided once: it waits, with a decision stored
    head = await h.submit(name="head", count=8, duration_s=600)
    b, c = h.broker, h.broker.cycle

    async def state():
        return (sorted(b.book.active.queue.ids()), dict(c._deferred), dict(c._holds), dict(c._moving),
                dict(c._in_flight), dict(c._last_seen), dict(c._group_failures),
                [await b.store.get_decision(j.id) for j in (waiting, head)],
                [await h.states(j.id) for j in (waiting, head)],
                [e.id for e in b.events.recent], generate_latest(c.metrics.registry))

    before = await state()
    d, ahead = previewed(h, count=4, duration_s=600)
    assert d.outcome == "unplaceable" and ahead.decided == 2  # waiting (fits nowhere), then head (takes alpha)
    assert await state() == before
    await h.cycle()
    assert (await h.job(head.id)).state == JobState.DISPATCHING
    assert (await h.job(waiting.id)).state == JobState.QUEUED


async def test_the_api_and_the_cli_say_how_many_queued_jobs_were_decided_ahead(make):
    from broker.api import preview_note
    from broker.cli import show_decision
    from broker.models import Preview

    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    await h.cycle()
    await h.submit(name="head", count=8, duration_s=600)
    d, ahead = previewed(h, count=4, duration_s=600)
    doc = Preview(note=preview_note(ahead), decision=d, ahead=ahead.decided).model_dump(mode="json")
    assert doc["ahead"] == 1 and "at its place in the queue" in doc["note"]
    assert show_decision(doc["decision"], preview=True, ahead=doc["ahead"]).splitlines()[0].endswith(
        ", after the 1 queued job the next pass would decide before it")
    assert "ahead" not in Preview(note="n", decision=d).model_dump(mode="json")  # (an older broker's answer)


async def test_a_long_queue_is_decided_ahead_up_to_the_cap_and_the_preview_says_so(make, monkeypatch):
    """Ten thousand queued jobs of many shapes, with room for a few: the preview still answers quickly (the
    groups that found no site are decided once), and past ``PREVIEW_AHEAD_MAX`` decisions it stops and says so."""
    from broker.api import preview_note

    h = await make(site("alpha", gpus={"a100-80gb": 16}, adapter=FAST),
                   site("beta", region=WEST, gpus={"a100-80gb": 16}, adapter=FAST))
    await h.cycle()
    for i in range(10_000):
        await h.broker.book.submit(job(tenant=f"t{i % 20}", name=f"j{i}", count=1 + i % 8, priority=i % 5,
                                       duration_s=600))
    started = time.perf_counter()
    d, ahead = previewed(h, count=1, duration_s=600)
    took_s = time.perf_counter() - started
    assert d.outcome == "unplaceable" and not ahead.capped and ahead.placed > 0
    assert took_s < 2.0, took_s
    monkeypatch.setattr(cycle_module, "PREVIEW_AHEAD_MAX", 3)
    _, ahead = previewed(h, count=1, duration_s=600)
    assert ahead.decided == 3 and ahead.capped
    assert "only the first 3 jobs ahead of it were decided" in preview_note(ahead)
