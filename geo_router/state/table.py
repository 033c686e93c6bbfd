"""The routing table as the router holds it, and where it comes from.

`RoutingTableClient` long-polls the control plane and keeps serving from the last table it
has (in memory, and on disk across restarts) while the control plane is unreachable:
static stability. `StaticTableSource` serves a fixed table (tests, single-box setups).
The client's retry backoff is timed on its `Clock`, so tests move it with a ManualClock.

Deltas: once it holds a table whose build the control plane named, the client asks for the
changes since it (`A-IM: meridian-delta`, `X-Meridian-Table-Build`; meridian.contracts has
the protocol) and builds the next table from its own plus the delta, so a change costs what
changed rather than a parse of the whole fleet (at 10,000 nodes a full parse is ~70 ms). A
delta for another base than the table held is refused and the full table fetched; a control
plane that knows no deltas answers 200 with full tables, which the client takes as before.

`LoadedTable` holds the indexes a request needs (nodes by id, by model, and a model's READY
nodes by region), built once per version, so that a request costs O(candidates), not O(fleet). A table a delta led to also
names the nodes the delta changed (`changes_since`), so that listeners (the prober, the KV
subscriber) follow an install in O(changed nodes) too; a table built whole names none, and
listeners then look at every node.

The snapshot on disk is rewritten at most every `snapshot_interval_s` (the newest table
always, and at stop): the first table is on disk once `start` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Protocol

import httpx

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.cluster_client import ClusterClient, ClusterEndpoint
from meridian.contracts import (
    DeploymentEntry,
    NodeStatus,
    RegionInfo,
    RoutingNode,
    RoutingTable,
    RoutingTableDelta,
    TenantEntry,
)
from meridian.settings.router import RouterSettings

from .snapshot import read_snapshot, write_snapshot

log = logging.getLogger(__name__)

# The table call's timeouts but the long-poll's read (ClusterClient.routing_table adds the wait).
_TABLE_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class LoadedTable:
    """A routing table plus the lookups every request needs, built once per version."""

    table: RoutingTable
    regions: Mapping[str, RegionInfo]
    tenants: Mapping[str, TenantEntry]  # by key hash
    deployments: Mapping[str, DeploymentEntry]  # by model
    # Every model a node serves or a deployment names: the model label of per-tenant
    # metrics is one of these (a client's made-up name would grow the series without bound).
    models: frozenset[str]
    nodes_by_id: Mapping[str, RoutingNode]
    # The nodes that list a model name (a LoRA adapter's base model is looked up by its own
    # name), in the table's order.
    nodes_by_model: Mapping[str, tuple[RoutingNode, ...]]
    # The READY nodes of each model by region, in the table's order: what a bounded candidate
    # set (geo_router.selection.candidates) walks nearest region first, O(regions) before any node, and
    # (its keys) the regions models_for looks at, O(models x regions).
    ready_by_model_region: Mapping[str, Mapping[str, tuple[RoutingNode, ...]]]
    # What a listener needs to follow the table in O(changed nodes): the node ids added,
    # changed or removed since the table of version `base_version`. None for a table built
    # whole (a full table, a snapshot): a listener then looks at every node. They say how
    # the table was reached, not what it holds, so equal tables compare equal without them.
    changed_nodes: frozenset[str] | None = field(default=None, compare=False)
    base_version: int | None = field(default=None, compare=False)

    @classmethod
    def build(cls, table: RoutingTable) -> LoadedTable:
        by_model: dict[str, list[RoutingNode]] = {}
        for node in table.nodes:
            for model in node.models:
                by_model.setdefault(model, []).append(node)
        ready_by_region = {m: _ready_by_region(nodes) for m, nodes in by_model.items()}
        return cls(
            table=table,
            regions={r.name: r for r in table.regions},
            tenants={t.key_hash: t for t in table.tenants},
            deployments={d.model: d for d in table.deployments},
            models=frozenset(by_model) | {d.model for d in table.deployments},
            nodes_by_id={n.node_id: n for n in table.nodes},
            nodes_by_model={m: tuple(nodes) for m, nodes in by_model.items()},
            ready_by_model_region={m: r for m, r in ready_by_region.items() if r},
        )

    def apply(self, delta: RoutingTableDelta) -> LoadedTable:
        """The loaded table `delta` leads to from this one (its base: the caller checks), its
        lookups updated for what changed rather than built again over the fleet."""
        table = apply_delta(self.table, delta)
        changed = set(delta.nodes_removed) | {n.node_id for n in delta.nodes_upserted}
        nodes_by_id = dict(self.nodes_by_id)
        touched: set[str] = set()  # models whose node lists change
        for node_id in changed:
            if (old := nodes_by_id.pop(node_id, None)) is not None:
                touched.update(old.models)
        for node in delta.nodes_upserted:
            nodes_by_id[node.node_id] = node
            touched.update(node.models)
        by_model = dict(self.nodes_by_model)
        ready_by_region = dict(self.ready_by_model_region)
        for model in touched:
            kept = [n for n in by_model.get(model, ()) if n.node_id not in changed]
            kept += [n for n in delta.nodes_upserted if model in n.models]
            kept.sort(key=attrgetter("node_id"))
            by_model.pop(model, None)
            ready_by_region.pop(model, None)
            if kept:
                by_model[model] = tuple(kept)
                if ready := _ready_by_region(kept):
                    ready_by_region[model] = ready
        return LoadedTable(
            table=table,
            regions=self.regions if delta.regions is None else {r.name: r for r in table.regions},
            tenants=self.tenants if delta.tenants is None else {t.key_hash: t for t in table.tenants},
            deployments=self.deployments if delta.deployments is None else {d.model: d for d in table.deployments},
            models=frozenset(by_model) | {d.model for d in table.deployments},
            nodes_by_id=nodes_by_id,
            nodes_by_model=by_model,
            ready_by_model_region=ready_by_region,
            changed_nodes=frozenset(changed),
            base_version=self.version,
        )

    def changes_since(self, version: int | None) -> frozenset[str] | None:
        """The node ids changed since the table of `version` (the one a listener saw last);
        None when this table does not say (built whole, or from another base): look at all."""
        if self.changed_nodes is None or version is None or self.base_version != version:
            return None
        return self.changed_nodes

    @property
    def version(self) -> int:
        return self.table.version


def _ready_by_region(nodes: list[RoutingNode]) -> dict[str, tuple[RoutingNode, ...]]:
    """The READY ones of `nodes` (one model's) by region, in their order."""
    out: dict[str, list[RoutingNode]] = {}
    for node in nodes:
        if node.status == NodeStatus.READY:
            out.setdefault(node.region, []).append(node)
    return {region: tuple(ready) for region, ready in out.items()}


def apply_delta(table: RoutingTable, delta: RoutingTableDelta) -> RoutingTable:
    """The table `delta` leads to from `table` (its base: the caller checks). Unchanged nodes
    are kept as they are, not validated again; nodes stay ordered by node_id, as the control
    plane orders them."""
    removed = set(delta.nodes_removed)
    upserts = {n.node_id: n for n in delta.nodes_upserted}
    nodes = [upserts.pop(n.node_id, n) for n in table.nodes if n.node_id not in removed]
    if upserts:  # nodes new to the table; sorting a list sorted but for these is linear
        nodes.extend(upserts.values())
        nodes.sort(key=attrgetter("node_id"))
    return RoutingTable.model_construct(
        version=delta.version,
        generated_at=delta.generated_at,
        regions=table.regions if delta.regions is None else delta.regions,
        nodes=nodes,
        tenants=table.tenants if delta.tenants is None else delta.tenants,
        deployments=table.deployments if delta.deployments is None else delta.deployments,
    )


TableListener = Callable[[LoadedTable], None]


def _notify(listeners: list[TableListener], loaded: LoadedTable) -> None:
    for listener in listeners:
        try:
            listener(loaded)
        except Exception:  # noqa: BLE001 - a broken listener must not stop table updates
            log.exception("routing-table listener %r failed", listener)


class TableSource(Protocol):
    """Where the router gets its routing table from."""

    def current(self) -> LoadedTable | None:
        """The latest table, or None while none has been loaded."""
        ...

    def add_listener(self, listener: TableListener) -> None:
        """Call `listener` (on the event loop, must not block) with each table installed."""
        ...

    def refreshed_at(self) -> float | None:
        """When (monotonic, on the app's clock) the table was last confirmed current; None for
        a table that cannot go stale (a static one) or before any."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticTableSource:
    """A table source that serves the table it is given (tests, fixed deployments)."""

    def __init__(self, table: RoutingTable | None = None) -> None:
        self._loaded = LoadedTable.build(table) if table is not None else None
        self._listeners: list[TableListener] = []

    def current(self) -> LoadedTable | None:
        return self._loaded

    def add_listener(self, listener: TableListener) -> None:
        self._listeners.append(listener)

    def refreshed_at(self) -> float | None:
        return None  # a fixed table is as current as it will ever be

    def set(self, table: RoutingTable) -> None:
        """Replace the table, as a new control-plane version would."""
        self._loaded = LoadedTable.build(table)
        _notify(self._listeners, self._loaded)

    def apply_delta(self, delta: RoutingTableDelta) -> None:
        """Move to the table `delta` leads to from the current one, as a router applying a
        control plane's delta does (listeners then see which nodes changed)."""
        if self._loaded is None:
            raise ValueError("no table to apply a delta to")
        self._loaded = self._loaded.apply(delta)
        _notify(self._listeners, self._loaded)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def cluster_endpoint(settings: RouterSettings, timeout_s: float, *, max_connections: int = 4) -> ClusterEndpoint:
    """The control plane as this router reaches it (cluster token), with a call's timeout."""
    return ClusterEndpoint(settings.control_plane_url, settings.cluster_token, timeout_s, settings.connect_timeout_s,
                           max_connections)


class RoutingTableClient:
    """Keeps the latest routing table from the control plane, long-polling for changes."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        retry_base_s: float = 0.5,
        retry_max_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._loaded: LoadedTable | None = None
        self._task: asyncio.Task[None] | None = None
        self._cluster = ClusterClient(cluster_endpoint(settings, _TABLE_CALL_TIMEOUT_S, max_connections=2),
                                      transport=transport)
        self._updated = asyncio.Event()
        self._listeners: list[TableListener] = []
        self._refreshed_at: float | None = None
        # The control plane's build id of the table held (None: unknown, e.g. from the snapshot
        # or an older control plane): a delta is asked for only on top of a named build.
        self._build: str | None = None
        # Snapshot writing: woken by each install, at most every snapshot_interval_s; the lock
        # orders a write at stop after one still running in its thread.
        self._snapshot_wanted = asyncio.Event()
        self._snapshot_task: asyncio.Task[None] | None = None
        self._snapshot_lock = threading.Lock()
        self._snapshot_version: int | None = None
        # Counted for tests and benchmarks: tables installed from deltas and from full tables.
        self.deltas_applied = 0
        self.full_tables = 0

    def current(self) -> LoadedTable | None:
        return self._loaded

    def add_listener(self, listener: TableListener) -> None:
        self._listeners.append(listener)

    def refreshed_at(self) -> float | None:
        # A long-poll answered 304 confirms the table as much as a new one does.
        return self._refreshed_at

    async def start(self) -> None:
        """Fetch the table once (or fall back to the snapshot), then keep it fresh."""
        try:
            if await self._poll(wait_s=0.0):
                await self._write_snapshot()
        except Exception as exc:  # noqa: BLE001 - any failure here means "use the snapshot"
            log.warning("control plane unreachable at start-up (%s); trying the snapshot", exc)
            await self._load_snapshot()
        self._task = asyncio.create_task(self._run(), name="routing-table-poll")
        if self._settings.snapshot_path is not None:
            self._snapshot_task = asyncio.create_task(self._snapshots(), name="routing-table-snapshot")

    async def stop(self) -> None:
        for task in (self._task, self._snapshot_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._snapshot_task = None
        await self._write_snapshot()  # the newest table, if the writer had not got to it
        await self._cluster.aclose()

    async def wait_for_version(self, version: int, timeout_s: float) -> LoadedTable:
        """Wait until a table with at least `version` is loaded (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout_s):
            while self._loaded is None or self._loaded.version < version:
                self._updated.clear()
                await self._updated.wait()
        return self._loaded

    async def _run(self) -> None:
        failures = 0
        while True:
            wait_s = self._settings.table_poll_timeout_s if self._loaded is not None else 0.0
            started = self._clock.monotonic()
            try:
                changed = await self._poll(wait_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - never let the poller die
                failures += 1
                delay = min(self._retry_base_s * 2 ** (failures - 1), self._retry_max_s)
                delay *= random.uniform(0.5, 1.0)  # so a fleet of routers does not retry in step
                version = self._loaded.version if self._loaded else None
                log.warning(
                    "routing-table poll failed (%s: %s); serving version %s, retrying in %.1fs",
                    type(exc).__name__, exc, version, delay,
                )
                await self._clock.sleep(delay)
                continue
            failures = 0
            # A control plane that answers 304 at once instead of holding the long-poll
            # must not turn this loop into a busy loop.
            if not changed and self._clock.monotonic() - started < 0.2:
                await self._clock.sleep(0.2)

    async def _poll(self, wait_s: float) -> bool:
        """One request to the control plane; True when a new table was loaded."""
        held = self._loaded
        # The version held makes it conditional (a long-poll); the build held asks for a delta.
        answer = await self._cluster.routing_table(version=held.version if held is not None else None,
                                                   build=self._build, wait_s=wait_s)
        if answer.delta is not None:
            if held is None or self._build is None or not self._apply(answer.delta):
                # Not a delta for the table held: drop the build so the next ask is a full one.
                self._build = None
                return await self._poll(0.0)
        elif answer.table is not None:
            self.full_tables += 1
            self._install(LoadedTable.build(answer.table), answer.build)
        self._refreshed_at = self._clock.monotonic()
        return not answer.unchanged

    def _apply(self, delta: RoutingTableDelta) -> bool:
        """Install the table a delta leads to; False when its base is not the table held."""
        assert self._loaded is not None
        if (delta.base_version, delta.base_build) != (self._loaded.version, self._build):
            log.warning(
                "routing-table delta from %d/%s does not apply to version %d/%s; fetching the full table",
                delta.base_version, delta.base_build, self._loaded.version, self._build,
            )
            return False
        self.deltas_applied += 1
        self._install(self._loaded.apply(delta), delta.build)
        return True

    async def _snapshots(self) -> None:
        """Write the newest table after each install, at most every snapshot_interval_s."""
        while True:
            await self._snapshot_wanted.wait()
            self._snapshot_wanted.clear()
            await self._write_snapshot()
            if self._settings.snapshot_interval_s > 0:
                await self._clock.sleep(self._settings.snapshot_interval_s)

    async def _write_snapshot(self) -> None:
        if self._settings.snapshot_path is None or self._loaded is None:
            return
        try:
            await asyncio.to_thread(self._write_newest, self._settings.snapshot_path)
        except OSError as exc:
            log.warning("cannot write routing-table snapshot: %s", exc)

    def _write_newest(self, path: Path) -> None:
        # In a worker thread: the newest table when the lock is ours, once.
        with self._snapshot_lock:
            loaded = self._loaded
            if loaded is None or loaded.version == self._snapshot_version:
                return
            write_snapshot(path, loaded.table)
            self._snapshot_version = loaded.version

    async def _load_snapshot(self) -> None:
        path = self._settings.snapshot_path
        if path is None:
            log.warning("no snapshot_path configured; serving nothing until the control plane answers")
            return
        table = await asyncio.to_thread(read_snapshot, path)
        if table is None:
            log.warning("no usable routing-table snapshot at %s", path)
            return
        log.info("serving routing table version %d from snapshot %s", table.version, path)
        self._install(LoadedTable.build(table))
        self._snapshot_version = table.version  # already on disk
        self._refreshed_at = self._clock.monotonic()

    def _install(self, loaded: LoadedTable, build: str | None = None) -> None:
        previous = self._loaded.version if self._loaded else None
        self._loaded = loaded
        table = loaded.table
        self._build = build
        self._snapshot_wanted.set()
        self._updated.set()
        _notify(self._listeners, self._loaded)
        if previous != table.version:
            log.info(
                "routing table version %s -> %d (%d nodes, %d tenants)",
                previous, table.version, len(table.nodes), len(table.tenants),
            )
