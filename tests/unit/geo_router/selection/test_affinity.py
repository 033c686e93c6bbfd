"""Affinity's prefix matching: the exact index for nodes that publish KV events (hashed at
each node's own block size), the routing history for the others."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from router_harness import REGIONS, node

from geo_router.selection.affinity import Affinity
from geo_router.selection.candidates import Candidate
from geo_router.selection.prefix import RequestPrefix
from geo_router.state.kv_index import KVIndex
from geo_router.state.node_load import NodeLoad
from meridian.block_hash import hash_blocks

TOKENS = list(range(1, 257))


class Index:
    """Nodes holding the first `blocks` blocks of TOKENS at their block size."""

    def __init__(self, held: Mapping[str, tuple[int, int]]) -> None:
        self.held = held  # node -> (block size, blocks held)

    def match(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        out = {}
        for n in node_ids:
            size, blocks = self.held.get(n, (0, 0))
            mine = hash_blocks(TOKENS, size)[:blocks] if size else []
            out[n] = sum(1 for a, b in zip(hashes, mine, strict=False) if a == b)
        return out

    def block_size(self, node_id: str) -> int | None:
        return self.held.get(node_id, (None, 0))[0]

    def holders(self, hashes: Sequence[int], limit: int) -> list[str]:
        return []


class History:
    def __init__(self, held: Mapping[str, int]) -> None:
        self.held = held

    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        return {n: min(len(keys), self.held.get(n, 0)) for n in node_ids}

    def record(self, node_id: str, keys: Sequence[int]) -> None:
        pass

    def holders(self, keys: Sequence[int], limit: int) -> list[str]:
        return []


class Loads:
    def load(self, node_id: str) -> NodeLoad | None:
        return None


class Prefixes:
    def build(self, model: str, payload: Mapping[str, Any], block_size: int | None) -> RequestPrefix:
        hashes = hash_blocks(TOKENS, block_size) if block_size else None
        return RequestPrefix(hashes, len(TOKENS), block_size, [1, 2, 3, 4], None, token_ids=TOKENS)


def cand(name: str, *, events: bool) -> Candidate:
    routing = node("us", f"http://{name}:1").model_copy(update={
        "node_id": name, "kv_events": "tcp://127.0.0.1:5557" if events else None})
    return Candidate(node=routing, region=REGIONS["us"], rtt_ms=1.0, in_flight=0)


def hits(affinity: Affinity, *cands: Candidate) -> dict[str, float]:
    annotated, _ = affinity.annotate(list(cands), "m", {})
    return {c.node.node_id: c.prefix_hit for c in annotated}


def test_each_node_is_matched_at_its_own_block_size() -> None:
    # vLLM's CPU build reports blocks of 128, the torch engine of 16: both hold the prompt.
    index = Index({"vllm": (128, 2), "torch": (16, 8)})
    affinity = Affinity(loads=Loads(), kv_index=index, history=History({}), prefixes=Prefixes())
    assert hits(affinity, cand("vllm", events=True), cand("torch", events=True)) == {"vllm": 1.0, "torch": 0.5}


def test_a_router_without_kv_events_matches_event_publishing_nodes_by_history() -> None:
    index = Index({"a": (16, 16)})
    affinity = Affinity(loads=Loads(), kv_index=index, history=History({"b": 2}), prefixes=Prefixes(),
                        exact=None)
    assert hits(affinity, cand("a", events=True), cand("b", events=True)) == {"a": 0.0, "b": 0.5}


def test_a_scoped_router_matches_nodes_outside_its_kv_scope_by_history() -> None:
    """geo_router.state.kv_scope: a node whose events this router does not follow is not in its
    index; counting it as holding nothing there would steer every conversation away from it."""
    index = Index({"near": (16, 16)})
    affinity = Affinity(loads=Loads(), kv_index=index, history=History({"far": 4}), prefixes=Prefixes(),
                        exact=lambda n: n.node_id == "near")
    assert hits(affinity, cand("near", events=True), cand("far", events=True)) == {"near": 1.0, "far": 1.0}


def test_a_cache_holding_the_prompt_joins_a_bounded_candidate_set_without_any_routing_history() -> None:
    """Another router sent the conversation to `holder` (no history shared here): the KV index
    names it, and it is added to the sample that left it out, through selection's checks."""
    index = KVIndex()
    index.store("holder", hash_blocks(TOKENS, 16), block_size=16)
    index.store("other", hash_blocks(TOKENS, 16)[:2], block_size=16)
    asked: list[list[str]] = []

    def more(node_ids: Sequence[str]) -> list[Candidate]:
        asked.append(list(node_ids))
        return [cand(n, events=True) for n in node_ids]

    affinity = Affinity(loads=Loads(), kv_index=index, history=History({}), prefixes=Prefixes())
    sample = [cand("a", events=True), cand("b", events=True)]
    annotated, _ = affinity.annotate(sample, "m", {}, more)
    assert asked == [["holder"]]  # the longest run's holder only
    assert {c.node.node_id: c.prefix_hit for c in annotated} == {"a": 0.0, "b": 0.0, "holder": 1.0}
    # A router that does not use KV events asks nobody.
    asked.clear()
    blind = Affinity(loads=Loads(), kv_index=index, history=History({}), prefixes=Prefixes(), exact=None)
    annotated, _ = blind.annotate(sample, "m", {}, more)
    assert asked == [] and [c.node.node_id for c in annotated] == ["a", "b"]
