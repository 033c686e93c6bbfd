"""The paged KV cache's block pool and prefix cache: sharing, LRU eviction, events."""

from __future__ import annotations

from data_plane.engine.base import GenerationRequest
from data_plane.engine.kv_cache.block_pool import BlockPool
from data_plane.engine.kv_cache.manager import KVCacheManager
from data_plane.engine.sequence import Sequence
from meridian.block_hash import hash_block, hash_blocks
from meridian.kv_events import BlockRemoved, BlockStored

BS = 4


def seq(tokens: list[int], rid: str = "r", lora: str | None = None, salt: str | None = None) -> Sequence:
    req = GenerationRequest(rid, tokens, lora_name=lora, cache_salt=salt)
    return Sequence(request=req, arrival=0, token_ids=list(tokens))


def test_block_hashes_chain_over_parent_tokens_adapter_and_salt() -> None:
    tokens = list(range(12))
    hashes = hash_blocks(tokens, BS)
    assert len(hashes) == 3
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # Same block tokens under a different parent: a different hash.
    assert hash_blocks([9, 9, 9, 9] + tokens[4:8], BS)[1] != hashes[1]
    assert hash_blocks(tokens, BS, lora_name="a")[0] != hashes[0]
    salted = hash_blocks(tokens, BS, cache_salt="tenant-1")
    assert salted[0] != hashes[0] and salted[2] != hashes[2]
    # Incremental extension gives the same chain.
    assert hash_blocks(tokens + [1, 2, 3, 4], BS, start=hashes) == hash_blocks(tokens + [1, 2, 3, 4], BS)


def test_sequence_memory_waste_is_under_one_block() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    for n in (1, 4, 5, 17):
        s = seq(list(range(n)), rid=f"r{n}")
        assert kv.allocate(s, n)
        assert len(s.blocks) * BS - n < BS
        kv.free(s)


def test_full_blocks_are_shared_and_freed_ones_stay_cached_until_space_is_needed() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = seq(list(range(10)), "a")
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)  # blocks 0 and 1 are full
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(range(8))

    b = seq(list(range(8)) + [50, 51, 52], "b")
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [blk.block_id for blk in a.blocks[:2]]
    assert kv.allocate(b, 3, hits)
    assert b.num_computed_tokens == 8 and b.blocks[:2] == a.blocks[:2]
    assert a.blocks[0].ref_cnt == 2

    kv.free(a)
    kv.free(b)
    assert kv.usage() == 0.0
    # Nothing was evicted by freeing: a third request still hits both blocks.
    c = seq(list(range(9)), "c")
    assert len(kv.find_cached_prefix(c)) == 2
    assert not [e for e in kv.take_events() if isinstance(e, BlockRemoved)]

    # Filling the whole pool forces the cached blocks out, announced as BlockRemoved.
    d = seq(list(range(100, 124)), "d")
    assert kv.allocate(d, 24)
    removed = [h for e in kv.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hash_blocks(list(range(8)), BS))
    assert kv.find_cached_prefix(c) == []


def test_eviction_takes_empty_blocks_first_then_least_recently_freed() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(4)
    hashes = [11, 22, 33]
    pool.cache_blocks(blocks[:3], hashes, None, list(range(12)), None)
    pool.free([blocks[1]])   # cached, freed first
    pool.free([blocks[3]])   # empty
    pool.free([blocks[0]])   # cached, freed second
    pool.take_events()
    first = pool.allocate(1)[0]
    assert first is blocks[3] and pool.take_events() == []
    second = pool.allocate(1)[0]
    assert second is blocks[1]
    assert pool.take_events() == [BlockRemoved(block_hashes=[22], medium="GPU")]
    assert pool.lookup(11) is blocks[0] and pool.lookup(22) is None


def test_adapter_and_salt_isolate_cache_entries() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    base = seq(list(range(9)), "base")
    assert kv.allocate(base, 9)
    base.num_computed_tokens = 9
    kv.cache_computed_blocks(base)
    assert kv.find_cached_prefix(seq(list(range(9)), "lora", lora="a")) == []
    assert kv.find_cached_prefix(seq(list(range(9)), "salted", salt="t1")) == []
    assert len(kv.find_cached_prefix(seq(list(range(9)), "same"))) == 2


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = seq(list(range(8)), "a")
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    # Both blocks are cached, but the logits of token 8 are needed: only one block is reused.
    assert len(kv.find_cached_prefix(seq(list(range(8)), "b"))) == 1


def test_a_block_computed_twice_stays_cached_once_and_events_keep_their_parents() -> None:
    pool = BlockPool(8, BS)
    other = pool.allocate(1)
    pool.cache_blocks(other, [22], 11, list(range(4, 8)), None)
    pool.take_events()
    mine = pool.allocate(3)
    pool.cache_blocks(mine, [11, 22, 33], None, list(range(12)), "a")
    assert pool.lookup(22) is other[0] and mine[1].hash is None
    assert pool.take_events() == [
        BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=BS,
                    lora_id=None, medium="GPU", lora_name="a"),
        BlockStored(block_hashes=[33], parent_block_hash=22, token_ids=[8, 9, 10, 11], block_size=BS,
                    lora_id=None, medium="GPU", lora_name="a"),
    ]
