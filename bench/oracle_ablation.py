"""Where the whole-job oracle's lead over ``green`` comes from: the Evidence's oracle (``heliotrope simulate
--oracle``) packed again with one of its advantages taken away at a time, on the Evidence's workload
(whole Philly trace, ``--year``, ``--utilisation``, workload seed 0):

- ``oracle``: as in the Evidence: jobs allowed the fewest sites first, then in submit order, guided by the
  offline LP's price of each site-hour (the jobs still to come);
- ``no prices``: carbon alone decides each job's start and site;
- ``no prices, submit order``: and every job in submit order, as a broker deciding each job as it arrives
  would (each still knows its own run time and the true intensity of every future hour);
- ``..., wait <= 168 h`` and ``<= 48 h``: and no job starts later than that after its submission (the
  time-shift search's horizon is 168 h), unless no earlier start has room.

Each line: carbon (t CO2e), deadline misses, the 95th percentile of the wait, the time it took. About half a
minute per packing, after the LP (about 10 s). It prints figures and asserts nothing. Usage::

    .venv/bin/python bench/oracle_ablation.py [--year 2021] [--utilisation 0.3] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.data.traces import resolve_preset  # noqa: E402
from broker.simulation.oracle import whole_job_oracle  # noqa: E402
from broker.simulation.run import SimulationSpec, capacity_prices, prepare  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--year", type=int, default=2021, help="the carbon year the trace is mapped onto")
    p.add_argument("--utilisation", type=float, default=0.3, help="mean GPU utilisation the sites are sized for")
    p.add_argument("--data", type=Path, default=SHARED, help="the shared data folder")
    args = p.parse_args()
    trace = args.data / "traces" / "philly" / "philly_jobs_pollux.csv"
    carbon = args.data / "carbon-intensity" / "electricitymaps-hourly"
    for path in (trace, carbon):
        if not path.exists():
            p.error(f"{path}: not found (give --data)")
    spec = SimulationSpec(trace=trace, mapping=resolve_preset("philly"), carbon=carbon, policies=["green"],
                          utilisation=args.utilisation, trace_from=date(2017, 9, 1), start=date(args.year, 9, 1),
                          bound=False, seed=0)
    prep = prepare(spec)
    w, ran = prep.workload, ~prep.left_out
    t = time.perf_counter()
    prices = capacity_prices(prep)
    print(f"oracle ablation: Philly, {args.year}, utilisation {args.utilisation:g} (the LP's prices: "
          f"{time.perf_counter() - t:.0f} s)")
    for label, kw in [("oracle", {"shadow_kg_per_gpu_hour": prices}),
                      ("no prices", {}),
                      ("no prices, submit order", {"submit_order": True}),
                      ("no prices, submit order, wait <= 168 h", {"submit_order": True, "max_wait_s": 168 * 3600.0}),
                      ("no prices, submit order, wait <= 48 h", {"submit_order": True, "max_wait_s": 48 * 3600.0})]:
        t = time.perf_counter()
        run = whole_job_oracle(w, prep.federation, prep.fitting, prep.left_out, **kw)  # type: ignore[arg-type]
        missed = ran & (run.end_s > w.deadline_s + 1e-6)
        wait_h = (run.start_s - w.submit_s)[ran] / 3600.0
        print(f"{label:42s} {run.carbon_kg[ran].sum() / 1000:6.1f} t  {int(missed.sum()):5,d} misses  "
              f"wait p95 {np.percentile(wait_h, 95):4.1f} h  [{time.perf_counter() - t:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
