"""Grid signals for the live broker: an hourly carbon-intensity forecast per grid zone, kept fresh in the
background, and the price matrix of a configured price provider.

Carbon forecasts (:class:`GridSignals`)
    On :meth:`GridSignals.start` and then every ``refresh_s`` (default 3600 s), for every grid zone of the
    registered sites, concurrently and each zone on its own: ask the carbon provider
    (:mod:`broker.providers.carbon`) for the ``history_h`` hours before the hour containing ``now`` (default
    672 h, four weeks), fit a :class:`broker.forecast.Forecaster` on them and keep its ``horizon_h``-hour
    forecast (default 48 h) starting at ``now``'s hour. Only past hours are read: the hour containing ``now``
    is the forecast's first hour, never part of its history. After a zone's first good round only the hours
    since then are asked for, and at least the last :data:`REFETCH_H` hours (23) again, so that a service's
    revisions of recent hours are used (with the HTTP provider and hourly rounds that is one ``history``
    request a round instead of four weeks of ``past-range``). Where those hours cannot be read (a gap in the
    service's data at their start, which cannot be interpolated there), the round asks for the whole window. A zone that a new site brings is fetched as soon as a snapshot asks for
    it, without waiting for the next round.

    Models (``model``): ``seasonal_naive`` (the value one season earlier, ``season_h`` 24 or 168),
    ``holt_winters`` (damped Holt-Winters, its parameters fitted on the history each round), or ``auto``
    (default): both are fitted and the one with the lower in-sample MAE wins, scored as
    :func:`broker.forecast.choose_models` scores a training span (every 1..``horizon_h``-step forecast made
    after the first :data:`~broker.forecast.WARMUP_H` hours of the history whose targets lie in the history;
    ties go to seasonal-naive). Holt-Winters and ``auto`` need ``history_h >= WARMUP_H + horizon_h``.

    When a zone's round fails (the service is down, the files do not cover the hours, the series cannot be
    fitted), the failure is logged at WARNING with the provider's one-line reason, the other zones carry on,
    and that zone keeps its last forecast until it is older than ``stale_after_s`` (default 6 h); after
    that the zone has no forecast until a round succeeds.

    Past the model's ``horizon_h`` the row goes on to ``reach_h`` hours (default 168, a week: as far as the
    time-shift search plans a start) with the zone's mean day: each hour takes the mean of the same hour of
    the day over the last ``profile_days`` days of the history (default 28; :func:`broker.forecast.
    daily_profile`). A model's skill fades within a day or two, and a job that runs for days is judged on
    the zone's typical day instead of the model's last hour stretched over its whole run. ``reach_h`` at
    most ``horizon_h`` turns it off.

    :meth:`GridSignals.forecast_rows` is what the snapshot path calls (synchronous, no I/O): one row per
    site's zone, ``reach_h`` hourly values from the hour containing ``now``. A forecast made in an earlier
    hour is shifted so that column 0 is always ``now``'s hour; the hours it no longer covers at the end go
    on round the mean day (a day back in the row), or take its last value where the row has no mean day
    (as the carbon scorer does past a forecast's end); :meth:`GridSignals.model_hours` says how many of the
    shifted row's hours are still the model's. A zone with no usable forecast
    (none yet, stale, or made in a later hour than ``now``'s) is a row of NaN: the carbon scorer ranks such a
    site after every site with one.

    ``replay_day`` (for demos on files data from the past): the broker's current day is mapped onto that
    date, time of day kept, so a files provider on an old slice answers as if it were live; the mapping is
    fixed when the signals start.

Prices (:func:`price_matrix`)
    The snapshot's ``usd_per_gpu_hour`` from a :class:`~broker.providers.prices.PriceProvider`, one row per
    site (name order), NaN where nothing prices a model; the federation computes it once per change of the
    set of sites, not per pass.

Units: gCO2e/kWh (direct, or life-cycle if the provider is so configured), hourly, UTC; US dollars per GPU
per hour. To turn carbon signals off leave ``broker.carbon`` unset (every site is then unknown to the carbon
scorer); to turn the price override off leave ``broker.prices`` unset or set ``{kind: static}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Literal, Protocol

import numpy as np
from pydantic import Field, model_validator

from broker.clock import Clock
from broker.forecast import (
    PROFILE_DAYS,
    REACH_H,
    WARMUP_H,
    ExponentialSmoothing,
    ForecastError,
    Forecaster,
    Model,
    SeasonalNaive,
    daily_profile,
    extend_by_profile,
    forecast_matrix,
    mae,
)
from broker.ids import UnknownIdentifier, grid_zone
from broker.models import SiteSpec, Strict
from broker.providers.carbon import CarbonProvider, ProviderError
from broker.providers.prices import PriceProvider
from policies.snapshot import MODEL_INDEX, N_MODELS

__all__ = [
    "REFETCH_H",
    "CarbonForecastSettings",
    "FittedForecast",
    "GridSignals",
    "ZoneState",
    "fit_forecast",
    "price_matrix",
]

log = logging.getLogger(__name__)

_HOUR = timedelta(hours=1)

REFETCH_H = 23
"""Hours before the forecast's first hour that each round asks for again (revisions of recent hours): the
hours before the current one that the HTTP provider's ``history`` endpoint answers with (its last 24 hours
include the current one), so that a round that follows a good one makes that one request."""

ModelChoice = Literal["seasonal_naive", "holt_winters", "auto"]


class CarbonForecastSettings(Strict):
    """``broker.carbon_forecast``: how the live broker forecasts each zone's carbon intensity (used only when
    ``broker.carbon`` names a provider)."""

    refresh_s: float = Field(default=3600.0, ge=1, le=86_400,
                             description="seconds between rounds of fetching history and refitting every zone")
    history_h: int = Field(default=672, ge=24, le=24 * 366,
                           description="hours of past intensity fetched per zone and round (672 = four weeks)")
    horizon_h: int = Field(default=48, ge=1, le=24 * 14, description="hours forecast from now's hour")
    reach_h: int = Field(default=REACH_H, ge=1, le=24 * 14,
                         description="hours each zone's row reaches: past horizon_h, the zone's mean day over the "
                                     "last profile_days days (horizon_h or less: the model's hours alone)")
    profile_days: int = Field(default=PROFILE_DAYS, ge=1, le=366,
                              description="days of history the mean day past horizon_h is taken over (those "
                                          "history_h holds, where it holds fewer)")
    model: ModelChoice = Field(default="auto", description="seasonal_naive, holt_winters, or auto: the one with "
                               "the lower in-sample MAE over the history")
    season_h: Literal[24, 168] = Field(default=24, description="the seasonal-naive model's season: 24 (daily) "
                                       "or 168 (weekly)")
    stale_after_s: float = Field(default=6 * 3600.0, gt=0, description="a zone whose refreshes fail keeps its "
                                 "last forecast this long, then has none")
    fetch_timeout_s: float = Field(default=300.0, gt=0, description="longest one zone's fetch may take (retries "
                                   "included) before that zone's round counts as failed")
    replay_day: date | None = Field(default=None, description="demos on past files data: the broker's current "
                                    "day is read from the data as this date (time of day kept)")

    @property
    def min_history_h(self) -> int:
        """Hours of history the chosen model needs (seasonal naive: one season; Holt-Winters and auto: the
        warm-up week plus one horizon, to fit and score)."""
        if self.model == "seasonal_naive":
            return self.season_h
        return WARMUP_H + self.horizon_h

    @model_validator(mode="after")
    def _consistent(self) -> CarbonForecastSettings:
        if self.history_h < self.min_history_h:
            why = (f"one {self.season_h} h season" if self.model == "seasonal_naive"
                   else f"{WARMUP_H} h of warm-up + the {self.horizon_h} h horizon, to fit and score")
            raise ValueError(f"history_h {self.history_h} is too short for model {self.model}: it needs at least "
                             f"{self.min_history_h} hours ({why}); raise history_h or lower horizon_h")
        if self.stale_after_s < self.refresh_s:
            raise ValueError(f"stale_after_s ({self.stale_after_s:g}) must be at least refresh_s "
                             f"({self.refresh_s:g}), or every forecast would go stale before the next round")
        return self


# --- fitting ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FittedForecast:
    """One zone's forecast: ``values[i]`` (gCO2e/kWh) is the forecast of ``[first_hour + i h, + 1 h)``.

    ``first_hour`` and ``made_at`` are on the broker's clock; ``history_end`` is the (exclusive) end of the
    history read, on the data's clock (the same unless replaying). ``mae`` holds each candidate's in-sample
    MAE (gCO2e/kWh) when ``auto`` compared several."""

    zone: str
    first_hour: datetime
    made_at: datetime
    history_end: datetime
    model: str
    params: dict[str, float]
    values: np.ndarray
    mae: dict[str, float] = field(default_factory=dict)


def _candidates(settings: CarbonForecastSettings) -> tuple[Model, ...]:
    naive, hw = SeasonalNaive(settings.season_h), ExponentialSmoothing()
    return {"seasonal_naive": (naive,), "holt_winters": (hw,), "auto": (naive, hw)}[settings.model]


def fit_forecast(history: np.ndarray, settings: CarbonForecastSettings, zone: str | None = None,
                 ) -> tuple[Model, np.ndarray, dict[str, float]]:
    """Fit the configured model on ``history`` (hourly gCO2e/kWh, oldest first, ending just before the first
    hour forecast) and forecast ``horizon_h`` hours, extended to ``reach_h`` by the mean day of the last
    ``profile_days`` days of ``history``. Returns ``(fitted model, forecast, in-sample MAE per candidate)``
    (the MAEs only for ``auto``). CPU-bound (tens of milliseconds for four weeks); raises
    :class:`~broker.forecast.ForecastError` naming the zone."""
    y = np.asarray(history, dtype=np.float64)
    horizon = settings.horizon_h
    if len(y) < settings.min_history_h:
        raise ForecastError(f"zone {zone}: {settings.model} needs at least {settings.min_history_h} hours of "
                            f"history, got {len(y)}")
    candidates = _candidates(settings)
    scores: dict[str, float] = {}
    chosen = candidates[0]
    if len(candidates) > 1:
        first = max(WARMUP_H, *(m.min_history for m in candidates))
        best = (np.inf, 0)
        fitted: list[Model] = []
        for i, model in enumerate(candidates):
            fm = model.fit(y, horizon=horizon, score_from=first, zone=zone)
            err = mae(forecast_matrix(fm, y, horizon, zone=zone), y, first, len(y) - horizon)
            scores[fm.name] = err
            fitted.append(fm)
            if err < best[0]:  # strictly lower: a tie stays with the earlier candidate
                best = (err, i)
        chosen = fitted[best[1]]
    forecaster = Forecaster(chosen, zone=zone).fit(y, horizon=horizon)
    values = np.asarray(forecaster.predict(horizon), dtype=np.float64)
    if settings.reach_h > horizon:  # past the model's horizon: the zone's mean day over the last profile_days
        profile = daily_profile(y, settings.profile_days, [len(y)], zone=zone)
        values = extend_by_profile(values[None, :], profile, settings.reach_h)[0]
    values.setflags(write=False)
    return forecaster.model, values, scores


# --- the live signals ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ZoneState:
    """What the broker knows of one zone: the last good forecast, and the last failure if the latest round
    failed (``error`` is None after a success)."""

    forecast: FittedForecast | None = None
    error: str | None = None
    failed_at: datetime | None = None
    history: np.ndarray | None = None  # the history the forecast was fitted on (ends at forecast.history_end)


class ForecastRows(Protocol):
    """What the federation needs of grid signals when it freezes a snapshot."""

    def forecast_rows(self, zones: Sequence[str], now: datetime) -> np.ndarray: ...

    def model_hours(self, zones: Sequence[str], now: datetime) -> int: ...


def _floor_hour(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _fmt(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


class GridSignals:
    """Per-zone carbon forecasts, refreshed in the background; see the module docstring.

    ``zones()`` names the grid zones wanted now (the registered sites' zones). Owned by the broker: call
    :meth:`start` after the sites have joined and :meth:`stop` at shutdown (it closes the provider).
    """

    def __init__(self, provider: CarbonProvider, settings: CarbonForecastSettings, clock: Clock,
                 zones: Callable[[], Iterable[str]]) -> None:
        self.provider = provider
        self.settings = settings
        self._clock = clock
        self._zones = zones
        self.zones: dict[str, ZoneState] = {}
        self._offset: timedelta | None = None  # data time - broker time (whole days), fixed at the first round
        self._task: asyncio.Task[None] | None = None
        self._new_zone = asyncio.Event()  # a snapshot asked for a zone never fetched
        self._ready = asyncio.Event()  # the first round is done
        self.rounds = 0

    def __repr__(self) -> str:
        return f"GridSignals({self.provider!r}, zones={list(self.zones)})"

    # --- life cycle ---

    async def start(self) -> None:
        """Start the refresh task: a round at once, then one every ``refresh_s``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="grid-signals")

    async def stop(self) -> None:
        """Cancel the refresh task (a round in progress is abandoned) and close the provider."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.provider.close()

    async def wait_ready(self) -> None:
        """Return once the first round has finished (each zone succeeded or failed)."""
        await self._ready.wait()

    async def _run(self) -> None:
        while True:
            started = self._clock.now()
            try:
                await self.refresh()
            except Exception:  # each zone's failure is handled in its round; this is a bug, not an outage
                log.exception("carbon forecast: the refresh round failed; trying again in refresh_s")
            self._ready.set()
            await self._wait_until(started + timedelta(seconds=self.settings.refresh_s))

    async def _wait_until(self, when: datetime) -> None:
        """Sleep on the clock until ``when``; meanwhile fetch any zone a snapshot asks for that was never
        fetched."""
        while (remaining := (when - self._clock.now()).total_seconds()) > 0:
            sleep = asyncio.ensure_future(self._clock.sleep(remaining))
            woken = asyncio.ensure_future(self._new_zone.wait())
            try:
                done, _ = await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (sleep, woken):
                    t.cancel()
                await asyncio.gather(sleep, woken, return_exceptions=True)
            if woken not in done:
                return
            self._new_zone.clear()
            await self.refresh(only_new=True)

    # --- one round ---

    def _wanted(self) -> list[str]:
        out = set()
        for z in self._zones():
            try:
                out.add(grid_zone(z))
            except UnknownIdentifier as e:
                log.warning("carbon forecast: %s; that zone gets no forecast", e)
        return sorted(out)

    async def refresh(self, *, only_new: bool = False) -> None:
        """One round: fetch and refit every wanted zone concurrently (``only_new``: only zones never tried).
        Each zone's outcome is stored as it completes; no zone's failure is raised."""
        now = self._clock.now()
        if self._offset is None:
            replay = self.settings.replay_day
            self._offset = timedelta(0) if replay is None else (
                datetime(replay.year, replay.month, replay.day, tzinfo=UTC)
                - now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0))
            if replay is not None:
                log.info("carbon forecast: replaying: %s is read from the data as %s", _fmt(now),
                         _fmt(now + self._offset))
        wanted = self._wanted()
        if only_new:
            wanted = [z for z in wanted if z not in self.zones]
        else:
            for gone in set(self.zones) - set(wanted):
                del self.zones[gone]  # no site is in that zone any more
        for z in wanted:
            self.zones.setdefault(z, ZoneState())
        await asyncio.gather(*(self._refresh_zone(z, now) for z in wanted))
        self.rounds += 1

    async def _refresh_zone(self, zone: str, now: datetime) -> None:
        s = self.settings
        hour = _floor_hour(now)
        end = hour + (self._offset or timedelta(0))
        try:
            async with asyncio.timeout(s.fetch_timeout_s):
                history = await self._history(zone, end)
            model, values, scores = await asyncio.to_thread(fit_forecast, history, s, zone)
        except (ProviderError, ForecastError, ValueError) as e:  # ValueError: e.g. the files' CarbonDataError
            reason = str(e)
        except TimeoutError:
            reason = f"carbon provider: zone {zone}: no answer within fetch_timeout_s ({s.fetch_timeout_s:g} s)"
        except Exception as e:  # a provider's bug must not end the other zones' rounds
            log.exception("carbon forecast: zone %s: unexpected failure", zone)
            reason = f"unexpected failure: {type(e).__name__}: {e}"
        else:
            state = self.zones.setdefault(zone, ZoneState())
            state.forecast = FittedForecast(zone, hour, now, end, model.name, model.params(), values, scores)
            state.history = history
            state.error = state.failed_at = None
            chosen = f"{model.name}" + (
                " (in-sample MAE " + ", ".join(f"{n} {v:.1f}" for n, v in scores.items()) + " gCO2e/kWh)"
                if scores else "")
            log.info("carbon forecast: zone %s: %s, %d h from %s", zone, chosen, s.horizon_h, _fmt(hour))
            return
        if f"zone {zone}" not in reason:
            reason = f"zone {zone}: {reason}"
        state = self.zones.setdefault(zone, ZoneState())
        state.error, state.failed_at = reason, now
        last = state.forecast
        if last is None:
            kept = "no forecast for this zone until a refresh succeeds"
        elif (now - last.made_at).total_seconds() > s.stale_after_s:
            kept = (f"its last forecast (made {_fmt(last.made_at)}) is older than stale_after_s "
                    f"({s.stale_after_s:g} s): no forecast for this zone until a refresh succeeds")
        else:
            kept = f"keeping the forecast made {_fmt(last.made_at)} (stale after {s.stale_after_s:g} s)"
        log.warning("carbon forecast: %s; %s", reason, kept)

    async def _history(self, zone: str, end: datetime) -> np.ndarray:
        """The ``history_h`` hours before ``end`` (data time): the kept history's older hours where it has
        them, the rest (at least the last REFETCH_H hours) from the provider."""
        n = self.settings.history_h
        start = end - n * _HOUR
        state = self.zones.get(zone)
        kept = state.history if state is not None and state.forecast is not None else None
        if kept is None or len(kept) != n:
            return await self.provider.history(zone, start, end)
        kept_end = state.forecast.history_end  # type: ignore[union-attr]
        ask_from = max(start, min(kept_end, end - REFETCH_H * _HOUR))
        if kept_end > end or ask_from >= kept_end:  # the clock went back, or nothing kept is still wanted
            return await self.provider.history(zone, start, end)
        try:
            fresh = await self.provider.history(zone, ask_from, end)
        except ProviderError as e:
            # A gap in the service's data at the start of the hours asked for cannot be interpolated there, and
            # asking from the same hour again would fail every round: the whole window, where the gap lies
            # inside and is filled as in the first round (or the error is the window's own).
            log.info("carbon forecast: zone %s: %s; asking for the whole history instead", zone, e)
            return await self.provider.history(zone, start, end)
        kept_start = kept_end - n * _HOUR
        older = kept[(start - kept_start) // _HOUR:(ask_from - kept_start) // _HOUR]
        return np.concatenate([older, fresh])

    # --- what the snapshot reads ---

    def model_hours(self, zones: Sequence[str], now: datetime) -> int:
        """Hours of :meth:`forecast_rows`' rows (from the hour containing ``now``) that the zones' models made,
        the fewest over the zones with a usable forecast: a forecast made ``k`` hours ago has ``horizon_h -
        k`` model hours left (the rest: the zone's mean day). 0 when no zone has one; at least 1 when one has,
        since 0 tells the snapshot that every hour is the model's (``Snapshot.carbon_forecast_model_h``): a
        forecast kept past its horizon (``stale_after_s`` above ``horizon_h``) is then judged on its first
        hour only, not on the mean day that follows."""
        usable = [self._usable(z, now) for z in zones]
        left = [self.settings.horizon_h - u[1] for u in usable if u is not None]
        return max(min(left), 1) if left else 0

    def _usable(self, zone: str, now: datetime) -> tuple[FittedForecast, int] | None:
        """``zone``'s forecast and the hours since its first hour, if it is usable at ``now``: not stale,
        not made in a later hour than ``now``'s, not run out."""
        state = self.zones.get(zone)
        f = state.forecast if state is not None else None
        if f is None or (now - f.made_at).total_seconds() > self.settings.stale_after_s:
            return None
        shift = (_floor_hour(now) - f.first_hour) // _HOUR
        return (f, shift) if 0 <= shift < len(f.values) else None  # else: the clock went back, or run out

    def forecast_rows(self, zones: Sequence[str], now: datetime) -> np.ndarray:
        """float64[len(zones), reach_h]: each zone's forecast from the hour containing ``now`` (gCO2e/kWh),
        NaN rows where a zone has no usable forecast. Synchronous and cheap: reads memory only."""
        horizon = max(self.settings.reach_h, self.settings.horizon_h)
        out = np.full((len(zones), horizon), np.nan)
        unseen = False
        for i, z in enumerate(zones):
            unseen = unseen or z not in self.zones
            usable = self._usable(z, now)
            if usable is None:
                continue
            f, shift = usable
            n = len(f.values) - shift
            out[i, :min(n, horizon)] = f.values[shift:shift + horizon]
            if n < horizon:  # the hours the shifted row no longer covers
                if len(f.values) - self.settings.horizon_h >= 24:  # go on round the mean day, a day back
                    j = np.arange(n, horizon) + shift
                    out[i, n:] = f.values[j - 24 * ((j - len(f.values)) // 24 + 1)]
                else:  # no mean day: the last value
                    out[i, n:] = f.values[-1]
        if unseen and self._task is not None:
            self._new_zone.set()
        return out


# --- prices ----------------------------------------------------------------------------------------------


def price_matrix(specs: Sequence[SiteSpec], provider: PriceProvider) -> np.ndarray:
    """float64[n_sites, n_models] (rows as ``specs`` come, columns as the snapshot's): the provider's on-demand
    USD per GPU-hour of every model a site owns or its spec prices; NaN where the provider has none."""
    out = np.full((len(specs), N_MODELS), np.nan, dtype=np.float64, order="F")
    for i, spec in enumerate(specs):
        for model in sorted({g.model for g in spec.gpus} | set(spec.usd_per_gpu_hour)):
            usd = provider.usd_per_gpu_hour(spec, model)
            if usd is not None:
                out[i, MODEL_INDEX[model]] = usd
    return out
