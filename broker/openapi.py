"""The OpenAPI 3.1 document of the HTTP API, generated from the pydantic models."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from broker.models import Decision, Job, JobSpec, JobState, QuotaState, SiteSpec, SiteState, TenantQuota

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _page(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["items", "next"],
        "properties": {
            "items": {"type": "array", "items": item},
            "next": {"type": ["string", "null"], "description": "cursor of the next page; null on the last"},
        },
    }


@cache
def openapi_document() -> dict[str, Any]:
    models = [(m, "validation") for m in (JobSpec, SiteSpec, TenantQuota)] + [
        (m, "serialization") for m in (Job, Decision, SiteState, QuotaState)
    ]
    _, schemas = models_json_schema(models, ref_template=_REF)
    components = dict(schemas.get("$defs", {}))
    components["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "required": ["status", "message"],
                "properties": {
                    "status": {"type": "integer"},
                    "message": {"type": "string"},
                    "fields": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"field": {"type": "string"}, "problem": {"type": "string"}},
                        },
                    },
                },
            }
        },
    }
    components["SiteQuota"] = {
        "allOf": [{"type": "object", "required": ["site"], "properties": {"site": {"type": "string"}}},
                  _ref("QuotaState")]
    }
    components["Site"] = {
        "allOf": [_ref("SiteSpec"), {"type": "object", "properties": {"status": _ref("SiteState")}}]
    }
    err = {str(code): _json_body(_ref("Error"), text) for code, text in (
        (400, "malformed JSON or query parameter"), (404, "not found"), (409, "conflict"),
        (413, "body too large"), (422, "invalid spec"), (501, "the site's adapter keeps no quotas"),
        (503, "the site did not answer or could not keep the change"),
    )}
    tenant = {"name": "tenant", "in": "path", "required": True, "schema": {"type": "string"}}
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    job_id = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    list_params = [
        {"name": "state", "in": "query", "schema": {"type": "string", "enum": [s.value for s in JobState]}},
        {"name": "tenant", "in": "query", "schema": {"type": "string"}},
        {"name": "site", "in": "query", "schema": {"type": "string"}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
    ]
    paths: dict[str, Any] = {
        "/v1/sites": {
            "post": {
                "summary": "Register a site",
                "requestBody": _json_body(_ref("SiteSpec"), "the site"),
                "responses": {"201": _json_body(_ref("Site"), "registered"), **err},
            },
            "get": {"summary": "List sites", "responses": {"200": _json_body(_page(_ref("Site")), "sites")}},
        },
        "/v1/sites/{name}": {
            "parameters": [name],
            "get": {"summary": "Get a site", "responses": {"200": _json_body(_ref("Site"), "the site"), **err}},
            "put": {
                "summary": "Replace a site's spec",
                "requestBody": _json_body(_ref("SiteSpec"), "the new spec"),
                "responses": {"200": _json_body(_ref("Site"), "updated"), **err},
            },
            "delete": {"summary": "Remove a site", "responses": {"204": {"description": "removed"}, **err}},
        },
        "/v1/sites/{name}/quota": {
            "parameters": [name],
            "get": {
                "summary": "The site's quota state per tenant, as the site reports it",
                "parameters": [{"name": "tenant", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": _json_body(_ref("SiteQuota"), "the quota state"), **err},
            },
        },
        "/v1/sites/{name}/quota/{tenant}": {
            "parameters": [name, tenant],
            "put": {
                "summary": "Set a tenant's quota at the site (kept by the site across restarts)",
                "requestBody": _json_body(_ref("TenantQuota"), "the quota; tenant defaults to the path's"),
                "responses": {"200": _json_body(_ref("SiteQuota"), "the tenant's new state"), **err},
            },
            "delete": {
                "summary": "Remove a tenant's quota at the site",
                "responses": {"200": _json_body(_ref("SiteQuota"), "the quota state"), **err},
            },
        },
        "/v1/jobs": {
            "post": {
                "summary": "Submit a job (stored durably before 201)",
                "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string", "maxLength": 255}}],
                "requestBody": _json_body(_ref("JobSpec"), "the job"),
                "responses": {"201": _json_body(_ref("Job"), "accepted (or replayed for a repeated key)"), **err},
            },
            "get": {
                "summary": "List jobs, newest first",
                "parameters": list_params,
                "responses": {"200": _json_body(_page(_ref("Job")), "a page of jobs"), **err},
            },
        },
        "/v1/jobs/{id}": {
            "parameters": [job_id],
            "get": {"summary": "Get a job", "responses": {"200": _json_body(_ref("Job"), "the job"), **err}},
            "delete": {"summary": "Cancel a job", "responses": {"200": _json_body(_ref("Job"), "cancelled"), **err}},
        },
        "/v1/jobs/{id}/cancel": {
            "parameters": [job_id],
            "post": {"summary": "Cancel a job", "responses": {"200": _json_body(_ref("Job"), "cancelled"), **err}},
        },
        "/v1/jobs/{id}/decision": {
            "parameters": [job_id],
            "get": {
                "summary": "Why the job went where it went",
                "responses": {"200": _json_body(_ref("Decision"), "the latest decision"), **err},
            },
        },
        "/v1/jobs/{id}/events": {
            "parameters": [job_id],
            "get": {"summary": "The job's transitions", "responses": {"200": {"description": "transitions"}, **err}},
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "ok"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format): jobs, decisions, sites, carbon, cost",
                             "responses": {"200": {"description": "ok",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "heliotrope", "version": "1", "description": "Federated multi-cluster GPU job broker"},
        "paths": paths,
        "components": {"schemas": components},
    }
