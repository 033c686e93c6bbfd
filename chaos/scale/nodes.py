"""Simulated nodes: the real node agent (`data_plane.agent.NodeAgent`), thousands per process,
without an engine or a listener.

Each simulated node is a NodeAgent as `meridian node run` builds it, so it speaks the node
protocol exactly as a node does, whatever that protocol becomes: it registers, takes the
heartbeat interval the control plane answers, heartbeats with a load that moves, registers
again when the control plane has forgotten it, backs off when it is unreachable, drains
(its status says DRAINING and it reports at once) and deregisters (`leave`). A death is an
agent closed without deregistering: it stops heartbeating, as a crashed node does.

What makes thousands fit in a process: one `FleetTransport` under every agent's HTTP
client, which carries their requests over one small keep-alive pool (chaos.scale.wire)
instead of a pool per node, and watches them go by (registrations, acknowledged reports
per node, 404s that mean a live node was reaped). One settings object is copied per node
(building settings reads the environment and config file: tens of ms each).

One process runs `agent_main` for its share of the fleet. The coordinator sends it
commands on a queue (`Kill`, `Drain`, `Leave`, `Stop`) and it reports on a shared events
queue: `AgentStats` every second and a `NodeEvent` for each command carried out, with the
monotonic time (CLOCK_MONOTONIC is one clock for every process of the machine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx
from pydantic import SecretStr

from chaos.scale.wire import WireError, WirePool
from data_plane.agent import NodeAgent
from localfabric.procs import die_with_parent
from meridian.contracts import NodeLoad, NodeStatus
from meridian.settings.node import NodeSettings

STATS_EVERY_S = 1.0
# The agent processes' niceness (see agent_main).
AGENT_NICE = 10
# /v1/nodes/{id}/<anything>: a node's own report (a heartbeat today).
_NODE_REPORT = re.compile(r"^/v1/nodes/([^/]+)/[^/]+$")


@dataclass(frozen=True, slots=True)
class SimNodeSpec:
    index: int
    node_id: str
    region: str
    model: str


@dataclass(frozen=True, slots=True)
class AgentJob:
    """One agent process's share of the fleet and where the control plane is."""

    index: int
    cp_host: str
    cp_port: int
    token: str
    nodes: list[SimNodeSpec]
    # Registrations are spread uniformly over this many seconds, as a fleet comes up.
    ramp_s: float
    pool_size: int = 128
    seed: int = 0
    # Each node answers HTTP on a listener of its own (127.0.0.1, any path: 200, empty), so
    # real routers' active probes find it healthy (a drill's fleet beside real routers); off,
    # its URL points at a port nothing listens on (nothing in a measurement calls a node).
    listen: bool = False
    # The processes' niceness (see agent_main): 0 where the fleet is small and the machine is
    # shared with other work (a CI test), where a lower priority would starve heartbeats.
    nice: int = AGENT_NICE


class Command(StrEnum):
    KILL = "kill"  # stop heartbeating (a crash): the reaper must notice
    DRAIN = "drain"  # report DRAINING from now on, at once
    LEAVE = "leave"  # deregister and stop (a drained node leaving)
    STOP = "stop"  # end of the run: stop every agent of the process


@dataclass(frozen=True, slots=True)
class NodeCommand:
    command: Command
    node_id: str = ""


@dataclass(frozen=True, slots=True)
class AgentStats:
    """Counters of one agent process since it started."""

    index: int
    at: float
    registered: int  # agents registered now
    alive: int  # agents still reporting (not killed, not left)
    acks: int  # reports (heartbeats) the control plane took
    errors: int  # requests that failed (unreachable, timeout, 5xx)
    timeouts: int  # of those, the ones the control plane did not answer in time
    refused: int  # registrations the control plane turned away (429, registration admission)
    reregistrations: int  # reports answered 404: the control plane had reaped a live node
    interval_s: float  # the median heartbeat interval the agents follow now


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A command carried out: `at` when (monotonic); for a kill, `acked_at` is the last report
    the control plane acknowledged; for a drain, `at` is when the DRAINING report was sent."""

    command: Command
    node_id: str
    at: float
    acked_at: float | None = None
    ok: bool = True


@dataclass
class Observed:
    acks: int = 0
    errors: int = 0
    timeouts: int = 0
    refused: int = 0
    reregistrations: int = 0
    last_ack: dict[str, float] = field(default_factory=dict)


class FleetTransport(httpx.AsyncBaseTransport):
    """Every agent's requests over one WirePool, observed on the way."""

    def __init__(self, pool: WirePool) -> None:
        self.pool = pool
        self.seen = Observed()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode()
        try:
            # The agent's own timeout (httpx passes it to its transport), on the exchange.
            timeout = request.extensions.get("timeout", {}).get("read")
            answer = await self.pool.request(request.method, path, await request.aread(), timeout)
        except WireError as exc:
            self.seen.errors += 1
            # A timeout on a kept-alive connection is retried once on a fresh one (WirePool)
            # and, if that times out too, arrives here as the WireError it caused.
            if isinstance(exc.__cause__, TimeoutError):
                self.seen.timeouts += 1
            raise httpx.ConnectError(str(exc), request=request) from exc
        except TimeoutError as exc:
            self.seen.errors += 1
            self.seen.timeouts += 1
            raise httpx.ReadTimeout("control plane did not answer in time", request=request) from exc
        self._observe(request.method, path, answer.status)
        return httpx.Response(answer.status, content=answer.body, headers={"content-type": "application/json"},
                              request=request)

    def _observe(self, method: str, path: str, status: int) -> None:
        if status >= 500:
            self.seen.errors += 1
        elif status == 429:
            self.seen.refused += 1
        if method != "POST":
            return
        m = _NODE_REPORT.match(path)
        if m is None:  # a registration: the agents' own `registered` counts those
            return
        if status == 404:
            self.seen.reregistrations += 1
        elif 200 <= status < 300:
            self.seen.acks += 1
            self.seen.last_ack[m.group(1)] = time.monotonic()

    async def aclose(self) -> None:
        # Each agent's client closes its transport with it; the pool outlives them all.
        return None


@dataclass
class SimNode:
    spec: SimNodeSpec
    agent: NodeAgent
    status: NodeStatus = NodeStatus.READY
    alive: bool = True
    start_task: asyncio.Task[None] | None = None


class AgentProcess:
    """The agents of one process, their shared transport and counters."""

    def __init__(self, job: AgentJob) -> None:
        self.job = job
        self.transport = FleetTransport(WirePool(job.cp_host, job.cp_port, job.token, job.pool_size))
        self.rng = random.Random(job.seed)
        self.sockets = {s.node_id: _listening_socket() for s in job.nodes} if job.listen else {}
        self._servers: list[asyncio.Server] = []
        base = NodeSettings(control_plane_url=f"http://{job.cp_host}:{job.cp_port}", region=job.nodes[0].region,
                            cluster_token=SecretStr(job.token))
        self.nodes = {s.node_id: self._node(base, s) for s in job.nodes}

    def _node(self, base: NodeSettings, spec: SimNodeSpec) -> SimNode:
        sock = self.sockets.get(spec.node_id)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}" if sock is not None else _dummy_url(spec.index)
        settings = base.model_copy(update={"node_id": spec.node_id, "region": spec.region, "advertise_url": url})
        holder: dict[str, SimNode] = {}
        agent = NodeAgent(settings, models=[spec.model], status=lambda: holder["n"].status, load=self._load,
                          transport=self.transport)
        holder["n"] = SimNode(spec, agent)
        return holder["n"]

    def _load(self) -> NodeLoad:
        running = self.rng.randint(0, 8)
        return NodeLoad(running=running, waiting=self.rng.randint(0, 2) if running > 6 else 0,
                        kv_cache_usage=round(self.rng.random(), 3))

    def stats(self) -> AgentStats:
        nodes = list(self.nodes.values())
        seen = self.transport.seen
        intervals = [n.agent.heartbeat_interval_s for n in nodes if n.agent.registered]
        return AgentStats(self.job.index, time.monotonic(), sum(n.agent.registered for n in nodes if n.alive),
                          sum(n.alive for n in nodes), seen.acks, seen.errors, seen.timeouts, seen.refused,
                          seen.reregistrations,
                          statistics.median(intervals) if intervals else 0.0)

    async def start(self) -> None:
        for sock in self.sockets.values():
            self._servers.append(await asyncio.start_server(_answer_ok, sock=sock))
        for node in self.nodes.values():
            node.start_task = asyncio.create_task(self._start(node))

    async def _start(self, node: SimNode) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, self.job.ramp_s))
        await node.agent.start()

    async def stop(self) -> None:
        for node in self.nodes.values():
            if node.start_task is not None:
                node.start_task.cancel()
        await asyncio.gather(*(n.agent.close() for n in self.nodes.values()), return_exceptions=True)
        await self.transport.pool.close()
        for server in self._servers:
            server.close()

    async def carry_out(self, cmd: NodeCommand) -> NodeEvent:
        node = self.nodes[cmd.node_id]
        if cmd.command is Command.KILL:
            node.alive = False
            await node.agent.close()
            return NodeEvent(cmd.command, cmd.node_id, time.monotonic(),
                             self.transport.seen.last_ack.get(cmd.node_id))
        if cmd.command is Command.DRAIN:
            node.status = NodeStatus.DRAINING
            sent = time.monotonic()
            ok = await node.agent.report_now()
            return NodeEvent(cmd.command, cmd.node_id, sent, time.monotonic() if ok else None, ok)
        node.alive = False  # LEAVE: stop reporting and deregister, as a drained node does
        sent = time.monotonic()
        ok = await node.agent.leave()
        await node.agent.close()
        return NodeEvent(cmd.command, cmd.node_id, sent, time.monotonic() if ok else None, ok)


def _dummy_url(index: int) -> str:
    # A loopback address of its own on a port nothing listens on (discard): nothing in a
    # measurement calls a node, and one that tried would be refused at once (no DNS).
    return f"http://127.{1 + index // 65536}.{index // 256 % 256}.{index % 256}:9"


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every request (a router's health probe: GET /metrics) answered 200 with no metric (an
    idle node), on a keep-alive connection; request bodies are not expected."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(_OK)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


def node_specs(count: int, regions: list[str], models: list[str], prefix: str = "sim") -> list[SimNodeSpec]:
    """`count` nodes spread round-robin over the regions, each serving one of the models."""
    return [SimNodeSpec(i, f"{prefix}-{i:05d}", regions[i % len(regions)], models[(i // len(regions)) % len(models)])
            for i in range(count)]


def agent_main(job: AgentJob, commands: Any, events: Any) -> None:
    """Entry point of an agent process (multiprocessing, spawn): runs until `Stop`."""
    die_with_parent()  # a coordinator killed outright must not leave a fleet behind
    # The simulated fleet stands in for thousands of machines of its own; here it shares two
    # cores with the control plane and the routers it measures, and its real NodeAgents (httpx,
    # ~2 ms of CPU a request) would take the CPU those need. At a lower priority it still gets
    # every idle cycle, and a node late for lack of CPU is counted (AgentStats), not hidden.
    os.nice(job.nice)
    # Thousands of agents each logging their registration (INFO) or the control plane's
    # absence (WARNING, once per outage) would drown the coordinator's progress lines.
    logging.getLogger("data_plane.agent").setLevel(logging.ERROR)
    asyncio.run(_agent_loop(job, commands, events))


async def _agent_loop(job: AgentJob, commands: Any, events: Any) -> None:
    proc = AgentProcess(job)
    await proc.start()
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[NodeCommand] = asyncio.Queue()

    def read_commands() -> None:  # a thread: multiprocessing queues block
        while True:
            cmd = commands.get()
            loop.call_soon_threadsafe(inbox.put_nowait, cmd)
            if cmd.command is Command.STOP:
                return

    threading.Thread(target=read_commands, daemon=True, name="agent-commands").start()

    async def report_stats() -> None:
        while True:
            events.put(proc.stats())
            await asyncio.sleep(STATS_EVERY_S)

    stats_task = asyncio.create_task(report_stats())
    pending: set[asyncio.Task[None]] = set()

    async def carry_out(cmd: NodeCommand) -> None:
        events.put(await proc.carry_out(cmd))

    while (cmd := await inbox.get()).command is not Command.STOP:
        task = asyncio.create_task(carry_out(cmd))
        pending.add(task)
        task.add_done_callback(pending.discard)
    stats_task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await proc.stop()
    events.put(proc.stats())
