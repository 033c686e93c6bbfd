"""Which streamed requests can migrate, and what is sent to a node so that they can.

A stream can resume on another replica when the router can rebuild the rest of the
generation from token ids alone: one choice (`n` = 1), no structured output, no logprobs,
no echo, on chat completions or completions. For those the router asks the node for
`return_token_ids` (vLLM >= 0.10.2, and the torch engine), keeps the ids as they stream
past, and strips them again unless the client asked for them itself.

Chat streams with tools migrate when the model chooses freely (`tool_choice` "auto", or
absent): the calls are plain text the node's parser reads, and the router replays that
parser on the continuation's text (geo_router.forwarding.migration.tool_calls: vLLM's `pythonic`
format only). Which parser a node runs is known from its registration: such a stream is
planned whatever its node, and moves only between nodes that advertise `pythonic`
(geo_router.forwarding.migration.decide). A named or "required" `tool_choice` and any structured
output (JSON schema, regex, grammar, `response_format`) are refused: the node constrains
every token with a grammar whose state lives in the engine, and a /v1/completions
continuation cannot resume it, so its tokens would no longer be the constrained ones.

Everything else streams exactly as before: a break after the first byte ends it with an
error event. The refusals are deliberate, not gaps in parsing: a grammar's state and a
sampled token's logprobs cannot be rebuilt on another node from ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from meridian.contracts import NodeCapability, Route, RoutingNode

from ...ingress.request import with_field

CHAT_ROUTE = Route.CHAT
COMPLETIONS_ROUTE = Route.COMPLETIONS

# Sampling and stopping fields a continuation keeps as the client sent them (vLLM's names).
# max_tokens and min_tokens are carried over reduced by what was generated; frequency and
# presence penalties count only the continuation's own output, so with them a migrated
# stream is valid but not identical to an unbroken one. vllm_xargs: the per-request
# arguments of a node's custom logits processors, which act on the continuation too.
_CARRIED = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "cache_salt", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
    "allowed_token_ids", "bad_words", "user", "priority", "vllm_xargs",
)
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "functions", "function_call", "prompt_logprobs", "suffix")
_ENCODE = msgspec.json.Encoder()


class Api(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """How one migratable stream is forwarded, and how a continuation of it is asked for."""

    api: Api
    model: str
    upstream_body: bytes  # the client's body with return_token_ids on
    client_wants_token_ids: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    min_tokens: int
    stops: tuple[str, ...]
    include_stop_str: bool
    carried: dict[str, Any]
    # Tool calls may stream (chat with tools, tool_choice "auto"): a continuation's text is
    # replayed through the pythonic parser; only call 0 is sent when parallel calls are off.
    tools: bool = False
    parallel_tool_calls: bool = True

    def continuation_body(self, prompt_ids: list[int], generated: int, node: RoutingNode) -> bytes:
        """The /v1/completions request that generates the rest, from the token ids so far,
        for `node` (as the routing table describes it)."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt_ids, **self.carried,
                                "stream": True, "return_token_ids": True}
        if self.max_tokens is not None:
            body["max_tokens"] = max(1, self.max_tokens - generated)
        if self.min_tokens > generated:
            body["min_tokens"] = self.min_tokens - generated
        if self.stops and node.can(NodeCapability.STOP_STRING_IN_OUTPUT):
            # The router matches the stop strings in a continuation's text itself (one may
            # start before the seam, where the node cannot see it). vLLM holds back the last
            # len(longest stop) - 1 characters of a stream that excludes its stop strings,
            # so the router would read one token past such a stop before seeing it; asked to
            # include them, it holds nothing back, and the router cuts the text as the
            # client asked (events.Continuation). A node without the capability (the torch
            # engine) holds back only a real stop string's start, and refuses the field.
            body["include_stop_str_in_output"] = True
        return _ENCODE.encode(body)


def plan_for(route: str, payload: dict[str, Any], body: bytes) -> MigrationPlan | None:
    """The plan for a request whose stream can migrate; None when it cannot."""
    api = {CHAT_ROUTE: Api.CHAT, COMPLETIONS_ROUTE: Api.COMPLETIONS}.get(route)
    if api is None or payload.get("stream") is not True or not _plain_text(api, payload):
        return None
    max_tokens = payload.get("max_tokens")
    if max_tokens is None and api is Api.CHAT:
        max_tokens = payload.get("max_completion_tokens")
    min_tokens = payload.get("min_tokens") or 0
    stop = payload.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str) and s)
    options = payload.get("stream_options")
    options = options if isinstance(options, dict) else {}
    if not _ints_or_none(max_tokens, min_tokens) or (stop is not None and not isinstance(stop, str | list)):
        return None  # the node answers the bad field with a 400; nothing to migrate
    wants_ids = payload.get("return_token_ids") is True
    return MigrationPlan(
        api=api,
        model=str(payload["model"]),
        upstream_body=body if wants_ids else _with_token_ids(body, payload),
        client_wants_token_ids=wants_ids,
        include_usage=options.get("include_usage") is True,
        continuous_usage=options.get("continuous_usage_stats") is True,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stops=stops,
        include_stop_str=payload.get("include_stop_str_in_output") is True,
        carried={k: payload[k] for k in _CARRIED if k in payload},
        tools=api is Api.CHAT and bool(payload.get("tools")) and payload.get("tool_choice") != "none",
        parallel_tool_calls=payload.get("parallel_tool_calls") is not False,
    )


def _plain_text(api: Api, payload: dict[str, Any]) -> bool:
    if payload.get("n", 1) not in (1, None) or payload.get("best_of", 1) not in (1, None):
        return False
    if any(payload.get(k) is not None for k in _STRUCTURED):
        return False
    if payload.get("tools") and payload.get("tool_choice") not in (None, "auto", "none"):
        return False  # named or "required": a grammar the continuation cannot resume
    response_format = payload.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        return False
    if api is Api.CHAT:
        return not payload.get("logprobs")
    prompt = payload.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and (
        all(isinstance(t, int) for t in prompt) or len(prompt) == 1))
    return single and payload.get("logprobs") is None and not payload.get("echo")


def _ints_or_none(*values: Any) -> bool:
    return all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values)


def _with_token_ids(body: bytes, payload: dict[str, Any]) -> bytes:
    if "return_token_ids" in payload:  # the client said false (or nonsense): ours wins
        return _ENCODE.encode({**payload, "return_token_ids": True})
    return with_field(body, "return_token_ids", b"true")
