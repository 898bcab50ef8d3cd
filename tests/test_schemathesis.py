"""Schemathesis over the whole HTTP API of a live ``heliotrope serve``: no 5xx, every answer as the document says.

The broker runs as a real process with four simulated sites (one keeps quotas) and three jobs, and with
authentication on, called with an admin token: an admin may make every call, so nothing is left out, and
schemathesis' ``ignored_auth`` check also confirms that each operation the document marks as protected
answers 401 without a token and with a wrong one. Every operation is fuzzed with valid and invalid inputs and
all of schemathesis' default checks: ``not_a_server_error``, status code, content type, response header and
response schema conformance, invalid data rejected, valid data accepted, authentication enforced, and the
rest. Path parameters are often swapped for the sites, tenants and jobs that exist, so that the answers with
bodies (a job, its decision, a site's quota) are checked too, not only 404s.

Reproducible: a fixed seed, derandomised generation, no example database. Left out: streaming operations
(``text/event-stream``, that is ``GET /v1/events``): a stream never ends, so a fuzzed call would hang until
its timeout; tests/test_events.py reads it with bounded reads.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from broker.openapi import openapi_document
from tests.conftest import ServerProcess, free_port

pytestmark = pytest.mark.slow

SEED = 8  # issue 8; any fixed value keeps CI reproducible
MAX_EXAMPLES = 30  # per operation and generation phase: the whole file in about a minute on two CPUs
TOKEN_ENV = "HELIOTROPE_FUZZ_ADMIN_TOKEN"
TOKEN = "hlt_" + secrets.token_urlsafe(32)  # this run's admin token; the server reads it from TOKEN_ENV


def _site(name: str, region: str, zone: str, tz: str, model: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name, "region": region, "grid_zone": zone, "timezone": tz, "latitude": 50.1, "longitude": 8.7,
        "gpus": [{"model": model, "gpus_per_node": 8, "nodes": 2}],
        "adapter": {"kind": "simulated", "dispatch_delay_s": 0.01},
        **more,
    }


CONFIG = {
    "broker": {"cycle_interval_s": 0.2, "max_body_bytes": 64 * 1024,
               "auth": {"enabled": True, "admin_token_env": TOKEN_ENV}},
    "sites": [
        _site("alpha", "gcp:us-east4", "US-MIDA-PJM", "America/New_York", "a100-80gb"),
        _site("beta", "gcp:europe-west3", "DE-LU", "Europe/Berlin", "l4",
              quotas=[{"tenant": "t1", "guaranteed_gpus": 4, "burst_gpus": 4}, {"tenant": "t2", "guaranteed_gpus": 2}]),
        _site("gamma", "gcp:asia-northeast1", "JP-TK", "Asia/Tokyo", "h100-80gb"),
        _site("delta", "aws:eu-west-1", "GB", "Europe/London", "t4"),  # the one DELETE /v1/sites/{name} may hit
    ],
}

# What exists on the live server: a drawn path parameter is often swapped for one of these, so the answers
# with bodies (a job, its decision, a site's quota) are fuzzed and checked too, not only 404s. The jobs are
# submitted by the fixture: one running, one no site can take, one finished.
KNOWN: dict[str, list[str]] = {"name": ["alpha", "beta", "gamma"], "tenant": ["t1", "t2"], "id": []}
JOBS = [
    {"tenant": "t1", "name": "runs", "gpus": {"count": 2}, "duration_s": 3600},
    {"tenant": "t2", "name": "fits-nowhere", "gpus": {"count": 64}, "duration_s": 60},
    {"tenant": "t1", "name": "ends", "gpus": {"count": 1, "model": "l4"}, "duration_s": 0.1},
]

# Rules the API checks that JSON Schema cannot state: they relate two fields, a field and the path, or a
# value and the server's state or configuration. A request that breaks one may be valid by the document, so
# its 4xx is not a "valid data rejected" failure when its error body names only such rules, field by field.
# Every other rejection of valid data still fails the test, as does any 5xx or off-schema answer.
RULES_BEYOND_THE_SCHEMA = [
    ("usd_per_gpu_hour", r"prices .+, which no node group of this site has"),  # keys among gpus[].model
    ("gpus", r"\d+ GPUs in all is more than"),  # a sum over the node groups
    (r"quotas\[\d+\]\.tenant", r"each tenant may appear once"),  # unique by one property
    (r"gpus\[\d+\]\.mig_profiles", r".+ needs \d+ GiB, more than a .+ GPU here has"),  # profile vs the model
    ("denied_regions", r"regions both allowed and denied"),  # two lists disjoint
    (r"fair_share\.reweight_h", r".+ divides window_h .+ periods, more than"),  # the ratio of two fields
    (r"adapter\.telemetry\.stale_after_s", r"stale_after_s .+ is not longer than every_s"),  # two fields compared
    ("name", r"must be '.*'"),  # PUT /v1/sites/{name}: the body's name is the path's
    ("tenant", r"must be '.*'"),  # PUT .../quota/{tenant}: the body's tenant is the path's
    ("adapter.kind", r"needs broker.mqtt"),  # a site run by an agent, on a broker configured without MQTT
    # No Kubernetes cluster or credentials where the test runs (and only a Kubernetes site's adapter can fail to
    # start here: a simulated one never does, an MQTT one is refused before, by the rule above).
    ("adapter", r"could not start: site \S+: "),
    ("profile", r"may not be chosen by a job here|is not defined"),  # the federation's configured profiles
    ("cursor", r"not a cursor from a previous page"),  # opaque: only the server hands them out
    ("deadline", r"in the past"),  # a new job's deadline against the broker's clock
    # a new job's GPUs against its tenant's federation-wide limit (PUT /v1/tenants/{tenant}/limit may set one of 0)
    ("gpus", r"may hold at most \S+ across the federation"),
    (r"after(_any|_failed)?\[\d+\]", r"no job with id"),  # a job it runs after: one that exists (and the caller sees)
    (r"after\[\d+\]", r"has (failed|been cancelled): a job that runs after it would never run"),
    (r"after_failed\[\d+\]", r"has succeeded: a job that runs after it fails would never run"),
    (r"after(_any|_failed)?\[\d+\]", r"is named twice \(also after"),  # one job in two of the lists
    (r"after(_any|_failed)?\[\d+\]", r"in after, after_any and after_failed together"),  # the three lists' sum
    (r".*", r"is out of range once converted to UTC"),  # a date-time near year 1 or 9999 with an offset
    # a Kubernetes toleration's fields together (no key needs Exists, Exists no value, seconds need NoExecute)
    (r"adapter\.tolerations\[\d+\]\.(value|operator|tolerationSeconds)",
     r"takes no value|must have operator Exists|needs effect NoExecute"),
    # a Kubernetes Pod's user against its Pod Security profile (restricted: not root)
    (r"adapter\.pod_security_context", r"runAsUser 0 is root, which pod_security restricted forbids"),
    # a Kubernetes site's Prometheus: a base URL without credentials, query or fragment; PromQL label matchers only;
    # a CA bundle only for https
    (r"adapter\.telemetry\.url", r"must be|is not a URL|port 0 is no port"),
    (r"adapter\.telemetry\.selector", r"is not PromQL label matchers|may not match __name__"),
    (r"adapter\.telemetry\.ca_file", r"ca_file verifies an https server"),
    # a quota against the site's GPUs (its spec's node groups, or the site's for PUT .../quota/{tenant})
    (r"(quotas\[\d+\]\.)?model", r"the site has no \S+ GPUs"),
    (r"(quotas\[\d+\]\.)?guaranteed_gpus", r"is more than the site's"),
    # GET /v1/usage: a date or time of the right shape that is no date (month 13), and a window's two ends together
    ("from|to", r"not an ISO 8601 time"),
    ("from|to", r"must end after it starts|spans at most"),
    ("from|to", r"reaches past the dates a report can name"),  # an end of hour or 30 days past year 9999 or before 1
    ("by", r"names a key twice"),
]


def _only_rules_beyond_the_schema(response: Any) -> bool:
    try:
        fields = response.json()["error"]["fields"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(fields) and all(
        any(re.fullmatch(field, _in_the_spec(f["field"])) and re.search(problem, f["problem"])
            for field, problem in RULES_BEYOND_THE_SCHEMA)
        for f in fields
    )


def _in_the_spec(field: str) -> str:
    """A field of one spec of a list (``POST /v1/preview`` of an array names it by its index: ``[1].deadline``, and
    a rule of the whole spec ``[1]``) as the rules name a field of a spec sent alone."""
    return re.sub(r"^\[\d+\]\.?", "", field) or "(body)"


def _streams(ctx: Any) -> bool:
    """An operation that answers a stream (``text/event-stream``): it never ends, so it is not fuzzed here."""
    responses = ctx.operation.definition.raw.get("responses", {})
    return any("text/event-stream" in (r.get("content") or {}) for r in responses.values() if isinstance(r, dict))


# Built here as the server builds it, and checked below to be what the live server serves. (Loading it from
# the live server in a fixture, ``schemathesis.pytest.from_fixture``, fails under pytest 9.2: schemathesis
# 4.32's lazy loader writes ``Node._nodeid``, which pytest 9.2 no longer has.)
schema = schemathesis.openapi.from_dict(
    openapi_document(),
    config=schemathesis.Config.from_dict({
        "seed": SEED,
        # Every request carries the admin token (below) rather than a generated one, which could only be
        # refused; the ignored_auth check still sends each operation without a token and with a wrong one.
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none",
                       "with-security-parameters": False},
    }),
).exclude(_streams)


@schema.hook
def filter_failure(context: Any, failure: Any, case: schemathesis.Case, response: Any) -> bool:
    """Keep every failure but a valid-by-the-document request refused for a rule the document cannot state, and a
    request whose body is over the broker's byte limit refused for it (413) before its content is read, valid or
    not (an array of many job specs for ``POST /v1/preview``: the document cannot state a size in bytes)."""
    kind = type(failure).__name__
    if kind in ("RejectedPositiveData", "AcceptedNegativeData") and _over_the_byte_limit(response):
        return False
    return not (kind == "RejectedPositiveData" and _only_rules_beyond_the_schema(response))


def _over_the_byte_limit(response: Any) -> bool:
    body = response.request.body
    return response.status_code == 413 and body is not None and len(body) > CONFIG["broker"]["max_body_bytes"]


@schema.hook
def map_query(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
    """A log followed (``follow=true``) streams until its attempt ends, an hour for the running jobs here: it is read
    without follow instead (the stream itself is tested in tests/test_job_logs.py). Other values are left alone."""
    if query and context.operation.path == "/v1/jobs/{id}/logs" and query.get("follow") in ("true", "1"):
        return {**query, "follow": "false"}
    return query


@schema.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any] | None) -> st.SearchStrategy[Any]:
    """Each drawn path parameter, or one of the resources that exist; but a value the document says is invalid
    is left alone (a negative case's), so that no invalid request is made valid behind schemathesis' back."""
    if not path_parameters:
        return st.just(path_parameters)
    removes_a_site = (context.operation.method.upper(), context.operation.path) == ("DELETE", "/v1/sites/{name}")
    known = {**KNOWN, "name": ["delta"]} if removes_a_site else KNOWN
    patterns = {p.name: p.definition.get("schema", {}).get("pattern", "") for p in context.operation.path_parameters}

    def swappable(key: str, value: Any) -> bool:
        return bool(known.get(key)) and isinstance(value, str) and re.search(patterns.get(key, ""), value) is not None

    return st.fixed_dictionaries({
        key: st.sampled_from([value, *known[key]]) if swappable(key, value) else st.just(value)
        for key, value in path_parameters.items()
    })


def _call(url: str, method: str = "GET", body: Any = None) -> Any:
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp: Path = tmp_path_factory.mktemp("schemathesis")
    cfg = tmp / "config.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    port = free_port()
    srv = ServerProcess(f"http://127.0.0.1:{port}", port, tmp / "broker.db", cfg, log=tmp / "server.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TOKEN_ENV, TOKEN)
        srv.start()
    KNOWN["id"] = [_call(srv.url + "/v1/jobs", "POST", job)["id"] for job in JOBS]
    deadline = time.monotonic() + 10
    while _call(f"{srv.url}/v1/jobs/{KNOWN['id'][2]}")["state"] != "succeeded":
        assert time.monotonic() < deadline, "the short job did not finish in 10 s"
        time.sleep(0.05)
    yield srv
    srv.stop()


def test_the_live_server_serves_the_document_that_is_fuzzed_and_every_path_but_the_stream_is_fuzzed(
    live_server: ServerProcess,
) -> None:
    with urllib.request.urlopen(live_server.url + "/openapi.json", timeout=5) as r:
        served = json.load(r)
    assert served == json.loads(json.dumps(openapi_document()))
    fuzzed = {op.path for op in (result.ok() for result in schema.get_all_operations())}
    assert set(served["paths"]) - fuzzed == {"/v1/events"}


@schema.parametrize()
@settings(deadline=None, derandomize=True, database=None, max_examples=MAX_EXAMPLES,
          # The server is another process on a shared machine: a slow answer is not the code under test.
          suppress_health_check=[HealthCheck.too_slow])
def test_every_operation_answers_as_its_document_says_and_never_with_a_5xx(
    case: schemathesis.Case, live_server: ServerProcess
) -> None:
    case.call_and_validate(base_url=live_server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
