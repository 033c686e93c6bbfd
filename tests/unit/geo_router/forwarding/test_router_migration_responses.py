"""Streamed Responses API answers survive their node: served as chat, written back as events.

The same real router and token-id stand-in nodes as test_router_migration.py: a plain
streamed Responses request (store false) reaches the node as a streamed chat completion
with token ids on, the client gets the Responses API's events, and a stream whose node
dies at its first, a middle or its last token comes out as the unbroken one would: the
same text, one response id, usage counting every token, sequence numbers running on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from router_harness import EU_KEY, GLOBAL_KEY, MODEL, REGIONS, SCRAPE, metric
from test_router_migration import MigrationFabric, fabric, reference
from token_node import Fault, chat_prompt

__all__ = ["fabric"]  # the fixture, shared with the chat tests

INPUT = "tell me a long story"
PROMPT = chat_prompt([{"role": "system", "content": "be kind"}, {"role": "user", "content": INPUT}])


@dataclass
class Events:
    events: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_text.delta"))

    @property
    def completed(self) -> dict[str, Any]:
        (done,) = self.of("response.completed")
        return done


async def responses(f: MigrationFabric, key: str = GLOBAL_KEY, **body: Any) -> Events:
    payload = {"model": MODEL, "input": INPUT, "instructions": "be kind", "stream": True, "store": False,
               "max_output_tokens": 40, **body}
    events: list[dict[str, Any]] = []
    kind = None
    async with f.client(key) as client, client.stream("POST", "/v1/responses", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                events.append(event)
    return Events(events)


async def test_a_plain_responses_stream_is_served_as_chat_with_token_ids(fabric: MigrationFabric) -> None:
    got = await responses(fabric)
    sent = fabric.nodes["us-1"].requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["return_token_ids"] is True
    assert sent["messages"] == [{"role": "system", "content": "be kind"}, {"role": "user", "content": INPUT}]
    assert sent["max_tokens"] == 40 and sent["stream_options"] == {"include_usage": True}
    assert "add_special_tokens" not in sent  # a torch node's (vLLM's get it: for_engine)
    assert got.text == reference(PROMPT, 40)[0]
    assert [e["sequence_number"] for e in got.events] == list(range(len(got.events)))
    done = got.completed["response"]
    assert done["status"] == "incomplete" and done["output"][0]["content"][0]["text"] == got.text
    assert done["usage"]["input_tokens"] == len(PROMPT) and done["usage"]["output_tokens"] == 40
    assert "meridian" not in got.completed


@pytest.mark.parametrize("after", [0, 17, 39])
async def test_a_responses_stream_killed_mid_generation_equals_an_unbroken_one(
        fabric: MigrationFabric, after: int) -> None:
    unbroken = await responses(fabric)
    fabric.nodes["us-1"].faults.append(Fault("die", after))
    got = await responses(fabric)
    assert got.text == unbroken.text and [e["type"] for e in got.events] == [e["type"] for e in unbroken.events]
    assert [e["sequence_number"] for e in got.events] == list(range(len(got.events)))
    ids = {e["response"]["id"] for e in got.events if "response" in e}
    assert len(ids) == 1 and {e["item_id"] for e in got.events if "item_id" in e} == {
        e["item_id"] for e in got.events if e["type"] == "response.content_part.added"}
    done, before = got.completed["response"], unbroken.completed["response"]
    assert done["usage"] == before["usage"] and done["usage"]["output_tokens"] == 40
    assert done["output"][0]["content"] == before["output"][0]["content"]
    assert got.completed["meridian"] == {"migrations": 1, "node": "eu-1", "region": REGIONS["eu"].name}
    resumed = fabric.nodes["eu-1"].requests[-1]
    assert resumed["path"] == "/v1/completions" and resumed["prompt"][:len(PROMPT)] == PROMPT


async def test_the_router_accounts_the_usage_of_a_migrated_responses_stream(
        fabric: MigrationFabric, caplog: pytest.LogCaptureFixture) -> None:
    fabric.nodes["us-1"].faults.append(Fault("die", 9))
    with caplog.at_level(logging.INFO, logger="meridian.access"):
        await responses(fabric, max_output_tokens=30)
    (line,) = [r for r in caplog.records if r.name == "meridian.access"]
    assert (line.route, line.stream, line.prompt_tokens, line.completion_tokens) == (  # type: ignore[attr-defined]
        "/v1/responses", True, len(PROMPT), 30)
    async with fabric.client() as c:
        scraped = (await c.get("/metrics", headers=SCRAPE)).text
    tokens = "meridian_router_tenant_tokens_total"
    assert metric(scraped, tokens, tenant="acme", model=MODEL, zone="global", kind="prompt") == len(PROMPT)
    assert metric(scraped, tokens, tenant="acme", model=MODEL, zone="global", kind="completion") == 30


async def test_a_refused_migration_ends_with_the_responses_apis_error_event(fabric: MigrationFabric) -> None:
    fabric.nodes["eu-1"].faults.append(Fault("die", 7))
    got = await responses(fabric, key=EU_KEY)
    (error,) = got.of("error")
    assert got.events[-1] is error and error["code"] == "upstream_disconnected"
    assert "residency zone" in error["message"] and got.of("response.completed") == []
    assert got.text == reference(PROMPT, 40)[0][:7]


@pytest.mark.parametrize("change", [{"store": True}, {"stream": False}, {"previous_response_id": None,
                                                                       "background": True}])
async def test_other_responses_requests_reach_the_node_as_sent(fabric: MigrationFabric,
                                                               change: dict[str, Any]) -> None:
    payload = {"model": MODEL, "input": INPUT, "stream": True, **change}
    async with fabric.client() as c:
        r = await c.post("/v1/responses", json=payload)
    assert r.status_code == 404  # the stand-in serves no Responses API: the request went as it was
    (sent,) = [q for n in fabric.nodes.values() for q in n.requests]
    assert sent["path"] == "/v1/responses" and "return_token_ids" not in sent and "messages" not in sent
