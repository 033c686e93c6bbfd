"""The approximate prefix index: which nodes this router (and, with Redis, every router) sent
a prompt prefix to lately, for nodes that publish no KV events.

Keys are a request's `text_keys` (geo_router.selection.prefix): chained, so holding key i means having
seen the whole prompt up to chunk i, and a match is a prefix walk that stops at a node's
first miss. A node is believed to hold a key for `ttl_s` after a request with it went there
(its cache may evict it sooner or keep it longer: this is a routing hint). The index is a
bounded LRU: at most `max_keys` keys, the least recently routed dropped first, at most
_MAX_NODES_PER_KEY nodes each. Forgetting a node is O(1): its entries carry an epoch that
a forget bumps, and stale ones age out of the LRU.

RedisPrefixHistory shares it between routers without putting Redis on the request path:
record and match are local and synchronous, and a background task appends this router's
new records to the stream `<prefix>prefix-history` every `sync_interval_s` and merges the
entries other routers appended since its last read. An entry is {r: router id, n: node id,
k: packed 8-byte keys} (or f: a forgotten node); a router publishes only keys that are new
for that node or were last published more than ttl/2 ago, so a shared system prompt costs
Redis one entry per node and half-TTL, not one per request. Redis memory stays bounded:
every append trims the stream to `stream_maxlen` entries and to entries younger than the
TTL (XTRIM MINID), and the stream key expires one TTL after the last append. Ages come
from stream ids (Redis's clock), so routers' clock skew does not matter. While Redis is
unreachable the router keeps its local history, holds back what it has to publish (bounded)
and logs once per 30 s.
"""

from __future__ import annotations

import logging
import math
import struct
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from .redis_sync import RedisMirror

log = logging.getLogger(__name__)

# More nodes than this holding one key tell a router nothing more about where to send it.
_MAX_NODES_PER_KEY = 16
# Keys per stream entry, entries per XRANGE page and pages per sync.
_KEYS_PER_ENTRY = 1024
_PAGE = 500
_MAX_PAGES_PER_SYNC = 40
_KEY = struct.Struct(">Q")
# The highest sequence number of a stream id: "(<ms-1>-<this>" reads everything from <ms>.
_MAX_SEQ = 2**64 - 1


class PrefixHistory(Protocol):
    """Where requests' prefix keys went: recorded after routing, matched before it."""

    def record(self, node_id: str, keys: Sequence[int]) -> None: ...

    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]: ...

    def holders(self, keys: Sequence[int], limit: int) -> list[str]: ...

    def forget_node(self, node_id: str) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class InProcessPrefixHistory:
    """PrefixHistory of this router alone: a bounded LRU of key -> nodes, with a TTL."""

    def __init__(
        self,
        ttl_s: float,
        max_keys: int,
        *,
        max_nodes_per_key: int = _MAX_NODES_PER_KEY,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_keys = max_keys
        self._max_nodes = max_nodes_per_key
        self._clock = clock
        # key -> node -> (believed held until, per clock.monotonic(); the node's epoch when recorded)
        self._entries: OrderedDict[int, dict[str, tuple[float, int]]] = OrderedDict()
        self._epochs: dict[str, int] = {}

    @classmethod
    def from_settings(
        cls, settings: RouterSettings, *, clock: Clock = SYSTEM_CLOCK
    ) -> InProcessPrefixHistory:
        return cls(settings.prefix_history_ttl_s, settings.prefix_history_max_keys, clock=clock)

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, node_id: str, keys: Sequence[int]) -> None:
        """`node_id` was sent a prompt with these keys (so it now holds them)."""
        self.record_fresh(node_id, keys)

    def record_fresh(self, node_id: str, keys: Sequence[int]) -> list[int]:
        """record(), returning the keys worth telling other routers: new for the node, or
        recorded more than half a TTL ago."""
        now = self._clock.monotonic()
        until = now + self._ttl_s
        epoch = self._epochs.get(node_id, 0)
        refresh_before = now + self._ttl_s / 2
        fresh: list[int] = []
        for key in keys:
            nodes = self._touch(key)
            held = nodes.get(node_id)
            if held is None or held[1] != epoch or held[0] <= refresh_before:
                fresh.append(key)
            nodes[node_id] = (until, epoch)
            self._bound(nodes, now)
        self._evict(now)
        return fresh

    def merge(self, node_id: str, keys: Sequence[int], until: float) -> None:
        """Another router's record: `node_id` holds these keys until `until` (per clock)."""
        now = self._clock.monotonic()
        if until <= now:
            return
        epoch = self._epochs.get(node_id, 0)
        for key in keys:
            nodes = self._touch(key)
            held = nodes.get(node_id)
            if held is None or held[1] != epoch or held[0] < until:
                nodes[node_id] = (until, epoch)
                self._bound(nodes, now)
        self._evict(now)

    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        """How many leading keys each node is believed to hold (0 for none)."""
        counts = dict.fromkeys(node_ids, 0)
        alive = list(counts)
        now = self._clock.monotonic()
        for i, key in enumerate(keys):
            nodes = self._entries.get(key)
            if nodes is None:
                break
            still = []
            for node_id in alive:
                held = nodes.get(node_id)
                if held is not None and held[0] > now and held[1] == self._epochs.get(node_id, 0):
                    counts[node_id] = i + 1
                    still.append(node_id)
            if not still:
                break
            alive = still
        return counts

    def holders(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` nodes believed to hold the longest run of leading `keys`, most
        recently sent first, whatever nodes a request's candidates are: where a bounded
        candidate set (geo_router.selection.candidates) finds a conversation's replica it left out.
        Keys are chained, so the deepest key with a live holder is found by bisection:
        O(log keys) lookups, each over at most max_nodes_per_key nodes."""
        now = self._clock.monotonic()
        lo, hi, found = 0, len(keys), []  # keys[:lo] held by someone, keys[hi:] by nobody
        while lo < hi:
            mid = (lo + hi) // 2
            live = self._live(keys[mid], now)
            if live:
                lo, found = mid + 1, live
            else:
                hi = mid
        found.sort(key=lambda held: -held[0])
        return [node_id for _until, node_id in found[:limit]]

    def _live(self, key: int, now: float) -> list[tuple[float, str]]:
        nodes = self._entries.get(key)
        if not nodes:
            return []
        return [(until, node_id) for node_id, (until, epoch) in nodes.items()
                if until > now and epoch == self._epochs.get(node_id, 0)]

    def forget_node(self, node_id: str) -> None:
        """The node's cache is gone (restarted, removed): it holds none of its keys."""
        self._epochs[node_id] = self._epochs.get(node_id, 0) + 1

    async def start(self) -> None:
        """Nothing to start: kept for the PrefixHistory lifecycle."""

    async def stop(self) -> None:
        """Nothing to stop: kept for the PrefixHistory lifecycle."""

    def _touch(self, key: int) -> dict[str, tuple[float, int]]:
        nodes = self._entries.get(key)
        if nodes is None:
            nodes = self._entries[key] = {}
        else:
            self._entries.move_to_end(key)
        return nodes

    def _bound(self, nodes: dict[str, tuple[float, int]], now: float) -> None:
        if len(nodes) <= self._max_nodes:
            return
        for node_id, (until, epoch) in list(nodes.items()):
            if until <= now or epoch != self._epochs.get(node_id, 0):
                del nodes[node_id]
        while len(nodes) > self._max_nodes:
            del nodes[min(nodes, key=lambda n: nodes[n][0])]

    def _evict(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self._max_keys:
            entries.popitem(last=False)
        # Least recently routed first: entries at the front whose every node expired are
        # dead weight (each key is dropped once, so this is amortised O(1) per record).
        while entries:
            oldest = next(iter(entries.values()))
            if any(until > now for until, _ in oldest.values()):
                break
            entries.popitem(last=False)


class RedisPrefixHistory(RedisMirror):
    """PrefixHistory shared by every router on the same Redis (see the module docstring)."""

    task_name = "prefix-history-sync"
    while_down = "routing history stays local to this router"
    once_back = "routing history is shared with the other routers"

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float,
        max_keys: int,
        stream_maxlen: int = 10_000,
        sync_interval_s: float = 0.5,
        timeout_s: float = 1.0,
        key_prefix: str = "meridian:router:",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # What the others recorded is of no use to a router that stops: the final flush is
        # the base's, a push.
        super().__init__(redis_url, timeout_s=timeout_s, sync_interval_s=sync_interval_s, clock=clock)
        self._local = InProcessPrefixHistory(ttl_s, max_keys, clock=clock)
        self._ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self._max_pending = max_keys
        self._maxlen = stream_maxlen
        self._stream = f"{key_prefix}prefix-history"
        self._router_id = uuid.uuid4().hex.encode()
        # What Redis has not seen yet, in order: (node, keys) records and (node, None) forgets.
        self._outbox: deque[tuple[str, list[int] | None]] = deque()
        self._pending_keys = 0
        self._last_id: bytes | None = None  # the last stream entry merged (or skipped)
        self._server_ms = 0  # Redis's clock at the last read, for trimming by age

    @classmethod
    def from_settings(
        cls, settings: RouterSettings, *, clock: Clock = SYSTEM_CLOCK
    ) -> RedisPrefixHistory:
        if not settings.redis_url:
            raise ValueError("RedisPrefixHistory needs settings.redis_url")
        return cls(
            settings.redis_url,
            ttl_s=settings.prefix_history_ttl_s,
            max_keys=settings.prefix_history_max_keys,
            stream_maxlen=settings.prefix_history_stream_maxlen,
            sync_interval_s=settings.fleet_sync_interval_s,
            timeout_s=settings.redis_timeout_s,
            key_prefix=settings.fleet_key_prefix,
            clock=clock,
        )

    # --- PrefixHistory: local and synchronous, never touches Redis -------------------------

    def record(self, node_id: str, keys: Sequence[int]) -> None:
        fresh = self._local.record_fresh(node_id, keys)
        if fresh:
            self._enqueue(node_id, fresh)

    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        return self._local.match(keys, node_ids)

    def holders(self, keys: Sequence[int], limit: int) -> list[str]:
        return self._local.holders(keys, limit)

    def forget_node(self, node_id: str) -> None:
        self._local.forget_node(node_id)
        self._enqueue(node_id, None)

    def __len__(self) -> int:
        return len(self._local)

    # --- background sync -------------------------------------------------------------------

    def _enqueue(self, node_id: str, keys: list[int] | None) -> None:
        self._outbox.append((node_id, keys))
        self._pending_keys += len(keys) if keys else 1
        self._bound_outbox()

    def _bound_outbox(self) -> None:
        # Redis has been away a while: the oldest records are the least worth sharing.
        while self._pending_keys > self._max_pending and len(self._outbox) > 1:
            _, dropped = self._outbox.popleft()
            self._pending_keys -= len(dropped) if dropped else 1

    def _entries(self, batch: Sequence[tuple[str, list[int] | None]]) -> list[dict[bytes, bytes]]:
        """Stream entries for a batch: one record per node between forgets, in order."""
        out: list[dict[bytes, bytes]] = []
        merged: dict[str, dict[int, None]] = {}

        def flush() -> None:
            for node_id, keys in merged.items():
                ordered = list(keys)
                for i in range(0, len(ordered), _KEYS_PER_ENTRY):
                    packed = b"".join(_KEY.pack(k) for k in ordered[i:i + _KEYS_PER_ENTRY])
                    out.append({b"r": self._router_id, b"n": node_id.encode(), b"k": packed})
            merged.clear()

        for node_id, keys in batch:
            if keys is None:
                flush()
                out.append({b"r": self._router_id, b"n": node_id.encode(), b"f": b"1"})
            else:
                merged.setdefault(node_id, {}).update(dict.fromkeys(keys))
        flush()
        return out

    async def _push(self) -> None:
        if not self._outbox:
            return
        # Records made while the pipeline is in flight queue up behind this batch.
        batch, batch_keys = self._outbox, self._pending_keys
        self._outbox, self._pending_keys = deque(), 0
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for fields in self._entries(batch):
                    pipe.xadd(self._stream, fields, maxlen=self._maxlen, approximate=True)
                if self._server_ms:
                    pipe.xtrim(self._stream, minid=f"{self._server_ms - self._ttl_ms}-0", approximate=True)
                pipe.pexpire(self._stream, self._ttl_ms)
                await pipe.execute()
        except BaseException:
            batch.extend(self._outbox)
            self._outbox, self._pending_keys = batch, batch_keys + self._pending_keys
            self._bound_outbox()
            raise

    async def _pull(self) -> None:
        for _ in range(_MAX_PAGES_PER_SYNC):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.time()
                if self._last_id is None:
                    pipe.xrange(self._stream, min="-", max="+", count=_PAGE)
                else:
                    pipe.xrange(self._stream, min=b"(" + self._last_id, max="+", count=_PAGE)
                (seconds, micros), page = await pipe.execute()
            now_ms = seconds * 1000 + micros // 1000
            self._server_ms = now_ms
            if self._last_id is None and not page:
                # Nothing yet: start right before now, so no later entry can be missed.
                self._last_id = f"{now_ms - 1}-{_MAX_SEQ}".encode()
            self._merge(page, now_ms)
            if len(page) < _PAGE:
                return

    def _merge(self, page: Sequence[tuple[bytes, dict[bytes, bytes]]], now_ms: int) -> None:
        local_now = self._clock.monotonic()
        for entry_id, fields in page:
            self._last_id = entry_id
            entry_ms = int(entry_id.split(b"-", 1)[0])
            if fields.get(b"r") == self._router_id:
                continue
            node = fields.get(b"n")
            if not node:
                continue
            node_id = node.decode(errors="replace")
            if b"f" in fields:
                self._local.forget_node(node_id)
                continue
            packed = fields.get(b"k", b"")
            left_s = (self._ttl_ms - max(0, now_ms - entry_ms)) / 1000
            if left_s <= 0 or len(packed) % _KEY.size:
                continue
            keys = [k for (k,) in _KEY.iter_unpack(packed)]
            self._local.merge(node_id, keys, local_now + left_s)
