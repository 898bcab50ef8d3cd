"""Follow the sun, in two modes, scored over the first hours of the job's expected run.

- ``offpeak``: prefer sites outside their local business hours (Monday to Friday, 09:00 to 18:00 local
  time, daylight saving included), where capacity sits idle and is cheap. Raw value: the fraction of the
  run window (up to its first 24 hours) that falls outside business hours, 0..1, computed exactly.
- ``solar``: prefer sites where the sun is up, so the work follows solar generation. Raw value: the mean
  sine of the sun's elevation (0 when it is below the horizon) at the site over the run window (up to its
  first 12 hours, sampled every 15 minutes), from the site's latitude and longitude and the date (NOAA's
  low-precision solar position: declination and equation of time to a few tenths of a degree).

Higher is better in both. Weight from the profile (``balanced`` 0.1 in ``offpeak`` mode); 0 turns it off.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from policies.snapshot import JobRequest, Snapshot

BUSINESS_HOURS = (9.0, 18.0)  # local time, Monday to Friday
_STEP_H = 0.25


def _samples(req: JobRequest, cap_h: float) -> np.ndarray:
    span = min(max(req.duration_s / 3600.0, _STEP_H), cap_h)
    return np.arange(0.0, span, _STEP_H) + _STEP_H / 2  # hours after now, mid-step


def offpeak_fraction(snap: Snapshot, span_h: float) -> np.ndarray:
    """Per site: the share of ``[now, now + span_h)`` outside local business hours, exactly (local days are
    walked one by one; a job's window covers at most a few of them)."""
    start = snap.now.timestamp() / 3600.0 + snap.utc_offset_h  # local hours since the epoch, per site
    end = start + span_h
    busy = np.zeros(snap.n_sites)
    if not snap.n_sites:  # no site registered: nothing to walk (min and max of no hours are undefined)
        return busy
    for day in range(int(np.floor(start.min() / 24.0)), int(np.floor(end.max() / 24.0)) + 1):
        if (day + 3) % 7 >= 5:  # 1970-01-01 was a Thursday (3): days 5 and 6 of the week are the weekend
            continue
        lo, hi = day * 24.0 + BUSINESS_HOURS[0], day * 24.0 + BUSINESS_HOURS[1]
        busy += np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0.0, None)
    return 1.0 - busy / span_h


def sun_elevation_sine(lat_deg: np.ndarray, lon_deg: np.ndarray, epoch_s: np.ndarray) -> np.ndarray:
    """sin(solar elevation) for sites (rows) at instants (columns), NOAA's low-precision formulas."""
    days = epoch_s / 86400.0 - 10957.5  # days since J2000.0 (2000-01-01 12:00 UTC)
    g = np.radians(357.529 + 0.98560028 * days)  # mean anomaly
    q = 280.459 + 0.98564736 * days  # mean longitude, degrees
    ecliptic_lon = np.radians(q + 1.915 * np.sin(g) + 0.020 * np.sin(2 * g))
    obliquity = np.radians(23.439 - 0.00000036 * days)
    declination = np.arcsin(np.sin(obliquity) * np.sin(ecliptic_lon))
    right_ascension = np.degrees(np.arctan2(np.cos(obliquity) * np.sin(ecliptic_lon), np.cos(ecliptic_lon)))
    equation_of_time_deg = (q - right_ascension + 180.0) % 360.0 - 180.0  # degrees (4 minutes each)
    utc_h = np.mod(epoch_s / 3600.0, 24.0)
    solar_time_deg = (utc_h * 15.0)[None, :] + lon_deg[:, None] + equation_of_time_deg[None, :]
    hour_angle = np.radians(solar_time_deg - 180.0)
    lat = np.radians(lat_deg)[:, None]
    return np.sin(lat) * np.sin(declination)[None, :] + np.cos(lat) * np.cos(declination)[None, :] * np.cos(hour_angle)


class FollowSunScorer:
    higher_is_better = True

    def __init__(self, mode: Literal["offpeak", "solar"] = "offpeak") -> None:
        if mode not in ("offpeak", "solar"):
            raise ValueError(f"follow_sun mode must be 'offpeak' or 'solar', not {mode!r}")
        self.mode = mode
        self.name = f"follow_sun_{mode}"

    def raw(self, req: JobRequest, snap: Snapshot) -> np.ndarray:
        if self.mode == "offpeak":
            if snap.utc_offset_h.size != snap.n_sites:
                return snap.zeros()  # every site alike
            span_h = min(max(req.duration_s / 3600.0, _STEP_H), 24.0)
            return snap.derived(("offpeak", span_h), offpeak_fraction, snap, span_h)
        if snap.latitude.size != snap.n_sites:
            return snap.zeros()  # every site alike
        # The same for every run of the same (capped) length: computed once per snapshot and length.
        return snap.derived(("solar", min(max(req.duration_s / 3600.0, _STEP_H), 12.0)), solar, req, snap)


def solar(req: JobRequest, snap: Snapshot) -> np.ndarray:
    """Mean sine of the sun's elevation (0 below the horizon) per site over the run's first 12 hours."""
    instants = snap.now.timestamp() + _samples(req, 12.0) * 3600.0
    return np.maximum(sun_elevation_sine(snap.latitude, snap.longitude, instants), 0.0).mean(axis=1)
