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

Forecasts kept in the store (:data:`FORECASTS_STATE`)
    Given the broker's store, the signals save every zone's last good forecast there (``Store.put_state``,
    table ``broker_state``): after a round that made a new one, at most every :data:`FORECASTS_SAVE_S`, and
    when the broker stops. :meth:`GridSignals.start` (a broker starting, or a replica taking over) reads them
    back before its first round, so a broker that starts while its provider is down forecasts from them as a
    running broker does from its last forecast: shifted to ``now``'s hour, and no longer than
    ``stale_after_s`` after they were *made* (fetched), not after the restart. A zone's first good round
    replaces its kept forecast. A store that cannot be read then (PostgreSQL restarting) is read again in the
    background while the first round runs (tenacity, backing off, for at most :data:`RESTORE_RETRY_S`): the
    start does not wait for it, :meth:`GridSignals.wait_ready` (the first pass) does, and nothing is saved
    over the kept forecasts meanwhile.

    What is kept is each zone's forecast row as made (its ``reach_h`` values, 168 by default, its first hour
    and when it was made: about 3.4 KB of JSON a zone), not the history the forecaster fits on: that is
    ``history_h`` values (672 by default, four times as many), and the row is exactly what a running broker
    would go on using after a failed round, where the history would have to be fitted again (the round's one
    CPU-bound step) to give that same row back. The row is all that a correct forecast needs within
    ``stale_after_s``: between rounds a running broker shifts it and never refits it. Kept history would
    only shorten the fetch of the first round that succeeds; without it that round asks for the whole
    window, as after a first start. The document holds the zones wanted when it was saved, only their forecasts not yet
    stale. A document that cannot be read, from another release, or made with another ``horizon_h`` or
    ``reach_h`` is ignored with a WARNING (a zone's entry that cannot be read: that zone alone); nothing is
    saved over it until a round has made a forecast, so a broker that restarts with its provider down leaves
    it as it was.

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
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay, wait_exponential

from broker.clock import Clock
from broker.errors import at, located, problems
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
from broker.store import Store, StoreError
from policies.snapshot import MODEL_INDEX, N_MODELS

__all__ = [
    "FORECASTS_SAVE_S",
    "FORECASTS_STATE",
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

FORECASTS_STATE = "carbon-forecasts"
"""The store's name (``Store.put_state``) for the zones' last forecasts, read back by a broker that starts or
takes over (see the module docstring)."""

FORECASTS_SAVE_S = 300.0
"""At most this often (broker clock) the forecasts are saved after a round that changed them, and when the
broker stops: a crash loses at most that many seconds of them (a round is hourly by default)."""

FORECASTS_VERSION = 1
"""The kept document's format; a document of another is ignored, with a warning."""

RESTORE_RETRY_S = 20.0
"""For how long at most, after the read at start failed (a store briefly away: PostgreSQL restarting), the
forecasts kept in the store are read again in the background while the first round runs: within the broker's
wait for its first forecasts before its first pass (``FIRST_PASS_WAIT_S``, 30 s)."""

_RESTORE_FIRST_WAIT_S = 0.25
"""The wait before the first of those reads; each later wait doubles, up to :data:`_RESTORE_WAIT_MAX_S`."""
_RESTORE_WAIT_MAX_S = 4.0
"""The longest wait between two of those reads."""

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
    stale_after_s: float = Field(default=6 * 3600.0, gt=0, le=7 * 86_400, description="a zone whose refreshes fail "
                                 "keeps its last forecast this long, then has none (at most a week, 604800)")
    fetch_timeout_s: float = Field(default=300.0, gt=0, le=3600, description="longest one zone's fetch may take "
                                   "(retries included) before that zone's round counts as failed (at most 3600)")
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
            raise at("history_h", f"history_h {self.history_h} is too short for model {self.model}: it needs at least "
                             f"{self.min_history_h} hours ({why}); raise history_h or lower horizon_h")
        if self.stale_after_s < self.refresh_s:
            raise at("stale_after_s", f"stale_after_s ({self.stale_after_s:g}) must be at least refresh_s "
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
    failed (``error`` is None after a success). ``kept``: the forecast was read from the store at start (made
    by this broker before a restart, or by the last leader), not made by a round of this one."""

    forecast: FittedForecast | None = None
    error: str | None = None
    failed_at: datetime | None = None
    history: np.ndarray | None = None  # the history the forecast was fitted on (ends at forecast.history_end)
    kept: bool = False


class _KeptForecast(BaseModel):
    """One zone's forecast as the store keeps it (:data:`FORECASTS_STATE`): a :class:`FittedForecast`, times
    as ISO 8601 with their offset."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    first_hour: AwareDatetime
    made_at: AwareDatetime
    history_end: AwareDatetime
    model: str
    params: dict[str, float]
    mae: dict[str, float] = Field(default_factory=dict)
    values: list[float] = Field(min_length=1)


class _KeptForecasts(BaseModel):
    """The whole document: the settings its rows were made with, and one entry per zone (each checked on its
    own: one that cannot be read costs that zone only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int
    horizon_h: int
    reach_h: int
    zones: dict[str, Any]


def _why(e: ValueError) -> str:
    """A one-line reason: pydantic's first error, worded as a config file's (``broker.errors``), or the message."""
    found = problems(e) if isinstance(e, ValidationError) else []
    if found:
        return located(found[0])
    return str(e).splitlines()[0] if str(e) else type(e).__name__


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
                 zones: Callable[[], Iterable[str]], store: Store | None = None,
                 may_act: Callable[[], bool] | None = None) -> None:
        """``store``: where the forecasts are kept across restarts and takeovers (None: nowhere);
        ``may_act``: whether this broker may write to it now (a replica: while it surely leads)."""
        self.provider = provider
        self.settings = settings
        self._clock = clock
        self._zones = zones
        self._store = store
        self._may_act = may_act or (lambda: True)
        self._changes = 0  # good forecasts made since start (each one changes what the store should keep)
        self._saved_changes = 0  # ... of which the store holds the latest
        self._save_tried_at: datetime | None = None  # when a save was last tried (broker clock)
        self.zones: dict[str, ZoneState] = {}
        self._offset: timedelta | None = None  # data time - broker time (whole days), fixed at the first round
        self._task: asyncio.Task[None] | None = None
        self._new_zone = asyncio.Event()  # a snapshot asked for a zone never fetched
        self._ready = asyncio.Event()  # the first round is done
        self._restoring: asyncio.Task[int] | None = None  # reading the kept forecasts again after a failed read
        self.restore_retry_s = RESTORE_RETRY_S
        self.rounds = 0

    def __repr__(self) -> str:
        return f"GridSignals({self.provider!r}, zones={list(self.zones)})"

    # --- life cycle ---

    async def start(self) -> None:
        """Take up the forecasts kept in the store (if given one), then start the refresh task: a round at
        once, then one every ``refresh_s``. Where the store cannot be read, it is read again in the background
        (:meth:`_restore_retrying`) while the first round runs."""
        if self._task is None:
            loop = asyncio.get_running_loop()
            if self._store is not None:
                try:
                    await self.restore(raise_unreadable=True)
                except StoreError as e:
                    log.warning("carbon forecast: could not read the forecasts kept in the store (%s); reading "
                                "them again for up to %g s while the first round runs", e, self.restore_retry_s)
                    self._restoring = loop.create_task(self._restore_retrying(), name="grid-signals-restore")
            self._task = loop.create_task(self._run(), name="grid-signals")

    async def stop(self, keep: bool = False) -> None:
        """Cancel the refresh task (a round in progress is abandoned), save the forecasts not saved yet if
        ``keep`` (a broker that stops; not a deposed leader, whose writes the store refuses), and close the
        provider."""
        for task in (self._task, self._restoring):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = None
        if keep:
            await self.keep(final=True)
        await self.provider.close()

    # --- the forecasts kept in the store ---

    def _kept_doc(self, now: datetime) -> str:
        """The document to keep: every zone's forecast that is not stale at ``now`` (see the module doc)."""
        zones: dict[str, Any] = {}
        for zone, state in sorted(self.zones.items()):
            f = state.forecast
            if f is None or (now - f.made_at).total_seconds() > self.settings.stale_after_s:
                continue
            zones[zone] = {"first_hour": f.first_hour.isoformat(), "made_at": f.made_at.isoformat(),
                           "history_end": f.history_end.isoformat(), "model": f.model, "params": f.params,
                           "mae": f.mae, "values": [float(v) for v in f.values]}
        return json.dumps({"version": FORECASTS_VERSION, "horizon_h": self.settings.horizon_h,
                           "reach_h": self.settings.reach_h, "zones": zones}, separators=(",", ":"))

    async def keep(self, final: bool = False) -> None:
        """Save the forecasts if a round made a new one since the last save, and this broker may write
        (``final``: it stops; a replica that has already given up leading still holds the lease, and the
        store's fence refuses the write if another has taken over). A failure is logged and tried again
        :data:`FORECASTS_SAVE_S` later."""
        changes = self._changes
        if self._store is None or changes == self._saved_changes or self._restore_pending():
            return  # (nothing saved over the kept forecasts while they are still being read)
        now = self._clock.now()
        self._save_tried_at = now
        if not (final or self._may_act()):
            return
        try:
            await self._store.put_state(FORECASTS_STATE, self._kept_doc(now))
        except StoreError as e:
            log.warning("carbon forecast: could not save the forecasts in the store: %s", e)
            return
        self._saved_changes = changes

    def _save_due(self) -> datetime | None:
        """When the forecasts not saved yet are next saved (None: nothing to save)."""
        if self._store is None or self._changes == self._saved_changes:
            return None
        now = self._clock.now()
        if self._save_tried_at is None or self._save_tried_at > now:  # (never tried, or the clock went back)
            return now
        return self._save_tried_at + timedelta(seconds=FORECASTS_SAVE_S)

    async def _keep_due(self) -> None:
        due = self._save_due()
        if due is not None and due <= self._clock.now():
            try:
                await self.keep()
            except Exception:  # a bug here must not end the rounds
                log.exception("carbon forecast: saving the forecasts failed")

    def _restore_pending(self) -> bool:
        """Whether the kept forecasts are still being read again (nothing is saved over them meanwhile), or
        were being read when the broker stopped (its final save would write over them what the rounds made)."""
        return self._restoring is not None and (not self._restoring.done() or self._restoring.cancelled())

    async def _restore_retrying(self) -> int:
        """Read the kept forecasts again after a failed read, backing off, for at most ``restore_retry_s``
        (tenacity); each failure is a WARNING, and the last one says the zones go without them."""

        def failed(state: RetryCallState) -> None:
            assert state.outcome is not None
            log.warning("carbon forecast: reading the forecasts kept in the store failed again (%s); trying "
                        "again in %.1f s", state.outcome.exception(), state.upcoming_sleep)

        tries = 1  # the read at start
        try:
            async with asyncio.timeout(self.restore_retry_s):  # (a read that hangs counts too)
                async for attempt in AsyncRetrying(
                        retry=retry_if_exception_type(StoreError), stop=stop_after_delay(self.restore_retry_s),
                        wait=wait_exponential(multiplier=_RESTORE_FIRST_WAIT_S, max=_RESTORE_WAIT_MAX_S),
                        before_sleep=failed, reraise=True):
                    with attempt:
                        if tries == 1:  # not at once again: the read at start has just failed
                            await asyncio.sleep(_RESTORE_FIRST_WAIT_S)
                        tries += 1
                        taken = await self.restore(raise_unreadable=True)
        except (StoreError, TimeoutError) as e:
            log.warning("carbon forecast: could not read the forecasts kept in the store in %d tries within %g s "
                        "(%s); the zones have none until a round succeeds", tries, self.restore_retry_s,
                        e if isinstance(e, StoreError) else "the last read did not answer in time")
            return 0
        log.info("carbon forecast: read the forecasts kept in the store at try %d", tries)
        return taken

    async def restore(self, raise_unreadable: bool = False) -> int:
        """Take up the forecasts the store keeps, for the zones wanted now, as each zone's last forecast
        (until a round replaces it, and no longer than ``stale_after_s`` after it was made); a zone a round
        has made a forecast for already keeps that one. Returns how many zones got one. Never raises for what
        the store holds: a document or entry that cannot be read is ignored with a WARNING, as is a store that
        cannot be read, unless ``raise_unreadable`` (then its StoreError is raised)."""
        assert self._store is not None
        try:
            doc = await self._store.get_state(FORECASTS_STATE)
        except StoreError as e:
            if raise_unreadable:
                raise
            log.warning("carbon forecast: could not read the forecasts kept in the store (%s); the zones have "
                        "none until a round succeeds", e)
            return 0
        if doc is None:
            return 0
        s = self.settings
        try:
            raw = json.loads(doc)
            if not isinstance(raw, dict) or raw.get("version") != FORECASTS_VERSION:
                found = raw.get("version") if isinstance(raw, dict) else None
                raise ValueError(f"format {found!r}, where this release reads {FORECASTS_VERSION}")
            kept = _KeptForecasts.model_validate(raw)
            if (kept.horizon_h, kept.reach_h) != (s.horizon_h, s.reach_h):
                raise ValueError(f"made with horizon_h {kept.horizon_h} and reach_h {kept.reach_h}, where "
                                 f"{s.horizon_h} and {s.reach_h} are configured")
        except ValueError as e:  # json's and pydantic's errors included
            log.warning("carbon forecast: ignoring the forecasts kept in the store: %s", _why(e))
            return 0
        now = self._clock.now()
        length = max(s.reach_h, s.horizon_h)
        wanted = set(self._wanted())
        taken: list[str] = []
        for zone, entry in sorted(kept.zones.items()):
            if zone not in wanted:
                continue  # no site is in that zone now
            made = self.zones.get(zone)
            if made is not None and made.forecast is not None:
                continue  # a round has made one (read again after a failed read, while the first round ran)
            try:
                k = _KeptForecast.model_validate(entry)
                if len(k.values) != length:
                    raise ValueError(f"{len(k.values)} values, not {length}")
                if k.first_hour != _floor_hour(k.first_hour) or _floor_hour(k.made_at) != k.first_hour:
                    raise ValueError("its first hour is not the hour it was made in")
            except ValueError as e:
                log.warning("carbon forecast: zone %s: ignoring its forecast kept in the store: %s", zone, _why(e))
                continue
            age_s = (now - k.made_at).total_seconds()
            if age_s > s.stale_after_s:
                log.info("carbon forecast: zone %s: its forecast kept in the store (made %s) is older than "
                         "stale_after_s (%g s): not used", zone, _fmt(k.made_at), s.stale_after_s)
                continue
            values = np.array(k.values, dtype=np.float64)
            values.setflags(write=False)
            forecast = FittedForecast(zone, k.first_hour.astimezone(UTC), k.made_at.astimezone(UTC),
                                      k.history_end.astimezone(UTC), k.model, dict(k.params), values, dict(k.mae))
            state = self.zones.setdefault(zone, ZoneState())
            state.forecast, state.kept = forecast, True
            taken.append(f"{zone} (made {_fmt(k.made_at)})")
        if taken:
            log.info("carbon forecast: took up the forecasts kept in the store for %s; each is used until a round "
                     "succeeds for its zone, for at most stale_after_s (%g s) after it was made",
                     ", ".join(taken), s.stale_after_s)
        return len(taken)

    def kept_in_use(self, now: datetime) -> int:
        """Zones whose usable forecast at ``now`` is one read from the store (no round has replaced it)."""
        return sum(1 for z, st in self.zones.items() if st.kept and self._usable(z, now) is not None)

    async def wait_ready(self) -> None:
        """Return once the first round has finished (each zone succeeded or failed), and the kept forecasts
        a failed read at start left out are read again, or given up on (at most ``restore_retry_s``)."""
        await self._ready.wait()

    async def _run(self) -> None:
        while True:
            started = self._clock.now()
            try:
                await self.refresh()
            except Exception:  # each zone's failure is handled in its round; this is a bug, not an outage
                log.exception("carbon forecast: the refresh round failed; trying again in refresh_s")
            if self._restoring is not None and not self._ready.is_set():
                # ready once the kept forecasts are in too, or given up (bounded by restore_retry_s)
                await asyncio.gather(self._restoring, return_exceptions=True)
            self._ready.set()
            await self._keep_due()
            await self._wait_until(started + timedelta(seconds=self.settings.refresh_s))

    async def _wait_until(self, when: datetime) -> None:
        """Sleep on the clock until ``when``; meanwhile fetch any zone a snapshot asks for that was never
        fetched, and save the forecasts when a save is due."""
        while (remaining := (when - self._clock.now()).total_seconds()) > 0:
            await self._keep_due()
            due = self._save_due()
            if due is not None:  # wake for it (a failed save is tried again FORECASTS_SAVE_S later)
                remaining = min(remaining, max((due - self._clock.now()).total_seconds(), 0.0))
            sleep = asyncio.ensure_future(self._clock.sleep(remaining))
            woken = asyncio.ensure_future(self._new_zone.wait())
            try:
                done, _ = await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (sleep, woken):
                    t.cancel()
                await asyncio.gather(sleep, woken, return_exceptions=True)
            if woken not in done:
                continue  # ``when`` has come, or a save is due
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
            state.kept = False
            self._changes += 1
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
            kept = (f"keeping the forecast made {_fmt(last.made_at)}{' (kept in the store)' if state.kept else ''} "
                    f"(stale after {s.stale_after_s:g} s)")
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

    async def measured(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        """The provider's hourly intensity of ``zone`` over [``start``, ``end``) (whole hours of the broker's clock,
        read from the data as the forecasts read it: on the replayed day where ``replay_day`` is set), within
        ``fetch_timeout_s``: what a usage report charges past hours at (:mod:`broker.usage`). Raises
        ProviderError, ValueError (the files' data) or TimeoutError."""
        offset = self._offset or timedelta(0)
        async with asyncio.timeout(self.settings.fetch_timeout_s):
            return await self.provider.history(zone, start + offset, end + offset)

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
