"""Tool-call streams move only between nodes whose tool-call parser the router replays.

Each node advertises its parser (RoutingNode.tool_call_parser, from its registration); the
router replays vLLM's `pythonic` one. The stand-in nodes all write pythonic calls: what a
test changes is what a node advertises, which is all the router may go by.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from router_harness import REGIONS, SCRAPE, metric
from test_router_migration import CALLS, MESSAGES, SCRIPT, TOOLS, _fabric, reference, stream, tool_calls
from token_node import Fault, chat_prompt

TOOL_BODY = {"tools": TOOLS, "vllm_xargs": {"script": SCRIPT}, "max_tokens": 100}


async def test_a_tool_call_stream_skips_a_replica_with_another_parser(tmp_path: Any) -> None:
    # eu-1 is the nearer replica, but reads tool calls as hermes does: apac-1 resumes.
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu", "apac-1": "apac"}, parsers={"eu-1": "hermes"}):
        f.nodes["us-1"].faults.append(Fault("die", 21))
        got = await stream(f, **TOOL_BODY)
        assert got.error is None and got.done
        assert [(n, a) for _, n, a in tool_calls(got)] == CALLS and got.finish_reason == "tool_calls"
        assert got.trailer == {"migrations": 1, "node": "apac-1", "region": REGIONS["apac"].name}
        assert f.nodes["eu-1"].requests == []


@pytest.mark.parametrize("other", ["hermes", None])
async def test_a_tool_call_stream_is_refused_when_no_replica_replays_its_parser(
        tmp_path: Any, other: str | None) -> None:
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu"}, parsers={"eu-1": other}):
        f.nodes["us-1"].faults.append(Fault("die", 21))
        got = await stream(f, **TOOL_BODY)
        assert got.error is not None and got.error["code"] == "upstream_disconnected"
        assert "no other replica" in got.error["message"] and got.done is False
        assert tool_calls(got)[0][1:] == ("get_weather", '{"city": "Pa')  # what came before the break, once
        assert f.nodes["eu-1"].requests == []
        async with f.client() as c:
            scraped = (await c.get("/metrics", headers=SCRAPE)).text
        assert metric(scraped, "meridian_router_migrations_refused_total", why="no_replica") == 1


@pytest.mark.parametrize("parser", ["hermes", None])
@pytest.mark.parametrize("body", [TOOL_BODY, {"tools": TOOLS}], ids=["calls", "content"])
async def test_a_tool_stream_from_a_node_with_another_parser_is_not_replayed(
        tmp_path: Any, parser: str | None, body: dict[str, Any]) -> None:
    # Even a content answer: the rest of its text might be calls in the node's format.
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu"}, parsers={"us-1": parser}):
        f.nodes["us-1"].faults.append(Fault("die", 21))
        got = await stream(f, **body)
        assert got.error is not None and got.error["code"] == "upstream_disconnected"
        assert "format that cannot be resumed" in got.error["message"] and got.done is False
        assert f.nodes["eu-1"].requests == []
        async with f.client() as c:
            scraped = (await c.get("/metrics", headers=SCRAPE)).text
        assert metric(scraped, "meridian_router_migrations_refused_total", why="tool_format") == 1


async def test_a_slow_node_with_another_parser_is_waited_for_as_before(tmp_path: Any) -> None:
    # Its tool stream could not move anyway: a pause past the inter-token timeout (though
    # within the read timeout) must not end it, as it did not before streams could move.
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu"}, parsers={"us-1": "hermes"},
                           inter_token_timeout_s=0.2):
        f.nodes["us-1"].faults.append(Fault("stall", 21))
        task = asyncio.create_task(stream(f, **TOOL_BODY))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 1.0)  # five inter-token timeouts
        f.nodes["us-1"].release.set()
        got = await task
        assert got.error is None and got.done and got.trailer is None
        assert [(n, a) for _, n, a in tool_calls(got)] == CALLS and f.nodes["eu-1"].requests == []


async def test_the_parser_does_not_matter_to_a_stream_without_tools(tmp_path: Any) -> None:
    async for f in _fabric(tmp_path, {"us-1": "us", "eu-1": "eu"}, parsers={"us-1": "hermes", "eu-1": None}):
        f.nodes["us-1"].faults.append(Fault("die", 9))
        got = await stream(f)
        assert got.error is None and got.text == reference(chat_prompt(MESSAGES), 40)[0]
        assert got.trailer is not None and got.trailer["node"] == "eu-1"
