"""Measured GPU telemetry for a site's reports: a source read in the background, its latest reading put into
each ``SiteState`` the site sends.

A site adapter knows its capacity and queue but not how hot its GPUs run or whether their clocks are held
down. A :class:`TelemetrySource` measures that: :class:`NvmlSource` (``adapters.nvml``) on the machine the
agent runs on, or ``adapters.dcgm``'s Prometheus source for a cluster whose nodes run NVIDIA's DCGM exporter.
A :class:`TelemetryFeed` reads its source every ``every_s`` seconds and keeps the latest reading;
:meth:`TelemetryFeed.overlay` puts it into a site report, keeping the adapter's own queue depth.

- A reading that fails is logged (once per distinct error, then at debug level) and the previous one is kept
  until it is ``stale_after_s`` old; after that the site's own telemetry goes out again, as if no source were
  configured, so a broken exporter never freezes a site's telemetry at an old value.
- Sources never block the event loop: NVML is read in a worker thread, Prometheus with aiohttp.
- :func:`telemetry_feed` builds the feed a config asks for (``kind: nvml`` or ``kind: prometheus``).

Turning it off: leave ``telemetry`` unset in the agent's config (or the Kubernetes adapter's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Protocol

from adapters.dcgm import PrometheusSource
from broker.clock import Clock, SystemClock
from broker.models import NvmlTelemetryConfig, PrometheusTelemetryConfig, SiteState, Telemetry

log = logging.getLogger(__name__)


class TelemetrySource(Protocol):
    """One reading of a site's GPUs. ``read`` raises on failure (the feed logs it and keeps the last
    reading); ``aclose`` releases what the source holds."""

    async def read(self) -> Telemetry: ...

    async def aclose(self) -> None: ...


class NvmlSource:
    """The GPUs of the machine this process runs on, through NVML (a site agent on a GPU node)."""

    def __init__(self, collector: object | None = None) -> None:
        from adapters.nvml import NvmlCollector

        self._collector = collector if collector is not None else NvmlCollector()
        self._opened = False
        # NVML is called from worker threads; a reading cancelled on stop may still be running in its thread
        # when the close comes, so each call holds this lock (the close waits for the reading, never cuts it).
        self._lock = threading.Lock()

    def _read(self) -> Telemetry:
        with self._lock:
            if not self._opened:
                self._collector.open()  # NvmlUnavailable names the cause
                self._opened = True
            return self._collector.sample().telemetry()

    def _close(self) -> None:
        with self._lock:
            if self._opened:
                self._opened = False
                self._collector.close()

    async def read(self) -> Telemetry:
        return await asyncio.to_thread(self._read)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._close)


class TelemetryFeed:
    """Reads ``source`` every ``every_s`` seconds in a task of its own; :meth:`overlay` puts the latest
    reading (if not older than ``stale_after_s``) into a site's report."""

    def __init__(self, site: str, source: TelemetrySource, every_s: float, stale_after_s: float,
                 clock: Clock | None = None) -> None:
        self.site = site
        self.source = source
        self.every_s = every_s
        self.stale_after_s = stale_after_s
        self.clock = clock or SystemClock()
        self.latest: Telemetry | None = None
        self.read_at: float | None = None  # the clock's timestamp of the latest reading
        self.failures = 0
        self._last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def read_once(self) -> bool:
        """One reading; False (logged) when it failed."""
        try:
            reading = await self.source.read()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a source's failure must never stop the site's reports
            self.failures += 1
            error = f"{type(e).__name__}: {e}"
            level = logging.WARNING if error != self._last_error else logging.DEBUG
            log.log(level, "site %s: GPU telemetry reading failed (%s); the last reading is kept for up to %.0f s",
                    self.site, error, self.stale_after_s)
            self._last_error = error
            return False
        if self._last_error is not None:
            log.info("site %s: GPU telemetry read again", self.site)
        self._last_error = None
        self.latest = reading
        self.read_at = self.clock.now().timestamp()
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"telemetry-{self.site}")

    async def _loop(self) -> None:
        while True:
            await self.read_once()
            await self.clock.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.source.aclose()

    def fresh(self) -> Telemetry | None:
        """The latest reading, or None when there is none or it is older than ``stale_after_s``."""
        if self.latest is None or self.read_at is None:
            return None
        if self.clock.now().timestamp() - self.read_at > self.stale_after_s:
            return None
        return self.latest

    def overlay(self, state: SiteState) -> SiteState:
        """``state`` with the measured telemetry in place of the adapter's (its queue depth kept: the adapter
        knows its queue, the GPUs do not); ``state`` as it was when there is no fresh reading."""
        measured = self.fresh()
        if measured is None:
            return state
        return state.model_copy(update={
            "telemetry": measured.model_copy(update={"queue_depth": state.telemetry.queue_depth})})


def nvml_feed(site: str, config: NvmlTelemetryConfig, clock: Clock | None = None,
              collector: object | None = None) -> TelemetryFeed:
    """A feed that reads this machine's GPUs through NVML (``collector``: a stand-in, for tests)."""
    return TelemetryFeed(site, NvmlSource(collector), config.every_s, config.stale_after_s, clock)


def telemetry_feed(site: str, config: NvmlTelemetryConfig | PrometheusTelemetryConfig,
                   clock: Clock | None = None) -> TelemetryFeed:
    """The feed ``config`` asks for: NVML on this machine (``kind: nvml``), or the Prometheus server that
    scrapes the cluster's dcgm-exporter (``kind: prometheus``, :class:`adapters.dcgm.PrometheusSource`)."""
    if isinstance(config, PrometheusTelemetryConfig):
        return TelemetryFeed(site, PrometheusSource(config), config.every_s, config.stale_after_s, clock)
    return nvml_feed(site, config, clock)
