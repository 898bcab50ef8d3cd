"""``heliotrope simulate`` from the command line: its outputs, and a clear one-line error for bad input."""

from __future__ import annotations

import argparse
import csv
import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from broker import cli
from broker.simulation import cli as sim_cli
from broker.simulation.fairshare import MODES
from tests.test_sim_engine import _carbon, _site


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    carbon = _carbon(tmp_path / "carbon", {"GB": [100.0 + 10 * h for h in range(72)], "FR": [60.0] * 72})
    sites = tmp_path / "sites.yaml"
    sites.write_text("sites:\n" + _site("a", "GB", "gcp:europe-west2", 2.0) + _site("b", "FR", "gcp:europe-west9", 1.0))
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,seconds,gpus,team,due\n"
                     "2022-06-01T00:00:00,3600,2,x,2022-06-01T06:00:00\n"
                     "2022-06-01T00:10:00,5400,1,y,2022-06-01T08:00:00\n"
                     "2022-06-01T00:30:00,3600,2,x,2022-06-01T09:00:00\n")
    return {"carbon": carbon, "sites": sites, "trace": trace, "tmp": tmp_path}


def _args(f: dict[str, Path], *more: str, columns: str = "submit=submit,duration=seconds,gpus=gpus,tenant=team") -> list[str]:
    return ["simulate", "--trace", str(f["trace"]), "--columns", columns, "--carbon", str(f["carbon"]),
            "--sites", str(f["sites"]), *more]


def test_compare_writes_table_json_report_and_workload(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = files["tmp"] / "out"
    code = cli.main(_args(files, "--compare", "all", "--json", str(out / "r.json"), "--report", str(out / "html"),
                          "--dump-workload", str(out / "w")))
    assert code == 0
    table = capsys.readouterr().out
    for name in ("baseline-round-robin", "baseline-least-loaded", "baseline-cheapest-first", "baseline-spillover",
                 "baseline-carbon-greedy", "offline bound"):
        assert name in table
    assert "whole-job bound" in table and "vs whole-job" in table
    doc = json.loads((out / "r.json").read_text())
    assert set(doc) >= {"policies", "offline_bound", "whole_job_bound"}
    whole = doc["whole_job_bound"]["carbon_kg"]
    # the whole-job bound starts from the fluid LP's prices, so it is at least about as high
    assert whole >= doc["offline_bound"]["carbon_kg"] * (1 - 1e-6)
    for m in doc["policies"].values():
        assert {"carbon_kg", "cost_usd", "energy_kwh", "jobs", "deadline_misses", "wait_p95_s", "jain_fairness",
                "utilisation", "gap_to_bound", "gap_to_whole_job_bound"} <= set(m)
        assert m["jobs"] == 3
        assert m["gap_to_bound"] >= 0
        assert m["carbon_kg"] >= m["whole_job_bound_carbon_kg"] - 1e-9 and m["gap_to_whole_job_bound"] >= 0
        assert m["whole_job_bound_carbon_kg"] <= whole + 1e-9  # a run's own windows are at least as wide
    assert (out / "html" / "index.html").exists()
    jobs = (out / "w" / "jobs.csv").read_text().splitlines()
    assert len(jobs) == 4 and "deadline" in jobs[0]
    assert json.loads((out / "w" / "sites.json").read_text())[0]["grid_zone"] in ("GB", "FR")


def test_whole_job_steps_reach_the_search(files: dict[str, Path]) -> None:
    out = files["tmp"] / "r.json"
    assert cli.main(_args(files, "--policy", "green", "--whole-job-steps", "0", "--json", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["whole_job_bound"]["iterations"] == 0  # the offline LP's prices alone
    assert doc["whole_job_bound"]["carbon_kg"] >= doc["offline_bound"]["carbon_kg"] * (1 - 1e-6)
    assert cli.main(_args(files, "--policy", "green", "--no-bound", "--json", str(out))) == 0
    assert json.loads(out.read_text())["whole_job_bound"] is None


def test_checkpointable_jobs_are_drawn_when_asked_and_written_out(files: dict[str, Path]) -> None:
    out = files["tmp"] / "out"
    assert cli.main(_args(files, "--policy", "green", "--dump-workload", str(out / "none"))) == 0
    assert cli.main(_args(files, "--policy", "green", "--checkpointable", "1", "--restart-s", "60",
                          "--dump-workload", str(out / "all"))) == 0
    rows = {name: list(csv.DictReader((out / name / "jobs.csv").open())) for name in ("none", "all")}
    assert [r["checkpointable"] for r in rows["none"]] == ["false"] * 3
    flexible = [datetime.fromisoformat(r["deadline_utc"]) > datetime.fromisoformat(r["submit_utc"])
                + timedelta(seconds=float(r["true_duration_s"])) for r in rows["all"]]
    assert [r["checkpointable"] == "true" for r in rows["all"]] == flexible and any(flexible)


def test_inflexible_jobs_ask_to_start_at_once_unless_left_undeclared(files: dict[str, Path]) -> None:
    # Forty jobs: the drawn inflexible ones (deadline = submit + run) say so (deferrable false) unless
    # --inflexible-undeclared; a trace's own deadlines say nothing of it.
    files["trace"].write_text("submit,seconds,gpus,team,due\n" + "".join(
        f"2022-06-01T{i // 4:02d}:{15 * (i % 4):02d}:00,1800,1,x,2022-06-02T12:00:00\n" for i in range(40)))
    out = files["tmp"] / "w"
    assert cli.main(_args(files, "--policy", "green", "--dump-workload", str(out / "declared"))) == 0
    assert cli.main(_args(files, "--policy", "green", "--inflexible-undeclared", "--dump-workload",
                          str(out / "undeclared"))) == 0
    assert cli.main(_args(files, "--policy", "green", "--dump-workload", str(out / "trace"),
                          columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,deadline=due")) == 0
    rows = {name: list(csv.DictReader((out / name / "jobs.csv").open())) for name in ("declared", "undeclared",
                                                                                      "trace")}
    rigid = [datetime.fromisoformat(r["deadline_utc"]) == datetime.fromisoformat(r["submit_utc"])
             + timedelta(seconds=float(r["true_duration_s"])) for r in rows["declared"]]
    assert any(rigid) and not all(rigid)
    assert [r["deferrable"] == "false" for r in rows["declared"]] == rigid
    assert {r["deferrable"] for r in rows["undeclared"]} == {r["deferrable"] for r in rows["trace"]} == {"true"}


def test_trace_deadlines_are_used(files: dict[str, Path]) -> None:
    out = files["tmp"] / "r.json"
    code = cli.main(_args(files, "--policy", "baseline-spillover", "--json", str(out), "--dump-workload",
                          str(files["tmp"] / "w"),
                          columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,deadline=due"))
    assert code == 0
    rows = (files["tmp"] / "w" / "jobs.csv").read_text().splitlines()
    assert "2022-06-01T06:00:00Z" in rows[1]


def test_sites_that_list_no_rtt_from_their_own_region_still_take_its_latency_bound_jobs(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A broker config lists the RTTs measured from other regions (config/demo.yaml), not a site's own; the
    # workload draws origins from the sites' regions, so a latency-bound job from one used to fit no site.
    files["sites"].write_text("sites:\n" + "".join(
        _site(n, z, r, 1.0).replace(f"rtt_ms: {{'{r}': 1.0}}", "rtt_ms: {}")
        for n, z, r in (("a", "GB", "gcp:europe-west2"), ("b", "FR", "gcp:europe-west9"))))
    files["trace"].write_text("submit,seconds,gpus,team\n" + "".join(
        f"2022-06-01T{i // 4:02d}:{15 * (i % 4):02d}:00,1800,1,t{i % 5}\n" for i in range(40)))
    out = files["tmp"] / "r.json"
    assert cli.main(_args(files, "--policy", "baseline-least-loaded", "--no-bound", "--json", str(out),
                          "--dump-workload", str(files["tmp"] / "w"))) == 0
    rows = list(csv.DictReader((files["tmp"] / "w" / "jobs.csv").open()))
    assert any(r["latency_slo_ms"] for r in rows)  # the draw gave some jobs an objective
    doc = json.loads(out.read_text())
    assert doc["left_out"] == 0 and doc["policies"]["baseline-least-loaded"]["jobs"] == 40
    assert doc["policies"]["baseline-least-loaded"]["latency_violations"] == 0
    assert "note: sites: a, b list no RTT from their own region" in capsys.readouterr().err


def test_zones_outside_the_default_table_run_once_zone_regions_names_their_regions(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # Carbon data for a zone the default federation's table lacks, and one whose folder is lower case with a
    # dash: the table's error used to point at a Python argument the command line had no way to give.
    carbon = _carbon(files["tmp"] / "other", {"PL": [700.0 - h for h in range(72)], "se-se3": [30.0] * 72})
    argv = ["simulate", "--trace", str(files["trace"]), "--columns", "submit=submit,duration=seconds,gpus=gpus",
            "--carbon", str(carbon), "--policy", "baseline-carbon-greedy", "--no-bound"]
    err = _error(capsys, argv)
    assert "grid zone PL, SE-SE3 has no cloud region" in err and "--zone-regions PL=" in err
    assert len(err.strip().splitlines()) == 1
    out = files["tmp"] / "w"
    assert cli.main([*argv, "--zone-regions", "pl=gcp:europe-central2, SE-SE3=gcp:europe-north1",
                     "--dump-workload", str(out)]) == 0
    sites = {s["grid_zone"]: s["region"] for s in json.loads((out / "sites.json").read_text())}
    assert sites == {"PL": "gcp:europe-central2", "SE-SE3": "gcp:europe-north1"}
    assert "note: sites: zone PL: mapped to gcp:europe-central2" in capsys.readouterr().err
    assert "is not ZONE=REGION" in _error(capsys, [*argv, "--zone-regions", "PL"])
    assert "default federation only" in _error(capsys, [*argv, "--zone-regions", "PL=gcp:europe-central2",
                                                        "--sites", str(files["sites"])])


def _models_run(files: dict[str, Path]) -> tuple[Path, list[str]]:
    """A trace file (to be written) with a model column, and the simulate command line that replays it over
    the default federation of two zones."""
    carbon = _carbon(files["tmp"] / "gb", {"GB": [100.0 + h for h in range(72)], "DE-LU": [300.0] * 72})
    trace = files["tmp"] / "models.csv"
    return trace, ["simulate", "--trace", str(trace), "--columns",
                   "submit=submit,duration=seconds,gpus=gpus,model=model", "--carbon", str(carbon),
                   "--policy", "baseline-carbon-greedy", "--no-bound"]


def test_the_default_federations_gpu_model_is_chosen_with_site_model(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A trace of H100 jobs (or a price table without A100s) had no way to the default federation, which was
    # A100 80GB only: every job was left out, and only a --sites file could help.
    trace, argv = _models_run(files)
    trace.write_text("submit,seconds,gpus,model\n2022-06-01T00:00:00,3600,2,H100 80GB\n"
                     "2022-06-01T00:10:00,5400,1,h100-80gb\n")
    out = files["tmp"] / "w"
    assert cli.main([*argv, "--site-model", "NVIDIA H100 80GB HBM3", "--dump-workload", str(out)]) == 0
    assert {m for s in json.loads((out / "sites.json").read_text()) for m in s["capacity_gpus"]} == {"h100-80gb"}
    assert cli.main([*argv, "--site-model", "a100-80gb"]) == 1  # every job asks for a model no site has
    assert "h100-80gb, which no site has" in capsys.readouterr().err
    assert "unknown GPU model 'h1000'" in _error(capsys, [*argv, "--site-model", "h1000"])
    assert "default federation only" in _error(capsys, [*argv, "--site-model", "h100-80gb", "--sites",
                                                        str(files["sites"])])


def test_the_default_sites_are_of_the_one_model_the_traces_jobs_name(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A Slurm dump of one cluster's H100 jobs (gres/gpu:h100) left every job out on the default A100 sites, with
    # no job to replay; where every job that names a model names one, the default sites are of that model.
    trace, argv = _models_run(files)
    trace.write_text("submit,seconds,gpus,model\n2022-06-01T00:00:00,3600,2,H100 80GB\n"
                     "2022-06-01T00:10:00,5400,1,\n2022-06-01T00:20:00,600,1,h100-80gb\n")
    out = files["tmp"] / "w"
    argv = [*argv, "--dump-workload", str(out)]
    assert cli.main(argv) == 0
    assert ("note: sites: every job of the trace that names a GPU model names h100-80gb, so the default sites "
            "are h100-80gb (--site-model chooses another)") in capsys.readouterr().err
    assert {m for s in json.loads((out / "sites.json").read_text()) for m in s["capacity_gpus"]} == {"h100-80gb"}
    # one model the price list does not price: the default sites stay a100-80gb, and the note says why
    trace.write_text("submit,seconds,gpus,model\n2022-06-01T00:00:00,3600,2,v100-32gb\n")
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "names v100-32gb, which the price list does not price on demand, so the default sites are a100-80gb" in err
    assert "jobs ask for v100-32gb, which no site has" in err and "Traceback" not in err
    # jobs of two models: the default sites stay a100-80gb, and both kinds are left out, as the note says
    trace.write_text("submit,seconds,gpus,model\n2022-06-01T00:00:00,3600,2,h100-80gb\n"
                     "2022-06-01T00:10:00,5400,1,l4\n")
    assert cli.main(argv) == 1
    assert "jobs ask for h100-80gb, l4, which no site has: the sites have a100-80gb" in capsys.readouterr().err


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_missing_column_names_the_column(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, _args(files, "--policy", "baseline-spillover",
                               columns="submit=submit,duration=runtime,gpus=gpus"))
    assert "runtime" in err and "trace.csv" in err


def test_zone_without_data_names_the_zone(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    files["sites"].write_text(files["sites"].read_text() + _site("c", "JP-TK", "gcp:asia-northeast1", 3.0))
    err = _error(capsys, _args(files, "--policy", "baseline-spillover"))
    assert "JP-TK" in err


def test_deadline_before_submit_names_the_row(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    text = files["trace"].read_text().replace("2022-06-01T09:00:00", "2022-05-31T23:00:00")
    files["trace"].write_text(text)
    err = _error(capsys, _args(files, "--policy", "baseline-spillover",
                               columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,deadline=due"))
    assert "line 4" in err and "deadline" in err and "before the submit" in err


def test_start_outside_the_carbon_data(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, _args(files, "--policy", "baseline-spillover", "--start", "2023-01-01"))
    assert "--start" in err and "GB" in err


@pytest.mark.parametrize("flags, words", [
    (("--policy", "fastest"), "unknown policy fastest"),
    (("--compare", "all", "--utilisation", "0"), "--utilisation"),
    (("--compare", "all", "--days", "-2"), "--days"),
    (("--compare", "all", "--trace-from", "yesterday"), "--trace-from"),
    (("--compare", "all", "--checkpointable", "1.5"), "--checkpointable 1.5: give a share of jobs within [0, 1]"),
    (("--compare", "all", "--restart-s", "-1"), "--restart-s -1.0: give seconds"),
    (("--compare", "all", "--whole-job-steps", "-1"), "--whole-job-steps -1: give a whole number"),
    (("--compare", "all", "--trace-from", "9999-12-31", "--days", "1"), "ends after the last date there is"),
    (("--compare", "all", "--latency", "/no/such.csv"), "--latency /no/such.csv: no such file"),
    (("--compare", "all", "--time-format", "seconds", "--trace-timezone", "Europe/London"),
     "--trace-timezone: applies to ISO times (--time-format iso) only"),
    (("--compare", "all", "--origin", "2022-06-01T00:00:00+00:00"), "--origin: applies to --time-format seconds only"),
    (("--compare", "all", "--days", "36550"), "--days 36550.0: give a number of days above 0 and at most 36,525"),
    (("--compare", "all", "--trace-from", "9999-12-31T23:00:00-05:00"), "--trace-from '9999-12-31T23:00:00-05:00': "
                                                                         "is after the last date there is"),
    (("--compare", "all", "--start", "0001-01-01T00:00:00+01:00"), "--start '0001-01-01T00:00:00+01:00': "
                                                                   "is before the first date there is"),
])
def test_bad_flags(files: dict[str, Path], capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], words: str) -> None:
    assert words in _error(capsys, _args(files, *flags))


def test_an_output_that_cannot_be_written_is_named_before_the_run(files: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    blocker = files["tmp"] / "a-file"
    blocker.write_text("not a folder")
    err = _error(capsys, _args(files, "--policy", "green", "--json", str(blocker / "out.json")))
    assert err.startswith(f"heliotrope: --json {blocker / 'out.json'}: cannot make the folder {blocker}")
    err = _error(capsys, _args(files, "--policy", "green", "--dump-workload", str(blocker)))
    assert "--dump-workload" in err and "cannot make the folder" in err
    err = _error(capsys, _args(files, "--policy", "green", "--json", str(files["tmp"])))
    assert "--json" in err and "is a folder" in err


def test_a_trace_no_site_can_run_is_an_error_not_a_table_of_zeros(files: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files["trace"].write_text("submit,seconds,gpus,team\n2022-06-01T00:00:00,3600,100000,x\n")
    err = _error(capsys, _args(files, "--policy", "green"))
    assert "no job to replay" in err and "100000 GPUs" in err


def test_a_trace_asking_for_a_gpu_model_no_site_has_says_so(files: dict[str, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # It said only "the largest asks 1 GPUs", which is not why no site fits the job.
    files["trace"].write_text("submit,seconds,gpus,team,m\n2022-06-01T00:00:00,3600,1,x,h100\n")
    err = _error(capsys, _args(files, "--policy", "green",
                               columns="submit=submit,duration=seconds,gpus=gpus,tenant=team,model=m"))
    assert "no job to replay" in err and "jobs ask for h100-80gb, which no site has: the sites have " in err


@pytest.mark.parametrize("row, words", [
    ("2022-06-01T00:00:00,1e12,2,x", "column 'seconds' (duration): '1e12' ends the job after 9000-01-01"),
    ("2022-06-01T00:00:00,3600,2,x", None),
])
def test_a_trace_time_no_date_can_hold_names_its_line(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                       row: str, words: str | None) -> None:
    files["trace"].write_text("submit,seconds,gpus,team\n" + row + "\n")
    if words is None:
        assert cli.main(_args(files, "--policy", "baseline-spillover")) == 0
        return
    err = _error(capsys, _args(files, "--policy", "baseline-spillover"))
    assert "line 2" in err and words in err


def test_a_file_that_is_not_text_is_named_with_its_flag(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    binary = files["tmp"] / "prices.csv"
    binary.write_bytes(b"\xff\xfe\x00")
    err = _error(capsys, _args(files, "--policy", "green", "--prices", str(binary)))
    assert f"--prices {binary}: not UTF-8 text" in err


@pytest.mark.parametrize("flag, value, words", [
    ("--window-h", "0", "--window-h 0: Input should be greater than 0"),
    ("--k", "-1", "--k -1: Input should be greater than or equal to 0"),
    ("--utilisation", "1e-9", "give a larger utilisation"),
    ("--days", "36550", "--days 36550.0: give a number of days above 0 and at most 36,525"),
    ("--trace-from", "9999-12-31T23:00:00-05:00", "--trace-from '9999-12-31T23:00:00-05:00': is after the last date"),
    ("--reweight-h", "0.001", "--reweight-h 0.001: 0.001 h divides window_h (24 h) into 24,000 periods"),
    # these three were named in the words of fairshare.compare ("guaranteed fraction 2.0"), not by their flags
    ("--guaranteed-fraction", "2", "heliotrope: --guaranteed-fraction 2: give a fraction from 0 to 1"),
    ("--max-refusals", "0", "heliotrope: --max-refusals 0: give 1 or more"),
    ("--starvation-h", "-1", "heliotrope: --starvation-h -1: give 0 (no guard) or more hours"),
    ("--cycle-s", "1e-9", "heliotrope: --cycle-s 1e-09: give 1 s or more"),  # (it replayed for ever)
])
def test_simulate_quotas_names_the_flag_of_a_setting_out_of_range(files: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  flag: str, value: str, words: str) -> None:
    err = _error(capsys, ["simulate-quotas", "--trace", str(files["trace"]), "--columns",
                          "submit=submit,duration=seconds,gpus=gpus,tenant=team", flag, value])
    assert words in err


def test_a_mode_or_policy_named_twice_is_replayed_and_shown_once(files: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # simulate-quotas --modes time,fifo,time printed two rows for time and wrote one (the JSON is keyed by mode);
    # simulate --compare green,green replayed green twice to show it once.
    out = files["tmp"] / "q.json"
    assert cli.main(["simulate-quotas", "--trace", str(files["trace"]), "--columns",
                     "submit=submit,duration=seconds,gpus=gpus,tenant=team", "--modes", "time,fifo,time",
                     "--json", str(out)]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line.split()[0] in MODES]
    assert rows == ["time", "fifo"] == list(json.loads(out.read_text())["modes"])
    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    spec = sim_cli.spec_from(parser.parse_args(_args(files, "--compare", "green, cheap,green")))
    assert list(spec.policies) == ["green", "cheap"]


def test_simulate_quotas_names_both_flags_when_only_their_pair_is_out_of_range(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # Each alone is fine against the other's default; together the window holds 21,600 periods. The run used to
    # load the trace and then stop with pydantic's own text, naming no flag.
    err = _error(capsys, ["simulate-quotas", "--trace", str(files["trace"]), "--columns",
                          "submit=submit,duration=seconds,gpus=gpus,tenant=team", "--window-h", "2160",
                          "--reweight-h", "0.1"])
    assert err.startswith("heliotrope: --window-h 2160 with --reweight-h 0.1: 0.1 h divides window_h "
                          "(2160 h) into 21,600 periods, more than 10,000; recompute less often (reweight_h at least "
                          "0.216 h)")


def test_what_the_run_assumed_about_its_inputs_is_on_stderr_not_only_in_the_json(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A job larger than any site is left out of every policy's run: the table alone would not say so.
    with files["trace"].open("a") as fh:
        fh.write("2022-06-01T00:40:00,3600,64,z,2022-06-01T09:00:00\n")
    out = files["tmp"] / "r.json"
    assert cli.main(_args(files, "--policy", "baseline-spillover", "--json", str(out))) == 0
    err = capsys.readouterr().err
    left_out = [line for line in err.splitlines() if line.startswith("note: left out: 1 jobs")]
    assert len(left_out) == 1, err
    assert "largest asks 64 GPUs; " in left_out[0] and " of them have a latency objective" in left_out[0]
    # every line of the JSON's report is on stderr, once
    report = json.loads(out.read_text())["report"]
    assert report and all(err.count(f"note: {line}\n") == 1 for line in report)
