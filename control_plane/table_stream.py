"""The routing tables this control-plane process serves: one build per version, shared by
every waiting router, and deltas from the versions it built before.

Why: at 10,000 nodes a table is ~1.7 MB and a build ~0.2 s of CPU; 50 long-polling routers
woken by one bump each used to get a build of their own, and then 1.7 MB each for what is
usually one node's change.

- **Single flight.** `newest_at_least(v)` answers from the newest table built when it is at
  least `v`; otherwise every caller awaits the one build in flight (a caller cancelled while
  waiting does not cancel it). The newest table's serialized bytes are kept, so 50 routers
  woken by one bump cost one build and one serialization.
- **Deltas** (RFC 3229 delta encoding, as Envoy's incremental xDS; the wire contract is
  meridian.contracts.RoutingTableDelta). Each build gets a random build id. The process keeps
  its last builds (`routing_history_versions` and `routing_history_bytes`, the newest always
  kept) and answers a router that names (version, build) of one of them with what changed
  since; a delta is computed once per (base, newest) and shared. A build this process does
  not hold (too old, another replica's, one from before a restart) gets the full table: the
  build id, not the version alone, names the content, because a table labelled V may hold
  changes committed after V (build_routing_table reads the version first), and two builds
  of V may differ.
- Unchanged nodes of consecutive builds are the same objects (a node whose database row did
  not change is not built again, and the rest are interned on equality), so a build validates
  only what changed, the history costs a dict per version rather than a fleet, and a diff is
  mostly identity checks. The full table is spliced from each node's JSON, kept from build to
  build, so only changed nodes are serialized.
- A database whose version went back (a restore) drops every build (`forget`).
- **Spaced builds.** A build starts at least `min_interval_s` after the previous one ended
  (routing_build_min_interval_s): during a storm of changes the builds cover many versions
  each, so table distribution costs at most one build per interval whatever the change rate.
  The spacing also grows with what the last build cost: at least its CPU time times
  (1 / `max_cpu_share` - 1), so builds take at most that share of a core
  (routing_build_max_cpu_share, 0.25) however large the fleet. A build reads every node row,
  ~0.1-0.3 s of CPU at 10,000 nodes: at 0.25 s apart, a registration storm kept the control
  plane building tables back to back with no CPU left for the registrations themselves.
  A change then reaches routers up to ~3 builds' time later (~0.6 s at 10,000 nodes).

Not done here: the build still reads every node row (~0.1-0.2 s at 10,000 nodes on SQLite);
rows stamped with the version that changed them would let it read only those.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from control_plane.routing_table import NodeRows
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import (
    DeploymentEntry,
    RegionInfo,
    RoutingNode,
    RoutingTable,
    RoutingTableDelta,
    TenantEntry,
)


@dataclass(frozen=True, slots=True)
class BuiltTable:
    """One build of the routing table as the history keeps it (no serialized bytes)."""

    version: int
    build: str
    generated_at: datetime
    nodes: dict[str, RoutingNode]  # by node_id, in the table's order
    regions: list[RegionInfo]
    tenants: list[TenantEntry]
    deployments: list[DeploymentEntry]
    # Serialized size: what the history's byte bound counts (an upper bound, nodes are shared).
    size: int


@dataclass(frozen=True, slots=True)
class Published:
    """The newest build and its serialized full table, as every router is sent it."""

    table: BuiltTable
    body: bytes
    # Each node's JSON in `body`, by node_id: the next build reuses it for the nodes it shares.
    node_json: dict[str, tuple[RoutingNode, bytes]]


def new_build_id() -> str:
    return secrets.token_urlsafe(12)


# Where the nodes go in a table serialized without them (`nodes` follows `regions`).
_NO_NODES = b',"nodes":[]'


def publish(table: RoutingTable, previous: Published | None) -> Published:
    """Serialize `table` and keep it as a build. Nodes equal to the previous build's are
    replaced by those objects, so consecutive builds share what did not change, and their
    JSON is the previous build's: only changed nodes are serialized (the whole table's
    serialization was ~1/5 of a build at 10,000 nodes)."""
    before = previous.node_json if previous is not None else {}
    nodes: dict[str, RoutingNode] = {}
    node_json: dict[str, tuple[RoutingNode, bytes]] = {}
    for node in table.nodes:
        old = before.get(node.node_id)
        if old is not None and (old[0] is node or old[0] == node):
            node, data = old
        else:
            data = node.model_dump_json().encode()
        nodes[node.node_id] = node
        node_json[node.node_id] = (node, data)
    shell = table.model_copy(update={"nodes": []}).model_dump_json().encode()
    at = shell.index(_NO_NODES)
    body = b"".join((
        shell[:at], b',"nodes":[', b",".join(data for _, data in node_json.values()), b"]",
        shell[at + len(_NO_NODES):],
    ))
    built = BuiltTable(
        version=table.version,
        build=new_build_id(),
        generated_at=table.generated_at,
        nodes=nodes,
        regions=table.regions,
        tenants=table.tenants,
        deployments=table.deployments,
        size=len(body),
    )
    return Published(built, body, node_json)


def table_delta(base: BuiltTable, target: BuiltTable) -> RoutingTableDelta:
    """What turns `base` into `target`: the nodes that differ, the ids that left, and the
    small lists whole where they changed."""
    upserted = [
        node for node_id, node in target.nodes.items()
        if (old := base.nodes.get(node_id)) is not node and old != node
    ]
    return RoutingTableDelta(
        base_version=base.version,
        base_build=base.build,
        version=target.version,
        build=target.build,
        generated_at=target.generated_at,
        nodes_upserted=upserted,
        nodes_removed=[node_id for node_id in base.nodes if node_id not in target.nodes],
        regions=None if target.regions == base.regions else target.regions,
        tenants=None if target.tenants == base.tenants else target.tenants,
        deployments=None if target.deployments == base.deployments else target.deployments,
    )


class TableStream:
    """The newest build (single flight), the history of builds, and the deltas from them."""

    def __init__(
        self,
        build: Callable[[NodeRows], RoutingTable],
        *,
        max_versions: int,
        max_bytes: int,
        min_interval_s: float = 0.0,
        max_cpu_share: float = 1.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # `build` reads the database (build_routing_table): it runs in a worker thread, one at
        # a time, and reuses the nodes of the previous build whose rows did not change.
        self._build = build
        self._known: NodeRows = {}
        self._max_versions = max_versions
        self._max_bytes = max_bytes
        self._newest: Published | None = None
        self._history: OrderedDict[tuple[int, str], BuiltTable] = OrderedDict()  # oldest first
        self._history_bytes = 0
        self._inflight: asyncio.Future[None] | None = None
        self._min_interval_s = min_interval_s
        self._max_cpu_share = max_cpu_share
        self._spacing_s = min_interval_s  # from the end of one build to the start of the next
        self._clock = clock
        self._built_at: float | None = None  # monotonic, when the last build ended
        self._deltas: dict[tuple[int, str], bytes] = {}  # to the newest build, by base
        # Counted for tests and benchmarks: builds and deltas computed.
        self.builds = 0
        self.deltas_computed = 0

    def newest(self) -> Published | None:
        return self._newest

    def held(self) -> list[tuple[int, str]]:
        """(version, build) of every build kept, oldest first."""
        return list(self._history)

    async def newest_at_least(self, version: int) -> Published:
        """The newest build, built first (once, for every caller) unless it is at least `version`."""
        while (newest := self._newest) is None or newest.table.version < version:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._build_and_keep())
            # Shielded: one router giving up must not cancel the build the others wait for.
            await asyncio.shield(self._inflight)
        return newest

    async def _build_and_keep(self) -> None:
        try:
            if self._built_at is not None:
                # Spaced builds: whatever is committed meanwhile goes into this one build.
                wait_s = self._built_at + self._spacing_s - self._clock.monotonic()
                if wait_s > 0:
                    await self._clock.sleep(wait_s)
            previous = self._newest

            def build() -> tuple[Published, float]:
                started = time.thread_time()  # this thread's CPU: the build's own cost
                done = publish(self._build(self._known), previous)
                return done, time.thread_time() - started

            published, cpu_s = await asyncio.to_thread(build)
            self._spacing_s = max(self._min_interval_s, cpu_s * (1.0 / self._max_cpu_share - 1.0))
            self._built_at = self._clock.monotonic()
            self.builds += 1
            self._keep(published)
        finally:
            self._inflight = None

    def _keep(self, published: Published) -> None:
        newest = self._newest
        if newest is not None and published.table.version <= newest.table.version:
            return  # nothing newer (another replica's bump was seen by an earlier build)
        self._newest = published
        self._deltas.clear()
        self._history[(published.table.version, published.table.build)] = published.table
        self._history_bytes += published.table.size
        while len(self._history) > 1 and (
            len(self._history) > self._max_versions or self._history_bytes > self._max_bytes
        ):
            _, dropped = self._history.popitem(last=False)
            self._history_bytes -= dropped.size

    def forget(self) -> None:
        """Drop every build (the database's version went back): the next caller builds anew."""
        self._newest = None
        self._history.clear()
        self._history_bytes = 0
        self._deltas.clear()
        self._known.clear()

    def delta(self, base_version: int, base_build: str, target: Published) -> bytes | None:
        """The serialized delta from the build (base_version, base_build) to `target`, or None
        when this process does not hold that build (the caller sends the full table)."""
        key = (base_version, base_build)
        newest = target is self._newest
        if newest and (cached := self._deltas.get(key)) is not None:
            return cached
        base = self._history.get(key)
        if base is None or base.version >= target.table.version:
            return None
        # Computed here, on the event loop with no await: each (base, newest) at most once.
        # (A target a newer build has replaced meanwhile is rare: its delta is not kept.)
        body = table_delta(base, target.table).model_dump_json().encode()
        self.deltas_computed += 1
        if newest:
            self._deltas[key] = body
        return body
