"""Simulated routers: many real `geo_router.state.table.RoutingTableClient`s per process.

Each client long-polls the control plane exactly as a router does (whatever the table
stream offers: full snapshots today, deltas once it has them, since this only calls the
client's public API) and this module watches it from outside:

- every install, through `add_listener`: the version, when (monotonic), and how long the
  install took, from the moment the answer's last byte arrived (a counting transport
  under the client) to the listener's call, which is the client's parse plus
  `LoadedTable.build` (the client does nothing between them that waits);
- the bytes the control plane sent it (the counting transport);
- for each node the coordinator named in advance (the victims of deaths and drains), the
  first install in which it is excluded (absent, or not READY) after being seen READY.

One process runs `router_main` for its share of the routers and reports on the shared
events queue (`Install`, `Excluded`, `RouterStats`) until the stop event is set.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

from geo_router.state.table import LoadedTable, RoutingTableClient
from localfabric.procs import die_with_parent
from meridian.contracts import NodeStatus
from meridian.settings.router import RouterSettings

STATS_EVERY_S = 0.25


@dataclass(frozen=True, slots=True)
class RouterJob:
    index: int  # of the process
    first_router: int  # global index of its first router
    routers: int
    cp_url: str
    token: str
    watched: frozenset[str]  # node ids whose exclusion is timed


@dataclass(frozen=True, slots=True)
class Install:
    router: int
    version: int
    at: float  # monotonic
    install_ms: float  # answer received -> listener called (parse + build)
    nodes: int


@dataclass(frozen=True, slots=True)
class Excluded:
    router: int
    node_id: str
    version: int
    at: float
    # When the control plane began the build of that version (its wall clock, the same host's).
    built_at: float = 0.0


@dataclass(frozen=True, slots=True)
class RouterStats:
    index: int
    at: float
    routers_with_table: int
    bytes_received: int  # summed over the process's routers since start
    responses: int  # table answers received (200 and 304)
    tables: int  # of which carried a table (200)


class CountingTransport(httpx.AsyncHTTPTransport):
    """Counts the bytes of each answer's body and notes when the last one arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.responses = 0
        self.tables = 0  # answers that carried a table (200), not a 304
        self.last_body_at = 0.0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        body = await response.aread()
        self.bytes += len(body)
        self.responses += 1
        self.tables += response.status_code == 200
        self.last_body_at = time.monotonic()
        return response


class WatchedRouter:
    """One table client and what is watched of it."""

    def __init__(self, number: int, job: RouterJob, events: Any) -> None:
        self.number = number
        self.transport = CountingTransport()
        settings = RouterSettings(control_plane_url=job.cp_url, cluster_token=SecretStr(job.token),
                                  snapshot_path=None)
        self.client = RoutingTableClient(settings, transport=self.transport)
        self._watched = job.watched
        self._seen_ready: set[str] = set()
        self._excluded: set[str] = set()
        self._events = events
        self.client.add_listener(self._on_install)

    def _on_install(self, loaded: LoadedTable) -> None:
        now = time.monotonic()
        install_ms = (now - self.transport.last_body_at) * 1000.0
        self._events.put(Install(self.number, loaded.version, now, install_ms, len(loaded.table.nodes)))
        if not self._watched:
            return
        ready = {n.node_id for n in loaded.table.nodes
                 if n.status is NodeStatus.READY and n.node_id in self._watched}
        self._seen_ready |= ready
        for node_id in self._seen_ready - ready - self._excluded:
            self._excluded.add(node_id)
            built_at = loaded.table.generated_at.timestamp()
            self._events.put(Excluded(self.number, node_id, loaded.version, now, built_at))


def router_main(job: RouterJob, events: Any, stop: Any) -> None:
    """Entry point of a router process (multiprocessing, spawn): runs until `stop` is set."""
    die_with_parent()  # a coordinator killed outright must not leave a fleet behind
    asyncio.run(_router_loop(job, events, stop))


async def _router_loop(job: RouterJob, events: Any, stop: Any) -> None:
    routers = [WatchedRouter(job.first_router + i, job, events) for i in range(job.routers)]
    # Started together, as routers of a fleet are: the control plane sees them all waiting.
    await asyncio.gather(*(r.client.start() for r in routers))
    while not stop.is_set():
        await asyncio.sleep(STATS_EVERY_S)
        events.put(RouterStats(
            job.index, time.monotonic(), sum(r.client.current() is not None for r in routers),
            sum(r.transport.bytes for r in routers), sum(r.transport.responses for r in routers),
            sum(r.transport.tables for r in routers)))
    await asyncio.gather(*(r.client.stop() for r in routers), return_exceptions=True)
