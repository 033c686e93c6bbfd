"""Prefill/decode disaggregation on real vLLM (its CPU build) through two nodes: a prefill
node and a decode node, each the node agent's app around vLLM with its NixlConnector (KV
in host memory, moved by NIXL's UCX backend; make vllm installs NIXL).

The two-phase protocol by hand, as the router runs it (meridian.kv_transfer): the request
goes to the prefill node with max_tokens 1, stream false and the prefill params; its answer
carries `kv_transfer_params` naming the prefill engine, its blocks and side channel; the
original request then goes to the decode node with those params, and the decode node pulls
the prompt's KV instead of computing it. Greedy answers must be token-identical to the same
request served co-located, and the decode node's vLLM must count the prompt's tokens as
pulled (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`).

Each case has its own prompt, long enough for two of vLLM's CPU blocks (128 tokens): the
co-located answer comes from the prefill node, so the decode node has nothing of it cached
and takes every prompt token from the transfer.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from router_harness import CLUSTER_TOKEN, REGIONS, ServerGroup, router_settings, serve_router
from tenant_fabric import MODEL, Tenant
from vllm_fabric import PDNodes, pd_nodes, require_vllm

from geo_router import create_app as create_router_app
from geo_router.state.table import StaticTableSource
from meridian.contracts import HEADER_REQUEST_ID, NodeRole, NodeStatus, RoutingNode, RoutingTable
from meridian.kv_transfer import decode_params, prefill_request_params

pytestmark = pytest.mark.asyncio(loop_scope="module")

PREFILL, DECODE = NodeRole.PREFILL, NodeRole.DECODE
ERIN = Tenant("erin", "sk-erin-0123456789abcdef", zone="eu")
_EXTERNAL = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
                       re.MULTILINE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PDNodes]:
    require_vllm()
    async with pd_nodes(tmp_path_factory.mktemp("vllm-pd")) as started:
        yield started


def client(nodes: PDNodes, role: NodeRole) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=nodes.urls[role], timeout=120,
                             headers={"authorization": f"Bearer {CLUSTER_TOKEN}"})


def request(path: str, case: str, stream: bool) -> dict[str, Any]:
    text = f"case {case}: " + " ".join(["tell me a long story about the sea and the ships on it"] * 14)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == "/v1/chat/completions":
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": text}


async def answer(nodes: PDNodes, role: NodeRole, path: str, body: dict[str, Any],
                 key: str) -> tuple[list[int], str, int]:
    """(generated token ids, text, prompt tokens) of a request to one node, streamed or not."""
    ids: list[int] = []
    text = ""
    usage: dict[str, Any] = {}
    async with client(nodes, role) as c:
        if not body["stream"]:
            r = await c.post(path, json=body, headers={HEADER_REQUEST_ID: key})
            assert r.status_code == 200, r.text
            data = r.json()
            choice = data["choices"][0]
            return choice["token_ids"], choice.get("text") or choice["message"]["content"], data["usage"][
                "prompt_tokens"]
        async with c.stream("POST", path, json=body, headers={HEADER_REQUEST_ID: key}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    ids += choice.get("token_ids") or []
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return ids, text, usage["prompt_tokens"]


async def external_tokens(nodes: PDNodes, role: NodeRole) -> float:
    """Prompt tokens the node's vLLM took from KV transfers, as the node's /metrics relays them."""
    async with client(nodes, role) as c:
        text = (await c.get("/metrics")).text
    m = _EXTERNAL.search(text)
    assert m is not None, "vLLM's prompt_tokens_by_source_total is not on the node's /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_request_prefilled_on_one_node_and_decoded_on_the_other_answers_as_co_located(
    nodes: PDNodes, path: str, stream: bool,
) -> None:
    case = f"{path.rsplit('/', 1)[-1]}-{stream}"
    body = request(path, case, stream)
    co_located = await answer(nodes, PREFILL, path, body, f"{case}-co-located")
    assert len(co_located[0]) == 16 and co_located[2] > 128

    # Phase 1: the prefill node computes the prompt's KV and says where its blocks are.
    before = await external_tokens(nodes, DECODE)
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_request_params()}
    prefill.pop("stream_options", None)
    async with client(nodes, PREFILL) as c:
        r = await c.post(path, json=prefill, headers={HEADER_REQUEST_ID: f"{case}-prefill"})
    assert r.status_code == 200, r.text
    params = decode_params(r.json())
    assert params["remote_host"] == "127.0.0.1" and params["remote_block_ids"]
    assert params["remote_engine_id"] and params["remote_port"] > 0

    # Phase 2: the decode node pulls them and generates what co-located serving did.
    decoded = await answer(nodes, DECODE, path, {**body, "kv_transfer_params": params}, f"{case}-decode")
    assert decoded == co_located
    assert await external_tokens(nodes, DECODE) - before == co_located[2]


async def test_each_node_journals_its_phase_as_served(nodes: PDNodes) -> None:
    """A one-token prefill is journalled as a completed prefill hop on the prefill node, the
    decode as the request's answer on the decode node (the journal is what the chaos
    checker's exactly-once accounting reads: a hop is not a second answer)."""
    served = {role: _served(nodes, role) for role in (PREFILL, DECODE)}
    assert served[PREFILL]["completions-False-prefill"] == (True, True)
    assert served[PREFILL]["completions-False-co-located"] == (True, False)
    assert served[DECODE]["completions-True-decode"] == (True, False)
    assert not any(key.endswith("-prefill") for key in served[DECODE])


def _served(nodes: PDNodes, role: NodeRole) -> dict[str, tuple[bool, bool]]:
    """(completed, prefill hop) of each key the node journalled as served."""
    path: Path = nodes.apps[role].state.runtime.settings.request_journal_path
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["key"]: (line["completed"], line.get("prefill", False)) for line in lines
            if line["type"] == "served"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_through_the_router_a_chat_is_disaggregated_and_answers_as_co_located(
    nodes: PDNodes, stream: bool,
) -> None:
    """The router's own P/D flow (geo_router.forwarding.disagg) in front of the two vLLM nodes."""
    path = "/v1/chat/completions"
    case = f"router-{stream}"
    body = request(path, case, stream)
    co_located = await answer(nodes, PREFILL, path, body, f"{case}-co-located")
    before = await external_tokens(nodes, DECODE)
    table = RoutingTable(
        version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()), tenants=[ERIN.entry()],
        nodes=[RoutingNode(node_id=nodes.node_ids[role], region=REGIONS["eu"].name, url=nodes.urls[role],
                           models=[MODEL], status=NodeStatus.READY, engine="vllm", role=role,
                           kv_transfer=nodes.apps[role].state.runtime.engine.kv_transfer())
               for role in (PREFILL, DECODE)])
    settings = router_settings(probe_enabled=False, read_timeout_s=120.0, request_timeout_s=180.0,
                               max_request_bytes=1_000_000, default_client_location=REGIONS["eu"].name,
                               pd_min_prompt_tokens=0,
                               # A loopback connect waits on this process's loop, which a CI box
                               # running two vLLMs has starved past the harness's 1 s (a stop's CI
                               # ended 503 no_replica_in_zone that way): the hand-off is tested, not
                               # connect timeouts.
                               connect_timeout_s=10.0,
                               # A vLLM pinned to one core of a busy CI box has taken over the
                               # default 30 s to prefill; this test is about the hand-off, not timeouts.
                               pd_prefill_timeout_s=150.0)
    servers = ServerGroup()
    try:
        router_url = await serve_router(servers, create_router_app(settings, table_source=StaticTableSource(table)),
                                        settings)
        async with httpx.AsyncClient(base_url=router_url, timeout=180,
                                     headers={"authorization": f"Bearer {ERIN.key}"}) as c:
            ids, text, prompt_tokens = await _via(c, path, body)
            page = (await c.get("/metrics", headers={"authorization": f"Bearer {CLUSTER_TOKEN}"})).text
    finally:
        await servers.stop()
    assert (ids, text, prompt_tokens) == co_located
    assert await external_tokens(nodes, DECODE) - before == co_located[2]
    assert 'meridian_router_pd_requests_total{how="disaggregated",region="gcp:europe-west4"} 1.0' in page


async def _via(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[list[int], str, int]:
    if not body["stream"]:
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["token_ids"], data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens"]
    ids: list[int] = []
    text, usage = "", {}
    async with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    ids += choice.get("token_ids") or []
                    text += (choice.get("delta") or {}).get("content") or ""
    return ids, text, usage["prompt_tokens"]
