"""Carbon: prefer the site whose grid is forecast cleanest over the job's run.

Raw value: kg CO2e = the job's estimated energy (GPUs held × the board power of the lowest-power model at
the site it could use with room, in kW, × expected duration in hours) × the site zone's mean forecast
intensity (g/kWh) over the hours from now to now + duration / 1000. The forecast is the snapshot's
``carbon_forecast`` (hourly, from the hour containing ``now``); beyond its horizon the last forecast hour
stands for the rest of the run; without a forecast the current intensity (``carbon_g_per_kwh``) is used; a
site with neither ranks after every known one. Lower is better. Weight from the profile (``green`` 1.0,
``balanced`` 0.5); 0 turns it off.
"""

from __future__ import annotations

import numpy as np

from policies import _scores
from policies.filters.gpu_fit import Fit, fit_matrix
from policies.scorers._usable import least_where, unknown_last, usable_models
from policies.snapshot import TDP_KW, JobRequest, Snapshot, running_sums


def window_mean(forecast: np.ndarray, offset_h: float, duration_h: float, cum: np.ndarray | None = None) -> np.ndarray:
    """Mean of each row of an hourly ``forecast`` over ``[offset_h, offset_h + duration_h)`` hours from its
    first hour, partial hours pro rata; hours past the forecast's end take its last value. ``cum``: the
    rows' running sums (``policies.snapshot.running_sums``), when the caller has them."""
    hours = forecast.shape[1]
    if cum is None or cum.shape != (forecast.shape[0], hours + 1):
        cum = running_sums(forecast)

    def integral(t: float) -> np.ndarray:
        if t >= hours:
            return cum[:, hours] + (t - hours) * forecast[:, hours - 1]
        h = int(t)
        return cum[:, h] + (t - h) * forecast[:, h]

    span = max(duration_h, 1e-9)
    return (integral(offset_h + span) - integral(offset_h)) / span


def run_intensity(req: JobRequest, snap: Snapshot, start_offset_h: float = 0.0) -> np.ndarray:
    """Mean forecast g/kWh per site over a run starting ``start_offset_h`` hours after ``now``."""
    duration_h = req.duration_s / 3600.0
    forecast, cum = snap.carbon_forecast, snap.carbon_forecast_cum
    if forecast.shape[0] == snap.n_sites and forecast.shape[1] > 0:
        into_hour = (snap.now.minute * 60 + snap.now.second + snap.now.microsecond / 1e6) / 3600.0
        if forecast.dtype == np.float64 and cum.shape == (forecast.shape[0], forecast.shape[1] + 1):
            # window_mean, compiled: the same values
            return _scores.window_mean_rows(forecast, cum, into_hour + start_offset_h, duration_h)
        return window_mean(forecast, into_hour + start_offset_h, duration_h, cum)
    if snap.carbon_g_per_kwh.size == snap.n_sites:
        return snap.carbon_g_per_kwh.astype(np.float64)
    return np.full(snap.n_sites, np.nan)


def power_kw(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """kW the job would draw per site: GPUs held × the lowest-power usable model with room."""
    ok = usable_models(req, snap) & fit_matrix(req, snap)
    tdp = np.where(ok, TDP_KW[None, :], np.nan)
    with np.errstate(invalid="ignore"):
        return np.fmin.reduce(tdp, axis=1) * req.charge


def power_kw_fit(fit: Fit) -> np.ndarray:
    """``power_kw`` over the decision's shared fit: the same values."""
    power = least_where(fit.room, TDP_KW[fit.usable.columns])
    power *= fit.req.charge
    return power


class CarbonScorer:
    name = "carbon"
    higher_is_better = False

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        return self.raw_fit(Fit(req, snap))

    def raw_fit(self, fit: Fit) -> np.ndarray:
        req, snap = fit.req, fit.snap
        # The mean intensity over the run depends only on the snapshot and the run's length.
        intensity = snap.derived(("run-intensity", req.duration_s), run_intensity, req, snap)
        held, duration_s = req.charge, req.duration_s
        if held >= 0 and duration_s >= 0:
            # kWh per usable model, in the order of ``power_kw * duration_s / 3600``: rounding is monotonic,
            # so the least of them is the kWh of the lowest-power model, as ``power_kw`` takes it.
            kwh = np.array([[kw * held * duration_s / 3600.0 for kw in fit.usable.tdp_kw]])
            # least_where(fit.room, kwh) * intensity / 1000, then unknown_last, in one compiled pass
            kg = _scores.least_scaled(fit.room, kwh, intensity, _scores.NO_VALUES, 1000.0)
            kg.flags.writeable = False  # (raw values are read, never written: the pipeline takes them as they are)
            return kg
        else:
            kg = power_kw_fit(fit)
            kg *= duration_s
            kg /= 3600.0
        kg *= intensity
        kg /= 1000.0
        return unknown_last(kg)

    def unknown_fit(self, fit: Fit) -> np.ndarray:
        """Where the raw value stands in for an unknown one: the zone has neither a forecast nor an intensity
        now, or no model the job could use has room (so its power is unknown)."""
        req, snap = fit.req, fit.snap
        intensity = snap.derived(("run-intensity", req.duration_s), run_intensity, req, snap)
        return ~fit.room.any(axis=1) | np.isnan(intensity)  # (every model's power is known: room is all it needs)
