"""vLLM's KV events re-keyed by Meridian's chained block hash (data_plane/engine/vllm/rehash.py):
the hashes a router computes from a request's prompt are the hashes the node publishes."""

from __future__ import annotations

from data_plane.engine.vllm.rehash import BlockRehasher, block_salt
from meridian.block_hash import hash_blocks
from meridian.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4
PROMPT = list(range(100, 112))  # three blocks of four


def stored(theirs: list[int], parent: int | None, tokens: list[int], *, lora: str | None = None,
           extra: list[object] | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(theirs, parent, tokens, BS, None, medium, lora, extra)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))  # type: ignore[arg-type]


def test_a_chain_stored_in_two_events_gets_the_routers_hashes_salt_and_adapter_included() -> None:
    r = BlockRehasher()
    # vLLM publishes the salt untagged after the adapter's name, on the first block only.
    first = r.translate(batch(stored([901, 902], None, PROMPT[:8], lora="sql", extra=[["sql", "s4lt"], ["sql"]])))
    second = r.translate(batch(stored([903], 902, PROMPT[8:], lora="sql", extra=[["sql"]])))
    expected = hash_blocks(PROMPT, BS, "sql", "s4lt")
    (a,), (b,) = first.events, second.events
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.block_hashes == expected[:2] and a.parent_block_hash is None
    assert b.block_hashes == expected[2:] and b.parent_block_hash == expected[1]
    assert a.token_ids == PROMPT[:8] and a.lora_name == "sql" and a.extra_keys is None
    # Another tenant's salt is another chain.
    assert hash_blocks(PROMPT, BS, "sql", "other")[0] not in a.block_hashes


def test_blocks_it_cannot_reproduce_are_left_out_never_guessed() -> None:
    r = BlockRehasher()
    # A parent stored before the relay listened: the whole event is unknown territory.
    assert r.translate(batch(stored([2], 1, PROMPT[:4]))).events == []
    # A multimodal block ends what can be matched from text, there and after it.
    out = r.translate(batch(stored([5, 6, 7], None, PROMPT, extra=[None, [["img", 0]], None])))
    (event,) = out.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == hash_blocks(PROMPT[:4], BS) and event.token_ids == PROMPT[:4]
    assert r.skipped == 1 + 2
    # Token ids that do not fill the blocks are malformed.
    assert r.translate(batch(BlockStored([8], None, [1, 2], BS, None, "GPU", None))).events == []


def test_removals_are_translated_and_a_block_is_kept_while_any_medium_holds_it() -> None:
    r = BlockRehasher()
    ours = hash_blocks(PROMPT[:4], BS)[0]
    r.translate(batch(stored([11], None, PROMPT[:4])))
    r.translate(batch(stored([11], None, PROMPT[:4], medium="CPU")))
    gpu_gone = r.translate(batch(BlockRemoved([11, 999], "GPU")))
    assert gpu_gone.events == [BlockRemoved([ours], "GPU")], "unknown hashes are dropped"
    cpu_gone = r.translate(batch(BlockRemoved([11], "CPU")))
    assert cpu_gone.events == [BlockRemoved([ours], "CPU")]
    assert len(r) == 0
    assert r.translate(batch(BlockRemoved([11], "GPU"))).events == []


def test_all_blocks_cleared_passes_and_forgets_the_map() -> None:
    r = BlockRehasher()
    r.translate(batch(stored([11], None, PROMPT[:4])))
    assert r.translate(batch(AllBlocksCleared())).events == [AllBlocksCleared()]
    assert len(r) == 0
    assert r.translate(batch(stored([12], 11, PROMPT[4:8]))).events == [], "its parent is forgotten"


def test_the_map_is_capped_oldest_first() -> None:
    r = BlockRehasher(max_blocks=2)
    for theirs, start in ((1, 0), (2, 4), (3, 8)):
        r.translate(batch(stored([theirs], None, PROMPT[start:start + 4])))
    assert len(r) == 2
    assert r.translate(batch(BlockRemoved([1], "GPU"))).events == []


def test_extra_keys_shapes() -> None:
    assert block_salt(None, None) == (True, None)
    assert block_salt(["salt"], None) == (True, "salt")
    assert block_salt(["sql", "salt"], "sql") == (True, "salt")
    assert block_salt(["sql"], "sql") == (True, None)
    assert block_salt([["mm", 0]], None) == (False, None)
    assert block_salt(["a", "b"], None) == (False, None)
