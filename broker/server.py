"""Run the broker and its HTTP API until SIGINT or SIGTERM, then shut down gracefully: stop taking
requests, let dispatches in flight finish, close the sites and the store."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from broker.api import create_app
from broker.config import BrokerSettings
from broker.models import SiteSpec
from broker.service import Broker

log = logging.getLogger("heliotrope")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def run(
    settings: BrokerSettings,
    sites: list[SiteSpec],
    feeder: Callable[[str], Awaitable[None]] | None = None,
    ready: Callable[[int], None] | None = None,
    log_jobs: bool = False,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("heliotrope.jobs").setLevel(logging.INFO if log_jobs else logging.WARNING)
    broker = Broker(settings)
    await broker.start(sites)
    runner = web.AppRunner(create_app(broker), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        await broker.stop()
        raise OSError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else settings.port  # type: ignore[union-attr]
    url = f"http://{settings.host}:{port}"
    print(f"heliotrope serving on {url}  (db {settings.db}, {len(broker.federation.members)} sites)", flush=True)
    if not _is_loopback(settings.host):
        log.warning("listening on %s without authentication: anyone who can reach it can submit jobs", settings.host)
    else:
        log.info("open API on loopback only (no authentication in this release)")
    if broker.replicas is not None:
        broker.elect(broker.replicas.advertise_url or url)
        log.info("one of several replicas: competing for leadership as %s", broker.replicas.advertise_url or url)
    if ready is not None:
        ready(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    feed_task = loop.create_task(feeder(url)) if feeder else None
    try:
        await stop.wait()
    finally:
        print("heliotrope shutting down", flush=True)
        if feed_task is not None:
            feed_task.cancel()
            await asyncio.gather(feed_task, return_exceptions=True)
        await runner.cleanup()
        await broker.stop()
