"""``GET /v1/jobs/{id}/logs`` against a live broker with simulated sites, and the simulated site's log itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from adapters.base import AdapterError, JobLogs, LogFollow, LogsUnsupported, tail_text
from adapters.simulated import SimulatedSite
from broker import api
from broker.api import create_app
from broker.clock import ManualClock
from broker.config import BrokerSettings
from broker.models import Job
from broker.service import Broker
from tests.builders import NOW, job, site
from tests.conftest import free_port
from tests.test_api import register, site_body, wait_for

JOB = {"tenant": "t1", "name": "train-1", "gpus": {"count": 1}, "duration_s": 3600}


@pytest.fixture
async def client(tmp_path: Path):
    settings = BrokerSettings(db=str(tmp_path / "api.db"), cycle_interval_s=0.05, shutdown_grace_s=1)
    broker = Broker(settings)
    await broker.start([])
    async with TestClient(TestServer(create_app(broker))) as c:
        c.broker = broker  # type: ignore[attr-defined]
        await register(c, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))
        yield c
    await broker.stop()


async def submitted(client: TestClient, **spec: Any) -> str:
    r = await client.post("/v1/jobs", json={**JOB, **spec})
    assert r.status == 201, await r.text()
    return (await r.json())["id"]


async def error(r: Any) -> dict[str, Any]:
    assert r.content_type == "application/json", await r.text()
    return (await r.json())["error"]


async def test_a_running_jobs_log_is_read_as_plain_text_from_its_site(client: TestClient):
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    r = await client.get(f"/v1/jobs/{job_id}/logs")
    assert r.status == 200 and r.content_type == "text/plain" and r.charset == "utf-8"
    text = await r.text()
    assert f"attempt 1 of job {job_id} (tenant t1) started on 1 x a100-80gb" in text
    assert "this log is simulated" in text
    assert r.headers["X-Heliotrope-Site"] == "berlin" and r.headers["X-Heliotrope-Attempt"] == "1"
    assert r.headers["X-Heliotrope-Log-Truncated"] == "false"


async def test_a_finished_jobs_log_ends_with_its_outcome(client: TestClient):
    job_id = await submitted(client, duration_s=0.2)
    await wait_for(client, job_id, {"succeeded"})
    text = await (await client.get(f"/v1/jobs/{job_id}/logs")).text()
    lines = text.splitlines()
    assert "started on" in lines[0] and "attempt 1 succeeded after 0 s" in lines[-1]
    assert [line.split(" ", 2)[1] for line in lines[1:-1]] == ["progress"] * 9


async def test_tail_keeps_the_last_lines_and_says_it_cut(client: TestClient):
    job_id = await submitted(client, duration_s=0.2)
    await wait_for(client, job_id, {"succeeded"})
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"tail": "2"})
    lines = (await r.text()).splitlines()
    assert len(lines) == 2 and "progress 90%" in lines[0] and "succeeded" in lines[1]
    assert r.headers["X-Heliotrope-Log-Truncated"] == "true"


async def test_a_job_not_yet_at_a_site_has_no_logs_and_409_says_so(client: TestClient):
    job_id = await submitted(client, gpus={"count": 1, "model": "h100-80gb"})  # no site has one: it stays queued
    r = await client.get(f"/v1/jobs/{job_id}/logs")
    assert r.status == 409
    assert f"job {job_id} has not reached a site yet (it is queued)" in (await error(r))["message"]


async def test_an_attempt_that_never_reached_a_site_is_a_409_naming_the_attempts_that_did(client: TestClient):
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": "2"})
    assert r.status == 409
    body = await error(r)
    assert "attempt 2 of job" in body["message"] and "the attempts that did: 1" in body["message"]
    assert body["fields"][0]["field"] == "attempt"
    assert (await client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": "1"})).status == 200


@pytest.mark.parametrize("query, field", [
    ({"tail": "0"}, "tail"), ({"tail": "ten"}, "tail"), ({"tail": "-5"}, "tail"), ({"tail": "1000001"}, "tail"),
    ({"attempt": "0"}, "attempt"), ({"attempt": "first"}, "attempt"),
], ids=["tail zero", "tail not a number", "tail negative", "tail too large", "attempt zero",
        "attempt not a number"])
async def test_a_bad_tail_or_attempt_is_a_422_naming_the_parameter(client: TestClient, query: dict[str, str],
                                                                   field: str):
    job_id = await submitted(client)
    r = await client.get(f"/v1/jobs/{job_id}/logs", params=query)
    assert r.status == 422
    assert (await error(r))["fields"][0]["field"] == field


async def test_an_unknown_parameter_is_a_400_naming_it(client: TestClient):
    job_id = await submitted(client)
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"since": "10m"})
    assert r.status == 400 and (await error(r))["fields"][0]["field"] == "since"


async def test_logs_of_an_unknown_job_are_a_json_404(client: TestClient):
    r = await client.get("/v1/jobs/01nosuchjob0000000/logs")
    assert r.status == 404 and "no job with id 01nosuchjob0000000" in (await error(r))["message"]


async def test_a_site_that_does_not_answer_is_a_503_with_retry_after(client: TestClient):
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    client.broker.federation.get("berlin").adapter.set_reachable(False)
    r = await client.get(f"/v1/jobs/{job_id}/logs")
    assert r.status == 503 and r.headers["Retry-After"]
    assert "site berlin did not answer: site berlin is unreachable" in (await error(r))["message"]


class _Without:
    """A site adapter without one capability's method (``hidden``), as a custom adapter, or a site agent that reads
    logs but cannot follow them, may be."""

    def __init__(self, inner: SimulatedSite, hidden: str) -> None:
        self.inner, self.hidden = inner, hidden

    def __getattr__(self, name: str) -> Any:
        if name == self.hidden:
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Refuses:
    def __init__(self, inner: SimulatedSite, error: AdapterError) -> None:
        self.inner, self.error = inner, error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def logs(self, *args: Any) -> JobLogs:
        raise self.error


@pytest.mark.parametrize("wrap, status, says", [
    (lambda inner: _Without(inner, "logs"), 501, "site berlin's adapter (simulated) cannot give logs"),
    (lambda inner: _Refuses(inner, LogsUnsupported("its agent is of an earlier release")), 501,
     "site berlin cannot give logs: its agent is of an earlier release"),
], ids=["an adapter without logs", "an adapter that says it cannot give logs"])
async def test_a_site_that_cannot_give_logs_is_a_501_saying_so(client: TestClient, wrap: Any, status: int, says: str):
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    member = client.broker.federation.get("berlin")
    member.adapter = wrap(member.adapter)
    r = await client.get(f"/v1/jobs/{job_id}/logs")
    assert r.status == status and says in (await error(r))["message"]


# --- following a log (follow=true) ---


async def test_a_followed_log_sends_its_tail_then_each_line_as_it_is_written_and_ends_with_the_attempt(
        client: TestClient):
    job_id = await submitted(client, duration_s=3)
    await wait_for(client, job_id, {"running"})
    async with client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true", "tail": "1"}) as r:
        assert r.status == 200 and r.content_type == "text/plain" and r.charset == "utf-8"
        assert r.headers["X-Heliotrope-Site"] == "berlin" and r.headers["X-Heliotrope-Attempt"] == "1"
        assert r.headers["X-Heliotrope-Log-Source"] == "simulated run at site berlin"
        first = (await r.content.readline()).decode()
        # it came while the job still runs: the answer is streamed, not held until the end
        assert (await (await client.get(f"/v1/jobs/{job_id}")).json())["state"] == "running"
        rest = (await r.content.read()).decode()  # to the end of the stream: the attempt's end
    assert "started on" in first or "progress" in first
    lines = rest.splitlines()
    assert lines[-1].split(" ", 1)[1] == "attempt 1 succeeded after 3 s"
    steps = [int(line.split()[2].rstrip("%:")) for line in [first, *lines[:-1]] if " progress " in line]
    assert steps == list(range(steps[0] if steps else 10, 100, 10))  # each tenth once, in order, to 90%
    whole = await (await client.get(f"/v1/jobs/{job_id}/logs")).text()
    assert whole.endswith(first + rest)  # what was streamed is the log as it stands at the end


class _Breaks:
    """A site whose followed log says one line, then stops answering (an agent gone silent, a chunk lost)."""

    def __init__(self, inner: SimulatedSite) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        async def chunks() -> AsyncGenerator[str, None]:
            yield "epoch 1\n"
            raise AdapterError("its agent is no longer heard from")
        return LogFollow(False, "pod p", chunks())


async def test_a_follow_that_breaks_while_the_attempt_runs_does_not_end_as_if_the_attempt_had_ended(
        client: TestClient):
    """A clean end of the stream says the attempt ended: one the broker cannot carry on (its site stopped answering,
    its 24 hours, its token revoked, the broker stopping) is cut off instead, so the client knows to ask again."""
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    member = client.broker.federation.get("berlin")
    member.adapter = _Breaks(member.adapter)
    async with client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as r:
        assert r.status == 200 and await r.content.readline() == b"epoch 1\n"
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.read()


async def test_following_the_log_of_an_attempt_that_ended_sends_it_and_ends(client: TestClient):
    job_id = await submitted(client, duration_s=0.2)
    await wait_for(client, job_id, {"succeeded"})
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "1"})
    assert r.status == 200 and await r.text() == await (await client.get(f"/v1/jobs/{job_id}/logs")).text()


@pytest.mark.parametrize("value", ["yes", "2", "", "truee"], ids=["yes", "2", "empty", "a typo"])
async def test_a_bad_follow_is_a_400_naming_it(client: TestClient, value: str):
    job_id = await submitted(client)
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": value})
    assert r.status == 400
    body = await error(r)
    assert body["fields"][0]["field"] == "follow" and "follow must be true or false" in body["message"]


async def test_following_at_a_site_that_cannot_is_a_501_and_reading_still_works(client: TestClient):
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    member = client.broker.federation.get("berlin")
    member.adapter = _Without(member.adapter, "follow_logs")
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert r.status == 501
    body = await error(r)
    assert "site berlin's adapter (simulated) cannot follow logs" in body["message"] and "tail=N" in body["message"]
    assert body["fields"][0]["field"] == "follow"
    assert (await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "false"})).status == 200


class _Quiet:
    """A site whose followed log says one line, then nothing, and notes when its stream is closed."""

    def __init__(self, inner: SimulatedSite) -> None:
        self.inner, self.closed = inner, asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        async def chunks() -> AsyncGenerator[str, None]:
            try:
                yield "loading the dataset\n"
                await asyncio.Event().wait()  # a job that prints nothing for hours
            finally:
                self.closed.set()
        return LogFollow(False, "pod p", chunks())


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[aiohttp.ClientSession, Broker]]:
    """A broker served as ``broker.server`` serves it (aiohttp does not cancel a handler whose client left, as the
    test server does), and a session to it."""
    broker = Broker(BrokerSettings(db=str(tmp_path / "api.db"), cycle_interval_s=0.05, shutdown_grace_s=1))
    await broker.start([])
    runner = web.AppRunner(create_app(broker), access_log=None, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            await register(session, site_body("berlin", "gcp:europe-west3", {"a100-80gb": 8}))  # type: ignore[arg-type]
            yield session, broker
    finally:
        await runner.cleanup()
        await broker.stop()


async def test_a_client_that_leaves_a_quiet_follow_has_the_sites_stream_closed(served, monkeypatch):
    monkeypatch.setattr(api, "LOG_FOLLOW_CHECK_S", 0.05)
    session, broker = served
    job_id = await submitted(session, duration_s=3600)  # type: ignore[arg-type]
    await wait_for(session, job_id, {"running"})  # type: ignore[arg-type]
    member = broker.federation.get("berlin")
    member.adapter = quiet = _Quiet(member.adapter)
    r = await session.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert await r.content.readline() == b"loading the dataset\n"
    r.close()  # the client goes away (Ctrl-C) while the log is quiet
    await asyncio.wait_for(quiet.closed.wait(), 5)


@contextlib.asynccontextmanager
async def replica_relaying_to(leader: str) -> AsyncIterator[tuple[aiohttp.ClientSession, web.Application]]:
    """A replica that does not lead, as far as a followed log goes: it relays it from ``leader``
    (``broker.api._relay_stream``, as ``follower_middleware`` calls it); a session to it, and its app."""
    async with aiohttp.ClientSession() as to_leader:
        async def relay(request: web.Request) -> web.StreamResponse:
            return await api._relay_stream(request, to_leader, leader, {})

        replica = web.Application()
        replica[api.RELAYS] = set()
        replica.router.add_get("/{path:.*}", relay)
        runner = web.AppRunner(replica, access_log=None, handle_signals=False)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as via_replica:
                yield via_replica, replica
        finally:
            await runner.cleanup()


async def test_a_client_that_leaves_a_quiet_follow_through_a_replica_that_does_not_lead_frees_the_sites_stream(
        served, monkeypatch):
    """A replica that does not lead relays the leader's followed log. Its client leaving a quiet log must close the
    relay's connection to the leader, which then closes the site's stream: a quiet log has nothing to write, so
    neither would learn of it by a failed write, and the site's stream and one of the leader's
    ``MAX_LOG_FOLLOWS`` would be held for hours."""
    monkeypatch.setattr(api, "LOG_FOLLOW_CHECK_S", 0.05)
    session, broker = served
    job_id = await submitted(session, duration_s=3600)  # type: ignore[arg-type]
    await wait_for(session, job_id, {"running"})  # type: ignore[arg-type]
    member = broker.federation.get("berlin")
    member.adapter = quiet = _Quiet(member.adapter)
    leader = str(session._base_url).rstrip("/")
    async with replica_relaying_to(leader) as (via_replica, replica):
        r = await via_replica.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
        assert r.headers["X-Heliotrope-Leader"] == leader
        assert await r.content.readline() == b"loading the dataset\n"
        r.close()  # the client goes away (Ctrl-C) while the log is quiet
        await asyncio.wait_for(quiet.closed.wait(), 5)
        assert not replica[api.RELAYS]


async def test_a_follow_cut_short_at_the_leader_is_cut_short_through_a_replica_that_does_not_lead(served):
    session, broker = served
    job_id = await submitted(session)  # type: ignore[arg-type]
    await wait_for(session, job_id, {"running"})  # type: ignore[arg-type]
    member = broker.federation.get("berlin")
    member.adapter = _Breaks(member.adapter)
    async with replica_relaying_to(str(session._base_url).rstrip("/")) as (via_replica, _):
        async with via_replica.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as r:
            assert r.status == 200 and await r.content.readline() == b"epoch 1\n"
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.content.read()


async def test_follows_beyond_the_bound_are_a_503_with_retry_after(client: TestClient, monkeypatch):
    monkeypatch.setattr(api, "MAX_LOG_FOLLOWS", 1)
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    member = client.broker.federation.get("berlin")
    member.adapter = _Quiet(member.adapter)
    held = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert await held.content.readline() == b"loading the dataset\n"
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert r.status == 503 and r.headers["Retry-After"]
    assert "1 logs are being followed through this broker already" in (await error(r))["message"]
    assert (await client.get(f"/v1/jobs/{job_id}/logs")).status == 200  # reading without follow is not bounded
    held.close()


async def test_follows_being_begun_count_against_the_bound(client: TestClient, monkeypatch):
    """The bound holds for follows whose site has not answered yet (an agent's takes a round trip over MQTT, up
    to 12 s): a burst of requests must not all pass it while the first ones wait."""
    monkeypatch.setattr(api, "MAX_LOG_FOLLOWS", 1)
    job_id = await submitted(client)
    await wait_for(client, job_id, {"running"})
    member = client.broker.federation.get("berlin")
    member.adapter = slow = _SlowToFollow(_Quiet(member.adapter))
    first = asyncio.ensure_future(client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}))
    await asyncio.wait_for(slow.asked.wait(), 5)  # the first waits for its site
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert r.status == 503 and "1 logs are being followed" in (await error(r))["message"]
    slow.answer.set()
    held = await first
    assert held.status == 200 and await held.content.readline() == b"loading the dataset\n"
    held.close()


class _SlowToFollow:
    """A site whose first follow is answered only once ``answer`` is set (the others at once)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.asked, self.answer = inner, asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        if not self.asked.is_set():
            self.asked.set()
            await self.answer.wait()
        return await self.inner.follow_logs(job_id, attempt, tail_lines, limit_bytes)


# --- the simulated site's log, on a manual clock ---


async def test_a_simulated_log_grows_with_the_run_and_is_the_same_each_time():
    clock = ManualClock(NOW)
    sim = SimulatedSite(site("sim", adapter={"kind": "simulated", "dispatch_delay_s": 0}), clock)
    await sim.start()
    try:
        attempt = Job(id="j-1", spec=job(duration_s=1000), attempt=1, created_at=NOW, updated_at=NOW,
                      gpu_model="a100-80gb")
        assert (await sim.submit(attempt)).admitted
        await asyncio.sleep(0)
        first = (await sim.logs("j-1", 1, None, 1 << 20)).text
        assert len(first.splitlines()) == 1
        await clock.advance(350)
        later = (await sim.logs("j-1", 1, None, 1 << 20)).text
        assert later.startswith(first) and [line.split(" ")[2] for line in later.splitlines()[1:]] == [
            "10%:", "20%:", "30%:"]
        assert later == (await sim.logs("j-1", 1, None, 1 << 20)).text
        await sim.cancel("j-1", 1)
        ended = (await sim.logs("j-1", 1, None, 1 << 20)).text
        assert ended.splitlines()[-1].endswith("attempt 1 was withdrawn by the broker after 350 s")
    finally:
        await sim.close()


async def test_a_followed_simulated_log_sends_each_line_when_its_time_comes_and_ends_with_the_run():
    clock = ManualClock(NOW)
    sim = SimulatedSite(site("sim", adapter={"kind": "simulated", "dispatch_delay_s": 0}), clock)
    await sim.start()
    try:
        attempt = Job(id="j-1", spec=job(duration_s=1000), attempt=1, created_at=NOW, updated_at=NOW,
                      gpu_model="a100-80gb")
        assert (await sim.submit(attempt)).admitted
        await clock.advance(150)
        followed = await sim.follow_logs("j-1", 1, 1, 1 << 20)
        assert followed.truncated  # the tail is the last of two lines
        assert (await anext(followed.chunks)).split(" ", 2)[1:] == ["progress", "10%: 100 s of 1000 s\n"]
        later = asyncio.ensure_future(anext(followed.chunks))
        await clock.advance(49)
        assert not later.done()  # 20% is due at 200 s: nothing before
        await clock.advance(2)
        assert " progress 20%: 200 s of 1000 s\n" in await later
        await clock.advance(100)
        await sim.cancel("j-1", 1)
        rest = "".join([chunk async for chunk in followed.chunks])
        assert rest.splitlines()[0].endswith("progress 30%: 300 s of 1000 s")
        assert rest.splitlines()[-1].endswith("attempt 1 was withdrawn by the broker after 301 s")
        assert (await sim.logs("j-1", 1, None, 1 << 20)).text.endswith(rest)
    finally:
        await sim.close()


async def test_a_followed_simulated_log_ends_when_its_site_is_closed():
    """A simulated site removed from the federation (or stopped with the broker) is closed: its runs stop, and so
    must the follows of their logs, which would otherwise wait for an end that never comes (for 24 hours, the
    broker's bound), holding one of the broker's follows."""
    clock = ManualClock(NOW)
    sim = SimulatedSite(site("sim", adapter={"kind": "simulated", "dispatch_delay_s": 0}), clock)
    await sim.start()
    attempt = Job(id="j-1", spec=job(duration_s=1000), attempt=1, created_at=NOW, updated_at=NOW,
                  gpu_model="a100-80gb")
    assert (await sim.submit(attempt)).admitted
    await clock.advance(950)  # (past the last progress line: nothing more is due before the end)
    followed = await sim.follow_logs("j-1", 1, 1, 1 << 20)
    assert " progress 90%" in await anext(followed.chunks)
    later = asyncio.ensure_future(anext(followed.chunks, None))
    await sim.close()
    assert await asyncio.wait_for(later, 5) is None


def test_tail_text_keeps_the_end_in_lines_then_bytes_without_half_a_character():
    assert tail_text("a\nb\nc\n", 2, 100) == ("b\nc\n", True)
    assert tail_text("a\nb\n", 5, 100) == ("a\nb\n", False)
    assert tail_text("xé\n", None, 2) == ("\n", True)  # é is two bytes: the one left of it is dropped


@pytest.mark.parametrize("text", [
    "epoch 1\r 10%|#   |\r 50%|##  |\r100%|####|\nloss 0.31\n",
    "page 1\x0cpage 2\nend\n",
    "record\x1efield\x1dunit\x1c\nend\n",
    "línea\u2028otra\x85más\nend\n",
], ids=["a progress bar redrawn with carriage returns", "a form feed", "ASCII separators",
        "Unicode line and paragraph separators"])
def test_tail_lines_are_counted_at_newlines_only_as_a_kubelet_counts_them(text: str):
    # str.splitlines also splits at \r, \f, \x1c-\x1e, \x85, \u2028: a progress bar's redraws counted as lines, so
    # --tail 2 of a training log showed the bar's last frames and not the line before them.
    assert tail_text(text, 2, 1 << 20) == (text, False)
    assert tail_text(text, 1, 1 << 20) == ("end\n" if text.endswith("end\n") else "loss 0.31\n", True)


# --- on the wire to a site agent ---


def test_a_reply_without_logs_is_written_as_an_earlier_release_reads_it():
    # A broker of an earlier release forbids keys it does not know in a reply: only an answer to "logs", which
    # only this release asks for, carries the new ones.
    from adapters import mqtt_protocol as proto

    plain = proto.encode(proto.Reply(site="edge", msg_id="m1", ok=True))
    assert b"logs" not in plain
    asked = proto.LogsRequest(site="edge", msg_id="m2", job_id="j-1", attempt=2, tail_lines=10, limit_bytes=4096)
    assert proto.decode(proto.topic("edge", "down"), proto.encode(asked)) == asked
    answer = proto.Reply(site="edge", msg_id="m2", ok=False, no_logs="not-found", reason="no Pod")
    assert proto.decode(proto.topic("edge", "up"), proto.encode(answer)) == answer
