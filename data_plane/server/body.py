"""Reading request bodies: size-capped (meridian.http_body), JSON-decoded and validated,
with every failure as an OpenAI 400/413 rather than FastAPI's 422."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from data_plane.server.errors import BadRequestError, validation_error
from meridian import http_body
from meridian.json_limits import MAX_JSON_DEPTH, too_deep

M = TypeVar("M", bound=BaseModel)
_TOO_DEEP = object()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, read by the kernel's one reader (meridian.http_body): over `limit`
    bytes is a 413 without reading it all, a malformed or lying Content-Length a 400 (the
    node's error handlers map its errors)."""
    return await http_body.read_body(request.receive, request.headers.get("content-length"), limit)


# OpenAI parameters this server does not implement, and the values that ask for nothing
# (clients such as LangChain send them at their defaults): any other value is refused.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": ({}, None),
    "tools": ([], None),
    "tool_choice": ("none", "auto", None),
    "parallel_tool_calls": (True, False, None),
    "functions": ([], None),
    "function_call": ("none", "auto", None),
    "response_format": ({"type": "text"}, None),
    "store": (False, None),
    "metadata": ({}, None),
    "service_tier": ("auto", "default", None),
    "modalities": (["text"], None),
    "reasoning_effort": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "min_tokens": (0, None),
    "best_of": (1, None),
    "suffix": (None,),
}


def check_parameters(data: dict[str, Any], model: type[BaseModel]) -> None:
    """Refuse (400 unsupported_parameter, naming it) every field `model` would drop: a
    request must never be served as if a parameter it set had been honoured."""
    known = model.model_fields
    for name, value in data.items():
        if name in known:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is not None and any(value == n and type(value) is type(n) or value is n for n in neutral):
            continue
        raise BadRequestError(
            f"`{name}` is not supported by this model's engine (Meridian's torch engine); "
            "vLLM deployments serve it",
            param=name, code="unsupported_parameter",
        )


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object; a 400 when it is not JSON, nested too deep or not an object."""
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
    return data


async def parse_body(
    request: Request, model: type[M], *, limit: int, context: dict[str, Any] | None = None,
    strict: bool = False,
) -> M:
    """Read, decode and validate a JSON body into `model`; with `strict`, a field the
    model does not implement is a 400 (check_parameters) rather than ignored."""
    data = decode_json_object(await read_body(request, limit))
    if strict:
        check_parameters(data, model)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise validation_error(exc) from None
