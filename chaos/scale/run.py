"""One fleet-size point: start the real control plane on a fresh database, the routers and the
simulated fleet; measure; tear everything down. `run_point(spec)` returns its figures.

The schedule of a point, and what each phase measures:

1. start: control plane, real routers, router processes (their clients install the first
   table), then the agent processes; nodes join at `join_per_s`. With `routers_after_fleet`
   the routers start once the fleet has registered instead.
2. register: until every node is registered (or the point collapses: see below).
3. steady: `steady_s` of heartbeats only. Heartbeats asked (registered / interval) and
   reached (acknowledged per second), the control plane's CPU (cores = CPU seconds / wall
   seconds, from /proc), Postgres's (its backends for this database) and its write rate
   (pg_stat_database deltas), table versions seen (a steady fleet should make none).
4. table: the bytes of a full GET /v1/routing-table and how long it takes.
5. deaths: `deaths` nodes stop heartbeating, `gap_s` apart. For each: the time to notice
   (its last acknowledged heartbeat -> the control plane marks it lost, polled in Postgres)
   and the time from that mark to the last router excluding it (every in-process client,
   and each real router, whose /metrics table version is polled).
6. drains: `drains` nodes heartbeat DRAINING, `gap_s` apart: time from the heartbeat to
   the last router excluding it, and the control plane's CPU and the bytes sent to the
   routers per table change (the window's excess over the steady rate, per change). The
   drained nodes then deregister, as drained nodes do.
7. micro: a table install, a request's candidate scan, the KV index (chaos.scale.measure),
   and each real router's RSS.

A point collapses when the fleet cannot be kept registered: registration does not finish
within its ramp + `register_timeout_s` (and, when nodes join faster than that, at
MIN_ADMITTED_PER_S: a control plane that admits joins at the rate it can serve, turning the
rest away with 429 and a turn, registers a storm more slowly than it arrives, and that is
admission control working, not a collapse), or more than COLLAPSE_REAPED_SHARE of the live nodes
have been reaped as lost (their heartbeats answered 404: they fell behind the TTL). It is
then stopped there and says why (`collapsed`); the figures it reached are kept. A control
plane that answers fewer heartbeats than asked without reaping anyone has not collapsed: it
is slower than asked, which its figures and a note say.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import queue
import random
import secrets
import signal
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from chaos.attacks.target import rss_mib
from chaos.scale import measure, sites
from chaos.scale.nodes import (
    AGENT_NICE,
    AgentJob,
    AgentStats,
    Command,
    NodeCommand,
    NodeEvent,
    SimNodeSpec,
    agent_main,
    node_specs,
)
from chaos.scale.routers import Excluded, Install, RouterJob, RouterStats, router_main
from chaos.scale.stack import (
    DEFAULT_SERVER_URL,
    BackendCpu,
    LostWatch,
    PgCounters,
    ServerProc,
    cpu_seconds,
    router_table_version,
    scratch_database,
    start_control_plane,
    start_router,
)
from geo_router.state.table import LoadedTable
from meridian.contracts import NodeRegistered, NodeRegistration, NodeStatus, RoutingTable
from meridian.settings.control_plane import ControlPlaneSettings

MODELS = ["llama-3-8b", "mistral-7b", "llama-2-13b", "llama-3-70b"]
NODES_PER_AGENT_PROC = 2500
ROUTERS_PER_PROC = 25
PROGRESS_EVERY_S = 5.0
# A point has collapsed once this share of its live nodes has been reaped as lost.
# The slowest a control plane may admit a joining fleet before a point counts as collapsed.
MIN_ADMITTED_PER_S = 15.0
COLLAPSE_REAPED_SHARE = 0.25


@dataclass(frozen=True)
class PointSpec:
    nodes: int
    regions: int
    routers: int  # in-process table clients
    real_routers: int = 1
    steady_s: float = 20.0
    deaths: int = 5
    drains: int = 3
    gap_s: float = 1.5
    # Nodes join at this rate (registrations spread uniformly): a fleet coming up, or coming
    # back to a restarted control plane.
    join_per_s: float = 100.0
    register_timeout_s: float = 60.0
    exclusion_timeout_s: float = 60.0
    kv_blocks_per_node: int = 512
    # The routers' kv_events_max_rtt_ms (geo_router.state.kv_scope): their KV index holds the nodes of
    # the regions this near; the figure is the router that holds the most. None: every node.
    kv_scope_rtt_ms: float | None = 50.0
    cp_env: dict[str, str] = field(default_factory=dict)
    real_router_probes: bool = False
    # The routers start once the fleet has registered (a router fleet restarted under a
    # registered fleet) instead of before it (a fleet coming up under running routers).
    routers_after_fleet: bool = False
    server_url: str = DEFAULT_SERVER_URL
    log_dir: Path = Path("/tmp/meridian-scale")
    seed: int = 1
    # The agent processes' niceness (nodes.AGENT_NICE: the measured processes first).
    agent_nice: int = AGENT_NICE

    @property
    def ramp(self) -> float:
        return max(1.0, self.nodes / self.join_per_s)

    @property
    def register_deadline_s(self) -> float:
        """How long registration may take: the ramp and `register_timeout_s`, or the fleet
        admitted at MIN_ADMITTED_PER_S, whichever is longer."""
        return max(self.ramp + self.register_timeout_s, self.nodes / MIN_ADMITTED_PER_S)


def point_for(nodes: int, catalog_regions: int = 100) -> PointSpec:
    """The issue's curve: regions 10 -> 100 and routers 5 -> 50 as nodes go 100 -> 10,000
    (both with the square root of the fleet), regions capped by the catalog."""
    grow = math.sqrt(max(nodes, 1) / 100.0)
    return PointSpec(nodes=nodes, regions=min(catalog_regions, max(1, round(10 * grow))),
                     routers=max(1, round(5 * grow)), real_routers=1 if nodes <= 1000 else 2)


@dataclass
class PointResult:
    spec: PointSpec
    figures: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    collapsed: str | None = None


class Collapsed(Exception):
    """The control plane could not keep the fleet registered."""


@dataclass
class Events:
    """Everything the agent and router processes reported, filled by a reader thread."""

    agents: dict[int, AgentStats] = field(default_factory=dict)
    routers: dict[int, RouterStats] = field(default_factory=dict)
    installs: list[Install] = field(default_factory=list)
    excluded: dict[str, dict[int, Excluded]] = field(default_factory=lambda: defaultdict(dict))
    node_events: dict[tuple[Command, str], NodeEvent] = field(default_factory=dict)

    def take(self, item: Any) -> None:
        if isinstance(item, AgentStats):
            self.agents[item.index] = item
        elif isinstance(item, RouterStats):
            self.routers[item.index] = item
        elif isinstance(item, Install):
            self.installs.append(item)
        elif isinstance(item, Excluded):
            self.excluded[item.node_id][item.router] = item
        elif isinstance(item, NodeEvent):
            self.node_events[(item.command, item.node_id)] = item

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in list(self.agents.values()))

    def router_bytes(self) -> int:
        return sum(s.bytes_received for s in list(self.routers.values()))

    def router_tables(self) -> int:
        return sum(s.tables for s in list(self.routers.values()))

    def installed_nodes(self, since: float) -> dict[int, int]:
        """Per router, the node count of its latest install after `since`."""
        out: dict[int, int] = {}
        for i in list(self.installs):
            if i.at >= since:
                out[i.router] = i.nodes
        return out


class RealRouterWatch:
    """Polls each real router's table version; `first_seen(r, v)` is when router r first
    served a version >= v."""

    def __init__(self, routers: list[ServerProc], token: str, every_s: float = 0.05) -> None:
        self._routers, self._token, self._every_s = routers, token, every_s
        self.seen: list[list[tuple[int, float]]] = [[] for _ in routers]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="real-router-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def first_seen(self, router: int, version: int) -> float | None:
        return next((t for v, t in list(self.seen[router]) if v >= version), None)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.wait(self._every_s):
                for i, r in enumerate(self._routers):
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        v = router_table_version(http, r, self._token)
                        if v is not None and (not self.seen[i] or v > self.seen[i][-1][0]):
                            self.seen[i].append((v, time.monotonic()))


@dataclass
class Fleet:
    """The running point: processes, queues and what they reported."""

    spec: PointSpec
    cp: ServerProc
    database_url: str
    token: str
    progress: Callable[[str], None]
    events: Events = field(default_factory=Events)
    real: list[ServerProc] = field(default_factory=list)
    agent_procs: list[Any] = field(default_factory=list)
    commands: list[Any] = field(default_factory=list)
    router_procs: list[Any] = field(default_factory=list)
    owner: dict[str, int] = field(default_factory=dict)  # node id -> agent process
    victims: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    phase: str = "start"
    started: float = field(default_factory=time.monotonic)
    _stop_routers: Any = None
    _queue: Any = None
    _reading: threading.Event = field(default_factory=threading.Event)

    @property
    def cp_url(self) -> str:
        return self.cp.url

    def read_events(self) -> None:
        while not self._reading.is_set():
            with contextlib.suppress(queue.Empty):
                self.events.take(self._queue.get(timeout=0.2))

    def routers_total(self) -> int:
        return self.spec.routers + len(self.real)

    def asked_per_s(self) -> float:
        stats = list(self.events.agents.values())
        return sum(s.registered / s.interval_s for s in stats if s.interval_s > 0)

    def status_line(self, rate: float) -> str:
        ev = self.events
        with_table = sum(s.routers_with_table for s in list(ev.routers.values()))
        return (f"[scale {self.spec.nodes}n] phase={self.phase} registered={ev.total('registered')}/"
                f"{self.spec.nodes} heartbeats/s={rate:.0f} (asked {self.asked_per_s():.0f}) errors="
                f"{ev.total('errors')} (timeouts {ev.total('timeouts')}) refused={ev.total('refused')} reaped-live={ev.total('reregistrations')} routers={with_table}/"
                f"{self.spec.routers}+{len(self.real)} real")


def _pick_regions(table: RoutingTable, count: int) -> list[str]:
    """`count` of the control plane's regions, evenly spread over its sorted list (providers mixed)."""
    names = sorted(r.name for r in table.regions)
    if count >= len(names):
        return names
    return [names[round(i * len(names) / count)] for i in range(count)]


def _fetch_table(cp_url: str, token: str) -> tuple[bytes, float]:
    with httpx.Client(timeout=60.0) as http:
        times, body = [], b""
        for _ in range(3):
            t0 = time.perf_counter()
            r = http.get(cp_url + "/v1/routing-table", headers={"authorization": f"Bearer {token}"})
            times.append((time.perf_counter() - t0) * 1000.0)
            r.raise_for_status()
            body = r.content
    return body, statistics.median(times)


def _plan(f: Fleet, mp: Any) -> list[SimNodeSpec]:
    """The fleet's nodes and its victims (named in advance: the routers watch them)."""
    spec = f.spec
    nodes = node_specs(spec.nodes, f.regions, MODELS)
    picks = random.Random(spec.seed).sample(range(spec.nodes), k=min(spec.nodes, spec.deaths + spec.drains))
    f.victims = [nodes[i].node_id for i in picks]
    f._queue = mp.Queue()
    threading.Thread(target=f.read_events, daemon=True, name="scale-events").start()
    return nodes


def _start_routers(f: Fleet, mp: Any, log_dir: Path) -> None:
    spec = f.spec
    f.real = [start_router(i, f.cp_url, f.token, log_dir, spec.real_router_probes) for i in range(spec.real_routers)]
    f._stop_routers = mp.Event()
    procs = max(1, math.ceil(spec.routers / ROUTERS_PER_PROC))
    for p in range(procs):
        first = p * spec.routers // procs
        count = (p + 1) * spec.routers // procs - first
        job = RouterJob(p, first, count, f.cp_url, f.token, frozenset(f.victims))
        f.router_procs.append(mp.Process(target=router_main, args=(job, f._queue, f._stop_routers), daemon=True))
        f.router_procs[-1].start()


def _start_agents(f: Fleet, mp: Any, nodes: list[SimNodeSpec]) -> None:
    spec = f.spec
    agents = max(1, math.ceil(spec.nodes / NODES_PER_AGENT_PROC))
    host, _, port = f.cp_url.removeprefix("http://").partition(":")
    for a in range(agents):
        share = nodes[a::agents]
        for n in share:
            f.owner[n.node_id] = a
        cmds = mp.Queue()
        job = AgentJob(a, host, int(port), f.token, share, spec.ramp, seed=spec.seed * 1000 + a,
                       nice=spec.agent_nice)
        f.commands.append(cmds)
        f.agent_procs.append(mp.Process(target=agent_main, args=(job, cmds, f._queue), daemon=True))
        f.agent_procs[-1].start()


def _routers_ready(f: Fleet, r: PointResult) -> None:
    """Wait until every in-process router holds a table (routers started after the fleet)."""
    f.phase = "routers"
    t0 = time.monotonic()
    if not _wait(f, f.spec.register_timeout_s, lambda: sum(
            s.routers_with_table for s in list(f.events.routers.values())) >= f.spec.routers):
        raise Collapsed(f"the routers did not all get a table in {f.spec.register_timeout_s:.0f} s")
    r.figures["routers_first_table_s"] = time.monotonic() - t0


def _stop_processes(f: Fleet) -> None:
    for cmds in f.commands:
        cmds.put(NodeCommand(Command.STOP))
    if f._stop_routers is not None:
        f._stop_routers.set()
    for p in [*f.agent_procs, *f.router_procs]:
        p.join(20)
        if p.is_alive():
            p.terminate()
            p.join(5)
    f._reading.set()


class Rate:
    """Heartbeats acknowledged per second, from successive totals."""

    def __init__(self, f: Fleet) -> None:
        self._f = f
        self._last = (time.monotonic(), f.events.total("acks"))

    def sample(self) -> float:
        now, acks = time.monotonic(), self._f.events.total("acks")
        rate = (acks - self._last[1]) / max(1e-6, now - self._last[0])
        self._last = (now, acks)
        return rate


def _wait(f: Fleet, seconds: float, until: Callable[[], bool] = lambda: False) -> bool:
    """Wait up to `seconds`, printing progress; True as soon as `until()` holds."""
    deadline = time.monotonic() + seconds
    rate = Rate(f)
    next_line = time.monotonic() + PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        if until():
            return True
        for p in [*f.agent_procs, *f.router_procs]:
            if p.exitcode not in (None, 0):
                raise RuntimeError(f"a simulator process exited with code {p.exitcode}")
        if f.cp.popen.poll() is not None:
            raise Collapsed(f"the control plane exited: {f.cp.tail(500)}")
        reaped = f.events.total("reregistrations")
        if f.phase != "register" and reaped > COLLAPSE_REAPED_SHARE * f.spec.nodes:
            raise Collapsed(f"{reaped} live nodes reaped as lost (heartbeats fell behind the TTL): "
                            f"heartbeats reached {f.events.total('acks') / max(1.0, time.monotonic() - f.started):.0f}/s"
                            f" on average, {f.asked_per_s():.0f}/s asked")
        if time.monotonic() >= next_line:
            f.progress(f.status_line(rate.sample()))
            next_line += PROGRESS_EVERY_S
        time.sleep(0.05)
    return until()


def _register(f: Fleet, r: PointResult) -> None:
    f.phase = "register"
    t0 = time.monotonic()
    done = _wait(f, f.spec.register_deadline_s, lambda: f.events.total("registered") >= f.spec.nodes)
    r.figures["register_s"] = time.monotonic() - t0
    if not done:
        ev = f.events
        raise Collapsed(f"{ev.total('registered')}/{f.spec.nodes} nodes registered after "
                        f"{f.spec.register_deadline_s:.0f} s (joining at {f.spec.join_per_s:g}/s):"
                        f" {ev.total('reregistrations')} live nodes reaped as lost and registered again,"
                        f" {ev.total('acks')} heartbeats acknowledged, {len(ev.installs)} table installs"
                        f" by {f.spec.routers} in-process routers")
    _wait(f, 3.0)  # the last registrations' table versions settle


def _steady(f: Fleet, r: PointResult, pg: PgCounters) -> None:
    f.phase = "steady"
    backends = BackendCpu(f.database_url)
    backends.start()
    try:
        t0, cpu0, snap0 = time.monotonic(), cpu_seconds(f.cp.pid), pg.snapshot()
        acks0, rereg0, installs0 = f.events.total("acks"), f.events.total("reregistrations"), len(f.events.installs)
        asked = f.asked_per_s()
        collapsed: Collapsed | None = None
        try:
            _wait(f, f.spec.steady_s)
        except Collapsed as exc:  # the window so far is still measured, then the point stops
            collapsed = exc
        dt = time.monotonic() - t0
        cpu = cpu_seconds(f.cp.pid) - cpu0
        snap = pg.snapshot()
    finally:
        backends.stop()
    pgcpu = backends.total()
    reached = (f.events.total("acks") - acks0) / dt
    fig = r.figures
    fig["heartbeats_asked_per_s"] = asked
    fig["heartbeats_reached_per_s"] = reached
    # The control plane's whole CPU over the window: heartbeats and the routers' long-polls.
    fig["cp_cpu_cores"] = cpu / dt
    fig["cp_cpu_ms_per_heartbeat"] = cpu / max(1.0, reached * dt) * 1000.0
    fig["pg_cpu_cores"] = pgcpu / dt
    sdt = max(1e-6, snap.at - snap0.at)
    fig["pg_commits_per_s"] = (snap.commits - snap0.commits) / sdt
    fig["pg_rows_written_per_s"] = ((snap.inserted - snap0.inserted) + (snap.updated - snap0.updated)
                                    + (snap.deleted - snap0.deleted)) / sdt
    fig["pg_rows_updated_per_s"] = (snap.updated - snap0.updated) / sdt
    fig["steady_table_installs"] = float(len(f.events.installs) - installs0)
    reaped = f.events.total("reregistrations") - rereg0
    fig["reaped_live_nodes"] = float(f.events.total("reregistrations"))
    if reached < 0.9 * asked:
        r.notes.append(f"the control plane fell behind: heartbeats reached {reached:.0f}/s of {asked:.0f}/s asked")
    if reaped:
        r.notes.append(f"{reaped} live nodes reaped as lost in the steady window ({dt:.0f} s)")
    if collapsed is not None:
        raise collapsed


def _excluded_everywhere(f: Fleet, node_id: str, real: RealRouterWatch) -> float | None:
    """When the last router (in-process or real) excluded the node; None while one has not."""
    seen = f.events.excluded.get(node_id, {})
    if len(seen) < f.spec.routers:
        return None
    last = max(e.at for e in seen.values())
    version = min(e.version for e in seen.values())
    for i in range(len(f.real)):
        t = real.first_seen(i, version)
        if t is None:
            return None
        last = max(last, t)
    return last


def _deaths(f: Fleet, r: PointResult, real: RealRouterWatch, lost: LostWatch) -> None:
    f.phase = "deaths"
    dead = f.victims[: f.spec.deaths]
    collapsed: Collapsed | None = None
    try:
        for node_id in dead:
            lost.watch(node_id)
            f.commands[f.owner[node_id]].put(NodeCommand(Command.KILL, node_id))
            _wait(f, f.spec.gap_s)
        done = _wait(f, _paced_ttl_s(f.spec) + f.spec.exclusion_timeout_s,
                     lambda: all(_excluded_everywhere(f, n, real) is not None for n in dead))
    except Collapsed as exc:  # the deaths seen so far are still measured, then the point stops
        collapsed, done = exc, False
    notice, to_routers = [], []
    for node_id in dead:
        killed = f.events.node_events.get((Command.KILL, node_id))
        lost_at, everywhere = lost.lost_at.get(node_id), _excluded_everywhere(f, node_id, real)
        if killed is not None and killed.acked_at is not None and lost_at is not None:
            notice.append(lost_at - killed.acked_at)
        if lost_at is not None and everywhere is not None:
            to_routers.append(max(0.0, everywhere - lost_at))
    _death_stages(f, r, dead, lost)
    if not done:
        r.notes.append(f"only {len(to_routers)}/{len(dead)} deaths reached every router in "
                       f"{_paced_ttl_s(f.spec) + f.spec.exclusion_timeout_s:.0f} s: {_missing(f, dead, real, lost)}")
    _put_percentiles(r, "death_notice", notice)
    _put_percentiles(r, "death_to_all_routers", to_routers)
    if collapsed is not None:
        raise collapsed


def _death_stages(f: Fleet, r: PointResult, dead: list[str], lost: LostWatch) -> None:
    """Where a death's time to the in-process routers goes: from `lost` to the start of the
    build that excluded it (the wake and the build spacing), from there to the first router's
    install (the build, the delta, its parse), and from the first router to the last."""
    wall_minus_mono = time.time() - time.monotonic()
    to_build, to_first, first_to_last = [], [], []
    for node_id in dead:
        seen = list(f.events.excluded.get(node_id, {}).values())
        lost_at = lost.lost_at.get(node_id)
        if lost_at is None or not seen:
            continue
        first = min(seen, key=lambda e: e.at)
        built = first.built_at - wall_minus_mono
        to_build.append(built - lost_at)
        to_first.append(first.at - built)
        if len(seen) == f.spec.routers:
            first_to_last.append(max(e.at for e in seen) - first.at)
    _put_percentiles(r, "death_lost_to_build", to_build)
    _put_percentiles(r, "death_build_to_first_router", to_first)
    _put_percentiles(r, "death_first_to_last_router", first_to_last)


def _paced_ttl_s(spec: PointSpec) -> float:
    """The TTL the control plane holds a fleet of this size to (control_plane.heartbeat_pacing:
    the interval grows past nodes / max_heartbeats_per_s, the TTL in proportion): a death is
    noticed no sooner, so the wait for it to reach every router starts from there."""
    defaults = ControlPlaneSettings.model_fields
    env = spec.cp_env

    def setting(name: str) -> float | None:
        raw = env.get(f"MERIDIAN_CP_{name.upper()}")
        return float(raw) if raw is not None else defaults[name].default

    interval, ttl, rate = setting("heartbeat_interval_s"), setting("node_ttl_s"), setting("max_heartbeats_per_s")
    assert interval is not None and ttl is not None
    paced = interval if rate is None else max(interval, spec.nodes / rate)
    return paced * ttl / interval


def _missing(f: Fleet, nodes: list[str], real: RealRouterWatch, lost: LostWatch | None = None) -> str:
    """Where each node that did not reach every router stopped (for the note that says so)."""
    out = []
    for node_id in nodes:
        if _excluded_everywhere(f, node_id, real) is not None:
            continue
        seen = f.events.excluded.get(node_id, {})
        version = min((e.version for e in seen.values()), default=None)
        reals = [v[-1][0] if v else None for v in real.seen]
        marked = "?" if lost is None else ("lost" if node_id in lost.lost_at else "not marked lost")
        out.append(f"{node_id} ({marked}; excluded by {len(seen)}/{f.spec.routers} in-process routers from"
                   f" version {version}; real routers at {reals})")
    return "; ".join(out)


def _drains(f: Fleet, r: PointResult, real: RealRouterWatch) -> None:
    f.phase = "drains"
    drained = f.victims[f.spec.deaths:]
    if not drained:
        return
    for node_id in drained:
        f.commands[f.owner[node_id]].put(NodeCommand(Command.DRAIN, node_id))
        _wait(f, f.spec.gap_s)
    _wait(f, f.spec.exclusion_timeout_s, lambda: all(_excluded_everywhere(f, n, real) is not None for n in drained))
    times = []
    for node_id in drained:
        ev, everywhere = f.events.node_events.get((Command.DRAIN, node_id)), _excluded_everywhere(f, node_id, real)
        if ev is not None and everywhere is not None:
            times.append(max(0.0, everywhere - ev.at))
    _put_percentiles(r, "drain_to_all_routers", times)
    if len(times) < len(drained):
        r.notes.append(f"only {len(times)}/{len(drained)} drains reached every router: {_missing(f, drained, real)}")
    for node_id in drained:  # a drained node leaves
        f.commands[f.owner[node_id]].put(NodeCommand(Command.LEAVE, node_id))


def _changes(f: Fleet, r: PointResult) -> None:
    """CPU and bytes per table change with the fleet paused (SIGSTOP), so that heartbeats do
    not drown them: `changes` nodes join one after another, each once every router has the
    last. The pause stays well inside the node TTL, so no paused node is reaped."""
    f.phase = "changes"
    headers = {"authorization": f"Bearer {f.token}", "content-type": "application/json"}
    with httpx.Client(base_url=f.cp_url, timeout=30.0, headers=headers) as http:
        ack = NodeRegistered.model_validate_json(http.post("/v1/nodes/register", content=_join(f, 0)).content)
        _wait(f, 2.0)  # that first join settles
        budget = ack.ttl_s - ack.heartbeat_interval_s - 3.0
        if budget < 3.0:
            r.notes.append(f"no paused change window: the TTL ({ack.ttl_s:g} s) is too short")
            return
        for p in f.agent_procs:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            paused_at = time.monotonic()
            time.sleep(0.5)  # heartbeats in flight are answered
            t0, cpu0 = time.monotonic(), cpu_seconds(f.cp.pid)
            time.sleep(1.0)
            idle_rate = (cpu_seconds(f.cp.pid) - cpu0) / (time.monotonic() - t0)
            t0, cpu0, bytes0, tables0 = time.monotonic(), cpu_seconds(f.cp.pid), f.events.router_bytes(), f.events.router_tables()
            base = max(f.events.installed_nodes(0.0).values())
            done = 0
            for i in range(1, 4):
                if time.monotonic() - paused_at > budget:
                    break
                http.post("/v1/nodes/register", content=_join(f, i)).raise_for_status()
                want = base + i
                if not _wait(f, budget - (time.monotonic() - paused_at), lambda want=want: len(
                        [n for n in f.events.installed_nodes(t0).values() if n >= want]) >= f.spec.routers):
                    break
                done = i
            time.sleep(2 * 0.25)  # the routers' byte counters are reported every 0.25 s
            dt = time.monotonic() - t0
            cpu = cpu_seconds(f.cp.pid) - cpu0
        finally:
            for p in f.agent_procs:
                os.kill(p.pid, signal.SIGCONT)
    if not done:
        r.notes.append("no table change reached every router within the paused window")
        return
    r.figures["cp_cpu_s_per_table_change"] = max(0.0, cpu - idle_rate * dt) / done
    r.figures["cp_cpu_cores_idle_longpolls"] = idle_rate
    r.figures["bytes_per_table_change"] = (f.events.router_bytes() - bytes0) / done
    r.figures["table_fetches_per_change"] = (f.events.router_tables() - tables0) / done
    r.notes.append(f"per table change: {done} joins with the fleet paused, {f.spec.routers} in-process + "
                   f"{len(f.real)} real routers; bytes counted at the in-process routers")


def _join(f: Fleet, i: int) -> bytes:
    return NodeRegistration(node_id=f"join-{i:03d}", region=f.regions[0], url=f"http://127.0.0.1:{9000 + i}",
                            models=[MODELS[0]], status=NodeStatus.READY).model_dump_json().encode()


def _put_percentiles(r: PointResult, name: str, xs: list[float]) -> None:
    r.figures[f"{name}_p50_s"] = statistics.median(xs) if xs else None
    r.figures[f"{name}_p99_s"] = _p99(xs) if xs else None
    r.figures[f"{name}_samples"] = float(len(xs))


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _installs(f: Fleet, r: PointResult) -> None:
    full = [i.install_ms for i in f.events.installs if i.nodes >= 0.9 * f.spec.nodes]
    r.figures["router_table_install_inflight_p50_ms"] = statistics.median(full) if full else None
    r.figures["router_table_install_inflight_p99_ms"] = _p99(full) if full else None


def _real_rss(f: Fleet, r: PointResult) -> None:
    if f.real:
        r.figures["router_rss_table_mib"] = max(rss_mib(p.pid) for p in f.real)
        r.figures["router_rss_peak_mib"] = max(rss_mib(p.pid, "VmHWM") for p in f.real)


def _micro(f: Fleet, r: PointResult, body: bytes) -> None:
    """Run with the fleet stopped: these time this process's CPU, which the fleet would share."""
    f.progress(f"[scale {f.spec.nodes}n] micro-measures on a {len(body)} B table")
    r.figures["router_table_full_install_ms"] = measure.full_table_install_ms(body)
    loaded = LoadedTable.build(RoutingTable.model_validate_json(body))
    r.figures["router_table_install_ms"] = measure.table_install_ms(loaded)
    r.figures["select_candidates_us"] = measure.select_us(loaded, MODELS[0])
    workload = measure.KVWorkload(nodes=f.spec.nodes, blocks_per_node=f.spec.kv_blocks_per_node, models=len(MODELS))
    kv = measure.kv_index(workload)
    r.figures["kv_index_mib"] = kv.index_mib
    r.figures["kv_ingest_events_per_s"] = kv.events_per_s
    r.notes.append(f"KV index: {workload.describe()}; an event is one BlockStored of {measure.CHAIN_BLOCKS} blocks")
    held_mib = kv.index_mib
    if (scope := f.spec.kv_scope_rtt_ms) is not None:
        nodes, centre = measure.kv_scope_nodes(loaded, scope)
        held_mib = measure.kv_index(replace(workload, nodes=nodes)).index_mib
        r.figures["kv_scope_nodes"] = nodes
        r.figures["kv_index_scoped_mib"] = held_mib
        r.notes.append(f"KV scope: kv_events_max_rtt_ms={scope:g}; a router at {centre} indexes the most"
                       f" nodes, {nodes} of {f.spec.nodes}")
    rss = r.figures.get("router_rss_table_mib")
    if rss is not None:
        r.figures["router_rss_mib"] = rss + held_mib
        r.figures["router_rss_unscoped_mib"] = rss + kv.index_mib


def run_point(spec: PointSpec, progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
              ) -> PointResult:
    """Run one point against a fresh database; never raises for a collapse (see `collapsed`)."""
    result = PointResult(spec)
    token = secrets.token_urlsafe(24)
    log_dir = spec.log_dir / f"{spec.nodes}n"
    t_start = time.monotonic()
    # Past the catalog's regions, colocation sites beside real ones (chaos.scale.sites).
    inventory = sites.inventory_for(spec.regions, log_dir / "inventory.yaml")
    cp_env = {**({"MERIDIAN_CP_ONPREM_INVENTORY": str(inventory)} if inventory else {}), **spec.cp_env}
    with scratch_database(spec.server_url) as database_url:
        cp = start_control_plane(database_url, token, log_dir, cp_env)
        f = Fleet(spec, cp, database_url, token, progress)
        mp = multiprocessing.get_context("spawn")
        pg = PgCounters(database_url)
        lost = LostWatch(database_url)
        real: RealRouterWatch | None = None
        body = b""
        try:
            table = RoutingTable.model_validate_json(_fetch_table(f.cp_url, token)[0])
            f.regions = _pick_regions(table, spec.regions)
            if len(f.regions) < spec.regions:
                result.notes.append(f"the catalog has {len(table.regions)} regions: {len(f.regions)} used"
                                    f" instead of {spec.regions}")
            result.figures["regions"] = float(len(f.regions))
            nodes = _plan(f, mp)
            lost.start()
            if spec.routers_after_fleet:
                _start_agents(f, mp, nodes)
                _register(f, result)
                _start_routers(f, mp, log_dir)
                _routers_ready(f, result)
            else:
                _start_routers(f, mp, log_dir)
                _start_agents(f, mp, nodes)
                _register(f, result)
            real = RealRouterWatch(f.real, token)
            real.start()
            _steady(f, result, pg)
            body, get_ms = _fetch_table(f.cp_url, token)
            result.figures["table_bytes"] = float(len(body))
            result.figures["table_get_ms"] = get_ms
            _deaths(f, result, real, lost)
            _drains(f, result, real)
            _changes(f, result)
            _installs(f, result)
            _real_rss(f, result)
        except Collapsed as exc:
            result.collapsed = str(exc)
            progress(f"[scale {spec.nodes}n] collapsed in phase {f.phase}: {exc}")
            with contextlib.suppress(Exception):
                _installs(f, result)
            # What a router pays per table and request does not need a stable fleet: measured on
            # the control plane's own table grown to the point's size.
            with contextlib.suppress(httpx.HTTPError):
                body = measure.grown_table(_fetch_table(f.cp_url, token)[0], f.regions, MODELS, spec.nodes)
                result.figures.setdefault("table_bytes", float(len(body)))
            result.notes.append(f"collapsed: the micro-measures ran on the control plane's table grown to"
                                f" {spec.nodes} nodes; no real router RSS")
        finally:
            if real is not None:
                real.stop()
            lost.stop()
            _stop_processes(f)
            for p in f.real:
                p.stop()
            cp.stop()
            pg.close()
    if body:
        _micro(f, result, body)
    result.figures["wall_s"] = time.monotonic() - t_start
    return result

