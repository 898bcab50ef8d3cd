"""Slurm accounting dumps (``sacct --parsable2``) as job traces: GPUs and their model read from a TRES list,
job steps and jobs that never ran (or still run) left out and reported, and CPU-only rows an error unless
the user asks to drop them."""

from __future__ import annotations

import csv
import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from broker import cli
from broker.data.traces import (
    ColumnMapping,
    TraceError,
    load_trace,
    parse_columns,
    resolve_preset,
)
from broker.simulation.workload import WorkloadAssumptions, build_workload
from tests.test_sim_engine import _carbon, _site


def slurm() -> ColumnMapping:
    return resolve_preset("slurm")

HEADER = "JobID|User|Submit|Start|End|State|AllocTRES|Timelimit\n"

# What `sacct --parsable2 --format=JobID,User,Submit,Start,End,State,AllocTRES,Timelimit` writes without
# --allocations: the job rows, and rows for their steps (User and Timelimit empty, Submit = the step's start).
SACCT = HEADER + (
    "4101|ana|2024-03-04T09:00:00|2024-03-04T09:00:05|2024-03-04T11:00:05|COMPLETED|"
    "billing=8,cpu=8,gres/gpu=2,mem=64G,node=1|04:00:00\n"                                         # 2: 2 GPUs, 2 h
    "4101.batch||2024-03-04T09:00:05|2024-03-04T09:00:05|2024-03-04T11:00:05|COMPLETED|"
    "cpu=8,gres/gpu=2,mem=64G,node=1|\n"                                                           # 3: step
    "4101.extern||2024-03-04T09:00:05|2024-03-04T09:00:05|2024-03-04T11:00:05|COMPLETED|"
    "billing=8,cpu=8,gres/gpu=2,mem=64G,node=1|\n"                                                 # 4: step
    "4102|ben|2024-03-04T09:10:00|2024-03-04T09:12:00|2024-03-04T09:42:00|COMPLETED|"
    "billing=16,cpu=16,gres/gpu:a100=4,gres/gpu=4,mem=128G,node=1|1-00:00:00\n"                    # 5: 4 A100, typed + total
    "4103|ana|2024-03-04T09:15:00|2024-03-04T09:15:01|2024-03-04T09:20:01|COMPLETED|"
    "billing=4,cpu=4,mem=16G,node=1|30:00\n"                                                       # 6: CPU only
    "4104|cleo|2024-03-04T09:20:00|2024-03-04T09:20:00|2024-03-04T13:20:00|TIMEOUT|"
    "billing=32,cpu=32,gres/gpu:h100=8,mem=512G,node=1|04:00:00\n"                                 # 7: 8 H100, typed only
    "4105|ben|2024-03-04T09:30:00|Unknown|Unknown|PENDING||UNLIMITED\n"                             # 8: pending
    "4106|dan|2024-03-04T09:31:00|None|2024-03-04T09:35:00|CANCELLED by 1001||02:00:00\n"          # 9: cancelled first
    "4107|cleo|2024-03-04T09:40:00|2024-03-04T09:41:00|Unknown|RUNNING|"
    "billing=8,cpu=8,gres/gpu=1,mem=32G,node=1|Partition_Limit\n"                                  # 10: running
    "4108_2|eve|2024-03-04T09:50:00|2024-03-04T10:00:00|2024-03-04T10:10:00|FAILED|"
    "billing=4,cpu=4,gres/gpu:a100_80gb=1,gres/gpu=1,mem=32G,node=1|01:00:00\n"                    # 11: array task
    "4108_2.0||2024-03-04T10:00:01|2024-03-04T10:00:01|2024-03-04T10:10:00|FAILED|"
    "cpu=4,gres/gpu:a100_80gb=1,gres/gpu=1,mem=32G,node=1|\n"                                      # 12: step
    "4109|dan|2024-03-04T10:05:00|2024-03-04T10:06:00|2024-03-04T10:06:00|CANCELLED by 1002|"
    "billing=8,cpu=8,gres/gpu=1,mem=32G,node=1|02:00:00\n"                                         # 13: 0 s
    "4110|ana|2024-03-04T10:30:00|2024-03-04T10:31:00|2024-03-04T12:31:00|COMPLETED|"
    "billing=64,cpu=64,gres/gpu:a100=16,gres/gpu=16,mem=1T,node=2|08:00:00\n"                      # 14: 16 A100, 2 nodes
    "4111|fay|2024-03-04T10:40:00|2024-03-04T10:40:02|2024-03-04T10:50:02|COMPLETED|"
    "billing=2,cpu=2,mem=8G,node=1|00:30:00\n"                                                     # 15: CPU only
)


def sacct(tmp_path: Path, text: str = SACCT, name: str = "sacct.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def one_row(tmp_path: Path, tres: str) -> Path:
    return sacct(tmp_path, HEADER + f"7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|"
                                    f"COMPLETED|{tres}|01:00:00\n", name="one.txt")


def test_the_slurm_preset_reads_a_sacct_dump_with_cpu_jobs_dropped(tmp_path: Path) -> None:
    trace = load_trace(sacct(tmp_path), slurm(), cpu_jobs="drop")
    jobs = list(trace.jobs())
    assert [j.line for j in jobs] == [2, 5, 7, 11, 13, 14]
    assert [j.tenant for j in jobs] == ["ana", "ben", "cleo", "eve", "dan", "ana"]
    assert [j.gpus for j in jobs] == [2, 4, 8, 1, 1, 16]  # a typed and an untyped entry: each GPU once
    assert [j.model for j in jobs] == [None, "a100-40gb", "h100-80gb", "a100-80gb", None, "a100-40gb"]
    assert [j.duration_s for j in jobs] == [7200.0, 1800.0, 14400.0, 600.0, 1.0, 7200.0]  # end - start
    assert [j.milli for j in jobs] == [1000] * 6
    assert trace.start == datetime(2024, 3, 4, 9, 0, tzinfo=UTC)  # sacct's local times, read as UTC
    assert trace.report == [
        ("3 job step rows skipped (column 'JobID': ids such as 4101.batch, a part of the job on its own row, which "
         "holds the job's allocation; sacct --allocations writes no step rows) (lines 3, 4, 12)."),
        ("2 jobs never started (column 'Start' is empty, 'Unknown' or 'None': pending, or cancelled before it started); "
         "dropped (lines 8, 9)."),
        ("1 job had not ended (column 'End' is empty, 'Unknown' or 'None': still running when the file was written); "
         "dropped (lines 10)."),
        "2 rows of 0 GPUs (CPU-only jobs) dropped (lines 6, 15).",
        # time limits over run times: 4 h / 2 h, 1 d / 30 min, 4 h / 4 h, 1 h / 10 min, 2 h / 1 s, 8 h / 2 h
        "Run-time estimates read from column 'Timelimit' for 6 jobs (estimate / run time: median 5.00; 0% ran "
        "past theirs).",
        ("GPUs read from the TRES column 'AllocTRES': 4 jobs name a GPU type, read as its model (a100-40gb 2, "
         "a100-80gb 1, h100-80gb 1); 2 name none and run on any model."),
        "1 job of 0 s counted as 1 s (lines 13).",
    ]
    assert trace.estimate_s is not None
    assert trace.estimate_s.tolist() == [4 * 3600.0, 86400.0, 4 * 3600.0, 3600.0, 2 * 3600.0, 8 * 3600.0]


def test_a_dump_made_with_allocations_has_no_step_rows_to_report(tmp_path: Path) -> None:
    rows = [line for line in SACCT.splitlines(keepends=True) if "." not in line.split("|")[0]]
    trace = load_trace(sacct(tmp_path, "".join(rows)), slurm(), cpu_jobs="drop")
    assert len(trace) == 6
    assert not any("step" in note for note in trace.report), trace.report


def test_a_cpu_only_row_is_an_error_by_default_that_names_the_flag_that_drops_it(tmp_path: Path) -> None:
    path = sacct(tmp_path)
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    assert str(caught.value) == (
        f"{path}: line 6, column 'AllocTRES' (tres): 'billing=4,cpu=4,mem=16G,node=1' lists no GPUs; a job asks "
        "for at least one GPU (a CPU-only job: cpu_jobs='drop' (the CLI's --cpu-jobs drop) leaves rows of 0 GPUs "
        "out and reports how many)")


@pytest.mark.parametrize(
    ("tres", "message"),
    [
        pytest.param("cpu=8,gres/gpu=two,node=1", "'cpu=8,gres/gpu=two,node=1' gives gres/gpu the count 'two'; "
                     "expected a whole number of GPUs", id="a GPU count that is not a number names the entry"),
        pytest.param("cpu=8,gres/gpu=1.5", "gives gres/gpu the count '1.5'; expected a whole number",
                     id="a fractional GPU count is refused"),
        pytest.param("cpu=8;gres/gpu=2", "is not a Slurm TRES list (NAME=COUNT,...: e.g. cpu=8,gres/gpu=2,mem=64G)",
                     id="a cell that is not a TRES list is refused"),
        pytest.param("gres/gpu=2,gres/gpu=2", "lists gres/gpu twice", id="a total given twice is refused"),
        pytest.param("gres/gpu:=2", "lists 'gres/gpu:' without a GPU type", id="an empty GPU type is refused"),
    ],
)
def test_a_tres_that_cannot_be_read_names_the_line_and_column(tmp_path: Path, tres: str, message: str) -> None:
    path = one_row(tmp_path, tres)
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    assert str(caught.value).startswith(f"{path}: line 2, column 'AllocTRES' (tres): ")
    assert message in str(caught.value)


def test_a_bad_gpu_entry_names_its_first_line_and_cell_among_lists_that_differ_in_memory(tmp_path: Path) -> None:
    # Lists are read by their GPU entries: the first of the two bad ones in the file is named, with its own cell.
    rows = "".join(f"{7 + i}|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|{tres}|\n"
                   for i, tres in enumerate(["cpu=8,gres/gpu=2,mem=64G", "cpu=8,gres/gpu=2,mem=32G",
                                             "cpu=8,gres/gpu=two,mem=64G", "cpu=4,gres/gpu=two,mem=16G"]))
    path = sacct(tmp_path, HEADER + rows)
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    assert str(caught.value).startswith(f"{path}: line 4, column 'AllocTRES' (tres): 'cpu=8,gres/gpu=two,mem=64G' "
                                        "gives gres/gpu the count 'two'")
    good = sacct(tmp_path, HEADER + rows.replace("gres/gpu=two", "gres/gpu:a100=3"), name="good.txt")
    assert load_trace(good, slurm()).gpus.tolist() == [2, 2, 3, 3]


def test_entries_that_are_not_gpus_are_not_read_whatever_their_names(tmp_path: Path) -> None:
    # A remote license is accounted as license/NAME@SERVER; its '@' stopped the load of the whole dump.
    path = one_row(tmp_path, "billing=8,cpu=8,gres/gpu=2,license/matlab@flexlm=1,mem=64G,node=1")
    assert load_trace(path, slurm()).gpus.tolist() == [2]


def test_a_gpu_type_that_is_no_known_model_is_an_error_listing_the_models(tmp_path: Path) -> None:
    path = one_row(tmp_path, "cpu=8,gres/gpu:rtx2080ti=2,gres/gpu=2,node=1")
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    message = str(caught.value)
    assert message.startswith(f"{path}: line 2, column 'AllocTRES' (model): 'cpu=8,gres/gpu:rtx2080ti=2,gres/gpu=2,"
                              "node=1' names the GPU type 'rtx2080ti', which is no known GPU model; known models: "
                              "a100-40gb, a100-80gb, h100-80gb,")
    assert "without model" in message


def test_without_a_model_role_the_gpu_types_are_not_read_and_that_is_reported(tmp_path: Path) -> None:
    path = one_row(tmp_path, "cpu=8,gres/gpu:rtx2080ti=2,gres/gpu=2,node=1")
    trace = load_trace(path, parse_columns("submit=Submit,start=Start,end=End,tres=AllocTRES,tenant=User"))
    (job,) = trace.jobs()
    assert (job.gpus, job.model) == (2, None)
    assert ("1 job name a GPU type in the TRES column 'AllocTRES' (rtx2080ti), not read as their model: the "
            "mapping takes the model from no column (model=AllocTRES would read it).") in trace.report


def test_gpus_of_two_models_in_one_job_are_an_error_not_a_guess(tmp_path: Path) -> None:
    path = one_row(tmp_path, "cpu=16,gres/gpu:a100=2,gres/gpu:v100=2,gres/gpu=4,node=2")
    with pytest.raises(TraceError, match=r"line 2, column 'AllocTRES' \(model\): .* names GPUs of 2 models "
                                         r"\(a100-40gb, v100-16gb\)"):
        load_trace(path, slurm())


def test_a_total_unlike_its_typed_entries_is_used_and_reported(tmp_path: Path) -> None:
    trace = load_trace(one_row(tmp_path, "cpu=8,gres/gpu:a100=2,gres/gpu=4,node=1"), slurm())
    assert trace.gpus.tolist() == [4]
    assert any(n.startswith("1 job list a gres/gpu total unlike the sum of their typed gres/gpu:TYPE entries")
               and "(lines 2)" in n for n in trace.report), trace.report


# --- the role and the option, outside Slurm's preset ---------------------------------------------------------


def test_the_slurm_preset_prints_back_as_its_columns_text() -> None:
    assert str(resolve_preset("slurm")) == ("submit=Submit,start=Start,end=End,tres=AllocTRES,model=AllocTRES,"
                                            "tenant=User,estimate=Timelimit,job_id=JobID")
    assert parse_columns(str(resolve_preset("slurm"))) == resolve_preset("slurm")


@pytest.mark.parametrize(
    ("header", "rows", "mapping", "line", "column"),
    [
        pytest.param("t,d,n\n", ["2020-01-01 00:00:00,60,2", "2020-01-01 00:00:01,60,0"], "gpus=n", 3, "n",
                     id="a GPU count of 0 (a Helios-style CPU job)"),
        pytest.param("t,d,p\n", ["2020-01-01 00:00:00,60,50", "2020-01-01 00:00:01,60,0"], "gpu_percent=p", 3, "p",
                     id="a percentage of 0 (an Alibaba CPU task)"),
    ],
)
def test_rows_of_zero_gpus_are_an_error_naming_the_flag_or_dropped_and_counted(
        tmp_path: Path, header: str, rows: list[str], mapping: str, line: int, column: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(header + "".join(f"{r}\n" for r in rows))
    columns = parse_columns(f"submit=t,duration=d,{mapping}")
    with pytest.raises(TraceError) as caught:
        load_trace(path, columns)
    assert f"line {line}, column '{column}'" in str(caught.value)
    assert "(a CPU-only job: cpu_jobs='drop' (the CLI's --cpu-jobs drop)" in str(caught.value)
    trace = load_trace(path, columns, cpu_jobs="drop")
    assert len(trace) == 1
    assert f"1 row of 0 GPUs (CPU-only jobs) dropped (lines {line})." in trace.report


def test_a_negative_gpu_count_is_still_an_error_when_cpu_jobs_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t,d,n\n2020-01-01 00:00:00,60,-1\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path, parse_columns("submit=t,duration=d,gpus=n"), cpu_jobs="drop")
    assert str(caught.value).endswith("line 2, column 'n' (gpus): '-1' is less than 1; a job asks for at least one GPU")


def test_a_trace_of_cpu_jobs_alone_is_an_error_and_an_unknown_option_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t,d,n\n2020-01-01 00:00:00,60,0\n")
    columns = parse_columns("submit=t,duration=d,gpus=n")
    with pytest.raises(TraceError, match=r"no row asks for a GPU: 1 row of 0 GPUs \(CPU-only jobs\) dropped"):
        load_trace(path, columns, cpu_jobs="drop")
    with pytest.raises(TraceError, match=r"cpu_jobs='keep' is unknown; use 'error' or 'drop'"):
        load_trace(path, columns, cpu_jobs="keep")  # type: ignore[arg-type]


def test_duplicates_are_counted_among_the_rows_left_after_cpu_jobs_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t,d,n\n2020-01-01 00:00:00,60,0\n2020-01-01 00:00:00,60,0\n2020-01-01 00:00:00,60,1\n"
                    "2020-01-01 00:00:00,60,1\n")
    trace = load_trace(path, parse_columns("submit=t,duration=d,gpus=n"), cpu_jobs="drop", duplicates="drop")
    assert len(trace) == 1 and trace.line.tolist() == [4]
    assert ("1 row repeat an earlier row exactly (1 distinct row); dropped (the first copy is kept) (lines 5)."
            in trace.report), trace.report


def test_a_dump_of_jobs_that_never_ran_is_an_error_saying_why(tmp_path: Path) -> None:
    path = sacct(tmp_path, HEADER + "4105|ben|2024-03-04T09:30:00|Unknown|Unknown|PENDING||UNLIMITED\n")
    with pytest.raises(TraceError, match=r"no row is a job that ran: 1 job never started"):
        load_trace(path, slurm())


# --- heliotrope simulate --preset slurm ---------------------------------------------------------------------


@pytest.fixture
def slurm_run(tmp_path: Path) -> dict[str, Path]:
    carbon = _carbon(tmp_path / "carbon", {"GB": [100.0 + 10 * h for h in range(72)], "FR": [60.0] * 72})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0) + _site("b", "FR", "gcp:europe-west9", 1.0))
    trace = sacct(tmp_path, HEADER + (
        "9001|ana|2022-06-01T00:00:00|2022-06-01T00:00:10|2022-06-01T01:00:10|COMPLETED|"
        "billing=8,cpu=8,gres/gpu:a100_80gb=2,gres/gpu=2,mem=64G,node=1|02:00:00\n"
        "9001.batch||2022-06-01T00:00:10|2022-06-01T00:00:10|2022-06-01T01:00:10|COMPLETED|"
        "cpu=8,gres/gpu:a100_80gb=2,gres/gpu=2,mem=64G,node=1|\n"
        "9002|ben|2022-06-01T00:10:00|2022-06-01T00:10:00|2022-06-01T00:40:00|COMPLETED|"
        "billing=2,cpu=2,mem=8G,node=1|01:00:00\n"
        "9003|ben|2022-06-01T00:20:00|2022-06-01T00:21:00|2022-06-01T01:51:00|COMPLETED|"
        "billing=4,cpu=4,gres/gpu=1,mem=16G,node=1|04:00:00\n"
        "9004|cleo|2022-06-01T00:30:00|Unknown|Unknown|PENDING||UNLIMITED\n"
    ))
    return {"carbon": carbon, "sites": sites, "trace": trace, "tmp": tmp_path}


def _simulate(f: dict[str, Path], *more: str) -> list[str]:
    return ["simulate", "--trace", str(f["trace"]), "--preset", "slurm", "--carbon", str(f["carbon"]),
            "--sites", str(f["sites"]), "--policy", "baseline-spillover", "--no-bound", *more]


def test_simulate_replays_a_sacct_dump_with_cpu_jobs_dropped(slurm_run: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = slurm_run["tmp"] / "w"
    assert cli.main(_simulate(slurm_run, "--cpu-jobs", "drop", "--dump-workload", str(out))) == 0
    captured = capsys.readouterr()
    assert "baseline-spillover" in captured.out
    assert "note: trace: 1 row of 0 GPUs (CPU-only jobs) dropped (lines 4)." in captured.err
    assert "note: trace: 1 job step row skipped" in captured.err
    assert "note: trace: 1 job never started" in captured.err
    jobs = (out / "jobs.csv").read_text().splitlines()
    assert len(jobs) == 3  # the header and jobs 9001 and 9003


def test_simulate_without_cpu_jobs_drop_says_which_row_and_which_flag(slurm_run: dict[str, Path],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_simulate(slurm_run)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"heliotrope: {slurm_run['trace']}: line 4, column 'AllocTRES' (tres): ")
    assert "--cpu-jobs drop" in err


def test_simulate_refuses_an_unknown_cpu_jobs_value(slurm_run: dict[str, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(_simulate(slurm_run, "--cpu-jobs", "keep"))
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-jobs: invalid choice: 'keep'" in err and "Traceback" not in err


def test_simulate_quotas_takes_the_same_preset_and_cpu_jobs_flag(slurm_run: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate-quotas", "--trace", str(slurm_run["trace"]), "--preset", "slurm", "--modes", "off"]
    assert "--cpu-jobs drop" in _error(capsys, argv)
    assert cli.main([*argv, "--cpu-jobs", "drop"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1].split()[0] == "off"
    # what the load dropped is said, as simulate says it (it printed nothing before)
    assert "note: trace: 1 row of 0 GPUs (CPU-only jobs) dropped (lines 4)." in captured.err
    assert "note: trace: 1 job never started" in captured.err


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# --- run-time estimates: a time limit is what the submitter said ---------------------------------------------


@pytest.mark.parametrize(
    ("cell", "seconds"),
    [
        ("04:00:00", 4 * 3600.0),            # sacct's Timelimit, HH:MM:SS
        ("1-00:00:00", 86400.0),             # D-HH:MM:SS
        ("2-12", 2.5 * 86400.0),             # D-HH, as sbatch --time takes it
        ("2-12:30", 2.5 * 86400.0 + 1800.0),  # D-HH:MM
        ("30:00", 1800.0),                   # MM:SS: Slurm reads two fields as minutes and seconds
        ("5400", 5400.0),                    # a plain number is seconds, as every duration of a trace
        ("90.5", 90.5),
    ],
)
def test_an_estimate_cell_reads_as_seconds_in_each_form_slurm_writes(tmp_path: Path, cell: str,
                                                                        seconds: float) -> None:
    path = sacct(tmp_path, HEADER + f"7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|"
                                    f"COMPLETED|gres/gpu=1|{cell}\n")
    assert load_trace(path, slurm()).estimate_s.tolist() == [seconds]


def test_jobs_without_a_time_limit_of_their_own_are_counted_and_left_to_the_drawn_estimate(tmp_path: Path) -> None:
    cells = ["UNLIMITED", "Partition_Limit", "", "00:00:00", "0", "02:00:00"]
    rows = "".join(f"{7 + i}|ana|2024-03-04T09:0{i}:00|2024-03-04T09:0{i}:00|2024-03-04T10:00:00|COMPLETED|"
                   f"gres/gpu=1|{cell}\n" for i, cell in enumerate(cells))
    trace = load_trace(sacct(tmp_path, HEADER + rows), slurm())
    assert np.isnan(trace.estimate_s[:5]).all() and trace.estimate_s[5] == 7200.0  # 2 h for a run of 55 min
    assert ("Run-time estimates read from column 'Timelimit' for 1 job (estimate / run time: median 2.18; 0% ran "
            "past theirs); 5 give none (empty, UNLIMITED, Partition_Limit, NONE, INVALID or 0) and get a drawn "
            "estimate.") in trace.report
    invalid = sacct(tmp_path, HEADER + "7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|"
                                       "gres/gpu=1|INVALID\n", name="invalid.txt")
    assert ("Run-time estimates read from column 'Timelimit' for 0 jobs; 1 gives none (empty, UNLIMITED, "
            "Partition_Limit, NONE, INVALID or 0) and gets a drawn estimate.") in load_trace(invalid, slurm()).report


@pytest.mark.parametrize("cell", ["-5", "soon", "1:2:3:4", "inf", "1-"])
def test_an_estimate_that_is_no_time_names_the_line_and_the_column(tmp_path: Path, cell: str) -> None:
    path = sacct(tmp_path, HEADER + "7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|"
                                    "gres/gpu=1|01:00:00\n"
                                    f"8|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|"
                                    f"gres/gpu=1|{cell}\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    assert str(caught.value).startswith(f"{path}: line 3, column 'Timelimit' (estimate): {cell!r} is not a "
                                        "run-time estimate: give seconds, or a Slurm time")


@pytest.mark.parametrize("cell", ["9" * 400 + ":00", "9" * 400 + "-00", "9" * 5000 + ":00"])
def test_a_time_limit_too_large_for_a_number_names_the_line_not_a_traceback(tmp_path: Path, cell: str) -> None:
    path = sacct(tmp_path, HEADER + "7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|"
                                    f"gres/gpu=1|{cell}\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())
    assert str(caught.value).startswith(f"{path}: line 2, column 'Timelimit' (estimate): {cell!r} is too large")


def test_the_policies_see_the_time_limit_and_jobs_without_one_keep_their_draw(tmp_path: Path) -> None:
    rows = ("7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|gres/gpu=1|03:00:00\n"
            "8|ben|2024-03-04T09:05:00|2024-03-04T09:05:00|2024-03-04T09:35:00|COMPLETED|gres/gpu=2|UNLIMITED\n")
    path = sacct(tmp_path, HEADER + rows)
    assumptions = WorkloadAssumptions(origin_regions=("gcp:europe-west2",))
    with_limits = build_workload(load_trace(path, slurm()), assumptions)
    drawn = build_workload(load_trace(path, dataclasses.replace(slurm(), estimate=None)), assumptions)
    assert with_limits.job_spec(0).duration_s == 3 * 3600.0  # what the submitter wrote, not 1 h × noise
    assert with_limits.estimated_duration_s[1] == drawn.estimated_duration_s[1]  # no limit: the same draw
    assert with_limits.estimate_given.tolist() == [True, False]
    for name in ("deadline_s", "latency_slo_ms", "inflexible", "origin_region"):  # every other draw as it was
        np.testing.assert_array_equal(getattr(with_limits, name), getattr(drawn, name))
    assert any("(the trace's own for 1 job, drawn for 1)" in line for line in with_limits.report)
    assert any("Estimated / true duration (drawn)" in line for line in drawn.report)


# --- times: sacct writes the cluster's local clock ---------------------------------------------------------


def test_a_time_zone_places_local_times_on_utc_and_a_run_across_a_clock_change_keeps_its_length(
        tmp_path: Path) -> None:
    # New York's clocks went from 02:00 to 03:00 on 2024-03-10: 01:30 to 03:30 local is one hour of run.
    path = sacct(tmp_path, HEADER + (
        "7|ana|2024-03-04T09:00:00|2024-03-04T09:00:00|2024-03-04T11:00:00|COMPLETED|gres/gpu=1|04:00:00\n"
        "8|ana|2024-03-10T01:00:00|2024-03-10T01:30:00|2024-03-10T03:30:00|COMPLETED|gres/gpu=1|04:00:00\n"
        "9|ana|2024-07-01T12:00:00+00:00|2024-07-01T12:00:00+00:00|2024-07-01T13:00:00+00:00|COMPLETED|"
        "gres/gpu=1|04:00:00\n"))
    local = load_trace(path, slurm(), time_zone="America/New_York")
    jobs = list(local.jobs())
    assert local.start == datetime(2024, 3, 4, 14, 0, tzinfo=UTC)  # 09:00 EST
    assert jobs[1].submit == datetime(2024, 3, 10, 6, 0, tzinfo=UTC)
    assert [j.duration_s for j in jobs] == [7200.0, 3600.0, 3600.0]  # an offset in the cell is kept
    assert "Times without an offset read as wall-clock times in America/New_York." in local.report
    as_utc = list(load_trace(path, slurm()).jobs())
    assert as_utc[1].duration_s == 7200.0  # read as UTC, the skipped hour counts as run


def test_a_job_that_ends_in_the_hour_the_clocks_repeat_before_its_start_on_the_clock_loads_with_its_real_length(
        tmp_path: Path) -> None:
    # New York's clocks went back from 02:00 EDT to 01:00 EST on 2024-11-03: a job started at 01:50 EDT that
    # ran 20 minutes ended at 01:10 EST, which sacct writes as 01:10, ten minutes "before" its start.
    path = sacct(tmp_path, HEADER + (
        "7|ana|2024-11-03T01:40:00|2024-11-03T01:50:00|2024-11-03T01:10:00|COMPLETED|gres/gpu=1|04:00:00\n"
        "8|ana|2024-11-03T01:20:00|2024-11-03T01:30:00|2024-11-03T01:45:00|COMPLETED|gres/gpu=1|04:00:00\n"
        # submitted 01:55 EDT, started 01:05 EST (after 70 minutes in the queue), ended 03:00 EST: 1 h 55 min
        "9|ana|2024-11-03T01:55:00|2024-11-03T01:05:00|2024-11-03T03:00:00|COMPLETED|gres/gpu=1|04:00:00\n"))
    trace = load_trace(path, slurm(), time_zone="America/New_York")
    assert [(j.submit, j.duration_s) for j in trace.jobs()] == [
        (datetime(2024, 11, 3, 5, 20, tzinfo=UTC), 900.0),  # both ends in the first 01:xx, as the rule reads
        (datetime(2024, 11, 3, 5, 40, tzinfo=UTC), 20 * 60.0),
        (datetime(2024, 11, 3, 5, 55, tzinfo=UTC), 115 * 60.0)]
    assert ("1 job ends before its start on the clock, in the hour the change of the clock in America/New_York "
            "repeats; its end reads with the offset after the change (line 2).") in trace.report
    assert ("1 job starts before its submit on the clock, in the hour the change of the clock in America/New_York "
            "repeats; its start reads with the offset after the change (line 4).") in trace.report
    assert not any("start before submission" in note for note in trace.report)
    with pytest.raises(TraceError) as caught:
        load_trace(path, slurm())  # as UTC there is no second 01:10: the error says what to give
    assert str(caught.value) == (
        f"{path}: line 2, column 'End' (end): '2024-11-03T01:10:00' is before the start (column 'Start'); if the "
        "trace's times are local times without an offset (as sacct writes them), a job that ran across the change of "
        "the clock that repeats an hour ends before its start on the clock: give their time zone (time_zone=, the "
        "CLI's --trace-timezone)")


def test_a_local_time_past_the_year_9999_names_the_line_as_it_does_without_a_time_zone(tmp_path: Path) -> None:
    path = sacct(tmp_path, HEADER + "7|ana|10000-01-01T00:00:00|2024-03-04T09:00:00|2024-03-04T10:00:00|COMPLETED|"
                                    "gres/gpu=1|01:00:00\n")
    for zone in (None, "America/New_York"):
        with pytest.raises(TraceError, match="line 2, column 'Submit' .*is not a time between 1970-01-01 and 9000"):
            load_trace(path, slurm(), time_zone=zone)


def test_an_unknown_time_zone_or_one_with_seconds_is_refused(tmp_path: Path) -> None:
    for name in ("Mars/Olympus", "US", "Europe"):  # (the last two are folders of zones, not zones)
        with pytest.raises(TraceError, match=f"time zone '{name}' is unknown; give an IANA name"):
            load_trace(sacct(tmp_path), slurm(), time_zone=name)
    with pytest.raises(TraceError, match="a time zone applies only to time format 'iso'"):
        load_trace(sacct(tmp_path), slurm(), time_format="seconds", origin=datetime(2024, 1, 1, tzinfo=UTC),
                   time_zone="UTC")


def test_simulate_takes_the_time_limits_and_the_clusters_time_zone(slurm_run: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = slurm_run["tmp"] / "w"
    argv = _simulate(slurm_run, "--cpu-jobs", "drop", "--trace-timezone", "America/Sao_Paulo", "--dump-workload",
                     str(out))
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "note: trace: Run-time estimates read from column 'Timelimit' for 2 jobs" in err
    assert "note: trace: Times without an offset read as wall-clock times in America/Sao_Paulo." in err
    with (out / "jobs.csv").open() as f:
        jobs = list(csv.DictReader(f))
    assert [float(j["estimated_duration_s"]) for j in jobs] == [7200.0, 4 * 3600.0]
    assert jobs[0]["submit_utc"].startswith("2022-06-01T03:00:00")  # midnight in São Paulo (UTC-3)


def test_both_simulators_name_the_flag_of_an_unknown_time_zone(slurm_run: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, _simulate(slurm_run, "--cpu-jobs", "drop", "--trace-timezone", "Europe/Atlantis"))
    assert err.startswith("heliotrope: --trace-timezone: time zone 'Europe/Atlantis' is unknown")
    quotas = ["simulate-quotas", "--trace", str(slurm_run["trace"]), "--preset", "slurm", "--modes", "off",
              "--cpu-jobs", "drop"]
    assert _error(capsys, [*quotas, "--trace-timezone", "Europe/Atlantis"]).startswith("heliotrope: --trace-timezone")
    assert cli.main([*quotas, "--trace-timezone", "Europe/London"]) == 0


def test_a_time_zone_given_for_times_that_all_carry_an_offset_is_said_to_be_unneeded(tmp_path: Path) -> None:
    path = sacct(tmp_path, HEADER + "7|ana|2024-07-01T12:00:00+02:00|2024-07-01T12:00:00+02:00|"
                                    "2024-07-01T13:00:00+02:00|COMPLETED|gres/gpu=1|04:00:00\n")
    trace = load_trace(path, slurm(), time_zone="America/New_York")
    assert trace.start == datetime(2024, 7, 1, 10, 0, tzinfo=UTC)
    assert "Every time carries its own offset; the time zone America/New_York was not needed." in trace.report


def test_start_moves_the_trace_to_another_day_and_keeps_each_jobs_hour_of_the_day(slurm_run: dict[str, Path],
                                                                                   capsys: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    # The first job was submitted at midnight in São Paulo, 03:00 UTC: moved to 2022-06-02, it is submitted at
    # 03:00 UTC there too, where the carbon data's hours of the day are the trace's (it used to land at 00:00).
    out = slurm_run["tmp"] / "w"
    argv = _simulate(slurm_run, "--cpu-jobs", "drop", "--trace-timezone", "America/Sao_Paulo", "--start", "2022-06-02",
                     "--dump-workload", str(out))
    assert cli.main(argv) == 0
    capsys.readouterr()
    with (out / "jobs.csv").open() as f:
        submits = [j["submit_utc"] for j in csv.DictReader(f)]
    assert submits[0].startswith("2022-06-02T03:00:00") and submits[1].startswith("2022-06-02T03:20:00")


def test_a_dump_written_without_time_limits_loads_with_the_preset_and_says_so(tmp_path: Path) -> None:
    header = HEADER.replace("|Timelimit", "")
    rows = "".join("|".join(line.split("|")[:-1]) + "\n" for line in SACCT.splitlines()[1:])
    trace = load_trace(sacct(tmp_path, header + rows), slurm(), cpu_jobs="drop")
    assert len(trace) == 6 and trace.estimate_s is None
    assert trace.report[0] == "The header has no column 'Timelimit': estimate not read."
    with pytest.raises(TraceError, match="the header has no column 'Timelimit'"):  # asked for by name, it must be there
        load_trace(sacct(tmp_path, header + rows), parse_columns(str(slurm())), cpu_jobs="drop")


def test_simulate_quotas_does_not_read_time_limits(slurm_run: dict[str, Path], capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    # A site replays run times: a time limit it cannot read does not stop it, and no note speaks of estimates.
    text = slurm_run["trace"].read_text().replace("|04:00:00\n", "|soon\n")
    slurm_run["trace"].write_text(text)
    argv = ["simulate-quotas", "--trace", str(slurm_run["trace"]), "--preset", "slurm", "--modes", "off",
            "--cpu-jobs", "drop"]
    assert cli.main(argv) == 0
    assert "estimate" not in capsys.readouterr().err
