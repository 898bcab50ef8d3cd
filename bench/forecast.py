"""Carbon intensity forecasts on the real data: which model each zone gets, how good it is, how long it takes.

What runs, on ``../shared/data/carbon-intensity/electricitymaps-hourly`` (``--data`` for another folder):

1. ``load_carbon`` of the zones (all 16 by default, ``--zones`` for some), timed.
2. Per zone, ``broker.forecast.choose_models`` with its defaults: seasonal-naive 24 h and 168 h and damped
   Holt-Winters (fitted on 2021 by grid search), the one with the lowest 2021 MAE over every 1..48 h-ahead
   forecast is chosen, and each is scored on 2022 (MAE in gCO2e/kWh, MASE against the 2021 one-day
   seasonal-naive in-sample MAE). The whole call is timed per zone (fitting included).
3. Per zone, ``forecast_matrix`` of the chosen model and of the fitted Holt-Winters (the slower of the
   model kinds) over the zone's two years (17,520 hours x ``--horizon``), best of ``--repeat`` runs.
4. The report's text table: every candidate's 2021 and 2022 MAE and 2022 MASE.

It prints figures and asserts nothing. Usage::

    .venv/bin/python bench/forecast.py [--data DIR] [--zones DE-LU,GB] [--horizon 48] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.data.carbon import load_carbon  # noqa: E402
from broker.forecast import (  # noqa: E402
    TEST_SPAN,
    TRAIN_SPAN,
    ExponentialSmoothing,
    ForecastReport,
    choose_models,
    forecast_matrix,
)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "carbon-intensity" / "electricitymaps-hourly"


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Electricity Maps hourly folder")
    ap.add_argument("--zones", default=None, help="comma-separated zones (default: every zone in --data)")
    ap.add_argument("--horizon", type=int, default=48, help="hours ahead (default 48)")
    ap.add_argument("--repeat", type=int, default=3, help="timing runs of each matrix, best kept (default 3)")
    args = ap.parse_args()

    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.machine()} {platform.system()}")
    zones = args.zones.split(",") if args.zones else None
    t = time.perf_counter()
    carbon = load_carbon(args.data, zones=zones)
    print(f"load_carbon: {len(carbon.zones())} zones in {time.perf_counter() - t:.2f} s ({args.data})")
    print(f"train {TRAIN_SPAN[0]:%Y-%m-%d}..{TRAIN_SPAN[1]:%Y-%m-%d}, test {TEST_SPAN[0]:%Y-%m-%d}.."
          f"{TEST_SPAN[1]:%Y-%m-%d} (end exclusive), horizon {args.horizon} h\n")

    head = (f"{'zone':<12} {'chosen':<24} {'test MAE':>8} {'MASE':>6}  {'params (Holt-Winters)':<42} "
            f"{'choose s':>8} {'matrix chosen':>13} {'matrix HW':>9}")
    print(head)
    print("-" * len(head))
    per_zone = []
    total_choose = 0.0
    for zone in carbon.zones():
        t = time.perf_counter()
        rep = choose_models(carbon, [zone], horizon=args.horizon).zone(zone)
        choose_s = time.perf_counter() - t
        total_choose += choose_s
        per_zone.append(rep)
        start, _ = carbon.span(zone)
        y = np.asarray(carbon.series(zone, start, (TEST_SPAN[1] - start) // timedelta(hours=1)))
        hw_score = next(s for s in rep.scores if s.model.startswith("holt-winters"))
        hw = ExponentialSmoothing(**hw_score.params)
        chosen_s, m = best_of(args.repeat, lambda model=rep.model, y=y: forecast_matrix(model, y, args.horizon))
        hw_s, _ = best_of(args.repeat, lambda y=y, hw=hw: forecast_matrix(hw, y, args.horizon))
        params = ", ".join(f"{k}={v:g}" for k, v in hw_score.params.items())
        c = rep.chosen
        print(f"{zone:<12} {c.model:<24} {c.test_mae:>8.2f} {c.test_mase:>6.3f}  {params:<42} {choose_s:>8.2f} "
              f"{chosen_s * 1e3:>10.1f} ms {hw_s * 1e3:>6.1f} ms   [{m.shape[0]} x {m.shape[1]}]")
    print(f"\nchoose_models over {len(per_zone)} zones: {total_choose:.2f} s "
          f"(fitting Holt-Winters on 2021 and building every candidate's two-year matrix)\n")
    report = ForecastReport(TRAIN_SPAN, TEST_SPAN, args.horizon, tuple(per_zone))
    print(report.format_table())


if __name__ == "__main__":
    main()
