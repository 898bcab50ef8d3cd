"""Loading job traces for the simulator: the real Philly trace loads whole, sorted and windowed; any CSV can be
mapped with ``--columns``; and every mistake in a mapping or a file is reported with the role, the file, the
line and the column."""

from __future__ import annotations

import csv
from datetime import date, datetime, timedelta, timezone, UTC
from pathlib import Path

import numpy as np
import pytest

from broker.data.traces import (
    PRESETS,
    ColumnMapping,
    Trace,
    TraceError,
    load_trace,
    parse_columns,
    resolve_preset,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PHILLY = DATA / "traces" / "philly" / "philly_jobs_pollux.csv"
UTC = UTC



def write_csv(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SIMPLE = ColumnMapping(submit="submitted", duration="seconds", gpus="gpus", tenant="team")


def simple_trace(tmp_path: Path, *rows: str) -> Path:
    """A CSV with columns submitted,seconds,gpus,team and the given rows."""
    return write_csv(tmp_path, "submitted,seconds,gpus,team\n" + "".join(f"{r}\n" for r in rows))


# --- the real Philly trace ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def philly() -> Trace:
    assert PHILLY.exists(), f"the shared Philly trace is not at {PHILLY}: clone the repo with shared/ beside it"
    return load_trace(PHILLY, resolve_preset("philly"))


def test_the_philly_preset_loads_every_job_of_the_pollux_trace_sorted_by_submit_time(philly: Trace) -> None:
    assert len(philly) == 82_247
    assert np.all(np.diff(philly.submit_s) >= 0)
    assert philly.submit_s[0] == 0.0
    assert philly.start == datetime(2017, 9, 4, 10, 30, 41, tzinfo=UTC)  # line 31568 of the file
    assert philly.start + timedelta(seconds=float(philly.submit_s[-1])) == datetime(2017, 12, 22, 8, 2, 11,
                                                                                      tzinfo=UTC)  # line 62255
    assert any("not in submit order" in note for note in philly.report)


def test_the_philly_trace_reports_its_65_exact_duplicate_rows_and_keeps_them(philly: Trace) -> None:
    (note,) = [n for n in philly.report if "repeat an earlier row" in n]
    assert note.startswith("65 rows repeat an earlier row exactly (63 distinct rows); kept as separate jobs")
    assert "3137" in note  # line 3137 repeats line 3136: 2017-10-06 19:56:38,562.0,1,562.0,6214e9
    copies = philly.line[(philly.submit_s == (datetime(2017, 10, 6, 19, 56, 38, tzinfo=UTC) - philly.start)
                          .total_seconds()) & (philly.duration_s == 562.0)]
    assert sorted(copies.tolist()) == [3136, 3137]


def test_a_known_philly_job_keeps_its_duration_gpus_and_virtual_cluster(philly: Trace) -> None:
    # line 23198: 2017-12-12 21:38:32,7673.0,128,982144.0,ee9e8c
    (job,) = [j for j in philly.jobs() if j.line == 23198]
    assert job.submit == datetime(2017, 12, 12, 21, 38, 32, tzinfo=UTC)
    assert (job.duration_s, job.gpus, job.tenant, job.milli, job.model) == (7673.0, 128, "ee9e8c", 1000, None)


def test_the_philly_trace_has_fifteen_virtual_clusters_as_tenants(philly: Trace) -> None:
    assert len(philly.tenant_names) == 15
    biggest = philly.tenant_names[int(np.bincount(philly.tenant).argmax())]
    assert biggest == "6214e9"


def test_the_philly_trace_totals_match_the_files_gpu_time_column(philly: Trace) -> None:
    with PHILLY.open(newline="") as f:
        gpu_seconds = sum(float(row["gpu_time"]) for row in csv.DictReader(f))
    assert philly.gpu_hours == pytest.approx(gpu_seconds / 3600)
    span_s = float(philly.submit_s[-1])
    # Every Philly job ends before the last submit, so clipping to the span changes the mean by < 0.01 %.
    assert philly.mean_gpus_busy() == pytest.approx(gpu_seconds / span_s, rel=1e-4)


def test_a_thirty_day_window_keeps_exactly_the_jobs_submitted_in_it() -> None:
    with PHILLY.open(newline="") as f:
        expected = sum(1 for row in csv.DictReader(f) if "2017-10-01" <= row["timestamp"] < "2017-10-31")
    window = load_trace(PHILLY, resolve_preset("philly"), trace_from="2017-10-01", days=30)
    assert len(window) == expected
    assert window.span == (datetime(2017, 10, 1, tzinfo=UTC), datetime(2017, 10, 31, tzinfo=UTC))
    assert datetime(2017, 10, 1, tzinfo=UTC) <= window.start
    assert window.start + timedelta(seconds=float(window.submit_s[-1])) < datetime(2017, 10, 31, tzinfo=UTC)
    assert f"keeps {expected} of 82247 jobs" in window.report[-1]


# --- mapping other traces ---------------------------------------------------------------------------------


def test_a_start_and_end_mapping_takes_the_duration_from_the_difference(tmp_path: Path) -> None:
    path = write_csv(tmp_path, (
        "id,queued,began,finished,n,share,gpu_type,user\n"
        "a,2024-03-01T10:00:00Z,2024-03-01T10:05:00Z,2024-03-01T11:05:00Z,2,500,a100,ann\n"
        "b,2024-03-01T09:00:00+01:00,2024-03-01T09:00:00+01:00,2024-03-01T09:00:30+01:00,1,1000,,bob\n"
    ))
    mapping = parse_columns("submit=queued,start=began,end=finished,gpus=n,milli=share,model=gpu_type,tenant=user")
    trace = load_trace(path, mapping)
    first, second = trace.jobs()
    assert first.submit == datetime(2024, 3, 1, 8, 0, tzinfo=UTC)  # 09:00+01:00, converted to UTC
    assert (first.duration_s, first.gpus, first.milli, first.model, first.tenant) == (30.0, 1, 1000, None, "bob")
    assert second.submit == datetime(2024, 3, 1, 10, 0, tzinfo=UTC)
    assert (second.duration_s, second.gpus, second.milli, second.model, second.tenant) == (3600.0, 2, 500, "a100",
                                                                                           "ann")
    assert second.submit_s == 7200.0


def test_seconds_times_are_offsets_from_the_origin(tmp_path: Path) -> None:
    path = write_csv(tmp_path, "t,len,gpus\n3600,60,1\n0,120,4\n86400.5,30,2\n")
    origin = datetime(2020, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=1)))  # midnight UTC
    trace = load_trace(path, parse_columns("submit=t,duration=len,gpus=gpus"), time_format="seconds",
                       origin=origin)
    assert trace.start == datetime(2020, 1, 1, tzinfo=UTC)
    assert trace.submit_s.tolist() == [0.0, 3600.0, 86400.5]
    assert trace.duration_s.tolist() == [120.0, 60.0, 30.0]
    assert trace.gpus.tolist() == [4, 1, 2]
    assert trace.tenant_names == ["default"] and trace.tenant.tolist() == [0, 0, 0]


def test_times_without_an_offset_are_taken_as_utc(tmp_path: Path) -> None:
    path = simple_trace(tmp_path, "2017-10-09 07:01:55,66,1,a", "2017-10-09T07:01:56,66,1,a")
    trace = load_trace(path, SIMPLE)
    assert trace.start == datetime(2017, 10, 9, 7, 1, 55, tzinfo=UTC)
    assert trace.submit_s.tolist() == [0.0, 1.0]


def test_rows_submitted_at_the_same_time_keep_their_file_order(tmp_path: Path) -> None:
    path = simple_trace(tmp_path, "2020-01-01 00:00:05,1,1,late", "2020-01-01 00:00:00,2,1,first",
                        "2020-01-01 00:00:00,3,1,second")
    trace = load_trace(path, SIMPLE)
    assert [j.tenant for j in trace.jobs()] == ["first", "second", "late"]
    assert trace.line.tolist() == [3, 4, 2]


def test_a_job_of_zero_seconds_is_kept_as_one_second_and_reported(tmp_path: Path) -> None:
    path = simple_trace(tmp_path, "2020-01-01 00:00:00,0,1,a", "2020-01-01 00:00:10,5,1,a")
    trace = load_trace(path, SIMPLE)
    assert trace.duration_s.tolist() == [1.0, 5.0]
    assert "1 job of 0 s counted as 1 s (lines 2)." in trace.report


@pytest.mark.parametrize(
    ("duplicates", "jobs"),
    [
        pytest.param("keep", 3, id="duplicate rows are kept by default because distinct jobs can look alike"),
        pytest.param("drop", 2, id="duplicate rows can be dropped, keeping the first copy"),
    ],
)
def test_duplicate_rows_are_reported_with_their_lines(tmp_path: Path, duplicates: str, jobs: int) -> None:
    path = simple_trace(tmp_path, "2020-01-01 00:00:00,5,1,a", "2020-01-01 00:00:01,5,1,a",
                        "2020-01-01 00:00:00,5,1,a")
    trace = load_trace(path, SIMPLE, duplicates=duplicates)  # type: ignore[arg-type]
    assert len(trace) == jobs
    assert any(n.startswith("1 row repeat an earlier row exactly (1 distinct row)") and "(lines 4)" in n
               for n in trace.report), trace.report


def test_mean_gpus_busy_counts_only_the_time_jobs_run_inside_the_window(tmp_path: Path) -> None:
    # 2 GPUs for the first hour, then 4 GPUs from 00:30 for two hours
    path = simple_trace(tmp_path, "2020-01-01 00:00:00,3600,2,a", "2020-01-01 00:30:00,7200,4,a")
    trace = load_trace(path, SIMPLE)
    assert trace.gpu_hours == pytest.approx(2 * 1 + 4 * 2)
    assert trace.mean_gpus_busy() == pytest.approx(2.0)  # span = first to last submit: only job 1 runs
    day = (datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC))
    assert trace.mean_gpus_busy(day) == pytest.approx(10 / 24)


def test_an_empty_line_at_the_end_or_in_the_middle_is_skipped(tmp_path: Path) -> None:
    path = write_csv(tmp_path, "submitted,seconds,gpus,team\n2020-01-01 00:00:00,5,1,a\n\n"
                               "2020-01-01 00:00:01,5,1,b\n\n")
    assert len(load_trace(path, SIMPLE)) == 2


def test_every_preset_and_mapping_prints_back_as_the_columns_text_that_gives_it() -> None:
    for mapping in PRESETS.values():
        assert parse_columns(str(mapping)) == mapping
    assert str(PRESETS["philly"]) == "submit=timestamp,duration=duration,gpus=num_gpus,tenant=cluster"


# --- GPUs as a percentage of one GPU (the Alibaba PAI trace's plan_gpu) ---------------------------------------


def test_a_percentage_of_one_gpu_is_read_as_gpus_and_thousandths_and_sizes_by_what_is_held(tmp_path: Path) -> None:
    # Alibaba's cluster-trace-gpu-v2020 (pai_job_table): start and end in epoch seconds, plan_gpu in percent.
    path = write_csv(tmp_path, "job,start_time,end_time,plan_gpu\n"
                               "a,0,3600,50\nb,0,3600,100\nc,0,3600,150\nd,0,3600,25.5\ne,0,3600,800\n")
    mapping = parse_columns("submit=start_time,start=start_time,end=end_time,gpu_percent=plan_gpu")
    trace = load_trace(path, mapping, time_format="seconds", origin=datetime(2020, 7, 1, tzinfo=UTC))
    assert trace.gpus.tolist() == [1, 1, 2, 1, 8]
    assert trace.milli.tolist() == [500, 1000, 750, 255, 1000]
    assert any("3 jobs use part of their GPUs" in r for r in trace.report), trace.report
    # sized by the GPUs the jobs hold: 0.5 + 1 + 1.5 + 0.255 + 8 over the hour, not 13 whole GPUs
    hour = (trace.start, trace.start + timedelta(hours=1))
    assert trace.mean_gpus_busy(hour) == pytest.approx(11.255)
    for bad, problem in (("0", "is not above 0"), ("", "is empty"), ("-5", "is not above 0")):
        path = write_csv(tmp_path, f"job,start_time,end_time,plan_gpu\na,0,3600,{bad}\n", name="bad.csv")
        with pytest.raises(TraceError, match=f"line 2, column 'plan_gpu' \\(gpu_percent\\): '{bad}' {problem}"):
            load_trace(path, mapping, time_format="seconds", origin=datetime(2020, 7, 1, tzinfo=UTC))


def test_a_slurm_sacct_export_separated_by_bars_is_read_and_a_bom_is_skipped(tmp_path: Path) -> None:
    # sacct --parsable2 --format=JobID,Submit,ElapsedRaw,AllocTRES,Account (a GPU count column made from it)
    path = tmp_path / "sacct.txt"
    path.write_text("\ufeffJobID|Submit|ElapsedRaw|GPUs|Account\n"
                    "101|2024-03-01T10:00:00|3600|4|vision\n102|2024-03-01T10:05:00|60|1|nlp\n", encoding="utf-8")
    trace = load_trace(path, parse_columns("submit=Submit,duration=ElapsedRaw,gpus=GPUs,tenant=Account"))
    assert trace.gpus.tolist() == [4, 1] and trace.duration_s.tolist() == [3600.0, 60.0]
    assert trace.tenant_names == ["nlp", "vision"]


# --- mistakes in --columns and --preset --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("submit=t,duration=d,gpu=g", "unknown role 'gpu'", id="an unknown role is named"),
        pytest.param("duration=d,gpus=g", "role 'submit' is missing", id="a missing submit role is named"),
        pytest.param("submit=t,duration=d", "role 'gpus' is missing", id="a missing gpus role is named"),
        pytest.param("submit=t,duration=d,start=s,end=e,gpus=g", "either duration=COLUMN or start=COLUMN,end",
                     id="a duration and a start and end together are refused"),
        pytest.param("submit=t,gpus=g", "role 'duration' is missing",
                     id="neither a duration nor a start and end is refused"),
        pytest.param("submit=t,start=s,gpus=g", "role 'start' needs role 'end'", id="a start without an end is refused"),
        pytest.param("submit=t,duration=d,gpus=g,gpus=h", "role 'gpus' is given twice",
                     id="a role given twice is named"),
        pytest.param("submit=t,duration=d,gpus=g,gpu_percent=p", "either gpus=COLUMN or gpu_percent=COLUMN",
                     id="a GPU count and a percentage together are refused"),
        pytest.param("submit=t,duration=d,gpu_percent=p,milli=m", "either gpu_percent=COLUMN or milli=COLUMN",
                     id="a percentage and thousandths together are refused"),
        pytest.param("submit=t,duration,gpus=g", "'duration' is not ROLE=COLUMN", id="an item without = is named"),
        pytest.param("submit=,duration=d,gpus=g", "role 'submit' has no column name",
                     id="a role without a column is named"),
        pytest.param("submit=t,duration=d,gpus=g,tres=r", "either tres=COLUMN or gpus=COLUMN, not both",
                     id="a GPU count and a TRES together are refused"),
        pytest.param("submit=t,duration=d,gpu_percent=p,tres=r", "either tres=COLUMN or gpu_percent=COLUMN",
                     id="a percentage and a TRES together are refused"),
        pytest.param("submit=t,duration=d", "or tres=COLUMN (a Slurm TRES list, as sacct's AllocTRES)",
                     id="a mapping without GPUs names the TRES role too"),
    ],
)
def test_a_bad_columns_mapping_is_refused_naming_the_role(text: str, message: str) -> None:
    with pytest.raises(TraceError, match="^--columns") as caught:
        parse_columns(text)
    assert message in str(caught.value)


def test_an_unknown_preset_is_refused_listing_the_presets() -> None:
    with pytest.raises(TraceError, match=r"unknown preset 'phily'; presets are: philly"):
        resolve_preset("phily")


# --- mistakes in the file --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "message"),
    [
        pytest.param("2020-01-01 00:00:00,ten,1,a", "line 3, column 'seconds' (duration): 'ten' is not a number",
                     id="a duration that is not a number names the line and column"),
        pytest.param("2020-01-01 00:00:00,-5,1,a", "line 3, column 'seconds' (duration): '-5' is negative",
                     id="a negative duration names the line and column"),
        pytest.param("2020-01-01 00:00:00,5,0,a", "line 3, column 'gpus' (gpus): '0' is less than 1",
                     id="a job asking for zero GPUs names the line and column"),
        pytest.param("2020-01-01 00:00:00,5,-2,a", "line 3, column 'gpus' (gpus): '-2' is less than 1",
                     id="a job asking for negative GPUs names the line and column"),
        pytest.param("2020-01-01 00:00:00,5,1.5,a", "line 3, column 'gpus' (gpus): '1.5' is not a whole number",
                     id="a fractional GPU count names the line and column"),
        pytest.param("2020-01-01 00:00:00,,1,a", "line 3, column 'seconds' (duration): '' is empty",
                     id="an empty duration names the line and column"),
        pytest.param("2020-13-01 00:00:00,5,1,a", "line 3, column 'submitted' (submit): '2020-13-01 00:00:00' is not "
                     "an ISO 8601 time", id="an impossible date names the line and column"),
        pytest.param("yesterday,5,1,a", "line 3, column 'submitted' (submit): 'yesterday' is not an ISO 8601 time",
                     id="a time that is not a time names the line and column"),
        pytest.param("2020-01-01 00:00:00,5,1", "line 3 has 3 fields but the header has 4",
                     id="a row with a missing field names the line"),
    ],
)
def test_a_bad_row_is_refused_naming_the_file_line_and_column(tmp_path: Path, row: str, message: str) -> None:
    path = simple_trace(tmp_path, "2020-01-01 00:00:00,5,1,a", row)
    with pytest.raises(TraceError) as caught:
        load_trace(path, SIMPLE)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_an_end_before_the_start_names_the_line_and_column(tmp_path: Path) -> None:
    path = write_csv(tmp_path, "t,s,e,g\n2020-01-01 00:00:00,2020-01-01 00:10:00,2020-01-01 00:09:59,1\n")
    with pytest.raises(TraceError, match=r"line 2, column 'e' \(end\): '2020-01-01 00:09:59' is before the start"):
        load_trace(path, parse_columns("submit=t,start=s,end=e,gpus=g"))


def test_a_missing_column_is_named_with_the_file_and_the_columns_present(tmp_path: Path) -> None:
    path = write_csv(tmp_path, "timestamp,duration,gpus,cluster\n2017-10-09 07:01:55,66.0,1,11cb48\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path, PRESETS["philly"])
    assert str(caught.value) == (f"{path}: the header has no column 'num_gpus' (mapped as gpus); "
                                 "its columns are: timestamp, duration, gpus, cluster")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"time_format": "seconds"}, "time format 'seconds' needs an origin",
                     id="seconds without an origin are refused"),
        pytest.param({"time_format": "seconds", "origin": datetime(2020, 1, 1)}, "has no time zone",
                     id="an origin without a time zone is refused"),
        pytest.param({"time_format": "epoch"}, "time format 'epoch' is unknown", id="an unknown time format is refused"),
        pytest.param({"days": 0}, "days must be more than 0", id="a window of zero days is refused"),
        pytest.param({"trace_from": date(2030, 1, 1), "days": 7}, "no job was submitted in [2030-01-01T00:00:00+00:00",
                     id="a window with no job is refused with the trace's span"),
        pytest.param({"trace_from": "next week"}, "'next week' is not an ISO 8601 date",
                     id="a window start that is not a date is refused"),
    ],
)
def test_bad_load_options_are_refused_with_what_to_do(tmp_path: Path, kwargs: dict, message: str) -> None:
    path = write_csv(tmp_path, "t,d,g\n0,5,1\n") if kwargs.get("time_format") else simple_trace(
        tmp_path, "2020-01-01 00:00:00,5,1,a")
    mapping = parse_columns("submit=t,duration=d,gpus=g") if kwargs.get("time_format") else SIMPLE
    with pytest.raises(TraceError) as caught:
        load_trace(path, mapping, **kwargs)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "the file is empty", id="an empty file is refused"),
        pytest.param("submitted,seconds,gpus,team\n", "has a header but no job rows", id="a header alone is refused"),
    ],
)
def test_a_trace_without_jobs_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = write_csv(tmp_path, text)
    with pytest.raises(TraceError, match=message):
        load_trace(path, SIMPLE)


def test_a_file_that_does_not_exist_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nowhere\.csv: cannot read the trace"):
        load_trace(tmp_path / "nowhere.csv", SIMPLE)


# Alibaba's 2023 GPU trace (cluster-trace-gpu-v2023/csv/openb_pod_list_*.csv): one row per pod, times in
# seconds from the trace's start, a pending pod's scheduled_time empty, CPU-only pods of 0 GPUs and shared
# GPUs as gpu_milli. These rows have its columns and its kinds of row; the values are made up.
OPENB = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
    "openb-pod-0001,6000,12288,1,460,,LS,Running,600,7800,600\n"              # 2: 0.46 of a GPU, 2 h
    "openb-pod-0002,88000,327680,8,1000,,Burstable,Succeeded,900,4560,960\n"  # 3: 8 GPUs, 1 h after a minute
    "openb-pod-0003,20000,65536,0,0,,LS,Running,1000,9000,1002\n"             # 4: CPU only
    "openb-pod-0004,11908,47104,1,1000,,BE,Pending,1200,1325,\n"              # 5: never scheduled
    "openb-pod-0005,3152,5600,1,1000,V100M16|V100M32,BE,Failed,1500,1700,1500\n"  # 6: ran 200 s, then failed
)
OPENB_COLUMNS = "submit=creation_time,start=scheduled_time,end=deletion_time,gpus=num_gpu,milli=gpu_milli"


def test_alibabas_2023_pod_list_loads_with_its_pending_and_cpu_pods_left_out(tmp_path: Path) -> None:
    origin = datetime(2023, 3, 1, tzinfo=UTC)
    trace = load_trace(write_csv(tmp_path, OPENB), parse_columns(OPENB_COLUMNS), time_format="seconds",
                       origin=origin, cpu_jobs="drop")
    jobs = list(trace.jobs())
    assert [j.line for j in jobs] == [2, 3, 6]
    assert [(j.gpus, j.milli) for j in jobs] == [(1, 460), (8, 1000), (1, 1000)]
    assert [j.duration_s for j in jobs] == [7200.0, 3600.0, 200.0]
    assert trace.start == origin + timedelta(seconds=600)
    assert ("1 job never started (column 'scheduled_time' is empty, 'Unknown' or 'None': pending, or cancelled "
            "before it started); dropped (lines 5).") in trace.report
    assert "1 row of 0 GPUs (CPU-only jobs) dropped (lines 4)." in trace.report
