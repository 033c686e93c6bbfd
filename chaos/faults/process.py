"""Faults on processes: crash (SIGKILL), hang (SIGSTOP), spot preemption (SIGTERM with a
drain deadline), a region's or provider's nodes all at once, and the control plane."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Mapping

from chaos.drill import Fault
from chaos.environment import COLD_START_NICENESS, DrillEnvironment, InjectionError
from chaos.faults.injector import register
from chaos.history import History, Outcome
from meridian.localfabric import Proc, renice


@register("process_crash", "region_outage", "provider_outage")
class NodeCrash:
    """SIGKILL the target's nodes (one, a region's, a provider's); restart them at the end."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []

    async def inject(self) -> None:
        self._victims = self._env.nodes(self._fault.target)
        await self._env.signal(self._victims, signal.SIGKILL, reap=True)

    async def heal(self) -> None:
        victims, self._victims = self._victims, []
        if victims:
            await self._env.restart(victims)

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {}


@register("process_hang")
class NodeHang:
    """SIGSTOP the target's nodes: they keep their sockets open and answer nothing (a gray
    failure no connect error reveals); SIGCONT at the end."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []
        self._ejections_before: dict[str, float] = {}

    async def inject(self) -> None:
        self._victims = self._env.nodes(self._fault.target)
        for p in self._victims:
            self._ejections_before[p.node_id or ""] = await self._env.router_metric(
                "meridian_router_ejections", node=p.node_id or "")
        await self._env.signal(self._victims, signal.SIGSTOP, reap=False)

    async def heal(self) -> None:
        if self._victims:
            await self._env.signal(self._victims, signal.SIGCONT, reap=False)

    async def observe(self, history: History) -> Mapping[str, bool]:
        # Routers count every ejection they made; one for each hung node shows outlier detection
        # took it out (rather than requests merely timing out on it for the whole fault).
        ejected = True
        for p in self._victims:
            after = await self._env.router_metric("meridian_router_ejections", node=p.node_id or "")
            ejected &= after > self._ejections_before.get(p.node_id or "", 0.0)
        return {"outlier_ejected": bool(self._victims) and ejected}


@register("spot_preemption")
class SpotPreemption:
    """SIGTERM a node as a spot reclaim notice does; it must drain within the deadline.

    At the fault's end a replacement is started in the same region with a new node id, as
    the reconciler's driver does after a cloud reclaims an instance.
    """

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._deadline_s = float(fault.params["drain_deadline_s"])
        self._victim: Proc | None = None
        self._drained_in_s: float | None = None
        self._replacement_ready = False
        self._waiter: asyncio.Task[None] | None = None

    async def inject(self) -> None:
        victims = self._env.nodes(self._fault.target)
        if len(victims) != 1:
            raise InjectionError("spot_preemption targets one node: use node: any or a node id")
        self._victim = victims[0]
        sent = time.monotonic()
        await self._env.signal(victims, signal.SIGTERM, reap=False)
        self._waiter = asyncio.create_task(self._wait_exit(self._victim, sent))

    async def _wait_exit(self, p: Proc, sent: float) -> None:
        # Waited for past the deadline, so a slow drain is measured rather than cut short.
        code = await asyncio.to_thread(p.popen.wait, self._deadline_s * 3 + 30)
        self._drained_in_s = time.monotonic() - sent
        self._env.event("exited", f"{p.name} exited with code {code} {self._drained_in_s:.2f}s after SIGTERM")

    async def heal(self) -> None:
        if self._victim is None:
            return
        if self._waiter is not None:
            await self._waiter
        region = self._victim.region or ""
        fresh = await asyncio.to_thread(self._env.fabric.start_replacement_node, region, COLD_START_NICENESS)
        self._env.event("replace", f"{fresh.name} started in {region} (pid {fresh.popen.pid})")
        await asyncio.to_thread(self._env.fabric.wait_ready, fresh, 120.0)
        renice(fresh.popen.pid, 0)
        self._replacement_ready = True
        self._env.event("ready", f"{fresh.name} is ready in the routing table")

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {
            "node_drained_within_deadline": self._drained_in_s is not None and self._drained_in_s <= self._deadline_s,
            "replacement_node_ready": self._replacement_ready,
        }


@register("control_plane_outage")
class ControlPlaneOutage:
    """SIGKILL the control plane for the fault's window, then start it again on the same
    port and database: routers and nodes must serve on from their last routing table."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victim: Proc | None = None
        self._confirmed_down = False

    async def inject(self) -> None:
        self._victim = self._env.control_plane()
        await self._env.signal([self._victim], signal.SIGKILL, reap=True)
        self._confirmed_down = not await self._env.answers(self._victim.url)
        self._env.event("check", f"control plane {'unreachable' if self._confirmed_down else 'STILL ANSWERS'}")

    async def heal(self) -> None:
        if self._victim is not None:
            await self._env.restart([self._victim])

    async def observe(self, history: History) -> Mapping[str, bool]:
        # Static stability: answers completed while the control plane was really gone.
        f = self._fault
        served = any(
            op.outcome is Outcome.OK and f.start_s <= op.invoke_s < f.end_s for op in history.client
        )
        return {"served_from_snapshot": self._confirmed_down and served}

