"""Forecasts of grid carbon intensity per zone for the next hours, from past values only.

Units and time
    Values are hourly gCO2e/kWh, as :mod:`broker.data.carbon` serves them: value ``i`` of a series covers the
    hour ``[start + i h, start + (i + 1) h)``, UTC. Errors (MAE) are in gCO2e/kWh; MASE has no unit.

The one rule: a forecast never sees the future
    A forecast *made at hour t* (at the start of that hour) uses the values of hours ``0 .. t-1`` only and
    predicts hours ``t .. t+horizon-1``: step ``h`` (1-based) of it is the ``h``-hour-ahead forecast of hour
    ``t+h-1``. :func:`forecast_matrix` returns one such row per hour; the live :class:`Forecaster` holds the
    same state and is fed one actual value per hour with :meth:`Forecaster.update`. Model parameters are
    chosen on a training span and then frozen; the test span is never looked at while choosing.

Models
    - :class:`SeasonalNaive` (``season_h`` 24, daily, or 168, weekly): hour ``j`` is forecast by the last
      known value one (or, for steps beyond a season, two or more) seasons before it,
      ``y[j - season * ceil((j - t + 1) / season)]``.
    - :class:`ExponentialSmoothing`: additive Holt-Winters with a daily season (24 h) and an optional damped
      trend (error-correction form, classic seasonal update)::

          level_t  = alpha * (y_t - s_old) + (1 - alpha) * (level + phi * trend)
          trend_t  = beta * (level_t - level) + (1 - beta) * phi * trend
          s_t      = gamma * (y_t - level_t) + (1 - gamma) * s_old          (s_old: the season of y_t's phase)
          forecast = max(0, level + (phi + phi^2 + ... + phi^h) * trend + s[phase of the target hour])

      The state starts after one season: level = mean of the first 24 values, trend = 0, seasonal terms =
      those 24 values minus that mean; from then on it is updated hour by hour with each actual value.
      ``alpha``, ``beta``, ``gamma`` and ``phi`` are fitted by :meth:`ExponentialSmoothing.fit`: every point
      of a small grid (:data:`DEFAULT_GRID`: alpha 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7; gamma 0.02,
      0.05, 0.1, 0.2, 0.4; beta 0 (no trend), 0.02, 0.1; phi 0.5, 0.8, 0.95 where beta > 0, or 1 with
      ``damped=False``; 280 points) is run as the online recursion over the training values (all points at
      once, vectorised), and the point with the lowest
      mean absolute error over all 1..horizon-step forecasts made there wins (ties: the first in grid
      order). The recursion is one function (:func:`_hw_step`) used by the grid search (vectorised over
      the grid), by :func:`forecast_matrix` and by :class:`Forecaster`.

Early hours
    Before a model has one full season of history (hours ``t < season_h``: 24 for Holt-Winters and the daily
    naive model, 168 for the weekly one), its row is the last known value ``y[t-1]`` repeated over the
    horizon. Row 0 has no known value at all and is NaN. :attr:`SeasonalNaive.min_history` and
    :attr:`ExponentialSmoothing.min_history` say where real forecasts begin.

Choosing and scoring per zone (:func:`choose_models`)
    Every candidate (by default seasonal-naive 24 h and 168 h and Holt-Winters) runs over the zone's whole
    series from its first hour. A forecast counts for a span when it is made in the span and all its
    ``horizon`` target hours lie in the span too (so a span's figures use that span's values only as
    truth); in the training span, forecasts made in the first :data:`WARMUP_H` hours (one week) of the data
    are skipped, so that every model has a full history. Each zone gets the candidate with the lowest
    training MAE (ties: the first candidate). The test span reports MAE and MASE = MAE / scale, where the
    scale is the in-sample MAE of the one-day seasonal-naive one-step forecast on the training span,
    ``mean |y_t - y_{t-24}|`` (MAPE is not used: it explodes where intensity nears zero, as in hydro and
    nuclear grids). Both (all) candidates' figures are kept so the choice is visible.

Cost
    :func:`forecast_matrix` over two years (17,520 hours, horizon 48) takes a few tens of milliseconds: one
    scalar Python step per hour, the forecasts built column by column with numpy. Fitting Holt-Winters on
    one year takes well under a second (the grid is one vectorised recursion). ``bench/forecast.py`` prints
    the figures on this machine.

Turning things off
    Nothing in the broker forecasts unless a caller asks. To use one model everywhere, pass it alone to
    :func:`choose_models` (``models=(SeasonalNaive(24),)``); an :class:`ExponentialSmoothing` with all four
    parameters given is never refitted; ``damped=False`` fixes phi at 1 and a grid with ``beta=(0.0,)``
    drops the trend.

Errors
    :class:`ForecastError` (a :class:`ValueError`) names the zone when one is known: too little history to
    fit or start a model, NaN or infinite values (with the first bad hour), a horizon below 1, spans that the
    data does not cover or that overlap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import numpy as np

from broker.data.carbon import CarbonData, CarbonDataError
from broker.ids import UnknownIdentifier, grid_zone

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_MODELS",
    "TEST_SPAN",
    "TRAIN_SPAN",
    "WARMUP_H",
    "ExponentialSmoothing",
    "ForecastError",
    "ForecastReport",
    "Forecaster",
    "Grid",
    "Model",
    "ModelScore",
    "SeasonalNaive",
    "ZoneForecast",
    "choose_models",
    "forecast_matrix",
    "mae",
    "mase_scale",
]

_HOUR = timedelta(hours=1)

WARMUP_H = 168
"""Forecasts made in the first week of the data are not scored when choosing (every model has full history
after it). Also the start of scoring in :meth:`ExponentialSmoothing.fit` by default."""

TRAIN_SPAN = (datetime(2021, 1, 1, tzinfo=UTC), datetime(2022, 1, 1, tzinfo=UTC))
TEST_SPAN = (datetime(2022, 1, 1, tzinfo=UTC), datetime(2023, 1, 1, tzinfo=UTC))


class ForecastError(ValueError):
    """A forecast cannot be made or scored as asked; the message names the zone when one is known."""


def _where(zone: str | None) -> str:
    return f"zone {zone}: " if zone else ""


# --- models -------------------------------------------------------------------------------------------


class Model(Protocol):
    """What :func:`forecast_matrix`, :class:`Forecaster` and :func:`choose_models` need of a model."""

    @property
    def name(self) -> str: ...

    @property
    def min_history(self) -> int: ...

    @property
    def fitted(self) -> bool: ...

    def fit(self, values: np.ndarray | Sequence[float], *, horizon: int = 48, score_from: int = WARMUP_H,
            zone: str | None = None) -> Model: ...

    def params(self) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class SeasonalNaive:
    """Hour ``j`` is forecast by the last known value a whole number of seasons before it (see module doc)."""

    season_h: int = 24

    def __post_init__(self) -> None:
        if not (isinstance(self.season_h, int) and self.season_h >= 1):
            raise ForecastError(f"season_h must be a whole number of hours of 1 or more, not {self.season_h!r}")

    @property
    def name(self) -> str:
        return f"seasonal-naive-{self.season_h}h"

    @property
    def min_history(self) -> int:
        """Hours of history before the first real (non-fallback) forecast."""
        return self.season_h

    @property
    def fitted(self) -> bool:
        return True

    def fit(self, values: np.ndarray | Sequence[float], *, horizon: int = 48, score_from: int = WARMUP_H,
            zone: str | None = None) -> SeasonalNaive:
        """Nothing to fit: returns itself (after checking the values, so errors match the other models')."""
        _check_horizon(horizon, zone)
        _as_series(values, zone)
        return self

    def params(self) -> dict[str, float]:
        return {"season_h": float(self.season_h)}


@dataclass(frozen=True, slots=True)
class Grid:
    """The candidate parameters of :meth:`ExponentialSmoothing.fit`; every combination is tried.

    ``phi`` applies only where ``beta > 0`` (with ``beta == 0`` the trend stays 0 and phi has no effect).
    """

    alpha: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7)
    beta: tuple[float, ...] = (0.0, 0.02, 0.1)
    gamma: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.4)
    phi: tuple[float, ...] = (0.5, 0.8, 0.95)

    def points(self, damped: bool = True) -> list[tuple[float, float, float, float]]:
        """``(alpha, beta, gamma, phi)`` for every combination, in a fixed order (the tie-break order)."""
        phis = self.phi if damped else (1.0,)
        out = []
        for a, b, g in itertools.product(self.alpha, self.beta, self.gamma):
            for p in (phis if b > 0 else (1.0,)):
                out.append((float(a), float(b), float(g), float(p)))
        return out


DEFAULT_GRID = Grid()
"""8 alpha x 5 gamma x (1 no-trend + 2 beta x 3 phi) = 280 points (see the module docstring).

Small alphas win in many zones: at 1..48 h ahead a slow level with fast seasonal terms beats tracking the
last hours. The ranges were widened where fits on the 2021 training year sat on the grid's edge."""


@dataclass(frozen=True, slots=True)
class ExponentialSmoothing:
    """Additive Holt-Winters with a daily season and an optional damped trend (see the module docstring).

    Give all four of ``alpha``, ``beta``, ``gamma``, ``phi`` to fix them, or none and call :meth:`fit`.
    """

    alpha: float | None = None
    beta: float | None = None
    gamma: float | None = None
    phi: float | None = None
    damped: bool = True
    season_h: int = 24
    grid: Grid = field(default=DEFAULT_GRID, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [p is not None for p in (self.alpha, self.beta, self.gamma, self.phi)]
        if any(given) and not all(given):
            raise ForecastError("give all four of alpha, beta, gamma and phi, or none (and call fit)")
        if not (isinstance(self.season_h, int) and self.season_h >= 2):
            raise ForecastError(f"season_h must be a whole number of hours of 2 or more, not {self.season_h!r}")
        if all(given):
            for name in ("alpha", "beta", "gamma"):
                v = getattr(self, name)
                if not 0.0 <= v <= 1.0:
                    raise ForecastError(f"{name} must be between 0 and 1, not {v}")
            if not 0.0 < self.phi <= 1.0:  # type: ignore[operator]
                raise ForecastError(f"phi must be in (0, 1], not {self.phi}")

    @property
    def name(self) -> str:
        return f"holt-winters-{self.season_h}h" + ("-damped" if self.damped else "")

    @property
    def min_history(self) -> int:
        """Hours of history before the first real (non-fallback) forecast: one season."""
        return self.season_h

    @property
    def fitted(self) -> bool:
        return self.alpha is not None

    def params(self) -> dict[str, float]:
        if not self.fitted:
            return {}
        return {"alpha": float(self.alpha), "beta": float(self.beta),  # type: ignore[arg-type]
                "gamma": float(self.gamma), "phi": float(self.phi)}  # type: ignore[arg-type]

    def fit(self, values: np.ndarray | Sequence[float], *, horizon: int = 48, score_from: int = WARMUP_H,
            zone: str | None = None) -> ExponentialSmoothing:
        """The grid point with the lowest MAE over every 1..``horizon``-step forecast made at hours
        ``t >= score_from`` whose targets all lie in ``values``; returns a new, fitted model.

        ``values`` are the training hours (and any history before them); nothing after them is seen. Needs at
        least ``max(score_from, season_h) + horizon`` values. A model whose parameters were given is returned
        as it is.
        """
        _check_horizon(horizon, zone)
        y = _as_series(values, zone)
        if self.fitted:
            return self
        first = max(int(score_from), self.season_h)
        need = first + horizon
        if len(y) < need:
            raise ForecastError(
                f"{_where(zone)}fitting {self.name} needs at least {need} hours of history "
                f"({first} before the first scored forecast + a {horizon} h horizon), got {len(y)}"
            )
        points = self.grid.points(self.damped)
        if not points:
            raise ForecastError("the fitting grid is empty")
        a, b, g, p = (np.array(col) for col in zip(*points, strict=True))
        errors = _hw_grid_mae(y, a, b, g, p, self.season_h, horizon, first)
        best = int(np.argmin(errors))
        return replace(self, alpha=float(a[best]), beta=float(b[best]), gamma=float(g[best]), phi=float(p[best]))


DEFAULT_MODELS: tuple[Model, ...] = (SeasonalNaive(24), SeasonalNaive(168), ExponentialSmoothing())
"""The candidates :func:`choose_models` compares per zone, in tie-break order."""


# --- the shared pieces: season offsets, the Holt-Winters step and forecast -----------------------------


def _season_offsets(horizon: int, season: int) -> np.ndarray:
    """For steps h = 1..horizon of a forecast made at t: ``source - t``, where ``source`` is the latest hour
    before t in the target's seasonal phase (``((h - 1) mod season) - season``, always in ``[-season, -1]``)."""
    return (np.arange(horizon) % season) - season


def _damp_cum(phi: float | np.ndarray, horizon: int) -> np.ndarray:
    """``phi + phi^2 + ... + phi^h`` for h = 1..horizon; shape (horizon,) or (horizon, len(phi))."""
    phi = np.asarray(phi, dtype=np.float64)
    powers = phi[None, ...] ** np.arange(1, horizon + 1).reshape((horizon,) + (1,) * phi.ndim)
    return np.cumsum(powers, axis=0)


def _hw_step(level: Any, trend: Any, season: Any, phase: int, y: float,
             alpha: Any, beta: Any, gamma: Any, phi: Any) -> tuple[Any, Any, Any]:
    """One hour of the Holt-Winters recursion: observe ``y`` (the actual of an hour in ``phase``), update
    ``season[phase]`` in place and return ``(level, trend, new seasonal term)``.

    Works on Python floats (one model; ``season`` a list) and on numpy arrays (a grid of models at once;
    ``season`` of shape (season_h, grid)) alike: the same arithmetic either way.
    """
    s_old = season[phase]
    damped = phi * trend
    expected = level + damped  # the one-step forecast of the level
    new_level = expected + alpha * (y - s_old - expected)
    new_trend = damped + beta * (new_level - level)
    new_s = s_old + gamma * (y - new_level - s_old)
    season[phase] = new_s
    return new_level, new_trend, new_s


def _hw_forecast(level: Any, trend: Any, seasonal: Any, damp_cum: Any) -> Any:
    """Holt-Winters forecast from a state: level + damped trend sum + the target's seasonal term (broadcasts),
    and never below 0: no grid's intensity is (the sum dips below 0 where a clean grid's day swings wider than
    its level, as Ontario's does)."""
    return np.maximum(level + damp_cum * trend + seasonal, 0.0)


def _hw_init(y: np.ndarray, season: int) -> tuple[float, list[float]]:
    """Initial level and seasonal terms from the first season of values (trend starts at 0)."""
    first = y[:season]
    level = float(first.mean())
    return level, [float(v) - level for v in first]


def _hw_states(y: np.ndarray, season: int, alpha: Any, beta: Any, gamma: Any, phi: Any,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[Any, Any, Any]]:
    """Run the recursion over ``y`` from hour ``season`` on.

    Returns ``level[t]``, ``trend[t]`` (the state at the start of hour t, for t in [season, n)), ``snew[t]``
    (the seasonal term of hour t's phase after hour t is observed; for t < season the initial terms) and the
    final ``(level, trend, season)`` after the last value. Floats for one model, arrays for a grid.
    """
    n = len(y)
    level0, season0 = _hw_init(y, season)
    grid = np.ndim(alpha) > 0
    if grid:
        g = len(alpha)
        level: Any = np.full(g, level0)
        trend: Any = np.zeros(g)
        seas: Any = np.repeat(np.asarray(season0)[:, None], g, axis=1)
        levels = np.empty((n, g))
        trends = np.empty((n, g))
        snew = np.empty((n, g))
        snew[:season] = seas
        values: Any = y
        for t in range(season, n):
            levels[t] = level
            trends[t] = trend
            level, trend, snew[t] = _hw_step(level, trend, seas, t % season, values[t], alpha, beta, gamma, phi)
        return levels, trends, snew, (level, trend, seas)
    level, trend, seas = level0, 0.0, list(season0)
    lv: list[float] = [math.nan] * season
    tr: list[float] = [math.nan] * season
    sn: list[float] = list(season0)
    values = y.tolist()
    for t in range(season, n):
        lv.append(level)
        tr.append(trend)
        level, trend, s = _hw_step(level, trend, seas, t % season, values[t], alpha, beta, gamma, phi)
        sn.append(s)
    return np.array(lv), np.array(tr), np.array(sn), (level, trend, seas)


def _hw_grid_mae(y: np.ndarray, alpha: np.ndarray, beta: np.ndarray, gamma: np.ndarray, phi: np.ndarray,
                 season: int, horizon: int, first: int) -> np.ndarray:
    """MAE of every grid point over the forecasts made at t in [first, n - horizon]."""
    n = len(y)
    levels, trends, snew, _ = _hw_states(y, season, alpha, beta, gamma, phi)
    last = n - horizon  # the last origin whose targets all lie in y
    dc = _damp_cum(phi, horizon)
    offsets = _season_offsets(horizon, season)
    total = np.zeros(len(alpha))
    step = max(1, 2**16 // len(alpha))  # origins per block: keeps each block's arrays in cache
    for a in range(first, last + 1, step):
        b = min(a + step, last + 1)
        lv, tr = levels[a:b], trends[a:b]
        for k in range(horizon):
            err = _hw_forecast(lv, tr, snew[a + offsets[k]: b + offsets[k]], dc[k])
            err -= y[a + k: b + k, None]
            total += np.abs(err, out=err).sum(axis=0)
    return total / ((last + 1 - first) * horizon)


# --- the matrix -----------------------------------------------------------------------------------------


def forecast_matrix(model: Model, values: np.ndarray | Sequence[float], horizon: int = 48, *,
                    zone: str | None = None) -> np.ndarray:
    """Every hour's forecast: row ``t`` is made at the start of hour ``t`` from ``values[:t]`` and covers
    hours ``t .. t+horizon-1`` (column ``h-1`` is the ``h``-hour-ahead forecast), gCO2e/kWh.

    Rows ``t < model.min_history`` repeat the last known value ``values[t-1]``; row 0 is NaN. Targets past
    the end of ``values`` are forecast like any other. ``model`` must be fitted (an
    :class:`ExponentialSmoothing` fitted on a training span, or given its parameters). Shape
    ``(len(values), horizon)``, float64, a new array.
    """
    _check_horizon(horizon, zone)
    y = _as_series(values, zone)
    if not model.fitted:
        raise ForecastError(
            f"{_where(zone)}{model.name} has no parameters: fit it on a training span first "
            f"(model.fit(train_values)) or give alpha, beta, gamma and phi"
        )
    n = len(y)
    out = np.empty((n, horizon))
    m = model.min_history
    start = min(m, n)
    out[0] = np.nan
    out[1:start] = y[: start - 1, None]  # fallback: the last known value
    if n <= m:
        return out
    offsets = _season_offsets(horizon, model.season_h)  # type: ignore[attr-defined]
    if isinstance(model, SeasonalNaive):
        for k in range(horizon):
            out[m:, k] = y[m + offsets[k]: n + offsets[k]]
        return out
    if isinstance(model, ExponentialSmoothing):
        levels, trends, snew, _ = _hw_states(y, m, model.alpha, model.beta, model.gamma, model.phi)
        dc = _damp_cum(model.phi, horizon)  # type: ignore[arg-type]
        for k in range(horizon):
            out[m:, k] = _hw_forecast(levels[m:], trends[m:], snew[m + offsets[k]: n + offsets[k]], dc[k])
        return out
    raise ForecastError(f"unknown model {model!r}")


# --- past the model's horizon: the mean day ----------------------------------------------------------------

REACH_H = 168
"""Hours a forecast row reaches when it is extended past its model's horizon (:func:`extend_by_profile`):
a week, as far as the time-shift search plans a start (``ShiftPolicy.horizon_h``)."""

PROFILE_DAYS = 28
"""Days of past values the mean day is taken over (:func:`daily_profile`): four weeks, what the live broker
reads per zone and round (``broker.carbon_forecast.history_h`` 672). Chosen on 2021 against 7 (README,
Evidence)."""


def daily_profile(values: np.ndarray | Sequence[float], days: int = PROFILE_DAYS,
                  at: np.ndarray | Sequence[int] | None = None, *, zone: str | None = None) -> np.ndarray:
    """The mean day before each hour of ``at`` (default every hour ``0 .. len(values)``): row ``i`` is made
    at the start of hour ``t = at[i]`` from ``values[:t]`` only, and its column ``r`` is the mean of
    ``values[t + r - 24 d]`` for ``d = 1 .. days``: the same hour of the day as hour ``t + r`` (and as every
    ``t + r + 24 n``) on each of the last ``days`` days, over those that exist; NaN where none does (``t +
    r < 24``). float64[len(at), 24], gCO2e/kWh. One pass of running sums (a stride-24 cumulative sum), so a
    year of hours costs a few milliseconds."""
    y = _as_series(values, zone)
    if isinstance(days, bool) or not isinstance(days, int | np.integer) or days < 1:
        raise ForecastError(f"{_where(zone)}days must be a whole number of 1 or more, not {days!r}")
    n = len(y)
    t = np.arange(n + 1) if at is None else np.asarray(at, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() > n):
        raise ForecastError(f"{_where(zone)}hours to make a mean day at must lie in 0 .. {n}")
    pad = (-n) % 24
    # c[i] = y[i] + y[i - 24] + y[i - 48] + ...: running sums along each hour of the day
    c = np.cumsum(np.concatenate([y, np.zeros(pad)]).reshape(-1, 24), axis=0).ravel()[:n]
    last = t[:, None] + np.arange(24)[None, :] - 24  # the latest value of that hour of the day before t
    first = last - 24 * days  # exclusive
    known = last >= 0
    total = np.where(known, c[np.clip(last, 0, n - 1)], 0.0)  # (n >= 1: _as_series refuses no values)
    total -= np.where(first >= 0, c[np.clip(first, 0, n - 1)], 0.0)
    count = np.where(known, np.minimum(days, last // 24 + 1), 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def extend_by_profile(rows: np.ndarray, profile: np.ndarray, reach_h: int = REACH_H) -> np.ndarray:
    """``rows`` (forecasts, [m, horizon]: row ``i`` from the hour its ``profile`` row was made at) extended
    to ``reach_h`` hours: hour ``k >= horizon`` of a row takes ``profile[i, k % 24]``, the mean of that hour
    of the day over the past days, or the row's last value where the profile has none (too little history).
    A model's skill fades within a day or two; past its horizon the zone's mean day is the better guess, and
    where the row's last hour, stretched, would stand for a whole week, it is the zone's typical day
    instead. ``reach_h`` at most ``horizon``: the rows as they are (a copy, cut to ``reach_h``)."""
    rows = np.asarray(rows)
    horizon = rows.shape[1]
    out = np.empty((rows.shape[0], max(reach_h, 0)), dtype=np.result_type(rows.dtype, np.float32))
    head = min(horizon, reach_h)
    out[:, :head] = rows[:, :head]
    if reach_h > horizon:
        tail = profile[:, np.arange(horizon, reach_h) % 24]
        out[:, horizon:] = np.where(np.isnan(tail), rows[:, -1:], tail)
    return out


# --- the live forecaster --------------------------------------------------------------------------------


class Forecaster:
    """One zone's live forecaster: :meth:`fit` on the history, :meth:`update` with each new hour's actual
    value, :meth:`predict` the next hours. Gives the same numbers as the matching row of
    :func:`forecast_matrix` (the same recursion runs underneath).
    """

    def __init__(self, model: Model, *, zone: str | None = None):
        self.model: Model = model
        self.zone = zone
        self._t = 0  # hours observed
        self._recent: list[float] = []  # seasonal naive: the last season_h values
        self._level = 0.0
        self._trend = 0.0
        self._season: list[float] = []

    @property
    def hours_seen(self) -> int:
        """Hours observed so far (the history given to :meth:`fit` plus every :meth:`update`)."""
        return self._t

    def fit(self, history: np.ndarray | Sequence[float], *, horizon: int = 48,
            score_from: int = WARMUP_H) -> Forecaster:
        """Fit the model's parameters on ``history`` if it has none, then run it over ``history``.

        ``history`` is hourly gCO2e/kWh up to the present, oldest first; it needs at least
        ``model.min_history`` values (and enough to fit, if fitting). Returns ``self``.
        """
        y = _as_series(history, self.zone)
        if len(y) < self.model.min_history:
            raise ForecastError(
                f"{_where(self.zone)}{self.model.name} needs at least {self.model.min_history} hours of history, "
                f"got {len(y)}"
            )
        self.model = self.model.fit(y, horizon=horizon, score_from=score_from, zone=self.zone)
        m = self.model.min_history
        self._t = len(y)
        if isinstance(self.model, SeasonalNaive):
            self._recent = y[-m:].tolist()
        elif isinstance(self.model, ExponentialSmoothing):
            md = self.model
            _, _, _, (self._level, self._trend, self._season) = _hw_states(y, m, md.alpha, md.beta, md.gamma,
                                                                           md.phi)
        else:
            raise ForecastError(f"unknown model {self.model!r}")
        return self

    def update(self, value: float) -> None:
        """Observe the actual value of the next hour."""
        if self._t == 0:
            raise ForecastError(f"{_where(self.zone)}call fit(history) before update")
        v = float(value)
        if not math.isfinite(v):
            raise ForecastError(f"{_where(self.zone)}hour {self._t} value {value!r} is not a finite number")
        if isinstance(self.model, SeasonalNaive):
            self._recent.append(v)
            del self._recent[0]
        else:
            md = self.model
            m = md.min_history
            self._level, self._trend, _ = _hw_step(self._level, self._trend, self._season, self._t % m, v,
                                                   md.alpha, md.beta, md.gamma, md.phi)  # type: ignore[attr-defined]
        self._t += 1

    def predict(self, horizon: int = 48) -> np.ndarray:
        """Forecasts of the next ``horizon`` hours (gCO2e/kWh), made from every value seen so far."""
        _check_horizon(horizon, self.zone)
        if self._t == 0:
            raise ForecastError(f"{_where(self.zone)}call fit(history) before predict")
        m = self.model.min_history
        offsets = _season_offsets(horizon, m)
        if isinstance(self.model, SeasonalNaive):
            return np.asarray(self._recent)[m + offsets]
        phi = self.model.phi  # type: ignore[attr-defined]
        seasonal = np.asarray(self._season)[(self._t + offsets) % m]
        return _hw_forecast(self._level, self._trend, seasonal, _damp_cum(phi, horizon))


# --- scoring --------------------------------------------------------------------------------------------


def mae(matrix: np.ndarray, values: np.ndarray | Sequence[float], first: int, last: int) -> float:
    """Mean absolute error (gCO2e/kWh) of ``matrix``'s rows ``first..last`` (inclusive) against ``values``:
    every step ``h`` of row ``t`` against ``values[t+h-1]``; every target must lie inside ``values``."""
    y = np.asarray(values, dtype=np.float64)
    horizon = matrix.shape[1]
    if first > last or first < 0 or last + horizon > len(y):
        raise ForecastError(f"rows {first}..{last} with horizon {horizon} do not fit {len(y)} values")
    total = 0.0
    for k in range(horizon):
        total += float(np.abs(matrix[first: last + 1, k] - y[first + k: last + 1 + k]).sum())
    return total / ((last - first + 1) * horizon)


def mase_scale(values: np.ndarray | Sequence[float], first: int, end: int, season: int = 24) -> float:
    """In-sample MAE of the seasonal-naive one-step forecast over hours ``[first, end)``:
    ``mean |y_t - y_{t-season}|`` for t in the span with t >= season (the MASE denominator, gCO2e/kWh)."""
    y = np.asarray(values, dtype=np.float64)
    lo = max(first, season)
    if end - lo < 1:
        raise ForecastError(f"no hour in [{first}, {end}) has a value {season} h before it")
    return float(np.abs(y[lo:end] - y[lo - season: end - season]).mean())


@dataclass(frozen=True, slots=True)
class ModelScore:
    """One candidate's figures in one zone (MAE in gCO2e/kWh)."""

    model: str
    params: dict[str, float]
    train_mae: float
    train_mase: float
    test_mae: float
    test_mase: float

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "params": dict(self.params), "train_mae": self.train_mae,
                "train_mase": self.train_mase, "test_mae": self.test_mae, "test_mase": self.test_mase}


@dataclass(frozen=True, slots=True)
class ZoneForecast:
    """The choice in one zone: the fitted ``model`` (ready for :func:`forecast_matrix` or a
    :class:`Forecaster`), the MASE ``scale`` (gCO2e/kWh) and every candidate's :class:`ModelScore`."""

    zone: str
    model: Model
    scale: float
    scores: tuple[ModelScore, ...]

    @property
    def chosen(self) -> ModelScore:
        return next(s for s in self.scores if s.model == self.model.name)

    def as_dict(self) -> dict[str, Any]:
        c = self.chosen
        return {"zone": self.zone, "chosen": c.model, "test_mae": c.test_mae, "test_mase": c.test_mase,
                "mase_scale": self.scale, "candidates": [s.as_dict() for s in self.scores]}


@dataclass(frozen=True, slots=True)
class ForecastReport:
    """:func:`choose_models`' result: per zone, the chosen model and every candidate's figures."""

    train: tuple[datetime, datetime]
    test: tuple[datetime, datetime]
    horizon: int
    zones: tuple[ZoneForecast, ...]

    def zone(self, zone: str) -> ZoneForecast:
        for z in self.zones:
            if z.zone == zone:
                return z
        raise ForecastError(f"no forecast for zone {zone!r}; zones: {', '.join(z.zone for z in self.zones)}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: spans as ISO 8601 strings, errors as floats (MAE in gCO2e/kWh)."""
        return {
            "train": [self.train[0].isoformat(), self.train[1].isoformat()],
            "test": [self.test[0].isoformat(), self.test[1].isoformat()],
            "horizon_h": self.horizon,
            "warmup_h": WARMUP_H,
            "units": {"mae": "gCO2e/kWh", "mase": "MAE / mean |y_t - y_(t-24)| on the training span"},
            "zones": [z.as_dict() for z in self.zones],
        }

    def format_table(self) -> str:
        """A text table: per zone the chosen model, its test MAE and MASE, then each candidate's train MAE and
        test MAE / MASE (the chosen one marked ``*``)."""
        names = list(dict.fromkeys(s.model for z in self.zones for s in z.scores))
        head = ["zone", "chosen", "test MAE", "test MASE", "scale"] + [f"{n} train/test MAE (MASE)" for n in names]
        rows = []
        for z in self.zones:
            c = z.chosen
            by = {s.model: s for s in z.scores}
            cells = [z.zone, c.model, f"{c.test_mae:.1f}", f"{c.test_mase:.3f}", f"{z.scale:.1f}"]
            for n in names:
                s = by.get(n)
                cells.append("-" if s is None else
                             f"{s.train_mae:.1f} / {s.test_mae:.1f} ({s.test_mase:.3f}){' *' if s is c else ''}")
            rows.append(cells)
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"{self.horizon} h forecasts; chosen on {_day(self.train[0])}..{_day(self.train[1])} by MAE, "
            f"tested on {_day(self.test[0])}..{_day(self.test[1])} (end exclusive); MAE in gCO2e/kWh, "
            f"MASE = MAE / scale (mean |y_t - y_t-24| on the training span)",
            "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip(),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join(lines)


def choose_models(
    carbon: CarbonData,
    zones: Iterable[str] | None = None,
    train: tuple[datetime, datetime] = TRAIN_SPAN,
    test: tuple[datetime, datetime] = TEST_SPAN,
    horizon: int = 48,
    models: Sequence[Model] = DEFAULT_MODELS,
) -> ForecastReport:
    """Per zone, the candidate with the lowest training MAE, scored on the test span (see the module doc).

    ``zones`` defaults to every zone of ``carbon``. Each zone's series is read from its first hour to the end
    of ``test``; unfitted models are fitted on the values before ``train[1]`` only. The training span must
    start at or after the data and end at or before the test span starts; both must be covered by the data.
    """
    _check_horizon(horizon, None)
    if not models:
        raise ForecastError("no candidate models given")
    for what, (a, b) in (("train", train), ("test", test)):
        if a.tzinfo is None or b.tzinfo is None:
            raise ForecastError(f"the {what} span must be timezone-aware datetimes (UTC)")
        if b <= a:
            raise ForecastError(f"the {what} span {_day(a)}..{_day(b)} is empty")
    if train[1] > test[0]:
        raise ForecastError(f"the training span (to {_day(train[1])}) overlaps the test span (from {_day(test[0])})")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ForecastError(f"candidate models must have distinct names: {names}")
    out = []
    for zone in (carbon.zones() if zones is None else zones):
        out.append(_choose_zone(carbon, zone, train, test, horizon, models))
    return ForecastReport(train, test, horizon, tuple(out))


def _choose_zone(carbon: CarbonData, zone: str, train: tuple[datetime, datetime], test: tuple[datetime, datetime],
                 horizon: int, models: Sequence[Model]) -> ZoneForecast:
    try:
        start, end = carbon.span(zone)
        name = grid_zone(zone)  # an alias such as "DE" is reported under its canonical id
    except (CarbonDataError, UnknownIdentifier) as err:
        raise ForecastError(str(err)) from None
    if train[0] < start or test[1] > end:
        raise ForecastError(
            f"zone {name}: its carbon data covers {_day(start)}..{_day(end)}, not the training and test spans "
            f"{_day(train[0])}..{_day(test[1])}"
        )
    y = np.asarray(carbon.series(zone, start, (test[1] - start) // _HOUR))
    _as_series(y, name)
    tr0, tr1 = (train[0] - start) // _HOUR, (train[1] - start) // _HOUR
    te0, te1 = (test[0] - start) // _HOUR, (test[1] - start) // _HOUR
    first = max(tr0, WARMUP_H)
    if tr1 - horizon < first:
        raise ForecastError(
            f"zone {name}: too little history to choose a model: the training span needs more than "
            f"{horizon} hours after the first {WARMUP_H} hours of data, it has {max(0, tr1 - first)}"
        )
    if te1 - horizon < te0:
        raise ForecastError(f"zone {name}: the test span is shorter than the {horizon} h horizon")
    scale = mase_scale(y, tr0, tr1)
    if scale <= 0:
        raise ForecastError(
            f"zone {name}: intensity repeats exactly day to day in the training span; MASE is undefined"
        )
    fitted, scores = [], []
    for model in models:
        fm = model.fit(y[:tr1], horizon=horizon, score_from=first, zone=name)
        mat = forecast_matrix(fm, y, horizon, zone=name)
        tr_mae = mae(mat, y, first, tr1 - horizon)
        te_mae = mae(mat, y, te0, te1 - horizon)
        fitted.append(fm)
        scores.append(ModelScore(fm.name, fm.params(), tr_mae, tr_mae / scale, te_mae, te_mae / scale))
    best = min(range(len(scores)), key=lambda i: (scores[i].train_mae, i))
    return ZoneForecast(name, fitted[best], scale, tuple(scores))


# --- checks ---------------------------------------------------------------------------------------------


def _check_horizon(horizon: int, zone: str | None) -> None:
    if isinstance(horizon, bool) or not isinstance(horizon, int | np.integer) or horizon < 1:
        raise ForecastError(f"{_where(zone)}the horizon must be a whole number of hours of 1 or more, not {horizon!r}")


def _as_series(values: np.ndarray | Sequence[float], zone: str | None) -> np.ndarray:
    try:
        y = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ForecastError(f"{_where(zone)}values must be numbers (hourly gCO2e/kWh)") from None
    if y.ndim != 1:
        raise ForecastError(f"{_where(zone)}values must be one-dimensional (one value per hour), not shape {y.shape}")
    if len(y) == 0:
        raise ForecastError(f"{_where(zone)}no values: a forecast needs at least one hour of history")
    bad = ~np.isfinite(y)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ForecastError(
            f"{_where(zone)}{int(bad.sum())} value(s) are NaN or infinite, the first at hour {k} ({y[k]}); "
            "forecasts need a complete series"
        )
    return y


def _day(when: datetime) -> str:
    w = when.astimezone(UTC)
    return w.strftime("%Y-%m-%d") if (w.hour, w.minute, w.second) == (0, 0, 0) else w.strftime("%Y-%m-%d %H:%M")
