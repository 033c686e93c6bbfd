"""Per-sequence view of the paged KV cache: block tables, prefix-cache lookups and the
bookkeeping that turns full blocks into cache entries."""

from __future__ import annotations

from data_plane.engine.kv_cache.block_pool import Block, BlockPool
from data_plane.engine.sequence import Sequence
from meridian.block_hash import hash_blocks
from meridian.kv_events import KVEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool; called only from the engine's worker thread."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_caching)
        self.enable_caching = enable_caching
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _hashes(self, seq: Sequence) -> list[int]:
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = hash_blocks(
                seq.token_ids, self.block_size, seq.lora_name, seq.request.cache_salt,
                start=seq.block_hashes,
            )
        return seq.block_hashes

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of leading full blocks already in the cache.

        At least one token is always left to compute: the last prompt token must run
        through the model for its logits to be sampled from.
        """
        if not self.enable_caching:
            return []
        hits: list[Block] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for h in self._hashes(seq)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, seq: Sequence, hit_tokens: int) -> None:
        """Count a first admission's lookup in tokens, as vLLM's prefix-cache counters do."""
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += hit_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[Block] | None = None) -> bool:
        """Append `hits` to the block table and make room for `num_new_tokens` more tokens.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        hits = hits or []
        needed = self._blocks_needed(seq, num_new_tokens, hits)
        if needed > self._free_after_touch(hits):
            return False
        if hits:
            self.pool.touch(hits)
            seq.blocks.extend(hits)
            seq.num_computed_tokens += len(hits) * self.block_size
            seq.num_cached_blocks = len(seq.blocks)
        if needed > 0:
            seq.blocks.extend(self.pool.allocate(needed))
        return True

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[Block]) -> int:
        total = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(seq.blocks) - len(hits))

    def _free_after_touch(self, hits: list[Block]) -> int:
        # A hit on a free cached block takes it out of the free pool.
        return self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed KV since the last call."""
        if not self.enable_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_cached_blocks
        if full <= start:
            return
        hashes = self._hashes(seq)
        bs = self.block_size
        self.pool.cache_blocks(
            seq.blocks[start:full],
            hashes[start:full],
            hashes[start - 1] if start > 0 else None,
            seq.token_ids[start * bs:full * bs],
            seq.lora_name,
        )
        seq.num_cached_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (tail first) and reset it to recompute from scratch."""
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

