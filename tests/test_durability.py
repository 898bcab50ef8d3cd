"""Acknowledged jobs survive ``kill -9``: a 201 means the job is on disk.

A real server process takes a burst of concurrent submissions and is killed with SIGKILL in the middle;
after a restart every job that got 201 is there, and a repeated idempotency key creates no duplicate.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess

import aiohttp
import pytest

from tests.conftest import HELIOTROPE, ROOT, free_port

pytestmark = pytest.mark.slow


async def _burst(url: str, n: int, concurrency: int, acked: dict[str, str], kill_after: int, kill) -> None:
    sem = asyncio.Semaphore(concurrency)
    killed = asyncio.Event()

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        async with sem:
            if killed.is_set():
                return
            body = {"tenant": "burst", "name": f"job-{i}", "gpus": {"count": 1}, "duration_s": 3600}
            try:
                async with session.post(f"{url}/v1/jobs", json=body, headers={"Idempotency-Key": f"k-{i}"}) as r:
                    if r.status == 201:
                        acked[f"k-{i}"] = (await r.json())["id"]
            except (TimeoutError, aiohttp.ClientError):
                return  # the server died under this request: it was never acknowledged
            if len(acked) >= kill_after and not killed.is_set():
                killed.set()
                kill()

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(i, session) for i in range(n)))


def test_every_acknowledged_job_survives_kill_9_and_keys_stay_idempotent(server_factory):
    srv = server_factory()
    srv.start()
    acked: dict[str, str] = {}
    asyncio.run(_burst(srv.url, n=3000, concurrency=64, acked=acked, kill_after=400, kill=srv.kill9))
    assert len(acked) >= 400, "the burst should have been acknowledged in part before the kill"
    assert srv.proc.returncode == -9

    # On disk, before any restart: every acknowledged id is a row.
    with sqlite3.connect(srv.db) as db:
        on_disk = {row[0] for row in db.execute("SELECT id FROM jobs WHERE tenant = 'burst'")}
    missing = set(acked.values()) - on_disk
    assert not missing, f"{len(missing)} acknowledged jobs were lost"

    srv.start()

    async def after_restart() -> None:
        async with aiohttp.ClientSession() as s:
            # Each acknowledged job is served with its state.
            for job_id in list(acked.values())[:50]:
                async with s.get(f"{srv.url}/v1/jobs/{job_id}") as r:
                    assert r.status == 200
                    assert (await r.json())["state"] in ("queued", "dispatching", "admitted", "running")
            # A repeated key returns the first job, for keys acknowledged before the kill...
            key, first_id = next(iter(acked.items()))
            i = key.split("-")[1]
            body = {"tenant": "burst", "name": f"job-{i}", "gpus": {"count": 1}, "duration_s": 3600}
            async with s.post(f"{srv.url}/v1/jobs", json=body, headers={"Idempotency-Key": key}) as r:
                assert r.status == 201
                assert r.headers.get("Idempotent-Replayed") == "true"
                assert (await r.json())["id"] == first_id

    asyncio.run(after_restart())
    with sqlite3.connect(srv.db) as db:
        keys = [row[0] for row in db.execute("SELECT idempotency_key FROM jobs WHERE tenant = 'burst'")]
    assert len(keys) == len(set(keys)), "an idempotency key created two jobs"


def test_jobs_running_when_the_broker_dies_are_requeued_and_finish_after_restart(server_factory):
    srv = server_factory()
    srv.start()

    async def submit_and_wait_running() -> list[str]:
        async with aiohttp.ClientSession() as s:
            ids = []
            for i in range(4):
                body = {"tenant": "t1", "name": f"short-{i}", "gpus": {"count": 1}, "duration_s": 1.5}
                async with s.post(f"{srv.url}/v1/jobs", json=body) as r:
                    ids.append((await r.json())["id"])
            for _ in range(100):
                states = []
                for job_id in ids:
                    async with s.get(f"{srv.url}/v1/jobs/{job_id}") as r:
                        states.append((await r.json())["state"])
                if all(st == "running" for st in states):
                    return ids
                await asyncio.sleep(0.05)
            raise AssertionError(f"jobs did not start: {states}")

    ids = asyncio.run(submit_and_wait_running())
    srv.kill9()
    srv.start()

    async def wait_succeeded() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                jobs = []
                for job_id in ids:
                    async with s.get(f"{srv.url}/v1/jobs/{job_id}") as r:
                        jobs.append(await r.json())
                if all(j["state"] == "succeeded" for j in jobs):
                    return jobs
                await asyncio.sleep(0.05)
            raise AssertionError(f"jobs did not finish after the restart: {[j['state'] for j in jobs]}")

    jobs = asyncio.run(wait_succeeded())
    # The attempt lost with the dead broker was requeued, so each job ran a second attempt.
    assert all(j["attempt"] == 2 for j in jobs)


@pytest.mark.parametrize("same_port", [True, False], ids=["same-port", "another-port"])
def test_a_second_broker_on_the_same_database_stops_without_touching_the_running_ones_jobs(server_factory, same_port):
    # `heliotrope serve` run again by mistake (another terminal, the same config): with SQLite one broker serves
    # a database. The second must stop before it reconciles: its own simulated sites know nothing, so it
    # would requeue and dispatch again every job the first one runs, behind that broker's back.
    srv = server_factory()
    srv.start()

    async def submit_and_wait_running() -> str:
        async with aiohttp.ClientSession() as s:
            body = {"tenant": "t1", "name": "long", "gpus": {"count": 1}, "duration_s": 3600}
            async with s.post(f"{srv.url}/v1/jobs", json=body) as r:
                job_id = (await r.json())["id"]
            for _ in range(100):
                async with s.get(f"{srv.url}/v1/jobs/{job_id}") as r:
                    if (await r.json())["state"] == "running":
                        return job_id
                await asyncio.sleep(0.05)
            raise AssertionError("the job did not start")

    job_id = asyncio.run(submit_and_wait_running())
    port = srv.port if same_port else free_port()
    second = subprocess.Popen(
        [*HELIOTROPE, "serve", "--config", str(srv.config), "--db", str(srv.db), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = second.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        second.kill()
        out, _ = second.communicate()
    with sqlite3.connect(srv.db) as db:
        doc = json.loads(db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
    assert (doc["state"], doc["attempt"]) == ("running", 1), "the second broker changed the first one's job"
    assert second.returncode == 1, out.decode()
    assert "another broker" in out.decode() and str(srv.db) in out.decode()

    async def cancel() -> int:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{srv.url}/v1/jobs/{job_id}/cancel") as r:
                return r.status

    assert asyncio.run(cancel()) == 200
