"""Job dependencies (``after``, ``after_any`` and ``after_failed``, as Slurm's ``--dependency=afterok``,
``afterany`` and ``afternotok``) against a live broker with simulated sites: a pipeline runs in order, a failed or
cancelled step fails the steps after it, a step after any end runs however the one before ended, a fallback after a
failure runs only if it failed (and fails if it succeeded), submissions naming jobs that cannot be waited for are
refused, and waiting jobs keep waiting (and are released) across a restart of the broker."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from adapters.mqtt_protocol import Dispatch
from broker.api import create_app
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.jobs import JobBook
from broker.models import Job, JobSpec, JobState
from broker.service import Broker
from broker.store import open_store
from broker.store.memory import MemoryStore
from tests.builders import NOW
from tests.test_api import register, site_body, wait_for
from tests.test_auth import fed, made  # noqa: F401 (fixtures: a broker with auth on, and its tokens)
from tests.test_auth import Federation
from tests.test_cli import run, submit_file

JOB = {"tenant": "t1", "gpus": {"count": 1}, "duration_s": 0.3}


def spec(**more: Any) -> JobSpec:
    return JobSpec.model_validate({**JOB, **more})


def _settings(db: Path) -> BrokerSettings:
    return BrokerSettings(db=str(db), cycle_interval_s=0.05, shutdown_grace_s=1)


@pytest.fixture
async def client(tmp_path: Path):
    broker = Broker(_settings(tmp_path / "deps.db"))
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        c.broker = broker  # type: ignore[attr-defined]
        yield c
    await broker.stop()


async def submit(client: TestClient, name: str, **more: Any) -> dict[str, Any]:
    r = await client.post("/v1/jobs", json={**JOB, "name": name, **more})
    assert r.status == 201, await r.text()
    return await r.json()


async def get(client: TestClient, job_id: str) -> dict[str, Any]:
    r = await client.get(f"/v1/jobs/{job_id}")
    assert r.status == 200, await r.text()
    return await r.json()


async def refused(client: TestClient, body: dict[str, Any], path: str = "/v1/jobs", **kw: Any) -> dict[str, Any]:
    r = await client.post(path, json=body, **kw)
    assert r.status == 422, await r.text()
    return (await r.json())["error"]


async def test_a_pipeline_runs_in_order_each_step_waiting_for_the_one_before(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "preprocess", duration_s=1.0)
    b = await submit(client, "train", after=[a["id"]])
    c = await submit(client, "eval", after=[b["id"]])
    assert b["state"] == "queued" and b["waiting"] is True and b["spec"]["after"] == [a["id"]]
    assert b["reason"].startswith(f"waiting for job {a['id']} (") and b["reason"].endswith("to succeed (after)")
    assert "after" not in a["spec"] and "waiting" not in a  # (left out where unused)
    running = await wait_for(client, a["id"], {"running"})
    shown = await get(client, b["id"])
    assert shown["state"] == "queued" and shown["reason"] == f"waiting for job {a['id']} (running) to succeed (after)"
    assert (await get(client, c["id"]))["reason"] == f"waiting for job {b['id']} (queued) to succeed (after)"
    r = await client.get(f"/v1/jobs/{b['id']}/decision")  # no pass decided it: the answer says why
    assert r.status == 404 and f"waiting for job {a['id']} (running)" in (await r.json())["error"]["message"]

    ended = [await wait_for(client, j["id"], {"succeeded"}, timeout_s=20) for j in (a, b, c)]
    assert [e["state"] for e in ended] == ["succeeded"] * 3
    # each started only once the one before had succeeded
    assert ended[1]["started_at"] >= ended[0]["finished_at"] and ended[2]["started_at"] >= ended[1]["finished_at"]
    assert running["started_at"] < ended[1]["started_at"]
    assert "waiting" not in ended[1]


@pytest.mark.parametrize("end", ["cancelled", "failed"])
async def test_a_step_that_fails_or_is_cancelled_fails_every_step_after_it_down_the_chain(client: TestClient, end: str):
    # flaky's only GPUs are L4s, and each attempt there fails: a job asking for an L4 fails at its one attempt
    await register(client, site_body("flaky", "gcp:europe-west3", {"l4": 8},
                                     adapter={"kind": "simulated", "dispatch_delay_s": 0.005, "failure_rate": 1.0}))
    first = {"gpus": {"count": 1, "model": "l4"}, "max_attempts": 1, "duration_s": 5} if end == "failed" else {
        "gpus": {"count": 1, "model": "h100-80gb"}}  # (no site has one: it stays queued until cancelled)
    a = await submit(client, "preprocess", **first)
    b = await submit(client, "train", after=[a["id"]])
    c = await submit(client, "eval", after=[b["id"]])
    other = await submit(client, "unrelated", gpus={"count": 1, "model": "h100-80gb"})
    if end == "cancelled":
        assert (await client.delete(f"/v1/jobs/{a['id']}")).status == 200
    assert (await wait_for(client, a["id"], {end}, timeout_s=20))["state"] == end
    b_now = await wait_for(client, b["id"], {"failed"})
    assert b_now["reason"] == f"job {a['id']} it runs after was {end}; it will never run (after)"
    c_now = await wait_for(client, c["id"], {"failed"})
    assert c_now["reason"] == f"job {b['id']} it runs after was failed; it will never run (after)"
    assert b_now["attempt"] == 0 and c_now["attempt"] == 0  # never placed
    assert (await get(client, other["id"]))["state"] == "queued"  # nothing else touched

    # and a job after one that failed or was cancelled is refused at once
    error = await refused(client, {**JOB, "name": "late", "after": [a["id"]]})
    assert error["fields"] == [{"field": "after[0]", "problem": f"job {a['id']} has "
                                f"{'failed' if end == 'failed' else 'been cancelled'}: a job that runs after it would "
                                "never run"}]


async def test_a_submission_naming_jobs_it_cannot_wait_for_is_refused_naming_each(client: TestClient):
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})
    error = await refused(client, {**JOB, "name": "x", "after": [a["id"], "01nosuchjob0000000"]})
    assert error["fields"] == [{"field": "after[1]", "problem": "no job with id 01nosuchjob0000000"}]
    error = await refused(client, {**JOB, "name": "x", "after": [a["id"], a["id"]]})
    assert error["fields"][0]["field"] == "after[1]" and "named twice" in error["fields"][0]["problem"]
    error = await refused(client, {**JOB, "name": "x", "after": [a["id"]] * 65})
    assert error["fields"][0]["field"] == "after" and "64" in error["fields"][0]["problem"]
    error = await refused(client, {**JOB, "name": "x", "after": [""]})
    assert error["fields"][0]["field"].startswith("after")
    # a preview checks them too, and a list's specs are named by their place
    error = await refused(client, [JOB | {"name": "ok"}, {**JOB, "name": "x", "after": ["01nosuchjob0000000"]}],
                          "/v1/preview")
    assert error["fields"] == [{"field": "[1].after[0]", "problem": "no job with id 01nosuchjob0000000"}]
    listed = await (await client.get("/v1/jobs")).json()
    assert [j["id"] for j in listed["items"]] == [a["id"]]  # nothing was stored


async def test_a_job_after_one_that_already_succeeded_is_queued_at_once_and_runs(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "a")
    await wait_for(client, a["id"], {"succeeded"})
    b = await submit(client, "b", after=[a["id"]])
    assert "waiting" not in b and b["reason"] == "waiting for a placement"
    assert (await wait_for(client, b["id"], {"succeeded"}))["spec"]["after"] == [a["id"]]


async def test_a_preview_of_a_job_after_unfinished_ones_says_it_would_wait_for_them(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})  # (no site has one: it stays queued)
    r = await client.post("/v1/preview", json={**JOB, "name": "b", "after": [a["id"]]})
    assert r.status == 200, await r.text()
    preview = await r.json()
    assert preview["waiting_for"] == [a["id"]] and preview["decision"]["site"] is None
    assert preview["decision"]["summary"] == f"would be waiting for job {a['id']} (queued) to succeed (after)"
    assert preview["decision"]["sites"] == []
    # in a list, it takes no room from the specs after it, which are decided as usual
    r = await client.post("/v1/preview", json=[{**JOB, "name": "b", "after": [a["id"]]}, {**JOB, "name": "c"}])
    first, second = (await r.json())["items"]
    assert first["waiting_for"] == [a["id"]] and "waiting_for" not in second
    assert second["decision"]["site"] == "berlin"


async def test_a_waiting_job_can_be_changed_without_being_released_and_cancelled(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})
    b = await submit(client, "b", after=[a["id"]])
    r = await client.patch(f"/v1/jobs/{b['id']}", json={"priority": 50})
    assert r.status == 200, await r.text()
    changed = await r.json()
    assert changed["spec"]["priority"] == 50 and changed["waiting"] is True and changed["state"] == "queued"
    r = await client.patch(f"/v1/jobs/{b['id']}", json={"after": []})
    assert r.status == 422 and (await r.json())["error"]["fields"][0]["field"] == "after"
    await asyncio.sleep(0.5)  # passes run meanwhile: it stays waiting, and never reaches a site
    held = await get(client, b["id"])
    assert held["state"] == "queued" and held["waiting"] is True and held["attempt"] == 0
    assert held["reason"] == f"waiting for job {a['id']} (queued) to succeed (after)"
    r = await client.delete(f"/v1/jobs/{b['id']}")
    assert r.status == 200 and (await r.json())["state"] == "cancelled"
    assert client.broker.book.active.dependents == {}  # (the index forgets it)


async def test_a_waiting_job_does_not_hold_up_the_jobs_queued_behind_it(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})
    b = await submit(client, "b", priority=100, gpus={"count": 8}, after=[a["id"]])  # would take the whole site
    c = await submit(client, "c", gpus={"count": 8})
    assert (await wait_for(client, c["id"], {"running", "succeeded"}))["site"] == "berlin"
    assert (await get(client, b["id"]))["attempt"] == 0
    tenants = await (await client.get("/v1/tenants")).json()  # it is queued, and holds nothing
    assert tenants["items"][0]["jobs"]["queued"] == 2


async def test_another_tenants_job_is_not_found_for_a_submitter_naming_it_in_after(fed: Federation):  # noqa: F811
    status, error = await fed.call("nlp", "POST", "/v1/jobs", {
        "tenant": "nlp", "name": "x", "gpus": {"count": 1}, "duration_s": 60, "after": [fed.jobs["vision_job"]]})
    assert status == 422
    assert error["error"]["fields"] == [{"field": "after[0]", "problem": f"no job with id {fed.jobs['vision_job']}"}]
    status, _ = await fed.call("nlp", "GET", "/v1/jobs/{vision_job}")
    assert status == 404  # as the job itself is answered
    status, created = await fed.call("vision", "POST", "/v1/jobs", {
        "tenant": "vision", "name": "x", "gpus": {"count": 1}, "duration_s": 60, "after": [fed.jobs["vision_job"]]})
    assert status == 201 and created["waiting"] is True
    status, created = await fed.call("admin", "POST", "/v1/jobs", {
        "tenant": "nlp", "name": "x", "gpus": {"count": 1}, "duration_s": 60, "after": [fed.jobs["vision_job"]]})
    assert status == 201 and created["waiting"] is True  # (an admin sees every job)


async def test_waiting_jobs_keep_waiting_across_a_restart_and_are_released_when_their_dependency_succeeds(
        tmp_path: Path):
    settings = _settings(tmp_path / "restart.db")
    broker = Broker(settings)
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        a = await submit(c, "a")  # (no site yet: it stays queued)
        b = await submit(c, "b", after=[a["id"]])
        d = await submit(c, "d", after=[b["id"]])
    await broker.stop()

    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            for job in (b, d):
                again = await get(c, job["id"])
                assert again["state"] == "queued" and again["waiting"] is True
            assert b["id"] not in broker.book.active.queue and b["id"] in broker.book.active.dependents[a["id"]]
            await register(c, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
            ended = [await wait_for(c, j["id"], {"succeeded"}, timeout_s=20) for j in (a, b, d)]
            assert ended[1]["started_at"] >= ended[0]["finished_at"]
            assert ended[2]["started_at"] >= ended[1]["finished_at"]
    finally:
        await broker.stop()


async def _end_while_no_broker_runs(settings, job_id: str, end: str) -> None:
    """End ``job_id`` in the store as another broker sharing the database would (``end``: its state), or, with
    "deleted", succeed it and delete it as ``broker.job_retention_h`` does."""
    store = open_store(settings.db)
    await store.open()
    try:
        job = await store.get_job(job_id)
        assert job is not None
        state = JobState.SUCCEEDED if end == "deleted" else JobState(end)
        await store.update_job(job.model_copy(update={"state": state, "version": job.version + 1,
                                                      "finished_at": job.created_at}), job.version)
        if end == "deleted":
            assert await store.prune_ended(datetime.now(UTC), 10) == [job_id]
    finally:
        await store.close()


@pytest.mark.parametrize("end", ["succeeded", "cancelled", "deleted"])
async def test_a_dependency_that_ended_while_no_broker_ran_is_acted_on_at_the_start(tmp_path: Path, end: str):
    settings = _settings(tmp_path / "down.db")
    broker = Broker(settings)
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        a = await submit(c, "a")
        b = await submit(c, "b", after=[a["id"]])
    await broker.stop()

    # Meanwhile another broker sharing the database ended it (or the retention deleted it once it had ended)
    await _end_while_no_broker_runs(settings, a["id"], end)

    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            if end == "succeeded":
                released = await _until(c, b["id"], lambda j: "waiting" not in j)
                assert released["reason"] == f"waiting for a placement: job {a['id']} it runs after succeeded (after)"
                await register(c, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
                await wait_for(c, b["id"], {"succeeded"})
            else:
                failed = await wait_for(c, b["id"], {"failed"})
                if end == "cancelled":
                    assert failed["reason"] == f"job {a['id']} it runs after was cancelled; it will never run (after)"
                else:
                    assert failed["reason"].startswith(f"job {a['id']} it runs after is no longer in the store")
    finally:
        await broker.stop()


async def _until(client: TestClient, job_id: str, ok: Any, timeout_s: float = 10) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        job = await get(client, job_id)
        if ok(job):
            return job
        assert loop.time() < deadline, f"job {job_id} stayed {job}"
        await asyncio.sleep(0.02)


async def _follower_and_leader() -> tuple[MemoryStore, JobBook, JobBook]:
    """A store and two books on it: a replica that does not lead (it only stores what it is sent) and the
    leader."""
    store = MemoryStore()
    await store.open()
    follower, leader = JobBook(store, ManualClock(NOW)), JobBook(store, ManualClock(NOW))
    follower.tracking = False
    await leader.load()
    return store, follower, leader


async def test_a_waiting_job_another_replica_accepted_is_held_by_the_leader_and_released_when_its_dependency_ends(
        ) -> None:
    # A replica that does not lead only stores what it is sent; the leader takes it in by pull_new (or take_in)
    store, follower, leader = await _follower_and_leader()
    a, _ = await leader.submit(spec(name="a"))
    b, _ = await follower.submit(spec(name="b", after=[a.id]))
    c, _ = await follower.submit(spec(name="c", after=[b.id]))
    assert b.waiting and b.reason == f"waiting for job {a.id} (queued) to succeed (after)"
    assert await leader.pull_new() == 2
    assert [j.id for j in leader.take_fresh()] == [a.id]  # the waiting ones are no work for a pass
    assert a.id in leader.active.queue and b.id not in leader.active.queue and c.id not in leader.active.queue
    assert leader.active.dependents == {a.id: {b.id}, b.id: {c.id}}

    await leader.transition(a.id, JobState.DISPATCHING, site="s")
    await leader.transition(a.id, JobState.ADMITTED)
    await leader.transition(a.id, JobState.SUCCEEDED)
    assert await leader.settle_waiting() == 1
    assert b.id in leader.active.queue and c.id not in leader.active.queue
    assert [j.id for j in leader.take_fresh()] == [b.id]
    stored_b = await store.get_job(b.id)
    assert stored_b is not None and not stored_b.waiting  # released durably: a new leader will not hold it again
    await leader.transition(b.id, JobState.CANCELLED)
    assert await leader.settle_waiting() == 1
    stored_c = await store.get_job(c.id)
    assert stored_c is not None and stored_c.state == JobState.FAILED
    assert stored_c.reason == f"job {b.id} it runs after was cancelled; it will never run (after)"
    assert leader.active.dependents == {} and await leader.settle_waiting() == 0


async def test_a_new_leader_releases_a_job_whose_dependency_the_old_one_saw_succeed_just_before_it_stopped() -> None:
    store = MemoryStore()
    await store.open()
    old = JobBook(store, ManualClock(NOW))
    await old.load()
    a, _ = await old.submit(spec(name="a"))
    b, _ = await old.submit(spec(name="b", after=[a.id]))
    await old.transition(a.id, JobState.DISPATCHING, site="s")
    await old.transition(a.id, JobState.ADMITTED)
    await old.transition(a.id, JobState.SUCCEEDED)  # ... and it stopped leading before it settled b
    new = JobBook(store, ManualClock(NOW))
    await new.load()
    assert b.id not in new.active.queue
    assert await new.settle_waiting() == 1
    assert b.id in new.active.queue and not new.active[b.id].waiting


async def test_a_retry_with_its_idempotency_key_gets_the_job_back_after_its_dependency_was_cancelled(
        client: TestClient):
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})
    body = {**JOB, "name": "b", "after": [a["id"]]}
    first = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "pipeline-b"})
    assert first.status == 201
    b = await first.json()
    assert (await client.delete(f"/v1/jobs/{a['id']}")).status == 200
    await wait_for(client, b["id"], {"failed"})
    again = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "pipeline-b"})
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert (await again.json())["id"] == b["id"]
    assert (await refused(client, body))["fields"][0]["field"] == "after[0]"  # without the key: a new job, refused


def test_the_cli_submits_after_from_the_yaml_and_shows_what_a_job_waits_for(capsys, server, tmp_path: Path):
    code, out, err = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, name="pre", duration_s=600)))
    assert code == 0, err
    first = json.loads(out)["id"]
    code, out, err = run(capsys, server, "submit", "--dry-run", str(submit_file(tmp_path, name="train", after=[first])))
    assert code == 0, err
    assert f"would be waiting for job {first} (" in out
    code, out, err = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, name="train", after=[first])))
    assert code == 0, err
    second = json.loads(out)
    assert second["spec"]["after"] == [first] and second["waiting"] is True
    code, out, err = run(capsys, server, "job", second["id"])
    assert code == 0, err
    assert f"  after     {first} to succeed (after)\n" in out
    assert f"  reason    waiting for job {first} (" in out
    code, out, err = run(capsys, server, "submit", str(submit_file(tmp_path, name="x", after=["01nosuchjob0000000"])))
    assert code != 0 and "after[0]" in err and "no job with id 01nosuchjob0000000" in err and "Traceback" not in err


def test_a_dispatch_to_a_site_agent_carries_neither_after_nor_waiting() -> None:
    # (an agent of an earlier release, whose spec forbids keys it does not know, would refuse the dispatch)
    job = Job(id="01b", spec=spec(name="b", after=["01a"]), created_at=NOW, updated_at=NOW, waiting=True)
    sent = json.loads(Dispatch(msg_id="m1", site="s", job=job).model_dump_json())
    assert "after" not in sent["job"]["spec"] and "waiting" not in sent["job"]
    assert json.loads(job.model_dump_json())["spec"]["after"] == ["01a"]  # (the broker's own copy keeps them)


async def c_after_a_and_b(store: MemoryStore) -> tuple[JobBook, Job, Job, Job]:
    """A leader's book on ``store`` (opened here) holding jobs a and b, queued, and c, which runs after both."""
    await store.open()
    book = JobBook(store, ManualClock(NOW))
    await book.load()
    a, _ = await book.submit(spec(name="a"))
    b, _ = await book.submit(spec(name="b"))
    c, _ = await book.submit(spec(name="c", after=[a.id, b.id]))
    return book, a, b, c


async def succeed(book: JobBook, job_id: str) -> None:
    for state in (JobState.DISPATCHING, JobState.ADMITTED, JobState.SUCCEEDED):
        await book.transition(job_id, state, site="s")


async def test_a_job_after_two_is_released_only_once_both_succeeded_and_says_which_it_still_waits_for() -> None:
    store = MemoryStore()
    book, a, b, c = await c_after_a_and_b(store)
    assert c.reason == f"waiting for jobs {a.id} (queued), {b.id} (queued) to succeed (after)"
    await succeed(book, a.id)
    await book.settle_waiting()
    stored = await store.get_job(c.id)
    assert stored is not None and stored.waiting
    assert stored.reason == f"waiting for job {b.id} (queued) to succeed (after)"
    assert c.id not in book.active.queue
    await succeed(book, b.id)
    assert await book.settle_waiting() == 1
    assert c.id in book.active.queue
    assert book.active[c.id].reason == f"waiting for a placement: jobs {a.id}, {b.id} it runs after succeeded (after)"


async def test_a_waiting_job_cancelled_while_the_leader_reads_what_it_waits_for_does_not_cut_the_pass_short() -> None:
    # As `heliotrope cancel --label pipeline=x` does: the first step's end is being settled, and the cancel of the
    # steps after it lands while the leader reads their dependencies' states from the store. That raised a KeyError
    # out of settle_waiting, and the scheduling cycle it ran in was skipped ("scheduling cycle failed").
    class SlowRead(MemoryStore):
        during: Any = None

        async def get_job(self, job_id: str) -> Job | None:
            if self.during is not None:
                during, self.during = self.during, None
                await during()
            return await super().get_job(job_id)

    store = SlowRead()
    book, a, b, c = await c_after_a_and_b(store)
    await succeed(book, a.id)

    async def cancel() -> None:
        await book.transition(c.id, JobState.CANCELLED, reason="cancelled by request")

    store.during = cancel  # (a's state is read from the store: it ended, so the book no longer holds it)
    assert await book.settle_waiting() == 0  # c, cancelled meanwhile, is left as it is
    assert store.during is None and (await store.get_job(c.id)).state == JobState.CANCELLED  # type: ignore[union-attr]
    assert book.active.dependents == {} and await book.settle_waiting() == 0


async def test_a_spec_of_a_previewed_list_naming_more_than_64_jobs_is_refused_naming_its_after(client: TestClient):
    # (it was answered as a list of more than 1,000 specs, naming the body: the list's own bound)
    too_many = {**JOB, "name": "x", "after": [f"job{i}" for i in range(65)]}
    error = await refused(client, [{**JOB, "name": "first"}, too_many], path="/v1/preview")
    assert [f["field"] for f in error["fields"]] == ["[1].after"]
    assert "64" in error["fields"][0]["problem"]
    assert [f["field"] for f in (await refused(client, too_many))["fields"]] == ["after"]  # as a submission is


async def test_a_retry_sent_while_the_first_submission_is_being_stored_gets_the_job_even_if_a_dependency_failed_since(
        client: TestClient, monkeypatch: pytest.MonkeyPatch):
    # The client timed out and sent the job again with its key while the first request was still on its way to the
    # store, and the job it runs after was cancelled meanwhile: the retry got a 422 (it would never run) for a job
    # that was accepted, where a retry gets the first job back (it waited for the first request's outcome).
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})  # (no site: it stays queued)
    store = client.broker.book._store  # type: ignore[attr-defined]
    inserting, go_on = asyncio.Event(), asyncio.Event()
    insert = store.insert_job

    async def slow_insert(*args: Any, **kw: Any) -> Any:
        inserting.set()
        await go_on.wait()
        return await insert(*args, **kw)

    monkeypatch.setattr(store, "insert_job", slow_insert)
    body = {**JOB, "name": "b", "after": [a["id"]]}
    headers = {"Idempotency-Key": "pipeline-b"}
    first = asyncio.ensure_future(client.post("/v1/jobs", json=body, headers=headers))
    await asyncio.wait_for(inserting.wait(), 5)
    assert (await client.delete(f"/v1/jobs/{a['id']}")).status == 200
    retry = asyncio.ensure_future(client.post("/v1/jobs", json=body, headers=headers))
    await asyncio.sleep(0.2)
    go_on.set()
    r1, r2 = await first, await retry
    assert r1.status == 201, await r1.text()
    assert r2.status == 201, await r2.text()
    assert r2.headers["Idempotent-Replayed"] == "true" and (await r2.json())["id"] == (await r1.json())["id"]
    assert (await wait_for(client, (await r1.json())["id"], {"failed"}))["reason"].endswith("will never run (after)")


async def _retaining_a_second(tmp_path: Path) -> Broker:
    """A started broker that deletes a finished job a second after it ended (``broker.job_retention_h``)."""
    broker = Broker(BrokerSettings(db=str(tmp_path / "keep.db"), cycle_interval_s=0.05, shutdown_grace_s=1,
                                   job_retention_h=1 / 3600))
    await broker.start([])
    return broker


async def test_the_retention_keeps_a_job_that_a_waiting_job_runs_after_until_the_waiting_job_is_decided(
        tmp_path: Path):
    """C runs after A and B; A succeeded past the retention, B still runs: the retention does not delete A (C
    would then fail as after a job no longer in the store, though A succeeded), and deletes it once C no longer
    waits."""
    broker = await _retaining_a_second(tmp_path)
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            await register(c, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
            a = await submit(c, "a", duration_s=0.05)
            b = await submit(c, "b", duration_s=600)
            await wait_for(c, a["id"], {"succeeded"})
            await wait_for(c, b["id"], {"running"})
            waiting = await submit(c, "c", after=[a["id"], b["id"]])
            await asyncio.sleep(1.2)  # a ended more than the retention ago
            await broker.prune_ended()
            assert (await c.get(f"/v1/jobs/{a['id']}")).status == 200  # kept: c waits for it
            b_done = await c.post(f"/v1/jobs/{b['id']}/cancel")
            assert b_done.status == 200
            job = await get(c, waiting["id"])
            for _ in range(100):  # until the leader's next pass settles it
                if job["state"] != "queued":
                    break
                await asyncio.sleep(0.02)
                job = await get(c, waiting["id"])
            assert job["state"] == "failed" and f"job {b['id']} it runs after was cancelled" in job["reason"]
            await broker.prune_ended()
            assert (await c.get(f"/v1/jobs/{a['id']}")).status == 404  # no job waits for it any more
    finally:
        await broker.stop()


# --- after_any (Slurm's afterany) and after_failed (afternotok) ---


async def _end(client: TestClient, job: dict[str, Any], end: str) -> None:
    """End ``job`` (asking for an L4 when ``end`` is failed, else for an H100, which no site here has) as ``end``."""
    if end == "cancelled":
        assert (await client.delete(f"/v1/jobs/{job['id']}")).status == 200
    assert (await wait_for(client, job["id"], {end}, timeout_s=20))["state"] == end


async def _flaky_and_berlin(client: TestClient) -> None:
    """flaky: only L4s, and each attempt there fails; berlin: A100s, where every job succeeds."""
    await register(client, site_body("flaky", "gcp:europe-west3", {"l4": 8},
                                     adapter={"kind": "simulated", "dispatch_delay_s": 0.005, "failure_rate": 1.0}))
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))


FIRST = {  # the first job, as it is to end
    "succeeded": {"gpus": {"count": 1, "model": "a100-80gb"}, "duration_s": 1.0},
    "failed": {"gpus": {"count": 1, "model": "l4"}, "max_attempts": 1, "duration_s": 1.0},
    "cancelled": {"gpus": {"count": 1, "model": "h100-80gb"}},  # (no site has one: it stays queued until cancelled)
}
ON_BERLIN = {"gpus": {"count": 1, "model": "a100-80gb"}}


@pytest.mark.parametrize("end", ["succeeded", "failed", "cancelled"])
async def test_a_job_after_any_runs_once_the_job_it_names_ended_however_it_ended(client: TestClient, end: str):
    await _flaky_and_berlin(client)
    a = await submit(client, "train", **FIRST[end])
    b = await submit(client, "report", after_any=[a["id"]], **ON_BERLIN)
    assert b["waiting"] is True and b["spec"]["after_any"] == [a["id"]] and "after" not in b["spec"]
    assert b["reason"] == f"waiting for job {a['id']} (queued) to end (after_any)"
    if end != "cancelled":  # GET gives the dependency's state as it is now
        await wait_for(client, a["id"], {"running"})
        assert (await get(client, b["id"]))["reason"] == f"waiting for job {a['id']} (running) to end (after_any)"
    await _end(client, a, end)
    released = await wait_for(client, b["id"], {"succeeded"}, timeout_s=20)
    assert released["attempt"] == 1 and "after_failed" not in released["spec"]


@pytest.mark.parametrize("end", ["failed", "cancelled"])
async def test_a_job_after_failed_runs_once_the_job_it_names_failed_or_was_cancelled(client: TestClient, end: str):
    await _flaky_and_berlin(client)
    a = await submit(client, "train", **FIRST[end])
    cleanup = await submit(client, "cleanup", after_failed=[a["id"]], **ON_BERLIN)
    assert cleanup["waiting"] is True and cleanup["spec"]["after_failed"] == [a["id"]]
    assert cleanup["reason"] == f"waiting for job {a['id']} (queued) to fail or be cancelled (after_failed)"
    await _end(client, a, end)
    assert (await wait_for(client, cleanup["id"], {"succeeded"}, timeout_s=20))["attempt"] == 1


async def test_a_job_after_failed_fails_when_the_job_it_names_succeeds_and_so_down_the_chain(client: TestClient):
    a = await submit(client, "train")  # (no site yet: every job below is submitted while it is queued)
    cleanup = await submit(client, "cleanup", after_failed=[a["id"]])
    after_cleanup = await submit(client, "after-cleanup", after=[cleanup["id"]])
    if_cleanup_fails = await submit(client, "if-cleanup-fails", after_failed=[cleanup["id"]])
    anyway = await submit(client, "anyway", after_any=[cleanup["id"]])
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    await wait_for(client, a["id"], {"succeeded"})
    failed = await wait_for(client, cleanup["id"], {"failed"})
    assert failed["reason"] == (f"job {a['id']} it runs after succeeded, and it runs only if that job fails or is "
                                "cancelled; it will never run (after_failed)")
    assert failed["attempt"] == 0  # never placed
    down = await wait_for(client, after_cleanup["id"], {"failed"})
    assert down["reason"] == f"job {cleanup['id']} it runs after was failed; it will never run (after)"
    # the failure meets the conditions of the jobs waiting for it to fail, or to end
    for job in (if_cleanup_fails, anyway):
        assert (await wait_for(client, job["id"], {"succeeded"}, timeout_s=20))["attempt"] == 1


async def test_a_job_combining_the_three_lists_is_released_only_once_every_condition_holds() -> None:
    # (submitted through a replica that does not lead: the leader takes it in and holds it)
    store, follower, leader = await _follower_and_leader()
    a, _ = await leader.submit(spec(name="a"))
    b, _ = await leader.submit(spec(name="b"))
    x, _ = await leader.submit(spec(name="x"))
    c, _ = await follower.submit(spec(name="c", after=[a.id], after_any=[b.id], after_failed=[x.id]))
    assert c.waiting and c.reason == (f"waiting for job {a.id} (queued) to succeed (after); job {b.id} (queued) to "
                                      f"end (after_any); job {x.id} (queued) to fail or be cancelled (after_failed)")
    assert await leader.take_in(c.id) is not None
    assert leader.active.dependents == {a.id: {c.id}, b.id: {c.id}, x.id: {c.id}}
    assert c.id not in leader.active.queue and [j.id for j in leader.take_fresh()] == [a.id, b.id, x.id]

    await leader.transition(x.id, JobState.CANCELLED)
    await leader.transition(b.id, JobState.FAILED)
    await leader.settle_waiting()
    held = await store.get_job(c.id)
    assert held is not None and held.waiting and held.state == JobState.QUEUED
    assert held.reason == f"waiting for job {a.id} (queued) to succeed (after)"
    assert c.id not in leader.active.queue
    await succeed(leader, a.id)
    assert await leader.settle_waiting() == 1
    assert c.id in leader.active.queue and [j.id for j in leader.take_fresh()][-1:] == [c.id]
    assert leader.active[c.id].reason == (
        f"waiting for a placement: job {a.id} it runs after succeeded (after); job {b.id} it runs after ended "
        f"(after_any); job {x.id} it runs after failed or was cancelled (after_failed)")
    assert leader.active.dependents == {}


async def test_a_submission_naming_jobs_in_after_any_or_after_failed_it_cannot_wait_for_is_refused_naming_each(
        client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    a = await submit(client, "a", gpus={"count": 1, "model": "h100-80gb"})  # (no site has one: it stays queued)
    done = await submit(client, "done")
    await wait_for(client, done["id"], {"succeeded"})
    nosuch = "01nosuchjob0000000"
    cases = [
        ({"after_any": [a["id"], done["id"], nosuch]}, "after_any[2]", f"no job with id {nosuch}"),
        ({"after_failed": [nosuch]}, "after_failed[0]", f"no job with id {nosuch}"),
        ({"after_failed": [a["id"], a["id"]]}, "after_failed[1]",
         f"job {a['id']} is named twice (also after_failed[0]); name each job once"),
        ({"after": [a["id"]], "after_any": [done["id"]], "after_failed": [a["id"]]}, "after_failed[0]",
         f"job {a['id']} is named twice (also after[0]); name each job once"),
        ({"after_failed": [done["id"]]}, "after_failed[0]",
         f"job {done['id']} has succeeded: a job that runs after it fails would never run"),
        ({"after": [f"j{i}" for i in range(30)], "after_any": [f"k{i}" for i in range(30)],
          "after_failed": [f"m{i}" for i in range(5)]}, "after_failed[4]",
         "more than 64 jobs in after, after_any and after_failed together (65); a job runs after at most 64"),
    ]
    for more, field, problem in cases:
        error = await refused(client, {**JOB, "name": "x", **more})
        assert error["fields"] == [{"field": field, "problem": problem}], more
        assert error["message"] == f"invalid job spec: {field}: {problem}"
    for kind in ("after_any", "after_failed"):  # each list alone, by the spec's own bounds
        error = await refused(client, {**JOB, "name": "x", kind: [f"j{i}" for i in range(65)]})
        assert error["fields"][0]["field"] == kind and "64" in error["fields"][0]["problem"]
        error = await refused(client, {**JOB, "name": "x", kind: [""]})
        assert error["fields"][0]["field"] == f"{kind}[0]"
    error = await refused(client, [JOB | {"name": "ok"}, {**JOB, "name": "x", "after_failed": [done["id"]]}],
                          "/v1/preview")
    assert [f["field"] for f in error["fields"]] == ["[1].after_failed[0]"]
    listed = await (await client.get("/v1/jobs")).json()
    assert sorted(j["id"] for j in listed["items"]) == sorted([a["id"], done["id"]])  # nothing else was stored


async def test_another_tenants_job_is_not_found_for_a_submitter_naming_it_in_after_any_or_after_failed(
        fed: Federation):  # noqa: F811
    for kind in ("after_any", "after_failed"):
        status, error = await fed.call("nlp", "POST", "/v1/jobs", {
            "tenant": "nlp", "name": "x", "gpus": {"count": 1}, "duration_s": 60, kind: [fed.jobs["vision_job"]]})
        assert status == 422
        assert error["error"]["fields"] == [{"field": f"{kind}[0]",
                                             "problem": f"no job with id {fed.jobs['vision_job']}"}]


async def test_conditions_already_met_at_submission_do_not_make_a_job_wait(client: TestClient):
    await register(client, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
    done = await submit(client, "done")
    gone = await submit(client, "gone", gpus={"count": 1, "model": "h100-80gb"})
    await wait_for(client, done["id"], {"succeeded"})
    await _end(client, gone, "cancelled")
    r = await client.post("/v1/preview", json={**JOB, "name": "p", "after_any": [done["id"]],
                                               "after_failed": [gone["id"]]})
    assert r.status == 200 and "waiting_for" not in (preview := await r.json())
    assert preview["decision"]["site"] == "berlin"
    b = await submit(client, "b", after_any=[done["id"], gone["id"]])
    c = await submit(client, "c", after=[done["id"]], after_failed=[gone["id"]])
    for job in (b, c):
        assert "waiting" not in job and job["reason"] == "waiting for a placement"
        assert (await wait_for(client, job["id"], {"succeeded"}))["attempt"] == 1


async def test_a_preview_of_a_job_after_any_or_after_failed_unfinished_ones_says_it_would_wait(client: TestClient):
    a = await submit(client, "a")  # (no site: it stays queued)
    b = await submit(client, "b")
    r = await client.post("/v1/preview", json={**JOB, "name": "p", "after_any": [a["id"]], "after_failed": [b["id"]]})
    assert r.status == 200, await r.text()
    preview = await r.json()
    assert preview["waiting_for"] == [a["id"], b["id"]] and preview["decision"]["sites"] == []
    assert preview["decision"]["summary"] == (f"would be waiting for job {a['id']} (queued) to end (after_any); job "
                                              f"{b['id']} (queued) to fail or be cancelled (after_failed)")


async def test_a_job_waiting_with_after_any_can_be_changed_without_being_released_and_cancelled(client: TestClient):
    a = await submit(client, "a")  # (no site: it stays queued)
    b = await submit(client, "b", after_any=[a["id"]], after_failed=[(await submit(client, "x"))["id"]])
    r = await client.patch(f"/v1/jobs/{b['id']}", json={"priority": 50})
    assert r.status == 200, await r.text()
    changed = await r.json()
    assert changed["waiting"] is True and changed["spec"]["priority"] == 50
    assert changed["spec"]["after_any"] == [a["id"]]
    r = await client.patch(f"/v1/jobs/{b['id']}", json={"after_any": []})
    assert r.status == 422 and (await r.json())["error"]["fields"][0]["field"] == "after_any"
    await asyncio.sleep(0.3)
    held = await get(client, b["id"])
    assert held["waiting"] is True and held["attempt"] == 0
    assert held["reason"].startswith(f"waiting for job {a['id']} (queued) to end (after_any); job ")
    r = await client.delete(f"/v1/jobs/{b['id']}")
    assert r.status == 200 and (await r.json())["state"] == "cancelled"
    assert client.broker.book.active.dependents == {}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kind", "end", "outcome"), [
    ("after_any", "succeeded", "released"), ("after_any", "failed", "released"), ("after_any", "deleted", "released"),
    ("after_failed", "cancelled", "released"), ("after_failed", "succeeded", "failed"),
    ("after_failed", "deleted", "failed"),
])
async def test_a_dependency_in_after_any_or_after_failed_that_ended_while_no_broker_ran_is_acted_on_at_the_start(
        tmp_path: Path, kind: str, end: str, outcome: str):
    settings = _settings(tmp_path / "down.db")
    broker = Broker(settings)
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        a = await submit(c, "a")
        still = await submit(c, "still")
        b = await submit(c, "b", **{kind: [a["id"]]})
        d = await submit(c, "d", **{kind: [still["id"]]})  # whose dependency does not end: it keeps waiting
    await broker.stop()

    await _end_while_no_broker_runs(settings, a["id"], end)  # (another broker sharing the database)

    broker = Broker(settings)
    await broker.start([])
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            if outcome == "released":
                released = await _until(c, b["id"], lambda j: "waiting" not in j)
                assert released["state"] == "queued"
                assert released["reason"].startswith(f"waiting for a placement: job {a['id']} it runs after ")
            else:
                failed = await wait_for(c, b["id"], {"failed"})
                assert failed["reason"].startswith(f"job {a['id']} it runs after ")
                assert failed["reason"].endswith("it will never run (after_failed)")
                assert ("cannot be told to have failed" in failed["reason"]) == (end == "deleted")
            await asyncio.sleep(0.2)  # passes ran: d still waits, held out of the queue
            kept = await get(c, d["id"])
            assert kept["state"] == "queued" and kept["waiting"] is True
            assert kept["reason"].endswith(f"({kind})") and d["id"] in broker.book.active.dependents[still["id"]]
    finally:
        await broker.stop()


async def test_the_retention_keeps_the_jobs_that_a_job_waits_for_in_after_any_or_after_failed(tmp_path: Path):
    """W1 runs after A and B end (after_any), W2 after Y fails and B succeeds; A succeeded and Y was cancelled
    past the retention, B still runs: the retention deletes neither A nor Y (W2 would then fail, Y's end no
    longer to be told), and deletes both once no job waits for them."""
    broker = await _retaining_a_second(tmp_path)
    try:
        async with TestClient(TestServer(create_app(broker))) as c:
            await register(c, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
            a = await submit(c, "a", duration_s=0.05)
            y = await submit(c, "y", gpus={"count": 1, "model": "h100-80gb"})
            b = await submit(c, "b", duration_s=600)
            await wait_for(c, a["id"], {"succeeded"})
            await _end(c, y, "cancelled")
            await wait_for(c, b["id"], {"running"})
            w1 = await submit(c, "w1", after_any=[a["id"], b["id"]])
            w2 = await submit(c, "w2", after=[b["id"]], after_failed=[y["id"]])
            assert w1["waiting"] is True and w2["waiting"] is True
            await asyncio.sleep(1.2)  # a and y ended more than the retention ago
            await broker.prune_ended()
            for kept in (a, y):
                assert (await c.get(f"/v1/jobs/{kept['id']}")).status == 200  # kept: w1 and w2 wait for them
            assert (await c.post(f"/v1/jobs/{b['id']}/cancel")).status == 200
            await wait_for(c, w1["id"], {"succeeded"})  # any end: released
            failed = await wait_for(c, w2["id"], {"failed"})
            assert failed["reason"] == f"job {b['id']} it runs after was cancelled; it will never run (after)"
            await broker.prune_ended()
            for gone in (a, y):
                assert (await c.get(f"/v1/jobs/{gone['id']}")).status == 404  # no job waits for them any more
    finally:
        await broker.stop()


def test_the_cli_submits_after_any_and_after_failed_from_the_yaml_and_shows_them(capsys, server, tmp_path: Path):
    code, out, err = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, name="pre", duration_s=600)))
    assert code == 0, err
    first = json.loads(out)["id"]
    code, out, err = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, name="other", duration_s=600)))
    other = json.loads(out)["id"]
    both = submit_file(tmp_path, name="fallback", after_any=[first], after_failed=[other])
    code, out, err = run(capsys, server, "submit", "--dry-run", str(both))
    assert code == 0, err
    assert f"would be waiting for job {first} (" in out and "(after_failed)" in out
    code, out, err = run(capsys, server, "--json", "submit", str(both))
    assert code == 0, err
    job = json.loads(out)
    assert job["spec"]["after_any"] == [first] and job["spec"]["after_failed"] == [other] and job["waiting"] is True
    code, out, err = run(capsys, server, "job", job["id"])
    assert code == 0, err
    # (one line, in the column of the others, whatever lists the spec uses)
    assert f"  after     {first} to end (after_any); {other} to fail or be cancelled (after_failed)\n" in out


def test_a_dispatch_to_a_site_agent_carries_neither_after_any_nor_after_failed() -> None:
    job = Job(id="01b", spec=spec(name="b", after_any=["01a"], after_failed=["01x"]), created_at=NOW, updated_at=NOW)
    sent = json.loads(Dispatch(msg_id="m1", site="s", job=job).model_dump_json())
    assert "after_any" not in sent["job"]["spec"] and "after_failed" not in sent["job"]["spec"]
    assert json.loads(job.model_dump_json())["spec"]["after_failed"] == ["01x"]  # (the broker's own copy keeps them)


async def test_the_openapi_document_names_the_rules_a_submission_checks_of_after_any_and_after_failed(
        client: TestClient):
    # (a client generated from the document is told every 422 a valid-looking spec may get, not only after's)
    described = (await (await client.get("/openapi.json")).json())["components"]["schemas"]["JobSpec"]["description"]
    rules = described.split("Also checked (a 422 names the field): ")[1]
    assert "after_any" in rules and "after_failed" in rules
    assert "at most 64 across after, after_any and after_failed" in rules
    assert "once across the three lists" in rules
    assert "in after_failed, not already succeeded" in rules
