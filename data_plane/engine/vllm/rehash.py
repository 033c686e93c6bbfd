"""vLLM's KV events, re-keyed by Meridian's chained block hash of the same tokens.

vLLM names its blocks by its own hash (another function and seed: sha256 of a pickled
tuple, or xxhash), which a router computing from the request never equals. Its
BlockStored events carry each block's token ids, its parent and its extra keys (LoRA
name, cache salt), so the node re-keys every stored block with meridian.block_hash,
which the router computes from a request's prompt (geo_router.selection.prefix): the routers'
exact index then matches vLLM nodes precisely, as it matches torch-engine nodes, and
sees their evictions, which the approximate routing history cannot.

Doing it on the node, not in each router, keeps one hash space on the wire whatever the
engine, and the map from vLLM's hashes to ours (needed to translate BlockRemoved, which
carries hashes only) is kept once per node instead of once per router and node.

What cannot be reproduced from the event is left out, which only ever makes the router
under-state what a node holds: a block whose parent the map does not know (stored
before the relay listened, or forgotten at the cap), a block with multimodal or
prompt-embedding keys (the router hashes text), and everything after such a block in
its chain. The map keeps a block until no storage medium holds it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from meridian.block_hash import hash_block
from meridian.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    medium_bit,
)

log = logging.getLogger(__name__)

# Far above any KV cache's block count; past it the oldest mappings go first.
DEFAULT_MAX_BLOCKS = 4_000_000


@dataclass(slots=True)
class _Mapped:
    ours: int
    media: int


def block_salt(keys: object, lora_name: str | None) -> tuple[bool, str | None]:
    """(reproducible, cache salt) of one block's extra keys as vLLM publishes them: the
    LoRA name first when the event has one, then multimodal pairs, the salt, prompt-
    embedding digests. Anything but one salt string is not reproducible from text."""
    if keys is None:
        return True, None
    if not isinstance(keys, list | tuple):
        return False, None
    items = list(keys)
    if lora_name is not None and items and items[0] == lora_name:
        items.pop(0)
    if not items:
        return True, None
    if len(items) == 1 and isinstance(items[0], str):
        return True, items[0]
    return False, None


class BlockRehasher:
    """Translates vLLM's event batches into batches keyed by Meridian's block hashes.

    Used from the relay's thread only (not thread-safe).
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self._max_blocks = max_blocks
        self._map: OrderedDict[ExternalBlockHash, _Mapped] = OrderedDict()
        # Blocks left out because they could not be reproduced (metrics, tests).
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._map)

    def translate(self, batch: KVEventBatch) -> KVEventBatch:
        events: list[KVEvent] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
                if stored is not None:
                    events.append(stored)
            elif isinstance(event, BlockRemoved):
                removed = self._removed(event)
                if removed is not None:
                    events.append(removed)
            else:
                self._map.clear()
                events.append(AllBlocksCleared())
        return KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)

    def clear(self) -> None:
        self._map.clear()

    def _stored(self, event: BlockStored) -> BlockStored | None:
        size = event.block_size
        tokens = event.token_ids
        if size < 1 or len(tokens) != size * len(event.block_hashes):
            self.skipped += len(event.block_hashes)
            return None
        parent: int | None = None
        if event.parent_block_hash is not None:
            known = self._map.get(event.parent_block_hash)
            if known is None:
                self.skipped += len(event.block_hashes)
                return None
            parent = known.ours
        first_parent = parent
        extra = event.extra_keys or []
        bit = medium_bit(event.medium)
        ours: list[int] = []
        for i, theirs in enumerate(event.block_hashes):
            reproducible, salt = block_salt(extra[i] if i < len(extra) else None, event.lora_name)
            if not reproducible:
                self.skipped += len(event.block_hashes) - i
                break
            # The salt keys only a chain's first block, in vLLM as in meridian.block_hash.
            h = hash_block(parent, tokens[i * size:(i + 1) * size], event.lora_name,
                           salt if parent is None else None)
            self._remember(theirs, h, bit)
            ours.append(h)
            parent = h
        if not ours:
            return None
        return BlockStored(
            block_hashes=ours, parent_block_hash=first_parent, token_ids=tokens[:len(ours) * size],
            block_size=size, lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name,
        )

    def _removed(self, event: BlockRemoved) -> BlockRemoved | None:
        bit = medium_bit(event.medium)
        ours: list[ExternalBlockHash] = []
        for theirs in event.block_hashes:
            mapped = self._map.get(theirs)
            if mapped is None:
                continue
            ours.append(mapped.ours)
            mapped.media &= ~bit
            if not mapped.media:
                del self._map[theirs]
        return BlockRemoved(block_hashes=ours, medium=event.medium) if ours else None

    def _remember(self, theirs: ExternalBlockHash, ours: int, bit: int) -> None:
        mapped = self._map.get(theirs)
        if mapped is not None:
            mapped.media |= bit
            self._map.move_to_end(theirs)
            return
        self._map[theirs] = _Mapped(ours, bit)
        if len(self._map) > self._max_blocks:
            self._map.popitem(last=False)
