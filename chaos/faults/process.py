"""Faults on processes: crash (SIGKILL), hang (SIGSTOP), spot preemption (SIGTERM with a
drain deadline), a region's or provider's nodes all at once, and the control plane."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from chaos.drill import Fault
from chaos.environment import COLD_START_NICENESS, DrillEnvironment, InjectionError
from chaos.history import History, Outcome
from chaos.observe import answers, metric_samples
from localfabric import FabricSpec, Proc, renice
from meridian.admin_client import AdminAPIError, AsyncAdminClient
from meridian.contracts import NodeStatus

# A single node is killed while it is working on a request, so that failover of requests in
# flight is exercised; if it stays idle this long it is killed anyway (and the event says so).
_BUSY_WAIT_S = 5.0
_BUSY_POLL_S = 0.02


class NodeCrash:
    """SIGKILL the target's nodes (one, a region's, a provider's); restart them at the end."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []

    async def inject(self) -> None:
        self._victims = await self._env.nodes(self._fault.target)
        if len(self._victims) == 1:
            await self._until_busy(self._victims[0])
        await self._env.signal(self._victims, signal.SIGKILL, reap=True)

    async def _until_busy(self, p: Proc) -> None:
        """Until the node reports a request running (its vLLM-style gauge), or _BUSY_WAIT_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _BUSY_WAIT_S
        async with httpx.AsyncClient(timeout=1.0) as http:
            while loop.time() < deadline:
                try:
                    running = _running((await http.get(f"{p.url}/metrics")).text)
                except httpx.HTTPError:
                    running = 0
                if running > 0:
                    self._env.event("busy", f"{p.name} has {running} request(s) running")
                    return
                await asyncio.sleep(_BUSY_POLL_S)
        self._env.event("idle", f"{p.name} ran no request for {_BUSY_WAIT_S:g}s; killed idle")

    async def heal(self) -> None:
        victims, self._victims = self._victims, []
        if victims:
            await self._env.restart(victims)

    async def observe(self, history: History) -> Mapping[str, bool]:
        # A saturated fleet's drill: requests waited at the routers for room (and the history
        # shows whether every one of them was then answered).
        return {"flow_control_held": await self._env.routers.held_by_flow_control() > 0}


class NodeHang:
    """SIGSTOP the target's nodes: they keep their sockets open and answer nothing (a gray
    failure no connect error reveals); SIGCONT at the end."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []
        self._ejections_before: dict[str, float] = {}

    async def inject(self) -> None:
        self._victims = await self._env.nodes(self._fault.target)
        self._ejections_before = await self._env.routers.ejections(p.node_id or "" for p in self._victims)
        await self._env.signal(self._victims, signal.SIGSTOP, reap=False)

    async def heal(self) -> None:
        if self._victims:
            await self._env.signal(self._victims, signal.SIGCONT, reap=False)

    async def observe(self, history: History) -> Mapping[str, bool]:
        # Routers count every ejection they made; one for each hung node shows outlier detection
        # took it out (rather than requests merely timing out on it for the whole fault).
        return {"outlier_ejected": await self._env.routers.all_ejected_since(self._ejections_before)}


class SpotPreemption:
    """SIGTERM a node as a spot reclaim notice does; it must drain within the deadline.

    Once it has exited a replacement starts in the same region with a new node id, as the
    provider's group and the reconciler's driver replace a reclaimed instance; the fault's
    end waits for the replacement to be READY.
    """

    @staticmethod
    def prepare(fault: Fault, spec: FabricSpec) -> None:
        # Nodes drain for part of the deadline, leaving the rest to their own shutdown.
        spec.drain_timeout_s = max(1.0, float(fault.params["drain_deadline_s"]) * 0.7)

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._deadline_s = float(fault.params["drain_deadline_s"])
        self._victim: Proc | None = None
        self._drained_in_s: float | None = None
        self._replacement_ready = False
        self._replacing: asyncio.Task[None] | None = None

    async def inject(self) -> None:
        victims = await self._env.nodes(self._fault.target)
        if len(victims) != 1:
            raise InjectionError("spot_preemption targets one node: use node: any or a node id")
        self._victim = victims[0]
        sent = time.monotonic()
        await self._env.signal(victims, signal.SIGTERM, reap=False)
        self._replacing = asyncio.create_task(self._replace(self._victim, sent), name="chaos-replace")

    async def _replace(self, p: Proc, sent: float) -> None:
        # Waited for past the deadline, so a slow drain is measured rather than cut short.
        code = await asyncio.to_thread(p.popen.wait, self._deadline_s * 3 + 30)
        self._drained_in_s = time.monotonic() - sent
        self._env.event("exited", f"{p.name} exited with code {code} {self._drained_in_s:.2f}s after SIGTERM")
        region = p.region or ""
        fresh = await asyncio.to_thread(self._env.fabric.start_replacement_node, region, COLD_START_NICENESS)
        self._env.event("replace", f"{fresh.name} started in {region} (pid {fresh.popen.pid})")
        await asyncio.to_thread(self._env.fabric.wait_ready, fresh, 120.0)
        renice(fresh.popen.pid, 0)
        self._replacement_ready = True
        self._env.event("ready", f"{fresh.name} is ready in the routing table")

    async def heal(self) -> None:
        if self._replacing is not None:
            await self._replacing

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {
            "node_drained_within_deadline": self._drained_in_s is not None and self._drained_in_s <= self._deadline_s,
            "replacement_node_ready": self._replacement_ready,
        }


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
        self._confirmed_down = not await answers(self._victim.url)
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



_WATCH_INTERVAL_S = 0.5


class ClockSkew:
    """Restart one control-plane replica with its wall clock `offset_s` off (libfaketime
    preloaded; monotonic time stays real, as an NTP-skewed host's does), and watch that the
    replicas never both lead and that no live node is expired by the skewed clock."""

    @staticmethod
    def unavailable() -> str | None:
        return None if _faketime_env(0) is not None else "libfaketime is not installed (pip install 'meridian[chaos]')"

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if fault.target.service not in (None, "control_plane"):
            raise InjectionError("the local runner skews a control-plane replica's clock (target.service control_plane)")
        self._fault, self._env = fault, env
        self._offset = float(fault.params["offset_s"])
        self._victim: Proc | None = None
        self._watching = True
        self._two_leaders: list[str] = []
        self._flapped: set[str] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def inject(self) -> None:
        replicas = self._env.control_planes()
        # A standby when there is one: the replica nodes talk to keeps serving them.
        victim = replicas[-1]
        # Not one of env.background (awaited before observe()): it runs until observe() stops it.
        self._watcher = asyncio.create_task(self._watch(), name="chaos-clock-watch")
        await self._env.signal([victim], signal.SIGKILL, reap=True)
        fake = _faketime_env(self._offset)
        assert fake is not None
        self._victim = self._env.fabric.restart(victim, env=fake)
        self._env.event("restart", f"{victim.name} started again with its clock {self._offset:+g}s off")
        await asyncio.to_thread(self._env.fabric.wait_healthy, self._victim, 120.0)

    async def heal(self) -> None:
        if self._victim is None:
            return
        await self._env.signal([self._victim], signal.SIGKILL, reap=True)
        self._victim = self._env.fabric.restart(self._victim, env={"LD_PRELOAD": "", "FAKETIME": ""})
        self._env.event("restart", f"{self._victim.name} started again with the host's clock")
        await asyncio.to_thread(self._env.fabric.wait_healthy, self._victim, 120.0)

    async def _watch(self) -> None:
        """Until observe(): who claims leadership, and which live nodes the control plane expired."""
        info = self._env.info
        headers = {"authorization": f"Bearer {info.admin_key}"}
        async with (httpx.AsyncClient(timeout=2.0, headers=headers) as http,
                    AsyncAdminClient(info.control_plane_url, info.admin_key, timeout_s=2.0) as admin):
            while self._watching:
                leaders = []
                for url in info.control_plane_urls:
                    try:
                        view = (await http.get(f"{url}/v1/leader")).json()
                        if view.get("is_leader"):
                            leaders.append(str(view.get("replica")))
                    except (httpx.HTTPError, ValueError):
                        continue
                if len(leaders) > 1 and len(self._two_leaders) < 20:
                    self._two_leaders.append(f"{self._env.now_s():.1f}s: {', '.join(leaders)}")
                    self._env.event("two leaders", ", ".join(leaders))
                try:
                    nodes = await admin.nodes()
                except (AdminAPIError, ValueError):
                    nodes = []
                alive = {p.node_id for p in self._env.live_nodes()}
                for n in nodes:
                    if n.node_id in alive and n.status == NodeStatus.LOST and n.node_id not in self._flapped:
                        self._flapped.add(n.node_id)
                        self._env.event("flap", f"live node {n.node_id} marked lost")
                await asyncio.sleep(_WATCH_INTERVAL_S)

    async def observe(self, history: History) -> Mapping[str, bool]:
        self._watching = False
        if self._watcher is not None:
            await self._watcher
        return {"single_leader": not self._two_leaders, "no_healthy_node_flapped": not self._flapped}


def _faketime_env(offset_s: float) -> dict[str, str] | None:
    """Environment that preloads libfaketime with the wall clock `offset_s` off; None without it."""
    try:
        import libfaketime
    except ImportError:
        return None
    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    if not library.exists():
        return None
    return {
        "LD_PRELOAD": str(library),
        "FAKETIME": f"{offset_s:+g}s",
        # Leases and timeouts run on monotonic time, which a skewed wall clock leaves alone.
        "DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


def _running(metrics: str) -> int:
    """vllm:num_requests_running in a node's /metrics text (0 when absent)."""
    return int(sum(value for _, value in metric_samples(metrics, "vllm:num_requests_running")))
