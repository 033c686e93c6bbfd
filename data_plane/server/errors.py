"""The node's error types and the one place they become OpenAI error responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from data_plane.engine.base import (
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequestError,
)
from meridian import http_body
from meridian.errors import OpenAIError
from meridian.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)


class APIError(OpenAIError):
    """An error the node answers itself, in OpenAI's error shape (the kernel's base, so
    that the router and the node answer the same failure with the same body)."""


class BadRequestError(APIError):
    status = 400
    type_ = "invalid_request_error"


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


class AuthenticationError(APIError):
    status = 401
    type_ = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(APIError):
    status = 404
    type_ = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist on this node.", param="model")


class PayloadTooLargeError(APIError):
    status = 413
    type_ = "invalid_request_error"
    code = "request_too_large"


class ClientClosedError(APIError):
    """The client went away; nobody reads this answer (nginx's 499)."""

    status = 499
    type_ = "invalid_request_error"
    code = "client_disconnected"

    def __init__(self) -> None:
        super().__init__("client disconnected")


class UnavailableError(APIError):
    """The node cannot take this request now (loading, draining, overloaded); the
    router may retry it on another replica."""

    status = 503
    type_ = "service_unavailable"


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


def validation_error(exc: ValidationError | RequestValidationError) -> BadRequestError:
    """First pydantic error as a 400, its location as the OpenAI `param`."""
    errors = exc.errors()
    if not errors:
        return BadRequestError("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    return BadRequestError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every error into an OpenAI JSON body."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ValidationError | RequestValidationError)
        return error_response(validation_error(exc))

    async def on_overloaded(_: Request, exc: Exception) -> JSONResponse:
        return error_response(UnavailableError(str(exc), code="overloaded"))

    async def on_not_ready(_: Request, exc: Exception) -> JSONResponse:
        return error_response(UnavailableError(str(exc), code="not_ready"))

    async def on_engine_request(_: Request, exc: Exception) -> JSONResponse:
        return error_response(BadRequestError(str(exc)))

    async def on_template(_: Request, exc: Exception) -> JSONResponse:
        return error_response(BadRequestError(str(exc), param="messages"))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(
            APIError(str(exc.detail), status=exc.status_code, headers=getattr(exc, "headers", None))
        )

    async def on_body(_: Request, exc: Exception) -> JSONResponse:
        # The kernel's body reader's errors, as the node's own.
        if isinstance(exc, http_body.BodyTooLarge):
            return error_response(PayloadTooLargeError(str(exc)))
        if isinstance(exc, http_body.ClientGone):
            return error_response(ClientClosedError())
        return error_response(BadRequestError(str(exc)))

    async def on_client_gone(_: Request, exc: Exception) -> JSONResponse:
        # The client left mid-body: nobody reads this, and it is not the node's error.
        return error_response(ClientClosedError())

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError("The server had an internal error."))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(EngineOverloadedError, on_overloaded)
    app.add_exception_handler(EngineNotReadyError, on_not_ready)
    app.add_exception_handler(EngineRequestError, on_engine_request)
    app.add_exception_handler(ChatTemplateError, on_template)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(http_body.BodyError, on_body)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)
