"""How long ``heliotrope simulate`` takes on the real data: each policy over the whole Philly trace, and
``--compare all`` over 30 days.

What runs (each through ``broker.simulation.run.simulate``, the code behind the CLI):

1. **Per policy, full trace.** The whole 82,247-job Philly trace over the default federation of the 16
   zones of ``shared/data/carbon-intensity/electricitymaps-hourly`` (mapped to 2021-09-04, the trace's own
   date in the first year of carbon data), one policy at a time, without the bound. Printed per policy:
   the replay's wall time (``PolicyRun.wall_s``: the event loop and the accounting, not the loading) and
   the whole call's wall time (loading the trace, carbon, prices, latency and regions, building the sites
   and the workload, replaying).
2. **The bound and the oracle, full trace.** The offline LP on the same workload (deadline windows): its
   size and solve time, the whole-job bound's search (its steps, time and value), and the whole-job
   oracle's packing time (``--oracle``, guided by the LP's prices);
   the whole call's time also holds one replay and, for a policy (or the oracle) that finished jobs after
   their deadlines, the solve of its own bound.
3. **``--compare all`` over 30 days** from ``--trace-from 2017-10-01``: every compared policy and the bound,
   end to end as the CLI runs it (without writing reports): one wall time.

This prints figures; it asserts nothing about timing. Usage::

    .venv/bin/python bench/simulate.py [--data ../shared/data] [--skip-full] [--skip-compare]
"""

from __future__ import annotations

import argparse
import time
from datetime import date
from pathlib import Path

from broker.data.traces import PRESETS
from broker.simulation.run import SimulationSpec, simulate
from policies.baselines import COMPARED

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder")
    p.add_argument("--skip-full", action="store_true", help="skip steps 1 and 2")
    p.add_argument("--skip-compare", action="store_true", help="skip step 3")
    args = p.parse_args()
    data = Path(args.data)
    trace = data / "traces" / "philly" / "philly_jobs_pollux.csv"
    carbon = data / "carbon-intensity" / "electricitymaps-hourly"
    for path in (trace, carbon):
        if not path.exists():
            raise SystemExit(f"bench/simulate.py: {path} is missing; pass --data DIR (the shared data folder)")

    def spec(policies: list[str], bound: bool, **more: object) -> SimulationSpec:
        return SimulationSpec(trace=trace, mapping=PRESETS["philly"], carbon=carbon, policies=policies,
                              bound=bound, **more)  # type: ignore[arg-type]

    if not args.skip_full:
        print("1. each policy over the whole Philly trace, 16 zones (no bound)")
        print(f"   {'policy':<26} {'jobs':>7} {'replay s':>9} {'call s':>8}")
        for name in COMPARED:
            t0 = time.perf_counter()
            result = simulate(spec([name], bound=False))
            wall = time.perf_counter() - t0
            run = result.policies[name]
            print(f"   {name:<26} {run.metrics['jobs']:>7} {run.wall_s:>9.1f} {wall:>8.1f}")
        print(f"2. the offline bound and the whole-job oracle over the whole trace (the call also replays "
              f"{COMPARED[-1]} and solves its own bound)")
        t0 = time.perf_counter()
        result = simulate(spec([COMPARED[-1]], bound=True, oracle=True))
        b = result.offline_bound or {}
        print(f"   {b.get('variables')} variables, {b.get('constraints')} constraints, solved with the capacity "
              f"prices in {b.get('solve_s', float('nan')):.1f} s (whole call {time.perf_counter() - t0:.1f} s); "
              f"relaxation: {b.get('relaxation')}")
        whole = result.whole_job_bound or {}
        print(f"   whole-job bound: {whole.get('carbon_kg', float('nan')) / 1000:.1f} t CO2e after "
              f"{whole.get('iterations')} steps in {whole.get('solve_s', float('nan')):.1f} s (fluid bound "
              f"{b.get('carbon_kg', float('nan')) / 1000:.1f} t)")
        if result.oracle is not None:
            print(f"   whole-job oracle: packed in {result.oracle.wall_s:.1f} s, "
                  f"{result.oracle.metrics['carbon_kg'] / 1000:.1f} t CO2e")
    if not args.skip_compare:
        print("3. --compare all over 30 days from 2017-10-01")
        t0 = time.perf_counter()
        result = simulate(spec(list(COMPARED), bound=True, trace_from=date(2017, 10, 1), days=30.0))
        wall = time.perf_counter() - t0
        jobs = next(iter(result.policies.values())).metrics["jobs"]
        print(f"   {len(result.policies)} policies + bounds, {jobs} jobs: {wall:.1f} s end to end "
              f"(bound {result.offline_bound['solve_s']:.1f} s, whole-job bound "
              f"{(result.whole_job_bound or {}).get('solve_s', float('nan')):.1f} s)")


if __name__ == "__main__":
    main()
