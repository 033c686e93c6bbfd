"""Reading request bodies: size-capped, JSON-decoded and validated, with every failure
as an OpenAI 400/413 rather than FastAPI's 422."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from data_plane.server.errors import BadRequestError, PayloadTooLargeError, validation_error
from meridian.json_limits import MAX_JSON_DEPTH, too_deep

M = TypeVar("M", bound=BaseModel)
_TOO_DEEP = object()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing anything over `limit` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise BadRequestError("invalid Content-Length header") from None
        if too_big:
            raise PayloadTooLargeError(f"request body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    # Chunked uploads carry no length: count as the bytes arrive.
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(
    request: Request, model: type[M], *, limit: int, context: dict[str, Any] | None = None
) -> M:
    """Read, decode and validate a JSON body into `model`."""
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        data = _TOO_DEEP
    if data is _TOO_DEEP or too_deep(raw, data):
        raise BadRequestError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object")
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise validation_error(exc) from None
