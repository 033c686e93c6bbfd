"""The requests of the two hops, made from the client's (pure).

The prefill request is the client's with its generation cut to one token, not streamed,
not stored, and `kv_transfer_params` asking for a remote decode; what only shapes the
answer (logprobs, stream options, echo) is dropped, since that answer is discarded. The
decode request is the client's bytes as they are, with the prefill worker's hand-off
added as one more field.

A client may not send `kv_transfer_params` itself: they name a host and port that a decode
worker would connect to and blocks it would read, which is the router's to say (a client
could otherwise point a node at any address, or at another tenant's blocks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from meridian.contracts import Route
from meridian.kv_transfer import prefill_request_params

from ...errors import BadRequest
from ...ingress.request import with_field

CHAT = Route.CHAT
COMPLETIONS = Route.COMPLETIONS
RESPONSES = Route.RESPONSES
PARAMS_FIELD = "kv_transfer_params"

# Fields of the client's request that only shape the discarded one-token answer.
_DROPPED = ("stream_options", "logprobs", "top_logprobs", "echo", "min_tokens", "suffix",
            "prompt_logprobs", "return_token_ids", "background", "previous_response_id")
_ENCODER = msgspec.json.Encoder()


def refuse_client_params(payload: Mapping[str, Any]) -> None:
    """BadRequest when the client sent `kv_transfer_params` (see the module doc)."""
    if PARAMS_FIELD in payload:
        raise BadRequest("`kv_transfer_params` is set by the router for disaggregated serving, "
                         "not by clients.", param=PARAMS_FIELD)


def prefill_body(route: str, payload: Mapping[str, Any]) -> bytes | None:
    """The prefill request for a request to `route`, or None when the request cannot be
    disaggregated (another route, several choices, a stored response to continue)."""
    if route not in (CHAT, COMPLETIONS, RESPONSES):
        return None
    if _int(payload.get("n"), 1) != 1 or _int(payload.get("best_of"), 1) != 1:
        return None  # one hand-off holds one sequence's blocks
    if route == RESPONSES and payload.get("previous_response_id") is not None:
        return None  # the conversation lives on the node that stored it
    body = {k: v for k, v in payload.items() if k not in _DROPPED}
    body["stream"] = False
    if route == RESPONSES:
        body["max_output_tokens"] = 1
        body["store"] = False
    else:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
    body[PARAMS_FIELD] = prefill_request_params()
    return _ENCODER.encode(body)


def decode_body(body: bytes, params: Mapping[str, Any]) -> bytes:
    """The request as the client sent it (after the router's own fields), with the hand-off."""
    return with_field(body, PARAMS_FIELD, _ENCODER.encode(params))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
