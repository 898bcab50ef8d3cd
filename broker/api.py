"""HTTP API (aiohttp, JSON, under ``/v1``).

Sites:  ``POST /v1/sites``, ``GET /v1/sites``, ``GET|PUT|DELETE /v1/sites/{name}``,
        ``POST /v1/sites/{name}/cordon`` (body optional: ``{"reason": "..."}``; no new jobs are placed there,
        what runs there runs on) and ``POST /v1/sites/{name}/uncordon``
Quotas: ``GET /v1/sites/{name}/quota[?tenant=T]`` (the site's own report: per tenant guaranteed, burst, in use,
        borrowed, fair share now, decayed usage, why its jobs wait), ``PUT|DELETE /v1/sites/{name}/quota/{tenant}``
        (the site operator's change, kept by the site across restarts; the body is a TenantQuota, ``tenant``
        taken from the path)
Jobs:   ``POST /v1/jobs`` (``Idempotency-Key`` header honoured),
        ``GET /v1/jobs?state=&tenant=&site=&label=KEY=VALUE&label=KEY&limit=&cursor=``,
        ``GET /v1/jobs/{id}``, ``POST /v1/jobs/{id}/cancel`` (and ``DELETE /v1/jobs/{id}``),
        ``POST /v1/cancellations`` (many jobs at once, by tenant, labels, state and site),
        ``GET /v1/jobs/{id}/decision``, ``GET /v1/jobs/{id}/events``,
        ``GET /v1/jobs/{id}/logs?attempt=&tail=&follow=`` (what an attempt printed, as its site gives it;
        text/plain; ``follow=true``: then what it prints, streamed, until it ends)
Live:   ``GET /v1/events?tenant=&site=&job=&type=`` (server-sent events, :mod:`broker.events`),
        ``GET /v1/carbon`` (carbon of placements against a carbon-agnostic choice, :mod:`broker.carbon_ledger`),
        ``GET /v1/tenants`` (each tenant's jobs and the GPUs it holds against its federation-wide limit),
        ``PUT|DELETE /v1/tenants/{tenant}/limit`` (an admin's override of the tenant's limit, ``{"gpus": N}``, null:
        unlimited; kept in the store; DELETE: the configuration's limit again: :mod:`broker.limits`),
        ``GET /v1/usage?from=&to=&by=&tenant=&site=`` (GPU-hours, energy and cost per tenant, site or model over
        whole hours, for chargeback: :mod:`broker.usage`)
Other:  ``GET /healthz`` (liveness), ``GET /readyz`` (readiness: the store answers), ``GET /openapi.json``,
        ``GET /metrics``, ``GET /v1/whoami``

Authentication (``broker.auth.enabled``): ``Authorization: Bearer TOKEN`` on every call but ``/healthz``,
``/openapi.json`` and the dashboard's static files; 401 without a valid token, 403 for a role that may not
make the call (``ACCESS``), 404 for a job of another tenant. :mod:`broker.auth` has the roles.

Lists answer ``{"items": [...], "next": CURSOR}``; pass ``cursor=CURSOR`` for the next page (``next`` is
null on the last). Every error is JSON::

    {"error": {"status": 422, "message": "...", "fields": [{"field": "gpus.count", "problem": "..."}]}}

422 for an invalid spec, 400 for malformed JSON or query parameters, 401, 403, 404, 409, 413 for a body over
the limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import replace
from datetime import UTC, date, datetime
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Annotated, Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from broker import auth
from broker import dashboard
from broker import usage
from broker.auth import Principal, Role, TokensUnavailable, Unauthenticated
from broker.cycle import Ahead
from broker.errors import integral_float, is_malformed_json, problems
from broker.events import TYPES as EVENT_TYPES
from broker.events import Event, frame
from broker.federation import Member, QuotaNotTaken, QuotaRefused, without_secrets
from broker.ids import GPU_MODEL_IDS
from broker.after import KINDS, Kind, dependencies, never_reason, unmet, waiting_reason
from broker.jobs import IdempotencyConflict, JobNotFound, NotQueued, PastDeadline, TenantUsage, check_deadline
from broker.metrics import ScopedView
from policies.profiles import ProfileError
from policies.quota import QuotaBeyondSite
from broker.lifecycle import AlreadyEnded
from adapters.base import AdapterError, LogFollow, LogFollower, LogReader, LogsNotFound, LogsUnsupported, QuotaAdmin
from broker.models import (AFTER_MAX, PREVIEW_LIST_MAX, SITE_READ_ONLY_KEYS, Cancellation, Decision, Job, JobChange,
                           JobSpec, JobState, Preview, QuotaState, SiteSpec, Slug, TenantLimitChange, TenantQuota,
                           clean_text, labels_problem)
from broker.openapi import openapi_document
from broker.providers.carbon import ProviderError
from broker.service import Broker, SiteConflict, SiteUnsupported
from broker.store import JobFilter, StoreError
from policies import explain
from policies.snapshot import JobRequest, gpus_charged
from policies.tenant_limit import SOURCE_WORDS, TenantLimits

log = logging.getLogger(__name__)

BROKER = web.AppKey("broker", Broker)
PRINCIPAL = web.RequestKey("heliotrope.principal", Principal)  # who is calling (broker.auth)
PROXY = web.AppKey("proxy", aiohttp.ClientSession)
RELAYS = web.AppKey("relays", set)  # tasks relaying the leader's event stream (ended at shutdown)
FOLLOWS = web.AppKey("follows", set)  # tasks following a job's log (ended at shutdown; at most MAX_LOG_FOLLOWS)
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)  # a follower's connection to the leader, made on first use
MAX_PAGE = 1000


class ApiError(web.HTTPException):
    """An error answered as JSON: ``status``, ``message`` and optionally the offending ``fields``."""

    def __init__(self, status: int, message: str, fields: list[dict[str, str]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        body: dict[str, Any] = {"status": status, "message": message}
        if fields:
            body["fields"] = fields
        super().__init__(text=json.dumps({"error": body}), content_type="application/json", headers=headers)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    if isinstance(data, BaseModel):
        text = data.model_dump_json()
    else:
        text = json.dumps(data, default=str)
    return web.Response(text=text, status=status, content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError:
        raise
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[BROKER].settings.max_body_bytes
        raise ApiError(413, f"request body is larger than the limit of {limit} bytes",
                       [{"field": "(body)", "problem": "too large"}]) from None
    except web.HTTPNotFound:
        raise ApiError(404, f"no such endpoint: {request.method} {request.path}") from None
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        raise ApiError(405, f"{request.method} is not allowed on {request.path}; allowed: {allowed}",
                       headers={"Allow": allowed}) from None  # RFC 9110: a 405 names the methods allowed
    except web.HTTPException as e:
        if e.status >= 400:
            raise ApiError(e.status, e.reason or "error") from None
        raise
    except StoreError as e:
        log.error("%s %s: store error: %s", request.method, request.path, e)
        if request.method in ("GET", "HEAD"):  # a read changes nothing: say what failed
            raise ApiError(503, "the broker could not read its store; try again") from None
        raise ApiError(503, "the broker could not write to its store; nothing was changed, try again") from None
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        raise ApiError(500, "internal error; the broker's log has the details") from None


# --- who may call what ---

OPEN = object()  # no token needed
ANY = frozenset(Role)
ADMIN = frozenset({Role.ADMIN})
OPERATORS = frozenset({Role.ADMIN, Role.OPERATOR})
SUBMITTERS = frozenset({Role.ADMIN, Role.SUBMITTER})
SITE = "site operator"  # admin, or an operator of the site the path names

ACCESS: dict[tuple[str, str], Any] = {
    ("POST", "/v1/sites"): ADMIN,
    ("GET", "/v1/sites"): ANY,  # a view per role: secrets never, adapters and quotas to the site's operators
    ("GET", "/v1/sites/{name}"): ANY,
    ("PUT", "/v1/sites/{name}"): SITE,
    ("DELETE", "/v1/sites/{name}"): ADMIN,
    ("POST", "/v1/sites/{name}/cordon"): SITE,
    ("POST", "/v1/sites/{name}/uncordon"): SITE,
    ("GET", "/v1/sites/{name}/quota"): ANY,  # operators of the site; submitters see their own tenants' rows
    ("PUT", "/v1/sites/{name}/quota/{tenant}"): SITE,
    ("DELETE", "/v1/sites/{name}/quota/{tenant}"): SITE,
    ("POST", "/v1/jobs"): SUBMITTERS,  # for a tenant the token acts for
    ("POST", "/v1/preview"): SUBMITTERS,  # likewise
    ("GET", "/v1/jobs"): ANY,  # submitters: their tenants' jobs; operators: jobs on their sites
    ("GET", "/v1/jobs/{id}"): ANY,  # 404 for a job the caller may not see
    ("POST", "/v1/jobs/{id}/cancel"): SUBMITTERS,
    ("PATCH", "/v1/jobs/{id}"): SUBMITTERS,
    ("DELETE", "/v1/jobs/{id}"): SUBMITTERS,
    ("POST", "/v1/cancellations"): SUBMITTERS,  # of the tenants the token acts for; others' jobs are not matched
    ("GET", "/v1/jobs/{id}/decision"): ANY,
    ("GET", "/v1/jobs/{id}/events"): ANY,
    ("GET", "/v1/jobs/{id}/logs"): ANY,  # 404 for a job the caller may not see
    ("GET", "/v1/events"): ANY,  # filtered to what the caller may see
    ("GET", "/v1/carbon"): ANY,
    ("GET", "/v1/usage"): SUBMITTERS,  # a submitter its own tenants' (as /v1/tenants)
    ("GET", "/v1/tenants"): SUBMITTERS,  # a submitter its own tenants' (a tenant's figures are not an operator's)
    ("PUT", "/v1/tenants/{tenant}/limit"): ADMIN,  # the platform team's, as the configuration's limits are
    ("DELETE", "/v1/tenants/{tenant}/limit"): ADMIN,
    ("GET", "/v1/whoami"): ANY,
    ("GET", "/metrics"): OPERATORS,
    ("GET", "/healthz"): OPEN,
    ("GET", "/readyz"): OPEN,
    ("GET", "/openapi.json"): OPEN,
}
"""Every route's rule; a route missing here is for admins only. The dashboard's static files are open."""

UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="heliotrope"'}


def not_your_tenant(who: Principal, tenant: str, at: str = "") -> ApiError:
    """403 for ``tenant``, named where ``at`` says (a spec's place in a list: ``[1].``)."""
    return ApiError(403, f"{at}tenant: " * bool(at) + f"{who.name} acts for tenants {', '.join(sorted(who.tenants))}, "
                    f"not {tenant}", [{"field": f"{at}tenant", "problem": "not a tenant this token acts for"}])


def not_your_site(who: Principal, site: str) -> ApiError:
    return ApiError(403, f"{who.name} operates sites {', '.join(sorted(who.sites))}, not {site}",
                    [{"field": "site", "problem": "not a site this token operates"}])


def principal(request: web.Request) -> Principal:
    return request.get(PRINCIPAL) or auth.ANONYMOUS_ADMIN


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Who is calling, and whether their role may make this call at all (scoping by site, tenant and job is
    each handler's, through :func:`principal`)."""
    match = request.match_info
    if match.http_exception is not None:  # no such route or method: answered as such, token or not
        return await handler(request)
    pattern = match.route.resource.canonical if match.route.resource is not None else request.path
    rule = ACCESS.get(("GET" if request.method == "HEAD" else request.method, pattern), ADMIN)
    if rule is OPEN or pattern == "/" or pattern.startswith("/dashboard"):
        return await handler(request)
    try:
        who = await request.app[BROKER].tokens.authenticate(request.headers.get("Authorization"))
    except Unauthenticated as e:
        raise ApiError(401, str(e), [{"field": "Authorization", "problem": str(e)}], headers=UNAUTHORIZED) from None
    except TokensUnavailable as e:
        raise ApiError(503, str(e), headers={"Retry-After": "2"}) from None
    if rule == SITE:
        allowed = who.operates(match.get("name"))
    else:
        allowed = who.role in rule
    if not allowed:
        scope = f" for sites {', '.join(sorted(who.sites))}" if who.role == Role.OPERATOR else (
            f" for tenants {', '.join(sorted(who.tenants))}" if who.role == Role.SUBMITTER else "")
        raise ApiError(403, f"{who.name} ({who.role}{scope}) may not {request.method} {request.path}")
    request[PRINCIPAL] = who
    return await handler(request)


LOG_HEADERS = ("X-Heliotrope-Site", "X-Heliotrope-Attempt", "X-Heliotrope-Log-Truncated", "X-Heliotrope-Log-Source")
"""What ``GET /v1/jobs/{id}/logs`` says about its text in headers (the body is the text itself)."""


ANY_REPLICA: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/openapi.json"),
    ("GET", "/metrics"),
    ("GET", "/v1/whoami"),
)
"""What every replica serves itself: submissions (stored at once; the leader takes them in) and reads of
jobs, which come from the shared store. Everything else (sites, quotas, cancels) changes what the leader
holds in memory, and a replica that does not lead passes it on to the leader."""


FORWARDED = "X-Heliotrope-Forwarded-By"  # set on a request one replica passes on to another: never passed on again
PASSED_BACK = ("content-type", "location", "retry-after", "idempotent-replayed", *(h.lower() for h in LOG_HEADERS))


def _any_replica(request: web.Request) -> bool:
    path = request.path.rstrip("/")
    if (request.method, path) in ANY_REPLICA:
        return True
    if request.method in ("GET", "HEAD") and (path == "" or path.startswith("/dashboard")):
        return True  # the dashboard's static files: every replica has them
    # (a job's logs come from its site, through the adapters only the leader runs)
    return request.method == "GET" and path.startswith("/v1/jobs/") and not path.endswith("/logs")


@web.middleware
async def follower_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """On a replica that does not lead, pass what only the leader may do on to the leader."""
    broker = request.app[BROKER]
    if broker.in_charge or _any_replica(request):
        return await handler(request)
    assert broker.leadership is not None
    leader = await broker.leadership.leader_url()
    if leader is None or request.headers.get(FORWARDED):
        # Nobody leads, this one is taking over, or the replica that passed it on took this one for the leader.
        raise ApiError(503, "no replica leads right now (an election or a takeover is under way); try again in a "
                            "few seconds")
    session: aiohttp.ClientSession | None = request.app.get(PROXY)
    if session is None or session.closed:
        # Longer than anything the leader may take to answer (a cancel waits up to the dispatch timeout).
        timeout = aiohttp.ClientTimeout(total=2 * broker.settings.dispatch_timeout_s + 10)
        from broker.server import forwarding_tls_context  # (server imports this module)

        tls = forwarding_tls_context(broker.settings.tls)  # None: plain HTTP
        session = request.app[PROXY] = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(ssl=tls) if tls is not None else None)
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "idempotency-key",
                                                                         "authorization", "accept", "last-event-id")}
    headers[FORWARDED] = broker.leadership.url
    if request.path.rstrip("/") == "/v1/events" or (request.path.rstrip("/").endswith("/logs")
                                                     and request.query.get("follow") in FOLLOW_TRUE):
        return await _relay_stream(request, session, leader, headers)
    try:
        async with session.request(request.method, leader.rstrip("/") + request.path_qs, headers=headers,
                                   data=await request.read()) as answer:
            body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() in PASSED_BACK}
            return web.Response(status=answer.status, body=body, headers={**kept, "X-Heliotrope-Leader": leader})
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ApiError(503, f"the leader at {leader} did not answer ({e}); try again in a few seconds") from None


async def _relay_stream(request: web.Request, session: aiohttp.ClientSession, leader: str,
                        headers: dict[str, str]) -> web.StreamResponse:
    """The leader's event stream (or a job's log it follows), passed through as it comes: a client of any replica
    (behind one Service address) follows the leader's events. It ends when the leader's ends (the leader stopped or
    stepped down: the client reconnects, with Last-Event-ID, to whoever leads next), when this replica stops, or
    when the client has left (looked at every ``LOG_FOLLOW_CHECK_S`` while the stream is quiet: a quiet log writes
    nothing that would fail, and the leader holds the site's stream for as long as this relay's connection)."""
    relays: set[asyncio.Task[Any]] = request.app[RELAYS]
    task = asyncio.current_task()
    assert task is not None
    relays.add(task)
    resp: web.StreamResponse | None = None
    try:
        async with session.get(leader.rstrip("/") + request.path_qs, headers=headers, timeout=STREAM_TIMEOUT) as up:
            if up.status != 200:
                body = await up.read()
                kept = {k: v for k, v in up.headers.items() if k.lower() in PASSED_BACK}
                return web.Response(status=up.status, body=body, headers={**kept, "X-Heliotrope-Leader": leader})
            kept = {k: v for k, v in up.headers.items() if k.lower() in PASSED_BACK}
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **kept, "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", "X-Heliotrope-Leader": leader})
            await resp.prepare(request)
            while True:
                try:
                    async with asyncio.timeout(LOG_FOLLOW_CHECK_S):
                        chunk = await up.content.readany()
                except TimeoutError:
                    if request.transport is None or request.transport.is_closing():
                        break  # the client left while the stream was quiet: closing ours tells the leader
                    continue
                if not chunk:
                    break
                await resp.write(chunk)
    except (aiohttp.ClientError, TimeoutError) as e:
        if resp is None:
            raise ApiError(503, f"the leader at {leader} did not answer ({e}); try again in a few seconds") from None
        if request.path.rstrip("/").endswith("/logs"):
            _cut(request)  # the leader cut the followed log short (_follow_logs): so is it here
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the client left, or this replica is stopping
    finally:
        relays.discard(task)
    return resp if resp is not None else web.Response(status=503)


async def _end_streams(app: web.Application) -> None:
    """At shutdown: end every event stream (this replica's, and those it relays from the leader), so that
    requests in flight, not streams, are what it waits for."""
    app[BROKER].events.end_streams()
    for task in (*app[RELAYS], *app[FOLLOWS]):
        task.cancel()


async def _close_proxy(app: web.Application) -> None:
    session = app.get(PROXY)
    if session is not None:
        await session.close()


def _validated(model: type[BaseModel] | TypeAdapter[Any], data: Any) -> Any:
    """``data`` (JSON bytes, or parsed JSON) as ``model``, strictly: the JSON types the OpenAPI document states
    (no "3" or true for a number), though 2.0 is an integer, as JSON Schema has it."""
    if isinstance(model, TypeAdapter):
        validate = model.validate_json if isinstance(data, bytes) else model.validate_python
    else:
        validate = model.model_validate_json if isinstance(data, bytes) else model.model_validate
    try:
        return validate(data, strict=True)
    except ValidationError as e:
        if not all(integral_float(err) for err in e.errors(include_url=False)):
            raise  # problems() leaves out the 2.0s
    return validate(data)


async def _read(request: web.Request) -> bytes:
    """The request's body (read once: aiohttp keeps it for the next read)."""
    try:
        return await request.read()
    except web.HTTPException:
        raise
    except Exception as e:  # a body that cannot be read: bad encoding, cut-off chunks
        raise ApiError(400, f"the request body could not be read: {e}",
                       [{"field": "(body)", "problem": "unreadable"}]) from None


async def _body(request: web.Request, model: type[BaseModel], what: str,
                defaults: dict[str, Any] | None = None,
                read_only: dict[str, str] | None = None) -> tuple[Any, bytes]:
    """The body validated as ``model``; ``defaults`` fill fields a JSON object body leaves out (the path's);
    ``read_only``: top-level keys that the resource has as read but a body may not carry, each with its problem."""
    raw = await _read(request)
    if not raw.strip():
        raise ApiError(400, f"the request body must be a JSON {what}", [{"field": "(body)", "problem": "empty"}])
    try:
        if defaults:
            try:
                doc = json.loads(raw)
            except ValueError as e:
                raise ApiError(400, f"malformed JSON: {e}", [{"field": "(body)", "problem": str(e)}]) from None
            if isinstance(doc, dict):
                doc = {**defaults, **doc}
            return _validated(model, doc), raw
        return _validated(model, raw), raw
    except ValidationError as e:
        if is_malformed_json(e):
            detail = e.errors(include_url=False)[0]["msg"]
            raise ApiError(400, f"malformed JSON: {detail}", [{"field": "(body)", "problem": detail}]) from None
        fields = problems(e, read_only)
        raise ApiError(422, f"invalid {what}: " + "; ".join(f"{f['field']}: {f['problem']}" for f in fields),
                       fields) from None


def _query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ApiError(400, f"query parameter {name} must be an integer from {lo} to {hi}",
                       [{"field": name, "problem": f"must be an integer from {lo} to {hi}, got {raw!r}"}])
    return value


# --- sites ---


def _site_json(member: Member, who: Principal, signals: dict[str, Any] | None = None) -> dict[str, Any]:
    """A site as ``who`` may see it: never its secrets; its adapter settings and quota list only to its
    operators; the quota state of the caller's own tenants only to a submitter."""
    doc = auth.redact_site(member.spec.model_dump(mode="json"))
    status = member.public_state().model_dump(mode="json")
    if not who.operates(member.spec.name):
        doc.pop("adapter", None)
        doc.pop("quotas", None)
        quota = status.get("quota")
        if quota is not None:
            quota["tenants"] = [t for t in quota["tenants"] if who.acts_for(t["tenant"])]
    out = {**doc, "status": status}
    if signals is not None:
        out["signals"] = signals.get(member.spec.name, {"carbon_g_per_kwh": None, "usd_per_gpu_hour": {}})
    return out


def _site_signals(broker: Broker) -> dict[str, dict[str, Any]]:
    """What routing sees of each site now: the grid's carbon intensity (gCO2e/kWh, None unknown) and the
    price of a GPU-hour of each model it has."""
    fed = broker.federation
    if not fed.members:
        return {}
    snap = fed.freeze(broker.clock.now())
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(snap.sites):
        carbon = float(snap.carbon_g_per_kwh[i]) if snap.carbon_g_per_kwh.size else math.nan
        prices = {GPU_MODEL_IDS[m]: round(float(snap.usd_per_gpu_hour[i, m]), 6)
                  for m in np.flatnonzero(snap.total_gpus[i] > 0) if math.isfinite(float(snap.usd_per_gpu_hour[i, m]))}
        out[name] = {"carbon_g_per_kwh": round(carbon, 3) if math.isfinite(carbon) else None,
                     "usd_per_gpu_hour": prices}
    return out


def _adapter_failed(e: AdapterError, spec: SiteSpec) -> ApiError:
    """A site whose adapter cannot start with its spec (credentials that do not load, a cluster that does not
    answer): the spec cannot be used as it is. The error names the site's secrets by their field (a site
    operator's update keeps a kubeconfig it is never sent, and the adapter's error may name its path); the
    broker's log keeps the full text."""
    log.warning("site %s: its adapter could not start with the spec sent: %s", spec.name, e)
    why = without_secrets(spec, str(e))
    return ApiError(422, f"the site's adapter could not start: {why}",
                    [{"field": "adapter", "problem": f"could not start: {why}"}])


def _check_quotas(spec: SiteSpec) -> None:
    """A quota for GPUs the site does not have is refused here (a stored one still loads: see TenantQuota.beyond)."""
    problems = spec.quota_problems()
    if problems:
        raise ApiError(422, "invalid site spec: " + "; ".join(f"{p['field']}: {p['problem']}" for p in problems),
                       problems)


async def create_site(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    spec, _ = await _body(request, SiteSpec, "site spec", read_only=SITE_READ_ONLY_KEYS)
    _check_quotas(spec)
    try:
        member = await broker.register_site(spec)
    except SiteConflict as e:
        raise ApiError(409, str(e), [{"field": "name", "problem": "already registered"}]) from None
    except SiteUnsupported as e:
        raise ApiError(422, str(e), [{"field": "adapter.kind", "problem": "needs broker.mqtt"}]) from None
    except AdapterError as e:
        raise _adapter_failed(e, spec) from None
    return _json(_site_json(member, principal(request)), 201, headers={"Location": f"/v1/sites/{spec.name}"})


def _takes_no_query(request: web.Request) -> None:
    """400 naming the parameter for a query on a route that takes none: a misspelt filter (``/v1/sites?region=``)
    must not answer as if it had been applied, as the routes that take parameters refuse one they do not know."""
    if request.query:
        name = next(iter(request.query))
        raise ApiError(400, f"unknown query parameter {name[:80]!r}; {request.method} {request.path} takes none",
                       [{"field": name[:80], "problem": "unknown parameter"}])


async def list_sites(request: web.Request) -> web.Response:
    _takes_no_query(request)
    broker = request.app[BROKER]
    members = sorted(broker.federation.members.values(), key=lambda m: m.spec.name)
    signals = _site_signals(broker)
    return _json({"items": [_site_json(m, principal(request), signals) for m in members], "next": None})


def _member(request: web.Request) -> Member:
    name = request.match_info["name"]
    member = request.app[BROKER].federation.get(name)
    if member is None:
        raise ApiError(404, f"no site named {name}")
    return member


async def get_site(request: web.Request) -> web.Response:
    _takes_no_query(request)
    return _json(_site_json(_member(request), principal(request), _site_signals(request.app[BROKER])))


REBUILD_FIELDS = ("gpus", "adapter", "fair_share")  # a change to these rebuilds the site's adapter (needs_rebuild)


def _rebuild_fields(old: SiteSpec | None, new: SiteSpec) -> list[dict[str, str]]:
    """The fields of a refused update that would rebuild the site's adapter under its active jobs."""
    if old is None:
        return []
    return [{"field": f, "problem": "cannot change while jobs are active on the site"}
            for f in REBUILD_FIELDS if getattr(old, f) != getattr(new, f)]


async def update_site(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    spec, _ = await _body(request, SiteSpec, "site spec", read_only=SITE_READ_ONLY_KEYS)
    if spec.name != name:
        raise ApiError(422, f"the body names site {spec.name!r} but the path names {name!r}",
                       [{"field": "name", "problem": f"must be {name!r}"}])
    _check_quotas(spec)
    who = principal(request)
    # The stored spec the update replaces is read under the broker's site lock, when the change is made: read
    # before, an update under way (another admin's new kubeconfig) would be undone by the secrets kept from
    # the copy, and an operator's PUT checked against a spec that is no longer the site's.
    replaced: SiteSpec | None = None

    def prepare(sent: SiteSpec, current: SiteSpec) -> SiteSpec:
        nonlocal spec, replaced
        replaced = current
        kept = auth.keep_secrets(sent, current)
        if not who.admin:
            changed = auth.credential_changes(current.adapter, kept.adapter)
            if changed:
                # These pick credentials (a kubeconfig, its context, the broker's service account) or where the
                # broker writes: an operator could aim its site at another's cluster, or at another site's
                # namespaces on a shared one. Platform admins only.
                raise ApiError(403, f"{who.name} may change site {name}'s GPUs, prices, quotas, labels and adapter "
                                    f"settings, but not {', '.join('adapter.' + f for f in changed)} (they select "
                                    "credentials or where the broker writes); ask a platform admin",
                               [{"field": f"adapter.{f}", "problem": "only an admin may change it"}
                                for f in changed])
        spec = kept  # what the errors below name (without its secrets)
        return kept

    try:
        member = await request.app[BROKER].update_site(spec, prepare)
    except KeyError:
        raise ApiError(404, f"no site named {name}") from None
    except SiteConflict as e:
        raise ApiError(409, str(e), _rebuild_fields(replaced, spec)) from None
    except SiteUnsupported as e:
        raise ApiError(422, str(e), [{"field": "adapter.kind", "problem": "needs broker.mqtt"}]) from None
    except QuotaRefused as e:  # the site's own GPUs are fewer than the spec says: no retry will change that
        i = next((i for i, q in enumerate(spec.quotas) if q.tenant == e.tenant), 0)
        raise ApiError(422, f"{without_secrets(spec, str(e))}; the site's spec is unchanged",
                       [{"field": f"quotas[{i}].{e.field}", "problem": e.problem}]) from None
    except QuotaNotTaken as e:
        # The site did not answer: its spec is as it was, and the change may be sent again.
        log.warning("site %s: %s", name, e)
        raise ApiError(503, f"{without_secrets(spec, str(e))}; the site's spec is unchanged, send it "
                            "again once the site answers", [{"field": "quotas", "problem": "the site did not take them"}],
                       headers={"Retry-After": "5"}) from None
    except AdapterError as e:
        raise _adapter_failed(e, spec) from None
    return _json(_site_json(member, principal(request)))


class CordonRequest(BaseModel):
    """The optional body of ``POST /v1/sites/{name}/cordon``."""

    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=500, description="why, in the operator's words")


class UncordonRequest(BaseModel):
    """The body of ``POST /v1/sites/{name}/uncordon``, best left out: it has no fields (``{}`` is taken)."""

    model_config = ConfigDict(extra="forbid")


# (a reason sent to uncordon was dropped without a word, as was a body that is no JSON at all)
UNCORDON_TAKES_NO_REASON = {"reason": "an uncordon takes no reason (the cordon's reason is cleared): leave the "
                                      "body out"}


async def cordon_site(request: web.Request) -> web.Response:
    """Take a site out of routing (no new placements; what runs there runs on) or give it back. A body that is
    sent is checked either way: malformed JSON is a 400, a key the request does not take a 422 naming it."""
    name = request.match_info["name"]
    cordon = request.path.rstrip("/").endswith("/cordon")
    reason = None
    if cordon and (await request.read()).strip():
        reason = (await _body(request, CordonRequest, "cordon request"))[0].reason
    elif not cordon and (await request.read()).strip():
        await _body(request, UncordonRequest, "uncordon request", read_only=UNCORDON_TAKES_NO_REASON)
    broker = request.app[BROKER]
    try:
        # (the spec is read when the change is made: a PUT under way is not undone by a copy from before it;
        # cordoned again with no reason, the first one stands)
        member = await broker.cordon_site(name, cordon, reason)
    except KeyError:
        raise ApiError(404, f"no site named {name}") from None
    log.info("site %s %s by %s%s", name, "cordoned" if cordon else "uncordoned", principal(request).name,
             f" ({reason})" if reason else "")
    return _json(_site_json(member, principal(request)))


async def delete_site(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        await request.app[BROKER].remove_site(name)
    except KeyError:
        raise ApiError(404, f"no site named {name}") from None
    except SiteConflict as e:
        raise ApiError(409, str(e)) from None
    return web.Response(status=204)


# --- site quotas (the site owns them; the broker relays) ---


def _quota_admin(member: Member) -> QuotaAdmin:
    if not isinstance(member.adapter, QuotaAdmin):
        raise ApiError(501, f"site {member.spec.name}'s adapter ({member.spec.adapter.kind}) does not report quotas")
    return member.adapter


def _surely_leads(request: web.Request) -> None:
    """A quota change is a call to a site, as a dispatch is: among replicas, only while this one surely
    leads (a leader that lost its lease without knowing yet must not change a site behind the new one)."""
    if not request.app[BROKER].may_act():
        raise ApiError(503, "this replica is not sure it still leads (its lease is being renewed or was lost); "
                            "try again in a few seconds", headers={"Retry-After": "2"})


async def _ask_site(member: Member, call: Awaitable[QuotaState]) -> QuotaState:
    try:
        return await call
    except AdapterError as e:
        raise ApiError(503, f"site {member.spec.name} did not answer: {e}") from None


def _quota_json(member: Member, state: QuotaState, tenant: str | None = None) -> dict[str, Any]:
    body = {"site": member.spec.name, **state.model_dump(mode="json")}
    if tenant is not None:
        body["tenants"] = [t for t in body["tenants"] if t["tenant"] == tenant]
    return body


QUOTA_FILTERS = ("tenant",)


async def get_quota(request: web.Request) -> web.Response:
    who = principal(request)
    unknown = [name for name in request.query if name not in QUOTA_FILTERS]
    if unknown:  # a misspelt ?tenant= must not answer with every tenant's row, as if they all had matched
        raise ApiError(400, f"unknown query parameter {unknown[0]!r}; a site's quota state is filtered by "
                            f"{', '.join(QUOTA_FILTERS)}",
                       [{"field": name, "problem": "unknown parameter"} for name in unknown])
    member = _member(request)
    if who.role == Role.OPERATOR and not who.operates(member.spec.name):
        raise not_your_site(who, member.spec.name)
    tenant = request.query.get("tenant")
    if tenant == "":  # (as on the job list: no tenant has an empty name)
        raise ApiError(400, "tenant is empty; give a tenant's name, or leave the parameter out",
                       [{"field": "tenant", "problem": "empty"}])
    if tenant is not None and who.role == Role.SUBMITTER and not who.acts_for(tenant):
        raise not_your_tenant(who, tenant)
    state = await _ask_site(member, _quota_admin(member).quota())
    body = _quota_json(member, state, tenant)
    if who.role == Role.SUBMITTER:
        body["tenants"] = [t for t in body["tenants"] if who.acts_for(t["tenant"])]
    return _json(body)


async def set_quota(request: web.Request) -> web.Response:
    member = _member(request)
    tenant = request.match_info["tenant"]
    admin = _quota_admin(member)
    quota, _ = await _body(request, TenantQuota, "tenant quota", defaults={"tenant": tenant})
    if quota.tenant != tenant:
        raise ApiError(422, f"the body names tenant {quota.tenant!r} but the path names {tenant!r}",
                       [{"field": "tenant", "problem": f"must be {tenant!r}"}])
    beyond = quota.beyond(member.spec.total_gpus())
    if beyond is not None:
        raise ApiError(422, f"invalid tenant quota: {beyond[0]}: {beyond[1]}", [{"field": beyond[0], "problem": beyond[1]}])
    _surely_leads(request)
    broker = request.app[BROKER]
    async with broker.site_lock(member.spec.name):  # (ordered with the site's other changes)
        # read again: the site may have been rebuilt (a new adapter) or removed while this change waited
        member = _member(request)
        admin = _quota_admin(member)
        beyond = quota.beyond(member.spec.total_gpus())
        if beyond is not None:
            raise ApiError(422, f"invalid tenant quota: {beyond[0]}: {beyond[1]}",
                           [{"field": beyond[0], "problem": beyond[1]}])
        _surely_leads(request)
        try:
            state = await _ask_site(member, admin.set_quota(quota))
        except QuotaBeyondSite as e:  # the site has fewer GPUs than its spec says (an agent's, a cluster's Nodes)
            raise ApiError(422, f"invalid tenant quota: site {member.spec.name} refuses it: {e.field}: {e.problem}",
                           [{"field": e.field, "problem": e.problem}]) from None
        await broker.quota_set_by_operator(member.spec.name, tenant)
    return _json(_quota_json(member, state, tenant))


async def delete_quota(request: web.Request) -> web.Response:
    member = _member(request)
    tenant = request.match_info["tenant"]
    admin = _quota_admin(member)
    _surely_leads(request)
    broker = request.app[BROKER]
    async with broker.site_lock(member.spec.name):  # (ordered with the site's other changes)
        member = _member(request)  # (read again, as in set_quota)
        admin = _quota_admin(member)
        _surely_leads(request)
        try:
            state = await _ask_site(member, admin.remove_quota(tenant))
        except KeyError:
            raise ApiError(404, f"site {member.spec.name} has no quota for tenant {tenant}") from None
        await broker.quota_set_by_operator(member.spec.name, tenant)
    return _json(_quota_json(member, state))


# --- jobs ---


async def _job_spec(request: web.Request, limit: bool = True) -> tuple[JobSpec, bytes]:
    """The request's job spec, checked as a submission is (422 naming the field; 403 for another tenant; the
    tenant's limit unless ``limit`` is false: :func:`_check_tenant_limit`)."""
    spec, raw = await _body(request, JobSpec, "job spec")
    await _check_job_spec(request, spec, limit=limit)
    return spec, raw


async def _check_job_spec(request: web.Request, spec: JobSpec, at: str = "", limit: bool = True) -> None:
    """What a submission checks of a valid spec beyond its schema; ``at``: the spec's place in a list (``[1].``),
    which the fields named start with; ``limit``: the tenant's limit too (:func:`_check_tenant_limit`)."""
    broker = request.app[BROKER]
    problem = labels_problem(spec.labels)
    if problem is not None:
        raise ApiError(422, f"invalid job spec: {at}labels: {problem}", [{"field": f"{at}labels", "problem": problem}])
    never = spec.gpus.never_fits()
    if never is not None:  # it would wait in the queue for ever
        raise ApiError(422, f"invalid job spec: {at}gpus: {never}",
                       [{"field": f"{at}gpus.mig_profile", "problem": never}])
    who = principal(request)
    if not who.acts_for(spec.tenant):
        raise not_your_tenant(who, spec.tenant, at)
    if limit:  # (after the tenant check: the limit is told only to those who act for the tenant)
        await _check_tenant_limit(broker, spec, at)
    try:
        broker.settings.profiles.choose(spec.profile)
    except ProfileError as e:
        raise ApiError(422, f"invalid job spec: {at}profile: {e}",
                       [{"field": f"{at}profile", "problem": str(e)}]) from None


async def _check_tenant_limit(broker: Broker, spec: JobSpec, at: str = "") -> None:
    """422 naming ``gpus`` for a job larger than its tenant's limit across the federation: it would wait for ever.
    A submission checks it only of a new job, as the deadline: a retry with the ``Idempotency-Key`` of a job
    accepted before the limit was lowered gets that job back. The limits are the configuration's with the overrides
    set through the API (:mod:`broker.limits`): on the broker in charge, those its cycle enforces; on a replica that
    does not lead (which takes submissions itself), those it read from the shared store, cached for a few seconds
    (``broker.limits.CACHE_S``), so a limit just changed on the leader may be checked there a moment late (a job
    taken past it waits in the queue, its decision saying why)."""
    limits = await broker.tenant_limits_now()
    limit = limits.of(spec.tenant)
    gpus = gpus_charged(spec.gpus)
    if limit is not None and gpus > limit + 1e-9:
        where = SOURCE_WORDS[limits.source(spec.tenant)].format(tenant=spec.tenant)
        problem = (f"the job holds {gpus:g} GPUs, and tenant {spec.tenant} may hold at most "
                   f"{limit:g} across the federation ({where})")
        raise ApiError(422, f"invalid job spec: {at}gpus: {problem}", [{"field": f"{at}gpus", "problem": problem}])


async def _unmet_after(request: web.Request, spec: JobSpec,
                       at: str = "") -> tuple[list[tuple[str, Kind]], dict[str, JobState]]:
    """Check a submitted (or previewed) spec's dependencies (``after``, ``after_any``, ``after_failed``: each id a
    job the caller may see (422 naming ``after[i]``, ``after_any[i]`` or ``after_failed[i]`` where it is not, worded
    as ``GET /v1/jobs/{id}`` answers 404 for it: another tenant's job is not told to exist), named once across the
    three lists, at most ``AFTER_MAX`` of them together, and none whose state means the job would never run (one in
    ``after`` already failed or cancelled, one in ``after_failed`` already succeeded). Returns the conditions that
    do not hold yet (``broker.after.unmet``), in order, and the state of each job named."""
    broker = request.app[BROKER]
    who = principal(request)
    states: dict[str, JobState] = {}
    named = [(f"{at}{kind}[{i}]", dep, kind) for kind in KINDS for i, dep in enumerate(getattr(spec, kind))]
    if len(named) > AFTER_MAX:  # (each list alone is bounded by the spec's schema; this is their sum)
        field = named[AFTER_MAX][0]
        problem = (f"more than {AFTER_MAX} jobs in after, after_any and after_failed together ({len(named)}); a job "
                   f"runs after at most {AFTER_MAX}")
        raise ApiError(422, f"invalid job spec: {field}: {problem}", [{"field": field, "problem": problem}])
    first: dict[str, str] = {}
    for field, dep, kind in named:
        problem = None
        if dep in first:
            problem = f"job {dep} is named twice (also {first[dep]}); name each job once"
        else:
            first[dep] = field
            try:
                job = await broker.book.get(dep)
            except JobNotFound:
                job = None
            except StoreError as e:
                log.error("could not read job %s that a job runs after: %s", dep, e)
                raise ApiError(503, f"job {dep} ({field}) could not be read; nothing was accepted, try again") from None
            if job is None or not who.sees_job(job):
                problem = f"no job with id {dep}"
            elif never_reason(dep, job.state, kind) is not None:
                if kind == "after_failed":
                    problem = f"job {dep} has succeeded: a job that runs after it fails would never run"
                else:
                    problem = f"job {dep} has {'failed' if job.state == JobState.FAILED else 'been cancelled'}: a " \
                              "job that runs after it would never run"
            else:
                states[dep] = job.state
        if problem is not None:
            raise ApiError(422, f"invalid job spec: {field}: {problem}", [{"field": field, "problem": problem}])
    return unmet(spec, states), states


_JOB_SPECS: TypeAdapter[list[JobSpec]] = TypeAdapter(Annotated[list[JobSpec], Field(max_length=PREVIEW_LIST_MAX)])


async def _job_specs(request: web.Request, raw: bytes) -> list[JobSpec]:
    """A JSON array of job specs (``POST /v1/preview``), each checked as a submission is, a problem named by the
    spec's place: ``[1].gpus.count`` (422); 422 for none or more than ``PREVIEW_LIST_MAX``."""
    try:
        specs: list[JobSpec] = _validated(_JOB_SPECS, raw)
    except ValidationError as e:
        if is_malformed_json(e):
            detail = e.errors(include_url=False)[0]["msg"]
            raise ApiError(400, f"malformed JSON: {detail}", [{"field": "(body)", "problem": detail}]) from None
        # (the list's own bound: a spec's list too long, its after, is named as any other problem of it)
        if any(err["type"] == "too_long" and not err["loc"] for err in e.errors(include_url=False)):
            problem = f"at most {PREVIEW_LIST_MAX} job specs in one preview: preview the rest in another"
            raise ApiError(422, f"invalid job specs: {problem}", [{"field": "(body)", "problem": problem}]) from None
        fields = problems(e)
        raise ApiError(422, "invalid job spec: " + "; ".join(f"{f['field']}: {f['problem']}" for f in fields),
                       fields) from None
    if not specs:
        problem = "an empty list: give at least one job spec"
        raise ApiError(422, f"invalid job specs: {problem}", [{"field": "(body)", "problem": problem}])
    for i, spec in enumerate(specs):
        await _check_job_spec(request, spec, f"[{i}].")
    return specs


PREVIEW_NOTE = ("what the broker would decide for this job now, at its place in the queue: the queued jobs the next "
                "pass would decide before it were decided first, and took their room; jobs submitted or changed "
                "meanwhile may still come first, and the sites' reports and forecasts move on; nothing was submitted")
PREVIEW_LIST_NOTE = ("what the broker would decide for these jobs now, were they submitted together one after another "
                     "in the list's order, each at its place in the queue: the queued jobs and the jobs of the list "
                     "the next pass would decide before each were decided first, and took their room; jobs submitted "
                     "or changed meanwhile may still come first, and the sites' reports and forecasts move on; "
                     "nothing was submitted")


def preview_note(ahead: Ahead, listed: bool = False) -> str:
    """The note of a preview that decided ``ahead`` before its job; ``listed``: one of a list previewed together."""
    note = PREVIEW_LIST_NOTE if listed else PREVIEW_NOTE
    if not ahead.capped:
        return note
    return (f"{note}; only the first {ahead.decided} jobs ahead of it were decided (the most a preview "
            "decides, or walks past with those deferred this hour): those further ahead were not weighed, and may "
            "take room it was shown")


async def preview_job(request: web.Request) -> web.Response:
    """``POST /v1/preview``: the decision a job would get now (as Slurm's ``sbatch --test-only``), nothing
    stored: its site, or its deferral, or why it would wait, with every site's terms, as ``GET
    /v1/jobs/{id}/decision`` gives them. A JSON array of specs: the decisions the jobs would get submitted together
    in the array's order (``{"items": [...]}``, in that order), each taking the room of those decided before it."""
    broker = request.app[BROKER]
    raw = await _read(request)
    listed = raw.lstrip().startswith(b"[")
    specs = await _job_specs(request, raw) if listed else [(await _job_spec(request))[0]]
    now = broker.clock.now()
    for i, spec in enumerate(specs):
        try:
            check_deadline(spec.deadline, now)  # (as a submission is refused)
        except PastDeadline as e:
            at = f"[{i}]." if listed else ""
            raise ApiError(422, f"invalid job spec: {at}{e}",
                           [{"field": f"{at}deadline", "problem": "in the past"}]) from None
    waits: list[Preview | None] = []
    for i, spec in enumerate(specs):
        left, states = await _unmet_after(request, spec, f"[{i}]." if listed else "")
        waits.append(_waiting_preview(left, states, now) if left else None)
    # (a spec that would wait is not decided, and takes no room from those after it)
    decided = iter(broker.cycle.previews([spec for spec, wait in zip(specs, waits) if wait is None]))
    previews = [wait or next(Preview(note=preview_note(ahead, listed),
                                     decision=explain.render(record, req, broker.cycle.filters, 0),
                                     ahead=ahead.decided, listed_ahead=ahead.listed if listed else None)
                                for req, record, ahead in decided)
                for wait in waits]
    return _json({"items": [p.model_dump(mode="json") for p in previews]} if listed else previews[0])


WAITING_NOTE = ("the job would wait in the queue, out of the scheduling queue, until every job in its after has "
                "succeeded, every one in its after_any ended and every one in its after_failed failed or been "
                "cancelled (and fail if one of after fails or is cancelled, or one of after_failed succeeds); only "
                "then is it decided as any new job, so no site was weighed; nothing was submitted")


def _waiting_preview(waits: list[tuple[str, Kind]], states: dict[str, JobState], now: datetime) -> Preview:
    """The preview of a spec some of whose dependencies' conditions do not hold yet (``after`` names jobs that have
    not succeeded, say): it would wait for them."""
    summary = "would be " + waiting_reason(waits, states)  # type: ignore[arg-type]
    return Preview(note=WAITING_NOTE, waiting_for=[dep for dep, _ in waits], decision=Decision(
        job_id="preview", attempt=0, decided_at=now, outcome="unplaceable", summary=summary, sites=[]))


async def submit_job(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    spec, raw = await _job_spec(request, limit=False)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (1 <= len(key) <= 255 and key.isascii() and key.isprintable()):
        raise ApiError(400, "Idempotency-Key must be 1 to 255 printable ASCII characters",
                       [{"field": "Idempotency-Key", "problem": "must be 1 to 255 printable ASCII characters"}])

    async def check() -> None:
        """Of a new job only: a retry of one accepted before one it runs after failed gets that job back (as one
        past its deadline does), and so does one sent while the first is still on its way to the store."""
        await _check_tenant_limit(broker, spec)
        if dependencies(spec):
            await _unmet_after(request, spec)

    try:
        job, created = await broker.book.submit(spec, key, raw, check=check)
    except IdempotencyConflict as e:
        raise ApiError(409, str(e), [{"field": "Idempotency-Key", "problem": "reused with a different body"}]) from None
    except PastDeadline as e:
        raise ApiError(422, f"invalid job spec: {e}", [{"field": "deadline", "problem": "in the past"}]) from None
    except StoreError as e:
        log.error("could not store a job: %s", e)
        raise ApiError(503, "the job could not be stored; it was not accepted, try again") from None
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return _json(job, 201, headers=headers)


JOB_FILTERS = ("state", "tenant", "site", "label", "limit", "cursor")


def _labels(request: web.Request) -> tuple[tuple[str, str | None], ...]:
    """The ``label`` parameters, each ``KEY=VALUE`` (the job carries the label with that value) or ``KEY`` (with
    any value); all must match. A key is any text but empty and without ``=`` (a job's labels are not checked
    further)."""
    out = []
    for raw in request.query.getall("label", []):
        key, eq, value = raw.partition("=")
        if not key:
            raise ApiError(400, f"label {raw!r} names no key; write label=KEY=VALUE (that value) or label=KEY (any)",
                           [{"field": "label", "problem": f"no key before '=' in {raw[:80]!r}"}])
        out.append((key, value if eq else None))
    return tuple(out)


async def list_jobs(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    unknown = [name for name in request.query if name not in JOB_FILTERS]
    if unknown:  # a misspelt filter must not list every job as if it had matched
        raise ApiError(400, f"unknown query parameter {unknown[0]!r}; jobs are listed by {', '.join(JOB_FILTERS)}",
                       [{"field": name, "problem": "unknown parameter"} for name in unknown])
    for name in ("tenant", "site", "limit", "cursor"):  # (one of each: the second was dropped without a word)
        if len(request.query.getall(name, [])) > 1:
            raise ApiError(400, f"{name} is given {len(request.query.getall(name))} times; give it once",
                           [{"field": name, "problem": "given more than once"}])
    states = list(dict.fromkeys(request.query.getall("state", [])))  # state=S&state=S2: in any of them
    for state in states:
        if state not in JobState.__members__.values():
            raise ApiError(400, f"unknown state {state!r}",
                           [{"field": "state", "problem": f"must be one of {', '.join(s.value for s in JobState)}"}])
    for name in ("tenant", "site"):  # (as an empty state is: no tenant or site has an empty name)
        if request.query.get(name) == "":
            raise ApiError(400, f"{name} is empty; give a {name}'s name, or leave the parameter out",
                           [{"field": name, "problem": "empty"}])
    flt = _scoped(principal(request), JobFilter(
        state=JobState(states[0]) if len(states) == 1 else None,
        states=tuple(JobState(s) for s in states) if len(states) > 1 else None,
        tenant=request.query.get("tenant"),
        site=request.query.get("site"),
        labels=_labels(request),
    ))
    limit = _query_int(request, "limit", 100, 1, MAX_PAGE)
    try:
        page = await broker.store.list_jobs(flt, limit, request.query.get("cursor"))
    except ValueError as e:
        raise ApiError(400, str(e), [{"field": "cursor", "problem": "not a cursor from a previous page"}]) from None
    # Each job as the leader holds it now where it holds it, unless it has moved on since the page was read
    # (a queued job dispatched meanwhile): it is then left out of a list filtered by what it no longer is.
    items = []
    for stored in page.items:
        job = broker.book.active.get(stored.id, stored)
        if job is stored or _matches(job, flt):
            items.append(job.model_dump(mode="json"))
    return _json({"items": items, "next": page.next})


def _matches(job: Job, flt: JobFilter) -> bool:
    """Whether ``job`` is what ``flt`` asks for (state, site; its tenant and labels never change)."""
    return ((flt.state is None or job.state == flt.state) and (flt.states is None or job.state in flt.states)
            and (flt.site is None or job.site == flt.site) and (flt.sites is None or job.site in flt.sites))


def _scoped(who: Principal, flt: JobFilter) -> JobFilter:
    """``flt`` narrowed to the jobs ``who`` may see: a submitter's tenants, an operator's sites."""
    if who.role == Role.SUBMITTER:
        if flt.tenant is not None and not who.acts_for(flt.tenant):
            raise not_your_tenant(who, flt.tenant)
        return flt if flt.tenant is not None else replace(flt, tenants=tuple(sorted(who.tenants)))
    if who.role == Role.OPERATOR:
        if flt.site is not None and not who.operates(flt.site):
            raise not_your_site(who, flt.site)
        return flt if flt.site is not None else replace(flt, sites=tuple(sorted(who.sites)))
    return flt


async def _job(request: web.Request) -> Job:
    """The path's job, if the caller may see it (404 otherwise, as for a job that does not exist)."""
    job_id = request.match_info["id"]
    broker = request.app[BROKER]
    try:
        job = await broker.book.get(job_id)
    except JobNotFound:
        kept = broker.settings.job_retention_h
        why = f" (a finished job is deleted {kept:g} h after it ended: broker.job_retention_h)" if kept else ""
        raise ApiError(404, f"no job with id {job_id}{why}") from None
    if not principal(request).sees_job(job):
        raise ApiError(404, f"no job with id {job_id}")
    return job


async def _waiting_now(broker: Broker, job: Job) -> Job:
    """A waiting job with its reason as of now: the jobs it still waits for, each in the state it is in now (the
    stored reason names them as they were when it last changed). Unchanged where a state cannot be read."""
    if not job.waiting or job.state != JobState.QUEUED:
        return job
    try:
        states = {dep: await broker.book.state_of(dep) for dep in dependencies(job.spec)}
    except StoreError:
        return job
    waits = unmet(job.spec, states)
    return job.model_copy(update={"reason": waiting_reason(waits, states)}) if waits else job


async def get_job(request: web.Request) -> web.Response:
    _takes_no_query(request)
    return _json(await _waiting_now(request.app[BROKER], await _job(request)))


async def cancel_job(request: web.Request) -> web.Response:
    job_id = request.match_info["id"]
    job = await _job(request)
    if not principal(request).acts_for(job.spec.tenant):
        raise ApiError(403, f"only tenant {job.spec.tenant}'s submitters and admins may cancel job {job_id}")
    try:
        cancelled = await request.app[BROKER].lifecycle.cancel(job_id)
    except JobNotFound:
        raise ApiError(404, f"no job with id {job_id}") from None
    except AlreadyEnded as e:
        raise ApiError(409, str(e)) from None
    return _json(cancelled)


ACTIVE_STATES = tuple(s for s in JobState if not s.terminal)
CANCEL_AT_MOST = 10_000
"""Jobs one ``POST /v1/cancellations`` cancels at most; it answers ``"more": true`` when more match (call again)."""
CANCEL_TOGETHER = 32  # cancels under way at once (each may wait on its site to withdraw the job, up to its timeout)
CANCEL_FOR_AT_MOST_S = 20.0  # then it answers with what is done, and "more": true (a follower waits for the leader)


async def cancel_many(request: web.Request) -> web.Response:
    """``POST /v1/cancellations``: cancel every job the body's selector matches and the caller may cancel, each as
    ``POST /v1/jobs/{id}/cancel`` would (running ones withdrawn from their sites); one that ends, or leaves the
    state or site asked for, meanwhile is skipped. Answers ``{"cancelled": [ids], "skipped": [{"id", "reason"}],
    "matched": n, "more": bool}``."""
    broker = request.app[BROKER]
    who = principal(request)
    sel, _ = await _body(request, Cancellation, "cancellation")
    if sel.tenant is None and not sel.labels:
        problem = "give a tenant, labels or both: one request may not cancel every job"
        raise ApiError(422, f"invalid cancellation: {problem}",
                       [{"field": "tenant", "problem": problem}, {"field": "labels", "problem": problem}])
    flt = _scoped(who, JobFilter(tenant=sel.tenant, site=sel.site, labels=tuple(sel.labels.items()),
                                 states=(JobState(sel.state),) if sel.state else ACTIVE_STATES))
    why = clean_text(sel.reason, 500) if sel.reason else None
    cancelled: list[str] = []
    skipped: list[dict[str, str]] = []
    failed: list[str] = []  # cancels the store did not take: the rest waits for the next call

    async def cancel(job_id: str) -> str | None:
        """Cancel one: None once cancelled, else why it was skipped."""
        # As the leader holds it now, not as listed: the batches before it awaited their writes and withdrawals, and
        # a job that has moved out of the state or site asked for meanwhile (placed, when queued ones were asked
        # for) is left alone, as the listing leaves one. (Nothing is awaited from here to its cancel in memory.)
        now = broker.book.active.get(job_id)
        if now is not None and not _matches(now, flt):
            on = f" on {now.site}" if now.site else ""
            return f"job {job_id} is {now.state.value}{on} now, which the cancellation does not select"
        try:
            # (a site slow to confirm a withdrawal does not hold the answer past the bound: settle retries it)
            await broker.lifecycle.cancel(job_id, why, withdraw_within_s=max(0.0, until - loop.time()))
            return None
        except AlreadyEnded as e:  # it ended (or began to) since it was listed
            return str(e)
        except JobNotFound:
            return f"job {job_id} no longer exists"
        except StoreError as e:  # (not the middleware's 503: the jobs cancelled before it stay cancelled)
            log.error("could not store the cancel of job %s: %s", job_id, e)
            failed.append(job_id)
            return "the store could not record the cancel; call again"

    loop = asyncio.get_running_loop()
    until = loop.time() + min(CANCEL_FOR_AT_MOST_S, broker.settings.dispatch_timeout_s)
    cursor: str | None = None
    more = False
    while True:
        try:
            page = await broker.store.list_jobs(flt, MAX_PAGE, cursor)
        except StoreError as e:
            if not cancelled and not skipped:
                raise  # (nothing done yet: the middleware's 503)
            log.error("could not list the jobs a cancel of many matches: %s", e)
            more = True
            break
        # As the leader holds each job now: one that has moved on since it was stored (to a state not asked for)
        # is left alone.
        jobs = [job for stored in page.items if (job := broker.book.active.get(stored.id, stored)) is stored
                or _matches(job, flt)]
        jobs = [job for job in jobs if who.acts_for(job.spec.tenant)]
        i = 0
        while i < len(jobs):
            room = CANCEL_AT_MOST - len(cancelled) - len(skipped)
            if room <= 0 or failed or loop.time() >= until:
                more = True
                break
            batch = jobs[i:i + min(CANCEL_TOGETHER, room)]
            for job, skip in zip(batch, await asyncio.gather(*(cancel(job.id) for job in batch))):
                if skip is None:
                    cancelled.append(job.id)
                else:
                    skipped.append({"id": job.id, "reason": skip})
            i += len(batch)
            await asyncio.sleep(0)  # (each cancel awaits its write; other requests are served between batches)
        if more or page.next is None:
            break
        cursor = page.next
    return _json({"cancelled": cancelled, "skipped": skipped, "matched": len(cancelled) + len(skipped),
                  "more": more or bool(failed)})


async def change_job(request: web.Request) -> web.Response:
    """``PATCH /v1/jobs/{id}``: a queued job's priority, deadline or profile (as Armada's reprioritize and
    Slurm's ``scontrol update``); its transitions record what changed."""
    broker = request.app[BROKER]
    job_id = request.match_info["id"]
    job = await _job(request)
    if not principal(request).acts_for(job.spec.tenant):
        raise ApiError(403, f"only tenant {job.spec.tenant}'s submitters and admins may change job {job_id}")
    change, _ = await _body(request, JobChange, "job change")
    if "profile" in change.model_fields_set:
        try:
            broker.settings.profiles.choose(change.profile)
        except ProfileError as e:
            raise ApiError(422, f"invalid job change: profile: {e}", [{"field": "profile", "problem": str(e)}]) from None
    try:
        changed = await broker.change_job(job_id, change)
    except (JobNotFound, NotQueued) as e:  # (JobNotFound: it ended meanwhile)
        now = await broker.book.get(job_id)
        raise ApiError(409, str(e) if isinstance(e, NotQueued) else f"job {job_id} is {now.state}: only a queued "
                       "job's priority, deadline or profile can change") from None
    except PastDeadline as e:
        raise ApiError(422, f"invalid job change: {e}", [{"field": "deadline", "problem": "in the past"}]) from None
    except ValidationError as e:  # the spec with the change is no valid spec
        fields = problems(e)
        raise ApiError(422, "invalid job change: " + "; ".join(f"{f['field']}: {f['problem']}" for f in fields),
                       fields) from None
    except StoreError as e:
        log.error("could not store a change of job %s: %s", job_id, e)
        raise ApiError(503, f"the change of job {job_id} could not be stored; nothing changed, try again") from None
    return _json(changed)


async def job_decision(request: web.Request) -> web.Response:
    _takes_no_query(request)
    broker = request.app[BROKER]
    job = await _job(request)
    stored = await broker.decision(job)
    ended = (f"{job.state}" + (f": {job.reason}" if job.reason else "")) if job.state.terminal else None
    if stored is None:
        if ended is not None:  # cancelled (or failed) before any pass decided it: none ever will
            raise ApiError(404, f"job {job.id} was never decided: it ended before a scheduling cycle reached it "
                                f"({ended})")
        if job.waiting:
            reason = (await _waiting_now(broker, job)).reason
            raise ApiError(404, f"job {job.id} has not been decided: it is {reason}; once they have, the next "
                                "scheduling cycle decides it")
        raise ApiError(404, f"job {job.id} has not been decided yet; the next scheduling cycle decides it")
    req = JobRequest.from_spec(job.id, job.spec, frozenset(stored.record.get("excluded", ())))
    try:
        decision = explain.render(stored.record, req, broker.cycle.filters, stored.attempt, ended=ended)
    except explain.RecordVersionError as e:  # e.g. a later release's replica decided it: this one cannot read it
        version = stored.record.get("v")
        later = ("; a later release of heliotrope recorded it (upgrade this replica)"
                 if isinstance(version, int) and version > explain.RECORD_VERSION else "")
        raise ApiError(501, f"job {job.id}'s decision cannot be explained by this broker: {e}{later}") from None
    return _json(decision)


async def job_events(request: web.Request) -> web.Response:
    _takes_no_query(request)
    job = await _job(request)
    return _json({"items": await request.app[BROKER].store.job_events(job.id), "next": None})


LOG_PARAMS = ("attempt", "tail", "follow")
DEFAULT_TAIL_LINES = 1000
MAX_TAIL_LINES = 1_000_000
MAX_LOG_BYTES = 1 << 20  # what one answer carries at most: the end of the log
LOGS_TIMEOUT_S = 30.0  # how long the broker waits for a site's logs
FOLLOW_TRUE, FOLLOW_FALSE = ("true", "1"), ("false", "0")
MAX_LOG_FOLLOWS = 256  # logs followed at once through this replica: each holds a connection to its site
LOG_FOLLOW_MAX_S = 24 * 3600.0  # how long a follow stays open at most (a client that wants more asks again)
LOG_FOLLOW_CHECK_S = 5.0  # how often a quiet follow looks whether its client is still there
REACHED = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.PREEMPTED})


def _log_param(request: web.Request, name: str, hi: int) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= hi:
        raise ApiError(422, f"query parameter {name} must be an integer from 1 to {hi}, got {raw[:40]!r}",
                       [{"field": name, "problem": f"must be an integer from 1 to {hi}"}])
    return value


async def _sites_reached(broker: Broker, job: Job) -> dict[int, str]:
    """Attempt -> site, for each attempt of ``job`` that a site admitted (its history says so)."""
    reached: dict[int, str] = {}
    for event in await broker.store.job_events(job.id):
        attempt, site = event.get("attempt"), event.get("site")
        if isinstance(attempt, int) and site and event.get("state") in REACHED:
            reached[attempt] = site
    if job.site is not None and job.state in REACHED:
        reached.setdefault(job.attempt, job.site)
    return reached


def _follow_param(request: web.Request) -> bool:
    raw = request.query.get("follow")
    if raw is None or raw in FOLLOW_FALSE:
        return False
    if raw in FOLLOW_TRUE:
        return True
    raise ApiError(400, f"query parameter follow must be true or false, got {raw[:40]!r}",
                   [{"field": "follow", "problem": "must be true or false (or 1 or 0)"}])


async def job_logs(request: web.Request) -> web.StreamResponse:
    """``GET /v1/jobs/{id}/logs``: what an attempt printed (the latest attempt a site admitted unless
    ``attempt`` is given), its last ``tail`` lines (1000) and at most ``MAX_LOG_BYTES``, as its site gives it;
    with ``follow``, then what it prints, streamed (:func:`_follow_logs`)."""
    unknown = [name for name in request.query if name not in LOG_PARAMS]
    if unknown:
        raise ApiError(400, f"unknown query parameter {unknown[0]!r}; logs take {', '.join(LOG_PARAMS)}",
                       [{"field": name, "problem": "unknown parameter"} for name in unknown])
    attempt = _log_param(request, "attempt", 1_000_000)
    tail = _log_param(request, "tail", MAX_TAIL_LINES) or DEFAULT_TAIL_LINES
    follow = _follow_param(request)
    broker = request.app[BROKER]
    job = await _job(request)
    reached = await _sites_reached(broker, job)
    if not reached:
        raise ApiError(409, f"job {job.id} has not reached a site yet (it is {job.state}): there are no logs until "
                            "a site admits it")
    # What an attempt printed is its site's to show: a site's operator, who sees the job while it is at that site,
    # reads the logs of the attempts at the sites it operates, not those of one that ran elsewhere before.
    who = principal(request)
    readable = reached if who.acts_for(job.spec.tenant) else {a: s for a, s in reached.items() if who.operates(s)}
    if attempt is None:
        if not readable:
            raise ApiError(409, f"no attempt of job {job.id} has reached a site this token operates yet")
        attempt = max(readable)
    elif attempt not in reached:
        raise ApiError(409, f"attempt {attempt} of job {job.id} never reached a site; the attempts that did: "
                            f"{', '.join(str(a) for a in sorted(reached))}",
                       [{"field": "attempt", "problem": "not an attempt a site admitted"}])
    elif attempt not in readable:
        raise ApiError(403, f"attempt {attempt} of job {job.id} ran at site {reached[attempt]}: its logs are for "
                            f"tenant {job.spec.tenant}'s submitters, admins and site {reached[attempt]}'s operators")
    site = reached[attempt]
    member = broker.federation.get(site)
    if member is None:
        raise ApiError(409, f"site {site}, where attempt {attempt} of job {job.id} ran, is no longer in the "
                            "federation: its logs cannot be read through the broker")
    if follow and not isinstance(member.adapter, LogFollower):
        raise ApiError(501, f"site {site}'s adapter ({member.spec.adapter.kind}) cannot follow logs; read them "
                            "without follow, again as often as needed (tail=N gives the last N lines)",
                       [{"field": "follow", "problem": f"site {site} cannot follow logs"}])
    if not follow and not isinstance(member.adapter, LogReader):
        raise ApiError(501, f"site {site}'s adapter ({member.spec.adapter.kind}) cannot give logs")
    follows: set[asyncio.Task[Any]] = request.app[FOLLOWS]
    if follow and len(follows) >= MAX_LOG_FOLLOWS:
        raise ApiError(503, f"{MAX_LOG_FOLLOWS} logs are being followed through this broker already; try again "
                            "later, or read the log without follow", headers={"Retry-After": "30"})
    task = asyncio.current_task()
    assert task is not None
    if follow:  # (counted from here: one whose site has not answered yet holds its place, and ends at shutdown)
        follows.add(task)
    try:
        return await _site_logs(request, member.adapter, site, job.id, attempt, tail, follow)
    finally:
        follows.discard(task)


async def _site_logs(request: web.Request, adapter: Any, site: str, job_id: str, attempt: int, tail: int,
                     follow: bool) -> web.StreamResponse:
    """The answer to ``GET /v1/jobs/{id}/logs`` once the site and attempt are known: the site's logs, or its
    followed log streamed (:func:`_follow_logs`); the site's failures as the API's errors."""
    try:
        async with asyncio.timeout(LOGS_TIMEOUT_S):
            if follow:
                followed = await adapter.follow_logs(job_id, attempt, tail, MAX_LOG_BYTES)
            else:
                logs = await adapter.logs(job_id, attempt, tail, MAX_LOG_BYTES)
    except LogsUnsupported as e:
        refused = [{"field": "follow", "problem": f"site {site} cannot follow logs"}] if follow else None
        raise ApiError(501, f"site {site} cannot give logs: {e}", refused) from None
    except LogsNotFound as e:
        raise ApiError(409, str(e)) from None
    except TimeoutError:
        raise ApiError(503, f"site {site} did not give the logs of attempt {attempt} within {LOGS_TIMEOUT_S:g} s; "
                            "try again", headers={"Retry-After": "5"}) from None
    except AdapterError as e:
        raise ApiError(503, f"site {site} did not answer: {e}", headers={"Retry-After": "5"}) from None
    if follow:
        return await _follow_logs(request, followed, _log_headers(site, attempt, followed.truncated, followed.source))
    return web.Response(text=logs.text, content_type="text/plain", charset="utf-8",
                        headers=_log_headers(site, attempt, logs.truncated, logs.source))


async def _next_chunk(chunks: AsyncGenerator[str, None]) -> str | None:
    """The next chunk of a followed log; None once it has ended."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


def _log_headers(site: str, attempt: int, truncated: bool, source: str | None) -> dict[str, str]:
    source = "".join(c if " " <= c <= "~" else "?" for c in (source or "")[:200])  # (a header is ASCII)
    return dict(zip(LOG_HEADERS, (site, str(attempt), "true" if truncated else "false", source), strict=True))


async def _follow_logs(request: web.Request, followed: LogFollow, headers: dict[str, str]) -> web.StreamResponse:
    """Stream a followed log (chunked ``text/plain``), each chunk written as the site gives it (nothing held
    beyond it), until the attempt ends, the client leaves, its token is revoked or expires (the token looked at
    before each chunk, and both every ``LOG_FOLLOW_CHECK_S`` while the log is quiet, so a quiet log does not hold
    the site's stream for a client long gone or no longer let in), ``LOG_FOLLOW_MAX_S`` have passed, or the broker
    stops. The site's stream is closed in every case. Only the attempt's end ends the answer as a whole: in every
    other case the connection is cut before the answer's last (empty) chunk, so that the client (``heliotrope logs
    -f``, a replica relaying it) learns that the attempt may still run and the follow must be asked for again."""
    broker, who = request.app[BROKER], principal(request)
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/plain; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    chunks, pending, ended = followed.chunks, None, False
    try:
        await resp.prepare(request)
        async with asyncio.timeout(LOG_FOLLOW_MAX_S):
            while True:
                pending = pending or asyncio.ensure_future(_next_chunk(chunks))
                done, _ = await asyncio.wait({pending}, timeout=LOG_FOLLOW_CHECK_S)
                if not done:
                    if request.transport is None or request.transport.is_closing():
                        break  # the client left while the log was quiet
                    if not await broker.tokens.still_valid(who):
                        break  # revoked or expired while the log was quiet
                    continue
                chunk, pending = pending.result(), None
                if chunk is None:
                    ended = True
                    break  # the attempt ended
                if not await broker.tokens.still_valid(who):
                    break  # revoked or expired since the follow began
                await resp.write(chunk.encode())
    except (TimeoutError, ConnectionResetError, asyncio.CancelledError):
        pass  # the follow had its time, the client left, or the broker is stopping
    except AdapterError as e:  # (the status has gone out: all that is left is to end the stream)
        log.warning("following the log (%s) ended early: %s", headers.get("X-Heliotrope-Log-Source"), e)
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await chunks.aclose()
        if not ended:
            _cut(request)
    return resp


def _cut(request: web.Request) -> None:
    """End a streamed answer without its last chunk (what was written still goes out first): the client reads it
    as cut short (aiohttp: ``ClientPayloadError``; curl: exit 18), not as whole."""
    if request.transport is not None:
        request.transport.close()


# --- live ---

EVENT_FILTERS = ("tenant", "site", "job", "type", "last_event_id")
HEARTBEAT_S = 15.0


def _event_filter(request: web.Request) -> Callable[[Event], bool]:
    """What the stream sends: the events the caller may see, narrowed by ``tenant``, ``site``, ``job`` and
    ``type`` (comma-separated types)."""
    who = principal(request)
    q = request.query
    for name in q:
        if name not in EVENT_FILTERS:
            raise ApiError(400, f"unknown query parameter {name!r}; the stream filters by {', '.join(EVENT_FILTERS)}",
                           [{"field": name, "problem": "unknown parameter"}])
    for name in ("tenant", "site", "job"):  # (as on the job list: an empty one would match no event, for ever)
        if q.get(name) == "":
            raise ApiError(400, f"{name} is empty; give a {name}'s name, or leave the parameter out",
                           [{"field": name, "problem": "empty"}])
    tenant, site, job = q.get("tenant"), q.get("site"), q.get("job")
    types = frozenset(t for t in q.get("type", "").split(",") if t) or None
    if types is not None and not types <= set(EVENT_TYPES):
        raise ApiError(400, f"unknown event type in {q['type']!r}; types: {', '.join(EVENT_TYPES)}",
                       [{"field": "type", "problem": f"must be among {', '.join(EVENT_TYPES)}"}])
    if tenant is not None and who.role == Role.SUBMITTER and not who.acts_for(tenant):
        raise not_your_tenant(who, tenant)
    if site is not None and who.role == Role.OPERATOR and not who.operates(site):
        raise not_your_site(who, site)

    def wants(e: Event) -> bool:
        return (who.sees_event(e.tenant, e.site)
                and (tenant is None or e.tenant == tenant) and (site is None or e.site == site)
                and (job is None or e.job_id == job) and (types is None or e.type in types))

    return wants


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events (``text/event-stream``) until the client leaves or the broker stops; a comment
    every 15 s keeps proxies from closing an idle stream. ``Last-Event-ID`` resumes after that event."""
    broker = request.app[BROKER]
    who = principal(request)
    wants = _event_filter(request)
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    after: int | None = None
    if raw:
        try:
            after = int(raw)
        except ValueError:
            raise ApiError(400, "Last-Event-ID must be the integer id of an event",
                           [{"field": "Last-Event-ID", "problem": f"not an event id: {raw[:40]!r}"}]) from None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    following = broker.events.follow(wants, after, HEARTBEAT_S)  # subscribed before the client hears back
    last = after
    try:
        await resp.prepare(request)
        await resp.write(b"retry: 2000\n: heliotrope events\n\n")
        async for event in following:
            if not await broker.tokens.still_valid(who):
                break  # revoked or expired since the stream opened: it ends (the client's reconnect gets a 401)
            if event is None:
                await resp.write(b": keepalive\n\n")
                continue
            await resp.write(frame(event, last))
            if event.id >= 0:
                last = event.id
    except ConnectionResetError:
        pass  # the client left: nothing more to send
    finally:
        following.close()
    return resp


async def carbon(request: web.Request) -> web.Response:
    _takes_no_query(request)
    return _json({**request.app[BROKER].cycle.carbon.as_dict(), "baseline": "carbon-agnostic: the same "
                  "decision without its carbon terms, at the same moment (broker.carbon_ledger)"})


async def tenants(request: web.Request) -> web.Response:
    """``GET /v1/tenants[?tenant=T]``: per tenant with unfinished jobs or a federation-wide limit, its jobs by state
    and the GPUs they hold across the federation against its limit (``broker.tenant_limits``), as Kueue's
    ClusterQueue status shows usage against quota. A submitter reads its own tenants'."""
    broker = request.app[BROKER]
    who = principal(request)
    unknown = sorted(set(request.query) - {"tenant"})
    if unknown:
        raise ApiError(400, f"unknown query parameter {unknown[0]!r}; tenants take tenant",
                       [{"field": unknown[0], "problem": "unknown query parameter"}])
    asked = request.query.get("tenant")
    if asked == "":
        raise ApiError(400, "query parameter tenant names no tenant", [{"field": "tenant", "problem": "empty"}])
    if asked is not None and who.role == Role.SUBMITTER and not who.acts_for(asked):
        raise not_your_tenant(who, asked)
    limits = broker.limits.current
    holding = broker.book.active.by_tenant()
    names = set(holding) | limits.named()
    if asked is not None:
        names = {asked}
    if who.role == Role.SUBMITTER:
        names = {t for t in names if who.acts_for(t)}
    return _json({"items": [_tenant_json(name, limits, holding.get(name)) for name in sorted(names)]})


def _tenant_json(name: str, limits: TenantLimits, held: TenantUsage | None) -> dict[str, Any]:
    """One tenant's row of ``GET /v1/tenants``: its jobs by state, the GPUs they hold, its limit (left out where it
    has none) and where that comes from (``limit_source``: config, default or override)."""
    item: dict[str, Any] = {"tenant": name, "gpus_held": round(held.gpus_held, 6) if held else 0.0,
                            "jobs": dict(sorted(held.jobs.items())) if held else {}}
    limit = limits.of(name)
    if limit is not None:
        item["gpus_limit"] = limit
    item["limit_source"] = limits.source(name)
    return item


_TENANT = TypeAdapter(Slug)


def _limit_tenant(request: web.Request) -> str:
    """The path's tenant, if a tenant's name (as a job spec's ``tenant``): 422 naming ``tenant`` otherwise."""
    tenant = request.match_info["tenant"]
    try:
        return _TENANT.validate_python(tenant)
    except ValidationError as e:
        problem = e.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise ApiError(422, f"invalid tenant {tenant!r}: {problem}",
                       [{"field": "tenant", "problem": problem}]) from None


async def set_tenant_limit(request: web.Request) -> web.Response:
    """``PUT /v1/tenants/{tenant}/limit``: the tenant's federation-wide limit set live, over the configuration's,
    kept in the store until deleted; jobs a raised limit makes room for start at the next pass, which runs at once
    (a lowered one stops nothing: new jobs wait until the tenant holds less). Answers the tenant's row."""
    tenant = _limit_tenant(request)
    change, _ = await _body(request, TenantLimitChange, "tenant limit")
    broker = request.app[BROKER]
    limits = await broker.set_tenant_limit(tenant, change.gpus)
    return _json(_tenant_json(tenant, limits, broker.book.active.by_tenant().get(tenant)))


async def reset_tenant_limit(request: web.Request) -> web.Response:
    """``DELETE /v1/tenants/{tenant}/limit``: the override removed, the configuration's limit in force again (the
    tenant's own entry, or the default). 404 where the tenant has no override. Answers the tenant's row."""
    tenant = _limit_tenant(request)
    broker = request.app[BROKER]
    limits = await broker.reset_tenant_limit(tenant)
    if limits is None:
        raise ApiError(404, f"tenant {tenant} has no limit set through the API; its limit is the configuration's")
    return _json(_tenant_json(tenant, limits, broker.book.active.by_tenant().get(tenant)))


USAGE_PARAMS = ("from", "to", "by", "tenant", "site")


def _parses(kind: type[date], text: str) -> bool:
    """Whether ``text`` is an ISO 8601 ``kind`` (a date, or a datetime)."""
    try:
        kind.fromisoformat(text)
    except ValueError:
        return False
    return True


def _usage_time(request: web.Request, name: str) -> datetime | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        # (a '+' of an offset written as is in a URL's query reads as a space: ...T09:00:00 01:00)
        plus = " " in raw and _parses(datetime, raw[::-1].replace(" ", "+", 1)[::-1])
        raise ApiError(400, f"{name}: {raw[:40]!r} is not a time (ISO 8601, e.g. 2026-11-01 or "
                            f"2026-11-01T09:00:00Z)" + ("; a + in a URL's query reads as a space: write it %2B"
                                                        if plus else ""),
                       [{"field": name, "problem": "not an ISO 8601 time"}]) from None
    if at.tzinfo is None and _parses(date, raw):  # a date alone (2026-11-01, 20261101, 2026-W44-7): its midnight, UTC
        at = at.replace(tzinfo=UTC)
    if at.tzinfo is None:
        raise ApiError(400, f"{name}: {raw[:40]!r} has no time zone; add Z for UTC or an offset such as +01:00",
                       [{"field": name, "problem": "no time zone"}])
    try:
        return at.astimezone(UTC)
    except OverflowError:
        raise ApiError(400, f"{name}: {raw[:40]!r} is out of range once converted to UTC",
                       [{"field": name, "problem": "is out of range once converted to UTC"}]) from None


async def usage_report(request: web.Request) -> web.Response:
    """``GET /v1/usage?from=&to=&by=&tenant=&site=``: GPU-hours, attempts, energy and an estimate of cost per
    tenant (or site, GPU model, or any of them together: ``by=tenant,site``) over a window of whole hours
    (:mod:`broker.usage`), for chargeback. A submitter reads its own tenants'."""
    broker = request.app[BROKER]
    who = principal(request)
    unknown = sorted(set(request.query) - set(USAGE_PARAMS))
    if unknown:
        raise ApiError(400, f"unknown query parameter {unknown[0]!r}; usage takes {', '.join(USAGE_PARAMS)}",
                       [{"field": unknown[0], "problem": "unknown query parameter"}])
    for name in USAGE_PARAMS:
        if len(request.query.getall(name, ())) > 1:
            raise ApiError(400, f"{name} given more than once", [{"field": name, "problem": "given more than once"}])
        if request.query.get(name) == "":
            raise ApiError(400, f"query parameter {name} is empty", [{"field": name, "problem": "empty"}])
    by = tuple(request.query.get("by", "tenant").split(","))
    wrong = [k for k in by if k not in usage.GROUP_KEYS]
    if wrong or len(set(by)) != len(by):
        problem = f"{wrong[0]!r} is not one of" if wrong else "names a key twice; give each of"
        raise ApiError(400, f"by: {problem} {', '.join(usage.GROUP_KEYS)} (comma-separated)",
                       [{"field": "by", "problem": f"{problem} {', '.join(usage.GROUP_KEYS)}"}])
    tenant, site = request.query.get("tenant"), request.query.get("site")
    if tenant is not None and who.role == Role.SUBMITTER and not who.acts_for(tenant):
        raise not_your_tenant(who, tenant)
    now = broker.clock.now()
    try:
        start, end = usage.window(_usage_time(request, "from"), _usage_time(request, "to"), now)
    except usage.WindowError as e:
        raise ApiError(400, str(e), [{"field": e.field, "problem": e.problem}]) from None
    records = await broker.store.usage_records(start.timestamp(), end.timestamp())
    tenants = ({tenant} if tenant is not None else set(who.tenants)) if who.role == Role.SUBMITTER else (
        None if tenant is None else {tenant})
    prices = _prices_now(broker, now)
    intensity, notes = await _usage_intensity(broker, records, start, end, now)
    body = await asyncio.to_thread(usage.report, records, start, end, now, by, prices, tenants, site, intensity)
    if notes:
        body["notes"] = [*body.get("notes", []), *notes]
    return _json(body)


def _prices_now(broker: Broker, now: datetime) -> dict[str, dict[str, float]]:
    """Each site's price per GPU-hour of each model it has, as routing sees it now (a price provider's over the
    spec's), for a usage report's ``cost_usd``."""
    if not broker.federation.members:
        return {}
    snap = broker.federation.freeze(now)
    return {name: {GPU_MODEL_IDS[m]: float(snap.usd_per_gpu_hour[i, m])
                   for m in np.flatnonzero(np.isfinite(snap.usd_per_gpu_hour[i]))}
            for i, name in enumerate(snap.sites)}


async def _usage_intensity(broker: Broker, records: usage.UsageRecords, start: datetime, end: datetime,
                           now: datetime) -> tuple[dict[str, dict[int, float]] | None, list[str]]:
    """Each site's grid intensity per hour for a usage report's ``co2e_kg``, over the hours its GPUs were held
    (:func:`broker.usage.hours_used`): the hours wholly past as the carbon provider measured them, the hour under
    way at its forecast (None without a provider), and a note per zone that could not be had."""
    signals = broker.signals
    if signals is None:
        return None, []
    hour_s = usage.HOUR_S
    current = int(now.timestamp() // hour_s * hour_s)  # (the hour under way: not measured yet)
    members = broker.federation.members
    spans: dict[str, tuple[int, int]] = {}  # zone -> first and last hour wanted
    for site, (first, last) in usage.hours_used(records, start, end, now).items():
        if site in members:
            zone = members[site].spec.grid_zone
            old = spans.get(zone, (first, last))
            spans[zone] = (min(first, old[0]), max(last, old[1]))
    notes: list[str] = []

    async def zone_hours(zone: str, first: int, last: int) -> dict[int, float]:
        out: dict[int, float] = {}
        past_end = min(last + hour_s, current)
        if past_end > first:
            try:
                values = await signals.measured(zone, datetime.fromtimestamp(first, UTC),
                                                datetime.fromtimestamp(past_end, UTC))
            except (ProviderError, ValueError, TimeoutError) as e:
                notes.append(f"co2e_kg: zone {zone}: {str(e) or 'no answer in time'}"[:300])
            else:
                out.update({first + i * hour_s: float(v) for i, v in enumerate(values)})
        if last >= current:  # the hour under way: its forecast
            row = signals.forecast_rows([zone], now)
            if row.size and math.isfinite(row[0][0]):
                out[current] = float(row[0][0])
            else:
                notes.append(f"co2e_kg: zone {zone}: no forecast for the hour under way")
        return out

    zones = sorted(spans)
    found = dict(zip(zones, await asyncio.gather(*(zone_hours(z, *spans[z]) for z in zones))))
    return {name: found.get(m.spec.grid_zone, {}) for name, m in members.items()}, sorted(notes)


async def whoami(request: web.Request) -> web.Response:
    _takes_no_query(request)
    who = principal(request)
    return _json({"name": who.name, "role": who.role.value, "sites": sorted(who.sites),
                  "tenants": sorted(who.tenants), "token_id": who.token_id,
                  "auth": request.app[BROKER].tokens.enabled})


# --- misc ---


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return _json({
        "status": "ok",
        "sites": len(broker.federation.members),
        "active_jobs": len(broker.book.active),
        "cycles": broker.cycles,
        **({"mqtt": {"connected": broker.hub.connected.is_set(), "messages": broker.hub.received,
                     "malformed": dict(broker.hub.malformed),
                     "unknown_sites": sum(broker.hub.unknown_sites.values()),
                     # (once connected: whether the MQTT broker took MQTT 5, so that commands expire there)
                     **({"commands_expire": broker.hub.commands_expire} if broker.hub.connects else {})}}
            if broker.hub is not None else {}),
        **({"replica": {"name": broker.leadership.holder, "leading": broker.leadership.leading,
                        "epoch": broker.leadership.epoch}} if broker.leadership is not None else {}),
    })


READY_TIMEOUT_S = 2.0
"""How long ``/readyz`` waits for the store before it says the replica is not ready."""


async def readyz(request: web.Request) -> web.Response:
    """Readiness: whether this replica can take requests now, i.e. whether its store answers a read within
    ``READY_TIMEOUT_S`` (``/healthz`` says only that the process serves: a broker whose database is down looked
    healthy, and a load balancer kept sending it submissions it could not store). 503 with the reason
    otherwise, so an orchestrator routes around it until the store is back, without restarting it."""
    broker = request.app[BROKER]
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await broker.store.get_state("readyz")
    except (StoreError, TimeoutError) as e:
        why = f"no answer within {READY_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else str(e)
        raise ApiError(503, f"not ready: the store did not answer a read ({why})",
                       headers={"Retry-After": "5"}) from None
    return _json({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus' text format; each replica answers for itself (a replica that does not lead holds no jobs).
    A site operator reads its own sites' figures and the platform's aggregates, never a tenant's
    (:class:`broker.metrics.ScopedView`)."""
    broker = request.app[BROKER]
    await broker.tenant_limits_now()  # (a replica that does not lead: the limits set through the API, read again)
    registry = broker.metrics.registry
    who = principal(request)
    body = generate_latest(registry if who.admin else ScopedView(registry, frozenset(who.sites)))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


def create_app(broker: Broker) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware, follower_middleware],
                          client_max_size=broker.settings.max_body_bytes)
    app[BROKER] = broker
    app[RELAYS] = set()
    app[FOLLOWS] = set()
    app.on_cleanup.append(_close_proxy)
    app.on_shutdown.append(_end_streams)
    r = app.router
    r.add_post("/v1/sites", create_site)
    r.add_get("/v1/sites", list_sites)
    r.add_get("/v1/sites/{name}", get_site)
    r.add_put("/v1/sites/{name}", update_site)
    r.add_delete("/v1/sites/{name}", delete_site)
    r.add_post("/v1/sites/{name}/cordon", cordon_site)
    r.add_post("/v1/sites/{name}/uncordon", cordon_site)
    r.add_get("/v1/sites/{name}/quota", get_quota)
    r.add_put("/v1/sites/{name}/quota/{tenant}", set_quota)
    r.add_delete("/v1/sites/{name}/quota/{tenant}", delete_quota)
    r.add_post("/v1/jobs", submit_job)
    r.add_post("/v1/preview", preview_job)
    r.add_patch("/v1/jobs/{id}", change_job)
    r.add_get("/v1/jobs", list_jobs)
    r.add_get("/v1/jobs/{id}", get_job)
    r.add_post("/v1/jobs/{id}/cancel", cancel_job)
    r.add_delete("/v1/jobs/{id}", cancel_job)
    r.add_post("/v1/cancellations", cancel_many)
    r.add_get("/v1/jobs/{id}/decision", job_decision)
    r.add_get("/v1/jobs/{id}/events", job_events)
    r.add_get("/v1/jobs/{id}/logs", job_logs)
    r.add_get("/v1/events", events, allow_head=False)  # a stream has no HEAD: it never ends
    r.add_get("/v1/carbon", carbon)
    r.add_get("/v1/tenants", tenants)
    r.add_put("/v1/tenants/{tenant}/limit", set_tenant_limit)
    r.add_delete("/v1/tenants/{tenant}/limit", reset_tenant_limit)
    r.add_get("/v1/usage", usage_report)
    r.add_get("/v1/whoami", whoami)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
    dashboard.add_routes(app)
    return app
