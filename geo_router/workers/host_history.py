"""The prefix history shared at once by the workers of one router, through a HostRing.

Affinity (geo_router.selection.affinity) sends a conversation's next turn where its prefix went
(geo_router.state.prefix_history); with N workers the next turn may reach another worker, which
must know where the last one went. Redis shares that between routers a sync interval late
(RedisPrefixHistory); on one host the workers share it at once, without Redis on the path:
each worker keeps an InProcessPrefixHistory and answers `match` and `holders` from it, after
merging what its siblings appended to the ring (geo_router.workers.host_ring) since its
last look; `record` and `forget_node` append what is new.

So a record is visible to every worker by the next request any of them routes, and a worker
started to replace one that died begins with what the ring holds. Record times are
CLOCK_MONOTONIC deadlines, one clock for the host's processes. A node id longer than
_MAX_NODE_BYTES is kept by its own worker only (no real id is near that long).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from ..state.prefix_history import InProcessPrefixHistory
from .host_ring import HostRing, RingReader

_KEYS_PER_RECORD = 32
_MAX_NODE_BYTES = 128
# key count (-1: the node was forgotten), until, node id length; then the node id and keys
_HEAD = struct.Struct("<hdB")
_FORGET = -1
PAYLOAD_BYTES = _HEAD.size + _MAX_NODE_BYTES + 8 * _KEYS_PER_RECORD
DEFAULT_SLOTS = 1 << 13  # 8192 records of up to 32 keys; 3.3 MiB


def create_ring(path: Path, slots: int = DEFAULT_SLOTS) -> None:
    HostRing.create(path, slots, PAYLOAD_BYTES)


def _records(node: bytes, until: float, keys: Sequence[int] | None) -> list[bytes]:
    if keys is None:
        return [_HEAD.pack(_FORGET, until, len(node)) + node]
    return [
        _HEAD.pack(len(chunk), until, len(node)) + node + struct.pack(f"<{len(chunk)}Q", *chunk)
        for chunk in (keys[i:i + _KEYS_PER_RECORD] for i in range(0, len(keys), _KEYS_PER_RECORD))
    ]


def _decoded(payload: bytes) -> tuple[str, float, list[int] | None]:
    count, until, size = _HEAD.unpack_from(payload)
    node = payload[_HEAD.size:_HEAD.size + size].decode("utf-8")
    if count == _FORGET:
        return node, until, None
    return node, until, list(struct.unpack_from(f"<{count}Q", payload, _HEAD.size + size))


class HostPrefixHistory(InProcessPrefixHistory):
    """InProcessPrefixHistory that tells and hears the other workers of its router at once."""

    def __init__(self, ring: HostRing, worker: int, ttl_s: float, max_keys: int, *,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(ttl_s, max_keys, clock=clock)
        self._ring = RingReader(ring, worker)

    @classmethod
    def for_worker(cls, settings: RouterSettings, path: Path, worker: int, *,
                   clock: Clock = SYSTEM_CLOCK) -> HostPrefixHistory:
        return cls(HostRing(path), worker, settings.prefix_history_ttl_s, settings.prefix_history_max_keys,
                   clock=clock)

    async def stop(self) -> None:
        """The ring stays mapped until the process exits: a request still routing while the
        app stops still records where it went."""

    def record(self, node_id: str, keys: Sequence[int]) -> None:
        self._catch_up()
        fresh = self.record_fresh(node_id, keys)
        node = node_id.encode("utf-8")
        if fresh and len(node) <= _MAX_NODE_BYTES:
            self._ring.tell(_records(node, self._clock.monotonic() + self._ttl_s, fresh))

    def forget_node(self, node_id: str) -> None:
        super().forget_node(node_id)
        node = node_id.encode("utf-8")
        if len(node) <= _MAX_NODE_BYTES:
            self._ring.tell(_records(node, 0.0, None))

    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        self._catch_up()
        return super().match(keys, node_ids)

    def holders(self, keys: Sequence[int], limit: int) -> list[str]:
        self._catch_up()
        return super().holders(keys, limit)

    def _catch_up(self) -> None:
        for payload in self._ring.news():
            node_id, until, keys = _decoded(payload)
            if keys is None:
                super().forget_node(node_id)
            else:
                self.merge(node_id, keys, until)
