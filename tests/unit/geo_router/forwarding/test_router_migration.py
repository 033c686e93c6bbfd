"""Streams that survive their node: the router resumes them on another replica, exactly.

A real router under uvicorn in front of stand-in nodes whose "model" is a deterministic
function of the token ids (token_node.py), so a continuation from prompt + generated ids
must reproduce an unbroken run token for token: anything duplicated or dropped at the seam
shows. Faults: the connection dropped (a SIGKILL), a frozen stream (SIGSTOP: the inter-token
timeout), an error event (an engine fault).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    REGIONS,
    SCRAPE,
    ServerGroup,
    make_table,
    metric,
    router_settings,
)
from token_node import Fault, TokenNode, chat_prompt, decode, encode, next_token, token_node_app

from geo_router import create_app
from geo_router.state.table import StaticTableSource
from meridian.contracts import NodeStatus, RoutingNode
from meridian.stop_strings import StopStringMatcher

MESSAGES = [{"role": "user", "content": "tell me a long story"}]


@dataclass
class MigrationFabric:
    router_url: str
    nodes: dict[str, TokenNode]
    journal: Any

    def client(self, key: str = GLOBAL_KEY) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.router_url, headers={"authorization": f"Bearer {key}"}, timeout=20)


async def _fabric(tmp_path: Any, layout: dict[str, str], parsers: dict[str, str | None] | None = None,
                  **settings: Any) -> AsyncIterator[MigrationFabric]:
    """Token nodes by name and region; each advertises the tool-call parser `parsers` names
    (by default "pythonic": the stand-in reads tool calls as vLLM's pythonic parser does)."""
    servers = ServerGroup()
    nodes = {name: TokenNode(name) for name in layout}
    parsers = parsers or {}
    try:
        routing = [RoutingNode(node_id=name, region=REGIONS[region].name, url=await servers.start(token_node_app(n)),
                               models=[MODEL], status=NodeStatus.READY, tool_call_parser=parsers.get(name, "pythonic"))
               for (name, region), n in zip(layout.items(), nodes.values(), strict=True)]
        journal = tmp_path / "router.jsonl"
        values = {"inter_token_timeout_s": 0.5, "request_journal_path": journal, "probe_enabled": False, **settings}
        app = create_app(router_settings(**values), table_source=StaticTableSource(make_table(routing)))
        yield MigrationFabric(await servers.start(app), nodes, journal)
    finally:
        for n in nodes.values():
            n.release.set()
        await servers.stop()


@pytest.fixture
async def fabric(tmp_path: Any) -> AsyncIterator[MigrationFabric]:
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu", "apac-1": "apac"}):
        yield f


@dataclass
class Received:
    events: list[dict[str, Any]]
    text: str
    done: bool
    error: dict[str, Any] | None

    @property
    def ids(self) -> set[str]:
        return {e["id"] for e in self.events if "id" in e}

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e.get("choices", []) for t in c.get("token_ids") or []]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]
        assert len(reasons) <= 1, reasons
        return reasons[0] if reasons else None

    @property
    def trailer(self) -> dict[str, Any] | None:
        return self.events[-1].get("meridian") if self.events else None


async def stream(f: MigrationFabric, route: str = "/v1/chat/completions", key: str = GLOBAL_KEY,
                 **body: Any) -> Received:
    payload: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 40, **body}
    if route.endswith("chat/completions"):
        payload.setdefault("messages", MESSAGES)
    else:
        payload.setdefault("prompt", "once upon a time")
    events: list[dict[str, Any]] = []
    done, error, text = False, None, ""
    async with f.client(key) as client, client.stream("POST", route, json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert not done, "an event after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            events.append(event)
            for c in event.get("choices", []):
                text += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return Received(events, text, done, error)


def reference(prompt: list[int], max_tokens: int, stops: list[str] = ()) -> tuple[str, list[int]]:
    """What an unbroken greedy run yields: the text a client sees, and every generated id."""
    ids: list[int] = []
    matcher = StopStringMatcher(list(stops))
    text = ""
    for _ in range(max_tokens):
        ids.append(next_token(prompt + ids, None))
        emit, stopped = matcher.feed(decode(ids[-1:]))
        text += emit
        if stopped:
            return text, ids
    return text + matcher.flush(), ids


async def test_unbroken_stream_is_unchanged_and_carries_no_token_ids(fabric: MigrationFabric) -> None:
    got = await stream(fabric)
    assert got.done and got.error is None and got.trailer is None
    assert got.text == reference(chat_prompt(MESSAGES), 40)[0]
    assert got.token_ids == [] and all("prompt_token_ids" not in e for e in got.events)
    # The node was asked for ids; the client did not see them.
    assert fabric.nodes["us-1"].requests[0]["return_token_ids"] is True


@pytest.mark.parametrize("after", [0, 1, 17, 39])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_killed_mid_generation_is_token_identical_to_an_unbroken_one(
        fabric: MigrationFabric, route: str, after: int) -> None:
    unbroken = await stream(fabric, route, return_token_ids=True)
    fabric.nodes["us-1"].faults.append(Fault("die", after))
    got = await stream(fabric, route, return_token_ids=True)
    assert got.error is None and got.done
    assert got.text == unbroken.text and got.token_ids == unbroken.token_ids and len(got.token_ids) == 40
    assert len(got.ids) == 1 and got.finish_reason == "length"
    if after == 0 and "chat" not in route:
        # A completions stream's first event is its first token: nothing had been sent yet,
        # so this is a failover before the first byte, not a migration.
        assert got.trailer is None and fabric.nodes["eu-1"].requests[-1]["path"] == route
        return
    assert got.trailer == {"migrations": 1, "node": "eu-1", "region": REGIONS["eu"].name}
    resumed = fabric.nodes["eu-1"].requests[-1]
    assert resumed["path"] == "/v1/completions" and resumed["max_tokens"] == 40 - after
    prompt = chat_prompt(MESSAGES) if "chat" in route else encode("once upon a time")
    assert resumed["prompt"] == prompt + unbroken.token_ids[:after]


async def test_usage_counts_every_token_the_client_received(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].faults.append(Fault("die", 11))
    got = await stream(fabric, stream_options={"include_usage": True}, max_tokens=30)
    usage = got.events[-1]["usage"]
    assert got.events[-1]["choices"] == [] and got.trailer is not None
    prompt = len(chat_prompt(MESSAGES))
    assert usage == {"prompt_tokens": prompt, "completion_tokens": 30, "total_tokens": prompt + 30}
    assert got.text == reference(chat_prompt(MESSAGES), 30)[0]


@pytest.mark.parametrize("after", [20, 21, 22, 23])
async def test_a_stop_string_split_across_the_seam_still_stops(fabric: MigrationFabric, after: int) -> None:
    text, _ = reference(chat_prompt(MESSAGES), 40)
    stop = text[20:24]  # four one-character tokens: the stream breaks inside them
    assert text.find(stop) == 20
    expected, ids = reference(chat_prompt(MESSAGES), 40, [stop])
    assert expected == text[:20] and len(ids) == 24
    fabric.nodes["us-1"].faults.append(Fault("die", after))
    got = await stream(fabric, stop=[stop], stream_options={"include_usage": True})
    assert (got.text, got.finish_reason, got.error) == (expected, "stop", None)
    assert got.trailer is not None and got.trailer["migrations"] == 1
    assert got.events[-1]["usage"]["completion_tokens"] == 24


async def test_a_frozen_node_is_left_after_the_inter_token_timeout(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].faults.append(Fault("stall", 9))
    got = await stream(fabric)
    assert got.error is None and got.text == reference(chat_prompt(MESSAGES), 40)[0]
    async with fabric.client() as c:
        scraped = (await c.get("/metrics", headers=SCRAPE)).text
    assert metric(scraped, "meridian_router_migrations_total", reason="stalled",
                  from_region=REGIONS["us"].name, to_region=REGIONS["eu"].name) == 1
    assert metric(scraped, "meridian_router_migration_reprefill_tokens_total") == len(chat_prompt(MESSAGES)) + 9
    assert metric(scraped, "meridian_router_migration_resume_seconds_count") == 1


async def test_an_error_event_mid_stream_is_resumed_elsewhere(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].faults.append(Fault("error", 5))
    got = await stream(fabric, route="/v1/completions")
    assert got.error is None and got.text == reference(encode("once upon a time"), 40)[0]


async def test_a_zoned_stream_never_resumes_outside_its_zone(fabric: MigrationFabric) -> None:
    fabric.nodes["eu-1"].faults.append(Fault("die", 7))
    got = await stream(fabric, key=EU_KEY)
    assert got.error is not None and got.error["code"] == "upstream_disconnected"
    assert "residency zone" in got.error["message"]
    assert fabric.nodes["us-1"].requests == [] and fabric.nodes["apac-1"].requests == []
    assert got.text == reference(chat_prompt(MESSAGES), 40)[0][:7]  # what came before the break, once


async def test_the_same_region_is_tried_first_and_a_stream_may_move_more_than_once(tmp_path: Any) -> None:
    async for f in _fabric(tmp_path, {"us-1": "us", "us-2": "us", "eu-1": "eu"}):
        f.nodes["us-1"].faults.append(Fault("die", 5))
        f.nodes["us-2"].faults.append(Fault("die", 5))
        got = await stream(f, return_token_ids=True)
        first = "us-1" if f.nodes["us-1"].requests[0]["path"].endswith("chat/completions") else "us-2"
        assert got.error is None and got.text == reference(chat_prompt(MESSAGES), 40)[0]
        assert got.trailer == {"migrations": 2, "node": "eu-1", "region": REGIONS["eu"].name}
        second = f.nodes["us-2" if first == "us-1" else "us-1"].requests[0]
        assert second["path"] == "/v1/completions" and len(second["prompt"]) == len(chat_prompt(MESSAGES)) + 5
        routed = [json.loads(line) for line in f.journal.read_text().splitlines()]
        pieces = [(r["node"], r.get("migration", 0), r.get("resume_tokens", 0)) for r in routed]
        assert pieces == [(first, 0, 0), (second_node(first), 1, 5), ("eu-1", 2, 10)]


def second_node(first: str) -> str:
    return "us-2" if first == "us-1" else "us-1"


async def test_the_per_request_limit_ends_the_stream_with_an_error_event(tmp_path: Any) -> None:
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu", "apac-1": "apac"}, migration_max_per_request=1):
        f.nodes["us-1"].faults.append(Fault("die", 3))
        f.nodes["eu-1"].faults.append(Fault("die", 3))
        got = await stream(f)
        assert got.error is not None and "as many times" in got.error["message"]
        assert got.text == reference(chat_prompt(MESSAGES), 40)[0][:6]
        assert f.nodes["apac-1"].requests == []


async def test_an_empty_token_budget_refuses_migrations(tmp_path: Any) -> None:
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu"}, migration_budget_burst_tokens=10):
        f.nodes["us-1"].faults.append(Fault("die", 3))
        got = await stream(f)
        assert got.error is not None and "too many answers" in got.error["message"]
        async with f.client() as c:
            scraped = (await c.get("/metrics", headers=SCRAPE)).text
        assert metric(scraped, "meridian_router_migrations_refused_total", why="budget") == 1


async def test_a_seeded_sampled_stream_keeps_its_shape_and_token_count(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].faults.append(Fault("die", 12))
    got = await stream(fabric, temperature=1.0, seed=7, max_tokens=33, return_token_ids=True,
                       stream_options={"include_usage": True})
    assert got.error is None and got.done and len(got.ids) == 1
    assert len(got.token_ids) == 33 and got.events[-1]["usage"]["completion_tokens"] == 33
    assert got.text == decode(got.token_ids) and got.finish_reason == "length"
    assert fabric.nodes["eu-1"].requests[-1]["seed"] == 7


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
SCRIPT = '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]'
CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]


def tool_calls(got: Received) -> list[tuple[str, str, str]]:
    """The calls as a client assembles them: (id, name, arguments); each index starts once."""
    calls: dict[int, list[str]] = {}
    for e in got.events:
        for c in e.get("choices", []):
            for d in (c.get("delta") or {}).get("tool_calls") or []:
                if d.get("id"):
                    assert d["index"] not in calls, "a call started twice"
                    calls[d["index"]] = [d["id"], d["function"]["name"], ""]
                calls[d["index"]][2] += d["function"].get("arguments") or ""
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


async def test_an_unbroken_tool_call_stream_streams_its_arguments(fabric: MigrationFabric) -> None:
    got = await stream(fabric, tools=TOOLS, vllm_xargs={"script": SCRIPT}, max_tokens=100)
    assert [(n, a) for _, n, a in tool_calls(got)] == CALLS and got.finish_reason == "tool_calls"
    assert got.text == "" and got.trailer is None


@pytest.mark.parametrize("after", [0, 1, 5, 21, 44, len(SCRIPT) - 1, len(SCRIPT)])
async def test_a_tool_call_stream_killed_anywhere_gives_the_unbroken_calls(
        fabric: MigrationFabric, after: int) -> None:
    # 0: before the first token; 5: inside the first name; 21: inside "Paris"; 44: the
    # second call's name; then before the closing `]`, and before EOS.
    body = {"tools": TOOLS, "vllm_xargs": {"script": SCRIPT}, "max_tokens": 100,
            "stream_options": {"include_usage": True}}
    unbroken = await stream(fabric, **body)
    fabric.nodes["us-1"].faults.append(Fault("die", after))
    got = await stream(fabric, **body)
    assert got.error is None and got.done and len(got.ids) == 1
    assert [(n, a) for _, n, a in tool_calls(got)] == CALLS
    assert all(i.startswith("chatcmpl-tool-") for i, _, _ in tool_calls(got))
    assert got.finish_reason == unbroken.finish_reason == "tool_calls"
    assert got.events[-1]["usage"] == unbroken.events[-1]["usage"]
    assert got.events[-1]["usage"]["completion_tokens"] == len(SCRIPT) + 1  # and EOS
    assert got.trailer is not None and got.trailer["node"] == "eu-1"
    assert fabric.nodes["eu-1"].requests[-1]["vllm_xargs"] == {"script": SCRIPT}


async def test_tool_calls_cut_by_max_tokens_resume_like_the_unbroken_stream(fabric: MigrationFabric) -> None:
    body = {"tools": TOOLS, "vllm_xargs": {"script": SCRIPT}, "max_tokens": 24}
    unbroken = await stream(fabric, **body)
    fabric.nodes["us-1"].faults.append(Fault("die", 20))
    got = await stream(fabric, **body)
    assert [(n, a) for _, n, a in tool_calls(got)] == [(n, a) for _, n, a in tool_calls(unbroken)]
    assert tool_calls(got)[0][1:] == ("get_weather", '{"city": "Paris')
    assert got.finish_reason == unbroken.finish_reason == "length"


@pytest.mark.parametrize("after", [SCRIPT.find("celsius") + k for k in (0, 2, 6)])
async def test_a_stop_string_split_across_the_seam_inside_tool_arguments_still_stops(
        fabric: MigrationFabric, after: int) -> None:
    body = {"tools": TOOLS, "vllm_xargs": {"script": SCRIPT}, "max_tokens": 100, "stop": ["celsius"],
            "stream_options": {"include_usage": True}}
    unbroken = await stream(fabric, **body)
    assert [(n, a) for _, n, a in tool_calls(unbroken)] == [("get_weather", '{"city": "Paris", "unit": "')]
    fabric.nodes["us-1"].faults.append(Fault("die", after))
    got = await stream(fabric, **body)
    assert got.error is None and got.trailer is not None
    assert [(n, a) for _, n, a in tool_calls(got)] == [(n, a) for _, n, a in tool_calls(unbroken)]
    assert got.finish_reason == unbroken.finish_reason == "tool_calls"
    assert got.events[-1]["usage"] == unbroken.events[-1]["usage"]


async def test_without_parallel_calls_only_the_first_call_is_sent_after_the_seam(fabric: MigrationFabric) -> None:
    body = {"tools": TOOLS, "vllm_xargs": {"script": SCRIPT}, "max_tokens": 100, "parallel_tool_calls": False}
    unbroken = await stream(fabric, **body)
    fabric.nodes["us-1"].faults.append(Fault("die", 44))  # at the second call's name
    got = await stream(fabric, **body)
    assert [(n, a) for _, n, a in tool_calls(got)] == [(n, a) for _, n, a in tool_calls(unbroken)] == CALLS[:1]
    assert got.finish_reason == unbroken.finish_reason == "tool_calls" and got.trailer is not None


async def test_a_content_answer_with_tools_on_migrates_as_content(fabric: MigrationFabric) -> None:
    unbroken = await stream(fabric, tools=TOOLS)
    fabric.nodes["us-1"].faults.append(Fault("die", 9))
    got = await stream(fabric, tools=TOOLS)
    assert got.error is None and got.text == unbroken.text == reference(chat_prompt(MESSAGES), 40)[0]
    assert tool_calls(got) == [] and got.finish_reason == "length"


@pytest.mark.parametrize(("detokenize_as", "message"), [
    (lambda t: t.replace("[", "("), "cannot be resumed"),  # not a pythonic call list
    (str.upper, "did not match the tool calls"),  # a call list, not the one sent
])
async def test_tool_calls_that_the_text_does_not_continue_end_with_an_error_event(
        fabric: MigrationFabric, detokenize_as: Any, message: str) -> None:
    fabric.nodes["eu-1"].detokenize_as = detokenize_as
    fabric.nodes["us-1"].faults.append(Fault("die", 21))
    got = await stream(fabric, tools=TOOLS, vllm_xargs={"script": SCRIPT}, max_tokens=100)
    assert got.error is not None and message in got.error["message"] and got.done is False
    assert tool_calls(got)[0][1:] == ("get_weather", '{"city": "Pa')  # the sent part, once


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_named_or_required_tool_choice_is_not_migrated(fabric: MigrationFabric, choice: Any) -> None:
    fabric.nodes["us-1"].faults.append(Fault("die", 4))
    got = await stream(fabric, tools=TOOLS, tool_choice=choice)
    assert got.error is not None and got.error["code"] == "upstream_disconnected"
    assert fabric.nodes["eu-1"].requests == []
    assert "return_token_ids" not in fabric.nodes["us-1"].requests[0]


async def test_a_non_streamed_request_whose_node_dies_is_retried_whole(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].die_whole = True
    async with fabric.client() as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference(chat_prompt(MESSAGES), 20)[0]
    assert r.headers["x-meridian-node"] == "eu-1"


async def test_a_frozen_replica_is_passed_over_for_the_next_one(fabric: MigrationFabric) -> None:
    fabric.nodes["us-1"].faults.append(Fault("die", 6))
    fabric.nodes["eu-1"].faults.append(Fault("stall", 0))  # the continuation's node freezes at once
    got = await stream(fabric)
    assert got.error is None and got.text == reference(chat_prompt(MESSAGES), 40)[0]
    assert got.trailer == {"migrations": 1, "node": "apac-1", "region": REGIONS["apac"].name}


async def test_a_replica_whose_own_streams_went_silent_is_passed_over(tmp_path: Any) -> None:
    # The whole nearest region freezes: us-1's stream and us-2's stream both stall. The stream
    # on us-1 must not be resumed on us-2 (same region, not yet ejected: its own stream has
    # not timed out yet) but on eu-1, without waiting out a second inter-token timeout.
    # The second stream starts once the first has frozen (not after a sleep), so the second
    # node has been silent for the timeout less the second stream's start-up when the first
    # times out: a 3 s timeout leaves a loaded box 1.5 s to start it (CI once took over 0.7 s).
    async for f in _fabric(tmp_path, {"us-1": "us", "us-2": "us", "eu-1": "eu"}, inter_token_timeout_s=3.0,
                           consecutive_failures_to_eject=100):
        f.nodes["us-1"].faults.append(Fault("stall", 3))
        f.nodes["us-2"].faults.append(Fault("stall", 3))
        first_task = asyncio.create_task(stream(f, max_tokens=20))
        await _first_set(f.nodes["us-1"].stalled, f.nodes["us-2"].stalled)
        second = await stream(f, max_tokens=20)
        first = await first_task
        assert f.nodes["us-1"].stalled.is_set() and f.nodes["us-2"].stalled.is_set()
        for got in (first, second):
            assert got.error is None and got.text == reference(chat_prompt(MESSAGES), 20)[0]
            assert got.trailer is not None and got.trailer["node"] == "eu-1"


async def _first_set(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), 10)
    finally:
        for w in waits:
            w.cancel()

