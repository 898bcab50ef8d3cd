"""Turning validation errors into messages that name the field and the problem.

Used by the config loader (``file: field: problem``) and the HTTP API (JSON ``fields`` list), so a user
meets the same wording in both places.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError


# The fields that hold one of several kinds of settings (``kind:`` says which): pydantic puts the kind in
# an error's location (``carbon.http.url``), which is no field anyone writes, so it is left out.
TAGGED_FIELDS: dict[str, frozenset[str]] = {
    "adapter": frozenset({"simulated", "kubernetes", "mqtt"}),
    "carbon": frozenset({"files", "http"}),
    "prices": frozenset({"static", "files"}),
    "telemetry": frozenset({"nvml", "prometheus"}),
}


# The context key of :func:`at`'s errors: where, below the model that raised it, the error belongs.
_AT = "heliotrope_at"


def at(field: str | tuple[int | str, ...], problem: str) -> PydanticCustomError:
    """An error a model validator raises about one of its fields, to be reported at that field (``gpus.count``)
    rather than at the model (the API's ``(body)``, for a job spec or a site spec): a check that compares two
    fields, which only the model's validator sees together, names the one to change. ``field``: a field name (its
    alias where it has one: the name the user writes), or a path below the model (``("quotas", 1, "tenant")``)."""
    # (the problem is pydantic's message template: only "{heliotrope_at}" in it would be replaced)
    return PydanticCustomError("value_error", problem, {_AT: (field,) if isinstance(field, str) else tuple(field)})


def field_path(loc: tuple[int | str, ...]) -> str:
    """``('sites', 2, 'gpus', 0, 'model')`` → ``sites[2].gpus[0].model``; ``('carbon', 'http', 'url')`` →
    ``carbon.url`` (the kind of settings a tagged field holds is not a field)."""
    out = ""
    previous: int | str | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "json-or-python") or str(part).startswith(("function-", "tagged-union")):
            continue
        elif isinstance(previous, str) and part in TAGGED_FIELDS.get(previous, ()):
            continue
        else:
            out += f".{part}" if out else str(part)
        previous = part
    return out or "(body)"


# A key the model does not have: the problem of every such field, which callers that know better may replace.
UNKNOWN_FIELD = "unknown field (check the spelling)"


def _problem(err: Any) -> str:
    msg: str = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "extra_forbidden":
        msg = UNKNOWN_FIELD
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif err["type"] == "union_tag_not_found":  # pydantic's "Unable to extract tag using discriminator 'kind'"
        key = str((err.get("ctx") or {}).get("discriminator", "kind")).strip("'\"")
        names = [p for p in err["loc"] if isinstance(p, str)]
        tags = TAGGED_FIELDS.get(names[-1], frozenset()) if names else frozenset()
        msg = f"{key} is missing" + (f": say which, one of {', '.join(sorted(tags))}" if tags else "")
    elif err["type"] == "literal_error" and isinstance(err["input"], bool):
        # YAML 1.1 reads an unquoted off, no, on or yes as a boolean: `mode: off` arrives as false.
        words = {False: ("off", "no", "n", "false"), True: ("on", "yes", "y", "true")}[err["input"]]
        meant = next((w for w in words if f"'{w}'" in str((err.get("ctx") or {}).get("expected", ""))), None)
        if meant is not None:
            got = str(err["input"]).lower()
            msg += f"; got {got}: YAML reads an unquoted {meant} as {got}: write '{meant}' in quotes"
    return msg


def integral_float(err: Any) -> bool:
    """A number such as 2.0 where strict validation wants an integer: an integer to JSON Schema, so no problem."""
    return err["type"] == "int_type" and isinstance(err["input"], float) and err["input"].is_integer()


def problems(error: ValidationError, read_only: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """One ``{"field", "problem"}`` entry per error pydantic found (but :func:`integral_float`). ``read_only``:
    fields the resource has as read but a document may not carry (a site's ``status``), each with the problem
    to name instead of a misspelling."""
    out = []
    for err in error.errors(include_url=False):
        if integral_float(err):
            continue
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        loc += tuple((err.get("ctx") or {}).get(_AT, ()))  # (an error raised with at(): below the model)
        field = field_path(loc)
        problem = _problem(err)
        if problem == UNKNOWN_FIELD and read_only and field in read_only:
            problem = read_only[field]
        out.append({"field": field, "problem": problem})
    return out


def located(problem: dict[str, str]) -> str:
    """One of :func:`problems` as a file's or a command's message reads it: ``FIELD: PROBLEM``, or the problem
    alone for a check of the whole document (``(body)``, the API's word for a request body, names nothing
    there)."""
    field = problem["field"]
    return problem["problem"] if field in ("", "(body)") else f"{field}: {problem['problem']}"


def is_malformed_json(error: ValidationError) -> bool:
    return any(e["type"] == "json_invalid" for e in error.errors(include_url=False))
