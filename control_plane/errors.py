"""Typed errors of the control plane and the one place they become problem+json bodies."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from meridian.admin_api import PROBLEM_MEDIA_TYPE
from meridian.contracts import Problem

log = logging.getLogger(__name__)


class ControlPlaneError(Exception):
    """Base of every error the API answers on purpose; status decides the HTTP code."""

    status: int = 500

    def __init__(self, detail: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail or HTTPStatus(self.status).phrase)
        self.detail = detail
        self.headers = headers


class BadRequest(ControlPlaneError):
    status = 400


class Unauthorized(ControlPlaneError):
    status = 401

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ControlPlaneError):
    status = 403


class NotFound(ControlPlaneError):
    status = 404


class Conflict(ControlPlaneError):
    status = 409


class PreconditionFailed(ControlPlaneError):
    """If-Match named a version that is no longer current (someone else changed it)."""

    status = 412


class ServiceUnavailable(ControlPlaneError):
    status = 503


def problem_response(
    status: int,
    detail: str | None = None,
    *,
    errors: list[dict[str, Any]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A problem+json response (RFC 9457) with the standard title for `status`."""
    body = Problem(title=HTTPStatus(status).phrase, status=status, detail=detail, errors=errors)
    return JSONResponse(
        body.model_dump(exclude_none=True),
        status_code=status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=dict(headers) if headers else None,
    )


def _validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    # Drop "input" and "ctx": they echo the request back and may not be JSON-serialisable.
    return [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]


async def _on_control_plane_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlPlaneError)
    return problem_response(exc.status, exc.detail, headers=exc.headers)


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").partition(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = _validation_errors(exc)
    # FastAPI does not parse a body sent as anything but JSON and reports it as a wrong value.
    has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
    if has_body and not _is_json(request.headers.get("content-type")) and any(e["loc"][:1] == ["body"] for e in errors):
        return problem_response(415, "send the body as JSON (Content-Type: application/json)")
    return problem_response(422, "request failed validation", errors=errors)


async def _on_http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else None
    return problem_response(exc.status_code, detail, headers=exc.headers)


async def _on_data_error(request: Request, exc: Exception) -> JSONResponse:
    # The database refused a value the API's validation let through (a NUL byte or an over-long
    # string, which Postgres rejects and SQLite stores): the request's fault, not the server's.
    assert isinstance(exc, DataError)
    # The driver's message only: the statement's parameters are the client's data.
    log.warning("database refused a value on %s %s: %s", request.method, request.url.path, exc.orig)
    return problem_response(400, "a value in the request is not storable (too long, out of range or a NUL byte)")


# Seconds a client is told to wait before retrying while the database is unreachable.
DATABASE_RETRY_AFTER_S = 2


async def _on_database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # The database went away (a restart, a failover, a cut connection) or refused to go on
    # (a deadlock, a serialisation failure): retrying is the answer, not a bug report. A
    # write whose connection broke while committing may have been applied; the client
    # cannot tell, so the message says so.
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path,
                getattr(exc, "orig", exc))
    return problem_response(
        503,
        "the control plane cannot reach its database right now; retry shortly (a write may "
        "have been applied if the connection broke while it was being committed)",
        headers={"retry-after": str(DATABASE_RETRY_AFTER_S)},
    )


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(500, "internal error; see the control plane's log")


def register_error_handlers(app: FastAPI) -> None:
    """Map every error to a problem+json body; nothing leaks a traceback to a client."""
    app.add_exception_handler(ControlPlaneError, _on_control_plane_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(OperationalError, _on_database_unavailable)
    app.add_exception_handler(Exception, _on_unexpected)
