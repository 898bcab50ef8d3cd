"""What checking a bearer token costs (issue 8: "stored as SHA-256 digests so that checking one costs
microseconds").

Prints the time of one ``TokenBook.authenticate`` with N tokens stored (the digest and a dictionary lookup,
the store reread every ``refresh_s`` as in production), and the request rate of ``GET /v1/whoami`` over
HTTP on one connection with authentication off and on, so the figure includes aiohttp's middleware path.

    .venv/bin/python bench/auth.py [--tokens 1000] [--calls 200000] [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from broker import auth  # noqa: E402
from broker.api import create_app  # noqa: E402
from broker.clock import SystemClock  # noqa: E402
from broker.config import AuthSettings, BrokerSettings  # noqa: E402
from broker.service import Broker  # noqa: E402
from broker.store.memory import MemoryStore  # noqa: E402


async def check_cost(tokens: int, calls: int) -> tuple[float, float]:
    store = MemoryStore()
    await store.open()
    now = datetime.now(UTC)
    made = []
    for i in range(tokens):
        token, rec = auth.make_record(f"t{i}", "submitter", [], [f"tenant{i % 50}"], now)
        await store.put_token(rec.id, rec.digest, rec.model_dump_json())
        made.append(f"Bearer {token}")
    book = auth.TokenBook(store, AuthSettings(enabled=True, refresh_s=2.0), SystemClock())
    await book.authenticate(made[0])  # the first load
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for i in range(calls // 5):
            await book.authenticate(made[i % tokens])
        rounds.append((time.perf_counter() - started) / (calls // 5) * 1e6)
    return statistics.median(rounds), min(rounds)


async def http_rate(enabled: bool, requests: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "b.db")
        broker = Broker(BrokerSettings(db=db, auth=AuthSettings(enabled=enabled)))
        await broker.start([])
        token, rec = auth.make_record("bench", "admin", [], [], datetime.now(UTC))
        await broker.store.put_token(rec.id, rec.digest, rec.model_dump_json())
        server = TestServer(create_app(broker))
        await server.start_server()
        headers = {"Authorization": f"Bearer {token}"} if enabled else {}
        try:
            async with aiohttp.ClientSession() as session:
                url = server.make_url("/v1/whoami")
                for _ in range(200):  # warm up
                    async with session.get(url, headers=headers) as r:
                        assert r.status == 200, await r.text()
                started = time.perf_counter()
                for _ in range(requests):
                    async with session.get(url, headers=headers) as r:
                        await r.read()
                return requests / (time.perf_counter() - started)
        finally:
            await server.close()
            await broker.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--requests", type=int, default=3000)
    a = p.parse_args()
    median_us, best_us = await check_cost(a.tokens, a.calls)
    print(f"authenticate (SHA-256 + lookup), {a.tokens} tokens stored: median {median_us:.2f} us, "
          f"best {best_us:.2f} us per call ({a.calls} calls)")
    off = await http_rate(False, a.requests)
    on = await http_rate(True, a.requests)
    print(f"GET /v1/whoami, one connection, client and server in one process: auth off {off:,.0f} req/s, "
          f"auth on {on:,.0f} req/s ({(1 / on - 1 / off) * 1e6:+.0f} us per request)")


if __name__ == "__main__":
    asyncio.run(main())
