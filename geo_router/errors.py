"""The router's typed errors and the one place they become OpenAI (or Anthropic) error bodies.

Every error the router answers itself is a `RouterError`, a meridian.errors.OpenAIError;
the handlers installed by `install_error_handlers` turn it, and anything else raised, into
the answer in the API's own shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from meridian.contracts import HEADER_REQUEST_ID, Route
from meridian.errors import OpenAIError

log = logging.getLogger(__name__)


class RouterError(OpenAIError):
    """An error the router answers itself, in OpenAI's error shape.

    The attributes (status, type_, code, param, headers) and the body are the shared base's
    (meridian.errors), the same as the node's errors: a client sees one shape whichever
    part of the fabric answered.
    """


class BadRequest(RouterError):
    status = 400
    type_ = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)


class InvalidApiKey(RouterError):
    status = 401
    type_ = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Incorrect or missing API key.") -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class ModelNotFound(RouterError):
    status = 404
    type_ = "invalid_request_error"
    code = "model_not_found"
    param = "model"

    def __init__(self, model: str) -> None:
        # Same answer for "served nowhere" and "not allowed for you": a tenant must not
        # learn which models other tenants use.
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.")


class RequestTooLarge(RouterError):
    status = 413
    type_ = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body is larger than the limit of {limit} bytes.")


def _retry_after(seconds: int) -> dict[str, str]:
    # Every 503 says when to come back: clients (the openai SDK among them) honour it
    # instead of retrying at once.
    return {"retry-after": str(max(1, seconds))}


class NoReplicaInZone(RouterError):
    status = 503
    code = "no_replica_in_zone"

    def __init__(self, model: str, zone: str, retry_after_s: int = 1) -> None:
        super().__init__(
            f"No healthy replica of model `{model}` is available in residency zone `{zone}`; "
            f"requests of this API key are never served outside zone `{zone}`. Retry later.",
            headers=_retry_after(retry_after_s),
        )


class NoHealthyReplica(RouterError):
    status = 503
    code = "no_healthy_replica"

    def __init__(self, model: str, retry_after_s: int = 1) -> None:
        super().__init__(f"No healthy replica of model `{model}` is available. Retry later.",
                         headers=_retry_after(retry_after_s))


class UpstreamTimeout(RouterError):
    status = 504
    code = "upstream_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The model did not answer within {timeout_s:g} seconds.")


class UpstreamLost(RouterError):
    """The node stopped answering health checks while a request waited for its answer."""

    status = 504
    code = "upstream_timeout"

    def __init__(self, node_id: str) -> None:
        super().__init__(
            f"Node {node_id} stopped answering health checks before it answered this request. "
            "It was not retried on another node because it may have run; retry it if it is safe to."
        )


class RouterOverloaded(RouterError):
    status = 503
    code = "router_overloaded"

    def __init__(self) -> None:
        super().__init__("The router has no free upstream connection. Retry later.", headers=_retry_after(1))


class RateLimited(RouterError):
    """The tenant is over its requests- or tokens-per-minute limit: OpenAI's 429."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: Literal["requests", "tokens"],
        retry_after_s: int | None,
        headers: dict[str, str],
    ) -> None:
        super().__init__(message, headers=headers)
        # As OpenAI does, `type` names the limit that was hit.
        self.type_ = limit
        # None: the request can never be admitted (larger than the whole bucket).
        self.retry_after_s = retry_after_s


class RoutingTableUnavailable(RouterError):
    status = 503
    code = "routing_table_unavailable"

    def __init__(self) -> None:
        super().__init__("The router has not loaded a routing table yet. Retry later.", headers=_retry_after(1))


class ScaleFromZeroTimeout(RouterError):
    status = 503
    type_ = "service_unavailable_error"
    code = "model_scaling_from_zero"

    def __init__(self, model: str, waited_s: float, retry_after_s: int) -> None:
        super().__init__(
            f"Model `{model}` is scaling up from zero replicas and none became ready within "
            f"{waited_s:g} seconds. Retry in {retry_after_s} seconds.",
            headers={"retry-after": str(retry_after_s)},
        )


class ScaleFromZeroQueueFull(RouterError):
    status = 503
    type_ = "service_unavailable_error"
    code = "scale_from_zero_queue_full"

    def __init__(self, model: str, limit: int, retry_after_s: int, *, yours: bool = False) -> None:
        whose = "of yours " if yours else ""
        super().__init__(
            f"Model `{model}` is scaling up from zero replicas and {limit} requests {whose}already "
            f"wait for it. Retry in {retry_after_s} seconds.",
            headers={"retry-after": str(retry_after_s)},
        )


class QueueTimeout(RouterError):
    """Flow control held the request past its queue TTL: the zone's replicas stayed full."""

    status = 503
    type_ = "service_unavailable_error"
    code = "queue_timeout"

    def __init__(self, model: str, waited_s: float, retry_after_s: int) -> None:
        super().__init__(
            f"Every replica of model `{model}` stayed busy for the {waited_s:g} seconds your request "
            f"could wait. Retry in {retry_after_s} seconds.",
            headers=_retry_after(retry_after_s),
        )


class QueueFull(RouterError):
    """Flow control's queue is at its caps (or shed this request for a more urgent one)."""

    status = 503
    type_ = "service_unavailable_error"
    code = "queue_full"

    def __init__(self, model: str, retry_after_s: int, *, shed: bool = False) -> None:
        why = ("gave its place to a more urgent request" if shed
               else "could not be queued: the queue for it is full")
        super().__init__(f"Every replica of model `{model}` is busy and your request {why}. "
                         f"Retry in {retry_after_s} seconds.", headers=_retry_after(retry_after_s))


class ClientClosedRequest(RouterError):
    """The client went away while its request waited; nobody reads this answer."""

    status = 499
    type_ = "invalid_request_error"
    code = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("The client closed the connection while the request waited.")


def error_response(exc: RouterError, request_id: str | None = None) -> JSONResponse:
    """Render a RouterError as OpenAI's error JSON."""
    headers = dict(exc.headers)
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


# Anthropic's error types by status (its clients read `error.type`; docs: "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "api_error"}


def anthropic_error_response(exc: RouterError, request_id: str | None = None) -> JSONResponse:
    """Render a RouterError in Anthropic's error shape, for the /v1/messages routes."""
    headers = dict(exc.headers)
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    kind = _ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}},
                        status_code=exc.status, headers=headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _respond(request: Request, exc: RouterError) -> JSONResponse:
    # Each API answers in its own error shape: Anthropic's clients parse theirs.
    if request.url.path.startswith(Route.MESSAGES):
        return anthropic_error_response(exc, _request_id(request))
    return error_response(exc, _request_id(request))


async def _router_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RouterError)
    return _respond(request, exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err = RouterError(
        str(exc.detail),
        status=exc.status_code,
        code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
        headers=dict(exc.headers or {}),
    )
    return _respond(request, err)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    return _respond(request, BadRequest(f"Invalid request: {exc}"))


async def _client_gone(request: Request, exc: Exception) -> JSONResponse:
    # Not an error of the router's: no traceback, no log line per disconnect.
    return _respond(request, ClientClosedRequest())


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the log, never to the client.
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = RouterError("The router hit an internal error.", status=500, code="internal_error")
    return _respond(request, err)


# Every exception-to-answer mapping of the router, most specific first (the installed handlers,
# and answer_error for the routes served ahead of FastAPI's stack, read this one table).
_HANDLERS: tuple[tuple[type[Exception], Callable[[Request, Exception], Awaitable[JSONResponse]]], ...] = (
    (RouterError, _router_error),
    (StarletteHTTPException, _http_error),
    (RequestValidationError, _validation_error),
    (ClientDisconnect, _client_gone),
    (Exception, _unexpected_error),
)


async def answer_error(request: Request, exc: Exception) -> JSONResponse:
    """The answer to `exc` raised while serving `request`: what the installed handlers answer,
    for the routes served ahead of FastAPI's stack (geo_router.ingress.http)."""
    handler = next(h for kind, h in _HANDLERS if isinstance(exc, kind))
    return await handler(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    """Register every exception-to-body mapping of the router on `app`."""
    for kind, handler in _HANDLERS:
        app.add_exception_handler(kind, handler)
