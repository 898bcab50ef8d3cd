"""``heliotrope simulate-quotas``: one site's quotas and fair share replayed over a job trace, one row per mode.

    heliotrope simulate-quotas --trace FILE (--preset philly|slurm | --columns MAPPING) [--cpu-jobs error|drop]
        [--trace-timezone ZONE]
        [--utilisation 0.8]
        [--trace-from ISO-DATE] [--days N] [--modes off,instant,time] [--window-h 24] [--half-life-h 6]
        [--reweight-h 1] [--k 1] [--min-run-s 600] [--guaranteed-fraction 0.8] [--max-refusals 64]
        [--cycle-s 300] [--starvation-h 24] [--json OUT]

What is simulated and every assumption: ``broker.simulation.fairshare``. Prints the table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pydantic import ValidationError

from broker.data.traces import PRESETS, load_trace, parse_columns, resolve_preset
from broker.errors import problems
from broker.models import FairSharePolicy
from broker.simulation.cli import add_trace_reading, date_flag, notes, trace_timezone, writable_flag
from broker.simulation.fairshare import (DEFAULT_CYCLE_S, DEFAULT_MAX_REFUSALS, DEFAULT_MIN_RUN_S,
                                         DEFAULT_STARVATION_H, DEFAULT_UTILISATION, GUARANTEED_FRACTION, MODES,
                                         QuotaSimulationError, as_json, compare, format_table,
                                         workload_from_trace)

COMMAND = "simulate-quotas"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(COMMAND, help="replay a job trace on one site with quotas, compare fair-share modes",
                       description="Replay a GPU job trace on one site whose tenants have quotas derived from "
                                   "their sizes, once per fair-share mode, and compare waits, slowdowns and "
                                   "utilisation.")
    s.add_argument("--trace", required=True, metavar="FILE", help="job trace CSV")
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--preset", metavar="NAME", help=f"a built-in column mapping: {', '.join(PRESETS)}")
    how.add_argument("--columns", metavar="MAPPING",
                     help="submit=COL and duration=COL (or start=COL,end=COL), gpus=COL (or gpu_percent=COL, "
                          "tres=COL), tenant=COL; as simulate's")
    add_trace_reading(s)
    s.add_argument("--utilisation", type=float, default=DEFAULT_UTILISATION, metavar="FRACTION",
                   help="the trace's mean GPUs busy over the site's GPUs the site is sized for "
                        "(default %(default)s)")
    s.add_argument("--trace-from", metavar="ISO-DATE", help="first day of the trace window")
    s.add_argument("--days", type=float, metavar="N", help="length of the trace window in days")
    s.add_argument("--modes", default="off,instant,time", metavar="MODE,...",
                   help=f"modes to replay, of: {', '.join(MODES)} (default %(default)s)")
    s.add_argument("--window-h", type=float, default=24.0, help="usage window, hours (default %(default)s)")
    s.add_argument("--half-life-h", type=float, default=6.0, help="usage half-life, hours (default %(default)s)")
    s.add_argument("--reweight-h", type=float, default=1.0, help="reweight period, hours (default %(default)s)")
    s.add_argument("--k", type=float, default=1.0, help="how strongly past usage moves a share "
                   "(default %(default)s)")
    s.add_argument("--min-run-s", type=float, default=DEFAULT_MIN_RUN_S,
                   help="preemption spares a job that ran less than this (default %(default)s)")
    s.add_argument("--guaranteed-fraction", type=float, default=GUARANTEED_FRACTION,
                   help="share of the site guaranteed to tenants in all (default %(default)s)")
    s.add_argument("--max-refusals", type=int, default=DEFAULT_MAX_REFUSALS,
                   help="refusals after which a scheduling cycle stops walking the queue (default %(default)s)")
    s.add_argument("--cycle-s", type=float, default=DEFAULT_CYCLE_S,
                   help="seconds between scheduling cycles while jobs wait and nothing else happens "
                        "(default %(default)s)")
    s.add_argument("--starvation-h", type=float, default=DEFAULT_STARVATION_H, metavar="HOURS",
                   help="a job queued this long holds GPUs against backfill once refused; 0 turns the guard "
                        "off (default %(default)s)")
    s.add_argument("--json", dest="json_out", metavar="OUT", help="write the figures as JSON to OUT")


MIN_CYCLE_S = 1.0
"""The shortest ``--cycle-s``: the replay steps through every cycle while jobs wait (a live site's cycle runs
at most about once a second, and a nanosecond's cycles made a short trace replay for ever)."""


def run(args: argparse.Namespace) -> str:
    """Run the comparison the arguments ask for; returns the table for stdout."""
    # A mode named twice is replayed once: the table had a row per name and the JSON (keyed by mode) one.
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise QuotaSimulationError(f"--modes {args.modes!r}: give modes from {', '.join(MODES)}, comma-separated")
    if not 0 < args.utilisation <= 1:
        raise QuotaSimulationError(f"--utilisation {args.utilisation}: give a fraction above 0 and at most 1")
    if not args.cycle_s >= MIN_CYCLE_S:  # (a cycle every nanosecond while jobs wait: a replay that never ends)
        raise QuotaSimulationError(f"--cycle-s {args.cycle_s:g}: give {MIN_CYCLE_S:g} s or more")
    # The site's settings that fairshare.compare checks too, named here by their flags.
    if not 0 <= args.guaranteed_fraction <= 1:
        raise QuotaSimulationError(f"--guaranteed-fraction {args.guaranteed_fraction:g}: give a fraction from 0 to 1")
    if args.max_refusals < 1:
        raise QuotaSimulationError(f"--max-refusals {args.max_refusals}: give 1 or more")
    if not args.starvation_h >= 0:
        raise QuotaSimulationError(f"--starvation-h {args.starvation_h:g}: give 0 (no guard) or more hours")
    if args.days is not None and not 0 < args.days <= 36_525:  # as simulate: the flag named, not load_trace's word
        raise QuotaSimulationError(f"--days {args.days}: give a number of days above 0 and at most 36,525")
    trace_from = date_flag("--trace-from", args.trace_from)
    if not Path(args.trace).exists():
        raise QuotaSimulationError(f"--trace {args.trace}: no such file")
    mapping = resolve_preset(args.preset) if args.preset else parse_columns(args.columns)
    mapping = dataclasses.replace(mapping, estimate=None)  # a site replays run times, not estimates: not read
    if mapping.tenant is None:
        raise QuotaSimulationError("the column mapping names no tenant column: add tenant=COL (quotas are "
                                   "per tenant)")
    # The fair-share settings, each checked as a site's quota file would be, and named by its flag.
    for flag, field, value in (("--window-h", "window_h", args.window_h), ("--half-life-h", "half_life_h",
                               args.half_life_h), ("--reweight-h", "reweight_h", args.reweight_h), ("--k", "k", args.k),
                               ("--min-run-s", "min_run_s", args.min_run_s)):
        try:
            FairSharePolicy.model_validate({field: value})
        except ValidationError as e:
            raise QuotaSimulationError(f"{flag} {value:g}: {problems(e)[0]['problem']}") from None
    try:  # and together (the window in periods of the reweight)
        FairSharePolicy.model_validate({"window_h": args.window_h, "reweight_h": args.reweight_h})
    except ValidationError as e:
        raise QuotaSimulationError(f"--window-h {args.window_h:g} with --reweight-h {args.reweight_h:g}: "
                                   f"{problems(e)[0]['problem'].removeprefix('Value error, ')}") from None
    if args.json_out:  # checked before the replay, which may take minutes, as simulate --json is
        writable_flag("--json", Path(args.json_out).parent, Path(args.json_out))
    trace = load_trace(args.trace, mapping, trace_from=trace_from, days=args.days, cpu_jobs=args.cpu_jobs,
                       time_zone=trace_timezone(args))
    notes([f"trace: {r}" for r in trace.report])  # what was dropped or kept, as simulate says it
    info, runs = compare(workload_from_trace(trace), modes, utilisation=args.utilisation,
                         guaranteed_fraction=args.guaranteed_fraction, window_h=args.window_h,
                         half_life_h=args.half_life_h, reweight_h=args.reweight_h, k=args.k,
                         min_run_s=args.min_run_s, max_refusals=args.max_refusals, cycle_s=args.cycle_s,
                         starvation_h=args.starvation_h)
    table = format_table(info, runs)
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(as_json(info, runs), indent=2, allow_nan=False) + "\n",
                                           encoding="utf-8")
        except OSError as e:  # the results are not lost with the file: the table still goes to stdout
            print(table, flush=True)
            raise QuotaSimulationError(f"--json: cannot write {e.filename or ''}: {e.strerror or e}") from None
    return table
