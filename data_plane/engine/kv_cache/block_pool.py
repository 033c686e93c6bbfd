"""The paged KV cache's blocks: a fixed pool, reference counts, a prefix-cache index and
an LRU of free blocks whose content may still be reused.

A block is in exactly one of three states: in use (ref_cnt > 0), free and cached (its
hash is still in the index, so a later request with the same prefix can take it back),
or free and empty. Free blocks are handed out empty ones first, then cached ones in
least-recently-freed order; a cached block is evicted only at that moment, when the
space is really needed, and that eviction is published as a BlockRemoved event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from meridian.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free (callers check num_free first)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 medium: str = MEDIUM_GPU) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.medium = medium
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Eviction order: first entry is handed out first. Empty blocks sit at the front,
        # cached ones are appended at the back as they are freed (LRU).
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self._events: list[KVEvent] = []

    # --- queries -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or evictable cached ones)."""
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, vLLM's kv_cache_usage_perc (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    # --- allocation ------------------------------------------------------------------

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """n blocks for new tokens, evicting least-recently-used cached blocks if needed."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[Block] = []
        evicted: list[int] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.hash is not None:
                evicted.append(block.hash)
                del self._cached[block.hash]
                block.hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; pass them tail first so that, of one
        sequence's blocks, the last ones are evicted before its shared prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            self._free[block.block_id] = block
            if block.hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def cache_blocks(
        self,
        blocks: list[Block],
        hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
        lora_name: str | None,
    ) -> None:
        """Register newly full blocks under their hashes and announce them."""
        if not self.enable_caching or not blocks:
            return
        # One BlockStored per run of consecutive newly cached blocks. Blocks already cached,
        # or computed concurrently by another sequence (the first copy stays cached), are skipped.
        run_start: int | None = None
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            new = block.hash is None and h not in self._cached
            if new:
                block.hash = h
                self._cached[h] = block
                if run_start is None:
                    run_start = i
            if run_start is not None and (not new or i == len(blocks) - 1):
                end = i + 1 if new else i
                bs = self.block_size
                self._events.append(BlockStored(
                    block_hashes=hashes[run_start:end],
                    parent_block_hash=hashes[run_start - 1] if run_start > 0 else parent_hash,
                    token_ids=token_ids[run_start * bs:end * bs], block_size=bs, lora_id=None,
                    medium=self.medium, lora_name=lora_name,
                ))
                run_start = None

    def take_events(self) -> list[KVEvent]:
        """Events since the previous call, oldest first."""
        events, self._events = self._events, []
        return events
