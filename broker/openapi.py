"""The OpenAPI 3.1 document of the HTTP API, generated from the pydantic models.

The models check some fields in Python (a site name's syntax, a region, a GPU model, a time zone); the
document states those rules as patterns and enums too, so that a client, or a fuzzer, knows what the API
accepts without trying it. ``tests/test_schemathesis.py`` holds the document to what the live API does.
"""

from __future__ import annotations

from functools import cache
from typing import Any
from zoneinfo import available_timezones

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from broker import ids, models, usage
from broker.auth import Role
from broker.events import TYPES as EVENT_TYPES
from broker.models import (LABEL_MAX_CHARS, LABELS_MAX, PREVIEW_LIST_MAX, Cancellation, Decision, Job, JobChange,
                           JobSpec, JobState, Preview, QuotaState, SiteSpec, SiteState, TenantLimitChange,
                           TenantQuota)

_REF = "#/components/schemas/{model}"


def _any_case(word: str) -> str:
    return "".join(f"[{c.upper()}{c}]" if c.isalpha() else c for c in word)


_L, _LD = "[A-Za-z]", "[A-Za-z0-9]"  # identifiers are lower-cased (grid zones upper-cased) on the way in
_REGION = (
    rf"^\s*(?:{_any_case('gcp')}:{_L}+-{_L}+[0-9]+(?:-{_L})?"
    rf"|{_any_case('aws')}:{_L}{{2}}(?:-{_any_case('gov')})?-{_L}+-[0-9]+{_L}?"
    rf"|{_any_case('azure')}:{_L}{_LD}+"
    rf"|{_any_case('onprem')}:{_LD}[A-Za-z0-9._-]{{0,62}})\s*$"
)

# What each validating function of ``broker.models`` accepts, as JSON Schema (besides the type pydantic states).
_CHECKED_BY: dict[Any, dict[str, Any]] = {
    models._slug: {"pattern": f"^{models._NAME.pattern}$"},
    models.iana_time_zone: {"enum": sorted(available_timezones()), "description": "an IANA time zone"},
    ids.gpu_model: {"enum": list(ids.GPU_MODEL_IDS),
                    "description": "a GPU model id (its product names and cloud SKUs are accepted and canonicalised)"},
    ids.region: {"pattern": _REGION,
                 "description": "provider:region (gcp, aws, azure, onprem); a zone suffix is dropped"},
    ids.grid_zone: {"pattern": rf"^\s*{_L}{{2}}(?:-{_LD}{{1,8}}){{0,3}}\s*$",
                    "description": "an Electricity Maps zone id such as DE-LU (its aliases are accepted too)"},
}


class _Generator(GenerateJsonSchema):
    """Pydantic's JSON Schema, with the rules the models check in Python written into it."""

    def function_after_schema(self, schema: core_schema.AfterValidatorFunctionSchema) -> JsonSchemaValue:
        out = super().function_after_schema(schema)
        rule = _CHECKED_BY.get(schema["function"]["function"])
        return {**out, **rule} if rule else out

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        # Pydantic writes a key pattern as patternProperties, which leaves keys that miss it unconstrained.
        out = super().dict_schema(schema)
        if len(out.get("patternProperties", {})) == 1:
            ((pattern, values),) = out.pop("patternProperties").items()
            out["propertyNames"] = {**out.get("propertyNames", {}), "pattern": pattern}
            out["additionalProperties"] = values
        return out


_MIG_PROFILE = r"^[1-7]g\.[0-9]*[1-9][0-9]*gb$"  # models.mig_slices: 1 to 7 compute slices, some memory


def _if(field: str, holds: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": {"required": [field], "properties": {field: holds}}, "then": then}


_BEYOND_THE_SCHEMA = {
    "SiteSpec": "usd_per_gpu_hour prices only models its gpus have; at most 200,000 GPUs in all; each tenant at most "
                "once in quotas; a node group's mig_profiles fit its GPUs' memory; an mqtt adapter needs broker.mqtt; "
                "fair_share's window_h is at most 10,000 periods of its reweight_h; a telemetry source's "
                "stale_after_s is longer than its every_s; a kubernetes adapter's pod_security_context.runAsUser "
                "is not 0 where its pod_security is restricted",
    "JobSpec": "no region both in allowed_regions and denied_regions; profile, one the federation lets jobs choose; "
               "a new job's deadline, not in the past; its GPUs within its tenant's federation-wide limit "
               "(broker.tenant_limits); each job in after, after_any and after_failed, one the submitter may see (a "
               "job it may not see is answered as one that does not exist), named once across the three lists, at "
               f"most {models.AFTER_MAX} across after, after_any and after_failed together; in after, not already "
               "failed or cancelled, in after_failed, not already succeeded (422 naming after[i], after_any[i] or "
               "after_failed[i])",
    "JobChange": "profile, one the federation lets jobs choose; a new deadline, not in the past; the job's spec "
                 "with the change, valid as a job spec",
    "Cancellation": "a tenant, labels or both (an empty selector would cancel every job)",
}


def _state_model_rules(schemas: dict[str, Any]) -> None:
    """The rules a model's own validators check: as JSON Schema where it can say them, else in the description."""
    node_group, site, gpus, job = schemas["NodeGroup"], schemas["SiteSpec"], schemas["GpuRequest"], schemas["JobSpec"]
    for model, rules in _BEYOND_THE_SCHEMA.items():
        schemas[model]["description"] += f"\n\nAlso checked (a 422 names the field): {rules}."
    node_group["properties"]["mig_profiles"]["items"]["pattern"] = _MIG_PROFILE
    node_group["allOf"] = [  # MIG slices are offered on models that have MIG
        {"if": {"required": ["mig_profiles"], "properties": {"mig_profiles": {"minItems": 1}}},
         "then": {"properties": {"model": {"enum": [m.id for m in ids.GPU_MODELS if m.mig]}}}}]
    gpus["properties"]["mig_profile"]["anyOf"][0]["pattern"] = _MIG_PROFILE
    adapter = site["properties"]["adapter"]["discriminator"]  # the tag picks the variant: it must be there
    for ref in adapter["mapping"].values():
        variant = schemas[ref.rsplit("/", 1)[1]]
        variant["required"] = [adapter["propertyName"], *variant.get("required", [])]
    for field in ("usd_per_gpu_hour", "rtt_ms"):
        site["properties"][field]["additionalProperties"]["minimum"] = 0
    site["properties"]["usd_per_gpu_hour"]["additionalProperties"]["maximum"] = models.MAX_USD_PER_GPU_HOUR
    gpus["allOf"] = [
        _if("milli", {"maximum": 999}, {"properties": {"count": {"const": 1}}}),
        _if("shared", {"const": True},
            {"required": ["memory_gib"], "properties": {"count": {"const": 1}, "memory_gib": {"type": "number"}}}),
        _if("mig_profile", {"type": "string"}, {"properties": {"milli": {"const": 1000}, "shared": {"const": False}}}),
        {"if": {"required": ["mig_profile", "model"],  # MIG slices of a model name one that has MIG
                "properties": {"mig_profile": {"type": "string"}, "model": {"type": "string"}}},
         "then": {"properties": {"model": {"enum": [m.id for m in ids.GPU_MODELS if m.mig]}}}},
    ]
    job["allOf"] = [
        _if("latency_slo_ms", {"type": "number"},
            {"required": ["origin_region"], "properties": {"origin_region": {"type": "string"}}}),
    ]
    for kind in ("after", "after_any", "after_failed"):  # (checked at submission, naming the second one: after[i])
        job["properties"][kind]["uniqueItems"] = True
    text = {"maxLength": LABEL_MAX_CHARS, "pattern": "^[^\\u0000-\\u001f\\u007f]*$"}  # no control characters
    job["properties"]["labels"].update({  # (checked at submission: label_problem)
        "maxProperties": LABELS_MAX, "additionalProperties": {"type": "string", **text},
        "propertyNames": {**text, "minLength": 1, "pattern": "^[^=\\u0000-\\u001f\\u007f]*$"}})
    schemas["Cancellation"]["properties"]["labels"]["propertyNames"] = {"minLength": 1}
    schemas["Cancellation"]["anyOf"] = [  # a tenant or some labels: never every job at once
        {"required": ["tenant"], "properties": {"tenant": {"type": "string"}}},
        {"required": ["labels"], "properties": {"labels": {"type": "object", "minProperties": 1}}},
    ]
    change = schemas["JobChange"]  # at least one key; a priority is a number (null: only deadline and profile)
    change["minProperties"] = 1
    priority = change["properties"]["priority"]
    change["properties"]["priority"] = {**{k: v for k, v in priority.items() if k not in ("anyOf", "default")},
                                        "type": "integer", "minimum": -1000, "maximum": 1000}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _request(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {**_json_body(schema, description), "required": True}


def _page(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["items", "next"],
        "properties": {
            "items": {"type": "array", "items": item},
            "next": {"type": ["string", "null"], "description": "cursor of the next page; null on the last"},
        },
    }


def _extended(model: dict[str, Any], title: str, required: bool = True, **more: dict[str, Any]) -> dict[str, Any]:
    """``model``'s schema with the properties ``more`` added (a model's schema forbids any other)."""
    out = {**model, "title": title, "properties": {**model["properties"], **more}}
    if required:
        out["required"] = [*model.get("required", []), *more]
    return out


def _object(required: bool = True, **properties: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = list(properties)
    return out


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_NULLABLE_STR, _NULLABLE_NUM = {"type": ["string", "null"]}, {"type": ["number", "null"]}


def _components() -> dict[str, Any]:
    models = [(m, "validation") for m in (JobSpec, JobChange, SiteSpec, TenantQuota, Cancellation,
                                          TenantLimitChange)] + [
        (m, "serialization") for m in (Job, Decision, Preview, SiteState, QuotaState)
    ]
    _, schemas = models_json_schema(models, ref_template=_REF, schema_generator=_Generator)
    components = dict(schemas.get("$defs", {}))
    _state_model_rules(components)
    components["Error"] = _object(error={
        "type": "object",
        "required": ["status", "message"],
        "properties": {
            "status": _INT,
            "message": _STR,
            "fields": {"type": "array", "items": _object(field=_STR, problem=_STR)},
        },
    })
    components["SiteQuota"] = _extended(components["QuotaState"], "SiteQuota", site=_STR)
    quota = components["TenantQuota"]  # PUT .../quota/{tenant}: the body's tenant, if any, is the path's
    components["TenantQuotaAtPath"] = {**quota, "title": "TenantQuotaAtPath",
                                       "required": [f for f in quota.get("required", []) if f != "tenant"]}
    signals = _object(carbon_g_per_kwh={**_NULLABLE_NUM, "description": "the grid's intensity now, gCO2e/kWh"},
                      usd_per_gpu_hour={"type": "object", "additionalProperties": _NUM,
                                        "description": "the price of a GPU-hour of each model it has, now"})
    # A site as the caller may see it: without its adapter and quota list unless it operates the site, and
    # never with a secret (a Kubernetes site's kubeconfig); its live signals in the reads.
    components["Site"] = _extended(
        _extended(components["SiteSpec"], "Site", status=_ref("SiteState")), "Site", required=False, signals=signals)
    components["JobEvent"] = _object(at={"type": "string", "format": "date-time"},
                                     state={"enum": [s.value for s in JobState]}, site=_NULLABLE_STR,
                                     attempt=_INT, reason=_NULLABLE_STR,
                                     gpu_model={**_NULLABLE_STR, "description": "the GPU model the attempt was placed "
                                                "on (null: none yet, or recorded by an earlier release)"},
                                     usd_per_gpu_hour={**_NULLABLE_NUM, "description": "the price per GPU-hour of "
                                                       "that model at its site that routing saw when the attempt was "
                                                       "placed, which the usage report charges it (null: unpriced, "
                                                       "or recorded by an earlier release)"})
    components["Carbon"] = _object(
        jobs={**_INT, "description": "distinct jobs placed (a job admitted again is not counted again)"},
        energy_kwh=_NUM, grams=_NUM, agnostic_grams=_NUM, saved_grams=_NUM, saved_fraction=_NUM,
        moved_jobs={**_INT, "description": "of those jobs, the ones an attempt put elsewhere than the baseline's site"},
        admissions={**_INT, "description": "attempts counted: each admission by a site"},
        open_attempts={**_INT, "description": "attempts still running, counted for their expected run until they end "
                                              "(then for the time they ran)"},
        baseline=_STR)
    components["TenantUsage"] = {
        **_object(required=False, tenant=_STR,
                  gpus_held={**_NUM, "description": "GPUs its jobs on sites or on their way to one hold (a fractional "
                                                    "job its share)"},
                  gpus_limit={**_NUM, "description": "the GPUs broker.tenant_limits, or a limit set through PUT "
                                                     "/v1/tenants/{tenant}/limit, lets it hold (absent: no limit)"},
                  jobs={"type": "object", "additionalProperties": _INT,
                        "propertyNames": {"enum": [s.value for s in JobState if not s.terminal]},
                        "description": "its unfinished jobs by state"},
                  limit_source={"enum": ["config", "default", "override"],
                                "description": "where its limit comes from: its own entry of broker.tenant_limits "
                                               "(config), broker.default_tenant_limit (default; none there: "
                                               "unlimited), or a limit set through PUT /v1/tenants/{tenant}/limit "
                                               "(override, null there: unlimited)"}),
        "required": ["tenant", "gpus_held", "jobs", "limit_source"]}
    figures = dict(
        gpu_hours={**_NUM, "description": "GPU-hours held in the window: each attempt from its admission to its end "
                                          "(a share of a GPU, N/7 of one per MIG slice of Ng)"},
        attempts={**_INT, "description": "attempts that began to hold GPUs in the window"},
        energy_kwh={**_NUM, "description": "GPU-hours x the model's board power (TDP): an upper estimate"},
        cost_usd={**_NUM, "description": "each attempt's GPU-hours x the price per GPU-hour of its model at its "
                                         "site that routing saw when it was placed (a price provider's, else the "
                                         "spec's); GPU-hours with no price recorded (placed before prices were "
                                         "recorded) at the price routing sees now, which notes then says; absent "
                                         "where some GPU-hours have neither"},
        co2e_kg={**_NUM, "description": "the energy, hour by hour, x its site's grid intensity then, as the carbon "
                                        "provider measured it (the hour under way: its forecast); absent without a "
                                        "carbon provider, or where an hour's intensity cannot be had (notes)"})
    components["UsageReport"] = _object(
        **{"from": {**_STR, "format": "date-time", "description": "the window's start (the start of an hour)"},
           "to": {**_STR, "format": "date-time", "description": "its end (the end of an hour)"}},
        by={"type": "array", "items": {"enum": list(usage.GROUP_KEYS)}},
        items={"type": "array", "items": {
            **_object(required=False, tenant=_STR, site=_STR, gpu_model=_STR, **figures),
            "required": ["gpu_hours", "attempts", "energy_kwh"]},
            "description": "a row per group, largest GPU-hours first"},
        total={**_object(required=False, **figures), "required": ["gpu_hours", "attempts", "energy_kwh"]},
        notes={"type": "array", "items": _STR, "description": "why a figure is left out or counts less than it "
                                                              "might (absent: nothing to say)"})
    components["UsageReport"]["required"].remove("notes")
    components["WhoAmI"] = _object(name=_STR, role={"enum": [r.value for r in Role]},
                                   sites={"type": "array", "items": _STR}, tenants={"type": "array", "items": _STR},
                                   token_id=_NULLABLE_STR, auth=_BOOL)
    components["Cancelled"] = _object(
        cancelled={"type": "array", "items": _STR, "description": "the jobs cancelled, newest first"},
        skipped={"type": "array", "items": _object(id=_STR, reason=_STR),
                 "description": ("matched jobs not cancelled: each ended, or left the state or site asked "
                                 "for, meanwhile, or its cancel could not be stored")},
        matched={**_INT, "description": "the jobs this call dealt with: cancelled and skipped"},
        more={**_BOOL, "description": "more jobs match than one call deals with: call again"})
    components["Healthz"] = {
        **_object(status={"const": "ok"}, sites=_INT, active_jobs=_INT, cycles=_INT),
        "additionalProperties": True,  # and mqtt, replica: the broker's links, when it has them
    }
    return components


_WHY = {
    400: "malformed JSON, a body of the wrong JSON type, or a bad query parameter",
    401: "no valid bearer token (authentication on)",
    403: "the token's role or scope does not allow this call",
    404: "no such resource (or one the token may not see)",
    409: "conflict with the current state",
    413: "body larger than broker.max_body_bytes",
    422: "invalid spec: each field and its problem",
    501: "the site's adapter keeps no quotas",
    503: "the store, the leader or the site could not answer or keep the change; try again",
}
_LOCATION = {"Location": {"description": "the new resource", "schema": _STR}}


def _answers(ok: dict[str, Any], *errors: int, ok_status: int = 200, open_: bool = False) -> dict[str, Any]:
    """An operation's responses: ``ok`` and the errors it may answer, plus 401 and 403 unless it is open, and 503
    (a store or a leader that did not answer)."""
    codes = sorted({*errors, 503} | (set() if open_ else {401, 403}))
    out = {str(ok_status): ok}
    for code in codes:
        out[str(code)] = _json_body(_ref("Error"), _WHY[code])
        if code == 401:
            out["401"]["headers"] = {"WWW-Authenticate": {"description": "Bearer realm", "schema": _STR}}
    return out


# GET /v1/usage's window: a date, or a time with a zone; its grouping keys
_TIME_OR_DATE = (r"^[0-9]{4}-[0-9]{2}-[0-9]{2}"
                 r"([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?(Z|[+-][0-9]{2}:[0-9]{2}))?$")
_KEY = f"({'|'.join(usage.GROUP_KEYS)})"


def _paths() -> dict[str, Any]:
    def param(name: str, where: str = "query", **schema: Any) -> dict[str, Any]:
        return {"name": name, "in": where, "required": where == "path", "schema": {"type": "string", **schema}}

    slug = _CHECKED_BY[models._slug]["pattern"]
    name, tenant = param("name", "path", pattern=slug), param("tenant", "path", pattern=slug)
    job_id = param("id", "path")
    job = _json_body(_ref("Job"), "the job")
    return {
        "/v1/sites": {
            "post": {
                "summary": "Register a site",
                "requestBody": _request(_ref("SiteSpec"), "the site"),
                "responses": _answers({**_json_body(_ref("Site"), "registered"), "headers": _LOCATION},
                                      400, 409, 413, 422, ok_status=201),
            },
            "get": {"summary": "List sites", "responses": _answers(_json_body(_page(_ref("Site")), "sites"))},
        },
        "/v1/sites/{name}": {
            "parameters": [name],
            "get": {"summary": "Get a site", "responses": _answers(_json_body(_ref("Site"), "the site"), 404)},
            "put": {
                "summary": "Replace a site's spec (the body names the path's site; a secret left out is kept)",
                "requestBody": _request(_ref("SiteSpec"), "the new spec"),
                "responses": _answers(_json_body(_ref("Site"), "updated"), 400, 404, 409, 413, 422),
            },
            "delete": {"summary": "Remove a site (none of its jobs active)",
                       "responses": _answers({"description": "removed"}, 404, 409, ok_status=204)},
        },
        "/v1/sites/{name}/cordon": {
            "parameters": [name],
            "post": {
                "summary": "Cordon a site: no new jobs are placed there; what runs there runs on",
                "requestBody": {**_json_body(_object(False, reason={**_NULLABLE_STR, "maxLength": 500}), "why (optional)"),
                                "required": False},
                "responses": _answers(_json_body(_ref("Site"), "the site, cordoned"), 400, 404, 413, 422),
            },
        },
        "/v1/sites/{name}/uncordon": {
            "parameters": [name],
            "post": {"summary": "Give a cordoned site back to routing (no body; {} is taken)",
                     "requestBody": {**_json_body(_object(False), "none: leave it out"), "required": False},
                     "responses": _answers(_json_body(_ref("Site"), "the site, uncordoned"), 400, 404, 413, 422)},
        },
        "/v1/sites/{name}/quota": {
            "parameters": [name],
            "get": {
                "summary": "The site's quota state per tenant, as the site reports it",
                "parameters": [param("tenant", minLength=1)],
                "responses": _answers(_json_body(_ref("SiteQuota"), "the quota state"), 400, 404, 501),
            },
        },
        "/v1/sites/{name}/quota/{tenant}": {
            "parameters": [name, tenant],
            "put": {
                "summary": "Set a tenant's quota at the site (kept by the site across restarts)",
                "requestBody": _request(_ref("TenantQuotaAtPath"), "the quota; tenant defaults to the path's"),
                "responses": _answers(_json_body(_ref("SiteQuota"), "the tenant's new state"),
                                      400, 404, 413, 422, 501),
            },
            "delete": {
                "summary": "Remove a tenant's quota at the site",
                "responses": _answers(_json_body(_ref("SiteQuota"), "the quota state"), 404, 501),
            },
        },
        "/v1/jobs": {
            "post": {
                "summary": "Submit a job (stored durably before 201)",
                # Printable ASCII, not starting or ending with a space (HTTP trims those).
                "parameters": [param("Idempotency-Key", "header", maxLength=255, pattern=r"^[!-~]([ -~]*[!-~])?$")],
                "requestBody": _request(_ref("JobSpec"), "the job"),
                "responses": _answers(
                    {**_json_body(_ref("Job"), "accepted (or replayed for a repeated key)"), "headers": {
                        **_LOCATION,
                        "Idempotent-Replayed": {"description": "true: the key was seen before; this is that job",
                                                "schema": {"const": "true"}},
                    }},
                    400, 409, 413, 422, ok_status=201),
            },
            "get": {
                "summary": "List jobs, newest first",
                "parameters": [
                    param("state", enum=[s.value for s in JobState]), param("tenant", minLength=1),
                    param("site", minLength=1),
                    {"name": "label", "in": "query", "required": False, "style": "form", "explode": True,
                     "description": "KEY=VALUE: the job carries the label with that value; KEY: with any value; "
                                    "repeated: every one must match",
                     "schema": {"type": "array", "items": {"type": "string", "pattern": "^[^=]"}}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                                                                "default": 100}},
                    param("cursor", description="the previous page's next"),
                ],
                "responses": _answers(_json_body(_page(_ref("Job")), "a page of jobs"), 400),
            },
        },
        "/v1/preview": {
            "post": {
                "summary": "What the broker would decide for a job now, at its place in the queue (after the queued "
                           "jobs the next pass would decide before it): its site, its deferral or why it would wait, "
                           "with every site's terms; nothing is submitted. An array of specs: the jobs as if "
                           "submitted together one after another in its order, each decided at its place in the "
                           "queue after the queued jobs and the array's jobs the next pass would decide before it, "
                           "which take their room; answered in the array's order (a 422 names a spec's field by its "
                           "index, [1].gpus.count)",
                "requestBody": _request({"oneOf": [
                    _ref("JobSpec"),
                    {"type": "array", "items": _ref("JobSpec"), "minItems": 1, "maxItems": PREVIEW_LIST_MAX,
                     "description": "jobs submitted together, in this order"},
                ]}, "the job, or the jobs"),
                "responses": _answers(_json_body({"oneOf": [
                    _ref("Preview"),
                    _object(items={"type": "array", "items": _ref("Preview"),
                                   "description": "one per spec, in the array's order"}),
                ]}, "the decision it would get, or each one's"), 400, 413, 422),
            },
        },
        "/v1/jobs/{id}": {
            "parameters": [job_id],
            "get": {"summary": "Get a job", "responses": _answers(job, 404)},
            "patch": {
                "summary": "Change a queued job's priority, deadline or profile (409 once it has left the queue)",
                "requestBody": _request(_ref("JobChange"), "what changes"),
                "responses": _answers(job, 400, 404, 409, 413, 422),
            },
            "delete": {"summary": "Cancel a job", "responses": _answers(job, 404, 409)},
        },
        "/v1/jobs/{id}/cancel": {
            "parameters": [job_id],
            "post": {"summary": "Cancel a job", "responses": _answers(job, 404, 409)},
        },
        "/v1/cancellations": {
            "post": {
                "summary": "Cancel many jobs at once: a tenant's, those carrying labels, in a state, at a site (each as "
                           "POST /v1/jobs/{id}/cancel would); at most 10,000 a call ('more': call again)",
                "requestBody": _request(_ref("Cancellation"), "which jobs, and why"),
                "responses": _answers(_json_body(_ref("Cancelled"), "what was cancelled and skipped"), 400, 413, 422),
            },
        },
        "/v1/jobs/{id}/decision": {
            "parameters": [job_id],
            "get": {
                "summary": "Why the job went where it went",
                "responses": {**_answers(_json_body(_ref("Decision"), "the latest decision"), 404),
                              "501": _json_body(_ref("Error"), "the decision's record is of a version this broker "
                                                               "does not read (a later release's replica wrote it)")},
            },
        },
        "/v1/jobs/{id}/events": {
            "parameters": [job_id],
            "get": {"summary": "The job's transitions, oldest first",
                    "responses": _answers(_json_body(_page(_ref("JobEvent")), "transitions"), 404)},
        },
        "/v1/jobs/{id}/logs": {
            "parameters": [job_id],
            "get": {
                "summary": "What an attempt printed (its last lines, at most 1 MiB), as its site gives it: a Kubernetes "
                           "site the container's log while its Pod exists, a simulated site a simulated log; with "
                           "follow, then what it prints, streamed until it ends",
                "parameters": [
                    {"name": "attempt", "in": "query", "description": "the attempt (default: the latest a site admitted)",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1_000_000}},
                    {"name": "tail", "in": "query", "description": "how many of the last lines",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1_000_000, "default": 1000}},
                    {"name": "follow", "in": "query", "description": (
                        "true (or 1): the tail, then what the attempt prints as it prints it, streamed (chunked) until "
                        "the attempt ends; a follow that ends sooner (24 hours have passed, the site stopped "
                        "answering, the token was revoked, the broker stopped) is cut off before its last chunk, "
                        "so the client can tell; 501 where the site cannot follow logs, 503 where this replica "
                        "follows as many as it may (256)"),
                     "schema": {"type": "string", "enum": ["true", "false", "1", "0"], "default": "false"}},
                ],
                "responses": {
                    **_answers({"description": "the log's text (with follow: streamed as it comes)", "content": {
                        "text/plain": {"schema": {"type": "string"}}}, "headers": {
                        "X-Heliotrope-Site": {"description": "the site the attempt ran at", "schema": _STR},
                        "X-Heliotrope-Attempt": {"description": "the attempt", "schema": _STR},
                        "X-Heliotrope-Log-Truncated": {"description": "true: lines or bytes before the text were "
                                                                      "left out", "schema": {"enum": ["true", "false"]}},
                        "X-Heliotrope-Log-Source": {"description": "where the site read it (a Pod and container)",
                                                    "schema": _STR}}},
                        400, 404, 409, 422),
                    "409": _json_body(_ref("Error"), "the job has not reached a site (for a site's operator: one it "
                                                     "operates), the attempt never did, or the site has no log of it "
                                                     "(not started yet, or gone)"),
                    "403": _json_body(_ref("Error"), "a site's operator asked for an attempt that ran at a site it "
                                                     "does not operate"),
                    "422": _json_body(_ref("Error"), "attempt or tail not an integer in range: the field names it"),
                    "501": _json_body(_ref("Error"), "the site cannot give logs (its adapter has none, or its agent "
                                                     "is of an earlier release), or, with follow, cannot follow them "
                                                     "(the field names follow)"),
                    "503": {**_json_body(_ref("Error"), "the site did not answer (or the store, or the leader), or "
                                                        "this replica follows as many logs as it may; try again"),
                            "headers": {"Retry-After": {"description": "seconds", "schema": _STR}}},
                },
            },
        },
        "/v1/events": {
            "get": {
                "summary": "Live events (server-sent events) until the client leaves; a replica that does not "
                           "lead relays the leader's stream",
                "parameters": [
                    param("tenant", minLength=1), param("site", minLength=1), param("job", minLength=1),
                    param("type", description=f"comma-separated, among {', '.join(EVENT_TYPES)}"),
                    param("last_event_id", pattern="^[0-9]+$"), param("Last-Event-ID", "header", pattern="^[0-9]+$"),
                ],
                "responses": _answers({"description": "the stream", "content": {"text/event-stream": {
                    "schema": {"type": "string"}}}}, 400),
            },
        },
        "/v1/carbon": {"get": {"summary": "Carbon of the placements made, against a carbon-agnostic choice",
                               "responses": _answers(_json_body(_ref("Carbon"), "the ledger"))}},
        "/v1/tenants": {"get": {
            "summary": "Each tenant's unfinished jobs by state and the GPUs they hold across the federation, against "
                       "its limit (broker.tenant_limits); a submitter reads its own tenants'",
            "parameters": [param("tenant", minLength=1)],
            "responses": _answers(_json_body(_object(items={"type": "array", "items": _ref("TenantUsage")}),
                                             "the tenants"), 400)}},
        "/v1/tenants/{tenant}/limit": {
            "parameters": [tenant],
            "put": {
                "summary": "Set a tenant's GPU limit across the federation live, over the configuration's (kept in "
                           "the store until deleted; jobs a raised limit makes room for start at once; a lowered one "
                           "stops nothing); admins only",
                "requestBody": _request(_ref("TenantLimitChange"), "the limit"),
                "responses": _answers(_json_body(_ref("TenantUsage"), "the tenant, with its new limit"),
                                      400, 413, 422),
            },
            "delete": {
                "summary": "Remove a tenant's limit set through the API: the configuration's applies again; admins "
                           "only",
                "responses": _answers(_json_body(_ref("TenantUsage"), "the tenant, with the configuration's limit"),
                                      404, 422),
            },
        },
        "/v1/usage": {"get": {
            "summary": "GPU-hours, attempts, energy and an estimate of cost per tenant, site or GPU model over a "
                       "window of whole hours (UTC), for chargeback, kept after finished jobs are deleted; a "
                       "submitter reads its own tenants'",
            "parameters": [
                param("from", pattern=_TIME_OR_DATE, description="an ISO 8601 time with a zone, or a date (midnight "
                                                                  "UTC); taken back to the start of its hour (default: "
                                                                  "30 days before to)"),
                param("to", pattern=_TIME_OR_DATE, description="taken on to the end of its hour (default: now)"),
                param("by", pattern=f"^{_KEY}(,{_KEY}){{0,2}}$",
                      description=f"comma-separated, among {', '.join(usage.GROUP_KEYS)} (default: tenant)"),
                param("tenant", minLength=1), param("site", minLength=1)],
            "responses": _answers(_json_body(_ref("UsageReport"), "the report"), 400)}},
        "/v1/whoami": {"get": {"summary": "Who the token is: name, role and scope",
                               "responses": _answers(_json_body(_ref("WhoAmI"), "the caller"))}},
        "/healthz": {"get": {"summary": "Liveness", "security": [],
                             "responses": _answers(_json_body(_ref("Healthz"), "ok"), open_=True)}},
        "/readyz": {"get": {"summary": "Readiness: the store answers a read (503 while it does not)", "security": [],
                            "responses": _answers(_json_body(_object(status={"const": "ready"}), "ready"),
                                                  open_=True)}},
        "/openapi.json": {"get": {"summary": "This document", "security": [],
                                  "responses": _answers(_json_body({"type": "object"}, "the document"), open_=True)}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format): jobs, decisions, sites, carbon, cost",
                             "responses": _answers({"description": "ok", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}})}},
    }


@cache
def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "heliotrope", "version": "1", "description": "Federated multi-cluster GPU job broker"},
        "paths": _paths(),
        "components": {
            "schemas": _components(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "a token from 'heliotrope token create' (broker.auth)"}},
        },
        # Every call but /healthz and /openapi.json, when broker.auth.enabled; with it off the API is open.
        "security": [{"bearer": []}],
    }
