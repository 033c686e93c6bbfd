"""What this router knows about node health and load: outlier ejection and in-flight counts.

Passive outlier detection after Envoy's, fed by the proxy and the active prober:

- a node that cannot be reached (connection refused, connect timeout) is ejected at once:
  nothing is listening, and every request sent there would fail the same way;
- a 5xx, a timeout or a stream broken mid-way ejects it after `consecutive_failures_to_eject`
  of them in a row (Envoy's consecutive_5xx, default 5), since one such failure may be the
  request's own doing; any answered request resets the count;
- the prober (geo_router.state.probe) ejects at once, having applied its own threshold;
- a 4xx is the client's fault, never the node's: it is not reported as a failure.

An ejection lasts `ejection_base_s`, doubling with each ejection since the node last answered
a request, up to `ejection_max_s`. Failures of requests reported while the node is ejected
(sent before it was) neither extend nor escalate it. A probe that fails while the node is
ejected was sent during the ejection, so it is news: it keeps the node out for at least
`ejection_base_s` from then (no escalation, no listener told), and a node whose probes keep
failing stays out rather than coming back, for the gap until the next probe, at each
ejection's end (Envoy's active health checking: unhealthy until probes pass). One answered
request clears the node's record;
`uneject` (the prober's healthy threshold) ends an ejection early but keeps the backoff level,
since a node that answers probes has not yet shown it answers requests.

Ejections never take more than `max_ejected_percent` of the known nodes (the routing table's
READY nodes, given by `set_known_nodes`) out of service, nor of the known nodes of any
residency zone the node serves: a zoned tenant can only use its zone's nodes, so a cap over
the whole fleet let a two-node zone be ejected whole while its tenants had nowhere else to
go. One node of each may always be ejected (Envoy's rule); at a cap a failure is counted
but not enforced, and listeners hear of it as an `Ejection` with `enforced=False`. Reads
are synchronous on purpose: selection runs on every request, so a shared implementation
(Redis, several routers) keeps a local view and syncs it in the background.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.router import RouterSettings

log = logging.getLogger(__name__)

# At most one "max ejected percent reached" warning per this many seconds.
_CAP_WARN_EVERY_S = 10.0


class FailureKind(StrEnum):
    """Why a node failed, which decides how soon it is ejected."""

    UNREACHABLE = "unreachable"  # connect refused / timed out: ejected at once
    ERROR = "error"  # 5xx, timeout, broken stream: ejected after N in a row
    PROBE = "probe"  # the active prober's verdict: ejected at once


@dataclass(frozen=True, slots=True)
class Ejection:
    """A failure that ejected a node, or would have but for the max ejected percent."""

    node_id: str
    kind: FailureKind
    duration_s: float  # 0 when not enforced
    enforced: bool


EjectionListener = Callable[[Ejection], None]


class FleetState(Protocol):
    """Per-node health and load as the router sees it."""

    def is_ejected(self, node_id: str) -> bool: ...

    def ejected_for_s(self, node_id: str) -> float:
        """Seconds until the node is tried again (0 when it is not ejected)."""
        ...

    def record_success(self, node_id: str) -> None:
        """The node answered a request (a 4xx included): forget its failures."""
        ...

    def record_failure(self, node_id: str, kind: FailureKind = FailureKind.UNREACHABLE) -> float:
        """Count a failure; returns the ejection it caused in seconds (0: none), or for a
        probe's failure while the node is ejected, how long the node is now out for."""
        ...

    def uneject(self, node_id: str) -> bool:
        """End the node's ejection now, keeping its backoff level; False if it was not ejected."""
        ...

    def set_known_nodes(self, node_ids: Iterable[str] | Mapping[str, Iterable[str]]) -> None:
        """The nodes the max ejected percent is a share of (the table's READY nodes), each
        with the residency zones it serves (whose own share is capped too)."""
        ...

    def update_known_nodes(self, upserted: Mapping[str, Iterable[str]], removed: Iterable[str]) -> None:
        """Change the known nodes by what changed (nodes added or whose zones changed, nodes
        gone): `set_known_nodes` for a routing-table delta, in O(changed nodes)."""
        ...

    def add_ejection_listener(self, listener: EjectionListener) -> None:
        """Call `listener` (synchronously, must not block) with each ejection this router decides."""
        ...

    def in_flight(self, node_id: str) -> int: ...

    def begin(self, node_id: str) -> None:
        """A request to the node starts (pair with `end`)."""
        ...

    def end(self, node_id: str) -> None: ...


def ejection_s(ejections: int, base_s: float, max_s: float) -> float:
    """How long a node is skipped at its `ejections`-th ejection since it last answered."""
    # Cap the exponent too, so a node that fails for days cannot overflow the float.
    return min(base_s * 2.0 ** min(ejections - 1, 30), max(max_s, base_s))


@dataclass(slots=True)
class NodeRecord:
    """A node's failure history, as both FleetStates keep it."""

    consecutive_failures: int = 0  # since the last answer or ejection
    ejections: int = 0  # since the last answer: the backoff level
    ejected_until: float = 0.0  # the clock's monotonic()


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """When a failing node is ejected and for how long (the module docstring)."""

    base_s: float
    max_s: float
    consecutive_failures: int = 5
    max_percent: float = 50.0

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> EjectionPolicy:
        return cls(settings.ejection_base_s, settings.ejection_max_s, settings.consecutive_failures_to_eject,
                   settings.max_ejected_percent)


class EjectionRules:
    """The decisions every FleetState shares: whether a failure ejects, for how long, who hears."""

    def __init__(self, policy: EjectionPolicy) -> None:
        self._base_s = policy.base_s
        self._max_s = max(policy.max_s, policy.base_s)
        self._consecutive = max(1, policy.consecutive_failures)
        self._max_percent = policy.max_percent
        self.known: set[str] = set()
        # Node -> the pools it counts in: "*" (every known node) and each zone it serves.
        self._pools_of: dict[str, tuple[str, ...]] = {}
        self._members: dict[str, set[str]] = {}
        self._listeners: list[EjectionListener] = []
        self._last_cap_warning = -math.inf

    def add_listener(self, listener: EjectionListener) -> None:
        self._listeners.append(listener)

    def set_known(self, nodes: Iterable[str] | Mapping[str, Iterable[str]]) -> None:
        """The known nodes, and the zones each serves when given as a mapping."""
        zones_of = nodes if isinstance(nodes, Mapping) else dict.fromkeys(nodes, ())
        self.known, self._pools_of, self._members = set(), {}, {}
        self.update_known(zones_of, ())

    def update_known(self, upserted: Mapping[str, Iterable[str]], removed: Iterable[str]) -> None:
        """Add or re-zone the `upserted` nodes and drop the `removed` ones."""
        for node_id in (*removed, *upserted):
            for pool in self._pools_of.pop(node_id, ()):
                members = self._members[pool]
                members.discard(node_id)
                if not members:
                    del self._members[pool]
            self.known.discard(node_id)
        for node_id, zones in upserted.items():
            pools = self._pools_of[node_id] = ("*", *sorted(set(zones)))
            for pool in pools:
                self._members.setdefault(pool, set()).add(node_id)
            self.known.add(node_id)

    def fail(
        self,
        node_id: str,
        record: NodeRecord,
        kind: FailureKind,
        now: float,
        records: Iterable[tuple[str, NodeRecord]],
    ) -> float:
        """Apply one failure to `record` (`records`: every node's, for the cap); the ejection in s."""
        if record.ejected_until > now:
            if kind is not FailureKind.PROBE:
                return 0.0  # sent before the ejection: already acted on
            # Sent during it: the node is still down (the module docstring). Not a new ejection.
            record.ejected_until = max(record.ejected_until, now + self._base_s)
            return record.ejected_until - now
        record.consecutive_failures += 1
        if kind is FailureKind.ERROR and record.consecutive_failures < self._consecutive:
            return 0.0
        if node_id in self.known:
            ejected = {n for n, r in records if r.ejected_until > now}
            for pool in self._pools_of[node_id]:
                members = self._members[pool]
                out = len(ejected & members)
                # One node may always go (Envoy's rule), however small the percentage.
                if out and (out + 1) * 100 > self._max_percent * len(members):
                    self._capped(node_id, kind, pool, out, len(members), now)
                    return 0.0
        record.consecutive_failures = 0
        record.ejections += 1
        duration = ejection_s(record.ejections, self._base_s, self._max_s)
        record.ejected_until = now + duration
        self._notify(Ejection(node_id, kind, duration, enforced=True))
        return duration

    @staticmethod
    def uneject(record: NodeRecord, now: float) -> bool:
        """End `record`'s ejection now, keeping its backoff level; False if it was not ejected."""
        if record.ejected_until <= now:
            return False
        record.ejected_until = 0.0
        record.consecutive_failures = 0
        return True

    def _capped(self, node_id: str, kind: FailureKind, pool: str, out: int, of: int, now: float) -> None:
        if now - self._last_cap_warning >= _CAP_WARN_EVERY_S:
            self._last_cap_warning = now
            where = "nodes" if pool == "*" else f"nodes of zone {pool}"
            log.warning(
                "node %s failed (%s) but stays in service: %d of %d %s are ejected already "
                "(max_ejected_percent=%g)",
                node_id, kind, out, of, where, self._max_percent,
            )
        self._notify(Ejection(node_id, kind, 0.0, enforced=False))

    def _notify(self, ejection: Ejection) -> None:
        for listener in self._listeners:
            try:
                listener(ejection)
            except Exception:  # noqa: BLE001 - a broken listener must not break routing
                log.exception("ejection listener %r failed", listener)


@dataclass(slots=True)
class NodeHealth(NodeRecord):
    """A node's record as this router keeps it: its history, its in-flight requests and
    (RedisFleetState) whether Redis holds its ejection as we do."""

    in_flight: int = 0
    shared: bool = False

    def clean(self) -> bool:
        """Nothing worth remembering: the record may be dropped."""
        return self.in_flight == 0 and self.consecutive_failures == 0 and self.ejections == 0

    def reset(self) -> None:
        """Forget the failure history (the in-flight count is kept)."""
        self.consecutive_failures = self.ejections = 0
        self.ejected_until = 0.0
        self.shared = False


class InProcessFleetState:
    """FleetState held in this process's memory: right for one router, and the local view
    a RedisFleetState shares."""

    def __init__(
        self,
        ejection_base_s: float,
        ejection_max_s: float,
        clock: Clock = SYSTEM_CLOCK,
        *,
        consecutive_failures_to_eject: int = 5,
        max_ejected_percent: float = 50.0,
    ) -> None:
        self._rules = EjectionRules(EjectionPolicy(ejection_base_s, ejection_max_s, consecutive_failures_to_eject,
                                                   max_ejected_percent))
        self._clock = clock
        self._nodes: dict[str, NodeHealth] = {}

    @classmethod
    def from_settings(cls, settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> InProcessFleetState:
        return cls(
            settings.ejection_base_s,
            settings.ejection_max_s,
            clock,
            consecutive_failures_to_eject=settings.consecutive_failures_to_eject,
            max_ejected_percent=settings.max_ejected_percent,
        )

    def is_ejected(self, node_id: str) -> bool:
        return self.ejected_for_s(node_id) > 0

    def ejected_for_s(self, node_id: str) -> float:
        h = self._nodes.get(node_id)
        if h is None:
            return 0.0
        return max(0.0, h.ejected_until - self._clock.monotonic())

    def record_success(self, node_id: str) -> None:
        h = self._nodes.get(node_id)
        if h is None:
            return
        h.reset()
        self._forget_if_clean(node_id, h)

    def record_failure(self, node_id: str, kind: FailureKind = FailureKind.UNREACHABLE) -> float:
        h = self._nodes.setdefault(node_id, NodeHealth())
        return self._rules.fail(node_id, h, kind, self._clock.monotonic(), self._nodes.items())

    def uneject(self, node_id: str) -> bool:
        h = self._nodes.get(node_id)
        return h is not None and self._rules.uneject(h, self._clock.monotonic())

    def set_known_nodes(self, node_ids: Iterable[str] | Mapping[str, Iterable[str]]) -> None:
        self._rules.set_known(node_ids)
        for node_id, h in list(self._nodes.items()):
            # A node that left the table keeps only its in-flight count, until that ends.
            if node_id not in self._rules.known and not self._keep_record(node_id):
                h.reset()
                self._forget_if_clean(node_id, h)

    def update_known_nodes(self, upserted: Mapping[str, Iterable[str]], removed: Iterable[str]) -> None:
        removed = list(removed)
        self._rules.update_known(upserted, removed)
        for node_id in removed:
            h = self._nodes.get(node_id)
            if h is not None and node_id not in self._rules.known and not self._keep_record(node_id):
                h.reset()
                self._forget_if_clean(node_id, h)

    def add_ejection_listener(self, listener: EjectionListener) -> None:
        self._rules.add_listener(listener)

    def in_flight(self, node_id: str) -> int:
        h = self._nodes.get(node_id)
        return h.in_flight if h else 0

    def begin(self, node_id: str) -> None:
        self._nodes.setdefault(node_id, NodeHealth()).in_flight += 1

    def end(self, node_id: str) -> None:
        h = self._nodes.get(node_id)
        if h is None:
            return
        h.in_flight = max(0, h.in_flight - 1)
        self._forget_if_clean(node_id, h)

    def _keep_record(self, node_id: str) -> bool:
        """Whether a node that left the table keeps its history (a change still to publish)."""
        return False

    def _forget_if_clean(self, node_id: str, h: NodeHealth) -> None:
        # Nodes come and go; keep entries only for nodes with something to remember.
        if h.clean():
            del self._nodes[node_id]
