"""What each answered request cost its tenant: the rate limiter's settlement and the
per-tenant request and token counters, from one read of the answer's usage.

A whole answer's usage is read once (`answer_usage`, which the access line shares); a stream is accounted when it ends
(its usage chunk if the client asked for one, else the prompt estimate plus one token per
streamed event, as nodes stream a token at a time). The model label is the request's model
only when the routing table serves or deploys it ("" otherwise), so that a client's
made-up model names cannot grow the metric's series without bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from fastapi.responses import Response

from meridian.contracts import TenantEntry

from ..admission.ratelimit import Admission
from ..admission.tokens import estimate_prompt_tokens, usage_split
from ..forwarding.streaming import UpstreamStreamingResponse, when_stream_ends
from ..sse import StreamTally
from ..state.table import LoadedTable
from .metrics import RouterMetrics

# settle(tenant, charged, used): the rate limiter's correction of an up-front charge.
Settle = Callable[[TenantEntry, int, int], None]
_DECODER = json.JSONDecoder()


def model_label(loaded: LoadedTable | None, model: str | None) -> str:
    """`model` when the table knows it, else ""."""
    return model if loaded is not None and model is not None and model in loaded.models else ""


def count_request(metrics: RouterMetrics, tenant: TenantEntry, model: str, status: int) -> None:
    metrics.child("tenant_requests", tenant.tenant, model, tenant.zone, str(status)).inc()


def answer_usage(response: Response) -> dict[str, Any] | None:
    """The `usage` object of a whole, successful answer, read once for the accounting and
    the access line; None for a stream, an error or an answer without one."""
    if isinstance(response, UpstreamStreamingResponse) or response.status_code >= 300 \
            or not isinstance(response.body, bytes | bytearray):
        return None
    return body_usage(bytes(response.body))


def body_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a whole JSON answer, decoded alone (not the whole body, which
    may be long): it is near the end of every API's answer."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    colon = body.find(b":", at + 7)
    if colon < 0:
        return None
    text = body[colon + 1:].decode("utf-8", errors="replace").lstrip()
    try:
        usage, _ = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def stream_tokens(tally: StreamTally, payload: Mapping[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens of a stream that ended: its usage chunk's, else the prompt
    estimate and one token per streamed event (nodes stream a token at a time)."""
    split = usage_split({"usage": tally.usage}) if tally.usage is not None else None
    return split or (estimate_prompt_tokens(payload), tally.events)


def account(
    metrics: RouterMetrics,
    settle: Settle,
    admission: Admission,
    model: str,
    payload: Mapping[str, Any],
    response: Response,
    usage: Mapping[str, Any] | None,
) -> None:
    """Count the request and, once its usage is known, its tokens (`usage`: a whole answer's,
    from answer_usage); settle the rate limiter's token charge when the tenant has a token limit."""
    tenant = admission.tenant
    count_request(metrics, tenant, model, response.status_code)
    limited = tenant.tokens_per_minute is not None

    def settled(prompt: int, completion: int) -> None:
        if prompt:
            metrics.child("tenant_tokens", tenant.tenant, model, tenant.zone, "prompt").inc(prompt)
        if completion:
            metrics.child("tenant_tokens", tenant.tenant, model, tenant.zone, "completion").inc(completion)
        if limited:
            settle(tenant, admission.tokens, prompt + completion)

    def stream_ended(tally: StreamTally) -> None:
        settled(*stream_tokens(tally, payload))

    if when_stream_ends(response, stream_ended) or not isinstance(response.body, bytes | bytearray):
        return
    if response.status_code >= 300:
        if limited:
            settle(tenant, admission.tokens, 0)
        return
    split = usage_split({"usage": usage}) if usage is not None else None
    if split is not None:
        settled(*split)
