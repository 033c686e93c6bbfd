"""Which streamed Responses API requests can migrate, and the chat request served in their place.

vLLM's streamed /v1/responses carries no token ids until its final event, and the torch
engine serves no /v1/responses at all, so a Responses stream cannot be resumed from what
its node sends. A *plain* one is therefore served as a streamed chat completion (which
both engines stream with `return_token_ids`): the chat migration machinery resumes it like
any chat stream, and geo_router.forwarding.migration.responses_stream writes the Responses API's
events from the chat chunks. The chat request is built the way vLLM's own Responses path
builds its prompt (vllm/entrypoints/openai/responses/utils.py, construct_input_messages):
`instructions` first as a system message, a string input as one user message, message
items as chat messages with their text parts (`input_text`/`output_text` parse to the
same text parts as chat's `text`), an assistant item as its first part's text; the
developer role is left as it is, since both routes map it the same way. vLLM's Responses
path tokenizes the rendered prompt with `add_special_tokens` on (chat's default is off: a
template that writes its BOS gets a second one there), so the chat request sent to a vLLM
node asks for that too (`for_node`; the torch engine has no Responses path to match and
refuses the field). So the prompt's token ids are the ones vLLM's Responses path would
have used (vLLM 0.32; harmony models, gpt-oss, are the exception: their prompt is harmony's).

Only what the chat route serves the same way takes this path: `stream` true, `store`
false (explicitly: a stored response lives in the memory of the one vLLM process that
made it, where `previous_response_id` and GET /v1/responses/{id} must find it, so a
stored response must stay vLLM's own), no `previous_response_id`, no `background`, no
tools (or function tools with tool_choice "none"), plain text out, no `include`, no
reasoning, no logprobs, no truncation, and input that is a string or plain messages.
Anything else, including a field this module does not know, goes to the node as the
client sent it, and a break ends it with an error event as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from meridian.contracts import NodeCapability, Route, RoutingNode

from ...ingress.request import with_field

RESPONSES_ROUTE = Route.RESPONSES

_ROLES = frozenset({"user", "system", "developer", "assistant"})
# Fields both routes take under the same name and meaning (vLLM's extras included).
_SAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
         "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "frequency_penalty",
         "presence_penalty", "repetition_penalty", "logit_bias", "user", "priority")
# Fields that change nothing about the generation: only echoed on the response object.
_ECHOED = ("metadata", "parallel_tool_calls", "service_tier", "max_tool_calls", "prompt_cache_key")
# Fields checked below (a value that changes the generation refuses the path).
_CHECKED = ("input", "instructions", "max_output_tokens", "stream", "store", "previous_response_id",
            "background", "tools", "tool_choice", "text", "include", "reasoning", "top_logprobs", "truncation")
_KNOWN = frozenset(_SAME + _ECHOED + _CHECKED)
_ENCODE = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class AsChat:
    """A Responses request served as a chat completion: the chat request, and what of the
    Responses request its response object echoes."""

    payload: dict[str, Any]
    body: bytes
    echo: dict[str, Any]


def refusal(payload: dict[str, Any]) -> str | None:
    """Why this Responses request must go to the node as it is; None when it can be served
    as a chat completion (and so migrate)."""
    if payload.get("stream") is not True:
        return "not streamed"
    if payload.get("store") is not False:
        return "stored (store is not false): the response must live on the node that made it"
    unknown = sorted(k for k in payload if k not in _KNOWN)
    if unknown:
        return f"fields this path does not translate: {', '.join(unknown)}"
    for name, ok in _CHECKS:
        if not ok(payload.get(name)):
            return f"`{name}` is not plain text generation"
    if not _plain_tools(payload.get("tools"), payload.get("tool_choice")):
        return "tools the model may call"
    if _messages(payload.get("input")) is None:
        return "input items other than plain text messages"
    return None


def as_chat_request(payload: dict[str, Any]) -> AsChat | None:
    """The chat request that serves `payload`, a Responses request; None when it must go as it is."""
    if refusal(payload) is not None:
        return None
    messages = _messages(payload["input"])
    assert messages is not None
    instructions = payload.get("instructions")
    if instructions:  # vLLM adds it only when non-empty
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: payload[k] for k in _SAME if k in payload}
    chat["messages"] = messages
    if payload.get("max_output_tokens") is not None:
        chat["max_tokens"] = payload["max_output_tokens"]
    if payload.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in payload["tools"]]
        chat["tool_choice"] = "none"
    chat["stream"] = True
    chat["stream_options"] = {"include_usage": True}  # the response object's usage needs it
    return AsChat(chat, _ENCODE.encode(chat), _echo(payload))


def for_node(body: bytes, node: RoutingNode) -> bytes:
    """The chat body (as_chat_request's, with any field the router appends) for `node`: one
    that can is asked to tokenize the prompt as its own Responses path would (vLLM)."""
    return with_field(body, "add_special_tokens", b"true") if node.can(NodeCapability.CHAT_SPECIAL_TOKENS) else body


def _echo(payload: dict[str, Any]) -> dict[str, Any]:
    """The request's fields on the response object, with the defaults vLLM shows for them
    (tool_choice "none" without tools: vLLM's check_tool_usage)."""
    echo = {k: payload.get(k) for k in ("instructions", "max_output_tokens", "user", "metadata", "max_tool_calls")}
    tools = payload.get("tools") or []
    echo.update(
        temperature=_float(payload.get("temperature"), 1.0), top_p=_float(payload.get("top_p"), 1.0),
        presence_penalty=_float(payload.get("presence_penalty"), 0.0),
        frequency_penalty=_float(payload.get("frequency_penalty"), 0.0),
        parallel_tool_calls=payload.get("parallel_tool_calls", True), service_tier=payload.get("service_tier") or "auto",
        tools=tools, tool_choice=payload.get("tool_choice") or "auto" if tools else "none", text=payload.get("text"),
        truncation=payload.get("truncation") or "disabled", top_logprobs=None)
    return echo


def _float(value: Any, default: float) -> Any:
    return default if value is None else float(value) if isinstance(value, int | float) else value


def _none_or_false(value: Any) -> bool:
    return value is None or value is False


def _int_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


_CHECKS = (
    ("previous_response_id", lambda v: v is None),
    ("background", _none_or_false),
    ("include", lambda v: v is None or v == []),
    ("reasoning", lambda v: v is None),
    ("top_logprobs", lambda v: v in (None, 0)),
    ("truncation", lambda v: v in (None, "disabled")),
    ("text", lambda v: v is None or v == {"format": {"type": "text"}}),
    ("instructions", lambda v: v is None or isinstance(v, str)),
    ("max_output_tokens", _int_or_none),
)


def _plain_tools(tools: Any, choice: Any) -> bool:
    if not tools:
        return choice in (None, "auto", "none")
    # Function tools the model may not call are only rendered into the prompt: the chat
    # route renders them the same (vLLM converts a Responses tool to a chat tool to render it).
    return choice == "none" and isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools)


def _messages(value: Any) -> list[dict[str, Any]] | None:
    """The chat messages for a Responses `input`; None when it holds anything but plain messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        return None
    messages = []
    for item in value:
        message = _message(item)
        if message is None:
            return None
        messages.append(message)
    return messages


def _message(item: Any) -> dict[str, Any] | None:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in _ROLES:
        return None
    role, content = item["role"], item.get("content")
    assistant = role == "assistant"
    if set(item) - ({"type", "role", "content", "id", "status"} if assistant else {"type", "role", "content"}):
        return None
    if item.get("status") not in (None, "completed"):
        return None  # a partial assistant message: vLLM continues it, chat would not
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content or not all(_text_part(p, assistant) for p in content):
        return None
    if assistant:
        # vLLM keeps an assistant item's first part only; more than one would not match.
        return {"role": role, "content": content[0]["text"]} if len(content) == 1 else None
    return {"role": role, "content": [{"type": "text", "text": p["text"]} for p in content]}


def _text_part(part: Any, assistant: bool) -> bool:
    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
        return False
    if assistant:
        return part.get("type") == "output_text" and not set(part) - {"type", "text", "annotations", "logprobs"}
    return part.get("type") == "input_text" and not set(part) - {"type", "text"}
