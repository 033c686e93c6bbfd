"""Node ejections shared at once by the workers of one router, through a HostRing.

A node one worker ejected, every worker skips: without that, each worker would send its own
`consecutive_failures_to_eject` requests into a failing node before it gave up on it, and a
node the prober found dead would keep getting the other workers' traffic. Each worker keeps
the InProcessFleetState rules and view (geo_router.state.health); what changes an ejection is
appended to the ring (geo_router.workers.host_ring), and a worker merges its siblings' news
before it reads a node's health or applies a failure:

- EJECTED (node, backoff level, until): the worker takes the later deadline and the higher
  level, so the next ejection anywhere continues the backoff;
- ANSWERED (node): a node that was ejected answered a request: its history is forgotten;
- UNEJECTED (node): the prober's healthy threshold ended the ejection early (level kept).

The max-ejected-percent cap counts the siblings' ejections too. What is not shared: failures
below the ejection threshold and in-flight counts, which are each worker's own (as they are
each router's with Redis). Deadlines are CLOCK_MONOTONIC, one clock for the host's processes.
With Redis set the workers use RedisFleetState instead (each a router of the fleet).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from pathlib import Path

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

from ..state.health import EjectionRules, FailureKind, InProcessFleetState, NodeHealth
from .host_ring import HostRing, RingReader

_MAX_NODE_BYTES = 128
# what happened, backoff level, until, node id length; then the node id
_HEAD = struct.Struct("<BIdB")
PAYLOAD_BYTES = _HEAD.size + _MAX_NODE_BYTES
DEFAULT_SLOTS = 1 << 10


class _News(IntEnum):
    EJECTED = 1
    ANSWERED = 2
    UNEJECTED = 3


def create_ring(path: Path, slots: int = DEFAULT_SLOTS) -> None:
    HostRing.create(path, slots, PAYLOAD_BYTES)


class HostFleetState(InProcessFleetState):
    """InProcessFleetState whose ejections every worker of the router shares at once."""

    def __init__(self, ring: HostRing, worker: int, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(settings.ejection_base_s, settings.ejection_max_s, clock,
                         consecutive_failures_to_eject=settings.consecutive_failures_to_eject,
                         max_ejected_percent=settings.max_ejected_percent)
        self._ring = RingReader(ring, worker)

    @classmethod
    def for_worker(cls, settings: RouterSettings, path: Path, worker: int,
                   clock: Clock = SYSTEM_CLOCK) -> HostFleetState:
        return cls(HostRing(path), worker, settings, clock)

    def ejected_for_s(self, node_id: str) -> float:
        self._catch_up()
        return super().ejected_for_s(node_id)

    def record_success(self, node_id: str) -> None:
        h = self._nodes.get(node_id)
        was_ejected = h is not None and h.ejections > 0
        super().record_success(node_id)
        if was_ejected:
            self._tell(_News.ANSWERED, node_id)

    def record_failure(self, node_id: str, kind: FailureKind = FailureKind.UNREACHABLE) -> float:
        self._catch_up()  # the cap counts what the siblings ejected
        duration = super().record_failure(node_id, kind)
        if duration > 0:
            h = self._nodes[node_id]
            self._tell(_News.EJECTED, node_id, h.ejections, h.ejected_until)
        return duration

    def uneject(self, node_id: str) -> bool:
        if not super().uneject(node_id):
            return False
        self._tell(_News.UNEJECTED, node_id)
        return True

    def _tell(self, news: _News, node_id: str, ejections: int = 0, until: float = 0.0) -> None:
        node = node_id.encode("utf-8")
        if len(node) <= _MAX_NODE_BYTES:
            self._ring.tell([_HEAD.pack(news, ejections, until, len(node)) + node])

    def _catch_up(self) -> None:
        for payload in self._ring.news():
            news, ejections, until, size = _HEAD.unpack_from(payload)
            node_id = payload[_HEAD.size:_HEAD.size + size].decode("utf-8")
            if news == _News.EJECTED:
                h = self._nodes.setdefault(node_id, NodeHealth())
                h.ejections = max(h.ejections, ejections)
                h.ejected_until = max(h.ejected_until, until)
                h.consecutive_failures = 0
                continue
            h = self._nodes.get(node_id)
            if h is None:
                continue
            if news == _News.ANSWERED:
                h.reset()
                self._forget_if_clean(node_id, h)
            else:
                EjectionRules.uneject(h, self._clock.monotonic())
