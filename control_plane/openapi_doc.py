"""The admin API's published OpenAPI document: operations grouped by tag, errors as problem+json.

FastAPI documents a failed validation as its own `HTTPValidationError` JSON, but this API
answers every error as RFC 9457 problem+json (control_plane.errors), so a client generated
from the document would parse errors wrongly. `install(app)` post-processes the generated
document once: every error response of every operation is `application/problem+json` with
the `Problem` schema (meridian.contracts, the very model errors.py serialises), and each
operation lists the error statuses that can reach it, by rule:

- 401 where the operation takes a credential, 403 where that credential is a scoped API key;
- 404 where the path names a resource; 409 on writes (a concurrent or conflicting change);
- 412 where it takes If-Match; 422 where FastAPI validates parameters or a body;
- `default` (any other status: 400, 413, 415, 503...) is a problem too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from meridian.admin_api import PROBLEM_MEDIA_TYPE
from meridian.contracts import Problem

# The tags of the routers in control_plane/api, in the order /docs shows them.
TAGS: list[dict[str, str]] = [
    {"name": "health", "description": "Liveness and database reachability (no credential)."},
    {"name": "nodes", "description": "Node registration and heartbeats (cluster token) and the fleet's nodes."},
    {"name": "routing", "description": "The routing table routers long-poll (cluster token)."},
    {"name": "residency", "description": "Regions and the residency zones they belong to."},
    {"name": "keys", "description": "Scoped API keys (admin)."},
    {"name": "tenants", "description": "Tenants, their residency zone and limits."},
    {"name": "models", "description": "Registered models and whether they fit a GPU."},
    {"name": "deployments", "description": "Which models are deployed, where they may run and how far they scale."},
    {"name": "capacity", "description": "GPU limits per region and SKU."},
    {"name": "offerings", "description": "The providers' catalog: providers, their offerings and GPU SKUs."},
    {"name": "placement", "description": "Placement plans: preview, apply, export as infrastructure."},
    {"name": "scaling", "description": "The leader, node groups, reconciler steps and autoscaler decisions."},
    {"name": "weights", "description": "Where model weights can be fetched from (cluster token)."},
    {"name": "routers", "description": "Requests held by routers' flow control (cluster token)."},
    {"name": "audit", "description": "Who changed what, when."},
    {"name": "console", "description": "Reads behind the web console: fleet overview and drill reports."},
]

_SCHEMA_REF = "#/components/schemas/{model}"
_FASTAPI_ERROR_SCHEMAS = ("HTTPValidationError", "ValidationError")
_WRITES = frozenset({"post", "put", "patch", "delete"})
_DESCRIPTIONS = {
    401: "No credential, or an unknown or revoked one",
    403: "The API key lacks a scope this operation needs",
    404: "Nothing by that name",
    409: "The change conflicts with the current state or a concurrent change; retry or fix the state",
    412: "If-Match names a version that is no longer current",
    422: "The request failed validation; `errors` lists each field's problem",
}


def _problem_content() -> dict[str, Any]:
    return {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": _SCHEMA_REF.format(model="Problem")}}}


def _problem_schemas() -> dict[str, Any]:
    """Problem and the models it refers to, as component schemas."""
    schema = Problem.model_json_schema(ref_template=_SCHEMA_REF)
    defs = schema.pop("$defs", {})
    return {**defs, "Problem": schema}


def _error_statuses(path: str, method: str, operation: dict[str, Any]) -> set[int]:
    schemes = {name for requirement in operation.get("security", []) for name in requirement}
    headers = {p["name"].lower() for p in operation.get("parameters", []) if p.get("in") == "header"}
    statuses = {int(code) for code in operation.get("responses", {}) if code.isdigit() and int(code) >= 400}
    rules = (
        (401, bool(schemes)),
        (403, "apiKey" in schemes),
        (404, "{" in path),
        (409, method in _WRITES),
        (412, "if-match" in headers),
    )
    return statuses | {status for status, applies in rules if applies}


def document_problems(spec: dict[str, Any]) -> None:
    """Rewrite `spec` in place: every error response is a Problem (see the module's docstring)."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_ERROR_SCHEMAS:
        schemas.pop(name, None)
    schemas.update(_problem_schemas())
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            for status in sorted(_error_statuses(path, method, operation)):
                # A route's own description of a status stays; FastAPI's "Validation Error" goes.
                documented = responses.get(str(status), {}).get("description") if status != 422 else None
                responses[str(status)] = {
                    "description": documented or _DESCRIPTIONS.get(status, "Error"),
                    "content": _problem_content(),
                }
            responses["default"] = {
                "description": "Any other error (400, 413, 415, 503, ...), as problem+json",
                "content": _problem_content(),
            }
            operation["responses"] = dict(sorted(responses.items(), key=lambda kv: (not kv[0].isdigit(), kv[0])))


def install(app: FastAPI) -> None:
    """Make `app.openapi()` publish the tagged, problem+json document (built once, then cached)."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            document_problems(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
