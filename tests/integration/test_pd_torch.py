"""Prefill/decode disaggregation end to end on the torch engine: a real router in front of
real prefill and decode nodes (the tiny checkpoint), against a co-located node.

Greedy output through the P/D pools must be token for token what one co-located node
gives for the same request, the decode node must account the prompt as transferred, not
computed, and each failure case must still answer the same tokens: a prefill worker
that is gone, a decode worker lost before its first token (a fresh prefill, another
decode worker), and both prefill workers gone (the decode worker prefills itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_harness import (
    CLUSTER_TOKEN,
    REGIONS,
    ServerGroup,
    reserve_port,
    router_settings,
    serve_router,
    url_of,
)
from tenant_fabric import MODEL, Tenant, node_settings

from chaos.faults.tcp_proxy import FaultProxy, running_proxy
from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.server.app import create_app as create_node_app
from geo_router import create_app as create_router_app
from geo_router.state.table import StaticTableSource
from meridian.contracts import (
    HEADER_NODE,
    KVConnector,
    KVTransferInfo,
    NodeRole,
    NodeStatus,
    RoutingNode,
    RoutingTable,
)

US = REGIONS["us"].name
DAVE = Tenant("dave", "sk-dave-0123456789abcdef", zone="global")
NODE_AUTH = {"authorization": f"Bearer {CLUSTER_TOKEN}"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PROMPT = "Tell me about rivers, lamps and copper stones in winter gardens, " * 4


def request(kind: str, text: str = PROMPT, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 12,
                            "return_token_ids": True, **extra}
    return body | ({"messages": [{"role": "user", "content": text}]} if kind == "chat" else {"prompt": text})


@dataclass
class Rig:
    router: httpx.AsyncClient
    nodes: dict[str, httpx.AsyncClient]  # by name, with the cluster token
    proxies: dict[str, FaultProxy]
    source: StaticTableSource
    table_nodes: dict[str, RoutingNode]

    def serve(self, *names: str) -> None:
        current = self.source.current().table
        self.source.set(current.model_copy(update={"version": current.version + 1,
                                                   "nodes": [self.table_nodes[n] for n in names]}))


async def _answer(client: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> tuple[list[int], str, str]:
    """(token ids, text, serving node) of one request, streamed or not."""
    if not body.get("stream"):
        r = await client.post(PATHS[kind], json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return list(choice["token_ids"]), choice.get("text") or choice["message"]["content"], r.headers.get(HEADER_NODE, "")
    ids: list[int] = []
    text: list[str] = []
    async with client.stream("POST", PATHS[kind], json=body) as r:
        assert r.status_code == 200
        node = r.headers.get(HEADER_NODE, "")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = httpx.Response(200, content=line[5:]).json()
            assert "error" not in event, event
            for choice in event.get("choices") or ():
                ids += choice.get("token_ids") or []
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return ids, "".join(text), node


async def by_source(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {s.labels["source"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "vllm:prompt_tokens_by_source_total"}


@contextlib.asynccontextmanager
async def _node(servers: ServerGroup, checkpoint: Path, name: str, role: NodeRole) -> AsyncIterator[str]:
    sock = reserve_port()
    port = sock.getsockname()[1]
    app = create_node_app(node_settings(checkpoint, node_id=name, region=US, role=role, host="127.0.0.1", port=port,
                                        max_tokens_limit=64))
    url = await servers.start(app, sock)
    await app.state.runtime.wait_ready()
    yield url


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    checkpoint = make_tiny_checkpoint(tmp_path / MODEL, seed=0)
    servers = ServerGroup()
    stack = contextlib.AsyncExitStack()
    clients: list[httpx.AsyncClient] = []
    try:
        roles = {"p1": NodeRole.PREFILL, "p2": NodeRole.PREFILL, "d1": NodeRole.DECODE, "d2": NodeRole.DECODE,
                 "c": NodeRole.BOTH}
        urls = {n: await stack.enter_async_context(_node(servers, checkpoint, n, r)) for n, r in roles.items()}
        # p1 and d1 are reached through fault proxies (a node lost without a word).
        proxies = {}
        for n in ("p1", "d1"):
            port = int(urls[n].rsplit(":", 1)[1])
            proxies[n] = await stack.enter_async_context(running_proxy("127.0.0.1", port))
        dead = reserve_port()
        table_nodes = {}
        for n, role in roles.items():
            url = f"http://127.0.0.1:{proxies[n].port}" if n in proxies else urls[n]
            transfer = None if role is NodeRole.BOTH else KVTransferInfo(
                connector=KVConnector.MERIDIAN, endpoint=urls[n].removeprefix("http://"), lease_s=60)
            table_nodes[n] = RoutingNode(node_id=n, region=US, url=url, models=[MODEL], status=NodeStatus.READY,
                                         role=role, kv_transfer=transfer)
        table_nodes["p-dead"] = table_nodes["p1"].model_copy(update={"node_id": "p-dead", "url": url_of(dead)})
        table = RoutingTable(version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()),
                             tenants=[DAVE.entry()], nodes=[table_nodes[n] for n in ("p1", "p2", "d1", "d2")])
        settings = router_settings(probe_enabled=False, read_timeout_s=60.0, request_timeout_s=120.0,
                                   max_request_bytes=1_000_000, default_client_location=US, pd_min_prompt_tokens=0)
        source = StaticTableSource(table)
        router_url = await serve_router(servers, create_router_app(settings, table_source=source), settings)
        router = httpx.AsyncClient(base_url=router_url, timeout=120, headers={"authorization": f"Bearer {DAVE.key}"})
        nodes = {n: httpx.AsyncClient(base_url=u, timeout=120, headers=NODE_AUTH) for n, u in urls.items()}
        clients = [router, *nodes.values()]
        yield Rig(router, nodes, proxies, source, table_nodes)
        dead.close()
    finally:
        for c in clients:
            await c.aclose()
        await stack.aclose()
        await servers.stop()


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_pd_answers_token_for_token_what_a_colocated_node_does(rig: Rig, kind: str):
    for stream in (False, True):
        # A prompt of its own each time: a decode node's prefix cache keeps what it pulled,
        # and would serve a repeated prompt's blocks as local cache hits.
        text = f"{'Streamed' if stream else 'Whole'}: {PROMPT}"
        r = await rig.nodes["c"].post(PATHS[kind], json=request(kind, text))
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        body = request(kind, text, stream=stream)
        expected, text, _ = await _answer(rig.nodes["c"], kind, body)
        before = {n: await by_source(rig.nodes[n]) for n in ("d1", "d2")}
        ids, got_text, node = await _answer(rig.router, kind, body)
        assert (ids, got_text) == (expected, text) and len(ids) == 12
        assert node in ("d1", "d2")
        after = await by_source(rig.nodes[node])
        # The decode node pulled the whole prompt's KV (vLLM counts the last token, which it
        # recomputes for its logits, as transferred too): it computed none of it.
        transferred = after.get("external_kv_transfer", 0) - before[node].get("external_kv_transfer", 0)
        assert transferred == prompt_tokens
        assert after.get("local_compute", 0) == before[node].get("local_compute", 0)


async def test_a_prefill_worker_that_is_gone_is_passed_over(rig: Rig):
    rig.serve("p-dead", "p2", "d2")
    body = request("chat", text="Rivers and lamps.")
    expected, _, _ = await _answer(rig.nodes["c"], "chat", body)
    before = (await by_source(rig.nodes["d2"])).get("external_kv_transfer", 0)
    ids, _, node = await _answer(rig.router, "chat", body)
    assert ids == expected and node == "d2"
    assert (await by_source(rig.nodes["d2"])).get("external_kv_transfer", 0) > before  # p2 prefilled


async def test_a_decode_worker_lost_before_its_first_token_is_replaced_with_a_fresh_prefill(rig: Rig):
    rig.serve("p2", "d1", "d2")
    rig.proxies["d1"].reset()  # d1 takes the connection and drops it: it may have pulled the KV
    body = request("completions", text="Copper stones in winter.", stream=True)
    expected, _, _ = await _answer(rig.nodes["c"], "completions", body)
    for _ in range(4):  # until the router has tried d1 (its policy may pick d2 first)
        ids, _, node = await _answer(rig.router, "completions", body)
        assert ids == expected and node == "d2"
        if rig.proxies["d1"].stats.reset:
            break
    assert rig.proxies["d1"].stats.reset


async def test_with_every_prefill_worker_gone_the_decode_worker_prefills_itself(rig: Rig):
    rig.serve("p1", "d2")
    rig.proxies["p1"].reset()
    body = request("chat", text="Lamps, gardens, and the sea.")
    expected, _, _ = await _answer(rig.nodes["c"], "chat", body)
    before = await by_source(rig.nodes["d2"])
    ids, _, node = await _answer(rig.router, "chat", body)
    assert ids == expected and node == "d2"
    after = await by_source(rig.nodes["d2"])
    assert after.get("local_compute", 0) > before.get("local_compute", 0)
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
