"""Plain streamed Responses requests are served as chat completions, and their events written back.

Pure functions of the request's JSON and the chat stream's bytes: which Responses requests
take the migratable path (and why the others do not), the chat request that serves one, and
the Responses events a chat stream (a migrated one included) becomes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from geo_router.forwarding.migration.responses import as_chat_request, for_node, refusal
from geo_router.forwarding.migration.responses_stream import ResponsesEvents
from meridian.contracts import NodeCapability, NodeStatus, RoutingNode

PLAIN = {"model": "m", "input": "hi", "stream": True, "store": False}


def node(engine: str, capabilities: list[NodeCapability] | None = None) -> RoutingNode:
    return RoutingNode.model_validate({"node_id": "n", "region": "aws:us-east-1", "url": "http://n:1", "models": ["m"],
                                       "status": NodeStatus.READY, "engine": engine, "capabilities": capabilities})


def test_a_plain_request_becomes_the_chat_request_vllm_would_render() -> None:
    chat = as_chat_request({**PLAIN, "instructions": "be brief", "max_output_tokens": 9, "temperature": 0,
                            "seed": 3, "top_k": 1, "ignore_eos": True, "cache_salt": "s", "metadata": {"a": "b"}})
    assert chat is not None
    assert chat.payload == {"model": "m", "temperature": 0, "seed": 3, "top_k": 1, "ignore_eos": True,
                            "cache_salt": "s", "max_tokens": 9, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert json.loads(chat.body) == chat.payload
    assert chat.echo["metadata"] == {"a": "b"} and chat.echo["instructions"] == "be brief"


def test_a_vllm_node_tokenizes_the_prompt_as_its_responses_path_does() -> None:
    chat = as_chat_request(PLAIN)
    assert chat is not None
    assert json.loads(for_node(chat.body, node("vllm"))) == {**chat.payload, "add_special_tokens": True}
    assert for_node(chat.body, node("torch")) == chat.body  # no Responses path to match; it refuses the field
    # What the node registered it can do decides, not its engine's name.
    assert for_node(chat.body, node("vllm", [])) == chat.body
    assert json.loads(for_node(chat.body, node("torch", [NodeCapability.CHAT_SPECIAL_TOKENS])))["add_special_tokens"]


def test_message_items_keep_their_roles_and_text_parts() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"role": "user", "content": "d"},
    ]
    chat = as_chat_request({**PLAIN, "input": items, "instructions": ""})
    assert chat is not None
    assert chat.payload["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]


@pytest.mark.parametrize("change,why", [
    ({"stream": False}, "not streamed"),
    ({"store": True}, "stored"),
    ({"store": None}, "stored"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tools": [{"type": "web_search_preview"}], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "required"}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input items"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input items"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "a"},
                                                  {"type": "output_text", "text": "b"}]}]}, "input items"),
    ({"input": []}, "input items"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "status": "incomplete",
                                                  "content": [{"type": "output_text", "text": "b"}]}]}, "input items"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_requests_the_chat_route_cannot_serve_the_same_go_as_they_are(change: dict[str, Any], why: str) -> None:
    payload = {**PLAIN, **change}
    reason = refusal(payload)
    assert reason is not None and why in reason
    assert as_chat_request(payload) is None


def test_function_tools_the_model_may_not_call_are_rendered_as_chat_tools() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    chat = as_chat_request({**PLAIN, "tools": [tool], "tool_choice": "none"})
    assert chat is not None and chat.payload["tool_choice"] == "none"
    assert chat.payload["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                                       "parameters": {"type": "object"}}}]


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


def parse(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            out.append(event)
    return out


def test_a_chat_stream_becomes_vllms_sequence_of_responses_events() -> None:
    events = ResponsesEvents(as_chat_request({**PLAIN, "max_output_tokens": 3}).echo)  # type: ignore[union-attr]
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    raw = events.feed(sse(chunk("")) ) + events.feed(sse(chunk("He"), chunk("llo")))
    raw += events.feed(sse(chunk(" you", "length"), {**chunk(), "choices": [], "usage": usage,
                                                     "meridian": {"migrations": 1}}, b"[DONE]"))
    got = parse(raw)
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert {e["item_id"] for e in got if "item_id" in e} == {"msg_abc123"}
    done = got[-1]["response"]
    assert done["id"] == got[0]["response"]["id"] == "resp_abc123" and done["created_at"] == 7
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == "Hello you" == got[7]["text"]
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert got[-1]["meridian"] == {"migrations": 1} and events.ended


def test_an_error_event_ends_the_stream_as_the_responses_apis_error() -> None:
    events = ResponsesEvents({})
    raw = events.feed(sse(chunk("a"), {"error": {"message": "gone", "type": "server_error",
                                                 "code": "upstream_disconnected"}}, b"[DONE]"))
    got = parse(raw)
    assert got[-1] == {"type": "error", "code": "upstream_disconnected", "param": None, "message": "gone",
                       "sequence_number": 5}
    assert events.ended and events.feed(sse(chunk("b"))) == b""
