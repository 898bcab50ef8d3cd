"""Job traces for the simulator: a CSV of past GPU jobs read into compact numpy arrays.

What it reads. Any CSV with a header row (comma-separated; ``|``, tab or ``;`` where the header holds no
comma and one of those, as Slurm's ``sacct --parsable2`` writes ``|``), through a :class:`ColumnMapping` that
says which column plays which role (the CLI's ``--columns submit=COL,duration=COL,gpus=COL,...`` or
``--preset philly`` / ``--preset slurm``):

- ``submit``: when the job was submitted (required);
- ``duration`` (seconds), or ``start`` and ``end`` (times; duration = end - start) — exactly one of the two;
- ``gpus``: GPUs the job asked for, a whole number >= 1 (required, unless ``gpu_percent`` or ``tres`` is given);
- ``milli``: thousandths of a GPU used per GPU, 1..1000 (optional; 1000, a whole GPU, when not mapped);
- ``gpu_percent``: instead of ``gpus`` (and ``milli``), the GPUs asked for as a percentage of one GPU, as the
  Alibaba PAI trace's ``plan_gpu`` gives them (50: half a GPU; 200: two; 150: two GPUs at 750 thousandths
  each): ``ceil(percent / 100)`` GPUs of ``round(10 × percent / GPUs)`` thousandths each;
- ``tres``: instead of ``gpus`` (or ``gpu_percent``), a Slurm TRES list such as sacct's ``AllocTRES`` or
  ``ReqTRES`` (``billing=8,cpu=8,gres/gpu=2,mem=64G,node=1``, or with a GPU type
  ``gres/gpu:a100=4,gres/gpu=4``): the GPUs are its ``gres/gpu`` total, or the sum of its typed
  ``gres/gpu:TYPE`` entries where it lists no total (Slurm lists both when the GPUs have a type; each GPU
  is counted once); other entries (cpu, mem, ``gres/gpumem``, ``gres/shard``) are not read;
- ``model``: GPU model the job asked for (optional; ``None`` = any model, also for an empty cell). Mapped to
  the same column as ``tres`` (``tres=AllocTRES,model=AllocTRES``), the model is the TRES's GPU type, read
  as a model of :mod:`broker.ids` (``a100_80gb`` → ``a100-80gb``); a type that is no known model, or GPUs of
  two models in one job, is an error naming the line; a job whose TRES names no type runs on any model.
  Without a model role the types are not read (and reported);
- ``tenant``: who submitted it, e.g. Philly's virtual cluster (optional; one tenant ``default`` if not mapped).
- ``deadline``: by when the job must finish, a time like ``submit`` (optional; when mapped it replaces the
  simulator's slack assumption; a deadline before the job's submit time is an error naming the line).
- ``estimate``: how long the submitter said the job would run (optional), such as Slurm's time limit
  (sacct's ``Timelimit``): seconds as a number (as ``duration``), or a Slurm time with a colon or a dash
  (``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; sacct's ``Timelimit`` is
  ``[D-]HH:MM:SS``; its ``TimelimitRaw`` is minutes, so map ``Timelimit``). A job without one (an empty
  cell, ``UNLIMITED``, ``Partition_Limit``, ``NONE``, ``INVALID``, or 0, which Slurm reads as no limit) gets the
  simulator's drawn estimate, and their count is reported. Where it is mapped, the policies see these
  estimates instead of the simulator's log-normal draw, as the live broker sees what a submitter writes.
- ``job_id``: the job's id (optional): rows whose id is a Slurm job step (``123.batch``, ``123.extern``,
  ``123.0``, ``123_7.batch``, ``123+1.0``: sacct without ``--allocations``) are skipped and reported, as
  the job's own row (``123``) already holds what the job was allocated.

The ``slurm`` preset reads ``sacct --parsable2 --allocations
--format=JobID,User,Submit,Start,End,State,AllocTRES,Timelimit``: ``job_id=JobID``, ``tenant=User``,
``submit=Submit``, ``start=Start``, ``end=End``, ``tres=AllocTRES``, ``model=AllocTRES``,
``estimate=Timelimit``. ``State`` is not read: every job that started and ended ran for end - start whatever
its state (completed, failed, cancelled or timed out while running).

Units. Times are UTC. With ``time_format="iso"`` a time with an offset is converted to UTC, and one without
is taken as UTC, or as a wall-clock time in ``time_zone`` where one is given (an IANA name such as
``America/New_York``: sacct writes the cluster's local times without an offset, so a dump read without it
keeps its wall-clock hours but not their place against the carbon data's UTC hours; a time that a change of
the clock repeats or skips reads with the offset in force before the change, except an ``end`` that would then
come before its ``start``, or a ``start`` before its ``submit``, which reads with the offset after it: the
job ran across the change); with
``time_format="seconds"`` a time is a number of seconds after ``origin`` (a timezone-aware datetime,
required then). In the returned :class:`Trace`, ``submit_s`` is float64 seconds
after the first submit (``Trace.start``), ``duration_s`` float64 seconds, ``gpus`` and ``milli`` int32.

Errors. Nothing is guessed: a file that cannot be read, a header without a mapped column, or a row whose
value cannot be used (not a number, negative duration, gpus < 1, end before start, a time that is not a
time, a row with the wrong number of fields) raises :class:`TraceError` naming the file, the line (the
header is line 1, so it is the line an editor shows) and the column. Empty lines are skipped.

What is kept and reported (``Trace.report``, one sentence per note):

- Rows that are not jobs that ran are dropped, each kind counted with its first lines: job steps (with a
  ``job_id``, above), and, with ``start`` and ``end``, rows whose start or end is ``Unknown`` or ``None``,
  as Slurm writes them for a job still pending, cancelled before it started, or still running, or empty,
  as other traces leave it (a pending pod's ``scheduled_time`` in Alibaba's 2023 GPU trace).
- Rows of 0 GPUs (``gpus`` 0, ``gpu_percent`` 0, a TRES without GPUs: CPU-only jobs) are an error by
  default, which names the line and ``cpu_jobs="drop"`` (the CLI's ``--cpu-jobs drop``); with it they are
  dropped and counted.
- Rows that repeat an earlier row exactly are *kept* by default (``duplicates="drop"`` drops the later
  copies): the trace has no job ids, and two jobs of one tenant submitted in the same second with the same
  size and length are plausible (scripted sweeps), so dropping them would understate the load. Their count
  and first lines are reported either way.
- Jobs of 0 s are kept and counted as 1 s (``MIN_DURATION_S``), the resolution of the traces: the job did
  arrive and ask for GPUs, and a zero-length job makes an event-driven simulator finish a job in the same
  instant it starts. Their count is reported.
- Rows are sorted by submit time (stable: equal times keep file order); ``Trace.line`` keeps each job's
  line in the file.
- ``trace_from`` / ``days`` keep the jobs submitted in ``[trace_from, trace_from + days)``; a window with no
  job is an error that gives the trace's span.
"""

from __future__ import annotations

import csv
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import date, datetime, timedelta, UTC
from operator import itemgetter
from pathlib import Path
from typing import Literal, NamedTuple, TextIO
from zoneinfo import ZoneInfo

import numpy as np

from broker import ids
from broker.models import iana_time_zone

MIN_DURATION_S = 1.0
"""Jobs whose duration is 0 s are counted as this long (seconds)."""

WHOLE_GPU_MILLI = 1000
"""``milli`` of a job that uses whole GPUs."""

DEFAULT_TENANT = "default"
"""The one tenant of a trace whose mapping has no ``tenant`` column."""

ROLES = ("submit", "duration", "start", "end", "gpus", "milli", "gpu_percent", "tres", "model", "tenant", "deadline",
         "estimate", "job_id")
"""Roles a ``--columns`` mapping may name, in the order they are printed."""

_FIRST_LINES_SHOWN = 5

TimeFormat = Literal["iso", "seconds"]

CpuJobs = Literal["error", "drop"]

_CPU_ONLY = ("a CPU-only job: cpu_jobs='drop' (the CLI's --cpu-jobs drop) leaves rows of 0 GPUs out and reports "
             "how many")
"""What an error about a row of 0 GPUs says to do."""

_NO_TIME = ("Unknown", "None", "")
"""What a trace writes for a start or end that is not there: Slurm's words for a pending job's start and end
and a running job's end, and the empty cell of other traces (Alibaba's 2023 pod list: a pending pod's
``scheduled_time``)."""


class TraceError(ValueError):
    """A trace or a column mapping that cannot be used; the message says what and where."""


# ---------------------------------------------------------------------------------------------------------
# Column mappings
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ColumnMapping:
    """Which CSV column plays which role. Give ``duration`` or both ``start`` and ``end``, not both; and
    one of ``gpus``, ``gpu_percent`` and ``tres``."""

    submit: str
    gpus: str | None = None
    duration: str | None = None
    start: str | None = None
    end: str | None = None
    milli: str | None = None
    model: str | None = None
    tenant: str | None = None
    deadline: str | None = None
    gpu_percent: str | None = None
    tres: str | None = None
    job_id: str | None = None
    estimate: str | None = None
    # Roles a preset maps that a file may lack: left out, with a note, where the header has no such column
    # (a sacct dump written without Timelimit). Not part of the --columns text, nor of equality.
    optional: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        for role in ROLES:
            column = getattr(self, role)
            if column is not None and (not isinstance(column, str) or not column.strip()):
                raise TraceError(f"role '{role}' needs a column name, got {column!r}")
        has_span = self.start is not None or self.end is not None
        if self.duration is not None and has_span:
            raise TraceError("give either duration=COLUMN or start=COLUMN,end=COLUMN, not both")
        if self.duration is None and not has_span:
            raise TraceError("role 'duration' is missing: give duration=COLUMN, or start=COLUMN,end=COLUMN")
        if has_span and (self.start is None or self.end is None):
            given, missing = ("start", "end") if self.end is None else ("end", "start")
            raise TraceError(f"role '{given}' needs role '{missing}' too: give start=COLUMN,end=COLUMN")
        if self.tres is not None and (self.gpus is not None or self.gpu_percent is not None):
            other = "gpus" if self.gpus is not None else "gpu_percent"
            raise TraceError(f"give either tres=COLUMN or {other}=COLUMN, not both: a TRES list (as sacct's "
                             "AllocTRES) already says how many GPUs a job holds")
        if self.tres is None and (self.gpus is None) == (self.gpu_percent is None):
            raise TraceError("give either gpus=COLUMN or gpu_percent=COLUMN (a percentage of one GPU), not both"
                             if self.gpus is not None else
                             "role 'gpus' is missing: give gpus=COLUMN, or gpu_percent=COLUMN (a percentage of one "
                             "GPU, as Alibaba's plan_gpu), or tres=COLUMN (a Slurm TRES list, as sacct's AllocTRES)")
        if self.gpu_percent is not None and self.milli is not None:
            raise TraceError("give either gpu_percent=COLUMN or milli=COLUMN: a percentage of one GPU already says "
                             "what part of a GPU the job uses")

    def roles(self) -> dict[str, str]:
        """The mapped roles, ``{role: column}``, in :data:`ROLES` order."""
        return {role: col for role in ROLES if (col := getattr(self, role)) is not None}

    def __str__(self) -> str:
        """The ``--columns`` text that gives this mapping back through :func:`parse_columns`."""
        return ",".join(f"{role}={col}" for role, col in self.roles().items())


PRESETS: dict[str, ColumnMapping] = {
    # Microsoft Philly, as published with Pollux (petuum/adaptdl, simulator/traces/philly.csv):
    # timestamp,duration,num_gpus,gpu_time,cluster; the virtual cluster is the tenant.
    "philly": ColumnMapping(submit="timestamp", duration="duration", gpus="num_gpus", tenant="cluster"),
    # Slurm accounting: sacct --parsable2 --allocations --format=JobID,User,Submit,Start,End,State,AllocTRES,Timelimit
    # (State is not read; see the module docstring). The user is the tenant, the time limit the estimate.
    "slurm": ColumnMapping(submit="Submit", start="Start", end="End", tres="AllocTRES", model="AllocTRES",
                           tenant="User", job_id="JobID", estimate="Timelimit", optional=frozenset({"estimate"})),
}



def resolve_preset(name: str) -> ColumnMapping:
    """The mapping of ``--preset NAME``; an unknown name raises :class:`TraceError` listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise TraceError(f"--preset: unknown preset {name!r}; presets are: {known}") from None


def parse_columns(text: str) -> ColumnMapping:
    """Parse ``--columns``, e.g. ``"submit=timestamp,duration=duration,gpus=num_gpus,tenant=cluster"``.

    Raises :class:`TraceError` naming the role for an unknown role, a role given twice, a missing
    ``submit`` or ``gpus``, both or neither of ``duration`` and ``start``/``end``.
    """
    found: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        role, sep, column = (part.strip() for part in item.partition("="))
        if not sep:
            raise TraceError(f"--columns: {item!r} is not ROLE=COLUMN (e.g. submit=timestamp)")
        if role not in ROLES:
            raise TraceError(f"--columns: unknown role {role!r} in {item!r}; roles are: {', '.join(ROLES)}")
        if not column:
            raise TraceError(f"--columns: role '{role}' has no column name in {item!r}")
        if role in found:
            raise TraceError(f"--columns: role '{role}' is given twice ({role}={found[role]} and {item})")
        found[role] = column
    if "submit" not in found:
        raise TraceError("--columns: role 'submit' is missing; give submit=COLUMN (the submit-time column)")
    try:
        return ColumnMapping(**found)
    except TraceError as exc:
        raise TraceError(f"--columns: {exc}") from None


# ---------------------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------------------


class TraceJob(NamedTuple):
    """One job of a :class:`Trace`, as :meth:`Trace.jobs` yields it."""

    index: int
    submit: datetime
    submit_s: float
    duration_s: float
    gpus: int
    milli: int
    model: str | None
    tenant: str
    line: int


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Jobs sorted by submit time, one array element per job.

    ``submit_s`` (float64) is seconds after ``start``, the first submit (timezone-aware UTC);
    ``duration_s`` float64 seconds; ``gpus`` int32; ``milli`` int32 thousandths of a GPU per GPU;
    ``model`` object array of ``str | None``; ``tenant`` int32 codes into ``tenant_names``; ``line`` int32,
    each job's line in ``path``. ``span`` is the window the jobs were picked from (``trace_from`` and
    ``days``), or the first to the last submit when none was given. ``report`` holds one note per thing
    the loader noticed (duplicates, zero durations, sorting, windowing).
    """

    path: Path
    start: datetime
    submit_s: np.ndarray
    duration_s: np.ndarray
    gpus: np.ndarray
    milli: np.ndarray
    model: np.ndarray
    tenant: np.ndarray
    tenant_names: list[str]
    line: np.ndarray
    span: tuple[datetime, datetime]
    report: list[str]
    deadline_s: np.ndarray | None = None  # float64 seconds after ``start``, when the trace maps a deadline
    estimate_s: np.ndarray | None = None  # float64 seconds, NaN for a job without one, when it maps an estimate

    def __len__(self) -> int:
        return int(self.submit_s.shape[0])

    def jobs(self) -> Iterator[TraceJob]:
        """The jobs in submit order, as small records."""
        names = self.tenant_names
        for i, (sub, dur, gpus, milli, model, tenant, line) in enumerate(
            zip(
                self.submit_s.tolist(), self.duration_s.tolist(), self.gpus.tolist(), self.milli.tolist(),
                self.model.tolist(), self.tenant.tolist(), self.line.tolist(), strict=True,
            )
        ):
            yield TraceJob(i, self.start + timedelta(seconds=sub), sub, dur, gpus, milli, model, names[tenant],
                           line)

    @property
    def gpu_hours(self) -> float:
        """Sum of GPUs × duration over all jobs, in GPU-hours (``milli`` not applied)."""
        return float(np.dot(self.gpus.astype(np.float64), self.duration_s)) / 3600.0

    def mean_gpus_busy(self, window: tuple[datetime, datetime] | None = None) -> float:
        """Mean number of GPUs in use over ``window`` (default ``span``) if every job ran at its submit time.

        Each job counts the GPUs it holds (GPUs × ``milli`` / 1000: a job on half a GPU holds half of one, as
        the simulator's utilisation counts it) × the part of ``[submit, submit + duration)`` inside the window,
        so jobs that run past the window's end add only their time inside it; the sum is divided by the
        window's length in seconds. Jobs submitted outside the window but running into it are only counted if they are in
        the trace.
        """
        lo_at, hi_at = window if window is not None else self.span
        lo_at, hi_at = _as_utc(lo_at, "window start"), _as_utc(hi_at, "window end")
        length_s = (hi_at - lo_at).total_seconds()
        if length_s <= 0:
            raise TraceError(f"mean_gpus_busy: the window {lo_at.isoformat()} .. {hi_at.isoformat()} is empty; "
                             "give a window whose end is after its start")
        lo = (lo_at - self.start).total_seconds()
        hi = lo + length_s
        inside = np.clip(self.submit_s + self.duration_s, lo, hi) - np.clip(self.submit_s, lo, hi)
        held = self.gpus.astype(np.float64) * (self.milli / float(WHOLE_GPU_MILLI))  # (× 1.0 for whole GPUs)
        return float(np.dot(held, inside)) / length_s


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def load_trace(
    path: str | Path,
    mapping: ColumnMapping,
    *,
    time_format: TimeFormat = "iso",
    origin: datetime | None = None,
    trace_from: datetime | date | str | None = None,
    days: float | None = None,
    duplicates: Literal["keep", "drop"] = "keep",
    cpu_jobs: CpuJobs = "error",
    time_zone: str | None = None,
) -> Trace:
    """Read the CSV at ``path`` through ``mapping``; see the module docstring for units and rules.

    ``trace_from`` (a datetime, a date or an ISO text; naive = UTC) and ``days`` keep the jobs submitted in
    ``[trace_from, trace_from + days)``; ``days`` alone counts from the first submit, ``trace_from`` alone
    runs to the end. ``cpu_jobs="drop"`` drops rows of 0 GPUs (CPU-only jobs) and reports how many; by
    default (``"error"``) such a row is an error. ``time_zone`` (an IANA name) is where the trace's ISO
    times without an offset were written. Raises :class:`TraceError` with the file, line and column of the
    first problem.
    """
    path = Path(path)
    if time_format not in ("iso", "seconds"):
        raise TraceError(f"time format {time_format!r} is unknown; use 'iso' or 'seconds'")
    zone = None if time_zone is None else time_zone_named(time_zone)
    if zone is not None and time_format != "iso":
        raise TraceError("a time zone applies only to time format 'iso'; with 'seconds', the origin says when 0 s is")
    if time_format == "seconds":
        if origin is None:
            raise TraceError(f"{path}: time format 'seconds' needs an origin, the UTC time that 0 s stands "
                             "for (e.g. 2017-10-01T00:00:00+00:00); or use time format 'iso'")
        origin = _as_utc(origin, "origin", naive_ok=False)
    elif origin is not None:
        raise TraceError("an origin applies only to time format 'seconds'; this trace's times are ISO times")
    if duplicates not in ("keep", "drop"):
        raise TraceError(f"duplicates={duplicates!r} is unknown; use 'keep' or 'drop'")
    if cpu_jobs not in ("error", "drop"):
        raise TraceError(f"cpu_jobs={cpu_jobs!r} is unknown; use 'error' or 'drop'")
    window_from = None if trace_from is None else _as_utc(trace_from, "trace_from")
    if days is not None and not 0 < days <= _MAX_DAYS:
        raise TraceError(f"days must be more than 0 and at most {_MAX_DAYS:g} (a hundred years), got {days!r}")

    header, rows, lines = _read_rows(path)
    report: list[str] = []
    absent = {role: col for role, col in mapping.roles().items() if role in mapping.optional and col not in header}
    if absent:
        mapping = dataclasses.replace(mapping, **dict.fromkeys(absent))
        report.append(f"The header has no column {', '.join(repr(c) for c in absent.values())}: "
                      f"{', '.join(absent)} not read.")
    index = _column_index(path, header, mapping)

    # Rows that are not jobs that ran go first: their other cells need not be readable.
    if mapping.job_id is not None:
        rows, lines = _take(rows, lines, _not_steps(rows, lines, index["job_id"], mapping.job_id, report))
    if mapping.start is not None:
        rows, lines = _take(rows, lines, _ran(rows, lines, index, mapping, report))
    if not rows:
        raise TraceError(f"{path}: no row is a job that ran: {' '.join(report)}")
    column = _Columns(path, header, rows, np.asarray(lines, dtype=np.int32), index)
    held = _read_gpus(column, mapping, drop_cpu=cpu_jobs == "drop")
    cpu = held.gpus == 0  # only where cpu_jobs="drop": otherwise a row of 0 GPUs has raised
    if cpu.any():
        report.append(f"{_n(int(cpu.sum()), 'row')} of 0 GPUs (CPU-only jobs) dropped "
                      f"(lines {_first_lines(np.asarray(lines)[cpu])}).")
        if cpu.all():
            raise TraceError(f"{path}: no row asks for a GPU: {' '.join(report)}")
        rows, lines = _take(rows, lines, ~cpu)
        held = held.take(~cpu)
    kept = _find_duplicates(rows, lines, report, drop=duplicates == "drop")
    if kept is not None:
        rows, lines = _take(rows, lines, kept)
        held = held.take(kept)
    line_arr = np.asarray(lines, dtype=np.int32)
    column = _Columns(path, header, rows, line_arr, index)
    gpus, milli = held.gpus, held.milli

    def times(role: str) -> np.ndarray:
        if time_format == "iso":
            return column.iso_times(role, zone)
        assert origin is not None
        return column.numbers(role, "a number of seconds") + origin.timestamp()

    def repeated_later(role: str, at: np.ndarray, earlier: np.ndarray, what: str) -> np.ndarray:
        """``at``, the times of ``role``, where one comes before ``earlier`` (the time of ``what``) on the clock
        only as the change of the clock that repeats an hour makes it (a job that started 01:50 EDT and ended
        01:10 EST, which sacct writes as 01:50 and 01:10), read with the offset after the change (reported)."""
        if zone is None or not (at < earlier).any():
            return at
        later = column.iso_times(role, zone, fold=1)
        repeated = (at < earlier) & (later >= earlier)
        k = int(repeated.sum())
        if k:
            verb, its = (f"{role}s", "its") if k == 1 else (role, "their")
            report.append(f"{_n(k, 'job')} {verb} before {its} {what} on the clock, in the hour the change of the "
                          f"clock in {zone.key} repeats; {its} {role} reads with the offset after the change "
                          f"(line{'s' if k > 1 else ''} {_first_lines(line_arr[repeated])}).")
        return np.where(repeated, later, at)

    submit_abs = times("submit")
    column.reject(~((submit_abs >= _FIRST_S) & (submit_abs <= _LAST_S)), "submit",
                  f"is not a time between {_FIRST:%Y-%m-%d} and {_LAST:%Y-%m-%d}")
    if mapping.duration is not None:
        duration = column.numbers("duration", "a number of seconds")
        column.reject(duration < 0, "duration", "is negative; a duration is seconds >= 0")
        column.reject(~(submit_abs + duration <= _LAST_S), "duration",
                      f"ends the job after {_LAST:%Y-%m-%d}; a duration is seconds, and this is too many")
    else:
        started = repeated_later("start", times("start"), submit_abs, "submit")
        ended = repeated_later("end", times("end"), started, "start")
        before = f"is before the start (column '{mapping.start}')"
        local = ("; if the trace's times are local times without an offset (as sacct writes them), a job that ran "
                 "across the change of the clock that repeats an hour ends before its start on the clock: give their "
                 "time zone (time_zone=, the CLI's --trace-timezone)")
        column.reject(ended < started, "end", lambda row, _: before + local  # within an hour, read as UTC
                      if zone is None and time_format == "iso" and started[row] - ended[row] <= 3600 else before)
        duration = ended - started
        early = int(np.count_nonzero(started < submit_abs))
        if early:
            report.append(f"{_n(early, 'job')} start before submission; duration is end - start.")
    deadline_abs = None
    if mapping.deadline is not None:
        deadline_abs = times("deadline")
        column.reject(~(deadline_abs <= _LAST_S), "deadline", f"is after {_LAST:%Y-%m-%d}")
        column.reject(deadline_abs < submit_abs, "deadline", f"is before the submit time (column '{mapping.submit}')")
        late = int(np.count_nonzero(deadline_abs < submit_abs + duration))
        if late:
            report.append(f"{_n(late, 'job')} have a deadline before submit + duration: they miss it however "
                          "they are placed.")
    estimate = None
    if mapping.estimate is not None:
        estimate = _read_estimates(column)
        report.append(_estimate_note(mapping.estimate, estimate, duration))
    if zone is not None:
        report.append(f"Times without an offset read as wall-clock times in {zone.key}." if column.naive_times else
                      f"Every time carries its own offset; the time zone {zone.key} was not needed.")
    if mapping.gpu_percent is not None:
        part = int(np.count_nonzero(milli < WHOLE_GPU_MILLI))
        report.append(f"GPUs read as a percentage of one GPU (column '{mapping.gpu_percent}'): "
                      f"{_n(part, 'job')} use part of their GPUs.")
    elif mapping.tres is not None:
        report.extend(held.tres_notes(mapping, line_arr))
    if mapping.milli is not None:
        milli = column.whole_numbers("milli", "a whole number of thousandths of a GPU")
        column.reject((milli < 1) | (milli > WHOLE_GPU_MILLI), "milli", "is not within 1..1000 (thousandths of a GPU)")
    model = held.model if held.model is not None else column.texts("model")
    tenant_text = column.texts("tenant")

    zero = duration == 0
    if zero.any():
        report.append(f"{_n(int(zero.sum()), 'job')} of 0 s counted as {MIN_DURATION_S:g} s "
                      f"(lines {_first_lines(line_arr[zero])}).")
        duration = np.where(zero, MIN_DURATION_S, duration)

    order = np.argsort(submit_abs, kind="stable")
    if not np.array_equal(order, np.arange(len(order))):
        report.append("Rows were not in submit order; sorted by submit time (equal times keep file order).")
    submit_abs, duration, gpus, milli, line_arr = (a[order] for a in (submit_abs, duration, gpus, milli, line_arr))
    model, tenant_text = model[order], tenant_text[order]
    if deadline_abs is not None:
        deadline_abs = deadline_abs[order]
    if estimate is not None:
        estimate = estimate[order]

    first_at = _from_epoch(float(submit_abs[0]))
    last_at = _from_epoch(float(submit_abs[-1]))
    if window_from is not None or days is not None:
        lo_at = window_from if window_from is not None else first_at
        try:
            hi_at = lo_at + timedelta(days=days) if days is not None else None
        except OverflowError:
            raise TraceError(f"the window from {lo_at:%Y-%m-%d} for {days:g} days ends after the last date there "
                             "is") from None
        keep = submit_abs >= lo_at.timestamp()
        if hi_at is not None:
            keep &= submit_abs < hi_at.timestamp()
        shown_hi = hi_at.isoformat() if hi_at is not None else "the end"
        if not keep.any():
            raise TraceError(f"{path}: no job was submitted in [{lo_at.isoformat()}, {shown_hi}); "
                             f"the trace's submits span {first_at.isoformat()} .. {last_at.isoformat()}")
        report.append(f"Window [{lo_at.isoformat()}, {shown_hi}) keeps {int(keep.sum())} of {len(keep)} jobs.")
        submit_abs, duration, gpus, milli, line_arr = (a[keep] for a in (submit_abs, duration, gpus, milli, line_arr))
        model, tenant_text = model[keep], tenant_text[keep]
        if deadline_abs is not None:
            deadline_abs = deadline_abs[keep]
        if estimate is not None:
            estimate = estimate[keep]
        first_at = _from_epoch(float(submit_abs[0]))
        span = (lo_at, hi_at if hi_at is not None else _from_epoch(float(submit_abs[-1])))
    else:
        span = (first_at, last_at)

    if mapping.tenant is None:
        tenant_names, tenant = [DEFAULT_TENANT], np.zeros(len(submit_abs), dtype=np.int32)
    else:
        blank = int(np.count_nonzero(tenant_text == ""))
        if blank:
            report.append(f"{_n(blank, 'job')} with an empty '{mapping.tenant}' (tenant) share the tenant ''.")
        names, codes = np.unique(tenant_text.astype(str), return_inverse=True)
        tenant_names, tenant = [str(n) for n in names], codes.astype(np.int32)
    model = np.where(model == "", None, model) if mapping.model is not None else np.full(len(model), None, object)

    return Trace(
        path=path, start=first_at, submit_s=submit_abs - submit_abs[0], duration_s=duration, gpus=gpus,
        milli=milli, model=model, tenant=tenant, tenant_names=tenant_names, line=line_arr, span=span,
        report=report, deadline_s=None if deadline_abs is None else deadline_abs - submit_abs[0],
        estimate_s=estimate,
    )


_OTHER_DELIMITERS = ("|", "\t", ";")
"""Separators taken instead of a comma when a header holds none of those and only one of these: Slurm's
``sacct --parsable2`` writes ``|``, spreadsheets in many locales ``;``, and ``\t`` is TSV."""


def _delimiter(f: TextIO) -> str:
    """The file's separator, read off its header line (the file is left at its start): a comma, unless the
    header holds no comma and exactly one of :data:`_OTHER_DELIMITERS`."""
    first = f.readline()
    f.seek(0)
    if "," in first:
        return ","
    found = [d for d in _OTHER_DELIMITERS if d in first]
    return found[0] if len(found) == 1 else ","


def _read_rows(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """Header (names stripped), data rows and their line numbers; empty lines skipped."""
    rows: list[list[str]] = []
    lines: list[int] = []
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, delimiter=_delimiter(f))
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}: the file is empty; expected a header row naming the columns")
            width = len(header)
            for row in reader:
                if row:
                    rows.append(row)
                    lines.append(reader.line_num)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8 CSV") from exc
    except csv.Error as exc:
        raise TraceError(f"{path}: not a readable CSV ({exc})") from exc
    if not rows:
        raise TraceError(f"{path}: has a header but no job rows")
    if set(map(len, rows)) != {width}:
        i = next(i for i, row in enumerate(rows) if len(row) != width)
        raise TraceError(f"{path}: line {lines[i]} has {len(rows[i])} fields but the header has {width}; "
                         "check for a missing or extra comma")
    return [name.strip() for name in header], rows, lines


def _column_index(path: Path, header: list[str], mapping: ColumnMapping) -> dict[str, int]:
    """Role → field position; every mapped column must be in the header, once."""
    roles = mapping.roles()
    missing = list(dict.fromkeys(col for col in roles.values() if col not in header))
    if missing:
        which = ", ".join(f"'{m}'" for m in missing)
        raise TraceError(f"{path}: the header has no column{'s' if len(missing) > 1 else ''} {which} (mapped as "
                         f"{', '.join(r for r, c in roles.items() if c in missing)}); "
                         f"its columns are: {', '.join(header)}")
    twice = sorted({col for col in roles.values() if header.count(col) > 1})
    if twice:
        raise TraceError(f"{path}: the header names column '{twice[0]}' more than once; rename one of them")
    return {role: header.index(col) for role, col in roles.items()}


def _find_duplicates(rows: list[list[str]], lines: list[int], report: list[str], *, drop: bool
                     ) -> np.ndarray | None:
    """Note rows that repeat an earlier row exactly; when ``drop``, the rows to keep (the first copies and the
    rows without a copy), else ``None``."""
    keys = list(map(tuple, rows))
    first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))  # row -> index of its first copy
    if len(first) == len(keys):
        return None
    repeats = sorted(set(range(len(keys))).difference(first.values()))
    repeated = {keys[i] for i in repeats}
    what = "dropped (the first copy is kept)" if drop else "kept as separate jobs"
    report.append(f"{_n(len(repeats), 'row')} repeat an earlier row exactly ({_n(len(repeated), 'distinct row')}); "
                  f"{what} (lines {_first_lines([lines[i] for i in repeats])}).")
    if not drop:
        return None
    keep = np.ones(len(rows), dtype=bool)
    keep[repeats] = False
    return keep


def _take(rows: list[list[str]], lines: list[int], keep: np.ndarray) -> tuple[list[list[str]], list[int]]:
    """The rows (and their line numbers) where ``keep`` is true."""
    if keep.all():
        return rows, lines
    at = np.flatnonzero(keep).tolist()
    return [rows[i] for i in at], [lines[i] for i in at]


_SLURM_STEP = re.compile(r"\d+(?:[_+]\d+)?\.(?:batch|extern|interactive|\d+)(?:\+\d+)?")
"""A Slurm job step's id: the job's id (``123``, an array task ``123_7``, a het job part ``123+1``), a dot
and the step (``batch``, ``extern``, ``interactive`` or its number, then a het component ``+0``)."""


def _not_steps(rows: list[list[str]], lines: list[int], at: int, name: str, report: list[str]) -> np.ndarray:
    """Rows that are not Slurm job steps (column ``at`` holds the job id); the steps are reported."""
    ids = np.array([row[at].strip() for row in rows], dtype=str)
    step = np.char.find(ids, ".") >= 0  # the regex only where a dot is
    for i in np.flatnonzero(step).tolist():
        step[i] = _SLURM_STEP.fullmatch(str(ids[i])) is not None
    if step.any():
        report.append(f"{_n(int(step.sum()), 'job step row')} skipped (column '{name}': ids such as "
                      f"{ids[step][0]}, a part of the job on its own row, which holds the job's allocation; "
                      f"sacct --allocations writes no step rows) (lines {_first_lines(np.asarray(lines)[step])}).")
    return ~step


def _ran(rows: list[list[str]], lines: list[int], index: dict[str, int], mapping: ColumnMapping,
         report: list[str]) -> np.ndarray:
    """Rows whose start and end are both there: Slurm writes ``Unknown`` or ``None`` for the start of a job
    that has not started (pending, or cancelled first) and the end of a running one, other traces leave the
    cell empty; those rows are reported."""
    def missing(role: str) -> np.ndarray:
        cells = np.array([row[index[role]].strip() for row in rows], dtype=str)
        return np.isin(cells, _NO_TIME)

    no_start, no_end = missing("start"), missing("end")
    running = no_end & ~no_start
    at = np.asarray(lines)
    if no_start.any():
        report.append(f"{_n(int(no_start.sum()), 'job')} never started (column '{mapping.start}' is empty, 'Unknown' or "
                      "'None': pending, or cancelled before it started); dropped "
                      f"(lines {_first_lines(at[no_start])}).")
    if running.any():
        report.append(f"{_n(int(running.sum()), 'job')} had not ended (column '{mapping.end}' is empty, 'Unknown' or "
                      f"'None': still running when the file was written); dropped (lines {_first_lines(at[running])}).")
    return ~(no_start | no_end)


@dataclasses.dataclass(frozen=True, slots=True)
class _Held:
    """What each row's GPU column(s) say: GPUs (0 for a CPU-only row, where those are dropped), thousandths of
    each, and, from a TRES column, the model (``None`` unless the model role reads that column) and the GPU
    types each row names."""

    gpus: np.ndarray
    milli: np.ndarray
    model: np.ndarray | None = None
    types: np.ndarray | None = None  # object: a tuple of the TRES's GPU types per row
    mismatch: np.ndarray | None = None  # bool: the TRES's gres/gpu total differs from its typed entries' sum

    def take(self, keep: np.ndarray) -> _Held:
        return _Held(*(None if a is None else a[keep] for a in (self.gpus, self.milli, self.model, self.types,
                                                                 self.mismatch)))

    def tres_notes(self, mapping: ColumnMapping, lines: np.ndarray) -> list[str]:
        """What the report says about GPUs read from a TRES column."""
        assert self.types is not None and self.mismatch is not None
        notes = []
        typed = np.fromiter(map(bool, self.types.tolist()), dtype=bool, count=len(self.types))
        if self.model is not None:
            named = [m for m in self.model.tolist() if m is not None]
            counts = ", ".join(f"{m} {named.count(m)}" for m in sorted(set(named)))
            notes.append(f"GPUs read from the TRES column '{mapping.tres}': {_n(len(named), 'job')} name a GPU type, "
                         f"read as its model ({counts or 'none'}); {len(self.model) - len(named)} name none and "
                         "run on any model.")
        elif typed.any():
            types = sorted({t for ts in self.types[typed].tolist() for t in ts})
            shown = ", ".join(types[:_FIRST_LINES_SHOWN]) + (", ..." if len(types) > _FIRST_LINES_SHOWN else "")
            where = "another column" if mapping.model is not None else "no column"
            notes.append(f"{_n(int(typed.sum()), 'job')} name a GPU type in the TRES column '{mapping.tres}' "
                         f"({shown}), "
                         f"not read as their model: the mapping takes the model from {where} "
                         f"(model={mapping.tres} would read it).")
        if self.mismatch.any():
            notes.append(f"{_n(int(self.mismatch.sum()), 'job')} list a gres/gpu total unlike the sum of their typed "
                         f"gres/gpu:TYPE entries in column '{mapping.tres}'; the total is their GPUs "
                         f"(lines {_first_lines(lines[self.mismatch])}).")
        return notes


def _read_gpus(column: _Columns, mapping: ColumnMapping, *, drop_cpu: bool) -> _Held:
    """Each row's GPUs, from ``gpus``, ``gpu_percent`` or ``tres``; a row of 0 GPUs raises unless
    ``drop_cpu`` (then its GPUs are 0, for the caller to drop)."""
    n = len(column.rows)
    whole = np.full(n, WHOLE_GPU_MILLI, dtype=np.int32)

    def zero_is_cpu(problem: str) -> Callable[[int, str], str]:
        """``problem``, and for a value of 0 (a CPU-only job) what to do about it."""
        return lambda row, value: f"{problem} ({_CPU_ONLY})" if float(value) == 0 else problem

    if mapping.gpu_percent is not None:
        percent = column.numbers("gpu_percent", "a percentage of one GPU")
        column.reject(percent < 0 if drop_cpu else ~(percent > 0), "gpu_percent",
                      zero_is_cpu("is not above 0; a job asks for some part of a GPU"))
        column.reject(percent > 100 * (2**31 - 1), "gpu_percent", "is too large")
        gpus = np.ceil(percent / 100.0).astype(np.int32)
        share = np.divide(percent * 10.0, gpus, out=np.full(n, float(WHOLE_GPU_MILLI)), where=gpus > 0)
        return _Held(gpus, np.clip(np.rint(share), 1, WHOLE_GPU_MILLI).astype(np.int32))
    if mapping.gpus is not None:
        gpus = column.whole_numbers("gpus", "a whole number of GPUs")
        column.reject(gpus < 0 if drop_cpu else gpus < 1, "gpus",
                      zero_is_cpu("is less than 1; a job asks for at least one GPU"))
        return _Held(gpus, whole)
    return _read_tres(column, mapping, whole, drop_cpu=drop_cpu)


_TRES_GPU = "gres/gpu"
_TRES_FORMAT = "a Slurm TRES list (NAME=COUNT,...: e.g. cpu=8,gres/gpu=2,mem=64G)"
_TRES_NAME = re.compile(r"[\w./:-]+")  # cpu, mem, billing, fs/disk, gres/gpu, gres/gpu:a100, license/x, bb/y
_TRES_ANY = re.compile(r"[^=\s]+")  # an entry not read: any name and value without '=' or blanks
_TRES_VALUE = re.compile(r"[\w.+-]+")  # 8, 64G, 1.50T (only the GPU counts are read, and must be whole numbers)
_TRES_PLAIN = re.compile(r"[^=,\s]+=[^=,\s]+(?:,[^=,\s]+=[^=,\s]+)*")  # NAME=VALUE,... as sacct writes it
_TRES_GPU_ENTRY = re.compile(r"(?:^|(?<=,))gres/gpu(?::[^=,]*)?=[^,]*")  # in such a list, its GPU entries


def _parse_tres(text: str) -> tuple[int, dict[str, int], bool]:
    """The GPUs of one TRES list (its ``gres/gpu`` total, else the sum of its ``gres/gpu:TYPE`` entries),
    the typed entries, and whether a total differs from their sum; a problem raises ``ValueError``."""
    total: int | None = None
    typed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not (sep and _TRES_ANY.fullmatch(name) and _TRES_ANY.fullmatch(value)):
            raise ValueError(f"is not {_TRES_FORMAT}: {item!r} is not NAME=COUNT")
        if name != _TRES_GPU and not name.startswith(_TRES_GPU + ":"):
            continue  # not read, so not checked beyond NAME=VALUE: a remote license is license/NAME@SERVER=1
        if not (_TRES_NAME.fullmatch(name) and _TRES_VALUE.fullmatch(value)):
            raise ValueError(f"is not {_TRES_FORMAT}: {item!r} is not NAME=COUNT")
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"gives {name} the count {value!r}; expected a whole number of GPUs")
        count = int(value)
        if count > 2**31 - 1:
            raise ValueError(f"gives {name} a count that is too large")
        if name == _TRES_GPU:
            if total is not None:
                raise ValueError(f"lists {_TRES_GPU} twice")
            total = count
        else:
            kind = name[len(_TRES_GPU) + 1:]
            if not kind:
                raise ValueError(f"lists {name!r} without a GPU type after the colon")
            typed[kind] = typed.get(kind, 0) + count
    typed = {kind: count for kind, count in typed.items() if count > 0}
    summed = sum(typed.values())
    if total is None:
        return summed, typed, False
    return total, typed, bool(typed) and summed != total


def _read_tres(column: _Columns, mapping: ColumnMapping, whole: np.ndarray, *, drop_cpu: bool) -> _Held:
    """GPUs (and, with ``model`` on the same column, the model) from a Slurm TRES column; each distinct
    text is parsed once, in the order of first appearance, so the first bad one is the first bad line."""
    raw = np.array(column._raw("tres"), dtype=str)
    texts, first_text, of_text = np.unique(raw, return_index=True, return_inverse=True)
    # Only the GPU entries are read, so a list written as sacct writes it (NAME=VALUE,... without blanks) is
    # parsed as its GPU entries alone: a dump's lists differ job by job in memory and billing, not in GPUs.
    keys = np.array([",".join(_TRES_GPU_ENTRY.findall(t)) if _TRES_PLAIN.fullmatch(t) else t for t in texts.tolist()],
                    dtype=str)
    distinct, of_key = np.unique(keys, return_inverse=True)
    first = np.full(len(distinct), len(raw), dtype=np.int64)
    np.minimum.at(first, of_key, first_text)  # each key's first row
    inverse = of_key[of_text]
    with_model = mapping.model == mapping.tres
    gpus = np.zeros(len(distinct), dtype=np.int64)
    types = np.empty(len(distinct), dtype=object)
    model = np.full(len(distinct), None, dtype=object)
    mismatch = np.zeros(len(distinct), dtype=bool)
    for k in np.argsort(first).tolist():
        row = int(first[k])
        text = str(raw[row])
        try:
            gpus[k], typed, mismatch[k] = _parse_tres(str(distinct[k]))
        except ValueError as exc:
            raise column._fail(row, "tres", text, str(exc)) from None
        if gpus[k] == 0 and not drop_cpu:
            raise column._fail(row, "tres", text, f"lists no GPUs; a job asks for at least one GPU ({_CPU_ONLY})")
        types[k] = tuple(typed)
        if with_model and gpus[k] > 0 and typed:
            models = {}
            for kind in typed:
                try:
                    models.setdefault(ids.gpu_model(kind), kind)
                except ids.UnknownIdentifier:
                    raise column._fail(row, "model", text, f"names the GPU type {kind!r}, which is no known GPU "
                                       f"model; known models: {', '.join(ids.GPU_MODEL_IDS)} (map the TRES "
                                       "column as tres only, without model, to read such jobs as running on any "
                                       "model)") from None
            if len(models) > 1:
                raise column._fail(row, "model", text, f"names GPUs of {len(models)} models "
                                   f"({', '.join(sorted(models))}); a job here runs on one model (map the TRES "
                                   "column as tres only, without model, to read it as running on any model)")
            model[k] = next(iter(models))
    return _Held(gpus[inverse].astype(np.int32), whole, model[inverse] if with_model else None, types[inverse],
                 mismatch[inverse])


class _Columns:
    """Converts one mapped column at a time, naming file, line and column on the first bad value."""

    def __init__(self, path: Path, header: list[str], rows: list[list[str]], lines: np.ndarray,
                 index: dict[str, int]) -> None:
        self.path, self.header, self.rows, self.lines, self.index = path, header, rows, lines, index
        self.naive_times = 0  # cells :meth:`iso_times` read without an offset

    def _raw(self, role: str, *, strip: bool = True) -> list[str]:
        values = list(map(itemgetter(self.index[role]), self.rows))
        return list(map(str.strip, values)) if strip else values

    def _fail(self, row: int, role: str, value: str, problem: str) -> TraceError:
        column = self.header[self.index[role]]
        return TraceError(f"{self.path}: line {int(self.lines[row])}, column '{column}' ({role}): "
                          f"{value!r} {problem}")

    def reject(self, bad: np.ndarray, role: str, problem: str | Callable[[int, str], str]) -> None:
        """Raise for the first row where ``bad``; ``problem`` may depend on the row and its value."""
        if bad.any():
            row = int(np.argmax(bad))
            value = self.rows[row][self.index[role]].strip()
            raise self._fail(row, role, value, problem if isinstance(problem, str) else problem(row, value))

    def numbers(self, role: str, what: str) -> np.ndarray:
        raw = self._raw(role, strip=False)  # numpy and float() both allow blanks around a number
        try:
            out = np.array(raw, dtype=np.float64)
        except ValueError:
            out = None
        if out is None or not np.isfinite(out).all():
            for row, value in enumerate(raw):
                try:
                    number = float(value)
                except ValueError:
                    number = float("nan")
                if not np.isfinite(number):
                    problem = f"is not {what}" if value.strip() else f"is empty; expected {what}"
                    raise self._fail(row, role, value, problem) from None
        assert out is not None
        return out

    def whole_numbers(self, role: str, what: str) -> np.ndarray:
        out = self.numbers(role, what)
        self.reject(out != np.round(out), role, f"is not {what}")
        self.reject(np.abs(out) > 2**31 - 1, role, "is too large")
        return out.astype(np.int32)

    def iso_times(self, role: str, zone: ZoneInfo | None = None, fold: int = 0) -> np.ndarray:
        """Seconds since 1970-01-01 UTC; naive times are wall-clock times in ``zone`` (UTC if none), others
        converted; a wall-clock time that a change of the clock repeats or skips reads with the offset before
        the change (``fold`` 0) or after it (1)."""
        fast = _numpy_naive_times(self._raw(role, strip=False))
        if fast is not None:
            self.naive_times += len(fast)
            return fast if zone is None else _wall_clock_to_utc(fast, zone, fold)
        raw = self._raw(role)
        out = np.empty(len(raw), dtype=np.float64)
        parse, naive_zone = datetime.fromisoformat, UTC if zone is None else zone
        naive = 0
        for row, value in enumerate(raw):
            try:
                at = parse(value)
            except ValueError:
                raise self._fail(row, role, value, "is not an ISO 8601 time (like 2017-10-09 07:01:55 or "
                                 "2017-10-09T07:01:55+02:00)") from None
            if at.tzinfo is None:
                naive += 1
                at = at.replace(tzinfo=naive_zone, fold=fold)
            out[row] = at.timestamp()
        self.naive_times += naive
        return out

    def texts(self, role: str) -> np.ndarray:
        if role not in self.index:
            return np.full(len(self.rows), None, dtype=object)
        interned: dict[str, str] = {}
        return np.array([interned.setdefault(v, v) for v in self._raw(role)], dtype=object)


def time_zone_named(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; an unknown one raises :class:`TraceError` with examples."""
    try:
        return ZoneInfo(iana_time_zone(name.strip()))
    except ValueError:
        raise TraceError(f"time zone {name!r} is unknown; give an IANA name such as America/New_York, Europe/Berlin "
                         "or UTC") from None


def _wall_clock_to_utc(wall_s: np.ndarray, zone: ZoneInfo, fold: int = 0) -> np.ndarray:
    """Seconds since the epoch of wall-clock times in ``zone`` given as if they were UTC (as numpy reads a
    naive time): each minute's offset is looked up once, with the offset in force before a change for a time
    the change repeats or skips (``fold=0``), or after it (``fold=1``). Clocks change on a whole minute
    everywhere."""
    # A time outside the years a datetime can have (numpy reads 10000-01-01) takes the offset of the nearest
    # one, as the range check after names it.
    minute = np.clip(np.floor(wall_s / 60.0), _MIN_WALL_MINUTE, _MAX_WALL_MINUTE)
    distinct, inverse = np.unique(minute, return_inverse=True)
    offset = np.array([zone.utcoffset((datetime(1970, 1, 1) + timedelta(minutes=float(m))).replace(fold=fold))
                       .total_seconds() for m in distinct.tolist()], dtype=np.float64)
    return wall_s - offset[inverse]


_MIN_WALL_MINUTE = (datetime(1, 1, 2) - datetime(1970, 1, 1)) // timedelta(minutes=1)
_MAX_WALL_MINUTE = (datetime(9999, 12, 30) - datetime(1970, 1, 1)) // timedelta(minutes=1)
"""The first and last minutes whose offset :func:`_wall_clock_to_utc` looks up, as minutes after 1970."""

_NO_ESTIMATE = frozenset({"", "unlimited", "partition_limit", "none", "invalid"})
"""Cells of an ``estimate`` column that give no estimate (case-insensitive): Slurm's words for a job without
a time limit of its own, and an empty cell."""

_SLURM_TIME = re.compile(r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                         r"|(?P<a>\d+):(?P<b>\d+)(?::(?P<c>\d+))?)")
"""Slurm's time forms with a dash or a colon: D-H, D-H:M, D-H:M:S, M:S, H:M:S (``sbatch --time``)."""


def _estimate_seconds(text: str) -> float:
    """Seconds of one ``estimate`` cell, NaN for none (:data:`_NO_ESTIMATE`, or 0: no limit in Slurm); a cell
    that is neither a number of seconds nor a Slurm time raises ``ValueError`` saying what is expected."""
    if text.lower() in _NO_ESTIMATE:
        return float("nan")
    match = _SLURM_TIME.fullmatch(text)
    if match is not None:
        try:
            g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
            if "d" in g:
                seconds = float(((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0))
            elif "c" in g:
                seconds = float((g["a"] * 60 + g["b"]) * 60 + g["c"])
            else:
                seconds = float(g["a"] * 60 + g["b"])  # M:S, as Slurm reads two fields
        except (ValueError, OverflowError):  # more digits than int() reads or a float holds
            raise ValueError("is too large to be a run-time estimate") from None
    else:
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not (np.isfinite(seconds) and seconds >= 0):
            raise ValueError("is not a run-time estimate: give seconds, or a Slurm time ([D-]HH:MM:SS, MM:SS, "
                             "D-HH), or UNLIMITED / an empty cell for none")
    return float(seconds) if seconds > 0 else float("nan")


def _read_estimates(column: _Columns) -> np.ndarray:
    """float64 seconds of the ``estimate`` column, NaN where a job gives none; each distinct cell is read once,
    in the order of first appearance, so the first bad one is the first bad line."""
    raw = np.array(column._raw("estimate"), dtype=str)
    distinct, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    seconds = np.empty(len(distinct), dtype=np.float64)
    for k in np.argsort(first).tolist():
        try:
            seconds[k] = _estimate_seconds(str(distinct[k]))
        except ValueError as exc:
            raise column._fail(int(first[k]), "estimate", str(distinct[k]), str(exc)) from None
    return seconds[inverse]


def _estimate_note(name: str, estimate: np.ndarray, duration: np.ndarray) -> str:
    """What the report says about the estimates read from column ``name``."""
    given = np.isfinite(estimate)
    note = f"Run-time estimates read from column '{name}' for {_n(int(given.sum()), 'job')}"
    if given.any():
        ratio = estimate[given] / np.maximum(duration[given], MIN_DURATION_S)
        note += (f" (estimate / run time: median {np.median(ratio):.2f}; {np.mean(ratio < 1):.0%} ran past theirs)")
    missing = int(np.count_nonzero(~given))
    if missing:
        one = missing == 1
        note += (f"; {missing} {'gives' if one else 'give'} none (empty, UNLIMITED, Partition_Limit, NONE, INVALID or "
                 f"0) and {'gets' if one else 'get'} a drawn estimate")
    return note + "."


def _numpy_naive_times(raw: list[str]) -> np.ndarray | None:
    """Fast path for times without an offset (numpy reads them as UTC); ``None`` sends the caller to the
    row-by-row parser, which also names the bad row."""
    if min(map(len, raw)) < 10:  # numpy would read "2017" or "" (NaT) as a time
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy only warns about an offset ("Z", "+02:00")
        try:
            parsed = np.array(raw, dtype="datetime64[us]")
        except (ValueError, UserWarning, DeprecationWarning):
            return None
    if np.isnat(parsed).any():
        return None
    return parsed.astype(np.int64) / 1e6


def _as_utc(value: datetime | date | str, what: str, *, naive_ok: bool = True) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise TraceError(f"{what}: {value!r} is not an ISO 8601 date or time (like 2017-10-01)") from None
    if not isinstance(value, datetime):
        if isinstance(value, date):
            value = datetime(value.year, value.month, value.day)
        else:
            raise TraceError(f"{what}: expected a date or time, got {value!r}")
    if value.tzinfo is None:
        if not naive_ok:
            raise TraceError(f"{what}: {value.isoformat()} has no time zone; give an aware time, e.g. "
                             f"{value.isoformat()}+00:00")
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


# The times a trace may hold: within the years a date can have, with room for a run and a deadline after.
_FIRST = datetime(1970, 1, 1, tzinfo=UTC)
_LAST = datetime(9000, 1, 1, tzinfo=UTC)
_FIRST_S, _LAST_S = _FIRST.timestamp(), _LAST.timestamp()
_MAX_DAYS = 36_525.0


def _from_epoch(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _first_lines(lines: Sequence[int] | np.ndarray) -> str:
    shown = [str(int(n)) for n in list(lines)[:_FIRST_LINES_SHOWN]]
    more = len(lines) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")
