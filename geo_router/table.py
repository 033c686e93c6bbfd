"""The routing table as the router holds it, and where it comes from.

`RoutingTableClient` long-polls the control plane and keeps serving from the last table it
has (in memory, and on disk across restarts) while the control plane is unreachable:
static stability. `StaticTableSource` serves a fixed table (tests, single-box setups).
The client's retry backoff is timed on its `Clock`, so tests move it with a ManualClock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx
from pydantic import ValidationError

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import DeploymentEntry, RegionInfo, RoutingTable, TenantEntry
from meridian.settings import RouterSettings

from .snapshot import read_snapshot, write_snapshot

log = logging.getLogger(__name__)

ROUTING_TABLE_PATH = "/v1/routing-table"


@dataclass(frozen=True, slots=True)
class LoadedTable:
    """A routing table plus the lookups every request needs, built once per version."""

    table: RoutingTable
    regions: Mapping[str, RegionInfo]
    tenants: Mapping[str, TenantEntry]  # by key hash
    deployments: Mapping[str, DeploymentEntry]  # by model
    node_regions: Mapping[str, str]  # node id -> region name
    # Every model a node serves or a deployment names: the model label of per-tenant
    # metrics is one of these (a client's made-up name would grow the series without bound).
    models: frozenset[str]

    @classmethod
    def build(cls, table: RoutingTable) -> LoadedTable:
        return cls(
            table=table,
            regions={r.name: r for r in table.regions},
            tenants={t.key_hash: t for t in table.tenants},
            deployments={d.model: d for d in table.deployments},
            node_regions={n.node_id: n.region for n in table.nodes},
            models=frozenset(m for n in table.nodes for m in n.models) | {d.model for d in table.deployments},
        )

    @property
    def version(self) -> int:
        return self.table.version


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

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


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
        self._http = httpx.AsyncClient(
            base_url=settings.control_plane_url.rstrip("/"),
            headers={"authorization": f"Bearer {settings.cluster_token.get_secret_value()}"},
            timeout=self._timeout(0.0),
            limits=httpx.Limits(max_connections=2, max_keepalive_connections=1),
            transport=transport,
        )
        self._updated = asyncio.Event()
        self._listeners: list[TableListener] = []
        self._refreshed_at: float | None = None

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
            await self._poll(wait_s=0.0)
        except Exception as exc:  # noqa: BLE001 - any failure here means "use the snapshot"
            log.warning("control plane unreachable at start-up (%s); trying the snapshot", exc)
            await self._load_snapshot()
        self._task = asyncio.create_task(self._run(), name="routing-table-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._http.aclose()

    async def wait_for_version(self, version: int, timeout_s: float) -> LoadedTable:
        """Wait until a table with at least `version` is loaded (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout_s):
            while self._loaded is None or self._loaded.version < version:
                self._updated.clear()
                await self._updated.wait()
        return self._loaded

    def _timeout(self, wait_s: float) -> httpx.Timeout:
        # A long-poll legitimately stays silent for `wait_s`; allow a margin on top.
        s = self._settings
        return httpx.Timeout(connect=s.connect_timeout_s, read=wait_s + 10.0, write=10.0, pool=10.0)

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
        headers: dict[str, str] = {}
        params: dict[str, str] = {}
        if self._loaded is not None:
            headers["if-none-match"] = f'"{self._loaded.version}"'
            if wait_s > 0:
                params["wait"] = f"{wait_s:g}"
        resp = await self._http.get(
            ROUTING_TABLE_PATH, headers=headers, params=params, timeout=self._timeout(wait_s)
        )
        if resp.status_code == 304:
            self._refreshed_at = self._clock.monotonic()
            return False
        if resp.status_code != 200:
            raise RuntimeError(f"control plane answered {resp.status_code}: {resp.text[:200]}")
        try:
            table = RoutingTable.model_validate_json(resp.content)
        except ValidationError as exc:
            raise RuntimeError(f"control plane sent an invalid routing table: {exc}") from exc
        self._install(table)
        self._refreshed_at = self._clock.monotonic()
        if self._settings.snapshot_path is not None:
            try:
                await asyncio.to_thread(write_snapshot, self._settings.snapshot_path, table)
            except OSError as exc:
                log.warning("cannot write routing-table snapshot: %s", exc)
        return True

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
        self._install(table)
        self._refreshed_at = self._clock.monotonic()

    def _install(self, table: RoutingTable) -> None:
        previous = self._loaded.version if self._loaded else None
        self._loaded = LoadedTable.build(table)
        self._updated.set()
        _notify(self._listeners, self._loaded)
        if previous != table.version:
            log.info(
                "routing table version %s -> %d (%d nodes, %d tenants)",
                previous, table.version, len(table.nodes), len(table.tenants),
            )
