"""Carbon intensity forecasts: no forecast sees the hour it is made in or any later one, the models do what
they claim on series whose answer is known, the live forecaster and the matrix agree, the choice per zone
on the real Electricity Maps data is the lower training error, and bad input stops with a message that
names the zone."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.data.carbon import CarbonData, load_carbon
from broker.forecast import (
    ExponentialSmoothing,
    ForecastError,
    Forecaster,
    Grid,
    SeasonalNaive,
    choose_models,
    daily_profile,
    extend_by_profile,
    forecast_matrix,
    mae,
    mase_scale,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
ELECTRICITY_MAPS = SHARED / "carbon-intensity" / "electricitymaps-hourly"

HW = ExponentialSmoothing(alpha=0.3, beta=0.05, gamma=0.2, phi=0.9)
MODELS = (SeasonalNaive(24), SeasonalNaive(168), HW, ExponentialSmoothing(0.1, 0.0, 0.1, 1.0, damped=False))


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def daily(days: int, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """A daily-periodic intensity profile (gCO2e/kWh) over ``days`` days, plus Gaussian noise."""
    hours = np.arange(days * 24)
    rng = np.random.default_rng(seed)
    profile = 300 + 80 * np.sin(2 * np.pi * hours / 24) + 30 * np.cos(4 * np.pi * hours / 24)
    return profile + rng.normal(0, noise, hours.size)


# --- no future leakage -----------------------------------------------------------------------------------


def random_series(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(0, 1000, n)
    if kind == "daily":
        return np.clip(300 + 150 * np.sin(2 * np.pi * np.arange(n) / 24 + rng.uniform(0, 6)) + rng.normal(0, 40, n),
                       0, None)
    return np.repeat(rng.choice([0.0, 0.5, 80.0, 800.0], -(-n // 7)), 7)[:n]  # steps, with zeros


SERIES = st.sampled_from(["uniform", "daily", "steps"])


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(MODELS), kind=SERIES, n=st.integers(1, 400), seed=st.integers(0, 2**32 - 1),
       horizon=st.integers(1, 60), data=st.data())
def test_row_t_uses_only_values_before_t(model, kind, n, seed, horizon, data):
    y = random_series(kind, n, seed)
    t = data.draw(st.integers(0, n - 1), label="t")
    changed = y.copy()
    changed[t:] = random_series(data.draw(SERIES, label="new kind"), n - t,
                                data.draw(st.integers(0, 2**32 - 1), label="new seed"))
    before, after = forecast_matrix(model, y, horizon), forecast_matrix(model, changed, horizon)
    assert before.shape == (len(y), horizon)
    # every row up to and including t was made before hour t: none may move
    assert np.array_equal(before[: t + 1], after[: t + 1], equal_nan=True)


def test_changing_the_test_year_changes_nothing_chosen_on_the_training_year():
    y = daily(60, noise=15, seed=3)
    spans = dict(train=(utc(2021, 1, 1), utc(2021, 1, 31)), test=(utc(2021, 1, 31), utc(2021, 3, 2)), horizon=24)
    changed = y.copy()
    changed[30 * 24:] = daily(30, noise=60, seed=4) * 2
    reports = [choose_models(CarbonData.from_arrays({"GB": (utc(2021, 1, 1), v)}), **spans).zone("GB")
               for v in (y, changed)]
    a, b = reports
    assert a.model == b.model and a.scale == b.scale
    assert [(s.model, s.params, s.train_mae) for s in a.scores] == [(s.model, s.params, s.train_mae) for s in b.scores]
    assert a.chosen.test_mae != b.chosen.test_mae  # the test year did change


# --- the models on series whose answer is known ------------------------------------------------------------


@pytest.mark.parametrize("season", [24, 168])
def test_seasonal_naive_forecasts_a_periodic_series_exactly(season):
    rng = np.random.default_rng(season)
    y = np.tile(rng.uniform(0, 800, season), 6)
    m = forecast_matrix(SeasonalNaive(season), y, 48)
    for t in range(season, len(y) - 48):
        assert np.array_equal(m[t], y[t: t + 48]), t


def test_early_rows_repeat_the_last_known_value_and_row_0_is_nan():
    y = daily(3, noise=5)
    for model in (SeasonalNaive(24), HW):
        m = forecast_matrix(model, y, 10)
        assert np.isnan(m[0]).all()
        for t in range(1, 24):
            assert (m[t] == y[t - 1]).all()
        assert not (m[24] == y[23]).all()
    short = forecast_matrix(SeasonalNaive(168), y[:5], 3)
    assert np.isnan(short[0]).all() and (short[1:, 0] == y[:4]).all()


def test_holt_winters_beats_a_flat_forecast_on_a_noisy_periodic_series():
    y = daily(120, noise=20, seed=1) + np.linspace(0, 60, 120 * 24)  # a slow upward drift too
    train = 60 * 24
    hw = ExponentialSmoothing().fit(y[:train])
    assert hw.fitted and set(hw.params()) == {"alpha", "beta", "gamma", "phi"}
    m = forecast_matrix(hw, y, 48)
    first, last = train, len(y) - 48
    flat = np.repeat(y[first - 1: last, None], 48, axis=1)  # the last known value, held
    hw_mae = mae(m, y, first, last)
    flat_mae = mae(np.vstack([np.zeros((first, 48)), flat]), y, first, last)
    assert hw_mae < 0.5 * flat_mae
    assert hw_mae < 1.5 * 20 * math.sqrt(2 / math.pi)  # close to the noise's own MAE (16 g/kWh)


def test_fit_picks_the_grid_point_with_the_lower_training_mae():
    y = daily(40, noise=25, seed=7)
    grid = Grid(alpha=(0.02, 0.9), beta=(0.0,), gamma=(0.05, 0.9), phi=())
    fitted = ExponentialSmoothing(grid=grid).fit(y, horizon=24, score_from=168)
    errors = {}
    for a in grid.alpha:
        for g in grid.gamma:
            model = ExponentialSmoothing(a, 0.0, g, 1.0)
            errors[(a, g)] = mae(forecast_matrix(model, y, 24), y, 168, len(y) - 24)
    assert min(errors, key=errors.get) == (fitted.alpha, fitted.gamma)


def test_mase_of_the_daily_seasonal_naive_in_sample_is_one():
    y = daily(30, noise=20, seed=2)
    m = forecast_matrix(SeasonalNaive(24), y, 1)
    assert mae(m, y, 24, len(y) - 1) / mase_scale(y, 0, len(y)) == pytest.approx(1.0, rel=1e-12)


# --- the live forecaster -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [SeasonalNaive(24), SeasonalNaive(168), HW], ids=lambda m: m.name)
def test_forecaster_gives_the_rows_of_the_matrix(model):
    y = daily(20, noise=10, seed=5)
    m = forecast_matrix(model, y, 48)
    f = Forecaster(model, zone="GB").fit(y[:200])
    for t in range(200, 260):
        np.testing.assert_allclose(f.predict(48), m[t], rtol=1e-12)
        f.update(y[t])
    assert f.hours_seen == 260


def test_no_forecast_is_below_zero_where_a_clean_grids_day_swings_wider_than_its_level():
    # Ontario's real series (the cleanest grid in the data, a few g/kWh at night): Holt-Winters, fitted on it,
    # forecast below 0 on many hours before it was held at 0; the live forecaster gives the same rows.
    # Fitted on 2021 before September, as the Evidence's replay of 2021 fits it; its lowest value is 2 g/kWh.
    y = np.asarray(load_carbon(ELECTRICITY_MAPS).series("CA-ON", utc(2021, 1, 1), 24 * (243 + 60)), dtype=np.float64)
    fit_h = 24 * 243
    model = ExponentialSmoothing().fit(y[:fit_h], horizon=48)
    raw = forecast_matrix(model, y, 48)
    assert np.nanmin(raw) == 0.0, "the rows reach 0 where the sum is below it, and go no lower"
    f = Forecaster(model, zone="CA-ON").fit(y[:fit_h])
    for t in range(fit_h, fit_h + 72):
        np.testing.assert_array_equal(f.predict(48), raw[t])
        f.update(y[t])


def test_forecaster_fits_an_unfitted_model_on_its_history():
    y = daily(30, noise=10, seed=6)
    f = Forecaster(ExponentialSmoothing(), zone="DE-LU").fit(y)
    assert f.model.fitted
    assert f.predict(5).shape == (5,)


# --- errors ------------------------------------------------------------------------------------------------


def test_errors_name_the_zone():
    y = daily(10)
    with pytest.raises(ForecastError, match="zone DE-LU.*horizon must be .* 1 or more"):
        forecast_matrix(SeasonalNaive(24), y, 0, zone="DE-LU")
    bad = y.copy()
    bad[50] = np.nan
    with pytest.raises(ForecastError, match="zone GB: 1 value.* NaN .* hour 50"):
        forecast_matrix(HW, bad, zone="GB")
    with pytest.raises(ForecastError, match="zone GB: .*NaN"):
        Forecaster(SeasonalNaive(24), zone="GB").fit(bad)
    with pytest.raises(ForecastError, match="zone CA-ON: fitting holt-winters.* needs at least 216 hours"):
        ExponentialSmoothing().fit(y[:100], zone="CA-ON")
    with pytest.raises(ForecastError, match="zone KR: seasonal-naive-168h needs at least 168 hours.* got 100"):
        Forecaster(SeasonalNaive(168), zone="KR").fit(y[:100])
    with pytest.raises(ForecastError, match="zone SG: holt-winters.* has no parameters"):
        forecast_matrix(ExponentialSmoothing(), y, zone="SG")
    with pytest.raises(ForecastError, match="zone SG: call fit"):
        Forecaster(HW, zone="SG").predict()
    with pytest.raises(ForecastError, match="all four"):
        ExponentialSmoothing(alpha=0.5)
    assert issubclass(ForecastError, ValueError)


def test_choose_models_errors_name_the_zone():
    carbon = CarbonData.from_arrays({"GB": (utc(2021, 1, 1), daily(20))})
    with pytest.raises(ForecastError, match="zone GB: its carbon data covers 2021-01-01..2021-01-21"):
        choose_models(carbon)
    with pytest.raises(ForecastError, match="zone GB: too little history"):
        choose_models(carbon, train=(utc(2021, 1, 1), utc(2021, 1, 8)), test=(utc(2021, 1, 8), utc(2021, 1, 21)))
    with pytest.raises(ForecastError, match="overlaps"):
        choose_models(carbon, train=(utc(2021, 1, 1), utc(2021, 1, 15)), test=(utc(2021, 1, 10), utc(2021, 1, 21)))


# --- the real data -----------------------------------------------------------------------------------------


def test_choose_models_on_the_real_data():
    assert ELECTRICITY_MAPS.is_dir(), (
        f"the shared Electricity Maps data is missing: expected one folder per zone under {ELECTRICITY_MAPS} "
        "(the project's shared data folder, ../shared/data from the repository)"
    )
    zones = ("DE-LU", "GB", "CA-ON")
    report = choose_models(load_carbon(ELECTRICITY_MAPS, zones=zones), zones)
    assert [z.zone for z in report.zones] == list(zones)
    for z in report.zones:
        assert len(z.scores) == 3 and z.scale > 0
        for s in z.scores:
            for v in (s.train_mae, s.train_mase, s.test_mae, s.test_mase):
                assert math.isfinite(v) and v > 0, (z.zone, s)
        assert z.chosen.train_mae == min(s.train_mae for s in z.scores), z.zone
        assert z.model.fitted
    back = json.loads(json.dumps(report.as_dict()))
    assert back["train"] == ["2021-01-01T00:00:00+00:00", "2022-01-01T00:00:00+00:00"]
    assert [z["zone"] for z in back["zones"]] == list(zones)
    table = report.format_table()
    assert all(zone in table for zone in zones) and "MASE" in table
    # the matrix over the real two years has the promised shape, with real forecasts from the first day on
    y = load_carbon(ELECTRICITY_MAPS, zones=["GB"]).series("GB", utc(2021, 1, 1), 2 * 365 * 24)
    m = forecast_matrix(report.zone("GB").model, y)
    assert m.shape == (17520, 48) and np.isfinite(m[1:]).all()
    assert timedelta(hours=len(y)) == utc(2023, 1, 1) - utc(2021, 1, 1)


# --- past the model's horizon: the mean day ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=24 * 9), st.integers(1, 10))
def test_the_mean_day_is_each_hour_of_the_days_mean_over_the_last_days_before_it(values, days) -> None:
    """Column r of the row made at hour t: the mean of values[t + r - 24 d], d = 1 .. days, over those that
    exist (NaN where none does), checked against the sum written out."""
    y = np.array(values)
    got = daily_profile(y, days)
    assert got.shape == (len(y) + 1, 24)
    for t in range(len(y) + 1):
        for r in range(24):
            seen = [y[t + r - 24 * d] for d in range(1, days + 1) if t + r - 24 * d >= 0]
            if seen:
                assert got[t, r] == pytest.approx(np.mean(seen), rel=1e-9, abs=1e-9)
            else:
                assert math.isnan(got[t, r])


def test_the_mean_day_reads_only_the_past() -> None:
    """Rows made at hour t are the same whatever the values from t on are (a forecast never sees the
    future), and ``at`` picks rows."""
    rng = np.random.default_rng(3)
    y = rng.uniform(50, 500, 24 * 40)
    poisoned = y.copy()
    poisoned[24 * 30:] = 1e6
    at = np.arange(0, 24 * 30 + 1, 7)
    np.testing.assert_array_equal(daily_profile(y, 28, at), daily_profile(poisoned, 28, at))
    np.testing.assert_array_equal(daily_profile(y, 28, at), daily_profile(y, 28)[at])
    with pytest.raises(ForecastError, match="days must be a whole number of 1 or more"):
        daily_profile(y, 0)
    with pytest.raises(ForecastError, match="must lie in 0 .. 960"):
        daily_profile(y, 7, [961])


def test_rows_go_on_with_the_mean_day_past_the_models_horizon() -> None:
    """A 2-hour forecast made at 22:00 reaches 6 hours: 22:00 and 23:00 are the model's, then 00:00 .. 03:00
    the mean day's; a row with no mean day (too little history) keeps its last value; reach at most the
    horizon cuts the rows."""
    rows = np.array([[10.0, 20.0], [30.0, 40.0]])
    profile = np.full((2, 24), np.nan)
    profile[0] = np.arange(24) * 100.0  # column r: the hour r hours after the row's first hour
    out = extend_by_profile(rows, profile, 6)
    np.testing.assert_array_equal(out[0], [10, 20, 200, 300, 400, 500])
    np.testing.assert_array_equal(out[1], [30, 40, 40, 40, 40, 40])
    np.testing.assert_array_equal(extend_by_profile(rows, profile, 1), rows[:, :1])


def test_on_real_data_the_mean_day_past_48_hours_beats_the_last_hour_stretched() -> None:
    """GB, every row of the first half of 2022: the 49..168 h-ahead values are closer to the truth as the
    zone's mean day over 28 days than as the model's 48th hour stretched (bench/forecast_reach.py gives
    every zone and the whole year)."""
    from broker.simulation.forecasts import forecast_rows

    carbon = load_carbon(ELECTRICITY_MAPS, zones=["GB"])
    start = utc(2022, 1, 1)
    first, end = carbon.span("GB")
    y = np.asarray(carbon.series("GB", first, (end - first) // timedelta(hours=1)), dtype=np.float64)
    k0 = (start - first) // timedelta(hours=1)
    hours = 181 * 24
    rows = forecast_rows(carbon, "GB", start, hours, []).astype(np.float64)
    truth = y[(k0 + np.arange(hours))[:, None] + np.arange(48, 168)[None, :]]
    stretched = np.abs(rows[:, 47:48] - truth).mean()
    mean_day = np.abs(rows[:, 48:] - truth).mean()
    assert mean_day < 0.9 * stretched
