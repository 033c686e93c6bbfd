"""Which nodes look frozen, from the streams the router is relaying for them.

A frozen node (SIGSTOP, a hung GPU driver, a partition) keeps its connections open and
sends nothing. Probes eject it within seconds; until they do, a whole region's broken
streams would be resumed on its frozen siblings and each would wait out the inter-token
timeout a second time. A node is suspect when one of its streams stalled lately, or when
it has streams open and has sent nothing on any of them for half the inter-token timeout.
"""

from __future__ import annotations

import asyncio
import math

# A node one of whose streams stalled is passed over for this many inter-token timeouts.
SUSPECT_AFTER_STALL = 5


class SilenceWatch:
    """When each node last sent a migratable stream anything, and how many it has open."""

    def __init__(self, inter_token_timeout_s: float) -> None:
        self._timeout_s = inter_token_timeout_s
        self._heard_at: dict[str, float] = {}
        self._stalled_at: dict[str, float] = {}
        self._open: dict[str, int] = {}

    def heard(self, node_id: str, stalled: bool = False) -> None:
        """`node_id` sent something (or, `stalled`, one of its streams went silent too long)."""
        (self._stalled_at if stalled else self._heard_at)[node_id] = asyncio.get_running_loop().time()

    def is_suspect(self, node_id: str) -> bool:
        now = asyncio.get_running_loop().time()
        if now - self._stalled_at.get(node_id, -math.inf) < SUSPECT_AFTER_STALL * self._timeout_s:
            return True
        return self._open.get(node_id, 0) > 0 and now - self._heard_at.get(node_id, now) > self._timeout_s / 2

    def started(self, node_id: str) -> None:
        self._open[node_id] = self._open.get(node_id, 0) + 1
        self._heard_at.setdefault(node_id, asyncio.get_running_loop().time())

    def ended(self, node_id: str) -> None:
        left = self._open.get(node_id, 0) - 1
        if left > 0:
            self._open[node_id] = left
        else:
            self._open.pop(node_id, None)
