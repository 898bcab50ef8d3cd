"""The ``heliotrope`` command.

    heliotrope serve --config FILE --host H --port P --db PATH|postgresql://...   (replicas elect a leader)
    heliotrope demo                    serve config/demo.yaml and feed it sample jobs
    heliotrope submit FILE             a job spec in YAML or JSON ('-' reads standard input)
    heliotrope jobs [--state S] [--tenant T] [--site S] [--label K=V|K ...] [--limit N]
    heliotrope job ID | explain ID | cancel ID [ID ...]
    heliotrope logs ID [--attempt N] [--tail N] [-f|--follow]   what a job printed (-f: then as it prints it)
    heliotrope cancel --tenant T | --label K=V|K ... [--state S] [--site S] [--reason TEXT] [--dry-run]
    heliotrope sites list | get NAME | add FILE | remove NAME   (list: health, lease and last-heard time)
    heliotrope agent --config site.yaml   a site agent next to a remote cluster (adapters.agent), over MQTT
    heliotrope tenants [--tenant T]          each tenant's jobs and GPUs held across the federation, against its limit
                                             (and where the limit comes from: config, default or override)
    heliotrope tenant-limit TENANT GPUS|none | --reset   set a tenant's limit live (none: unlimited), over the
                                             config's, or go back to the config's (PUT|DELETE /v1/tenants/T/limit)
    heliotrope usage [--from T] [--to T] [--by tenant,site,gpu_model] [--tenant T] [--site S] [--csv]   GPU-hours,
                     energy, cost and CO2e per tenant (site, model) over whole hours, for chargeback (GET /v1/usage)
    heliotrope quota SITE [--tenant T]       a site's quota state per tenant, and why a tenant's job waits
    heliotrope quota SITE --set T [--guaranteed N] [--burst N] [--weight W] [--ceiling P] [--model M] | --remove T
    heliotrope watch [--tenant T] [--site S] [--job ID] [--type T,...]   follow live events (GET /v1/events)
    heliotrope token create --role admin|operator|submitter --name N [--site S ...] [--tenant T ...]
                     [--expires-in DAYS] [--config FILE | --db DB]    prints the new token once
    heliotrope token list | revoke ID [--config FILE | --db DB]        (writes the broker's database directly)
    heliotrope simulate --trace FILE --preset philly --carbon DIR --compare all   (see broker.simulation.cli)
    heliotrope simulate-quotas --trace FILE --preset philly   one site's fair-share modes compared (fairshare_cli)

Client commands talk to ``--server`` (default ``$HELIOTROPE_URL`` or http://127.0.0.1:8080) with the bearer
token ``--token`` (default ``$HELIOTROPE_TOKEN``) where the broker requires one, print
tables, or JSON with ``--json``. Errors are one-line messages on standard error and exit status 1 (2 for
wrong usage; 3 for a command that did only part of its work, such as a cancel of many that left some); never a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from pydantic import BaseModel, ValidationError

from broker.client import ApiClientError, Client
from broker.simulation import cli as simulation_cli
from broker.simulation import fairshare_cli
from broker.errors import located, problems
from broker.auth import Role
from broker.models import PREVIEW_LIST_MAX, SITE_READ_ONLY_KEYS, JobSpec, JobState, SiteSpec, labels_problem
from broker.shipped import CONFIG
from broker.store import StoreError

DEFAULT_SERVER = "http://127.0.0.1:8080"
DEMO_CONFIG = CONFIG / "demo.yaml"


class CliError(RuntimeError):
    pass


class Incomplete(RuntimeError):
    """A command did part of what it was asked: ``output`` is what it did (printed as usual), the message what it
    left undone (on standard error); the exit status is 3, so a script does not take it for done."""

    def __init__(self, output: str, message: str) -> None:
        super().__init__(message)
        self.output = output


# --- output ---


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _job_row(job: dict[str, Any]) -> dict[str, Any]:
    g = job["spec"]["gpus"]
    gpus = f"{g['milli']}m" if g["milli"] < 1000 else str(g["count"])
    if g.get("model"):
        gpus += f" x {g['model']}"
    return {
        "id": job["id"],
        "tenant": job["spec"]["tenant"],
        "name": job["spec"]["name"],
        "gpus": gpus,
        "state": job["state"],
        "site": job["site"],
        "attempt": job["attempt"],
        "updated": _utc_time(job["updated_at"]),
    }


def _utc_time(iso: str) -> str:
    """A time of the API (ISO 8601, UTC) for a table, to the second and saying it is UTC: a bare wall-clock
    time reads as the reader's own time zone."""
    return f"{datetime.fromisoformat(iso).astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def _site_row(site: dict[str, Any]) -> dict[str, Any]:
    status = site.get("status") or {}
    free = {c["model"]: c["free_gpus"] for c in status.get("capacity", [])}
    total = {c["model"]: c["total_gpus"] for c in status.get("capacity", [])}
    return {
        "name": site["name"],
        "region": site["region"],
        "zone": site["grid_zone"],
        "timezone": site["timezone"],
        "gpus (free/total)": ", ".join(f"{m} {free[m]}/{total[m]}" for m in sorted(free)) or "-",
        "health": status.get("health") + (f" ({status['reason']})" if status.get("reason") else "")
        + (", cordoned" + (f" ({site['cordon_reason']})" if site.get("cordon_reason") else "")
           if site.get("cordoned") else ""),
        "lease": _lease(status.get("lease_expires_at")),
        "last heard": _ago(status.get("last_heard_at")),
    }


SITE_COLUMNS = ["name", "region", "zone", "timezone", "gpus (free/total)", "health", "lease", "last heard"]


def _seconds_from_now(iso: str | None) -> float | None:
    if not iso:
        return None
    return (datetime.fromisoformat(iso) - datetime.now(UTC)).total_seconds()


def _lease(iso: str | None) -> str:
    """A site agent's lease: the seconds left, or '-' for a site that holds none (a local site)."""
    left = _seconds_from_now(iso)
    if left is None:
        return "-"
    return f"{left:.0f} s left" if left > 0 else f"ran out {-left:.0f} s ago"


def _ago(iso: str | None) -> str:
    left = _seconds_from_now(iso)
    return "-" if left is None else f"{max(0.0, -left):.0f} s ago"


def _seconds(value: float) -> str:
    """Seconds to a tenth, with no trailing zeros (``41.6``, ``120``, ``2419200``): ``:g`` gave six significant
    digits, ``41.5508`` (timer noise), and ``2.4192e+06`` for a four-week job."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _run_text(job: dict[str, Any]) -> str:
    """How long the job has run: ``run_s`` counts only attempts that ended (kept across checkpoints), so a
    running job says since when it runs (its first attempt) or what earlier attempts ran, and an ended one how
    long it ran from its first start to its end, as ``broker.lifecycle.actual_run_s`` takes it (a job
    cancelled while it ran has no ``run_s``)."""
    run_s = float(job["run_s"])
    started, finished = job.get("started_at"), job.get("finished_at")
    if job["state"] == "running":
        if job["attempt"] <= 1 and started:  # (started_at is the first attempt's start)
            return f"running since {started}"
        return f"running, {_seconds(run_s)} s run by earlier attempts"
    if started and finished:
        span = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
        return f"{_seconds(max(run_s, span))} s run"
    return f"{_seconds(run_s)} s run"


DEPENDENCY_WORDS = (("after", "succeed"), ("after_any", "end"), ("after_failed", "fail or be cancelled"))
"""A job's lists of dependencies (``broker.after``), and what it waits for the jobs of each to do: ``heliotrope job``
shows them on one ``after`` line, each list by its key (whether the job still waits, and for which, is its reason)."""


def show_job(job: dict[str, Any]) -> str:
    spec = job["spec"]
    lines = [
        f"job {job['id']}  {spec['tenant']}/{spec['name']}",
        f"  state     {job['state']}" + (f" on {job['site']}" if job["site"] else ""),
        f"  reason    {job.get('reason') or '-'}",
        f"  gpus      {_job_row(job)['gpus']}" + (f", >= {spec['gpus']['memory_gib']} GiB" if spec["gpus"].get("memory_gib") else ""),
        f"  duration  {_seconds(spec['duration_s'])} s expected, {_run_text(job)}",
        f"  attempt   {job['attempt']} ({job['failed_attempts']} failed, at most {spec['max_attempts']})",
        f"  priority  {spec['priority']}",
        *(["  after     " + "; ".join(f"{', '.join(spec[kind])} to {to} ({kind})"
                                        for kind, to in DEPENDENCY_WORDS if spec.get(kind))]
          if any(spec.get(kind) for kind, _ in DEPENDENCY_WORDS) else []),
        f"  created   {job['created_at']}",
        f"  updated   {job['updated_at']}",
    ]
    return "\n".join(lines)


async def _decision_of(c: Client, job_id: str) -> dict[str, Any] | None:
    """The job's decision, or None where it has none yet (404)."""
    try:
        return await c.request("GET", f"/v1/jobs/{_part(job_id)}/decision")
    except ApiClientError as e:
        if e.status == 404:
            return None
        raise


def _waiting_line(decision: dict[str, Any] | None, job_id: str) -> str:
    """For a queued job: when it is planned to start and why it waits, from its decision ('' where none)."""
    if decision is None:
        return ""
    if decision["outcome"] == "deferred" and decision.get("deferred_until"):
        plan = decision.get("deferral") or {}
        where = f" on {plan['site']}" if plan.get("site") else ""
        return (f"\n  deferred  until {decision['deferred_until']}{where} "
                f"(why: heliotrope explain {job_id})")
    if decision["outcome"] == "unplaceable":
        return f"\n  waiting   {decision['summary']}"
    return ""


def show_quota(q: dict[str, Any]) -> str:
    if not q["enforced"]:
        head = f"site {q['site']}: no quotas; it admits whatever fits"
    else:
        fs = q["fair_share"]
        head = (f"site {q['site']}: {_num(q['capacity_gpus'])} GPUs; fair share {fs['mode']} (window {fs['window_h']:g} h, "
                f"half-life {fs['half_life_h']:g} h, re-weighted every {fs['reweight_h']:g} h); "
                f"unlisted tenants: {fs['unlisted_tenants']}")
    rows = [{
        "tenant": t["tenant"] + ("" if t["listed"] else " (unlisted)"),
        "guaranteed": _num(t["guaranteed_gpus"]) + ("" if t.get("configured_guaranteed_gpus") is None
                                                    else f" of {_num(t['configured_guaranteed_gpus'])}"),
        "burst": "no limit" if t["burst_gpus"] is None else _num(t["burst_gpus"]),
        "weight": f"{t['fair_share_weight']:g}",
        "in use": _num(t["in_use_gpus"]),
        "borrowed": _num(t["borrowed_gpus"]),
        "fair share": _num(t["fair_share_gpus"]),
        "usage (GPU-h)": _num(t["decayed_usage_gpu_h"]),
    } for t in q["tenants"]]
    lines = [head, table(rows, ["tenant", "guaranteed", "burst", "weight", "in use", "borrowed", "fair share",
                                "usage (GPU-h)"])]
    lines += [f"  {t['tenant']} waits: {t['waiting_reason']}" for t in q["tenants"] if t.get("waiting_reason")]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


RAW_UNITS = {"carbon": "kg CO2e", "cost": "USD", "latency": "ms", "free_gpus": "GPUs", "carbon_now": "g CO2e/kWh",
             "cheapest": "USD/GPU-h"}
"""The units of the scorers' raw values (policies/scorers/); the others' are fractions, penalties or positions."""


def _raw(scorer: str, value: float | None, ranked_as: float | None = None) -> str:
    """A term's raw value with its scorer's unit ('-' where the broker did not know it, with the value the
    decision ranked the site as, which the normalised values are worked out with)."""
    unit = RAW_UNITS.get(scorer)
    if value is None:
        return "-" if ranked_as is None else f"- (ranked as {_raw(scorer, ranked_as)})"
    return _num(value) if unit is None else f"{_num(value)} {unit}"


def show_decision(d: dict[str, Any], preview: bool = False, ahead: int | None = None,
                  listed: int | None = None) -> str:
    """A decision as ``heliotrope explain`` prints it; ``preview``: one ``submit --dry-run`` asked for, of a job
    not submitted (no id, no attempt), decided after ``ahead`` queued jobs (None: a broker that said not) and
    ``listed`` jobs of the same file (None: a file of one job, or a broker that said not)."""
    head = (f"would be decided so at {d['decided_at']}" if preview
            else f"job {d['job_id']} attempt {d['attempt']}, decided {d['decided_at']}")
    if preview and ahead is not None:
        queued = f"the {ahead} queued job{'' if ahead == 1 else 's'}"
        mine = f"{listed} job{'' if listed == 1 else 's'} of this file"
        if not listed:
            head += (", with no queued job decided before it" if ahead == 0 else
                     f", after {queued} the next pass would decide before it")
        else:
            head += f", after {mine if ahead == 0 else f'{queued} and {mine}'} the next pass would decide before it"
    lines = [head, f"  {d['summary']}", ""]
    feasible = sorted((s for s in d["sites"] if s["feasible"]), key=lambda s: -(s["score"] or 0))
    width = max([20, *(len(s["site"]) for s in d["sites"])])  # site names may be long: the columns still line up
    if feasible:
        lines.append("  feasible sites (best first):")
        for s in feasible:
            mark = "*" if s["site"] == d["site"] else " "
            terms = ", ".join(
                f"{t['scorer']} raw {_raw(t['scorer'], t['raw'], t.get('ranked_as'))} -> {t['normalised']:.3f} x {t['weight']:g} = {t['weighted']:.3f}"
                for t in s["terms"]
            )
            lines.append(f"  {mark} {s['site']:<{width}} score {s['score']:.3f}  [{terms}]")
            if s.get("passed_over"):
                lines.append(f"      turned away now: {s['passed_over']}")
    rejected = [s for s in d["sites"] if not s["feasible"]]
    if rejected:
        lines.append("  rejected sites:")
        for s in rejected:
            lines.append(f"    {s['site']:<{width}} " + "; ".join(s["reasons"]))  # raw terms: in --json
    return "\n".join(lines)


def _load_document(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CliError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        from broker.config import UniqueKeyLoader  # (a key written twice is refused, not half dropped)

        return _plain(yaml.load(text, Loader=UniqueKeyLoader))  # noqa: S506 - a SafeLoader; YAML is a superset of JSON
    except yaml.YAMLError as e:
        from broker.config import yaml_problem

        raise CliError(f"{path}: {yaml_problem(e)}") from None  # (JSON is YAML too)


def _specs_of(doc: Any, path: str, what: str) -> list[Any]:
    """The specs a file holds: the one it is, or each of its list. An empty file or an empty list is an error,
    not a command that does nothing and exits 0 (a sweep whose generator wrote nothing would pass for sent)."""
    if doc is None:
        raise CliError(f"{path}: empty: write a {what} spec, or a list of them")
    if doc == []:
        raise CliError(f"{path}: an empty list: nothing to send; give at least one {what} spec")
    return doc if isinstance(doc, list) else [doc]


def _plain(value: Any) -> Any:
    """A YAML document as JSON has it: an unquoted timestamp (``deadline: 2030-01-01T00:00:00Z``), which YAML
    reads as a date or time, becomes its ISO text again, so that the API reads it as it would the quoted one."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat() if value.tzinfo is None else value.isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    return value


def _part(value: str) -> str:
    """A job id, site or tenant name as one segment of an API path: escaped, so that ``../jobs/X`` or
    ``name?x=1`` names that (no such) thing rather than another resource."""
    return quote(value, safe="")


async def _send_each(c: Client, path: str, docs: list[Any], what: str,
                     headers_of: Any = lambda i: None) -> list[Any]:
    """POST each document in turn; where the broker refuses one after others went in, say which did, so that
    the rest can be sent again without sending those twice."""
    sent: list[Any] = []
    for i, doc in enumerate(docs):
        try:
            sent.append(await c.request("POST", path, doc, headers=headers_of(i)))
        except ApiClientError as e:
            if not sent:
                raise
            names = ", ".join(str(d.get("id") or d.get("name")) for d in sent)
            raise CliError(f"{what} {i + 1} of {len(docs)} was refused: {_api_message(e)}\n"
                           f"the {len(sent)} before it were accepted ({names}); send the rest again from {what} "
                           f"{i + 1}") from None
    return sent


async def _preview(c: Client, doc: Any) -> tuple[list[Any], str]:
    """``heliotrope submit --dry-run``: the broker's previews of a spec, or of a list of them together (one
    request, each taking the room of those the queue puts before it), and the note to print under them. A broker
    of an earlier release, which takes one spec a request, previews each of a list alone, and the note says so; so
    does a list longer than one preview takes (``PREVIEW_LIST_MAX``, or the broker's limit on a body's bytes: 413),
    which ``submit`` queues all the same."""
    if not isinstance(doc, list):
        preview = await c.request("POST", "/v1/preview", doc)
        return [preview], preview["note"]
    too_many = (f"The file holds more jobs than one preview decides together (at most {PREVIEW_LIST_MAX}, within the "
                "broker's limit on a request's size): each was previewed alone")
    alone = too_many if len(doc) > PREVIEW_LIST_MAX else None
    if alone is None:
        try:
            previews = (await c.request("POST", "/v1/preview", doc))["items"]
            return previews, previews[0]["note"]
        except ApiClientError as e:
            problem = e.fields[0]["problem"] if [f["field"] for f in e.fields] == ["(body)"] else ""
            if e.status == 413 or (e.status == 422 and problem.startswith("at most ")):  # (the broker's limits)
                alone = too_many
            elif e.status == 422 and "object" in problem:
                alone = "This broker previews each job alone"  # (an earlier release)
            else:
                raise
    previews = [await c.request("POST", "/v1/preview", spec) for spec in doc]
    return previews, f"{previews[0]['note']}. {alone}: together they may need more room than each was shown"


def _check_all(docs: list[Any], model: type[BaseModel], what: str,
               read_only: dict[str, str] | None = None) -> None:
    """Validate every document before any is sent, naming each bad one by its position; ``read_only`` as
    :func:`broker.errors.problems` takes it."""
    lines = []
    for i, doc in enumerate(docs):
        where = f"{what} {i + 1} of {len(docs)}" if len(docs) > 1 else what
        try:
            valid = model.model_validate(doc)
        except ValidationError as e:
            lines += [f"{where}: {located(p)}" for p in problems(e, read_only)]
            continue
        problem = labels_problem(valid.labels) if isinstance(valid, JobSpec) else None
        if problem is not None:  # (the broker checks them at submission only, not where a stored job is read)
            lines.append(f"{where}: labels: {problem}")
    if lines:
        raise CliError("nothing was sent; fix these first:\n  " + "\n  ".join(lines))


def _api_message(e: ApiClientError) -> str:
    if e.fields and len(e.fields) > 1:
        return e.args[0].split(":")[0] + ":\n" + "\n".join(f"  {f['field']}: {f['problem']}" for f in e.fields)
    return str(e)


# --- jobs by filter; cancelling many ---

JOB_COLUMNS = ["id", "tenant", "name", "gpus", "state", "site", "attempt", "updated"]
ACTIVE_STATES = [s.value for s in JobState if not s.terminal]


def _job_filters(args: argparse.Namespace, state: str | None) -> list[tuple[str, str]]:
    """The query of ``GET /v1/jobs`` for ``--tenant``, ``--site``, ``--label`` (repeated) and ``state``. An empty
    value is sent: the broker refuses it, naming it, rather than list every job."""
    pairs = [(k, v) for k, v in (("state", state), ("tenant", args.tenant), ("site", args.site)) if v is not None]
    return pairs + [("label", label) for label in args.label or []]


def _selector(args: argparse.Namespace) -> dict[str, Any]:
    """The body of ``POST /v1/cancellations`` for ``heliotrope cancel --tenant/--label/--state/--site``."""
    body: dict[str, Any] = {k: v for k, v in (("tenant", args.tenant), ("state", args.state), ("site", args.site),
                                              ("reason", args.reason)) if v is not None}
    if args.label:
        labels: dict[str, str | None] = {}
        for key, eq, value in (lb.partition("=") for lb in args.label):
            if eq or key not in labels:  # (KEY=VALUE narrows KEY alone, in any order, as the listing does)
                labels[key] = value if eq else None
        body["labels"] = labels
    return body


async def _cancellable(c: Client, args: argparse.Namespace) -> list[Any]:
    """``--dry-run``: the jobs the selector matches now, newest first, in every state a job can still leave (or
    ``--state``), listed in one request as ``POST /v1/cancellations`` reads them. (Listed state by state, a job the
    broker held in a new state while that change was still being stored was in no list: a list by one state leaves
    out a job held in another now.) A token whose cancel the broker would refuse (403: an operator's, or a
    submitter's for another tenant) is told so, as the cancel would be, rather than shown jobs it may read but not
    cancel."""
    me = await c.request("GET", "/v1/whoami")
    if me.get("role") not in ("admin", "submitter"):
        raise CliError(f"a cancel would be refused: {me.get('name')} is a token of role {me.get('role')}, and only "
                       "admins and submitters cancel jobs")
    if me["role"] == "submitter" and args.tenant is not None and args.tenant not in me.get("tenants", []):
        raise CliError(f"a cancel would be refused: {me.get('name')} acts for tenants "
                       f"{', '.join(me.get('tenants', []))}, not {args.tenant}")
    states = [("state", state) for state in ([args.state] if args.state else ACTIVE_STATES)]
    query = [*states, *_job_filters(args, None), ("limit", "1000")]
    listed = await c.list_all("/v1/jobs", query)
    return sorted(listed, key=lambda j: (j["created_at"], j["id"]), reverse=True)


async def _cancel_many(c: Client, args: argparse.Namespace) -> dict[str, Any]:
    """``POST /v1/cancellations`` until the broker says no more match (it cancels a bounded number per call)."""
    body = _selector(args)
    cancelled: list[str] = []
    skipped: dict[str, dict[str, str]] = {}  # by id, the latest call's reason: one skipped by a call and cancelled
    #                                          by the next (a store write that failed) is cancelled, not skipped
    while True:
        got = await c.request("POST", "/v1/cancellations", body)
        cancelled += got["cancelled"]
        for job_id in got["cancelled"]:
            skipped.pop(job_id, None)
        skipped.update((s["id"], s) for s in got["skipped"])
        if not got["more"] or not got["cancelled"]:  # (nothing cancelled: calling again would do no better)
            return {"cancelled": cancelled, "skipped": list(skipped.values()),
                    "matched": len(cancelled) + len(skipped), "more": got["more"]}


async def _cancel_each(c: Client, ids: list[str]) -> list[Any]:
    """``heliotrope cancel ID [ID ...]``: each in turn; where one is refused after others were cancelled, say which
    were."""
    done: list[Any] = []
    for job_id in ids:
        try:
            done.append(await c.request("POST", f"/v1/jobs/{_part(job_id)}/cancel"))
        except ApiClientError as e:
            if not done:
                raise
            raise CliError(f"{_api_message(e)}\nthe {len(done)} before it were cancelled: "
                           f"{', '.join(j['id'] for j in done)}") from None
    return done


def _check_cancel(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``heliotrope cancel`` takes job ids or a selector, not both, and not neither."""
    selector = [f for f, v in (("--tenant", args.tenant), ("--label", args.label), ("--state", args.state),
                               ("--site", args.site)) if v]
    if args.id and (selector or args.reason is not None or args.dry_run):
        extra = selector + [f for f, v in (("--reason", args.reason), ("--dry-run", args.dry_run)) if v]
        p.error(f"cancel: give job ids or --tenant/--label, not both (got ids and {', '.join(extra)})")
    if not args.id and not (args.tenant is not None or args.label):
        p.error("cancel: give job ids, or --tenant and/or --label to cancel every job they match (--state and "
                "--site narrow it)")
    if args.state is not None and args.state not in ACTIVE_STATES:  # (so --dry-run lists none the broker refuses)
        p.error(f"cancel: --state {args.state!r} is not one a job can still leave; give one of "
                f"{', '.join(ACTIVE_STATES)}")
    values: dict[str, set[str]] = {}
    for key, eq, value in (lb.partition("=") for lb in args.label or []):
        if eq:
            values.setdefault(key, set()).add(value)
    for key, seen in values.items():
        if len(seen) > 1:  # (no job carries both: the broker's body holds one value a key)
            p.error(f"cancel: --label {key} is given {len(seen)} values ({', '.join(sorted(seen))}); a job carries one "
                    "value for a key: cancel one value at a time")


# --- client commands ---
# --- client commands ---


async def _client_command(args: argparse.Namespace) -> str | None:
    async with Client(args.server, ca_file=args.ca_file, token=args.token) as c:
        out: Any
        left: str | None = None  # what the command did not do (Incomplete), after its output
        match args.command:
            case "watch":
                return await _watch(c, args)
            case "submit" if args.dry_run:
                doc = _load_document(args.file)
                specs = _specs_of(doc, args.file, "job")
                _check_all(specs, JobSpec, "job")
                previews, note = await _preview(c, doc)
                out = previews if isinstance(doc, list) else previews[0]
                text = "\n\n".join(show_decision(p["decision"], preview=True, ahead=p.get("ahead"),
                                                   listed=p.get("listed_ahead")) for p in previews)
                text += f"\n\n(dry run: {note})"
            case "submit":
                doc = _load_document(args.file)
                specs = _specs_of(doc, args.file, "job")
                _check_all(specs, JobSpec, "job")  # all or nothing: no job is sent if one is invalid
                key = args.idempotency_key
                jobs = await _send_each(c, "/v1/jobs", specs, "job", lambda i: (
                    {"Idempotency-Key": f"{key}-{i}" if len(specs) > 1 else key} if key else None))
                out = jobs if isinstance(doc, list) else jobs[0]
                text = table([_job_row(j) for j in jobs], ["id", "tenant", "name", "gpus", "state"])
            case "jobs":
                params = _job_filters(args, args.state)
                params.append(("limit", str(min(args.limit, 1000))))
                out = await c.list_all("/v1/jobs", params, limit=args.limit)
                text = table([_job_row(j) for j in out], JOB_COLUMNS)
            case "job":
                out = await c.request("GET", f"/v1/jobs/{_part(args.id)}")
                text = show_job(out)
                if out["state"] == "queued" and not out.get("waiting"):  # deferred, or waiting for room: say so
                    text += _waiting_line(await _decision_of(c, out["id"]), out["id"])
            case "logs":
                return await _logs(c, args)
            case "explain":
                out = await c.request("GET", f"/v1/jobs/{_part(args.id)}/decision")
                text = show_decision(out)
            case "cancel" if args.id:
                done = await _cancel_each(c, args.id)
                out = done[0] if len(done) == 1 else done
                text = "\n".join(f"job {j['id']} {j['state']}" for j in done)
            case "cancel" if args.dry_run:
                out = await _cancellable(c, args)
                text = table([_job_row(j) for j in out], JOB_COLUMNS)
                text += f"\n\n(dry run: {len(out)} job{'' if len(out) == 1 else 's'} would be cancelled; nothing was)"
            case "cancel":
                out = await _cancel_many(c, args)
                text = (f"{len(out['cancelled'])} job{'' if len(out['cancelled']) == 1 else 's'} cancelled, "
                        f"{len(out['skipped'])} skipped")
                text += "".join(f"\n  {s['id']}: {s['reason']}" for s in out["skipped"])
                if out["more"]:
                    left = ("more jobs match that were not cancelled (the broker stopped at its bound or could not "
                            "record a cancel): run the command again")
            case "update":
                change: dict[str, Any] = {}
                if args.priority is not None:
                    change["priority"] = args.priority
                for name in ("deadline", "profile"):
                    value = getattr(args, name)
                    if value is not None:
                        change[name] = None if value == "none" else value
                if not change:
                    raise CliError("give --priority, --deadline or --profile (none of them: nothing to change)")
                out = await c.request("PATCH", f"/v1/jobs/{_part(args.id)}", change)
                text = show_job(out)
            case "sites":
                match args.action:
                    case "list":
                        out = await c.list_all("/v1/sites")
                        text = table([_site_row(s) for s in out], SITE_COLUMNS)
                    case "get":
                        out = await c.request("GET", f"/v1/sites/{_part(args.name)}")
                        text = yaml.safe_dump(out, sort_keys=False).rstrip()
                    case "add":
                        doc = _load_document(args.file)
                        specs = _specs_of(doc, args.file, "site")
                        _check_all(specs, SiteSpec, "site", SITE_READ_ONLY_KEYS)
                        added = await _send_each(c, "/v1/sites", specs, "site")
                        out = added if isinstance(doc, list) else added[0]
                        text = table([_site_row(s) for s in added], SITE_COLUMNS)
                    case "remove":
                        await c.request("DELETE", f"/v1/sites/{_part(args.name)}")
                        out = {"removed": args.name}
                        text = f"site {args.name} removed"
                    case "cordon" | "uncordon":
                        body = {"reason": args.reason} if args.action == "cordon" and args.reason else None
                        out = await c.request("POST", f"/v1/sites/{_part(args.name)}/{args.action}", body)
                        text = table([_site_row(out)], SITE_COLUMNS)
                    case _:
                        raise CliError(f"unknown sites action {args.action}")
            case "quota":
                path = f"/v1/sites/{_part(args.site)}/quota"
                if args.set:  # a change of the fields given; the others keep their value
                    now = await c.request("GET", path, params={"tenant": args.set})
                    listed = [t for t in now["tenants"] if t["tenant"] == args.set and t["listed"]]
                    body = {k: listed[0][k] for k in ("guaranteed_gpus", "burst_gpus", "fair_share_weight",
                                                      "priority_ceiling", "model")} if listed else {}
                    if listed and listed[0].get("configured_guaranteed_gpus") is not None:
                        # the guarantee as configured, not the part of it the site can count now (a Node away)
                        body["guaranteed_gpus"] = listed[0]["configured_guaranteed_gpus"]
                    body.update({k: v for k, v in (("guaranteed_gpus", args.guaranteed), ("burst_gpus", args.burst),
                                                   ("fair_share_weight", args.weight), ("priority_ceiling", args.ceiling),
                                                   ("model", args.model)) if v is not None})
                    out = await c.request("PUT", f"{path}/{_part(args.set)}", body)
                elif args.remove:
                    out = await c.request("DELETE", f"{path}/{_part(args.remove)}")
                else:
                    out = await c.request("GET", path, params={"tenant": args.tenant} if args.tenant is not None else None)
                text = show_quota(out)
            case "tenants":
                out = await c.request("GET", "/v1/tenants", params={"tenant": args.tenant} if args.tenant else None)
                out = out["items"]
                text = table([_tenant_row(t) for t in out], TENANT_COLUMNS)
            case "tenant-limit":
                path = f"/v1/tenants/{_part(args.tenant)}/limit"
                if args.reset:
                    if args.gpus is not None:
                        raise CliError(f"tenant-limit: give GPUS or --reset, not both (--reset goes back to the "
                                       f"config's limit of {args.tenant})")
                    out = await c.request("DELETE", path)
                else:
                    out = await c.request("PUT", path, {"gpus": _limit_gpus(args.gpus)})
                text = table([_tenant_row(out)], TENANT_COLUMNS)
            case "usage":
                params = {name: value for name, value in (("from", args.start), ("to", args.end), ("by", args.by),
                                                          ("tenant", args.tenant), ("site", args.site)) if value}
                if args.csv and args.json:
                    raise CliError("usage: --csv and --json each give the whole report; use one of them")
                out = await c.request("GET", "/v1/usage", params=params or None)
                text = usage_csv(out) if args.csv else show_usage(out)
            case _:
                raise CliError(f"unknown command {args.command}")
    rendered = json.dumps(out, indent=2) if args.json else text
    if left is not None:
        raise Incomplete(rendered, left)
    return rendered


TENANT_COLUMNS = ("tenant", "gpus", "limit", "queued", "on_sites", "limit_source")


def _tenant_row(t: dict[str, Any]) -> dict[str, Any]:
    """One tenant of ``GET /v1/tenants``: the GPUs it holds, its limit across the federation (- for none), its queued
    jobs and those on sites or on their way to one, and where its limit comes from (config, default, override)."""
    jobs = t.get("jobs", {})
    return {"tenant": t["tenant"], "gpus": f"{t['gpus_held']:g}",
            "limit": f"{t['gpus_limit']:g}" if t.get("gpus_limit") is not None else None,
            "queued": jobs.get("queued", 0), "on_sites": sum(n for state, n in jobs.items() if state != "queued"),
            "limit_source": t.get("limit_source")}


def _limit_gpus(value: str | None) -> float | None:
    """``heliotrope tenant-limit``'s GPUS: a number of GPUs, 0 or more (a fraction is a share of one), or none
    (unlimited); a CliError saying what to give otherwise (the broker checks the upper bound)."""
    if value is None:
        raise CliError("tenant-limit: give GPUS (a number of GPUs, or none for unlimited), or --reset to go back to "
                       "the config's limit")
    if value.strip().lower() == "none":
        return None
    try:
        gpus = float(value)
    except ValueError:
        gpus = math.nan
    if not math.isfinite(gpus) or gpus < 0:
        raise CliError(f"tenant-limit: GPUS must be a number of GPUs, 0 or more, or none (unlimited), not {value!r}")
    return gpus


def show_usage(report: dict[str, Any]) -> str:
    """``GET /v1/usage`` as a table, a row per group and the total, under the window it covers."""
    by = report["by"]

    def row(item: dict[str, Any]) -> dict[str, Any]:
        cost, co2e = item.get("cost_usd"), item.get("co2e_kg")
        return {**{k: item.get(k, "") for k in by}, "gpu_hours": f"{item['gpu_hours']:,.2f}",
                "attempts": f"{item['attempts']:,}", "energy_kwh": f"{item['energy_kwh']:,.1f}",
                "cost_usd": f"{cost:,.2f}" if cost is not None else None,
                "co2e_kg": f"{co2e:,.1f}" if co2e is not None else None}

    total = {**{k: "" for k in by}, **row(report["total"])}
    total[by[0]] = "total"
    items = report["items"]
    # (the carbon column where the broker has a carbon provider: some figure, or a note on why there is none)
    carbon = ("co2e_kg",) if report.get("notes") or any("co2e_kg" in i for i in [*items, report["total"]]) else ()
    lines = [f"usage from {report['from']} to {report['to']}",
             table([row(i) for i in items] + [total], (*by, *USAGE_COLUMNS, *carbon))]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines)


USAGE_COLUMNS = ("gpu_hours", "attempts", "energy_kwh", "cost_usd")


def usage_csv(report: dict[str, Any]) -> str:
    """``GET /v1/usage`` as CSV for a spreadsheet: a header, a row per group with the window's start and end, the
    figures unrounded as the broker gives them (empty where one is left out), no total row (a sum of the column)."""
    import csv
    import io

    columns = ["from", "to", *report["by"], *USAGE_COLUMNS, "co2e_kg"]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for item in report["items"]:
        writer.writerow({"from": report["from"], "to": report["to"], **item})
    return out.getvalue().rstrip("\n")


async def _logs(c: Client, args: argparse.Namespace) -> str | None:
    """``heliotrope logs ID``: the text as the site gave it, written as is (no newline added); a note on standard
    error where its start was left out. With --json, the text and what the broker says of it."""
    params = {name: str(value) for name, value in (("attempt", args.attempt), ("tail", args.tail)) if value is not None}
    if args.follow:
        if args.json:
            raise CliError("logs: --json gives the log whole, --follow as it is written; use one of them")
        async with c.text_stream(f"/v1/jobs/{_part(args.id)}/logs", {**params, "follow": "true"}) as (headers, text):
            _left_out(headers)
            async for chunk in text:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        return None
    text, headers = await c.text(f"/v1/jobs/{_part(args.id)}/logs", params)
    truncated = headers.get("X-Heliotrope-Log-Truncated") == "true"
    if args.json:
        return json.dumps({"job": args.id, "site": headers.get("X-Heliotrope-Site"),
                           "attempt": int(headers.get("X-Heliotrope-Attempt") or 0) or None,
                           "truncated": truncated, "source": headers.get("X-Heliotrope-Log-Source") or None,
                           "text": text}, indent=2)
    sys.stdout.write(text)
    sys.stdout.flush()
    _left_out(headers)
    return None


def _left_out(headers: dict[str, str]) -> None:
    """Say on standard error where the start of a log was left out."""
    if headers.get("X-Heliotrope-Log-Truncated") == "true":
        print(f"heliotrope: the start of the log was left out (attempt {headers.get('X-Heliotrope-Attempt')} at "
              f"site {headers.get('X-Heliotrope-Site')}); --tail N shows more lines, up to 1 MiB", file=sys.stderr)


async def _watch(c: Client, args: argparse.Namespace) -> None:
    """Print events as they come until interrupted; reconnects (resuming after the last event) when the
    stream breaks, as when the broker restarts or leadership moves."""
    params = {k: v for k, v in (("tenant", args.tenant), ("site", args.site), ("job", args.job),
                                ("type", args.type)) if v is not None}
    last: int | None = args.after
    while True:
        try:
            async for event in c.events(params, last):
                if event["type"] == "gap" and args.after == 0:
                    continue  # asked for everything held: that some are no longer held is expected
                if event["id"] is not None:
                    last = event["id"]
                print(json.dumps(event) if args.json else show_event(event), flush=True)
                if args.count is not None:
                    args.count -= 1
                    if args.count <= 0:
                        return None
        except ApiClientError as e:
            if e.status is not None and e.status < 500:  # refused (400, 401, 403, 404): retrying would not help
                raise
            print(f"heliotrope: {e}; reconnecting in 2 s", file=sys.stderr, flush=True)
        await asyncio.sleep(2.0)


def show_event(event: dict[str, Any]) -> str:
    d, kind = event["data"], event["type"]
    at = str(d.get("at") or "")[11:19]
    match kind:
        case "transition":
            where = f" on {d['site']}" if d.get("site") else ""
            text = f"{d['job_id']} ({d['tenant']}) {d.get('previous') or 'new'} -> {d['state']}{where}"
            if d.get("reason"):
                text += f": {d['reason']}"
        case "decision" | "deferral":
            text = f"{d['job_id']} ({d['tenant']}) {d['outcome']}: {d['summary']}"
        case "preemption":
            text = f"{d['job_id']} ({d['tenant']}) preempted on {d['site']}: {d.get('reason') or '-'}"
        case "site":
            text = f"site {d['site']} {d.get('previous') or 'new'} -> {d['health']}" + (
                f" ({d['reason']})" if d.get("reason") else "")
        case "gap":
            text = "some events were missed while disconnected (no longer held by the broker)"
        case _:
            text = json.dumps(d)
    return f"{at}  {kind:<10}  {text}"


# --- tokens (the database directly: the first admin token is made before anyone can call the API) ---


def _token_command(args: argparse.Namespace) -> str:
    return asyncio.run(_tokens(args))


async def _tokens(args: argparse.Namespace) -> str:
    from datetime import timedelta

    from broker import auth
    from broker.config import load_config
    from broker.store import open_store

    db = args.db or load_config(args.config).broker.db
    if "://" in db and not db.startswith(("postgresql://", "postgres://")):
        raise CliError(f"--db {_where(db)}: give an SQLite file path or a postgresql:// URL")
    if db == ":memory:" or db.startswith("file::memory:"):
        raise CliError("--db :memory: keeps nothing; give the broker's database (a file or a postgresql:// URL)")
    if not db.startswith(("postgresql://", "postgres://")):
        if args.action != "create" and not Path(db).exists():
            raise CliError(f"no database at {db}: give the broker's with --db or --config")
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    if args.action == "create" and args.expires_in is not None and not 0 < args.expires_in <= 36500:
        raise CliError(f"--expires-in {args.expires_in:g}: give a number of days above 0 and at most 36500 "
                       "(leave it out for a token that does not expire)")
    store = open_store(db)
    await store.open()
    try:
        records = [auth.TokenRecord.model_validate_json(doc) for doc in await store.list_tokens()]
        match args.action:
            case "create":
                now = datetime.now(UTC)
                expires = now + timedelta(days=args.expires_in) if args.expires_in is not None else None
                try:
                    token, record = auth.make_record(args.name, args.role, args.site or [], args.tenant or [], now,
                                                     expires)
                except ValidationError as e:
                    raise CliError("; ".join(map(located, problems(e)))) from None
                await store.put_token(record.id, record.digest, record.model_dump_json())
                if args.json:
                    return json.dumps({**record.public(), "token": token}, indent=2)
                scope = ", ".join(record.sites or record.tenants) or "everything"
                return (f"{token}\n\ntoken {record.id} for {record.name}: {record.role} ({scope})"
                        + (f", expires {record.expires_at:%Y-%m-%d %H:%M} UTC" if record.expires_at else "")
                        + f"\nThis is the only time it is shown; the database ({_where(db)}) keeps its SHA-256 digest."
                        + "\nUse it with --token or HELIOTROPE_TOKEN, or as 'Authorization: Bearer TOKEN'.")
            case "list":
                records.sort(key=lambda r: (r.created_at, r.id))  # oldest first (ids are random)
                rows = [{"id": r.id, "name": r.name, "role": r.role.value,
                         "scope": ", ".join(r.sites or r.tenants) or "-",
                         "created": f"{r.created_at:%Y-%m-%d %H:%M} UTC",
                         "expires": f"{r.expires_at:%Y-%m-%d %H:%M} UTC" if r.expires_at else "never",
                         "revoked": f"{r.revoked_at:%Y-%m-%d %H:%M} UTC" if r.revoked_at else "-"} for r in records]
                if args.json:
                    return json.dumps([r.public() for r in records], indent=2)
                return table(rows, ["id", "name", "role", "scope", "created", "expires", "revoked"])
            case "revoke":
                found = [r for r in records if r.id == args.id]
                if not found:
                    raise CliError(f"no token {args.id} in {_where(db)}; 'heliotrope token list' shows them")
                if found[0].revoked_at is not None:
                    return f"token {args.id} was already revoked at {found[0].revoked_at:%Y-%m-%d %H:%M} UTC"
                revoked = found[0].model_copy(update={"revoked_at": datetime.now(UTC)})
                await store.update_token(revoked.id, revoked.model_dump_json())
                return (f"token {args.id} ({revoked.name}) revoked; brokers on this database refuse it within "
                        "broker.auth.refresh_s (2 s by default)")
        raise CliError(f"unknown token action {args.action}")
    finally:
        await store.close()


def _where(db: str) -> str:
    """The database named for a person, without a password."""
    from broker.store import describe_db

    return describe_db(db)


# --- server commands ---


def _serve(args: argparse.Namespace) -> None:
    from broker.config import load_config
    from broker.server import run

    config = load_config(args.config)
    settings = config.broker.model_copy()
    for name, value in (("host", args.host), ("port", args.port), ("db", args.db)):
        if value is not None:  # each flag checked as the file's setting is
            try:
                type(settings).__pydantic_validator__.validate_assignment(settings, name, value)
            except ValidationError as e:
                shown = _where(value) if name == "db" else value  # (a URL's password is not printed)
                raise CliError(f"--{name} {shown}: {problems(e)[0]['problem']}") from None
    feeder = None
    if args.command == "demo":
        from broker.demo import feed

        seconds = _seconds_range(args.job_seconds)
        # With authentication on, the feeder submits with --token ($HELIOTROPE_TOKEN), else with the admin token
        # the broker itself reads from broker.auth.admin_token_env.
        env = settings.auth.admin_token_env
        token = args.token or (os.environ.get(env, "").strip() if env else "") or None
        if settings.auth.enabled and token is None:
            raise CliError("the demo's job feeder needs a token when broker.auth is enabled: pass --token (or set "
                           "HELIOTROPE_TOKEN) to a submitter or admin token"
                           + (f", or set ${env}" if env else ""))
        feeder = lambda url: feed(url, config.sites, rate_per_s=args.rate, seed=args.seed, seconds=seconds,  # noqa: E731
                                  token=token, ca_file=args.ca_file)
    asyncio.run(run(settings, config.sites, feeder=feeder, log_jobs=args.command == "demo" or args.log_jobs))


def _seconds_range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition("-")
    try:
        low, high = float(lo), float(hi if sep else lo)
    except ValueError:
        raise CliError(f"--job-seconds {text!r}: write MIN-MAX in seconds, for example 10-90") from None
    if not 0 < low <= high:
        raise CliError(f"--job-seconds {text!r}: need 0 < MIN <= MAX")
    return low, high



def _at_least_one(text: str) -> int:
    """A count flag's value: a whole number, 1 or more (argparse names the flag when this refuses)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heliotrope", description="Federated multi-cluster GPU job broker")
    p.add_argument("--server", default=os.environ.get("HELIOTROPE_URL", DEFAULT_SERVER),
                   help="broker URL for client commands (default $HELIOTROPE_URL or %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--token", default=os.environ.get("HELIOTROPE_TOKEN"), metavar="TOKEN",
                   help="bearer token for a broker that requires one (default $HELIOTROPE_TOKEN)")
    p.add_argument("--ca-file", default=os.environ.get("HELIOTROPE_CA_FILE"), metavar="PEM",
                   help="CA bundle that verifies an https:// broker with a private CA (default $HELIOTROPE_CA_FILE)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The same options after the command too (`heliotrope jobs --json`); SUPPRESS keeps the global value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    common.add_argument("--token", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--ca-file", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    for name, help_text in (("serve", "run the broker"), ("demo", "run the broker on config/demo.yaml and feed it sample jobs")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--config", default=str(DEMO_CONFIG) if name == "demo" else None, help="federation YAML")
        s.add_argument("--host", default=None, help="address to listen on (default from config: 127.0.0.1)")
        s.add_argument("--port", type=int, default=None, help="port (default from config: 8080)")
        # No default here, not even the demo's: a flag's default would hide HELIOTROPE_BROKER__DB. The demo's
        # config/demo.yaml names var/demo.db itself.
        s.add_argument("--db", default=None, help="SQLite database file, or a postgresql:// URL (several replicas "
                       "may share it; default from config" + (": var/demo.db)" if name == "demo" else ")"))
        s.add_argument("--log-jobs", action="store_true", help="log every job transition (on in the demo)")
        if name == "demo":
            s.add_argument("--rate", type=float, default=0.5, help="sample jobs per second (default %(default)s)")
            s.add_argument("--seed", type=int, default=1, help="seed of the sample job stream")
            s.add_argument("--job-seconds", default="10-90", metavar="MIN-MAX",
                           help="run time of the sample jobs, in seconds (default %(default)s)")

    s = sub.add_parser("submit", parents=[common], help="submit a job spec (YAML or JSON; a list submits several)")
    s.add_argument("file", help="path, or - for standard input")
    s.add_argument("--idempotency-key", help="resubmitting with the same key returns the first job")
    s.add_argument("--dry-run", action="store_true",
                   help="submit nothing: show what the broker would decide for each job now (its site, or its "
                        "deferral, or why it would wait), as heliotrope explain shows a decision")
    s = sub.add_parser("jobs", parents=[common], help="list jobs, newest first")
    s.add_argument("--state")
    s.add_argument("--tenant")
    s.add_argument("--site")
    s.add_argument("--label", action="append", metavar="KEY=VALUE|KEY",
                   help="jobs carrying this label (KEY alone: with any value); repeat it: every one must match")
    s.add_argument("--limit", type=_at_least_one, default=50)
    for name, help_text in (("job", "show a job"), ("explain", "why a job went where it went")):
        sub.add_parser(name, parents=[common], help=help_text).add_argument("id")
    s = sub.add_parser("logs", parents=[common], help="what a job printed: the last lines of its latest attempt at a "
                                                      "site (a simulated site's log is simulated)")
    s.add_argument("id")
    s.add_argument("--attempt", type=_at_least_one, help="which attempt (default: the latest a site admitted)")
    s.add_argument("--tail", type=_at_least_one, help="how many of the last lines (default 1000; at most 1 MiB)")
    s.add_argument("-f", "--follow", action="store_true",
                   help="then print what it prints as it prints it, until the attempt ends (Ctrl-C stops)")
    s = sub.add_parser("cancel", parents=[common], help="cancel jobs: by id, or every one --tenant and --label match")
    s.add_argument("id", nargs="*", help="the jobs to cancel (or a selector instead: --tenant, --label)")
    s.add_argument("--tenant", help="every active job of this tenant (narrowed by the flags below)")
    s.add_argument("--label", action="append", metavar="KEY=VALUE|KEY",
                   help="every active job carrying this label (KEY alone: with any value); repeat it: every one "
                        "must match")
    s.add_argument("--state", help="only jobs in this state (queued, dispatching, admitted, running, preempted)")
    s.add_argument("--site", help="only jobs at this site")
    s.add_argument("--reason", help="why, recorded on each job cancelled")
    s.add_argument("--dry-run", action="store_true", help="cancel nothing: list the jobs that would be cancelled")
    s = sub.add_parser("update", parents=[common], help="change a queued job's priority, deadline or profile")
    s.add_argument("id")
    s.add_argument("--priority", type=int, help="its new priority (-1000 to 1000)")
    s.add_argument("--deadline", metavar="ISO-TIME|none", help="its new deadline (with its time zone), or none")
    s.add_argument("--profile", metavar="NAME|none",
                   help="its new routing profile, or none for the federation's default")
    s = sub.add_parser("sites", parents=[common], help="list, get, add, remove, cordon or uncordon sites")
    acts = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    acts.add_parser("list", parents=[common], help="list sites")
    acts.add_parser("get", parents=[common], help="show a site").add_argument("name")
    acts.add_parser("add", parents=[common], help="register sites from a YAML or JSON file").add_argument("file")
    acts.add_parser("remove", parents=[common], help="remove a site").add_argument("name")
    cordon = acts.add_parser("cordon", parents=[common], help="place no new jobs on a site (what runs there runs on)")
    cordon.add_argument("name")
    cordon.add_argument("--reason", help="why, for the site's readers (at most 500 characters)")
    acts.add_parser("uncordon", parents=[common], help="give a cordoned site back to routing").add_argument("name")
    s = sub.add_parser("tenants", parents=[common],
                       help="each tenant's jobs and the GPUs they hold across the federation, against its limit")
    s.add_argument("--tenant", help="show only this tenant")
    s = sub.add_parser("tenant-limit", parents=[common],
                       help="set a tenant's GPU limit across the federation live, over the config's (kept by the "
                            "broker across restarts), or --reset it to the config's")
    s.add_argument("tenant")
    s.add_argument("gpus", nargs="?", metavar="GPUS", help="GPUs its jobs may hold at once (0: none start), or none "
                                                           "(unlimited)")
    s.add_argument("--reset", action="store_true", help="remove the limit set live: the config's applies again")
    s = sub.add_parser("usage", parents=[common],
                       help="GPU-hours, attempts, energy and an estimate of cost per tenant (or site, GPU model) over "
                            "a window of whole hours, for chargeback")
    s.add_argument("--from", dest="start", metavar="TIME",
                   help="start: an ISO 8601 time with a zone, or a date (UTC); taken back to the start of its hour "
                        "(default: 30 days before --to)")
    s.add_argument("--to", dest="end", metavar="TIME", help="end, taken on to the end of its hour (default: now)")
    s.add_argument("--by", metavar="KEYS", help="group by tenant, site, gpu_model or several, comma-separated "
                                                "(default: tenant)")
    s.add_argument("--tenant", help="only this tenant's usage")
    s.add_argument("--site", help="only the usage at this site")
    s.add_argument("--csv", action="store_true", help="print CSV (a row per group, for a spreadsheet)")
    s = sub.add_parser("quota", parents=[common], help="a site's quota state per tenant; --set or --remove changes it")
    s.add_argument("site")
    s.add_argument("--tenant", help="show only this tenant")
    change = s.add_mutually_exclusive_group()
    change.add_argument("--set", metavar="TENANT", help="change this tenant's quota: the fields given (a new tenant: "
                                                        "the others at their defaults)")
    change.add_argument("--remove", metavar="TENANT", help="remove this tenant's quota")
    s.add_argument("--guaranteed", type=int, help="guaranteed GPUs")
    s.add_argument("--burst", type=int, help="GPUs allowed above the guarantee")
    s.add_argument("--weight", type=float, help="fair-share weight")
    s.add_argument("--ceiling", type=int, help="priority ceiling")
    s.add_argument("--model", help="GPU model the quota counts (default: any)")
    s = sub.add_parser("watch", parents=[common], help="follow live events: job transitions, decisions, "
                                                       "deferrals, preemptions, site health")
    s.add_argument("--tenant", help="only this tenant's jobs")
    s.add_argument("--site", help="only this site and the jobs on it")
    s.add_argument("--job", help="only this job")
    s.add_argument("--type", help="only these types, comma-separated: transition,decision,deferral,preemption,site")
    s.add_argument("--count", type=_at_least_one, help="stop after this many events")
    s.add_argument("--after", type=int, metavar="ID", help="start after this event id (0: every event the broker "
                                                           "still holds, up to 10,000); default: from now")
    s = sub.add_parser("token", help="create, list or revoke API tokens (in the broker's database)")
    acts = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--config", metavar="FILE", help="the broker's YAML (its broker.db, and HELIOTROPE_BROKER__DB)")
    where.add_argument("--db", help="the database: an SQLite file or a postgresql:// URL (default: --config's, "
                                    "else var/heliotrope.db)")
    where.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    c = acts.add_parser("create", parents=[where], help="make a token; it is printed once")
    c.add_argument("--role", required=True, choices=[r.value for r in Role])
    c.add_argument("--name", required=True, help="who or what holds it (a person, a team, a CI job)")
    c.add_argument("--site", action="append", help="operator: a site it may change (repeat for several)")
    c.add_argument("--tenant", action="append", help="submitter: a tenant it acts for (repeat for several)")
    c.add_argument("--expires-in", type=float, metavar="DAYS", help="days until it stops working (default: never)")
    acts.add_parser("list", parents=[where], help="the tokens: id, holder, role, scope, expiry (never the token)")
    acts.add_parser("revoke", parents=[where], help="stop accepting a token").add_argument("id")
    s = sub.add_parser("agent", help="run a site agent next to a remote cluster; it reaches the broker over MQTT")
    s.add_argument("--config", required=True, metavar="FILE", help="the agent's YAML: site, mqtt, heartbeat_s, ...")
    s.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="DEBUG, INFO, WARNING or ERROR, in any case (default %(default)s)")
    simulation_cli.add_parser(sub)
    fairshare_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "cancel":
        _check_cancel(p, args)
    try:
        if args.command in ("serve", "demo"):
            _serve(args)
            return 0
        if args.command == "agent":
            from adapters.agent import main as agent_main  # the agent's own loop, signals and errors

            return agent_main(["--config", args.config, "--log-level", args.log_level])
        if args.command == "simulate":
            print(simulation_cli.run(args))
            return 0
        if args.command == "token":
            print(_token_command(args))
            return 0
        if args.command == fairshare_cli.COMMAND:
            print(fairshare_cli.run(args))
            return 0
        text = asyncio.run(_client_command(args))
        if text is not None:
            print(text)
        return 0
    except Incomplete as e:
        print(e.output)
        print(f"heliotrope: {e}", file=sys.stderr)
        return 3
    except ApiClientError as e:
        print(f"heliotrope: {_api_message(e)}", file=sys.stderr)
    except BrokenPipeError:
        # The reader went away (`heliotrope token create ... | head -1`): what it read was whole; say nothing.
        # Python would flush stdout again at exit and complain, so point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CliError, ValueError, OSError, StoreError) as e:
        print(f"heliotrope: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
