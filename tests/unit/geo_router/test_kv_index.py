"""The exact KV-prefix index: what the nodes' events say they hold, and prefix matching."""

from __future__ import annotations

import random

import pytest

from geo_router.kv_index import KVIndex
from meridian.block_hash import hash_blocks
from meridian.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

BLOCK = 4


def stored(hashes: list[int], *, medium: str | None = MEDIUM_GPU, block_size: int = BLOCK) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * block_size * len(hashes),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None)


def chain(tokens: list[int], lora: str | None = None) -> list[int]:
    return hash_blocks(tokens, BLOCK, lora)


SYSTEM = list(range(100, 116))  # four blocks shared by every conversation
ALICE = chain([*SYSTEM, *range(200, 212)])  # seven blocks
BOB = chain([*SYSTEM, *range(300, 312)])


def test_match_counts_leading_blocks_per_node_and_stops_at_the_first_miss() -> None:
    index = KVIndex()
    index.apply("a", [stored(ALICE)])
    index.apply("b", [stored(ALICE[:4])])
    # c holds Alice's tail but not block 2: the chain breaks there, the rest is unusable.
    index.apply("c", [stored(ALICE[:2] + ALICE[3:])])

    assert index.match(ALICE, ["a", "b", "c", "unknown"]) == {"a": 7, "b": 4, "c": 2, "unknown": 0}
    # Bob shares the system prompt only.
    assert index.match(BOB, ["a", "b", "c"]) == {"a": 4, "b": 4, "c": 2}
    # Only the nodes asked about are answered.
    assert index.match(ALICE, ["b"]) == {"b": 4}
    assert index.match([], ["a"]) == {"a": 0}


def test_adapter_and_salt_make_different_chains() -> None:
    index = KVIndex()
    index.apply("a", [stored(chain(SYSTEM, lora="sql"))])
    assert index.match(chain(SYSTEM), ["a"]) == {"a": 0}
    assert index.match(chain(SYSTEM, lora="sql"), ["a"]) == {"a": 4}


def test_removed_blocks_stop_matching_only_on_their_node() -> None:
    index = KVIndex()
    index.apply("a", [stored(ALICE)])
    index.apply("b", [stored(ALICE)])
    index.apply("a", [BlockRemoved(block_hashes=[ALICE[5], 12345], medium=MEDIUM_GPU)])
    assert index.match(ALICE, ["a", "b"]) == {"a": 5, "b": 7}
    assert index.node_blocks("a") == 6
    # Removing from an unknown node, or a hash it never had, changes nothing.
    index.remove("zzz", [ALICE[0]])
    assert index.match(ALICE, ["a", "b"]) == {"a": 5, "b": 7}


def test_a_block_is_held_until_every_medium_dropped_it() -> None:
    index = KVIndex()
    index.apply("a", [stored(SYSTEM_HASHES := chain(SYSTEM)), stored(SYSTEM_HASHES, medium=MEDIUM_CPU)])
    index.apply("a", [BlockRemoved(block_hashes=SYSTEM_HASHES, medium=MEDIUM_GPU)])
    assert index.match(SYSTEM_HASHES, ["a"]) == {"a": 4}  # still offloaded to CPU
    index.apply("a", [BlockRemoved(block_hashes=SYSTEM_HASHES[2:], medium=MEDIUM_CPU)])
    assert index.match(SYSTEM_HASHES, ["a"]) == {"a": 2}
    # vLLM releases without a medium mean the GPU.
    index.apply("b", [stored(SYSTEM_HASHES, medium=None), BlockRemoved(block_hashes=SYSTEM_HASHES, medium=None)])
    assert index.match(SYSTEM_HASHES, ["b"]) == {"b": 0}


def test_all_blocks_cleared_empties_one_node_and_keeps_it() -> None:
    index = KVIndex()
    index.apply("a", [stored(ALICE)])
    index.apply("b", [stored(ALICE)])
    index.apply("a", [AllBlocksCleared()])
    assert index.match(ALICE, ["a", "b"]) == {"a": 0, "b": 7}
    assert sorted(index.nodes()) == ["a", "b"]
    # Events in the same batch after the clear apply on top of it.
    index.apply("a", [stored(ALICE[:3]), AllBlocksCleared(), stored(ALICE[:1])])
    assert index.match(ALICE, ["a"]) == {"a": 1}


def test_remove_node_forgets_it_and_its_slot_is_reused_cleanly() -> None:
    index = KVIndex()
    index.apply("a", [stored(ALICE)])
    index.apply("b", [stored(BOB)])
    index.remove_node("a")
    assert index.nodes() == ["b"]
    assert index.match(ALICE, ["a", "b"]) == {"a": 0, "b": 4}
    # A newcomer may take a's place in the index; it must not inherit a's blocks.
    index.apply("c", [stored(BOB[:2])])
    assert index.match(ALICE, ["a", "b", "c"]) == {"a": 0, "b": 4, "c": 2}
    assert index.stats().hashes == len(set(BOB))
    index.remove_node("a")  # idempotent


def test_block_size_is_learnt_from_block_stored() -> None:
    index = KVIndex()
    assert index.block_size("a") is None
    index.apply("a", [stored(ALICE[:1], block_size=16)])
    assert index.block_size("a") == 16


def test_cap_forgets_the_oldest_blocks_of_that_node_only() -> None:
    index = KVIndex(max_blocks_per_node=5)
    index.apply("a", [stored(ALICE[:4])])
    index.apply("a", [stored(ALICE[4:])])  # 7 blocks: the two oldest go
    index.apply("b", [stored(ALICE[:4])])
    assert index.node_blocks("a") == 5
    assert index.match(ALICE, ["a", "b"]) == {"a": 0, "b": 4}
    assert index.match(ALICE[2:], ["a"]) == {"a": 5}
    # Storing a block again makes it the newest, so it outlives older ones.
    index.apply("a", [stored([ALICE[2]]), stored(BOB[:1])])
    assert index.match(ALICE[2:], ["a"]) == {"a": 1}
    stats = index.stats()
    assert (stats.nodes, stats.blocks, stats.evicted) == (2, 9, 3)
    with pytest.raises(ValueError):
        KVIndex(max_blocks_per_node=0)


def test_match_agrees_with_a_naive_walk_over_many_nodes() -> None:
    rng = random.Random(7)
    prompts = [chain([*SYSTEM, *(rng.randrange(50) for _ in range(rng.randrange(0, 60)))]) for _ in range(40)]
    index = KVIndex()
    truth: dict[str, set[int]] = {}
    for n in range(100):
        node = f"n{n}"
        held = truth.setdefault(node, set())
        for p in rng.sample(prompts, 5):
            cut = rng.randrange(len(p) + 1)
            index.store(node, p[:cut])
            held.update(p[:cut])
        dropped = rng.sample(sorted(held), min(3, len(held)))
        index.remove(node, dropped)
        held.difference_update(dropped)
    nodes = list(truth)
    for p in prompts:
        expected = {}
        for node in nodes:
            k = 0
            while k < len(p) and p[k] in truth[node]:
                k += 1
            expected[node] = k
        assert index.match(p, nodes) == expected
