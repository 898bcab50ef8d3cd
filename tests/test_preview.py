"""``POST /v1/preview`` (``heliotrope submit --dry-run``) decides a job at the place the queue would give it, as
Slurm's ``sbatch --test-only`` does: the queued jobs the next pass would decide before it are decided first, on a
scratch snapshot, and take their room; nothing of the broker's own state changes."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from broker import cycle as cycle_module
from broker.models import JobState
from policies import explain
from tests.builders import job, site
from tests.test_api import MINIMAL, client, register, site_body  # noqa: F401 - the API's fixture
from tests.test_cycle import FAST, make  # noqa: F401 - the harness fixture

EAST, WEST = "gcp:us-east1", "gcp:europe-west3"


def previewed(h, **spec):
    """The rendered decision a preview of ``job(**spec)`` gives now, and what it decided ahead of it."""
    req, record, ahead = h.broker.cycle.preview("preview", job(**spec))
    return explain.render(record, req, h.broker.cycle.filters, 0), ahead


def previewed_together(h, *specs):
    """(outcome, site, queued jobs decided before it, specs of the list decided before it) of each of ``specs``
    (``job`` keywords) previewed together, in the list's order."""
    out = []
    for req, record, ahead in h.broker.cycle.previews([job(duration_s=600, **spec) for spec in specs]):
        d = explain.render(record, req, h.broker.cycle.filters, 0)
        assert d.job_id == "preview"
        out.append((d.outcome, d.site, ahead.decided, ahead.listed))
    return out


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


LISTS = [
    pytest.param([], [dict(name="a", count=8), dict(name="b", count=8)],
                 [("placed", "alpha", 0, 0), ("unplaceable", None, 0, 1)], ["placed", "placed"],
                 id="two jobs that each fit alone but not together: the second waits"),
    pytest.param([], [dict(name="a", count=4), dict(name="b", count=4), dict(name="c", count=1)],
                 [("placed", "alpha", 0, 0), ("placed", "alpha", 0, 1), ("unplaceable", None, 0, 2)],
                 ["placed", "placed", "placed"],
                 id="a sweep fills the free GPUs in the file's order and the rest waits"),
    pytest.param([], [dict(name="low", count=8), dict(name="high", count=8, priority=10)],
                 [("unplaceable", None, 0, 1), ("placed", "alpha", 0, 0)], ["placed", "placed"],
                 id="a later job of higher priority comes first in the queue and takes the room"),
    pytest.param([dict(name="head", count=4, priority=5)],
                 [dict(name="low", count=4), dict(name="high", count=4, priority=10)],
                 [("unplaceable", None, 1, 1), ("placed", "alpha", 0, 0)], ["placed", "placed"],
                 id="the queue's order mixes the list with the queued jobs: high, then the queued head, then low"),
    pytest.param([dict(name="head", count=4)], [dict(name="a", count=4, priority=-1), dict(name="b", count=4)],
                 [("unplaceable", None, 1, 1), ("placed", "alpha", 1, 0)], ["placed", "placed"],
                 id="a later job of the queue's priority comes before an earlier one of lower priority"),
]


@pytest.mark.parametrize(("queued", "specs", "expected", "alone"), LISTS)
async def test_specs_previewed_together_are_decided_as_if_submitted_one_after_another(make, queued, specs, expected,
                                                                                      alone):
    """``POST /v1/preview`` of a list (``heliotrope submit --dry-run`` of a sweep): the jobs as if submitted together
    in the list's order, each decided at its place in the queue after the queued jobs and the list's jobs a pass
    would decide before it, which take their room; the answers come in the list's order."""
    h = await make(site("alpha", region=EAST, gpus={"a100-80gb": 8}, adapter=FAST))
    await h.cycle()
    for kw in queued:
        await h.submit(duration_s=600, **kw)
        await h.clock.advance(0.001)
    assert previewed_together(h, *specs) == expected
    # previewed alone, as ``submit --dry-run`` of a list did, each is shown room the others of the list take
    assert [previewed_together(h, spec)[0][0] for spec in specs] == alone


async def test_a_list_past_the_cap_decides_the_rest_of_its_jobs_in_their_order_on_what_was_left(make, monkeypatch):
    """Past ``PREVIEW_AHEAD_MAX`` queued jobs, the list's jobs still come in the queue's order among themselves,
    each taking its room from the next."""
    h = await make(site("alpha", gpus={"a100-80gb": 16}, adapter=FAST))
    await h.cycle()
    for i in range(4):
        await h.submit(name=f"q{i}", count=2, duration_s=600)
    monkeypatch.setattr(cycle_module, "PREVIEW_AHEAD_MAX", 3)
    got = h.broker.cycle.previews([job(name=n, count=c, priority=p, duration_s=600)
                                   for n, c, p in (("a", 2, 0), ("b", 2, 0), ("c", 8, 10))])
    # c (priority 10) before the queue takes 8; past the cap (3 of the 4 queued, 6 GPUs), a takes the last 2, b waits
    outcomes = [explain.render(r, req, h.broker.cycle.filters, 0).outcome for req, r, _ in got]
    assert [(o, a.decided, a.capped, a.listed) for o, (_, _, a) in zip(outcomes, got, strict=True)] == [
        ("placed", 3, True, 1), ("unplaceable", 3, True, 2), ("placed", 0, False, 0)]


async def test_each_decision_of_a_list_shows_the_sites_as_they_were_when_it_was_decided(make):
    """A job of the list that fits nowhere is shown why with the GPUs free at its turn, not with what the list's
    later jobs took after it: 8 free at alpha for the first, which needs 16; the second takes them, the third
    finds none."""
    h = await make(site("alpha", gpus={"a100-80gb": 8}, adapter=FAST))
    await h.cycle()
    got = [explain.render(record, req, h.broker.cycle.filters, 0) for req, record, _ in h.broker.cycle.previews(
        [job(name=n, count=c, duration_s=600) for n, c in (("big", 16), ("fits", 8), ("late", 8))])]
    assert [d.outcome for d in got] == ["unplaceable", "placed", "unplaceable"]
    assert [v.reasons for v in got[0].sites] == [["gpus-do-not-fit: job needs 16 GPUs of any model; 8 free"]]
    assert [v.reasons for v in got[2].sites] == [["gpus-do-not-fit: job needs 8 GPUs of any model; 0 free"]]


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
    # a list previewed together, one of them before the queue: the room it takes is the preview's alone
    assert previewed_together(h, dict(count=4), dict(count=8, priority=10)) == [
        ("unplaceable", None, 2, 1), ("placed", "alpha", 0, 0)]
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


async def test_the_api_previews_a_list_together_in_its_order_and_a_single_spec_as_before(client):
    """``POST /v1/preview`` with a JSON array: ``{"items": [...]}`` in the array's order, each job taking the room of
    those decided before it; a JSON object is answered as it always was."""
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    spec = {**MINIMAL, "gpus": {"count": 8}, "duration_s": 600}
    r = await client.post("/v1/preview", json=[spec, {**spec, "name": "second"}])
    assert r.status == 200, await r.text()
    items = (await r.json())["items"]
    assert [(p["decision"]["outcome"], p["decision"]["site"], p["ahead"], p["listed_ahead"]) for p in items] == [
        ("placed", "berlin", 0, 0), ("unplaceable", None, 0, 1)]
    assert all(p["decision"]["job_id"] == "preview" and "submitted together" in p["note"] for p in items)
    r = await client.post("/v1/preview", json=spec)  # one spec: an object, as before
    one = await r.json()
    assert r.status == 200 and set(one) == {"note", "decision", "ahead"} and one["decision"]["site"] == "berlin"
    r = await client.post("/v1/preview", json=[spec])  # a list of one: a list of one answer
    assert [p["listed_ahead"] for p in (await r.json())["items"]] == [0]
    assert (await (await client.get("/v1/jobs")).json())["items"] == []  # nothing was submitted


@pytest.mark.parametrize(("body", "status", "fields"), [
    pytest.param([MINIMAL, {**MINIMAL, "gpus": {"count": 0}}], 422, ["[1].gpus.count"],
                 id="a bad spec is named by its index"),
    pytest.param([MINIMAL, {**MINIMAL, "deadline": "2020-01-01T00:00:00Z"}], 422, ["[1].deadline"],
                 id="a deadline in the past is named by its index"),
    pytest.param([{**MINIMAL, "profile": "nope"}, MINIMAL], 422, ["[0].profile"],
                 id="a profile the federation does not have is named by its index"),
    pytest.param([MINIMAL, {**MINIMAL, "nme": "x"}], 422,
                 ["[1].nme"], id="a misspelt key is named by its index"),
    pytest.param([], 422, ["(body)"], id="an empty list"),
    pytest.param([{"tenant": "t", "name": "n", "gpus": {"count": 1}, "duration_s": 1}] * 1001, 422, ["(body)"],
                 id="more specs than a preview decides"),
    pytest.param(b"[" + json.dumps(MINIMAL).encode() + b",", 400, ["(body)"], id="malformed JSON"),
])
async def test_a_bad_list_is_refused_naming_the_spec_and_field(client, body, status, fields):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    r = await client.post("/v1/preview", data=data, headers={"Content-Type": "application/json"})
    assert r.status == status, await r.text()
    error = (await r.json())["error"]
    assert [f["field"] for f in error["fields"]] == fields
    if len(body) == 1001:
        assert "at most 1000 job specs" in error["message"]
