"""The exact KV-prefix index: what the nodes' events say they hold, and prefix matching."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict

import pytest

from geo_router.state.kv_index import KVIndex
from meridian.block_hash import hash_blocks
from meridian.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, medium_bit

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


class _Reference:
    """The index's semantics written plainly: per node, hash -> media bits, oldest first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.nodes: dict[str, OrderedDict[int, int]] = {}
        self.evicted = 0

    def store(self, node: str, hashes: list[int], medium: str) -> None:
        blocks = self.nodes.setdefault(node, OrderedDict())
        for h in hashes:
            blocks[h] = blocks.get(h, 0) | medium_bit(medium)
            blocks.move_to_end(h)
        while len(blocks) > self.cap:
            blocks.popitem(last=False)
            self.evicted += 1

    def remove(self, node: str, hashes: list[int], medium: str) -> None:
        blocks = self.nodes.get(node, OrderedDict())
        for h in hashes:
            if h in blocks:
                blocks[h] &= ~medium_bit(medium)
                if not blocks[h]:
                    del blocks[h]

    def match(self, chain: list[int], nodes: list[str]) -> dict[str, int]:
        out = {}
        for node in nodes:
            held, k = self.nodes.get(node, {}), 0
            while k < len(chain) and chain[k] in held:
                k += 1
            out[node] = k
        return out


@pytest.mark.parametrize(("nodes", "cap", "resets", "step"),
                         [(90, 40, 0.1, 1024), (6, 1000, 0.01, 1024), (6, 1000, 0.01, 3), (6, 200, 0.01, 2)])
def test_random_events_agree_with_the_plain_semantics_as_holders_grow_and_shrink(nodes: int, cap: int,
                                                                                resets: float, step: int) -> None:
    # 90 nodes sharing few prompts: a hash's holders go from one node to a tuple, to a
    # bitmask and back; 6 nodes: many events each and few resets, so stale copies pile up in
    # a node's store order and it is compacted; with a small compaction step a pass spans
    # many batches, so stores, removals, evictions at the cap and clears land mid-pass. With
    # media, re-stores, the cap, clears and nodes leaving mixed in.
    rng = random.Random(3)
    prompts = [[rng.getrandbits(63) for _ in range(12)] for _ in range(30)]
    index, ref = KVIndex(max_blocks_per_node=cap, compaction_step=step), _Reference(cap=cap)
    names = [f"n{i}" for i in range(nodes)]
    for step in range(3000):
        node, p = rng.choice(names), rng.choice(prompts)
        cut, medium = rng.randrange(1, len(p) + 1), rng.choice([MEDIUM_GPU, MEDIUM_GPU, MEDIUM_CPU])
        roll = rng.random()
        if roll < 0.55 - resets / 2:
            index.apply(node, [stored(p[:cut], medium=medium)])
            ref.store(node, p[:cut], medium)
        elif roll < 1 - resets:
            part = rng.sample(p, rng.randrange(1, len(p)))
            index.apply(node, [BlockRemoved(block_hashes=part, medium=medium)])
            ref.remove(node, part, medium)
        elif roll < 1 - resets / 2:
            index.apply(node, [AllBlocksCleared()])
            ref.nodes.get(node, OrderedDict()).clear()
        else:
            index.remove_node(node)
            ref.nodes.pop(node, None)
        if step % 50 == 0:
            asked = rng.sample(names, rng.choice([1, 5, nodes]))
            for chain in rng.sample(prompts, 5):
                assert index.match(chain, asked) == ref.match(chain, asked)
    stats = index.stats()
    assert stats.blocks == sum(len(b) for b in ref.nodes.values())
    assert stats.hashes == len(set().union(*ref.nodes.values()))
    assert stats.evicted == ref.evicted
    assert all(index.node_blocks(n) == len(b) for n, b in ref.nodes.items())


def test_memory_per_entry_stays_small_with_thousands_of_nodes() -> None:
    # A bitmask of holders per hash costs nodes/8 bytes: at 3,000 nodes each holding its own
    # blocks that was ~470 bytes an entry, growing with the fleet. Held by one node, a hash
    # costs its entry only (about 100-150 bytes here, the int included).
    rng = random.Random(1)
    tracemalloc.start()
    try:
        index = KVIndex()
        for n in range(3000):
            index.store(f"node-{n}", [rng.getrandbits(63) for _ in range(16)])
        per_entry = tracemalloc.get_traced_memory()[0] / index.stats().blocks
    finally:
        tracemalloc.stop()
    assert per_entry < 200


class _CountedHash(int):
    """A block hash that counts how often the index hashes it: each dict or set operation on a
    hash is one, so the count per call is the number of entries that call touched."""

    calls = 0

    def __hash__(self) -> int:
        _CountedHash.calls += 1
        return int.__hash__(self)


def test_a_batch_touches_a_bounded_number_of_entries_however_many_blocks_the_node_holds() -> None:
    # A cache evicts by last use, not store order, so removals land anywhere in a node's store
    # order. Compacting it in one go touched every entry under the lock that `match` needs
    # (tens of ms at the 150,000 blocks of a GPU node); a batch must touch a bounded number.
    rng = random.Random(5)
    blocks, batch = 30_000, 300
    index = KVIndex()
    live = [_CountedHash(rng.getrandbits(63)) for _ in range(blocks)]
    for i in range(0, blocks, 1000):
        index.apply("a", [stored(live[i:i + 1000])])
    worst = 0
    for _ in range(3 * blocks // batch):  # three times the node's blocks replaced: passes run
        gone = [live.pop(rng.randrange(len(live))) for _ in range(batch)]
        new = [_CountedHash(rng.getrandbits(63)) for _ in range(batch)]
        again = rng.sample(live, batch // 3)  # used again: stored again, so they become newest
        live.extend(new)
        _CountedHash.calls = 0
        index.apply("a", [BlockRemoved(block_hashes=gone, medium=MEDIUM_GPU), stored(new), stored(again)])
        worst = max(worst, _CountedHash.calls)
    assert index.node_blocks("a") == blocks
    assert index.match(live[-50:], ["a"]) == {"a": 50}
    # The batch's own hashes cost a few dict operations each; upkeep adds ~2 per stepped copy.
    assert worst < 10 * batch + 3 * 1024 + 4 * (batch + batch // 3) < blocks


def test_holders_name_the_nodes_of_the_longest_run_held_whoever_holds_it() -> None:
    index = KVIndex()
    index.store("alice-node", ALICE)
    index.store("bob-node", BOB)
    index.store("system-only", ALICE[:4])
    # ALICE's whole chain is held by one node; its first four blocks by three.
    assert index.holders(ALICE, limit=4) == ["alice-node"]
    assert sorted(index.holders(ALICE[:4], limit=4)) == ["alice-node", "bob-node", "system-only"]
    assert len(index.holders(ALICE[:4], limit=2)) == 2
    # A prompt that shares only the system prompt with what is cached: its holders.
    carol = chain([*SYSTEM, *range(400, 412)])
    assert sorted(index.holders(carol, limit=4)) == ["alice-node", "bob-node", "system-only"]
    assert index.holders(chain(list(range(900, 916))), limit=4) == [] and index.holders([], limit=4) == []
    # Past the tuple size the holders are a bitmask over node slots: still named, up to the limit.
    for i in range(40):
        index.store(f"n{i:02d}", ALICE[:4])
    assert len(index.holders(carol, limit=4)) == 4
    assert set(index.holders(carol, limit=100)) == {"alice-node", "bob-node", "system-only", *(f"n{i:02d}" for i in range(40))}
    index.remove("alice-node", ALICE[4:])
    assert index.holders(ALICE, limit=4)[0] in {"alice-node", "bob-node", "system-only"}
