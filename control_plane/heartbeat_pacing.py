"""How often nodes heartbeat, by fleet size, and the TTL the reaper may hold them to.

Even a cheap heartbeat (control_plane.node_lease) costs the control plane a request: 10,000
nodes at the configured 2 s would ask 5,000 a second, several cores of Python. So the
interval handed out grows with the fleet:

    interval = max(heartbeat_interval_s, live nodes / max_heartbeats_per_s)
    ttl      = interval * (node_ttl_s / heartbeat_interval_s)     (the configured ratio)

`max_heartbeats_per_s` is the rate the control plane is sized to take; with several replicas
behind one address, the sum of theirs. The live count is read from the database at most every
`REFRESH_S`, by each replica; a request never waits for it.

Nodes learn the interval from each HeartbeatAck and wait that long for the next one. A node
registers with the configured interval (NodeRegistered): a node of an older release never reads
the ack and keeps the interval of its registration for good, so that one must be the floor the
reaper's TTL never goes below, and it is.

The reaper's rule (hysteresis): it holds nodes to the largest TTL of any interval this
replica has handed out within that interval's own TTL, plus one refresh. When the fleet grows,
the TTL grows at once; when it shrinks, a node told the long interval at its last heartbeat
keeps the long TTL until it has been told the short one, because every interval it may be
following was handed out at most one TTL of it ago. Replicas read the same count, so each
one's history covers what the others handed out, up to one refresh apart (the `REFRESH_S` in
the hold). A replica that has just started knows only the fleet it sees; the reaper's start-up
grace (reaper_grace_s) covers the first pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.db.models import Node
from meridian.clock import Clock
from meridian.contracts import NodeStatus
from meridian.settings.control_plane import ControlPlaneSettings

if TYPE_CHECKING:
    from control_plane.context import AppContext

# How stale the live-node count may be (s). A fleet grows by registrations, which see a
# larger interval at most this late; the reaper's hold allows for it.
REFRESH_S = 5.0


@dataclass(frozen=True, slots=True)
class PacingPolicy:
    """The pure rule: which interval and TTL a fleet of a given size gets."""

    base_interval_s: float
    base_ttl_s: float
    max_heartbeats_per_s: float | None

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> PacingPolicy:
        return cls(settings.heartbeat_interval_s, settings.node_ttl_s, settings.max_heartbeats_per_s)

    def interval_s(self, live_nodes: int) -> float:
        if self.max_heartbeats_per_s is None:
            return self.base_interval_s
        return max(self.base_interval_s, live_nodes / self.max_heartbeats_per_s)

    def ttl_s(self, interval_s: float) -> float:
        return interval_s * self.base_ttl_s / self.base_interval_s


@dataclass(slots=True)
class _Held:
    interval_s: float
    until: float  # monotonic: the reaper honours interval_s until then


@dataclass
class HeartbeatPacer:
    """One replica's pacing: the live count it last read and the intervals it handed out."""

    policy: PacingPolicy
    clock: Clock
    live_nodes: int = 0
    _read_at: float | None = None
    _held: list[_Held] = field(default_factory=list)
    _refreshing: threading.Lock = field(default_factory=threading.Lock)

    def interval_s(self) -> float:
        """The interval to hand out now."""
        return self.policy.interval_s(self.live_nodes)

    def reaper_ttl_s(self) -> float:
        """The TTL the reaper may hold nodes to now (never below the configured node_ttl_s)."""
        now = self.clock.monotonic()
        longest = max([self.interval_s(), *(h.interval_s for h in self._held if h.until >= now)])
        return self.policy.ttl_s(longest)

    def observe(self, live_nodes: int) -> None:
        """Take a fresh live count; the interval it replaces is held for its TTL."""
        now = self.clock.monotonic()
        before = self.interval_s()
        self.live_nodes, self._read_at = live_nodes, now
        # A new list, not an edit: the reaper's thread reads the old one meanwhile.
        held = [h for h in self._held if h.until >= now]
        if self.interval_s() < before:
            held.append(_Held(before, now + self.policy.ttl_s(before) + REFRESH_S))
        self._held = held

    def due(self) -> bool:
        return self._read_at is None or self.clock.monotonic() - self._read_at >= REFRESH_S

    def refresh(self, sessions: sessionmaker[Session]) -> None:
        """Re-read the live count if it is older than REFRESH_S (one thread at a time;
        the others go on with the last count)."""
        if self.policy.max_heartbeats_per_s is None or not self.due():
            return
        if not self._refreshing.acquire(blocking=False):
            return
        try:
            if self.due():
                self.observe(count_live(sessions))
        finally:
            self._refreshing.release()


def effective_ttl_s(ctx: AppContext) -> float:
    """The TTL the reaper holds nodes to now (see the module's rule); refreshes the count."""
    ctx.pacer.refresh(ctx.read_sessions)
    return ctx.pacer.reaper_ttl_s()


def count_live(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Node).where(Node.status != NodeStatus.LOST.value)) or 0
