"""A fleet of simulated nodes beside a drill's real fabric (`topology.simulated_nodes`).

Why: a drill's local fabric runs a handful of real nodes, too few for what only a fleet
shows (a reaper that expires a share of a region per pass, a control plane that catches up
with hundreds of nodes retrying at once). The simulated nodes are the fleet simulator's
(chaos.scale.nodes): the real node agent, in one extra process, speaking the node protocol
to the drill's control plane with its cluster token, at the heartbeat interval it answers.

What they are to the drill: nodes of the catalog's regions (round-robin), serving models the
drill's load never asks for (chaos.scale.run.MODELS), so no request of the load reaches them;
each answers HTTP on a listener of its own, so the fabric's real routers probe them healthy.
They are in the control plane's node list and in every routing table like the real nodes,
so what a fault's watcher judges over "every node ready at the injection" covers them.

`SimulatedFleet.start` returns once every node is registered; `stop` ends the process (its
agents stop without deregistering, as at a crash: the fabric is stopped right after).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from chaos.scale.nodes import AgentJob, AgentStats, Command, NodeCommand, agent_main, node_specs
from chaos.scale.run import MODELS
from meridian.contracts import RoutingTable

# Nodes join at this rate, as a fleet comes up (registrations spread uniformly).
JOIN_PER_S = 100.0
REGISTER_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class FleetError(RuntimeError):
    """The simulated fleet could not be started (its process exited, or it did not register)."""


@dataclass
class SimulatedFleet:
    """The fleet's process, its command queue and the counters it last reported."""

    size: int
    process: Any
    commands: Any
    events: Any
    stats: AgentStats | None = None
    _reading: threading.Event = field(default_factory=threading.Event)

    @classmethod
    async def start(cls, control_plane_url: str, token: str, size: int,
                    on_step: Callable[[str], None] = lambda _m: None) -> SimulatedFleet:
        """`size` simulated nodes over the catalog's regions, registered with the control plane."""
        regions = await _catalog_regions(control_plane_url, token)
        url = urlsplit(control_plane_url)
        job = AgentJob(0, url.hostname or "127.0.0.1", url.port or 80, token,
                       node_specs(size, regions, MODELS), ramp_s=max(1.0, size / JOIN_PER_S),
                       pool_size=32, listen=True)
        mp = multiprocessing.get_context("spawn")
        fleet = cls(size, None, mp.Queue(), mp.Queue())
        fleet.process = mp.Process(target=agent_main, args=(job, fleet.commands, fleet.events), daemon=True,
                                   name="chaos-sim-fleet")
        on_step(f"starting {size} simulated nodes in {len(regions)} regions")
        fleet.process.start()
        threading.Thread(target=fleet._read, daemon=True, name="chaos-sim-fleet-events").start()
        try:
            await fleet._registered(job.ramp_s + REGISTER_TIMEOUT_S)
        except BaseException:
            await fleet.stop()
            raise
        return fleet

    def _read(self) -> None:
        while not self._reading.is_set():
            with contextlib.suppress(queue.Empty):
                item = self.events.get(timeout=0.2)
                if isinstance(item, AgentStats):
                    self.stats = item

    async def _registered(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stats is None or self.stats.registered < self.size:
            if self.process.exitcode is not None:
                raise FleetError(f"the simulated fleet's process exited (code {self.process.exitcode})")
            if time.monotonic() > deadline:
                got = self.stats.registered if self.stats else 0
                raise FleetError(f"{got}/{self.size} simulated nodes registered after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    def summary(self) -> str:
        s = self.stats
        if s is None:
            return f"{self.size} simulated nodes: no report"
        return (f"{s.registered}/{self.size} simulated nodes registered, {s.acks} heartbeats acknowledged, "
                f"{s.errors} failed, {s.reregistrations} answered 404 (reaped while live), "
                f"interval {s.interval_s:g} s")

    async def stop(self) -> None:
        """Stop every agent and the process (killed if it lingers)."""
        if self.process.exitcode is None:
            self.commands.put(NodeCommand(Command.STOP))
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5)
        self._reading.set()


async def _catalog_regions(control_plane_url: str, token: str) -> list[str]:
    """The regions of the control plane's catalog, as the routing table lists them."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        r = await http.get(f"{control_plane_url}/v1/routing-table", headers={"authorization": f"Bearer {token}"})
    r.raise_for_status()
    regions = sorted(reg.name for reg in RoutingTable.model_validate_json(r.content).regions)
    if not regions:
        raise FleetError("the control plane's routing table lists no region")
    return regions
