"""The carbon forecasts a simulated broker sees: for every hour of the run, each zone's next week, made
from the values before that hour only (``broker.forecast``): the chosen model's 48 hours, then the zone's
mean day over the past four weeks (:func:`broker.forecast.extend_by_profile`), as the live broker's rows.

Per zone, the model is chosen the way the live broker chooses it: among seasonal-naive (24 h, 168 h) and
damped Holt-Winters, the one with the lowest 1–48 h-ahead MAE on the zone's history *before the run
starts* (Holt-Winters is fitted on that history too); nothing after the run's start is used to choose or
fit. With less than three weeks of history the zone gets seasonal-naive (24 h), reported. Built only when
a replayed policy reads forecasts (the profiles); the baselines see the current intensity only.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np

from broker.data.carbon import CarbonData
from broker.forecast import (DEFAULT_MODELS, PROFILE_DAYS, REACH_H, WARMUP_H, SeasonalNaive, daily_profile,
                             extend_by_profile, forecast_matrix, mae)

HORIZON_H = 48
_HOUR = timedelta(hours=1)
_MIN_HISTORY_H = 21 * 24


def forecast_rows(carbon: CarbonData, zone: str, hour0: datetime, hours: int,
                  report: list[str]) -> np.ndarray:
    """float32[hours, REACH_H]: row h is the forecast made at the start of run hour h (hour0 + h): the
    model's HORIZON_H hours, then the mean day of the PROFILE_DAYS days before hour h."""
    start, end = carbon.span(zone)
    y = np.asarray(carbon.series(zone, start, (end - start) // _HOUR), dtype=np.float64)
    k0 = (hour0 - start) // _HOUR
    history = y[:k0]
    model = SeasonalNaive(24)
    if k0 >= _MIN_HISTORY_H:
        best = None
        for candidate in DEFAULT_MODELS:
            fitted = candidate.fit(history, horizon=HORIZON_H, score_from=WARMUP_H, zone=zone)
            score = mae(forecast_matrix(fitted, history, HORIZON_H, zone=zone), history, WARMUP_H, k0 - HORIZON_H)
            if best is None or score < best[0]:
                best = (score, fitted)
        assert best is not None
        model = best[1]
        report.append(f"forecast: {zone}: {model.name}, {best[0]:.1f} g/kWh MAE over the {k0} h before the run")
    else:
        report.append(f"forecast: {zone}: only {k0} h of history before the run; seasonal-naive (24 h)")
    rows = forecast_matrix(model, y[:k0 + hours], HORIZON_H, zone=zone)[k0:k0 + hours]
    rows = extend_by_profile(rows, daily_profile(y[:k0 + hours], PROFILE_DAYS, np.arange(k0, k0 + hours), zone=zone),
                             REACH_H)
    # With no value before the run's first hour (k0 == 0), that hour's row is NaN (forecast_matrix's row 0).
    return rows.astype(np.float32)
