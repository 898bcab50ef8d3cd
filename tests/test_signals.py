"""Live grid signals in the broker's snapshots: carbon forecasts per zone from a carbon provider (the shipped
Electricity Maps slice, or a local service answering in the Electricity Maps v3 shape with recorded data) and
prices from a price provider; what a site's zone gets when its service fails; the refresh task's life cycle;
and a green job routed end to end by the forecast."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from broker.clock import ManualClock
from broker.config import BrokerSettings, ConfigError
from broker.data.carbon import CarbonData, load_carbon
from broker.federation import Federation
from broker.models import JobState, SimulatedAdapterConfig, SiteSpec
from broker.providers import FileCarbonProvider, FilePriceProvider, HttpCarbonProvider, build_price_provider
from broker.providers.carbon import ProviderError
from broker.service import Broker, adapter_factory
from broker.store import StoreError
from broker.signals import FORECASTS_STATE, CarbonForecastSettings, GridSignals, fit_forecast
from policies import explain
from policies.snapshot import MODEL_INDEX, JobRequest
from tests.builders import job, site
from tests.test_providers import FakeElectricityMaps, stamp

ROOT = Path(__file__).resolve().parents[1]
CARBON_DIR = ROOT / "data" / "carbon"  # the shipped slice: 2022-06-01 .. 2022-06-21, 8 zones
PRICES = ROOT / "data" / "prices" / "gcp_gpu_instance_prices.csv"
H = timedelta(hours=1)
FAST = SimulatedAdapterConfig(dispatch_delay_s=1.0)

NOW = datetime(2022, 6, 15, 12, 20, tzinfo=UTC)  # two weeks into the slice, 20 minutes into the hour
HOUR = NOW.replace(minute=0)

LONDON = site("london", region="gcp:europe-west2", grid_zone="GB", timezone="Europe/London", adapter=FAST)
FRANKFURT = site("frankfurt", region="gcp:europe-west3", grid_zone="DE-LU", timezone="Europe/Berlin", adapter=FAST)
PARIS = site("paris", region="gcp:europe-west9", grid_zone="FR", timezone="Europe/Paris", adapter=FAST)  # no data
TOKYO = site("tokyo", region="gcp:asia-northeast1", grid_zone="JP-TK", timezone="Asia/Tokyo", adapter=FAST)


@pytest.fixture(scope="module")
def carbon() -> CarbonData:
    return load_carbon(CARBON_DIR)


def settings(**kw: Any) -> CarbonForecastSettings:
    return CarbonForecastSettings(**({"history_h": 336} | kw))


def edited(data: CarbonData, zones: tuple[str, ...], edit: Callable[[np.ndarray, int], np.ndarray]) -> CarbonData:
    """The zones' series with ``edit(values, index of NOW's hour)`` applied."""
    arrays = {}
    for z in zones:
        start, end = data.span(z)
        values = np.array(data.series(z, start, (end - start) // H))
        arrays[z] = (start, edit(values, (HOUR - start) // H))
    return CarbonData.from_arrays(arrays)


async def federation(clock: ManualClock, *specs: SiteSpec) -> Federation:
    fed = Federation(clock, adapter_factory(clock))
    for spec in specs:
        await fed.add(spec)
    return fed


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """Federations and signals to close when the test ends."""
    things: list[Any] = []
    yield things
    for t in things:
        await (t.stop() if isinstance(t, GridSignals) else t.close())


async def signals_for(closing: list[Any], provider: Any, clock: ManualClock, cfg: CarbonForecastSettings,
                      *specs: SiteSpec) -> tuple[Federation, GridSignals]:
    """A federation of ``specs`` whose snapshots read the forecasts of signals on ``provider`` (no refresh task:
    the test calls ``refresh()``)."""
    fed = await federation(clock, *specs)
    signals = GridSignals(provider, cfg, clock, zones=lambda: {m.spec.grid_zone for m in fed.members.values()})
    fed.signals = signals
    closing += [fed, signals]
    return fed, signals


def row(snap: Any, name: str) -> np.ndarray:
    return snap.carbon_forecast[snap.index[name]]


# --- (a) the forecast in the snapshot: hour 0 is now's hour, and nothing after now is read --------------------------

DATA_AFTER_NOW = [
    pytest.param(lambda v, i: v, id="the shipped files, which go on for a week after now"),
    pytest.param(lambda v, i: np.concatenate([v[:i], np.full(len(v) - i, 1e6)]),
                 id="files whose values from now's hour on are poisoned with 1e6"),
    pytest.param(lambda v, i: v[:i], id="files that end where now's hour begins"),
]


@pytest.mark.parametrize("model", ["seasonal_naive", "holt_winters", "auto"])
@pytest.mark.parametrize("after_now", DATA_AFTER_NOW)
async def test_the_snapshot_forecast_starts_at_nows_hour_and_reads_only_the_past(carbon, closing, model,
                                                                                  after_now) -> None:
    zones = ("GB", "DE-LU")
    provider = FileCarbonProvider(edited(carbon, zones, after_now))
    clock = ManualClock(NOW)
    cfg = settings(model=model)
    fed, signals = await signals_for(closing, provider, clock, cfg, LONDON, FRANKFURT)
    await signals.refresh()
    snap = fed.freeze(NOW)
    assert snap.carbon_forecast.shape == (2, cfg.reach_h)  # the model's 48 h, then the mean day to a week
    for name, zone in (("london", "GB"), ("frankfurt", "DE-LU")):
        past = carbon.series(zone, HOUR - 336 * H, 336)  # the 336 hours before now's hour, from the real files
        _, want, _ = fit_forecast(np.array(past), cfg, zone)
        np.testing.assert_allclose(row(snap, name), want, rtol=1e-12)
        assert np.all(row(snap, name) < 1e5)
        assert signals.zones[zone].forecast.first_hour == HOUR
    np.testing.assert_array_equal(snap.carbon_g_per_kwh, snap.carbon_forecast[:, 0])


async def test_hour_0_is_nows_hour_seasonal_naive_repeats_yesterdays_same_hour(carbon, closing) -> None:
    clock = ManualClock(NOW)
    fed, signals = await signals_for(closing, FileCarbonProvider(carbon), clock, settings(model="seasonal_naive"),
                                     LONDON)
    await signals.refresh()
    got = row(fed.freeze(NOW), "london")
    yesterday = carbon.series("GB", HOUR - 24 * H, 24)  # 12:00 yesterday .. 11:00 today
    np.testing.assert_array_equal(got[:48], np.tile(yesterday, 2))


async def test_past_the_models_horizon_each_hour_is_the_mean_of_that_hour_of_the_day_over_the_history(
        carbon, closing) -> None:
    """The row reaches a week: after the model's 48 hours, the 12:00 hours take the mean of the 14 (history_h
    336: fewer days than profile_days' 28) 12:00 values before now, and so on round the clock."""
    clock = ManualClock(NOW)
    cfg = settings(model="seasonal_naive")
    fed, signals = await signals_for(closing, FileCarbonProvider(carbon), clock, cfg, LONDON)
    await signals.refresh()
    got = row(fed.freeze(NOW), "london")
    assert got.shape == (168,) and cfg.reach_h == 168
    mean_day = np.array(carbon.series("GB", HOUR - 336 * H, 336)).reshape(14, 24).mean(axis=0)  # from 12:00
    np.testing.assert_allclose(got[48:], mean_day[np.arange(48, 168) % 24], rtol=1e-12)
    off = settings(model="seasonal_naive", reach_h=48)  # reach_h at most horizon_h: the model's hours alone
    _, values, _ = fit_forecast(np.array(carbon.series("GB", HOUR - 336 * H, 336)), off, "GB")
    np.testing.assert_array_equal(values, got[:48])


async def test_a_forecast_kept_past_its_horizon_is_not_taken_as_all_model_hours(carbon, closing) -> None:
    """A 4-hour horizon kept 6 hours: 5 hours on, no model hour is left, and 0 told the snapshot that every
    hour of the row was the model's (moves were then judged on the mean day past it as on a forecast)."""
    clock = ManualClock(NOW)
    cfg = settings(horizon_h=4, stale_after_s=6 * 3600)
    fed, signals = await signals_for(closing, FileCarbonProvider(carbon), clock, cfg, LONDON)
    await signals.refresh()
    assert fed.freeze(NOW + 2 * H).carbon_forecast_model_h == 2
    assert fed.freeze(NOW + 5 * H).carbon_forecast_model_h == 1


async def test_a_forecast_is_shifted_to_nows_hour_until_it_goes_stale(carbon, closing) -> None:
    clock = ManualClock(NOW)
    cfg = settings(stale_after_s=6 * 3600)
    fed, signals = await signals_for(closing, FileCarbonProvider(carbon), clock, cfg, LONDON)
    await signals.refresh()
    made = row(fed.freeze(NOW), "london").copy()
    shifted = row(fed.freeze(NOW + 2 * H), "london")  # no refresh in between
    np.testing.assert_array_equal(shifted[:-2], made[2:])
    # past its reach: round the mean day, a day back (hours 168 and 169 of the row made at NOW are its 144, 145)
    np.testing.assert_array_equal(shifted[-2:], made[144:146])
    assert fed.freeze(NOW).carbon_forecast_model_h == 48  # the model's hours, then the mean day's
    assert fed.freeze(NOW + 2 * H).carbon_forecast_model_h == 46  # a forecast two hours old: 46 left
    assert np.isnan(row(fed.freeze(NOW + 6 * H + timedelta(seconds=1)), "london")).all()
    assert np.isnan(row(fed.freeze(NOW - H), "london")).all(), "a forecast made after now's hour is not used"


async def test_a_zone_the_provider_cannot_answer_is_a_nan_row_and_the_others_are_unaffected(carbon, closing,
                                                                                            caplog) -> None:
    clock = ManualClock(NOW)
    fed, signals = await signals_for(closing, FileCarbonProvider(carbon, "data/carbon"), clock, settings(),
                                     LONDON, PARIS)
    with caplog.at_level(logging.WARNING, logger="broker.signals"):
        await signals.refresh()
    snap = fed.freeze(NOW)
    assert np.isnan(row(snap, "paris")).all() and np.isnan(snap.carbon_g_per_kwh[snap.index["paris"]])
    assert np.isfinite(row(snap, "london")).all()
    assert "zone FR: files data/carbon: no carbon data for this zone" in signals.zones["FR"].error
    assert "no forecast for this zone until a refresh succeeds" in caplog.text


# --- (b) the HTTP provider: one zone's outage keeps its last forecast, the other zone carries on ---------------------

SERVICE_NOW = datetime(2022, 6, 7, 6, tzinfo=UTC)  # inside the recordings (2022-06-01 .. 2022-06-07 23:00)


class FlakyElectricityMaps(FakeElectricityMaps):
    """The recorded service, with faults per service zone id (``DE`` is the files' ``DE-LU``)."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, tuple[int, float]] = {}  # zone -> (HTTP status, delay in seconds)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        fault = self.faults.get(request.query.get("zone", ""))
        if fault is None:
            return await super().handle(request)
        status, delay_s = fault
        await asyncio.sleep(delay_s)
        return web.json_response({"message": "scripted outage"}, status=status)


@pytest.fixture
async def service() -> AsyncIterator[FlakyElectricityMaps]:
    fake = FlakyElectricityMaps()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    yield fake
    await server.close()


OUTAGES = [
    pytest.param((503, 0.0), "HTTP 503 Service Unavailable; gave up after 1 attempt",
                 id="a zone whose service answers 503"),
    pytest.param((200, 1.0), "no answer within 0.2 s; gave up after 1 attempt",
                 id="a zone whose service answers slower than the timeout"),
    pytest.param((404, 0.0), "HTTP 404 Not Found: scripted outage", id="a zone the service says it does not know"),
]


@pytest.mark.parametrize(("fault", "reason"), OUTAGES)
async def test_a_failing_zone_keeps_its_last_forecast_until_stale_and_the_other_zone_is_unaffected(
        service, carbon, closing, caplog, fault, reason) -> None:
    clock = ManualClock(SERVICE_NOW)
    provider = HttpCarbonProvider(service.url, timeout_s=0.2, retries=0, clock=clock)
    cfg = settings(model="seasonal_naive", history_h=96, stale_after_s=3 * 3600)
    fed, signals = await signals_for(closing, provider, clock, cfg, LONDON, FRANKFURT)
    await signals.refresh()
    first = fed.freeze(clock.now())
    assert np.isfinite(first.carbon_forecast).all()

    service.faults["GB"] = fault
    await clock.advance(3600)
    with caplog.at_level(logging.WARNING, logger="broker.signals"):
        await signals.refresh()
    snap = fed.freeze(clock.now())
    np.testing.assert_array_equal(row(snap, "london")[:-1], row(first, "london")[1:])  # kept, shifted an hour
    assert reason in signals.zones["GB"].error
    assert "keeping the forecast made 2022-06-07 06:00 UTC" in caplog.text
    # frankfurt was refitted at 07:00: seasonal naive, so hour 0 is yesterday's 07:00
    assert signals.zones["DE-LU"].error is None and signals.zones["DE-LU"].forecast.first_hour == clock.now()
    assert row(snap, "frankfurt")[0] == carbon.intensity("DE-LU", clock.now() - 24 * H)

    await clock.advance(2.5 * 3600)  # 3.5 h after london's last good forecast: stale
    await signals.refresh()
    snap = fed.freeze(clock.now())
    assert np.isnan(row(snap, "london")).all()
    assert np.isfinite(row(snap, "frankfurt")).all()

    service.faults.clear()
    await clock.advance(3600)
    await signals.refresh()
    assert np.isfinite(fed.freeze(clock.now()).carbon_forecast).all(), "the zone is back once its service is"


async def test_a_gap_in_the_services_data_is_filled_in_every_round_as_the_hours_asked_for_slide_over_it(
        service, closing, caplog) -> None:
    # The service never has 2022-06-06 12:00. The first round asks for four days and fills it between its
    # neighbours; each later round asks for the last 23 hours, whose first hour is the gap at 2022-06-07 11:00:
    # that round asks for the whole window instead, and no round fails (it used to fail every round from then on).
    service.drop = {stamp(datetime(2022, 6, 6, 12, tzinfo=UTC))}
    clock = ManualClock(SERVICE_NOW)
    # no cache: its answers live for cache_ttl_s of real time, which this test's hours do not take
    provider = HttpCarbonProvider(service.url, timeout_s=2.0, retries=0, clock=clock, cache_ttl_s=0)
    fed, signals = await signals_for(closing, provider, clock, settings(model="seasonal_naive", history_h=96), LONDON)
    with caplog.at_level(logging.INFO, logger="broker.signals"):
        for _ in range(10):  # hourly rounds, 06:00 .. 15:00
            await signals.refresh()
            state = signals.zones["GB"]
            assert state.error is None and state.forecast.first_hour == clock.now(), state.error
            assert np.isfinite(row(fed.freeze(clock.now()), "london")).all()
            await clock.advance(3600)
    assert "asking for the whole history instead" in caplog.text
    # what the rounds kept is what one request for the whole window gives, the gap filled alike
    end = signals.zones["GB"].forecast.history_end
    whole = HttpCarbonProvider(service.url, timeout_s=2.0, retries=0, clock=clock)
    closing.append(whole)
    np.testing.assert_array_equal(signals.zones["GB"].history, await whole.history("GB", end - 96 * H, end))


async def test_a_round_after_a_good_one_asks_the_history_endpoint_alone(service, closing) -> None:
    clock = ManualClock(datetime(2022, 6, 7, 22, 5, tzinfo=UTC))  # the recorded history is 2022-06-07's
    provider = HttpCarbonProvider(service.url, timeout_s=2.0, retries=0, clock=clock, cache_ttl_s=0)  # (no cache)
    fed, signals = await signals_for(closing, provider, clock, settings(model="seasonal_naive", history_h=96), LONDON)
    await signals.refresh()
    await clock.advance(3600)
    asked = len(service.requests)
    await signals.refresh()
    assert signals.zones["GB"].error is None
    assert [e for e, _, _ in service.requests[asked:]] == ["history"]


# --- (c) prices from a price provider ---------------------------------------------------------------------------------


class CountingPrices:
    """A price provider that counts its lookups."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def usd_per_gpu_hour(self, site: SiteSpec, model: str, spot: bool = False) -> float | None:
        self.calls += 1
        return self.inner.usd_per_gpu_hour(site, model, spot)


GB_PRICED = site("london", region="gcp:europe-west2", grid_zone="GB", gpus={"l4": 8, "a100-40gb": 8},
                 usd_per_gpu_hour={"l4": 0.9, "a100-40gb": 99.0}, adapter=FAST)
ONPREM = site("lab", region="onprem:basement", grid_zone="GB", gpus={"l4": 8}, usd_per_gpu_hour={"l4": 0.5},
              adapter=FAST)


async def test_a_price_provider_overrides_the_spec_price_once_per_set_of_sites(closing) -> None:
    clock = ManualClock(NOW)
    listed = FilePriceProvider.load(str(PRICES))
    prices = CountingPrices(listed)
    fed = await federation(clock, GB_PRICED, ONPREM)
    closing.append(fed)
    fed.set_prices(prices)
    snap = fed.freeze(NOW)
    usd = snap.usd_per_gpu_hour
    gb, lab = snap.index["london"], snap.index["lab"]
    assert usd[gb, MODEL_INDEX["a100-40gb"]] == listed.table.price("gcp:europe-west2", "a100-40gb") != 99.0
    assert usd[gb, MODEL_INDEX["l4"]] == listed.table.price("gcp:europe-west2", "l4") != 0.9
    assert usd[lab, MODEL_INDEX["l4"]] == 0.5, "a region the list does not price keeps the spec's price"
    assert np.isnan(usd[lab, MODEL_INDEX["a100-40gb"]])
    looked_up = prices.calls
    for _ in range(3):  # passes: new reports, new snapshots, the same sites
        await fed.collect()
        fed.freeze(clock.now())
    assert prices.calls == looked_up
    await fed.add(site("berlin", region="gcp:europe-west3", grid_zone="DE-LU", gpus={"l4": 8}, adapter=FAST))
    snap = fed.freeze(NOW)
    assert prices.calls > looked_up and not np.isnan(snap.usd_per_gpu_hour[snap.index["berlin"], MODEL_INDEX["l4"]])


async def test_a_broker_configured_with_prices_uses_them(tmp_path) -> None:
    b = Broker(BrokerSettings(db=str(tmp_path / "p.db"), shutdown_grace_s=0.1,
                              prices={"kind": "files", "path": str(PRICES)}), clock=ManualClock(NOW))
    await b.start([GB_PRICED], run_loop=False)
    try:
        snap = b.federation.freeze(NOW)
        want = build_price_provider({"kind": "files", "path": str(PRICES)}).usd_per_gpu_hour(GB_PRICED, "a100-40gb")
        assert snap.usd_per_gpu_hour[0, MODEL_INDEX["a100-40gb"]] == want != 99.0
        assert b.signals is None and np.isnan(snap.carbon_g_per_kwh).all()
    finally:
        await b.stop()


# --- (d) end to end: a green job goes where the grid is forecast cleanest over its run ------------------------------

# 2022-06-15 02:00 UTC (11:00 in Tokyo): Tokyo's grid is forecast cleaner than Frankfurt's for this hour (and was:
# 430 against 548 gCO2e/kWh), Frankfurt's over the next twelve (and was: 402 against 478), as its sun comes up.
GREEN_AT = datetime(2022, 6, 15, 2, tzinfo=UTC)
GREEN_JOBS = [
    pytest.param(dict(duration_s=3600), "tokyo", id="a one-hour job goes to tokyo, cleaner in the hour it runs"),
    pytest.param(dict(duration_s=12 * 3600), "frankfurt",
                 id="a twelve-hour job goes to frankfurt, dirtier now but cleaner over the twelve hours"),
    pytest.param(dict(duration_s=3600, allowed_regions=["gcp:europe-west9", "gcp:europe-west3"]), "frankfurt",
                 id="a job allowed in paris and frankfurt goes to frankfurt: paris's zone has no forecast"),
]


@pytest.fixture
async def green_broker(tmp_path) -> AsyncIterator[Broker]:
    cfg = {"db": str(tmp_path / "g.db"), "shutdown_grace_s": 0.1, "carbon": {"kind": "files", "path": str(CARBON_DIR)},
           "carbon_forecast": {"history_h": 336}}
    b = Broker(BrokerSettings.model_validate(cfg), clock=ManualClock(GREEN_AT))
    await b.start([FRANKFURT, PARIS, TOKYO], run_loop=False)
    await asyncio.wait_for(b.signals.wait_ready(), 30)
    yield b
    await b.stop()


@pytest.mark.parametrize(("spec", "chosen"), GREEN_JOBS)
async def test_a_green_job_goes_to_the_site_whose_grid_is_cleaner_over_its_run(green_broker, spec, chosen) -> None:
    b = green_broker
    j, _ = await b.book.submit(job(count=1, profile="green", **spec))
    await b.cycle.run_once()
    placed = await b.book.get(j.id)
    assert placed.state == JobState.DISPATCHING and placed.site == chosen
    stored = await b.store.get_decision(j.id)
    why = explain.render(stored.record, JobRequest.from_spec(j.id, j.spec), b.cycle.filters, stored.attempt)
    carbon_kg = {v.site: next(t.raw for t in v.terms if t.scorer == "carbon") for v in why.sites if v.feasible}
    assert carbon_kg["paris"] is None  # no forecast: no value in kg CO2e (the scorer ranks it last)
    known = {site: kg for site, kg in carbon_kg.items() if kg is not None}
    assert min(known, key=known.get) == chosen  # the explanation shows why


# --- the refresh task and the broker's life cycle -----------------------------------------------------------------


class CountingCarbon:
    """A carbon provider over files that counts history requests per zone, and can be made to hang."""

    def __init__(self, inner: FileCarbonProvider) -> None:
        self.inner = inner
        self.asked: Counter[str] = Counter()
        self.spans: list[tuple[str, datetime, datetime]] = []
        self.hang = False
        self.closed = False

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        self.asked[zone] += 1
        self.spans.append((zone, start, end))
        if self.hang:
            await asyncio.Event().wait()
        return await self.inner.history(zone, start, end)

    async def latest(self, zone: str, now: datetime) -> float:
        return await self.inner.latest(zone, now)

    async def close(self) -> None:
        self.closed = True


async def eventually(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_later_rounds_ask_only_for_the_new_hours_and_the_23_before_them_again(carbon, closing) -> None:
    provider = CountingCarbon(FileCarbonProvider(carbon))
    clock = ManualClock(NOW)
    fed, signals = await signals_for(closing, provider, clock, settings(), LONDON)
    await signals.refresh()
    await clock.advance(3 * 3600)
    await signals.refresh()
    # the new hours and the 23 before them that the HTTP provider's history endpoint answers with
    assert provider.spans == [("GB", HOUR - 336 * H, HOUR), ("GB", HOUR - 20 * H, HOUR + 3 * H)]
    once = await signals_for(closing, FileCarbonProvider(carbon), clock, settings(), LONDON)
    await once[1].refresh()  # the same hour, everything fetched at once
    np.testing.assert_array_equal(row(fed.freeze(clock.now()), "london"), row(once[0].freeze(clock.now()), "london"))
    await clock.advance(340 * 3600)  # more than history_h later: nothing kept is wanted, all is asked again
    await signals.refresh()
    assert provider.spans[-1] == ("GB", HOUR + 7 * H, HOUR + 343 * H)


@pytest.fixture
def make_broker(tmp_path) -> Iterator[Callable[..., Broker]]:
    def make(provider: Any, clock: ManualClock, **cfg: Any) -> Broker:
        s = BrokerSettings.model_validate({"db": str(tmp_path / "s.db"), "shutdown_grace_s": 0.1,
                                           "carbon_forecast": {"history_h": 336, **cfg}})
        return Broker(s, clock=clock, carbon=provider)

    yield make


async def test_the_broker_refreshes_every_refresh_s_and_fetches_a_new_zone_at_once(carbon, make_broker) -> None:
    provider = CountingCarbon(FileCarbonProvider(carbon))
    clock = ManualClock(NOW)
    b = make_broker(provider, clock, refresh_s=3600)
    await b.start([LONDON], run_loop=False)
    try:
        await asyncio.wait_for(b.signals.wait_ready(), 10)
        assert provider.asked == {"GB": 1}
        await clock.advance(1800)
        await asyncio.sleep(0.05)
        assert provider.asked == {"GB": 1}, "no round before refresh_s"
        await clock.advance(1800)
        await eventually(lambda: provider.asked["GB"] == 2)
        await b.register_site(FRANKFURT)
        b.federation.freeze(clock.now())  # a snapshot that asks for a zone never fetched wakes the task
        await eventually(lambda: b.signals.zones.get("DE-LU") is not None
                         and b.signals.zones["DE-LU"].forecast is not None)
        assert provider.asked == {"GB": 2, "DE-LU": 1}
    finally:
        await b.stop()
    assert provider.closed


async def test_stopping_the_broker_mid_refresh_cancels_it_and_closes_the_provider(carbon, make_broker) -> None:
    provider = CountingCarbon(FileCarbonProvider(carbon))
    provider.hang = True
    b = make_broker(provider, ManualClock(NOW))
    await b.start([LONDON], run_loop=False)
    await eventually(lambda: provider.asked["GB"] == 1)
    await asyncio.wait_for(b.stop(), 5)
    assert provider.closed and b.signals is None


@pytest.mark.parametrize(("cfg", "message"), [
    pytest.param({"carbon": {"kind": "files", "path": "/nonexistent/carbon"}}, "broker.carbon: ",
                 id="a carbon folder that does not exist stops the start naming broker.carbon"),
    pytest.param({"carbon": {"kind": "http", "url": "http://127.0.0.1:9", "token_env": "HELIOTROPE_NO_SUCH_TOKEN"}},
                 "broker.carbon: carbon provider: token_env names $HELIOTROPE_NO_SUCH_TOKEN, which is not set",
                 id="an unset token variable stops the start naming broker.carbon and the variable"),
    pytest.param({"prices": {"kind": "files", "path": "/nonexistent/prices.csv"}}, "broker.prices: ",
                 id="a price list that does not exist stops the start naming broker.prices"),
])
async def test_a_provider_that_cannot_be_built_stops_the_start_with_a_config_error(tmp_path, cfg, message) -> None:
    b = Broker(BrokerSettings.model_validate({"db": str(tmp_path / "e.db"), **cfg}), clock=ManualClock(NOW))
    with pytest.raises(ConfigError) as err:
        await b.start([LONDON], run_loop=False)
    assert str(err.value).startswith(message)


# --- the forecasts kept in the store: a broker that starts while its provider is down -------------------------------


class DownCarbon:
    """A carbon provider whose service is down: every request fails at once."""

    def __init__(self) -> None:
        self.asked = 0

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        self.asked += 1
        raise ProviderError("connection refused (scripted outage)", zone=zone, where="http://127.0.0.1:9")

    async def latest(self, zone: str, now: datetime) -> float:
        raise ProviderError("connection refused (scripted outage)", zone=zone, where="http://127.0.0.1:9")

    async def close(self) -> None:
        """Nothing to close: it holds no connection (a provider's interface asks for the method)."""


async def fetched_and_stopped(carbon: CarbonData, make_broker: Callable[..., Broker], at: datetime = NOW,
                              **cfg: Any) -> np.ndarray:
    """A broker on the files that fetches its forecasts at ``at`` and stops: what london's row was then."""
    b = make_broker(FileCarbonProvider(carbon), ManualClock(at), **cfg)
    await b.start([LONDON, FRANKFURT], run_loop=False)
    try:
        await asyncio.wait_for(b.signals.wait_ready(), 10)
        made = row(b.federation.freeze(at), "london").copy()
        assert np.isfinite(made).all()
    finally:
        await b.stop()
    return made


async def _both_forecasts_still_kept(make_broker) -> None:  # noqa: ANN001
    """A broker started later, its provider still down and its store answering, finds both zones' kept forecasts."""
    again = await started_down(make_broker, ManualClock(NOW + 5 * H))
    try:
        assert again.signals.kept_in_use(again.clock.now()) == 2
    finally:
        await again.stop()


async def started_down(make_broker: Callable[..., Broker], clock: ManualClock, **cfg: Any) -> Broker:
    """A broker on the same database whose carbon provider is down, its first round over (failed)."""
    b = make_broker(DownCarbon(), clock, **cfg)
    await b.start([LONDON, FRANKFURT], run_loop=False)
    await asyncio.wait_for(b.signals.wait_ready(), 10)
    return b


async def test_a_broker_restarted_with_its_provider_down_forecasts_from_what_it_kept_until_6_h_after_the_fetch(
        carbon, make_broker, caplog) -> None:
    # A running broker keeps its last forecast 6 h when its provider fails; a restarted one had none at all, so
    # its first pass decided every deferred job carbon-blind. The kept forecast lapses 6 h after it was
    # fetched, not 6 h after the restart; the provider's data, once it answers, replaces it.
    made = await fetched_and_stopped(carbon, make_broker)
    clock = ManualClock(NOW + 5 * H)
    with caplog.at_level(logging.INFO, logger="broker.signals"):
        b = await started_down(make_broker, clock)
    try:
        snap = b.federation.freeze(clock.now())
        np.testing.assert_array_equal(row(snap, "london")[:-5], made[5:])  # as the running broker shifts it
        assert snap.carbon_forecast_model_h == 43
        assert "took up the forecasts kept in the store for DE-LU (made 2022-06-15 12:20 UTC), GB (made" in caplog.text
        assert "keeping the forecast made 2022-06-15 12:20 UTC (kept in the store)" in caplog.text
        assert b.signals.kept_in_use(clock.now()) == 2
        await clock.advance(3600)  # 6 h after the fetch, to the second
        assert np.isfinite(b.federation.freeze(clock.now()).carbon_forecast).all()
        await clock.advance(1)
        assert np.isnan(b.federation.freeze(clock.now()).carbon_forecast).all(), "stale 6 h after the fetch"
        # the provider is back: its data replaces the kept forecasts
        b.signals.provider = FileCarbonProvider(carbon)
        await b.signals.refresh()
        assert b.signals.kept_in_use(clock.now()) == 0
        assert b.signals.zones["GB"].forecast.made_at == clock.now()
        assert np.isfinite(b.federation.freeze(clock.now()).carbon_forecast).all()
    finally:
        await b.stop()


async def test_kept_forecasts_older_than_stale_after_s_are_not_used(carbon, make_broker, caplog) -> None:
    await fetched_and_stopped(carbon, make_broker)
    clock = ManualClock(NOW + 6 * H + timedelta(seconds=1))
    with caplog.at_level(logging.INFO, logger="broker.signals"):
        b = await started_down(make_broker, clock)
    try:
        assert ("zone GB: its forecast kept in the store (made 2022-06-15 12:20 UTC) is older than stale_after_s "
                "(21600 s): not used") in caplog.text
        assert np.isnan(b.federation.freeze(clock.now()).carbon_forecast).all()
        assert b.signals.zones["GB"].forecast is None
    finally:
        await b.stop()
    # and the stop saved nothing over them: a broker with its provider down has nothing new to keep
    again = await started_down(make_broker, ManualClock(NOW + 5 * H))
    try:
        assert again.signals.kept_in_use(again.clock.now()) == 2
    finally:
        await again.stop()


def reads_failing(monkeypatch: pytest.MonkeyPatch, b: Broker, failures: int | None) -> list[float]:
    """Make ``b``'s store fail its first ``failures`` reads of the kept forecasts (None: every read), as a
    PostgreSQL that is restarting does; returns when each read came (monotonic)."""
    store_type = type(b.store)
    real = store_type.get_state
    reads: list[float] = []

    async def flaky(self: Any, name: str) -> str | None:
        if name == FORECASTS_STATE:
            reads.append(time.monotonic())
            if failures is None or len(reads) <= failures:
                raise StoreError("connection refused (the database is restarting)")
        return await real(self, name)

    monkeypatch.setattr(store_type, "get_state", flaky)
    return reads


@pytest.mark.parametrize("failures", [1, 3], ids=["the first read fails", "the first three reads fail"])
async def test_kept_forecasts_a_store_could_not_read_at_first_are_read_again_before_the_first_pass(
        carbon, make_broker, monkeypatch, caplog, failures: int) -> None:
    # A store briefly away at the start (PostgreSQL restarting with the broker) left the zones without their kept
    # forecasts until a round succeeded, with the provider down: the first pass decided every deferred job
    # carbon-blind. The reads go on in the background (the start is not held up), and the first pass waits for them.
    made = await fetched_and_stopped(carbon, make_broker)
    clock = ManualClock(NOW + 5 * H)
    b = make_broker(DownCarbon(), clock)
    reads = reads_failing(monkeypatch, b, failures)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="broker.signals"):
        await b.start([LONDON, FRANKFURT], run_loop=False)
        assert time.monotonic() - started < 1.0, "the start waits for no second read"
        try:
            await asyncio.wait_for(b.signals.wait_ready(), 10)
            assert len(reads) == failures + 1 and b.signals.kept_in_use(clock.now()) == 2
            np.testing.assert_array_equal(row(b.federation.freeze(clock.now()), "london")[:-5], made[5:])
            assert "could not read the forecasts kept in the store (connection refused" in caplog.text
            assert f"read the forecasts kept in the store at try {failures + 1}" in caplog.text
        finally:
            await b.stop()


async def test_a_store_that_stays_away_is_given_up_within_its_bound_and_the_zones_go_without(
        carbon, make_broker, monkeypatch, caplog) -> None:
    await fetched_and_stopped(carbon, make_broker)
    monkeypatch.setattr("broker.signals.RESTORE_RETRY_S", 1.0)
    clock = ManualClock(NOW + 5 * H)
    b = make_broker(DownCarbon(), clock)
    reads = reads_failing(monkeypatch, b, None)
    with caplog.at_level(logging.WARNING, logger="broker.signals"):
        await b.start([LONDON, FRANKFURT], run_loop=False)
        started = time.monotonic()
        try:
            await asyncio.wait_for(b.signals.wait_ready(), 10)
            assert time.monotonic() - started < 2.0 and len(reads) >= 3
            assert b.signals.kept_in_use(clock.now()) == 0
            assert f"could not read the forecasts kept in the store in {len(reads)} tries within 1 s" in caplog.text
        finally:
            await b.stop()
    # the stop saved nothing over them (no round made a forecast): once the store answers, they are there
    monkeypatch.undo()
    await _both_forecasts_still_kept(make_broker)


def _doc(**edit: Any) -> Callable[[dict[str, Any]], Any]:
    def apply(doc: dict[str, Any]) -> Any:
        return doc | edit
    return apply


def _zone_entry(zone: str, **edit: Any) -> Callable[[dict[str, Any]], Any]:
    def apply(doc: dict[str, Any]) -> Any:
        doc["zones"][zone] = doc["zones"][zone] | edit
        return doc
    return apply


CORRUPT = [
    pytest.param(lambda doc: "{not json", "ignoring the forecasts kept in the store: Expecting property name",
                 2, id="not JSON"),
    pytest.param(lambda doc: [1, 2, 3], "ignoring the forecasts kept in the store: format None, where this "
                 "release reads 1", 2, id="not an object"),
    pytest.param(lambda doc: {"GB": doc["zones"]["GB"]["values"]}, "ignoring the forecasts kept in the store: "
                 "format None, where this release reads 1", 2, id="an older format with no version"),
    pytest.param(_doc(version=2), "ignoring the forecasts kept in the store: format 2, where this release reads 1",
                 2, id="a later format"),
    pytest.param(_doc(zones=[]), "ignoring the forecasts kept in the store: zones: Input should be a valid "
                 "dictionary", 2, id="zones not an object"),
    pytest.param(_doc(horizon_h=24), "ignoring the forecasts kept in the store: made with horizon_h 24 and "
                 "reach_h 168, where 48 and 168 are configured", 2, id="made with another horizon"),
    pytest.param(_zone_entry("GB", values=[1.0, 2.0]), "zone GB: ignoring its forecast kept in the store: "
                 "2 values, not 168", 1, id="a zone's row of the wrong length: that zone only"),
    pytest.param(_zone_entry("GB", made_at="yesterday"), "zone GB: ignoring its forecast kept in the store: "
                 "made_at: Input should be a valid datetime", 1, id="a zone's time that is not one"),
    pytest.param(_zone_entry("GB", made_at="2022-06-15T12:20:00"), "zone GB: ignoring its forecast kept in the "
                 "store: made_at: Input should have timezone info", 1, id="a zone's time with no offset"),
    pytest.param(_zone_entry("GB", first_hour="2022-06-15T11:00:00+00:00"), "zone GB: ignoring its forecast kept "
                 "in the store: its first hour is not the hour it was made in", 1, id="a zone's row shifted"),
    pytest.param(_zone_entry("GB", values="NaN"), "zone GB: ignoring its forecast kept in the store: values: "
                 "Input should be a valid list", 1, id="a zone's values not a list"),
    pytest.param(_zone_entry("GB", surprise=1), "zone GB: ignoring its forecast kept in the store: surprise: "
                 "unknown field (check the spelling)", 1, id="a zone's entry with a field it does not know"),
]


@pytest.mark.parametrize(("corrupt", "warning", "broken"), CORRUPT)
async def test_a_kept_document_that_cannot_be_read_is_ignored_with_a_warning(carbon, make_broker, tmp_path, caplog,
                                                                             corrupt, warning, broken) -> None:
    import json

    from broker.signals import FORECASTS_STATE
    from broker.store import open_store

    await fetched_and_stopped(carbon, make_broker)
    store = open_store(str(tmp_path / "s.db"))
    await store.open()
    try:
        doc = json.loads(await store.get_state(FORECASTS_STATE))
        bad = corrupt(doc)
        await store.put_state(FORECASTS_STATE, bad if isinstance(bad, str) else json.dumps(bad))
    finally:
        await store.close()
    clock = ManualClock(NOW + H)
    with caplog.at_level(logging.WARNING, logger="broker.signals"):
        b = await started_down(make_broker, clock)
    try:
        assert warning in caplog.text
        snap = b.federation.freeze(clock.now())
        assert np.isnan(row(snap, "london")).all()
        assert np.isnan(row(snap, "frankfurt")).all() == (broken == 2), "one zone's bad entry costs that zone only"
    finally:
        await b.stop()


async def test_forecasts_kept_with_nan_values_are_ignored(carbon, make_broker, tmp_path, caplog) -> None:
    # (Python's json writes and reads NaN; a kept row with one would rank the zone's sites as unknown hours.)
    import json

    from broker.signals import FORECASTS_STATE
    from broker.store import open_store

    await fetched_and_stopped(carbon, make_broker)
    store = open_store(str(tmp_path / "s.db"))
    await store.open()
    try:
        doc = json.loads(await store.get_state(FORECASTS_STATE))
        doc["zones"]["GB"]["values"][3] = float("nan")
        await store.put_state(FORECASTS_STATE, json.dumps(doc))
    finally:
        await store.close()
    with caplog.at_level(logging.WARNING, logger="broker.signals"):
        b = await started_down(make_broker, ManualClock(NOW + H))
    try:
        assert "zone GB: ignoring its forecast kept in the store: values[3]: Input should be a finite number" \
            in caplog.text
        assert b.signals.zones["GB"].forecast is None and b.signals.zones["DE-LU"].forecast is not None
    finally:
        await b.stop()


async def test_the_kept_document_holds_only_the_wanted_zones_fresh_rows(carbon, make_broker, tmp_path) -> None:
    import json

    from broker.signals import FORECASTS_STATE
    from broker.store import open_store

    await fetched_and_stopped(carbon, make_broker)
    store = open_store(str(tmp_path / "s.db"))
    await store.open()
    try:
        doc = json.loads(await store.get_state(FORECASTS_STATE))
    finally:
        await store.close()
    assert doc["version"] == 1 and (doc["horizon_h"], doc["reach_h"]) == (48, 168)
    assert sorted(doc["zones"]) == ["DE-LU", "GB"]
    assert {len(z["values"]) for z in doc["zones"].values()} == {168}
    assert len(json.dumps(doc)) < 2 * 168 * 25  # a row of reach_h numbers a zone, not history_h hours of history


async def test_a_replica_that_takes_over_with_its_provider_down_forecasts_from_what_the_last_leader_kept(
        carbon, tmp_path, caplog) -> None:
    # The leader keeps its forecasts in the shared store as it makes them, not only when it stops: a leader that
    # dies leaves them for the next one too.
    from broker.config import ReplicaSettings
    from broker.signals import FORECASTS_STATE

    def replica(provider: Any, clock: ManualClock) -> Broker:
        s = BrokerSettings.model_validate({"db": str(tmp_path / "r.db"), "shutdown_grace_s": 0.1,
                                           "carbon_forecast": {"history_h": 336}})
        return Broker(s.model_copy(update={"replicas": ReplicaSettings(lease_s=1.0)}), clock=clock,
                      carbon=provider)

    first = replica(FileCarbonProvider(carbon), ManualClock(NOW))
    await first.start([LONDON, FRANKFURT], run_loop=False)
    try:
        first.elect("http://127.0.0.1:1")
        await eventually(lambda: first.in_charge and first.signals is not None and first.signals.rounds == 1)
        made = row(first.federation.freeze(NOW), "london").copy()
        await eventually(lambda: first.signals._saved_changes == 2)
        assert await first.store.get_state(FORECASTS_STATE) is not None, "kept while it leads"
    finally:
        await first.stop()
    clock = ManualClock(NOW + 2 * H)
    second = replica(DownCarbon(), clock)
    await second.start([LONDON, FRANKFURT], run_loop=False)
    try:
        with caplog.at_level(logging.INFO, logger="broker.signals"):
            second.elect("http://127.0.0.1:1")
            await eventually(lambda: second.in_charge and second.signals is not None and second.signals.rounds == 1)
        assert "took up the forecasts kept in the store" in caplog.text
        np.testing.assert_array_equal(row(second.federation.freeze(clock.now()), "london")[:-2], made[2:])
    finally:
        await second.stop()


async def test_forecasts_are_kept_as_rounds_make_them_at_most_every_five_minutes_and_at_stop(carbon,
                                                                                             make_broker) -> None:
    import json

    from broker.signals import FORECASTS_SAVE_S, FORECASTS_STATE

    clock = ManualClock(NOW)
    b = make_broker(FileCarbonProvider(carbon), clock, refresh_s=60, stale_after_s=3600)
    await b.start([LONDON], run_loop=False)

    async def kept_made_at() -> str:
        return json.loads(await b.store.get_state(FORECASTS_STATE))["zones"]["GB"]["made_at"]

    try:
        await asyncio.wait_for(b.signals.wait_ready(), 10)
        await eventually(lambda: b.signals._saved_changes == 1)
        assert await kept_made_at() == NOW.isoformat(), "the first round's, at once"
        assert FORECASTS_SAVE_S == 300
        for _ in range(4):  # rounds at +1 .. +4 minutes: not kept yet
            rounds = b.signals.rounds
            await clock.advance(60)
            await eventually(lambda: b.signals.rounds == rounds + 1)
            assert await kept_made_at() == NOW.isoformat()
        await clock.advance(60)  # five minutes after the last save: the round's forecast is kept
        await eventually(lambda: b.signals._saved_changes == 6)
        assert await kept_made_at() == (NOW + timedelta(minutes=5)).isoformat()
        await clock.advance(60)
        await eventually(lambda: b.signals.rounds == 7)
    finally:
        await b.stop()
    reopened = make_broker(DownCarbon(), clock, refresh_s=60, stale_after_s=3600)
    await reopened.start([LONDON], run_loop=False)
    try:
        assert reopened.signals.zones["GB"].forecast.made_at == NOW + timedelta(minutes=6), "and when it stops"
    finally:
        await reopened.stop()


class HalfDownCarbon:
    """The files, with Germany's zone down: a round makes london's forecast only."""

    def __init__(self, inner: FileCarbonProvider) -> None:
        self.inner = inner

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        if zone == "DE-LU":
            raise ProviderError("connection refused (scripted outage)", zone=zone, where="http://127.0.0.1:9")
        return await self.inner.history(zone, start, end)

    async def latest(self, zone: str, now: datetime) -> float:
        if zone == "DE-LU":
            raise ProviderError("connection refused (scripted outage)", zone=zone, where="http://127.0.0.1:9")
        return await self.inner.latest(zone, now)

    async def close(self) -> None:
        await self.inner.close()


async def test_a_broker_stopped_while_it_still_reads_its_kept_forecasts_again_saves_nothing_over_them(
        carbon, make_broker, monkeypatch) -> None:  # noqa: ANN001
    # The store could not be read at the start, and the broker stops before a read again succeeds (or gives up):
    # its final save wrote what its first round made (london's, Germany's service being down) as the whole
    # of the kept forecasts, and frankfurt's kept forecast was gone for the next start.
    await fetched_and_stopped(carbon, make_broker)
    clock = ManualClock(NOW + 5 * H)
    b = make_broker(HalfDownCarbon(FileCarbonProvider(carbon)), clock)
    reads_failing(monkeypatch, b, None)
    await b.start([LONDON, FRANKFURT], run_loop=False)
    try:
        for _ in range(200):  # the first round made london's
            if (z := b.signals.zones.get("GB")) is not None and z.forecast is not None:
                break
            await asyncio.sleep(0.02)
        assert b.signals._restore_pending()
    finally:
        await b.stop()
    monkeypatch.undo()
    await _both_forecasts_still_kept(make_broker)
