"""What a fault injector acts on: the running local fabric, the proxies in front of its
nodes and of Redis, and the run's clock and event log."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from chaos.drill import Load, Target
from chaos.faults.netns import Sites
from chaos.faults.tcp_proxy import FaultProxy
from chaos.history import HistoryWriter
from chaos.load import LoadTarget
from chaos.observe import RouterMetrics, busiest
from chaos.streams import StreamTracker
from chaos.timeline import Timeline
from localfabric import FabricInfo, LocalFabric, Proc, renice

# Niceness of a process cold-starting during a drill (see DrillEnvironment.restart).
COLD_START_NICENESS = 15

log = logging.getLogger(__name__)


class InjectionError(RuntimeError):
    """A fault could not be injected or healed (its target is missing, a process would not stop)."""


@dataclass(kw_only=True)
class DrillEnvironment(Timeline):
    """The local fabric under test as injectors see it."""

    fabric: LocalFabric
    info: FabricInfo
    node_proxies: dict[str, FaultProxy] = field(default_factory=dict)
    redis_proxy: FaultProxy | None = None
    postgres_proxy: FaultProxy | None = None
    # Regions whose nodes run in network namespaces (chaos.faults.netns).
    sites: Sites | None = None
    seed: int = 0
    http_timeout_s: float = 5.0
    # The drill's load, for injectors that send requests of their own (a burst): its target,
    # the client history they record into, and the run's key prefix.
    load: Load | None = None
    load_target: LoadTarget | None = None
    writer: HistoryWriter | None = None
    key_prefix: str = "req"
    # The load's long streams as they run (None without load.long_streams): mid-stream
    # faults wait until they are under way and pick the nodes serving them.
    streams: StreamTracker | None = None
    # Work an injector started that must end before the history is read (its requests).
    background: list[asyncio.Task[None]] = field(default_factory=list)
    # Undone after the fabric stopped, last first, even when the run failed (a mount).
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.routers = RouterMetrics(tuple(self.info.router_urls), self.http_timeout_s, self.info.cluster_token)

    # -- targets -----------------------------------------------------------------------

    def live_nodes(self) -> list[Proc]:
        return sorted((p for p in self.fabric.node_processes if p.popen.poll() is None), key=lambda p: p.name)

    async def nodes(self, target: Target) -> list[Proc]:
        """Live nodes matching the target; `node: any` picks the busiest of them."""
        found = [p for p in self.live_nodes()
                 if target.matches(p.node_id or "", p.region or "", [p.model] if p.model else [], p.role)]
        if not found:
            raise InjectionError(f"no live node matches the target {target.model_dump(exclude_none=True)}")
        if target.node == "any":
            return [busiest(found, lambda p: p.node_id or "", await self.routers.requests_by_node(), self.seed)]
        return found

    def control_plane(self) -> Proc:
        """The replica nodes and routers use."""
        return self.control_planes()[0]

    def control_planes(self) -> list[Proc]:
        """Every control-plane replica, the one nodes and routers use first."""
        found = sorted((p for p in self.fabric.processes if p.name.startswith("control-plane")),
                       key=lambda p: (p.name != "control-plane", p.name))
        if not found:
            raise InjectionError("the fabric has no control plane process")
        return found

    def proxies_of(self, procs: Iterable[Proc]) -> list[FaultProxy]:
        out = []
        for p in procs:
            proxy = self.node_proxies.get(p.node_id or "")
            if proxy is None:
                raise InjectionError(f"{p.name} has no fault proxy in front of it")
            out.append(proxy)
        return out

    # -- processes ---------------------------------------------------------------------

    async def signal(self, procs: Iterable[Proc], sig: signal.Signals, *, reap: bool) -> None:
        """Send `sig` to each process; with `reap`, wait for them to exit."""
        procs = list(procs)
        for p in procs:
            p.popen.send_signal(sig)
            self.event("signal", f"{sig.name} {p.name} (pid {p.popen.pid})")
        if reap:
            await asyncio.gather(*(asyncio.to_thread(p.popen.wait, 30) for p in procs))

    async def restart(self, procs: Iterable[Proc], timeout_s: float = 120.0) -> list[Proc]:
        """Start exited processes again (same port and settings) and wait until each is healthy.

        They start at a low CPU priority, raised once they are up: on one machine a cold
        start would otherwise starve the nodes serving the drill's load.
        """
        fresh = [self.fabric.restart(p, niceness=COLD_START_NICENESS) for p in procs]
        for p in fresh:
            self.event("restart", f"{p.name} started again (pid {p.popen.pid})")
        await asyncio.gather(*(asyncio.to_thread(self.fabric.wait_healthy, p, timeout_s) for p in fresh))
        for p in fresh:
            renice(p.popen.pid, 0)
            self.event("healthy", f"{p.name} answers /health")
        return fresh

