"""How good a forecast is past its model's 48 hours: the mean error of every 49..168-hour-ahead value over a
year, per zone, for the three ways a row can go on past the model:

- ``last hour``: the model's 48th hour, stretched (what the profiles read past the forecast's end before the
  rows reached a week);
- ``mean day, 7 d``: each hour, the mean of that hour of the day over the last 7 days;
- ``mean day, 28 d``: the same over the last 28 days (what ``broker.forecast.extend_by_profile`` gives the
  live broker and the simulator: ``PROFILE_DAYS``).

Rows are the simulator's (``broker.simulation.forecasts.forecast_rows``: the model chosen per zone on the
history before ``--start``, each row made from the hours before it only), one per hour of the year from
``--start``; errors in gCO2e/kWh against the true intensity, over every row whose 168 hours lie in the data.
The last line is the mean over zones. It prints figures and asserts nothing. Usage::

    .venv/bin/python bench/forecast_reach.py [--data DIR] [--start 2022-01-01] [--zones GB,DE-LU]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.data.carbon import load_carbon  # noqa: E402
from broker.forecast import REACH_H, daily_profile, extend_by_profile  # noqa: E402
from broker.simulation.forecasts import HORIZON_H, forecast_rows  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "carbon-intensity" / "electricitymaps-hourly"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Electricity Maps hourly folder")
    ap.add_argument("--start", default="2022-01-01", help="first hour of the year scored (default 2022-01-01)")
    ap.add_argument("--zones", default=None, help="comma-separated zones (default: every zone in --data)")
    args = ap.parse_args()
    if not args.data.exists():
        ap.error(f"{args.data}: not found (give --data)")
    t0 = time.perf_counter()
    carbon = load_carbon(args.data, zones=args.zones.split(",") if args.zones else None)
    start = datetime.fromisoformat(args.start).replace(tzinfo=UTC)
    print(f"MAE of the 49..{REACH_H} h-ahead values, gCO2e/kWh, rows made hourly from {start:%Y-%m-%d} for a year")
    print(f"{'zone':12s} {'last hour':>10s} {'mean day, 7 d':>14s} {'mean day, 28 d':>15s}")
    table = []
    for zone in carbon.zones():
        first, end = carbon.span(zone)
        y = np.asarray(carbon.series(zone, first, (end - first) // timedelta(hours=1)), dtype=np.float64)
        k0 = (start - first) // timedelta(hours=1)
        hours = min(365 * 24, len(y) - k0 - REACH_H)
        if k0 < 28 * 24 or hours <= 0:
            print(f"{zone:12s} too little data around {start:%Y-%m-%d}")
            continue
        rows = forecast_rows(carbon, zone, start, hours, []).astype(np.float64)  # [hours, REACH_H], 28 days
        week = extend_by_profile(rows[:, :HORIZON_H], daily_profile(y[:k0 + hours], 7, np.arange(k0, k0 + hours)),
                                 REACH_H)
        truth = y[(k0 + np.arange(hours))[:, None] + np.arange(HORIZON_H, REACH_H)[None, :]]
        errs = [np.abs(rows[:, HORIZON_H - 1:HORIZON_H] - truth).mean(), np.abs(week[:, HORIZON_H:] - truth).mean(),
                np.abs(rows[:, HORIZON_H:] - truth).mean()]
        table.append(errs)
        print(f"{zone:12s} {errs[0]:10.1f} {errs[1]:14.1f} {errs[2]:15.1f}", flush=True)
    if table:
        mean = np.mean(table, axis=0)
        print(f"{'mean':12s} {mean[0]:10.1f} {mean[1]:14.1f} {mean[2]:15.1f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
