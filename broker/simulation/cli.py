"""``heliotrope simulate``: the command line of the simulator (see ``broker.simulation.run`` for the steps).

    heliotrope simulate --trace FILE (--preset philly|slurm | --columns MAPPING) [--cpu-jobs error|drop]
        [--trace-timezone ZONE] [--carbon DIR] [--prices FILE]
        [--latency FILE] [--sites FILE | --zone-regions ZONE=REGION,... --site-model MODEL] [--utilisation FRACTION]
        [--trace-from ISO-DATE] [--days N] [--start ISO-DATE] (--policy NAME | --compare all) [--seed N] [--checkpointable FRACTION]
        [--restart-s SECONDS] [--inflexible-undeclared] [--tenant-limit GPUS] [--json OUT] [--report DIR]
        [--dump-workload DIR] [--time-format iso|seconds] [--origin ISO-TIME] [--lifecycle] [--no-bound]
        [--whole-job-steps N] [--oracle]

Prints the comparison table on stdout; progress on standard error when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from broker import ids
from broker.data.traces import PRESETS, TraceError, parse_columns, resolve_preset, time_zone_named
from policies.baselines import COMPARED, POLICIES

if TYPE_CHECKING:
    from broker.simulation.run import SimulationSpec

from broker.simulation.defaults import DEFAULT_CARBON, DEFAULT_LATENCY, DEFAULT_PRICES, DEFAULT_REGIONS

# The simulator itself (SciPy, Matplotlib) is imported when a simulation runs, so that the CLI's other
# commands start without it.


class SimulateUsage(ValueError):
    """A flag of ``heliotrope simulate`` that cannot be used; the message names it and what to give."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("simulate", help="replay a job trace against real carbon, prices and latency",
                       description="Replay a GPU job trace over sites in real grid zones and compare policies.")
    s.add_argument("--trace", required=True, metavar="FILE", help="job trace CSV")
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--preset", metavar="NAME", help=f"a built-in column mapping: {', '.join(PRESETS)} (slurm: "
                     "sacct --parsable2 --allocations --format=JobID,User,Submit,Start,End,State,AllocTRES,Timelimit)")
    how.add_argument("--columns", metavar="MAPPING",
                     help="submit=COL and duration=COL (or start=COL,end=COL), gpus=COL (or gpu_percent=COL: a "
                          "percentage of one GPU, as Alibaba's plan_gpu; or tres=COL: a Slurm TRES list, as sacct's "
                          "AllocTRES); optional milli=COL, model=COL (model=the tres column: its GPU type), "
                          "tenant=COL, deadline=COL, estimate=COL (the submitter's run-time estimate, e.g. Slurm's "
                          "Timelimit: seconds or [D-]HH:MM:SS), job_id=COL (Slurm's job steps skipped)")
    add_trace_reading(s)
    s.add_argument("--time-format", choices=("iso", "seconds"), default="iso",
                   help="trace times: ISO 8601 (naive = UTC) or seconds after --origin (default %(default)s)")
    s.add_argument("--origin", metavar="ISO-TIME", help="what 0 s means with --time-format seconds "
                   "(default the Unix epoch)")
    s.add_argument("--carbon", default=str(DEFAULT_CARBON), metavar="DIR", help="hourly carbon intensity: "
                   "<ZONE>/*.csv folders or <zone>_ci.csv files (default: the slice shipped in data/carbon: eight "
                   "zones, 2022-06-01 to 2022-06-21; give --start a day in it)")
    s.add_argument("--lifecycle", action="store_true", help="life-cycle intensity instead of direct (operational)")
    s.add_argument("--prices", default=str(DEFAULT_PRICES), metavar="FILE", help="GCP GPU price CSV "
                   "(default: the copy in data/)")
    s.add_argument("--latency", default=str(DEFAULT_LATENCY), metavar="FILE", help="measured RTT CSV "
                   "(default: the GCP rows shipped in data/)")
    s.add_argument("--regions", default=str(DEFAULT_REGIONS), metavar="FILE", help="region coordinates JSON "
                   "(default: the copy in data/)")
    s.add_argument("--sites", metavar="FILE", help="sites in the broker's YAML config format (default: one equal "
                   "site per carbon zone)")
    s.add_argument("--zone-regions", metavar="ZONE=REGION,...",
                   help="the cloud region each carbon zone outside the default federation's table stands for "
                        "(e.g. PL=gcp:europe-central2); without --sites every zone needs one")
    s.add_argument("--site-model", metavar="MODEL",
                   help="the GPU model of every site of the default federation, e.g. h100-80gb for a trace or a "
                        "price table of other GPUs (default: the model the trace's jobs name, where every job that "
                        "names one names the same; else a100-80gb)")
    s.add_argument("--utilisation", type=float, default=0.5, metavar="FRACTION",
                   help="mean GPU utilisation the default sites are sized for (default %(default)s)")
    s.add_argument("--trace-from", metavar="ISO-DATE", help="first day of the trace window")
    s.add_argument("--days", type=float, metavar="N", help="length of the trace window in days")
    s.add_argument("--start", metavar="ISO-DATE", help="the carbon-data date the window's first instant (--trace-from, else the UTC "
                   "midnight before the first submit) maps to")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", metavar="NAME", help=f"one of: {', '.join(POLICIES)}")
    which.add_argument("--compare", metavar="all", help=f"'all': {', '.join(COMPARED)}; or NAME,NAME,...")
    s.add_argument("--seed", type=int, default=0, help="seed of the workload assumptions (default %(default)s)")
    s.add_argument("--checkpointable", type=float, default=0.0, metavar="FRACTION",
                   help="share of the jobs that are not inflexible (interactive) that can be checkpointed, so that a profile "
                        "that moves running work (green) may move them (default %(default)s: none)")
    s.add_argument("--restart-s", type=float, default=600.0, metavar="SECONDS",
                   help="GPU time a move costs the moved job at its new site (default %(default)s)")
    s.add_argument("--tenant-limit", type=float, metavar="GPUS",
                   help="every tenant's jobs hold at most this many GPUs at once across the federation, as "
                        "broker.default_tenant_limit holds them live (default: no limit)")
    s.add_argument("--inflexible-undeclared", action="store_true",
                   help="the inflexible (interactive) jobs give only their deadline, not deferrable: false, as "
                        "releases before 2026-11-29 replayed them")
    s.add_argument("--json", dest="json_out", metavar="OUT", help="write the figures as JSON to OUT")
    s.add_argument("--report", metavar="DIR", help="write an HTML report with plots into DIR")
    s.add_argument("--dump-workload", metavar="DIR", help="write jobs.csv and sites.json: what the run was given")
    s.add_argument("--no-bound", action="store_true", help="skip the offline bound and the whole-job bound")
    s.add_argument("--whole-job-steps", type=int, default=300, metavar="N",
                   help="steps of the whole-job bound's search (default %(default)s; more can only raise the "
                        "bound on the deadlines; 0: the offline LP's prices alone)")
    s.add_argument("--oracle", action="store_true",
                   help="also pack the whole-job oracle: a schedule that knows every run time and every future "
                        "hour's carbon (a reference, not a policy; guided by the bound's prices unless --no-bound)")


def add_trace_reading(parser: argparse.ArgumentParser) -> None:
    """``--cpu-jobs``: what a row of 0 GPUs in the trace does (``load_trace``'s ``cpu_jobs``); and
    ``--trace-timezone``: where the trace's times without an offset were written (its ``time_zone``)."""
    parser.add_argument("--cpu-jobs", choices=("error", "drop"), default="error",
                        help="rows of 0 GPUs (CPU-only jobs, as many of a Slurm dump): an error naming the first "
                             "(default), or drop them and count them in the notes")
    parser.add_argument("--trace-timezone", metavar="ZONE",
                        help="the IANA time zone (e.g. America/New_York) of the trace's times that have no offset, "
                             "as sacct writes the cluster's local times (default: UTC)")


def trace_timezone(args: argparse.Namespace) -> str | None:
    """``--trace-timezone``, checked: an unknown zone is a usage error naming the flag."""
    if args.trace_timezone is None:
        return None
    try:
        return time_zone_named(args.trace_timezone).key
    except TraceError as e:
        raise SimulateUsage(f"--trace-timezone: {e}") from None


def date_flag(flag: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        try:
            d = date.fromisoformat(text)
        except ValueError:
            raise SimulateUsage(f"{flag} {text!r}: write an ISO date or time, e.g. 2017-10-01") from None
        value = datetime(d.year, d.month, d.day)
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00:00-05:00 is in the year 10000 in UTC
        where = "after the last" if value.year == datetime.max.year else "before the first"
        raise SimulateUsage(f"{flag} {text!r}: is {where} date there is, in UTC") from None


def _zone_regions(text: str | None) -> dict[str, str]:
    """``--zone-regions PL=gcp:europe-central2,...`` as ``{zone: region}`` (checked by the federation)."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        zone, sep, region = (part.strip() for part in item.partition("="))
        if not (sep and zone and region):
            raise SimulateUsage(f"--zone-regions: {item.strip()!r} is not ZONE=REGION (e.g. PL=gcp:europe-central2)")
        out[zone] = region
    return out


def spec_from(args: argparse.Namespace) -> SimulationSpec:
    from broker.simulation.run import SimulationSpec

    if args.compare is not None:
        # A policy named twice is replayed once (the results are keyed by name).
        names = list(COMPARED) if args.compare == "all" else list(dict.fromkeys(
            n.strip() for n in args.compare.split(",") if n.strip()))
        if not names:
            raise SimulateUsage("--compare: give 'all' or a comma-separated list of policies")
    else:
        names = [args.policy]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SimulateUsage(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    if not 0 < args.utilisation <= 1:
        raise SimulateUsage(f"--utilisation {args.utilisation}: give a fraction above 0 and at most 1, e.g. 0.5")
    if args.days is not None and not 0 < args.days <= 36_525:  # load_trace's limit, a hundred years
        raise SimulateUsage(f"--days {args.days}: give a number of days above 0 and at most 36,525")
    if args.seed < 0:
        raise SimulateUsage(f"--seed {args.seed}: give a whole number, 0 or more")
    if not 0 <= args.checkpointable <= 1:
        raise SimulateUsage(f"--checkpointable {args.checkpointable}: give a share of jobs within [0, 1], e.g. 0.9")
    if args.tenant_limit is not None and not 0 < args.tenant_limit <= 10_000_000:
        raise SimulateUsage(f"--tenant-limit {args.tenant_limit}: give GPUs above 0 and at most 10,000,000, e.g. 64")
    if not 0 <= args.restart_s <= 86400:
        raise SimulateUsage(f"--restart-s {args.restart_s}: give seconds within [0, 86400], e.g. 600")
    if not 0 <= args.whole_job_steps <= 100_000:
        raise SimulateUsage(f"--whole-job-steps {args.whole_job_steps}: give a whole number within [0, 100000], "
                            "e.g. 300")
    if args.trace_timezone is not None and args.time_format != "iso":
        raise SimulateUsage("--trace-timezone: applies to ISO times (--time-format iso) only; with --time-format "
                            "seconds, --origin says when 0 s is")
    if args.origin is not None and args.time_format != "seconds":
        raise SimulateUsage("--origin: applies to --time-format seconds only; the trace's ISO times say when they are")
    mapping = resolve_preset(args.preset) if args.preset else parse_columns(args.columns)
    zone_regions = _zone_regions(args.zone_regions)
    if zone_regions and args.sites:
        raise SimulateUsage("--zone-regions: applies to the default federation only; a --sites file gives each "
                            "site's region itself")
    site_model = None
    if args.site_model is not None:
        if args.sites:
            raise SimulateUsage("--site-model: applies to the default federation only; a --sites file gives each "
                                "site's GPUs itself")
        try:
            site_model = ids.gpu_model(args.site_model)
        except ValueError as e:
            raise SimulateUsage(f"--site-model {args.site_model}: {e}") from None
    for flag, value in (("--trace", args.trace), ("--carbon", args.carbon)):
        if not Path(value).exists():
            raise SimulateUsage(f"{flag} {value}: no such file or folder")
    for flag, value in (("--prices", args.prices), ("--latency", args.latency), ("--regions", args.regions),
                        ("--sites", args.sites)):
        if value is None:
            continue
        if not Path(value).is_file():
            raise SimulateUsage(f"{flag} {value}: no such file")
        try:
            Path(value).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SimulateUsage(f"{flag} {value}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except OSError as e:
            raise SimulateUsage(f"{flag} {value}: cannot read: {e.strerror or e}") from None
    return SimulationSpec(
        trace=Path(args.trace), mapping=mapping, carbon=Path(args.carbon), policies=names,
        time_format=args.time_format, origin=date_flag("--origin", args.origin), prices=Path(args.prices),
        latency=Path(args.latency), regions=Path(args.regions), sites=Path(args.sites) if args.sites else None,
        utilisation=args.utilisation, trace_from=date_flag("--trace-from", args.trace_from), days=args.days,
        start=date_flag("--start", args.start), seed=args.seed, lifecycle=args.lifecycle, bound=not args.no_bound,
        oracle=args.oracle, whole_job_steps=args.whole_job_steps, zone_regions=zone_regions, cpu_jobs=args.cpu_jobs,
        time_zone=trace_timezone(args), tenant_limit=args.tenant_limit,
        **({"site_model": site_model} if site_model is not None else {}),
        assumptions={"checkpointable_fraction": args.checkpointable, "restart_s": args.restart_s,
                     "declare_inflexible": not args.inflexible_undeclared},
    )


def run(args: argparse.Namespace) -> str:
    """Run the simulation the arguments ask for; returns the table for stdout."""
    from broker.simulation.report import format_table, write_html
    from broker.simulation.run import as_json, models_no_site_has, prepare, simulate
    from broker.simulation.workload import dump_workload

    spec = spec_from(args)
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        raise SimulateUsage(f"--report {args.report}: is a file; give a folder (it is created if missing)")
    # Where the results go is checked before the run, which may take minutes.
    if args.json_out:
        writable_flag("--json", Path(args.json_out).parent, Path(args.json_out))
    for flag, folder in (("--report", args.report), ("--dump-workload", args.dump_workload)):
        if folder:
            writable_flag(flag, Path(folder))
    prep = prepare(spec)
    # What the run assumed or changed about its inputs (a zone renamed, a region's RTT borrowed, jobs left out)
    # goes to stderr as well as into --json and --report, before the replay: a reader of the table alone
    # should not have to open them to learn that the sites had to be sized or a latitude corrected (and before
    # a run with nothing to replay stops, which they may explain).
    notes(prep.report)
    if prep.left_out.all():  # nothing would be replayed: every figure would be a zero that means nothing
        raise SimulateUsage(
            f"no job to replay: no job of the trace ({prep.left_out.size}) fits a site even when it is empty, or "
            f"one that meets its latency objective (the largest asks {int(prep.workload.gpus.max())} GPUs"
            f"{models_no_site_has(prep.workload, prep.sites, prep.left_out)}); give sites that fit them (--sites, "
            "--utilisation)")
    noted = len(prep.report)
    if args.dump_workload:
        dump_workload(prep.workload, prep.sites, args.dump_workload)
    result = simulate(spec, progress=sys.stderr.isatty(), prepared=prep)
    notes(result.report[noted:])  # what the bounds and the oracle met (not packed, no bound)
    table = format_table(result)
    writes = []
    if args.json_out:
        writes.append(("--json", lambda: Path(args.json_out).write_text(
            json.dumps(as_json(result), indent=2, allow_nan=False) + "\n", encoding="utf-8")))
    if args.report:
        writes.append(("--report", lambda: write_html(result, args.report)))
    for flag, write in writes:
        try:
            write()
        except OSError as e:  # the results are not lost with the file: the table still goes to stdout
            print(table, flush=True)
            raise SimulateUsage(f"{flag}: cannot write {e.filename or ''}: {e.strerror or e}") from None
    return table


def notes(lines: Sequence[str]) -> None:
    """Each line of a run's report on stderr, as ``note: ...``."""
    for line in lines:
        print(f"note: {line}", file=sys.stderr)


def writable_flag(flag: str, folder: Path, file: Path | None = None) -> None:
    """``folder`` exists (made if missing) and can be written, and ``file`` (in it) is not a folder; else
    :class:`SimulateUsage` naming the flag."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SimulateUsage(f"{flag} {file or folder}: cannot make the folder {folder}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SimulateUsage(f"{flag} {file or folder}: the folder {folder} cannot be written")
    if file is not None and file.is_dir():
        raise SimulateUsage(f"{flag} {file}: is a folder; give a file name")
