"""The router's replay of vLLM's pythonic tool parser gives what vLLM itself streams.

pythonic_cases.json holds vLLM's own streamed deltas for a few texts cut into chunks
(make_pythonic_cases.py records them with vLLM's venv; the router's has no vLLM). The
replay must give the same deltas for the same chunks, and, resumed at any chunk from what
a client was sent so far, the same assembled calls as the unbroken stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from geo_router.forwarding.migration.tool_calls import (
    PythonicStream,
    SentCall,
    ToolCallMismatch,
    parse_calls,
    record,
    starts_tool_calls,
)

CASES = json.loads((Path(__file__).parent.parent / "pythonic_cases.json").read_text())
TOOL_CASES = [c for c in CASES if starts_tool_calls(c["text"])]


def _texts(case: dict[str, Any]) -> list[str]:
    text, size = case["text"], case["chunk"]
    return [text[: at + size] for at in range(0, len(text), size)]


def _ids_hidden(message: dict[str, Any] | None) -> dict[str, Any] | None:
    for call in (message or {}).get("tool_calls") or ():
        if call.get("id"):
            call["id"] = "<id>"
    return message


def _assembled(messages: list[dict[str, Any] | None], calls: list[SentCall] | None = None) -> list[SentCall]:
    calls = [] if calls is None else calls
    for message in messages:
        record(calls, (message or {}).get("tool_calls"))
    return calls


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: f"{c['text'][:24]}/{c['chunk']}")
def test_the_replay_streams_what_vllm_streams(case: dict[str, Any]) -> None:
    replay = PythonicStream([])
    assert [_ids_hidden(replay.feed(t)) for t in _texts(case)] == case["deltas"]


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: f"{c['text'][:24]}/{c['chunk']}")
def test_resumed_at_any_chunk_the_client_assembles_the_unbroken_calls(case: dict[str, Any]) -> None:
    texts, deltas = _texts(case), case["deltas"]
    unbroken = _assembled(deltas)
    for at in range(len(texts)):
        sent = _assembled(deltas[:at])
        for n, call in enumerate(sent):
            call.id = f"sent-{n}"
        replay = PythonicStream(sent)
        # The continuation's first event may carry several tokens: jump one chunk ahead.
        rest = [replay.feed(t) for t in texts[at + 1:] or texts[at:]]
        got = _assembled(rest, sent)
        assert [(c.name, c.arguments, c.type) for c in got] == [(c.name, c.arguments, c.type) for c in unbroken]
        kept = sum(1 for m in deltas[:at] for c in (m or {}).get("tool_calls") or () if c.get("id"))
        assert [c.id for c in got[:kept]] == [f"sent-{n}" for n in range(kept)]
        assert all(c.id and c.id.startswith("chatcmpl-tool-") and len(c.id) == 30 for c in got[kept:])


def test_the_whole_list_parses_like_vllm() -> None:
    assert parse_calls("[get_weather(city='Paris', unit=\"celsius\"), get_time(zone='CET')]") == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]
    assert parse_calls("[a.b(x=-1, y=(1, 2), z=null, w=f'v', s='caf\u00e9')]") == [
        ("a.b", '{"x": -1, "y": [1, 2], "z": null, "w": "v", "s": "caf\u00e9"}')]
    for bad in ("[1, 2]", "[f(x=g())]", "f(x=1)", "[f(x=b'1')]"):
        with pytest.raises(ValueError):
            parse_calls(bad)


def test_text_that_contradicts_what_was_sent_is_refused() -> None:
    text = "[get_weather(city='Paris', unit='celsius')]"
    with pytest.raises(ToolCallMismatch):
        PythonicStream([SentCall("x", "function", "get_time", '{"city": "P')]).feed(text)
    with pytest.raises(ToolCallMismatch):
        PythonicStream([SentCall("x", "function", "get_weather", '{"city": "L')]).feed(text)
    with pytest.raises(ToolCallMismatch):
        PythonicStream([SentCall("x", "function", "get_weather", "{}"), SentCall("y", "function", "f", "{}")]).feed(text)
    assert PythonicStream([SentCall("x", "function", "get_weather", '{"city": "Pa')]).feed(text) == {
        "tool_calls": [{"id": None, "index": 0, "function": {"arguments": 'ris", "unit": "celsius"}'}}]}
