"""Precise KV-aware routing for vLLM nodes, against real vLLM (its CPU build): the blocks
vLLM reports in its KV events reach the router's exact index under the hashes the router
computes from a request (the node re-keys them: data_plane/engine/vllm/rehash.py), so a
request sharing a long prefix goes to the node that holds it, beside a torch-engine node
with another block size."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from router_harness import eventually
from tenant_fabric import MODEL
from vllm_fabric import ALICE, KVFabric, kv_fabric, require_vllm

from geo_router.ingress.isolation import salted
from geo_router.ingress.request import parse_inference_request
from meridian.contracts import HEADER_NODE

pytestmark = pytest.mark.timeout(600)

WORDS = "river mountain forest garden ocean island bridge road train computer model network".split()


def conversation(i: int) -> list[dict[str, str]]:
    """A system prompt of ~400 tokens of its own (three of vLLM's 128-token blocks)."""
    text = " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(400))
    return [{"role": "system", "content": f"Conversation {i}. {text}"}]


def request(i: int, turn: str) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [*conversation(i), {"role": "user", "content": turn}]}


def held_blocks(fabric: KVFabric, body: dict[str, object], node_id: str) -> int:
    """Leading blocks of `body`'s prompt the router believes `node_id` holds (exact index)."""
    state = fabric.state
    inference = salted(parse_inference_request(httpx.Request("POST", "/", json=body).content), ALICE.entry())
    size = state.kv_index.block_size(node_id)
    if size is None:
        return 0
    prefix = state.prefixes.build(MODEL, inference.payload, size)
    hashes = prefix.hashes_for(size) or []
    return state.kv_index.match(hashes, [node_id]).get(node_id, 0)


async def test_a_long_shared_prefix_goes_to_the_vllm_node_that_holds_it(tmp_path: Path) -> None:
    require_vllm()
    async with kv_fabric(tmp_path) as fabric, httpx.AsyncClient(
            base_url=fabric.router_url, timeout=120, headers={"authorization": f"Bearer {ALICE.key}"}) as client:
        firsts: dict[int, str] = {}
        for i in range(4):
            first = await client.post("/v1/chat/completions", json=request(i, "Hello"))
            assert first.status_code == 200, first.text
            node = firsts[i] = first.headers[HEADER_NODE]
            # vLLM's BlockStored events, re-keyed on the node, match the router's own hashes.
            await eventually(lambda i=i, node=node: held_blocks(fabric, request(i, "Hello"), node) >= 3,
                             timeout_s=30)
            follow = await client.post("/v1/chat/completions", json=request(i, "And then?"))
            assert follow.status_code == 200, follow.text
            assert follow.headers[HEADER_NODE] == node, f"conversation {i} left the node holding its prefix"
            usage = follow.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert cached >= 384 or node != "vllm-node", f"vLLM did not reuse the prefix: {usage}"
        assert "vllm-node" in firsts.values(), f"no conversation started on the vLLM node: {firsts}"
        assert fabric.state.kv_index.block_size("vllm-node") == 128, "the block size comes from vLLM's events"
