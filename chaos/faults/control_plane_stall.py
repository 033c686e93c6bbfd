"""The control plane stalled (SIGSTOP, as a process starved of CPU or frozen in a pause
looks to its clients: sockets open, nothing answered) for longer than the node TTL, then
resumed (SIGCONT). Static stability: the control plane's own lag must not take a healthy
node out of service, and once it runs again it catches up without a storm.

What the watcher observes, from the injection to the end of the load:

- every routing table the control plane serves, fetched as a router fetches it (a long poll
  with the last ETag): `no_live_node_left_the_table` holds when each one lists, as ready,
  every node that was ready at the injection and is still running (a fabric node whose
  process exited is not "live"; nodes that are not fabric processes, e.g. a simulated
  fleet registered with the control plane, count as live throughout);
- the control plane's node list (admin API): `no_healthy_node_flapped` holds when none of
  those nodes was ever marked lost;
- `caught_up_without_storm`: no node registered again (its registered_at is unchanged), the
  routing version rose by at most `max_version_bumps` (default 0: heartbeats that change
  nothing routers see bump nothing), and every live node heartbeated after the resume.

Routers install only tables the control plane serves, so a table that drops a live node is
seen here whenever a router could have seen it (both long-poll the same version stream).
The fabric's real routers are watched too, by the table version each one serves (its
/metrics gauge): every version a router installed after the injection must be one the
watcher judged, and judged to keep every live node; a version the watcher never saw (it
skipped it between two polls) cannot be vouched for and fails the invariant as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx

from chaos.drill import Fault
from chaos.environment import DrillEnvironment, InjectionError
from chaos.history import History
from chaos.observe import RouterMetrics, answers
from localfabric import Proc
from meridian.admin_client import AdminAPIError, AsyncAdminClient
from meridian.contracts import NodeStatus, NodeView, RoutingTable

_NODES_EVERY_S = 0.5
_ROUTERS_EVERY_S = 1.0
_LONG_POLL_S = 2.0
_ROUTER_VERSION = "meridian_router_routing_table_version"


@dataclass
class _Seen:
    """What the watcher saw; each list is kept short (the report shows it)."""

    versions: int = 0
    max_version: int = -1
    dropped: list[str] = field(default_factory=list)  # "v12 at 21.3s: n1, n2"
    flapped: set[str] = field(default_factory=set)
    last_nodes: list[NodeView] = field(default_factory=list)
    judged: dict[int, bool] = field(default_factory=dict)  # table version -> kept every live node
    installed: set[tuple[str, int]] = field(default_factory=set)  # (router URL, version) after the injection


class ControlPlaneStall:
    """SIGSTOP the control plane nodes and routers use for the fault's window; SIGCONT at its end."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if fault.target.service not in (None, "control_plane"):
            raise InjectionError("control_plane_stall targets the control plane (target.service control_plane)")
        self._fault, self._env = fault, env
        self._max_bumps = int(fault.params.get("max_version_bumps", 0))
        self._victim: Proc | None = None
        self._baseline: dict[str, datetime] = {}  # ready node -> registered_at, at the injection
        self._version0 = -1
        self._resumed_at: datetime | None = None
        self._seen = _Seen()
        self._watching = True
        self._watchers: list[asyncio.Task[None]] = []

    async def inject(self) -> None:
        info = self._env.info
        async with AsyncAdminClient(info.control_plane_url, info.admin_key, timeout_s=5.0) as admin:
            nodes = await admin.nodes()
        self._baseline = {n.node_id: n.registered_at for n in nodes if n.status == NodeStatus.READY}
        if not self._baseline:
            raise InjectionError("no ready node to keep in service")
        table = await self._table(None)
        if table is None:
            raise InjectionError("the control plane serves no routing table")
        self._version0 = self._seen.max_version = table.version
        self._seen.judged[table.version] = True  # the baseline: what was ready then is in it
        self._env.event("baseline", f"{len(self._baseline)} ready nodes, routing version {table.version}")
        # Not env.background (awaited before observe()): they run until observe() stops them.
        self._watchers = [asyncio.create_task(self._watch_tables(table.version), name="chaos-stall-tables"),
                          asyncio.create_task(self._watch_nodes(), name="chaos-stall-nodes"),
                          asyncio.create_task(self._watch_routers(), name="chaos-stall-routers")]
        self._victim = self._env.control_plane()
        await self._env.signal([self._victim], signal.SIGSTOP, reap=False)
        stopped = not await answers(self._victim.url)
        self._env.event("check", f"control plane {'answers nothing' if stopped else 'STILL ANSWERS'}")

    async def heal(self) -> None:
        if self._victim is None:
            return
        self._resumed_at = datetime.now(UTC)
        await self._env.signal([self._victim], signal.SIGCONT, reap=False)

    def _live(self) -> set[str]:
        """Baseline nodes still running (a fabric node whose process exited is not live)."""
        exited = {p.node_id for p in self._env.fabric.node_processes if p.popen.poll() is not None}
        return set(self._baseline) - exited

    async def _table(self, etag: str | None) -> RoutingTable | None:
        """The next routing table (None: unchanged, or no answer within the poll)."""
        info = self._env.info
        headers = {"authorization": f"Bearer {info.cluster_token}"}
        params = {}
        if etag is not None:
            headers["if-none-match"] = etag
            params["wait"] = str(_LONG_POLL_S)
        try:
            async with httpx.AsyncClient(timeout=_LONG_POLL_S + 3.0) as http:
                r = await http.get(f"{info.control_plane_url}/v1/routing-table", headers=headers, params=params)
        except httpx.HTTPError:
            return None  # stopped: it answers nothing
        return RoutingTable.model_validate_json(r.content) if r.status_code == 200 else None

    async def _watch_tables(self, version: int) -> None:
        seen = self._seen
        while self._watching:
            table = await self._table(f'"{version}"')
            if table is None:
                await asyncio.sleep(0.2)  # refused or timed out: not a tight loop
                continue
            version = table.version
            seen.versions += 1
            seen.max_version = max(seen.max_version, version)
            ready = {n.node_id for n in table.nodes if n.status == NodeStatus.READY}
            missing = sorted(self._live() - ready)
            seen.judged[version] = not missing
            if missing and len(seen.dropped) < 20:
                seen.dropped.append(f"v{version} at {self._env.now_s():.1f}s: {', '.join(missing)}")
                self._env.event("dropped", f"routing table v{version} leaves out live node(s) {', '.join(missing)}")
            else:
                self._env.event("table", f"routing table v{version} keeps every live node")

    async def _watch_nodes(self) -> None:
        info = self._env.info
        async with AsyncAdminClient(info.control_plane_url, info.admin_key, timeout_s=2.0) as admin:
            while self._watching:
                with contextlib.suppress(AdminAPIError, ValueError, httpx.HTTPError):
                    self._seen.last_nodes = await admin.nodes()
                live = self._live()
                for n in self._seen.last_nodes:
                    if n.node_id in live and n.status == NodeStatus.LOST and n.node_id not in self._seen.flapped:
                        self._seen.flapped.add(n.node_id)
                        self._env.event("flap", f"live node {n.node_id} marked lost")
                await asyncio.sleep(_NODES_EVERY_S)

    async def _watch_routers(self) -> None:
        """The table version each real router serves (its /metrics gauge), noted when it moved
        past the baseline; judged in observe() against the tables the watcher saw."""
        info = self._env.info
        while self._watching:
            for url in info.router_urls:
                version = await RouterMetrics((url,), 2.0, info.cluster_token).metric(_ROUTER_VERSION)
                if version > self._version0:
                    self._seen.installed.add((url, int(version)))
            await asyncio.sleep(_ROUTERS_EVERY_S)

    def _routers_kept_every_live_node(self) -> bool:
        bad = sorted((v, url) for url, v in self._seen.installed if not self._seen.judged.get(v, False))
        for version, url in bad:
            why = "unseen by the watcher" if version not in self._seen.judged else "which leaves out a live node"
            self._env.event("router", f"router {url} installed routing table v{version} ({why})")
        self._env.event("routers", f"{len(self._env.info.router_urls)} router(s) installed "
                        f"{len(self._seen.installed)} table version(s) after the injection; "
                        f"{len(bad)} not shown to keep every live node")
        return not bad

    async def observe(self, history: History) -> Mapping[str, bool]:
        self._watching = False
        for task in self._watchers:
            await task
        routers_ok = self._routers_kept_every_live_node()
        return {
            "no_live_node_left_the_table": not self._seen.dropped and routers_ok,
            "no_healthy_node_flapped": not self._seen.flapped,
            "caught_up_without_storm": self._caught_up(),
        }

    def _caught_up(self) -> bool:
        seen, live = self._seen, self._live()
        nodes = {n.node_id: n for n in seen.last_nodes}
        again = sorted(i for i in live if i in nodes and nodes[i].registered_at != self._baseline[i])
        stale = sorted(i for i in live if i not in nodes or self._resumed_at is None
                       or nodes[i].last_heartbeat < self._resumed_at)
        bumps = seen.max_version - self._version0
        self._env.event("catch-up", f"{bumps} routing version bump(s) since the stall began (at most "
                        f"{self._max_bumps}); registered again: {', '.join(again) or 'none'}; "
                        f"no heartbeat since the resume: {', '.join(stale) or 'none'}")
        return not again and not stale and bumps <= self._max_bumps
