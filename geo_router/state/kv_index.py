"""The exact KV-prefix index: which block hashes each node's prefix cache holds, built from
the KV cache events the nodes publish (vLLM's format, meridian.kv_events).

`match(hashes, node_ids)` answers, for a request whose prompt hashes to the chain
`hashes` (meridian's chained block hash: each block's hash covers its parent's, so
equal hashes mean equal prefixes), how many leading blocks each node already holds.
It runs on every request, so it walks the chain once for all nodes together, one dict
lookup per matched block whatever the number of nodes: it keeps the candidates still
matching and intersects them with each block's holders, stopping when none is left.

Memory is linear in the blocks held (node x block entries), about 70-100 bytes each: the
hash (shared with the node's own list), its holders entry, and a slot in the node's store
order. A hash records its holders by how many there are, because most blocks of a fleet
are held by one node (a conversation lives where it was routed) and a few by very many
(system prompts): one holder is a reference to the node, up to _TUPLE_MAX a tuple of
them, and beyond that a bitmask over dense node slots (slots of removed nodes are reused
lowest first). A bitmask costs slots/8 bytes however many nodes share it, which is what
made the earlier all-bitmask index grow with nodes x nodes (680 bytes an entry at 10,000
nodes); past _TUPLE_MAX holders it costs under slots/(8 x _TUPLE_MAX) bytes per holder,
and it is what keeps the walk over widely shared blocks one AND per block. Media bits are
only stored for blocks held elsewhere than on the GPU alone.

Memory is bounded per node by `max_blocks_per_node`. A node never reports more blocks
than its KV cache (GPU plus offloaded tiers) holds, because its evictions arrive as
BlockRemoved, so the cap is a safety net against a misbehaving stream and should sit
above the largest node's capacity in blocks. When it is hit anyway, the node's oldest
stored blocks are forgotten first (counted in `stats().evicted`); storing a block again
makes it the newest. Forgetting a block the node still holds only makes the router
under-predict that node's hits.

Each node keeps its hashes in store order (the eviction order at the cap) in deques, 8 bytes
a copy: a re-store appends the hash again and a removal leaves it in place, the stale copies
counted per hash. A cache evicts by last use, not store order, so stale copies pile up in
the middle; once they outnumber the blocks held a compaction pass copies the order into a
new deque without them, at most _STEP copies (plus two per copy the batch appended) per
`apply`, so no batch holds the lock for the node's size (a rebuild in one go held it
55-250 ms at 150,000 blocks). A per-node dict in insertion order would need no compaction
but costs ~27 bytes an entry more than a list (35 against 8, measured) and its oldest-first
deletes leave dummies that `next(iter(d))` scans and a resize rebuilds (110 ms worst seen
at 150,000), so it was not taken. Still O(blocks of the node) under the lock: clearing or
removing a node, and an eviction at the cap that must step over a long run of stale copies
(a node at the cap is misbehaving; the cap stays exact).

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
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat

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

# Holders kept as a tuple of nodes up to this many; a bitmask over node slots beyond. A mask
# costs slots/8 bytes whoever holds the hash, so it only pays for itself past a few holders.
_TUPLE_MAX = 16
_GPU = medium_bit(MEDIUM_GPU)
# Copies of a node's store order that one batch's upkeep steps over or compacts (module
# docstring): about 1 ms of Python work on a loaded box, whatever the node's size.
_STEP = 1024
_UNLIMITED = 1 << 62
# bin() digits of a mask, lowest slot first, to 0/1 bytes for itertools.compress.
# Past this many nodes, candidate masks are built and read by C loops over all slots.
_FEW_BITS = 64
_BITS = bytes.maketrans(b"01", b"\x00\x01")
_DIGITS = bytes.maketrans(b"\x00\x01", b"01")


@dataclass(frozen=True, slots=True)
class KVIndexStats:
    """Sizes for metrics: nodes indexed, blocks summed over nodes, distinct hashes, and
    blocks forgotten because a node reached the cap."""

    nodes: int
    blocks: int
    hashes: int
    evicted: int


@dataclass(slots=True, eq=False)  # compared by identity: holder tuples test membership with `in`
class _Node:
    node_id: str
    slot: int
    # The hashes in store order, oldest first: the deques of `segs` one after the other; a
    # store appends to the last. A re-store appends the hash again and a removal leaves it in
    # place: those stale copies are counted in `stale` (the current copy of a held hash is its
    # last). While a compaction pass runs, segs is [done, *sources, new]: `sources` deques
    # being read from the left, `before` the stale counts of their copies when it began.
    segs: list[deque[ExternalBlockHash]] = field(default_factory=lambda: [deque()])
    live: int = 0
    stale: dict[ExternalBlockHash, int] = field(default_factory=dict)
    sources: int = 0
    before: dict[ExternalBlockHash, int] = field(default_factory=dict)
    # hash -> media bits, only for held blocks whose media are not exactly the GPU.
    media: dict[ExternalBlockHash, int] = field(default_factory=dict)
    block_size: int | None = None
    capped: bool = False


# Who holds a hash: one node, a tuple of 2.._TUPLE_MAX nodes, or a bitmask over node slots.
_Holders = _Node | tuple[_Node, ...] | int


def _has(held: _Holders, node: _Node) -> bool:
    if type(held) is int:
        return held >> node.slot & 1 == 1
    if type(held) is tuple:
        return node in held
    return held is node


def _members(held: _Node | tuple[_Node, ...]) -> tuple[_Node, ...]:
    return held if type(held) is tuple else (held,)  # type: ignore[return-value]


class KVIndex:
    """Per-node sets of the KV block hashes the nodes' events say they hold."""

    def __init__(self, max_blocks_per_node: int = 262_144, *, compaction_step: int = _STEP) -> None:
        if max_blocks_per_node < 1 or compaction_step < 1:
            raise ValueError("max_blocks_per_node and compaction_step must be >= 1")
        self._max_blocks = max_blocks_per_node
        # Store-order upkeep per batch, in copies (module docstring); tests make passes long.
        self._step = compaction_step
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[ExternalBlockHash, _Holders] = {}
        # slot -> node (and its id); freed slots are reused lowest first so masks stay short.
        self._slot_node: list[_Node | None] = []
        self._slot_id: list[str | None] = []
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._evicted = 0

    # --- events ------------------------------------------------------------------------

    def apply(self, node_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch of `node_id`'s events, in order."""
        with self._lock:
            appended = 0
            for event in events:
                if isinstance(event, BlockStored):
                    appended += self._store(node_id, event.block_hashes, event.block_size, event.medium)
                elif isinstance(event, BlockRemoved):
                    self._remove(node_id, event.block_hashes, event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(node_id)
            self._upkeep(node_id, appended)

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
            self._upkeep(node_id, self._store(node_id, hashes, block_size, medium))

    def remove(self, node_id: str, hashes: Iterable[ExternalBlockHash], *, medium: str | None = MEDIUM_GPU) -> None:
        """Record that `node_id` dropped `hashes` from `medium` (a BlockRemoved)."""
        with self._lock:
            self._remove(node_id, hashes, medium)
            self._upkeep(node_id, 0)

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
            self._slot_node[node.slot] = None
            self._slot_id[node.slot] = None
            del self._slot_of[node_id]
            heapq.heappush(self._free_slots, node.slot)

    # --- queries -----------------------------------------------------------------------

    def match(self, hashes: Sequence[ExternalBlockHash], node_ids: Iterable[str]) -> dict[str, int]:
        """For each of `node_ids`, how many leading blocks of the chain `hashes` it holds."""
        out = dict.fromkeys(node_ids, 0)
        with self._lock:
            held = self._holders.get(hashes[0]) if hashes else None
            if held is None:
                return out
            if type(held) is int:
                alive = held & self._mask_of(out)
                start, nodes = self._walk_mask(hashes, alive, out)
            else:
                start, nodes = 1, [n for n in _members(held) if n.node_id in out]  # type: ignore[arg-type]
            self._walk_nodes(hashes, start, nodes, out)
        return out

    def holders(self, hashes: Sequence[ExternalBlockHash], limit: int) -> list[str]:
        """Up to `limit` nodes holding the longest run of the chain `hashes` that any node holds.

        The deepest held block is found by bisection, O(log blocks) lookups whatever the fleet:
        a prefix cache holds a block's ancestors while it holds the block (vLLM evicts a
        sequence's blocks last one first), so "some node holds block i" holds for a prefix of
        the chain. Where it does not, the run found is shorter, never wrong: its holders hold it.
        """
        with self._lock:
            holders = self._holders
            if not hashes or limit < 1 or hashes[0] not in holders:
                return []
            lo, hi = 0, len(hashes) - 1  # block lo is held; past hi none is
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid] in holders:
                    lo = mid
                else:
                    hi = mid - 1
            return self._ids(holders[hashes[lo]], limit)

    def _ids(self, held: _Holders, limit: int) -> list[str]:
        if type(held) is not int:
            return [n.node_id for n in _members(held)[:limit]]  # type: ignore[arg-type]
        out: list[str] = []
        mask = held
        while mask and len(out) < limit:
            low = mask & -mask
            out.append(self._slot_id[low.bit_length() - 1])  # type: ignore[arg-type]
            mask ^= low
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
            return node.live if node is not None else 0

    def stats(self) -> KVIndexStats:
        with self._lock:
            return KVIndexStats(
                nodes=len(self._nodes),
                blocks=sum(n.live for n in self._nodes.values()),
                hashes=len(self._holders),
                evicted=self._evicted,
            )

    # --- matching (lock held) ----------------------------------------------------------

    def _mask_of(self, node_ids: dict[str, int]) -> int:
        """The slot bitmask of the known ones among `node_ids`."""
        slot_of = self._slot_of
        if len(node_ids) <= _FEW_BITS:
            mask = 0
            for node_id in node_ids:
                slot = slot_of.get(node_id)
                if slot is not None:
                    mask |= 1 << slot
            return mask
        # Many: OR-ing them one by one would copy a slots-long int per node, so write 0/1
        # digits by C loops (unknown ids land on a spare last digit) and parse them once.
        spare = len(self._slot_id)
        digits = bytearray(spare + 1)
        deque(map(digits.__setitem__, map(slot_of.get, node_ids, repeat(spare)), repeat(1)), maxlen=0)
        digits[spare] = 0
        return int(digits[::-1].translate(_DIGITS), 2)

    def _credit(self, out: dict[str, int], mask: int, blocks: int) -> None:
        """out[node] = blocks for every node in `mask`."""
        if mask.bit_count() <= _FEW_BITS:
            slot_id = self._slot_id
            while mask:
                low = mask & -mask
                out[slot_id[low.bit_length() - 1]] = blocks  # type: ignore[index]
                mask ^= low
            return
        # Many: one int operation per bit would copy the mask per bit; C loops find the bits.
        bits = bin(mask)[:1:-1].encode().translate(_BITS)
        out.update(zip(compress(self._slot_id, bits), repeat(blocks)))  # type: ignore[arg-type]

    def _walk_mask(self, hashes: Sequence[ExternalBlockHash], alive: int, out: dict[str, int]) -> tuple[int, list[_Node]]:
        """Walk the chain from block 1 while the holders are masks (widely shared blocks):
        AND them into `alive`. Returns where the walk of few nodes takes over, and its nodes."""
        holders = self._holders
        for i in range(1, len(hashes)):
            if not alive:
                return i, []
            held = holders.get(hashes[i])
            if type(held) is int:
                kept = held & alive
                if kept != alive:
                    self._credit(out, alive ^ kept, i)
                    alive = kept
                continue
            nodes = [] if held is None else [n for n in _members(held) if alive >> n.slot & 1]
            for n in nodes:
                alive ^= 1 << n.slot
            self._credit(out, alive, i)
            return i + 1, nodes
        self._credit(out, alive, len(hashes))
        return len(hashes), []

    def _walk_nodes(self, hashes: Sequence[ExternalBlockHash], start: int, nodes: list[_Node], out: dict[str, int]) -> None:
        """Walk the chain from `start` for a few nodes (at most _TUPLE_MAX), each tested alone."""
        holders = self._holders
        for i in range(start, len(hashes)):
            if not nodes:
                return
            held = holders.get(hashes[i])
            if held is None:
                kept = []
            elif len(nodes) == 1 and held is nodes[0]:  # a node's own conversation
                continue
            else:
                kept = [n for n in nodes if _has(held, n)]
                if len(kept) == len(nodes):
                    continue
            for n in nodes:
                if n not in kept:
                    out[n.node_id] = i
            nodes = kept
        for n in nodes:
            out[n.node_id] = len(hashes)

    # --- events (lock held) ------------------------------------------------------------

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = len(self._slot_node)
                self._slot_node.append(None)
                self._slot_id.append(None)
            node = self._nodes[node_id] = _Node(node_id, slot)
            self._slot_node[slot] = node
            self._slot_id[slot] = node_id
            self._slot_of[node_id] = slot
        return node

    def _store(
        self, node_id: str, hashes: Iterable[ExternalBlockHash], block_size: int | None, medium: str | None
    ) -> int:
        """Record a BlockStored; returns how many copies it appended to the node's store order."""
        node = self._node(node_id)
        if block_size:
            node.block_size = block_size
        mbit = medium_bit(medium)
        holders, media, stale, last = self._holders, node.media, node.stale, node.segs[-1]
        before = len(last)
        for h in hashes:
            held = holders.get(h)
            if held is None:
                holders[h] = node
            elif held is not node and not _has(held, node):
                holders[h] = self._with(held, node)
            else:  # held already: one more medium, and it becomes the newest
                was = media.get(h, _GPU)
                if was | mbit != was:
                    media[h] = was | mbit
                stale[h] = stale.get(h, 0) + 1
                last.append(h)
                continue
            if mbit != _GPU:
                media[h] = mbit
            last.append(h)
            node.live += 1
        appended = len(last) - before
        over = node.live - self._max_blocks
        if over > 0:
            self._evict(node, over)
        return appended

    def _evict(self, node: _Node, count: int) -> None:
        """Forget `node`'s `count` oldest blocks (it is over the cap). Exact, so it steps over
        every stale copy in front of them: unbounded only for a node at the cap."""
        left = count
        while left:
            self._settle_front(node, _UNLIMITED)
            h = node.segs[0].popleft()
            if self._consume_stale(node, h):
                continue
            self._unhold(h, node)
            node.media.pop(h, None)
            left -= 1
        node.live -= count
        self._evicted += count
        if not node.capped:
            node.capped = True
            log.warning(
                "KV index of node %s reached %d blocks; forgetting its oldest blocks "
                "(raise kv_index_max_blocks_per_node above the node's KV cache size)",
                node.node_id, self._max_blocks,
            )

    def _remove(self, node_id: str, hashes: Iterable[ExternalBlockHash], medium: str | None) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        mbit = medium_bit(medium)
        holders, media, stale = self._holders, node.media, node.stale
        for h in hashes:
            held = holders.get(h)
            if held is None or (held is not node and not _has(held, node)):
                continue
            was = media.get(h, _GPU)
            now = was & ~mbit
            if now == was:
                continue
            if now:
                if now == _GPU:
                    del media[h]
                else:
                    media[h] = now
                continue
            if was != _GPU:
                del media[h]
            self._unhold(h, node)
            stale[h] = stale.get(h, 0) + 1
            node.live -= 1

    def _clear(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        holders = self._holders
        for h in chain.from_iterable(node.segs):
            held = holders.get(h)
            if held is not None and (held is node or _has(held, node)):
                self._unhold(h, node)
        node.segs, node.live, node.sources = [deque()], 0, 0
        node.stale, node.before = {}, {}
        node.media.clear()

    # --- store-order upkeep (lock held) ------------------------------------------------

    def _upkeep(self, node_id: str, appended: int) -> None:
        """After a batch: step over stale copies at the front of the node's store order, then
        advance its compaction pass (or begin one once stale copies outnumber the blocks
        held), _step + 2 x `appended` copies at most: the pass ends within its sources'
        length / _step batches and copies appended meanwhile stay under half of that."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        budget = self._step + 2 * appended
        stale = node.stale
        while stale and budget > 0:  # a cache drops its oldest blocks first: O(1) per removal
            budget -= self._settle_front(node, budget)
            first = node.segs[0]
            if budget <= 0 or not first or not stale.get(first[0]):
                break
            self._consume_stale(node, first.popleft())
            budget -= 1
        if not node.sources:
            if sum(map(len, node.segs)) - node.live <= node.live + 64:
                return
            self._begin_pass(node)
        while budget > 0 and node.sources:
            self._pass_step(node)
            budget -= 1

    def _begin_pass(self, node: _Node) -> None:
        """Start copying the store order into a new deque without its stale copies. The stale
        counts so far go with the copies being read (`before`); stores go to a new last deque
        and count their stale copies afresh, which keeps both counts exact whatever happens
        to a hash during the pass: a copy already passed can only go stale afterwards."""
        sources = [seg for seg in node.segs if seg]
        node.segs = [deque(), *sources, deque()]
        node.sources = len(sources)
        node.before, node.stale = node.stale, {}

    def _pass_step(self, node: _Node) -> None:
        """Move the copy at the pass's cursor to `done`, unless it was stale when it began."""
        segs = node.segs
        source = segs[1]
        h = source.popleft()
        if not source:
            del segs[1]
            node.sources -= 1
        before = node.before
        n = before.get(h)
        if n:
            if n == 1:
                del before[h]
            else:
                before[h] = n - 1
        else:
            segs[0].append(h)
        if not node.sources and len(segs[1]) <= self._step:  # done: one deque again
            segs[0].extend(segs.pop())

    def _settle_front(self, node: _Node, limit: int) -> int:
        """Make `node.segs[0]` start with the oldest copy (not one a pass has still to read),
        in at most `limit` pass steps; returns the steps taken."""
        segs, steps = node.segs, 0
        while not segs[0] and steps < limit:
            if node.sources:
                self._pass_step(node)
                steps += 1
            elif len(segs) > 1:
                del segs[0]
            else:
                break
        return steps

    @staticmethod
    def _consume_stale(node: _Node, h: ExternalBlockHash) -> bool:
        """Whether the oldest copy of `h` (read from the front, not from a pass's sources) is
        a stale one, counted off if so: a held hash's current copy is its last."""
        stale = node.stale
        n = stale.get(h)
        if not n:
            return False
        if n == 1:
            del stale[h]
        else:
            stale[h] = n - 1
        return True

    # --- holders (lock held) -------------------------------------------------------------

    def _with(self, held: _Holders, node: _Node) -> _Holders:
        """`held` plus `node` (which is not in it)."""
        if type(held) is int:
            return held | 1 << node.slot
        if type(held) is not tuple:
            return (held, node)  # type: ignore[return-value]
        if len(held) < _TUPLE_MAX:
            return (*held, node)
        mask = 1 << node.slot
        for n in held:
            mask |= 1 << n.slot
        return mask

    def _unhold(self, h: ExternalBlockHash, node: _Node) -> None:
        """`node` no longer holds `h` (it did)."""
        held = self._holders[h]
        if held is node:
            del self._holders[h]
            return
        if type(held) is tuple:
            rest = tuple(n for n in held if n is not node)
        else:
            mask = held ^ (1 << node.slot)  # type: ignore[operator]
            if mask.bit_count() > _TUPLE_MAX // 2:
                self._holders[h] = mask
                return
            rest = tuple(self._slot_nodes(mask))
        self._holders[h] = rest[0] if len(rest) == 1 else rest

    def _slot_nodes(self, mask: int) -> Iterator[_Node]:
        bits = bin(mask)[:1:-1].encode().translate(_BITS)
        return compress(self._slot_node, bits)  # type: ignore[arg-type]
