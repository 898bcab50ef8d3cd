"""The ``heliotrope`` command against a real server process: tables, --json, and errors as messages."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from broker import cli
from broker.cli import main
from broker.models import QuotaState, TenantQuotaState
from tests.conftest import ROOT, TWO_SITES, free_port

pytestmark = pytest.mark.slow


def run(capsys, server, *args: str) -> tuple[int, str, str]:
    code = main(["--server", server.url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def submit_file(tmp_path: Path, **spec) -> Path:
    body = {"tenant": "t1", "name": "cli-job", "gpus": {"count": 1}, "duration_s": 60} | spec
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def wait_for_state(capsys, server, job_id: str, state: str, within_s: float = 10.0) -> None:
    """Poll ``heliotrope job ID`` until the job is in ``state`` (fails if it is not within ``within_s``)."""
    deadline = time.monotonic() + within_s
    while (seen := json.loads(run(capsys, server, "--json", "job", job_id)[1])["state"]) != state:
        assert time.monotonic() < deadline, f"job {job_id} is {seen}, not {state}, after {within_s:g} s"
        time.sleep(0.05)


def test_submit_then_list_show_explain_and_cancel_a_job(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=600)))
    assert code == 0
    job_id = json.loads(out)["id"]

    wait_for_state(capsys, server, job_id, "running")

    code, out, _ = run(capsys, server, "jobs")
    assert code == 0
    header, row = out.splitlines()[:2]
    assert header.split()[:5] == ["ID", "TENANT", "NAME", "GPUS", "STATE"]
    assert row.split()[:5] == [job_id, "t1", "cli-job", "1", "running"]
    assert row.endswith(" UTC")  # the time says its zone: a bare one reads as the reader's own

    code, out, _ = run(capsys, server, "explain", job_id)
    assert code == 0
    assert "placed on alpha" in out
    assert "free_gpus raw 8" in out  # alpha had 8 free a100-80gb when it was chosen
    assert "beta" in out

    code, out, _ = run(capsys, server, "job", job_id)
    assert f"job {job_id}  t1/cli-job" in out and "running on alpha" in out

    code, out, _ = run(capsys, server, "cancel", job_id)
    assert code == 0 and out.strip() == f"job {job_id} cancelled"


def test_logs_prints_what_the_job_printed_as_is_and_says_when_the_start_was_left_out(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=0.3)))
    job_id = json.loads(out)["id"]
    wait_for_state(capsys, server, job_id, "succeeded")
    code, out, err = run(capsys, server, "logs", job_id)
    assert code == 0 and err == ""
    lines = out.split("\n")
    assert f"attempt 1 of job {job_id} (tenant t1) started on" in lines[0]
    assert "attempt 1 succeeded after" in lines[-2] and lines[-1] == ""  # as the site wrote it: no newline added
    code, out, err = run(capsys, server, "logs", job_id, "--tail", "1", "--attempt", "1")
    assert code == 0 and out.count("\n") == 1 and "succeeded" in out
    assert "the start of the log was left out (attempt 1 at site alpha); --tail N shows more lines" in err
    code, out, _ = run(capsys, server, "logs", job_id, "--json")
    doc = json.loads(out)
    assert (doc["site"], doc["attempt"], doc["truncated"]) == ("alpha", 1, False) and "succeeded" in doc["text"]


def follow(server, job_id: str, *flags: str) -> subprocess.Popen:
    """``heliotrope logs ID -f`` in a process of its own, its output read as it comes."""
    return subprocess.Popen([sys.executable, "-m", "broker.cli", "--server", server.url, "logs", job_id, *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_logs_follow_prints_each_line_as_the_job_prints_it_and_exits_0_when_it_ends(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=4)))
    job_id = json.loads(out)["id"]
    wait_for_state(capsys, server, job_id, "running")
    proc = follow(server, job_id, "--follow", "--tail", "1")
    try:
        first = proc.stdout.readline()
        # printed while the job still runs: the command streams, it does not wait for the end
        assert json.loads(run(capsys, server, "--json", "job", job_id)[1])["state"] == "running"
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "started on" in first or " progress " in first
    assert rest.splitlines()[-1].endswith("attempt 1 succeeded after 4 s") and " progress 90%" in rest
    assert "the start of the log was left out (attempt 1 at site alpha)" in err  # (--tail 1 of more lines)


def test_logs_follow_stops_quietly_at_ctrl_c(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=600)))
    job_id = json.loads(out)["id"]
    wait_for_state(capsys, server, job_id, "running")
    proc = follow(server, job_id, "-f")
    try:
        assert "started on" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == ""
    code, out, err = run(capsys, server, "logs", job_id, "-f", "--json")
    assert code == 1 and "--json gives the log whole, --follow as it is written; use one of them" in err


class _CutShort(http.server.BaseHTTPRequestHandler):
    """A broker whose followed log breaks off while the attempt runs (its site stopped answering): a line, then the
    connection closed before the answer's last chunk."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        for name, value in (("Content-Type", "text/plain; charset=utf-8"), ("Transfer-Encoding", "chunked"),
                            ("X-Heliotrope-Site", "alpha"), ("X-Heliotrope-Attempt", "1"),
                            ("X-Heliotrope-Log-Truncated", "false")):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(b"8\r\nepoch 1\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        """Quiet: http.server would write every request to stderr, which the CLI's checks read."""


def test_logs_follow_cut_short_by_the_broker_says_so_and_exits_1(capsys):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", "logs", "j-1", "-f"])
    finally:
        srv.shutdown()
        srv.server_close()
    out, err = capsys.readouterr()
    assert out == "epoch 1\n" and code == 1 and "Traceback" not in err
    assert "the broker broke off the log before the attempt ended" in err and "run the command again" in err


@pytest.mark.parametrize(("args", "message"), [
    pytest.param(("logs", "nope"), "no job with id nope", id="the logs of an unknown job"),
    pytest.param(("logs", "JOB", "--attempt", "5"), "attempt 5 of job JOB never reached a site; the attempts that "
                 "did: 1", id="the logs of an attempt that never reached a site"),
])
def test_logs_errors_are_one_line_messages(capsys, server, tmp_path, args, message):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=600)))
    job_id = json.loads(out)["id"]
    wait_for_state(capsys, server, job_id, "running")
    code, out, err = run(capsys, server, *(a.replace("JOB", job_id) for a in args))
    assert code == 1 and out == ""
    assert message.replace("JOB", job_id) in err and "Traceback" not in err and err.count("\n") == 1


def test_submit_dry_run_shows_where_the_job_would_go_and_submits_nothing(capsys, server, tmp_path):
    code, out, err = run(capsys, server, "submit", "--dry-run", str(submit_file(tmp_path, name="dry")))
    assert code == 0, err
    assert out.startswith("would be decided so at ") and "placed on alpha" in out and "beta" in out
    assert out.splitlines()[0].endswith(", with no queued job decided before it")
    assert "(dry run: what the broker would decide for this job now" in out
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert "dry" not in [j["name"] for j in json.loads(out)]  # nothing was submitted
    code, out, _ = run(capsys, server, "--json", "submit", "--dry-run", str(submit_file(tmp_path, gpus={"count": 64})))
    assert code == 0 and json.loads(out)["decision"]["outcome"] == "unplaceable"


def test_submit_dry_run_of_a_sweep_decides_its_jobs_together_in_the_files_order(capsys, server, tmp_path):
    """A sweep of two jobs that each fit alpha's 8 free A100s alone but not together: the second is shown waiting,
    as it would if the file were submitted (one after another, in its order), not placed on the same GPUs; a job
    of higher priority later in the file comes first in the queue, as it would."""
    path = tmp_path / "sweep.yaml"
    spec = {"tenant": "t1", "gpus": {"count": 8, "model": "a100-80gb"}, "duration_s": 600}
    path.write_text(yaml.safe_dump([{**spec, "name": "lr-1"}, {**spec, "name": "lr-2"}]))
    code, out, err = run(capsys, server, "submit", "--dry-run", str(path))
    assert code == 0, err
    first, second = out.split("\n\nwould be decided so at ")
    assert first.splitlines()[0].endswith(", with no queued job decided before it") and "placed on alpha" in first
    assert second.splitlines()[0].endswith(", after 1 job of this file the next pass would decide before it")
    assert "placed on" not in second and "gpus-do-not-fit" in second
    assert "(dry run: what the broker would decide for these jobs now, were they submitted together" in out
    path.write_text(yaml.safe_dump([{**spec, "name": "lr-1"}, {**spec, "name": "lr-2", "priority": 10}]))
    code, out, _ = run(capsys, server, "--json", "submit", "--dry-run", str(path))
    assert [(p["decision"]["outcome"], p["listed_ahead"]) for p in json.loads(out)] == [
        ("unplaceable", 1), ("placed", 0)]
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert json.loads(out) == []  # nothing was submitted


def test_submit_dry_run_of_a_sweep_larger_than_one_preview_takes_previews_each_job_alone_and_says_so(
        capsys, server, tmp_path):
    """A sweep of more jobs than one preview decides together (1,000), which ``submit`` queues all the same: the dry
    run previews each alone, as it did before lists were previewed together, and says so, rather than failing."""
    path = tmp_path / "sweep.yaml"
    spec = {"tenant": "t1", "gpus": {"count": 1}, "duration_s": 600}
    path.write_text(yaml.safe_dump([{**spec, "name": f"lr-{i}"} for i in range(1001)]))
    code, out, err = run(capsys, server, "submit", "--dry-run", str(path))
    assert code == 0, err
    assert out.count("would be decided so at ") == 1001
    assert "more jobs than one preview decides together" in out and "each was previewed alone" in out
    # fewer, but over the broker's limit on a request's bytes (1 MiB) together: a 413, then each alone as well
    labels = {f"k{n}": "v" * 100 for n in range(60)}
    path.write_text(yaml.safe_dump([{**spec, "name": f"lr-{i}", "labels": labels} for i in range(200)]))
    code, out, err = run(capsys, server, "submit", "--dry-run", str(path))
    assert code == 0, err
    assert out.count("would be decided so at ") == 200 and "each was previewed alone" in out
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert json.loads(out) == []  # nothing was submitted


class _EarlierBroker(http.server.BaseHTTPRequestHandler):
    """A broker of an earlier release: ``POST /v1/preview`` takes one spec, and refuses a list as pydantic does."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if isinstance(doc, list):
            problem = {"field": "(body)", "problem": "Input should be an object"}
            status, answer = 422, {"error": {"status": 422, "message": "invalid job spec: (body): Input should be an "
                                             "object", "fields": [problem]}}
        else:
            decision = {"job_id": "preview", "attempt": 0, "decided_at": "2026-01-01T00:00:00Z", "outcome": "placed",
                        "site": "alpha", "summary": f"placed on alpha ({doc['name']})", "sites": []}
            status, answer = 200, {"note": "what the broker would decide", "decision": decision, "ahead": 0}
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet, as _NotABroker."""


def test_submit_dry_run_of_a_sweep_against_an_earlier_broker_previews_each_job_alone_and_says_so(capsys, tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EarlierBroker)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    path = tmp_path / "sweep.yaml"
    spec = {"tenant": "t1", "gpus": {"count": 8}, "duration_s": 600}
    path.write_text(yaml.safe_dump([{**spec, "name": "lr-1"}, {**spec, "name": "lr-2"}]))
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", "submit", "--dry-run", str(path)])
    finally:
        srv.shutdown()
        srv.server_close()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "placed on alpha (lr-1)" in out and "placed on alpha (lr-2)" in out
    assert "This broker previews each job alone: together they may need more room than each was shown" in out


def test_update_changes_a_queued_jobs_priority_and_refuses_what_cannot_change(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, name="waits",
                                                                          gpus={"count": 64})))
    job_id = json.loads(out)["id"]
    code, out, err = run(capsys, server, "--json", "update", job_id, "--priority", "7", "--deadline", "none")
    assert code == 0, err
    assert json.loads(out)["spec"]["priority"] == 7
    code, out, err = run(capsys, server, "update", job_id)
    assert code != 0 and "give --priority, --deadline or --profile" in err
    code, out, err = run(capsys, server, "update", job_id, "--deadline", "2020-01-01T00:00:00Z")
    assert code != 0 and "deadline" in err and "Traceback" not in err
    run(capsys, server, "cancel", job_id)


def test_tenants_shows_what_each_tenant_holds_against_its_limit_and_a_job_past_it_waits(capsys, server_factory,
                                                                                         tmp_path):
    """A broker started with ``broker.tenant_limits`` (from its YAML file): t1 may hold 2 GPUs across the federation;
    its second 2-GPU job waits with the limit for a reason, and ``heliotrope tenants`` shows both tenants."""
    srv = server_factory({**TWO_SITES, "broker": {**TWO_SITES["broker"], "tenant_limits": {"t1": {"gpus": 2}}}})
    srv.start()

    def submit(**spec) -> str:
        code, out, err = run(capsys, srv, "--json", "submit", str(submit_file(tmp_path, **spec)))
        assert code == 0, err
        return json.loads(out)["id"]

    first = submit(name="a", gpus={"count": 2}, duration_s=600)
    second = submit(name="b", gpus={"count": 2}, duration_s=600)
    third = submit(tenant="t2", name="c", gpus={"count": 1}, duration_s=600)
    for _ in range(200):  # (until t2's job is on its site too: the tenants' table counts it there)
        states = [json.loads(run(capsys, srv, "--json", "job", i)[1])["state"] for i in (first, second, third)]
        if states[0] == states[2] == "running":
            break
        time.sleep(0.05)
    assert states == ["running", "queued", "running"]
    for _ in range(100):  # (its decision is stored once the pass that made it has written it)
        code, out, err = run(capsys, srv, "explain", second)
        if code == 0:
            break
        time.sleep(0.05)
    assert code == 0 and "tenant-limit: tenant t1 holds 2 GPUs across the federation and may hold at most 2" in out
    code, out, err = run(capsys, srv, "tenants")
    assert code == 0, err
    assert [line.split() for line in out.splitlines()] == [
        ["TENANT", "GPUS", "LIMIT", "QUEUED", "ON_SITES", "LIMIT_SOURCE"], ["t1", "2", "2", "1", "1", "config"],
        ["t2", "1", "-", "0", "1", "default"]]
    code, out, err = run(capsys, srv, "--json", "tenants", "--tenant", "t2")
    assert code == 0 and [t["tenant"] for t in json.loads(out)] == ["t2"]
    code, out, err = run(capsys, srv, "submit", str(submit_file(tmp_path, name="big", gpus={"count": 3})))
    assert code == 1 and "tenant t1 may hold at most 2 across the federation" in err and "Traceback" not in err


def test_tenant_limit_sets_a_limit_live_lifts_it_resets_it_and_says_what_is_wrong_in_one_line(capsys, server_factory):
    """``heliotrope tenant-limit``: the tenant's row after each change (its limit, and where it comes from); a
    mistake, the CLI's or one the broker refuses, is one line on standard error and status 1."""
    srv = server_factory({**TWO_SITES, "broker": {**TWO_SITES["broker"], "tenant_limits": {"t1": {"gpus": 2}}}})
    srv.start()
    header = ["TENANT", "GPUS", "LIMIT", "QUEUED", "ON_SITES", "LIMIT_SOURCE"]
    code, out, err = run(capsys, srv, "tenant-limit", "t1", "5")
    assert code == 0, err
    assert [line.split() for line in out.splitlines()] == [header, ["t1", "0", "5", "0", "0", "override"]]
    code, out, err = run(capsys, srv, "tenants", "--tenant", "t1")
    assert code == 0 and out.splitlines()[1].split() == ["t1", "0", "5", "0", "0", "override"], err
    code, out, err = run(capsys, srv, "tenant-limit", "t1", "none")
    assert code == 0 and out.splitlines()[1].split() == ["t1", "0", "-", "0", "0", "override"], err
    code, out, err = run(capsys, srv, "--json", "tenant-limit", "t1", "--reset")
    assert code == 0 and json.loads(out) == {"tenant": "t1", "gpus_held": 0.0, "jobs": {}, "gpus_limit": 2.0,
                                             "limit_source": "config"}, err
    for args, words in (
        (["t1"], "give GPUS"),
        (["t1", "lots"], "GPUS must be a number of GPUs"),
        (["t1", "-3"], "GPUS must be a number of GPUs"),
        (["t1", "inf"], "GPUS must be a number of GPUs"),
        (["t1", "4", "--reset"], "not both"),
        (["t1", "10000001"], "gpus"),  # (past MAX_TENANT_LIMIT_GPUS, 10,000,000)
        (["Bad_Name", "4"], "tenant"),
        (["t1", "--reset"], "no limit set through the API"),  # (reset above: nothing left to reset)
    ):
        code, out, err = run(capsys, srv, "tenant-limit", *args)
        assert code == 1 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    code, out, err = run(capsys, srv, "tenants", "--tenant", "t1")
    assert out.splitlines()[1].split() == ["t1", "0", "2", "0", "0", "config"], err


def test_jobs_are_listed_by_label_and_a_sweep_is_cancelled_at_once_after_a_dry_run(capsys, server, tmp_path):
    def submit(**spec) -> str:
        code, out, err = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, **spec)))
        assert code == 0, err
        return json.loads(out)["id"]

    sweep = [submit(name=f"lr-{i}", labels={"sweep.id": "lr", "lr": f"0.{i}"}, duration_s=600) for i in range(3)]
    done = submit(name="done", labels={"sweep.id": "lr"}, duration_s=0.05)
    other = submit(name="other", labels={"sweep.id": "batch"}, duration_s=600)
    for _ in range(200):
        code, out, _ = run(capsys, server, "--json", "job", done)
        if json.loads(out)["state"] == "succeeded":
            break
        time.sleep(0.05)
    assert json.loads(out)["state"] == "succeeded"

    code, out, _ = run(capsys, server, "--json", "jobs", "--label", "sweep.id=lr", "--label", "lr")
    assert code == 0 and [j["id"] for j in json.loads(out)] == sweep[::-1]
    code, out, _ = run(capsys, server, "jobs", "--label", "lr=0.1")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [sweep[1]]

    code, out, err = run(capsys, server, "cancel", "--tenant", "t1", "--label", "sweep.id=lr", "--dry-run")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[1:4]] == sweep[::-1]  # not the finished one
    assert out.rstrip().endswith("(dry run: 3 jobs would be cancelled; nothing was)")
    code, out, _ = run(capsys, server, "--json", "jobs", "--label", "sweep.id=lr", "--state", "cancelled")
    assert json.loads(out) == []

    code, out, err = run(capsys, server, "cancel", "--tenant", "t1", "--label", "sweep.id=lr", "--reason", "bad lr")
    assert code == 0 and out.strip() == "3 jobs cancelled, 0 skipped", err
    code, out, _ = run(capsys, server, "--json", "jobs", "--label", "sweep.id")
    states = {j["id"]: (j["state"], j["reason"]) for j in json.loads(out)}
    assert {i: states[i] for i in sweep} == {i: ("cancelled", "cancelled by request: bad lr") for i in sweep}
    assert states[done][0] == "succeeded" and states[other][0] in ("queued", "dispatching", "admitted", "running")

    code, out, err = run(capsys, server, "cancel", other, sweep[0])  # several ids, as one by one
    assert code == 1 and f"job {sweep[0]} is already cancelled" in err and f"were cancelled: {other}" in err
    code, out, _ = run(capsys, server, "--json", "job", other)
    assert json.loads(out)["state"] == "cancelled"


class _JsonAnswers(http.server.BaseHTTPRequestHandler):
    """A fake broker's handler: ``_send`` answers 200 with a JSON document; quiet, as _NotABroker."""

    def _send(self, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet."""


class _ScopedBroker(_JsonAnswers):
    """A broker as a token of role ``WHO`` sees it: ``GET /v1/whoami`` says who, every listing holds one job."""

    WHO: dict = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        job = {"id": "01jobjobjobjobjobj", "state": "queued", "site": None, "attempt": 0,
               "created_at": "2026-11-30T10:00:00Z", "updated_at": "2026-11-30T10:00:00Z",
               "spec": {"tenant": "t1", "name": "n", "gpus": {"count": 1, "milli": 1000}}}
        self._send(self.WHO if self.path == "/v1/whoami" else {"items": [job], "next": None})


@pytest.mark.parametrize("who, args, words", [
    ({"name": "ops-a", "role": "operator", "tenants": [], "sites": ["a"]}, ("--label", "sweep=1"),
     "ops-a is a token of role operator, and only admins and submitters cancel jobs"),
    ({"name": "alice", "role": "submitter", "tenants": ["t2"], "sites": []}, ("--tenant", "t1"),
     "alice acts for tenants t2, not t1"),
    ({"name": "bob", "role": "submitter", "tenants": ["t1"], "sites": []}, ("--tenant", "t1"), None),
])
def test_a_dry_run_of_a_cancel_the_broker_would_refuse_says_so_rather_than_list_jobs(capsys, who, args, words):
    """An operator may read the jobs on its sites a cancel would match, but its cancel is refused (403), as is a
    submitter's for another tenant: the dry run listed them as "would be cancelled" all the same."""
    handler = type("Scoped", (_ScopedBroker,), {"WHO": who})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", "cancel", *args, "--dry-run"])
    finally:
        srv.shutdown()
    out, err = capsys.readouterr()
    if words is None:
        assert code == 0 and "(dry run: 1 job would be cancelled; nothing was)" in out, err
    else:
        assert code == 1 and f"a cancel would be refused: {words}" in err and out == "" and "Traceback" not in err


def test_a_cancel_by_a_label_and_its_key_alone_cancels_what_the_dry_run_lists(capsys, server, tmp_path):
    """``--label lr=0.1 --label lr`` means lr=0.1 (as the listing reads it), whatever the order: not every job
    carrying lr, with any value."""
    ids = {}
    for lr in ("0.1", "0.2"):
        code, out, err = run(capsys, server, "--json", "submit",
                             str(submit_file(tmp_path, name=f"lr-{lr[-1]}", labels={"lr": lr}, duration_s=600)))
        assert code == 0, err
        ids[lr] = json.loads(out)["id"]
    selector = ("--tenant", "t1", "--label", "lr=0.1", "--label", "lr")
    code, out, err = run(capsys, server, "--json", "cancel", *selector, "--dry-run")
    assert code == 0 and [j["id"] for j in json.loads(out)] == [ids["0.1"]], err
    code, out, err = run(capsys, server, "--json", "cancel", *selector)
    assert code == 0 and json.loads(out)["cancelled"] == [ids["0.1"]], err
    code, out, _ = run(capsys, server, "--json", "job", ids["0.2"])
    assert json.loads(out)["state"] != "cancelled"


@pytest.mark.parametrize("args, message", [
    (("cancel", "some-id", "--tenant", "t1"), "give job ids or --tenant/--label, not both (got ids and --tenant)"),
    (("cancel", "some-id", "--dry-run"), "not both (got ids and --dry-run)"),
    (("cancel",), "give job ids, or --tenant and/or --label"),
    (("cancel", "--state", "queued", "--site", "alpha"), "give job ids, or --tenant and/or --label"),
    (("cancel", "--label", "sweep=a", "--label", "sweep=b"), "--label sweep is given 2 values (a, b)"),
    (("cancel", "--tenant", "t1", "--state", "succeeded", "--dry-run"),
     "--state 'succeeded' is not one a job can still leave; give one of queued, dispatching"),
], ids=["ids and a selector", "ids and a dry run", "nothing to cancel", "a state and a site alone (every job)",
        "one label key with two values (the last one alone would be cancelled)",
        "a dry run in a final state (it listed finished jobs as if they would be cancelled)"])
def test_cancel_takes_ids_or_a_selector_and_says_so_as_a_usage_error(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        main(["--server", "http://127.0.0.1:9", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("state,attempt,run_s,started,finished,shown", [
    ("running", 1, 0.0, "2026-11-26T16:25:40Z", None, "running since 2026-11-26T16:25:40Z"),
    ("running", 2, 600.0, "2026-11-26T16:25:40Z", None, "running, 600 s run by earlier attempts"),
    ("cancelled", 1, 0.0, "2026-11-26T16:25:40Z", "2026-11-26T16:25:53.5Z", "13.5 s run"),
    ("succeeded", 1, 120.0, "2026-11-26T16:25:40Z", "2026-11-26T16:27:40Z", "120 s run"),
    # to a tenth of a second, as the README shows it: ":g" printed "41.5508 s run", and a long run as "1.2096e+06"
    ("cancelled", 1, 0.0, "2026-11-26T16:25:40Z", "2026-11-26T16:26:21.550800Z", "41.6 s run"),
    ("succeeded", 1, 1209600.0, "2026-11-12T16:25:40Z", "2026-11-26T16:25:40Z", "1209600 s run"),
    ("queued", 0, 0.0, None, None, "0 s run"),
])
def test_a_job_shows_how_long_it_has_run_while_it_runs_and_once_cancelled(state, attempt, run_s, started, finished,
                                                                           shown):
    """run_s counts attempts that ended: a running job, or one cancelled while it ran, showed "0 s run"."""
    job = {"id": "j1", "spec": {"tenant": "t1", "name": "n", "gpus": {"count": 1, "milli": 1000}, "duration_s": 120,
                                "max_attempts": 3, "priority": 0},
           "state": state, "site": "ashburn" if started else None, "reason": None, "attempt": attempt,
           "failed_attempts": 0, "run_s": run_s, "started_at": started, "finished_at": finished,
           "created_at": "2026-11-26T16:25:35Z", "updated_at": "2026-11-26T16:25:53.5Z"}
    assert f"  duration  120 s expected, {shown}\n" in cli.show_job(job)


def test_update_help_says_what_profile_none_means(capsys):
    """The help ended mid-phrase: "its new routing profile, or none for the federation's"."""
    with pytest.raises(SystemExit):
        main(["update", "--help"])
    assert "or none for the federation's default" in " ".join(capsys.readouterr().out.split())


def test_sites_are_added_listed_shown_and_removed(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "sites", "add", str(ROOT / "config" / "site-example.yaml"))
    assert code == 0 and "singapore" in out
    code, out, _ = run(capsys, server, "sites", "list")
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert names == ["alpha", "beta", "singapore"]
    assert "l4 8/8" in out  # "NVIDIA L4" in the file was canonicalised
    code, out, _ = run(capsys, server, "sites", "get", "singapore")
    assert yaml.safe_load(out)["grid_zone"] == "SG"
    # What `sites get` printed, sent back whole: its status and signals are the broker's, named as such (not
    # as misspellings), and nothing is sent.
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    code, _, err = run(capsys, server, "sites", "add", str(shown))
    assert code == 1 and "nothing was sent" in err and "spelling" not in err
    assert "site: status: the site's last report, which is the broker's: leave it out of a spec" in err
    assert "site: signals: what routing reads of the site now, which is the broker's" in err
    code, out, _ = run(capsys, server, "sites", "remove", "singapore")
    assert code == 0 and out.strip() == "site singapore removed"


def test_a_remote_site_on_a_broker_without_mqtt_is_refused_with_the_setting_to_fix(capsys, server):
    code, _, err = run(capsys, server, "sites", "add", str(ROOT / "config" / "remote-site-example.yaml"))
    assert code == 1 and "set broker.mqtt" in err
    code, out, _ = run(capsys, server, "sites", "list")
    assert "lab" not in [line.split()[0] for line in out.splitlines()[1:]]  # nothing half-registered


def test_the_agent_takes_its_log_level_in_any_case_and_names_the_levels_it_knows(capsys, tmp_path):
    bad = tmp_path / "site.yaml"
    bad.write_text("site: {name: lab}\nheartbeat_s: 0\n")
    assert main(["agent", "--config", str(bad), "--log-level", "debug"]) == 2  # the config's error, not the level's
    assert "heartbeat_s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["agent", "--config", str(bad), "--log-level", "loud"])
    assert "DEBUG" in capsys.readouterr().err


def test_the_agent_command_with_a_bad_config_is_a_one_line_message(capsys, tmp_path):
    bad = tmp_path / "site.yaml"
    bad.write_text("site: {name: lab}\nheartbeat_s: 0\n")
    assert main(["agent", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and all(line.startswith("heliotrope agent: ") or ": " in line for line in err)
    assert "heartbeat_s" in "\n".join(err) and "Traceback" not in "\n".join(err)


def agent_yaml(adapter: str, mqtt: str) -> str:
    """An agent config for site lab (one node of A100s), with ``adapter`` and more ``mqtt`` settings if given."""
    return ("site: {name: lab, region: gcp:us-east1, grid_zone: US-MIDA-PJM, timezone: America/New_York, "
            "latitude: 33.2, longitude: -80.0, gpus: [{model: a100-80gb, gpus_per_node: 8, nodes: 1}]"
            + (f", {adapter}" if adapter else "") + "}\n"
            + f"mqtt: {{host: 127.0.0.1, port: {free_port()}" + (f", {mqtt}" if mqtt else "") + "}\n")


@pytest.mark.parametrize("kubeconfig", ["missing", "empty", "a-folder"])
def test_an_agent_whose_site_cannot_start_says_why_in_one_line(capsys, tmp_path, kubeconfig):
    path = tmp_path / kubeconfig
    if kubeconfig == "empty":
        path.write_text("")
    elif kubeconfig == "a-folder":
        path.mkdir()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(agent_yaml(f"adapter: {{kind: kubernetes, kubeconfig: '{path}'}}", ""))
    assert main(["agent", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "heliotrope agent: site lab (kubernetes adapter) could not start: " in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("job", "nope"), "no job with id nope", id="an unknown job id is a message"),
        pytest.param(("cancel", "nope"), "no job with id nope", id="cancelling an unknown job is a message"),
        pytest.param(("sites", "get", "nowhere"), "no site named nowhere", id="an unknown site is a message"),
        pytest.param(("submit", "/does/not/exist.yaml"), "cannot read", id="a missing file is a message"),
        pytest.param(("jobs", "--tenant", ""), "tenant is empty",
                     id="an empty tenant filter (an unset variable) is refused, not dropped to list every job"),
        pytest.param(("watch", "--tenant", ""), "tenant is empty",
                     id="an empty filter on the stream is refused, not a stream that never shows an event"),
    ],
)
def test_errors_are_one_line_messages_not_tracebacks(capsys, server, args, message):
    code, out, err = run(capsys, server, *args)
    assert code == 1
    assert message in err and "Traceback" not in err
    assert out == ""


def test_an_empty_file_or_an_empty_list_is_an_error_not_a_command_that_did_nothing(capsys, server, tmp_path):
    """`submit` of `[]` printed "(none)" and `submit --dry-run` of it a blank line, both with status 0, so an empty
    sweep (its generator wrote nothing) passed for one sent; an empty file got pydantic's "Input should be a valid
    dictionary or instance of JobSpec"."""
    (tmp_path / "empty-list.yaml").write_text("[]\n")
    (tmp_path / "empty.yaml").write_text("")
    for args, words in [(("submit", "empty-list.yaml"), "an empty list: nothing to send; give at least one job spec"),
                        (("submit", "--dry-run", "empty-list.yaml"), "an empty list: nothing to send"),
                        (("sites", "add", "empty-list.yaml"),
                         "an empty list: nothing to send; give at least one site spec"),
                        (("submit", "empty.yaml"), "empty: write a job spec, or a list of them"),
                        (("sites", "add", "empty.yaml"), "empty: write a site spec")]:
        code, out, err = run(capsys, server, *args[:-1], str(tmp_path / args[-1]))
        assert (code, out) == (1, ""), (args, code, out, err)
        assert f"{tmp_path / args[-1]}: {words}" in err and "JobSpec" not in err, (args, err)
    assert json.loads(run(capsys, server, "--json", "jobs")[1]) == []


def test_an_invalid_job_file_names_every_bad_field(capsys, server, tmp_path):
    path = submit_file(tmp_path, gpus={"count": -2, "model": "a1000"})
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1
    assert "gpus.count: Input should be greater than or equal to 1" in err
    assert "gpus.model: unknown GPU model 'a1000'" in err


def test_a_broker_that_is_not_running_is_a_clear_message(capsys):
    code = main(["--server", f"http://127.0.0.1:{free_port()}", "jobs"])
    _, err = capsys.readouterr()
    assert code == 1
    assert "cannot reach the broker" in err and "heliotrope serve" in err


def test_serve_with_a_broken_config_prints_the_field_and_exits_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sites:\n  - name: x\n    region: gcp:us-east1\n    grid_zone: DE\n    timezone: Mars/Olympus\n"
                   "    latitude: 0\n    longitude: 0\n    gpus: [{model: a100, gpus_per_node: 8, nodes: 1}]\n")
    proc = subprocess.run([sys.executable, "-m", "broker.cli", "serve", "--config", str(bad), "--db",
                           str(tmp_path / "x.db"), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert f"{bad}: sites[0].timezone: 'Mars/Olympus' is not an IANA time zone" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, env, words", [
    (["--port", "99999"], {}, "--port 99999: Input should be less than or equal to 65535"),
    (["--db", "mysql://u:secret@db/x"], {}, "--db mysql://u@db/x: mysql://u@db/x is not a database heliotrope "
                                           "can use: a URL must start with postgresql://"),
    ([], {"HELIOTROPE_BROKER__DB": "postgresq://u:secret@db.example/h"},
     "postgresq://u@db.example/h is not a database heliotrope can use"),
    (["--db", "postgress://u@db?password=secret"], {},  # no database path: the password is in the query alone
     "postgress://u@db?password=*** is not a database heliotrope can use"),
    (["--db", "postgress://u:secret?x@db/h"], {},  # a ? in the password, unencoded: the user's part ends at the @
     "postgress://u@db/h is not a database heliotrope can use"),
])
def test_serve_checks_its_flags_and_database_url_and_exits_1_at_once(tmp_path, flags, env, words):
    # A mistyped URL would otherwise become an SQLite file of that name, and a bad port a hang.
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(f"broker: {{db: {tmp_path / 'ok.db'}, port: {free_port()}}}\n")
    proc = subprocess.run([sys.executable, "-m", "broker.cli", "serve", "--config", str(cfg), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert words in proc.stderr
    assert "secret" not in proc.stderr  # a URL's password is never printed
    assert not any(p.name != "broker.yaml" for p in tmp_path.iterdir())  # no database file made


ADMIN_SECRET = "demo-admin-" + "x" * 32


@pytest.mark.parametrize("auth", [False, True], ids=["open", "with-auth"])
def test_the_demo_serves_on_loopback_and_its_sample_jobs_run_to_success(tmp_path, auth):
    """With authentication on (from the environment, as a container would set it), the demo's job feeder
    submits with the admin token the broker reads from ``broker.auth.admin_token_env``."""
    port = free_port()
    env = dict(os.environ)
    if auth:
        env.update(HELIOTROPE_BROKER__AUTH__ENABLED="true", HELIOTROPE_BROKER__AUTH__ADMIN_TOKEN_ENV="DEMO_ADMIN",
                   DEMO_ADMIN=ADMIN_SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "demo", "--port", str(port), "--db", str(tmp_path / "demo.db"),
         "--rate", "8", "--job-seconds", "0.5-1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {ADMIN_SECRET}"} if auth else {}

    def get(path: str) -> dict:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers)) as r:
            return json.load(r)

    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("heliotrope serving on"):  # log lines (carbon forecasts) may come first
            line = proc.stdout.readline()
        assert line.startswith(f"heliotrope serving on {url}")
        done: list[dict] = []
        for _ in range(150):
            time.sleep(0.1)
            done = get("/v1/jobs?state=succeeded&limit=5")["items"]
            if len(done) >= 3:
                break
        assert len(done) >= 3, "the demo's sample jobs did not run to success"
        path = [e["state"] for e in get(f"/v1/jobs/{done[0]['id']}/events")["items"]]
        assert path[0] == "queued" and path[-3:] == ["admitted", "running", "succeeded"]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("url", ["localhost:8080", "ftp://127.0.0.1:8080", "http://"])
def test_a_broker_url_without_http_is_a_message(capsys, url):
    code = main(["--server", url, "jobs"])
    _, err = capsys.readouterr()
    assert code == 1 and "must look like http://HOST:PORT" in err and "Traceback" not in err


class _NotABroker(http.server.BaseHTTPRequestHandler):
    """Another web server where --server points: a page of HTML, or some other JSON, for every path."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        html = not self.path.startswith("/v1/sites")
        body = b"<html><body>Sign in</body></html>" if html else b'{"items": 5}'
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if html else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet: http.server would write every request to stderr, which the CLI's checks read."""


@pytest.mark.parametrize("args", [("jobs",), ("job", "x"), ("explain", "x"), ("sites", "list"), ("logs", "x")])
def test_a_server_that_is_not_a_broker_is_a_one_line_message(capsys, args):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotABroker)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", *args])
    finally:
        srv.shutdown()
        srv.server_close()
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "is --server (or HELIOTROPE_URL) a heliotrope broker?" in err and "Traceback" not in err


def test_a_job_list_with_one_bad_item_sends_nothing(capsys, server, tmp_path):
    path = tmp_path / "jobs.yaml"
    good = {"tenant": "t1", "name": "ok", "gpus": {"count": 1}, "duration_s": 60}
    path.write_text(yaml.safe_dump([good, {**good, "name": "ok2"}, {**good, "gpus": {"count": 0}}]))
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1
    assert "nothing was sent" in err and "job 3 of 3: gpus.count" in err
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert json.loads(out) == []


def test_a_job_list_with_one_bad_label_sends_nothing(capsys, server, tmp_path):
    """A label the broker refuses (here a YAML block scalar's trailing newline, a control character) is found before
    any job is sent, as a spec the schema refuses is: the broker took the jobs before it and refused it alone."""
    path = tmp_path / "jobs.yaml"
    good = {"tenant": "t1", "name": "ok", "gpus": {"count": 1}, "duration_s": 60}
    path.write_text(yaml.safe_dump([good, {**good, "name": "ok2", "labels": {"note": "two\nlines\n"}}]))
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1
    assert "nothing was sent" in err and "job 2 of 2: labels: value of label 'note' holds the control character" in err
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert json.loads(out) == []


def test_json_and_server_may_follow_the_command(capsys, server, tmp_path):
    code = main(["jobs", "--json", "--server", server.url])
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out) == []
    code = main(["sites", "list", "--json", "--server", server.url])
    out, _ = capsys.readouterr()
    assert code == 0 and [s["name"] for s in json.loads(out)] == ["alpha", "beta"]


def test_quota_shows_a_sites_tenants_and_sets_and_removes_one(capsys, server):
    code, out, _ = run(capsys, server, "quota", "alpha")
    assert code == 0 and out.startswith("site alpha: no quotas")
    code, out, _ = run(capsys, server, "quota", "alpha", "--set", "vision", "--guaranteed", "4", "--burst", "2")
    assert code == 0
    header, row = out.splitlines()[1:3]
    assert header.split()[:3] == ["TENANT", "GUARANTEED", "BURST"] and row.split()[:3] == ["vision", "4", "2"]
    code, out, _ = run(capsys, server, "--json", "quota", "alpha")
    assert json.loads(out)["enforced"] is True
    code, out, _ = run(capsys, server, "quota", "alpha", "--set", "vision", "--weight", "3")  # the rest is kept
    assert out.splitlines()[2].split()[:4] == ["vision", "4", "2", "3"]
    code, out, _ = run(capsys, server, "quota", "alpha", "--remove", "vision")
    assert code == 0 and out.startswith("site alpha: no quotas")
    code, _, err = run(capsys, server, "quota", "alpha", "--set", "vision", "--guaranteed", "-3")
    assert code == 1 and "guaranteed_gpus" in err and "Traceback" not in err
    code, _, err = run(capsys, server, "quota", "nowhere")
    assert code == 1 and "no site named nowhere" in err


def test_a_job_list_refused_part_way_says_which_jobs_went_in(capsys, server, tmp_path):
    # A profile is checked by the broker only, so the first job is accepted before the second is refused.
    path = tmp_path / "jobs.yaml"
    good = {"tenant": "t1", "name": "first", "gpus": {"count": 1}, "duration_s": 60}
    path.write_text(yaml.safe_dump([good, {**good, "name": "second", "profile": "no-such-profile"}]))
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1 and "Traceback" not in err
    code, out, _ = run(capsys, server, "--json", "jobs")
    first = json.loads(out)
    assert [j["spec"]["name"] for j in first] == ["first"]
    assert "job 2 of 2 was refused" in err and "no-such-profile" in err
    assert f"the 1 before it were accepted ({first[0]['id']}); send the rest again from job 2" in err


def test_a_job_file_with_a_key_written_twice_sends_nothing_and_names_the_line(capsys, server, tmp_path):
    # YAML keeps the second of two equal keys: the job below would have run on 8 GPUs, not the 1 asked first.
    path = tmp_path / "job.yaml"
    path.write_text("tenant: t1\nname: twice\ngpus: {count: 1}\nduration_s: 60\ngpus: {count: 8}\n")
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1 and "Traceback" not in err
    assert "the key 'gpus' appears twice" in err and "line 5" in err
    code, out, _ = run(capsys, server, "--json", "jobs")
    assert json.loads(out) == []


def test_a_site_file_whose_site_does_not_hold_together_names_the_field_without_an_api_placeholder(
        capsys, server, tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("name: gamma\nregion: gcp:us-east1\ngrid_zone: DE\ntimezone: Europe/Berlin\nlatitude: 0\n"
                    "longitude: 0\ngpus: [{model: a100-80gb, gpus_per_node: 8, nodes: 1}]\n"
                    "usd_per_gpu_hour: {h100-80gb: 3}\n")
    code, _, err = run(capsys, server, "sites", "add", str(path))
    assert code == 1
    assert "  site: usd_per_gpu_hour: prices h100-80gb, which no node group of this site has" in err
    assert "(body)" not in err


def test_an_unquoted_yaml_deadline_is_read_as_the_time_it_names(capsys, server, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("tenant: t1\nname: dated\ngpus: {count: 1}\nduration_s: 60\ndeadline: 2030-01-01T00:00:00Z\n")
    code, out, err = run(capsys, server, "--json", "submit", str(path))
    assert code == 0, err
    assert json.loads(out)["spec"]["deadline"] in ("2030-01-01T00:00:00Z", "2030-01-01T00:00:00+00:00")
    path.write_text("tenant: t1\nname: dated\ngpus: {count: 1}\nduration_s: 60\ndeadline: 2030-01-01\n")
    code, _, err = run(capsys, server, "submit", str(path))
    assert code == 1 and "deadline" in err and "Traceback" not in err


def test_ids_and_names_are_one_path_segment_each(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, duration_s=600)))
    job_id = json.loads(out)["id"]
    # What would otherwise climb to another resource names no site, and touches nothing.
    code, _, err = run(capsys, server, "sites", "remove", f"../jobs/{job_id}")
    assert code == 1 and "Traceback" not in err
    code, _, err = run(capsys, server, "sites", "remove", "alpha?x=1")
    assert code == 1
    code, out, _ = run(capsys, server, "--json", "job", job_id)
    assert json.loads(out)["state"] != "cancelled"
    code, out, _ = run(capsys, server, "sites", "list")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["alpha", "beta"]
    code, _, err = run(capsys, server, "job", "../sites/alpha")
    assert code == 1 and "Traceback" not in err


def test_an_agent_whose_mqtt_tls_files_cannot_be_used_stops_at_once_naming_the_file(capsys, tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(agent_yaml("", f"tls: true, ca_file: '{tmp_path / 'none.pem'}'"))
    assert main(["agent", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"heliotrope agent: mqtt.ca_file {tmp_path / 'none.pem'}: cannot read" in err and "Traceback" not in err


def test_table_times_say_they_are_utc(tmp_path, capsys):
    from broker.cli import _job_row

    job = {"id": "j", "spec": {"tenant": "t", "name": "n", "gpus": {"count": 1, "milli": 1000}}, "state": "queued",
           "site": None, "attempt": 0, "updated_at": "2026-11-26T18:25:35.299900+02:00"}
    assert _job_row(job)["updated"] == "2026-11-26 16:25:35 UTC"
    db = str(tmp_path / "t.db")
    assert main(["token", "create", "--db", db, "--role", "admin", "--name", "ops", "--expires-in", "1"]) == 0
    capsys.readouterr()
    assert main(["token", "list", "--db", db]) == 0
    header, row = capsys.readouterr()[0].splitlines()
    assert header.split()[4:6] == ["CREATED", "EXPIRES"] and row.count(" UTC") == 2


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_the_database_named_in_the_environment_is_the_one_the_broker_opens(command, monkeypatch, tmp_path):
    """``HELIOTROPE_BROKER__DB`` overrides the file's ``db`` for ``demo`` as for ``serve`` (the demo's own
    default, var/demo.db, is its file's, so it does not hide the environment's); ``--db`` overrides both."""
    import broker.server

    opened: list[str] = []

    async def fake_run(settings, sites, **kwargs):
        opened.append(settings.db)

    monkeypatch.setattr(broker.server, "run", fake_run)
    demo_config = str(ROOT / "config" / "demo.yaml")
    assert main([command, "--config", demo_config]) == 0
    monkeypatch.setenv("HELIOTROPE_BROKER__DB", str(tmp_path / "env.db"))
    assert main([command, "--config", demo_config]) == 0
    assert main([command, "--config", demo_config, "--db", str(tmp_path / "flag.db")]) == 0
    assert opened == ["var/demo.db", str(tmp_path / "env.db"), str(tmp_path / "flag.db")]


@pytest.mark.parametrize("argv", [("watch", "--count", "0"), ("jobs", "--limit", "-1"), ("logs", "--tail", "0", "x")],
                         ids=["watch --count 0 (it printed one event)", "jobs --limit -1", "logs --tail 0"])
def test_a_count_below_one_is_a_usage_error_naming_the_flag(capsys, argv):
    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}: {argv[2]} is less than 1" in err and "Traceback" not in err


def test_explain_lines_up_its_columns_when_a_site_name_is_longer_than_twenty_characters():
    from broker.cli import show_decision

    def term(raw: float | None, norm: float | None) -> dict:
        return {"scorer": "cost", "raw": raw, "normalised": norm, "weight": 1.0,
                "weighted": None if norm is None else norm}

    long_name = "frankfurt-gpu-cluster-b.example"  # 31 characters: names may have up to 253
    decision = {
        "job_id": "01m8catea3mnc54j9v", "attempt": 1, "decided_at": "2026-11-26T16:25:35Z", "outcome": "placed",
        "site": "ashburn", "deferred_until": None, "summary": "placed on ashburn", "deferral": None,
        "sites": [
            {"site": "ashburn", "feasible": True, "reasons": [], "terms": [term(3.0, 1.0)], "score": 1.0},
            {"site": long_name, "feasible": True, "reasons": [], "terms": [term(5.0, 0.0)], "score": 0.0},
            {"site": "tokyo", "feasible": False, "reasons": ["gpus-do-not-fit: site has no l4"],
             "terms": [term(None, None)], "score": None},
            {"site": long_name + "-2", "feasible": False, "reasons": ["site-cordoned: cordoned"],
             "terms": [term(None, None)], "score": None},
        ],
    }
    lines = show_decision(decision).splitlines()
    ranked = [line for line in lines if " score " in line]
    assert len(ranked) == 2 and len({line.index(" score ") for line in ranked}) == 1, ranked
    rejected = [line for line in lines if ": " in line and line.startswith("    ") and "score" not in line]
    assert len(rejected) == 2 and len({line.index(line.split()[1]) for line in rejected}) == 1, rejected


def test_explain_gives_each_raw_value_in_its_scorers_unit_and_an_unknown_one_as_a_dash():
    from broker.cli import show_decision

    def term(scorer: str, raw: float | None) -> dict:
        return {"scorer": scorer, "raw": raw, "normalised": 0.5, "weight": 1.0, "weighted": 0.5}

    out = show_decision({
        "job_id": "01m8catea3mnc54j9v", "attempt": 1, "decided_at": "2026-11-26T16:25:35Z", "outcome": "placed",
        "site": "ashburn", "deferred_until": None, "summary": "placed on ashburn", "deferral": None,
        "sites": [{"site": "ashburn", "feasible": True, "reasons": [], "score": 2.5, "terms": [
            term("carbon", 3.56852), term("cost", 208.864), term("latency", 12.5), term("free_gpus", 16.0),
            term("follow_sun_offpeak", 0.25), term("carbon", None)]}],
    })
    assert ("[carbon raw 3.56852 kg CO2e -> 0.500 x 1 = 0.500, cost raw 208.864 USD -> 0.500 x 1 = 0.500, "
            "latency raw 12.5 ms -> 0.500 x 1 = 0.500, free_gpus raw 16 GPUs -> 0.500 x 1 = 0.500, "
            "follow_sun_offpeak raw 0.25 -> 0.500 x 1 = 0.500, carbon raw - -> 0.500 x 1 = 0.500]") in out


def test_explain_gives_an_unknown_raw_value_with_what_the_decision_ranked_it_as():
    from broker.cli import show_decision

    out = show_decision({
        "job_id": "01m8catea3mnc54j9v", "attempt": 1, "decided_at": "2026-11-26T16:25:35Z", "outcome": "placed",
        "site": "berlin", "deferred_until": None, "summary": "placed on berlin", "deferral": None,
        "sites": [{"site": "oslo", "feasible": True, "reasons": [], "score": 0.0, "terms": [
            {"scorer": "cost", "raw": None, "ranked_as": 6.0, "normalised": 0.0, "weight": 1.0, "weighted": 0.0}]}],
    })
    assert "[cost raw - (ranked as 6 USD) -> 0.000 x 1 = 0.000]" in out


class _SiteWithANodeAway(_JsonAnswers):
    """A broker whose site counts tenant vision's 10-GPU guarantee as the 8 GPUs it has now; records PUTs."""

    puts: list[dict] = []

    def _state(self, guaranteed: float, burst: float) -> dict:
        vision = TenantQuotaState(tenant="vision", guaranteed_gpus=8.0, burst_gpus=burst,
                                  configured_guaranteed_gpus=guaranteed)
        return QuotaState(enforced=True, capacity_gpus=8.0, tenants=[vision]).model_dump(mode="json") | {"site": "alpha"}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(self._state(10.0, 2.0))

    def do_PUT(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).puts.append(body)
        self._send(self._state(body["guaranteed_gpus"], body["burst_gpus"]))


class _CancelsInPieces(_JsonAnswers):
    """A broker that answers each ``POST /v1/cancellations`` with the next of ``answers``; records the bodies."""

    answers: list[dict] = []
    bodies: list[dict] = []
    listed: list[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        """``GET /v1/jobs?state=S[&state=S2...]``: one job, running (recorded in ``listed``, the states each listing
        asked for); ``GET /v1/whoami``: an admin."""
        if self.path == "/v1/whoami":
            return self._send({"name": "root", "role": "admin", "tenants": [], "sites": []})
        states = [v for k, v in urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query) if k == "state"]
        type(self).listed.append(states)
        job = {"id": "j1", "state": "running", "site": "alpha", "attempt": 1,
               "spec": {"tenant": "t1", "name": "n", "gpus": {"count": 1, "milli": 1000}},
               "created_at": "2026-11-30T10:00:00Z", "updated_at": "2026-11-30T10:00:01Z"}
        self._send({"items": [job] if "running" in states else [], "next": None})

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._send(type(self).answers.pop(0))


def cancel_against(capsys, answers: list[dict], *args: str, dry_run: bool = False) -> tuple[int, str]:
    _CancelsInPieces.answers, _CancelsInPieces.bodies, _CancelsInPieces.listed = list(answers), [], []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CancelsInPieces)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", *args, "cancel", "--label", "b=1",
                     *(["--dry-run"] if dry_run else [])])
    finally:
        srv.shutdown()
        srv.server_close()
    out, err = capsys.readouterr()
    assert _CancelsInPieces.answers == [], "the CLI stopped calling before the broker said no more match"
    return code, out + err


def test_a_cancel_of_many_that_stops_while_more_match_says_so(capsys):
    """The CLI calls again while each call cancels some; where one cancels none and more still match (jobs
    ending that are skipped, past the broker's bound), it stops, and must not read as if every job was cancelled."""
    stuck = [{"id": f"j{i}", "reason": f"job j{i} is ending"} for i in range(3)]
    code, out = cancel_against(capsys, [
        {"cancelled": ["a"], "skipped": stuck, "matched": 4, "more": True},
        {"cancelled": [], "skipped": stuck, "matched": 3, "more": True},
    ])
    assert code == 3 and out.startswith("1 job cancelled, ")  # (a script must not take it for done)
    assert "more jobs match that were not cancelled" in out and "run the command again" in out


def test_a_cancel_of_many_that_stops_while_more_match_prints_its_json_and_exits_3(capsys):
    stuck = [{"id": "j1", "reason": "job j1 is ending"}]
    code, out = cancel_against(capsys, [{"cancelled": [], "skipped": stuck, "matched": 1, "more": True}], "--json")
    printed, said = out.split("\nheliotrope: ", 1)
    assert code == 3 and json.loads(printed) == {"cancelled": [], "skipped": stuck, "matched": 1, "more": True}
    assert said.startswith("more jobs match that were not cancelled")


def test_a_cancel_of_many_over_several_calls_counts_each_job_once_as_it_ended(capsys):
    """A job skipped by one call (the store could not record its cancel, or it is ending) and cancelled or skipped
    again by the next is told once, as the last call left it."""
    failed = {"id": "b", "reason": "the store could not record the cancel; call again"}
    ending = {"id": "c", "reason": "job c is ending"}
    code, out = cancel_against(capsys, [
        {"cancelled": ["a"], "skipped": [failed, ending], "matched": 3, "more": True},
        {"cancelled": ["b", "d"], "skipped": [ending], "matched": 3, "more": False},
    ], "--json")
    assert code == 0 and json.loads(out) == {"cancelled": ["a", "b", "d"], "skipped": [ending], "matched": 4,
                                             "more": False}


def test_a_dry_run_lists_every_state_a_job_can_leave_in_one_request(capsys):
    """--dry-run asks for every state a job can still leave at once, as POST /v1/cancellations selects them: listed
    state by state, a job moving between two states while the change was stored was in neither list."""
    code, out = cancel_against(capsys, [], "--json", dry_run=True)
    assert code == 0 and [(j["id"], j["state"]) for j in json.loads(out)] == [("j1", "running")]
    assert _CancelsInPieces.listed == [list(cli.ACTIVE_STATES)]


def test_quota_set_of_one_field_keeps_the_guarantee_as_configured_not_as_the_site_counts_it_now(capsys):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SiteWithANodeAway)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = main(["--server", f"http://127.0.0.1:{srv.server_address[1]}", "quota", "alpha", "--set", "vision",
                     "--burst", "8"])
    finally:
        srv.shutdown()
        srv.server_close()
    out, _ = capsys.readouterr()
    assert code == 0
    assert [(p["guaranteed_gpus"], p["burst_gpus"]) for p in _SiteWithANodeAway.puts] == [(10.0, 8)]
    assert out.splitlines()[2].split()[:5] == ["vision", "8", "of", "10", "8"]  # counted now, of configured


def test_job_says_why_a_queued_job_waits(capsys, server, tmp_path):
    """A job no site can take shows its wait under `heliotrope job`, not only `queued` (it used to take an
    `explain` to learn it)."""
    code, out, _ = run(capsys, server, "--json", "submit", str(submit_file(tmp_path, gpus={"count": 64})))
    job_id = json.loads(out)["id"]
    for _ in range(100):
        code, out, _ = run(capsys, server, "job", job_id)
        if "\n  waiting   " in out:  # (its reason, "waiting for a placement", is there from the start)
            break
        time.sleep(0.05)
    assert code == 0 and "  state     queued" in out
    assert "  waiting   no site can take the job now (" in out
    code, out, _ = run(capsys, server, "--json", "job", job_id)
    assert set(json.loads(out)) >= {"id", "state", "spec"} and "waiting" not in json.loads(out)  # the API's job


def test_a_deferred_job_shows_when_and_where_it_is_planned_to_start():
    decision = {"outcome": "deferred", "deferred_until": "2026-12-01T12:00:00Z", "summary": "deferred until ...",
                "deferral": {"site": "toronto"}}
    assert cli._waiting_line(decision, "j1") == ("\n  deferred  until 2026-12-01T12:00:00Z on toronto "
                                                 "(why: heliotrope explain j1)")
    assert cli._waiting_line({"outcome": "placed"}, "j1") == cli._waiting_line(None, "j1") == ""
