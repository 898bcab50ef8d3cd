"""Measured GPU telemetry in a site's reports (adapters.telemetry): the latest reading replaces the adapter's
own, keeps the adapter's queue depth, survives a failed reading for a while and gives way once stale."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pynvml
import pytest

from adapters.nvml import NvmlCollector
from adapters.telemetry import TelemetryFeed, nvml_feed
from broker.clock import ManualClock
from broker.models import Health, NvmlTelemetryConfig, SiteState, Telemetry
from tests.test_nvml import FakeNvml, a100_in_mig_mode, h100_throttled

NOW = datetime(2026, 11, 29, 12, tzinfo=UTC)


class Readings:
    """A telemetry source that returns the readings it is given, or raises what it is given."""

    def __init__(self, *readings: Telemetry | Exception) -> None:
        self.readings = list(readings)
        self.closed = False

    async def read(self) -> Telemetry:
        reading = self.readings.pop(0)
        if isinstance(reading, Exception):
            raise reading
        return reading

    async def aclose(self) -> None:
        self.closed = True


def own_report(queue_depth: int = 3) -> SiteState:
    """What the adapter itself reports: its queue, and telemetry it estimates."""
    return SiteState(site="lab", health=Health.HEALTHY, telemetry=Telemetry(temperature_c_max=40.0,
                                                                           queue_depth=queue_depth))


async def test_the_latest_reading_replaces_the_adapters_telemetry_but_not_its_queue() -> None:
    clock = ManualClock(NOW)
    measured = Telemetry(temperature_c_max=81.0, power_w=650.0, **Telemetry.throttle_of([("hw_thermal",), ()]))
    feed = TelemetryFeed("lab", Readings(measured), every_s=15, stale_after_s=60, clock=clock)
    assert feed.overlay(own_report()).telemetry.temperature_c_max == 40.0  # nothing read yet: the adapter's
    assert await feed.read_once()
    sent = feed.overlay(own_report(queue_depth=3)).telemetry
    assert (sent.temperature_c_max, sent.power_w, sent.throttled_pct, sent.queue_depth) == (81.0, 650.0, 50.0, 3)


async def test_a_failed_reading_keeps_the_last_one_until_it_is_stale_then_the_adapters_goes_out(caplog) -> None:
    clock = ManualClock(NOW)
    source = Readings(Telemetry(temperature_c_max=81.0), OSError("exporter down"), OSError("exporter down"))
    feed = TelemetryFeed("lab", source, every_s=15, stale_after_s=60, clock=clock)
    await feed.read_once()
    with caplog.at_level(logging.DEBUG, logger="adapters.telemetry"):
        assert not await feed.read_once()
        assert feed.overlay(own_report()).telemetry.temperature_c_max == 81.0  # kept: 0 s old
        await clock.advance(61)
        assert not await feed.read_once()
    assert feed.overlay(own_report()).telemetry.temperature_c_max == 40.0  # stale: the adapter's own
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "exporter down" in warnings[0].getMessage()  # the same error is logged once
    assert feed.failures == 2
    await feed.stop()
    assert source.closed


async def test_an_nvml_feed_reads_the_nodes_gpus_and_their_clock_throttling() -> None:
    fake = FakeNvml([a100_in_mig_mode(), h100_throttled()])
    feed = nvml_feed("lab", NvmlTelemetryConfig(), ManualClock(NOW), collector=NvmlCollector(fake))
    assert await feed.read_once()
    sent = feed.overlay(own_report()).telemetry
    assert (sent.temperature_c_max, sent.throttled_pct, sent.queue_depth) == (83.0, 50.0, 3)
    await feed.stop()
    assert not fake.initialised  # NVML shut down


async def test_a_machine_without_the_nvidia_driver_sends_the_adapters_telemetry_and_says_why(caplog) -> None:
    fake = FakeNvml([h100_throttled()], init_error=pynvml.NVMLError_LibraryNotFound)
    feed = nvml_feed("lab", NvmlTelemetryConfig(), ManualClock(NOW), collector=NvmlCollector(fake))
    with caplog.at_level(logging.WARNING, logger="adapters.telemetry"):
        assert not await feed.read_once()
    assert "libnvidia-ml.so.1 not found" in caplog.text
    assert feed.overlay(own_report()) == own_report()


@pytest.mark.parametrize("every_s, stale_after_s", [(0.5, 60), (15, 0)])
def test_nvml_settings_out_of_range_are_refused(every_s, stale_after_s) -> None:
    with pytest.raises(ValueError):
        NvmlTelemetryConfig(every_s=every_s, stale_after_s=stale_after_s)
