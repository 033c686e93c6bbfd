"""The exact KV-prefix index: which block hashes each node's prefix cache holds, built from
the KV cache events the nodes publish (vLLM's format, meridian.kv_events).

`match(hashes, node_ids)` answers, for a request whose prompt hashes to the chain
`hashes` (meridian's chained block hash: each block's hash covers its parent's, so
equal hashes mean equal prefixes), how many leading blocks each node already holds.
It runs on every request, so it walks the chain once for all nodes together: every
node has a bit, every hash maps to the bitmask of the nodes holding it, and the walk
ANDs the masks until no node is left, crediting each node with the position where its
bit dropped out. A request costs one dict lookup per matched block, whatever the
number of nodes.

Memory is bounded per node by `max_blocks_per_node`. A node never reports more blocks
than its KV cache (GPU plus offloaded tiers) holds, because its evictions arrive as
BlockRemoved, so the cap is a safety net against a misbehaving stream and should sit
above the largest node's capacity in blocks. When it is hit anyway, the node's oldest
stored blocks are forgotten first (counted in `stats().evicted`). Forgetting a block
the node still holds only makes the router under-predict that node's hits.

A block stored on several media (GPU, CPU offload...) counts as held until it has been
removed from all of them; a BlockRemoved without a medium means the GPU, as in vLLM.

Every node publishes Meridian's chained hash, which the router computes from the request:
torch-engine nodes natively, vLLM nodes because the node re-keys vLLM's events from the
token ids they carry (data_plane/engine/vllm/rehash.py). Nodes may differ in block size
(vLLM's CPU build uses 128, GPU backends 16); `block_size(node)` is what the node's own
events said, and the router hashes the prompt once per size among the candidates.

Thread safety: every method takes one internal lock, held for one batch of events or
one match. The event subscriber applies events from its own thread while the event loop
matches, and neither waits for more than that.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meridian.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    medium_bit,
)

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class KVIndexStats:
    """Sizes for metrics: nodes indexed, blocks summed over nodes, distinct hashes, and
    blocks forgotten because a node reached the cap."""

    nodes: int
    blocks: int
    hashes: int
    evicted: int


@dataclass(slots=True)
class _Node:
    bit: int
    # hash -> media bits, oldest stored first (the eviction order at the cap).
    blocks: OrderedDict[ExternalBlockHash, int] = field(default_factory=OrderedDict)
    block_size: int | None = None
    capped: bool = False


class KVIndex:
    """Per-node sets of the KV block hashes the nodes' events say they hold."""

    def __init__(self, max_blocks_per_node: int = 262_144) -> None:
        if max_blocks_per_node < 1:
            raise ValueError("max_blocks_per_node must be >= 1")
        self._max_blocks = max_blocks_per_node
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        # hash -> bitmask of the nodes holding it.
        self._holders: dict[ExternalBlockHash, int] = {}
        # slot -> node id; freed slots are reused lowest first so masks stay small ints.
        self._slot_node: list[str | None] = []
        self._free_slots: list[int] = []
        self._evicted = 0

    # --- events ------------------------------------------------------------------------

    def apply(self, node_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch of `node_id`'s events, in order."""
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(node_id, event.block_hashes, event.block_size, event.medium)
                elif isinstance(event, BlockRemoved):
                    self._remove(node_id, event.block_hashes, event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(node_id)

    def store(
        self,
        node_id: str,
        hashes: Iterable[ExternalBlockHash],
        *,
        block_size: int | None = None,
        medium: str | None = MEDIUM_GPU,
    ) -> None:
        """Record that `node_id` holds `hashes` (a BlockStored)."""
        with self._lock:
            self._store(node_id, hashes, block_size, medium)

    def remove(self, node_id: str, hashes: Iterable[ExternalBlockHash], *, medium: str | None = MEDIUM_GPU) -> None:
        """Record that `node_id` dropped `hashes` from `medium` (a BlockRemoved)."""
        with self._lock:
            self._remove(node_id, hashes, medium)

    def clear_node(self, node_id: str) -> None:
        """Forget every block of `node_id` but keep the node (AllBlocksCleared, or events lost)."""
        with self._lock:
            self._clear(node_id)

    def remove_node(self, node_id: str) -> None:
        """Forget `node_id` altogether (it left the routing table)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return
            self._clear(node_id)
            del self._nodes[node_id]
            slot = node.bit.bit_length() - 1
            self._slot_node[slot] = None
            heapq.heappush(self._free_slots, slot)

    # --- queries -----------------------------------------------------------------------

    def match(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        """For each of `node_ids`, how many leading blocks of the chain `hashes` it holds."""
        out: dict[str, int] = {}
        with self._lock:
            alive = 0
            for node_id in node_ids:
                out[node_id] = 0
                node = self._nodes.get(node_id)
                if node is not None:
                    alive |= node.bit
            if not alive:
                return out
            holders = self._holders
            for i, h in enumerate(hashes):
                held = holders.get(h, 0) & alive
                if held != alive:
                    self._credit(out, alive & ~held, i)
                    alive = held
                    if not alive:
                        return out
            self._credit(out, alive, len(hashes))
        return out

    def nodes(self) -> list[str]:
        """Nodes the index has events from (cleared ones included)."""
        with self._lock:
            return list(self._nodes)

    def block_size(self, node_id: str) -> int | None:
        """The block size `node_id`'s last BlockStored announced, None before any."""
        with self._lock:
            node = self._nodes.get(node_id)
            return node.block_size if node is not None else None

    def node_blocks(self, node_id: str) -> int:
        """How many blocks `node_id` is believed to hold."""
        with self._lock:
            node = self._nodes.get(node_id)
            return len(node.blocks) if node is not None else 0

    def stats(self) -> KVIndexStats:
        with self._lock:
            return KVIndexStats(
                nodes=len(self._nodes),
                blocks=sum(len(n.blocks) for n in self._nodes.values()),
                hashes=len(self._holders),
                evicted=self._evicted,
            )

    # --- internals (lock held) ---------------------------------------------------------

    def _credit(self, out: dict[str, int], mask: int, blocks: int) -> None:
        while mask:
            low = mask & -mask
            node_id = self._slot_node[low.bit_length() - 1]
            if node_id is not None:
                out[node_id] = blocks
            mask ^= low

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
                self._slot_node[slot] = node_id
            else:
                slot = len(self._slot_node)
                self._slot_node.append(node_id)
            node = self._nodes[node_id] = _Node(bit=1 << slot)
        return node

    def _store(
        self, node_id: str, hashes: Iterable[ExternalBlockHash], block_size: int | None, medium: str | None
    ) -> None:
        node = self._node(node_id)
        if block_size:
            node.block_size = block_size
        mbit = medium_bit(medium)
        blocks, holders, bit = node.blocks, self._holders, node.bit
        for h in hashes:
            media = blocks.get(h)
            if media is None:
                blocks[h] = mbit
                holders[h] = holders.get(h, 0) | bit
            else:
                blocks[h] = media | mbit
                blocks.move_to_end(h)
        over = len(blocks) - self._max_blocks
        if over > 0:
            for _ in range(over):
                h, _media = blocks.popitem(last=False)
                self._unhold(h, bit)
            self._evicted += over
            if not node.capped:
                node.capped = True
                log.warning(
                    "KV index of node %s reached %d blocks; forgetting its oldest blocks "
                    "(raise kv_index_max_blocks_per_node above the node's KV cache size)",
                    node_id, self._max_blocks,
                )

    def _remove(self, node_id: str, hashes: Iterable[ExternalBlockHash], medium: str | None) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        keep = ~medium_bit(medium)
        blocks = node.blocks
        for h in hashes:
            media = blocks.get(h)
            if media is None:
                continue
            media &= keep
            if media:
                blocks[h] = media
            else:
                del blocks[h]
                self._unhold(h, node.bit)

    def _clear(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        for h in node.blocks:
            self._unhold(h, node.bit)
        node.blocks.clear()

    def _unhold(self, h: ExternalBlockHash, bit: int) -> None:
        rest = self._holders.get(h, 0) & ~bit
        if rest:
            self._holders[h] = rest
        else:
            self._holders.pop(h, None)
