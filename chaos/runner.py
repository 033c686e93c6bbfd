"""Run a drill against a local fabric: start it as the drill's topology says, drive the
load, inject and heal the fault on time, watch the abort conditions, then check the
joined histories and write the report.

Every request's history comes from three sources: the load generator's client records,
and the journals of every router and node (meridian.request_journal), keyed by the
request's idempotency key. The fabric runs as separate processes; the proxies in front
of its nodes and of Redis run on this process's event loop, next to the load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from chaos.admin_api import AdminApi
from chaos.drill import Drill
from chaos.environment import DrillEnvironment, InjectionError
from chaos.faults.injector import (
    NotRunnable,
    create_injector,
    prepare_fabric,
    supported_kinds,
    unavailable,
)
from chaos.faults.netns import Sites, netns_unavailable
from chaos.faults.tcp_proxy import FaultProxy
from chaos.history import History, HistoryWriter
from chaos.load import LoadGenerator, LoadTarget, warm_up
from chaos.schedule import EventCallback, FaultState, RunOutcome, TickCallback, drive, finish
from chaos.sim_fleet import SimulatedFleet
from chaos.streams import reference_run
from localfabric import DEMO_MODEL, DEMO_REGIONS, FabricError, FabricInfo, FabricSpec, LocalFabric

log = logging.getLogger(__name__)

# Topology features the local runner cannot provide, with what is missing.
_UNSUPPORTED_TOPOLOGY: tuple[tuple[Callable[[Drill], bool], str], ...] = (
    (lambda d: d.topology.control_plane_replicas > 1 and not d.topology.postgres,
     "several control-plane replicas without Postgres (SQLite serves one replica)"),
)


@dataclass
class RunOptions:
    """Where a run writes and how it reports progress."""

    out_dir: Path
    short: bool = True
    seed: int = 0
    # Redis the routers share (through a fault proxy) when the drill's topology asks for it.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # The Postgres server a drill's control plane uses (a fresh database of its own, through
    # a fault proxy) when the topology asks for Postgres.
    postgres_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    # Settings of every router, over the drill's own: how a test builds a deliberately
    # broken fabric (e.g. MERIDIAN_ROUTER_MAX_ATTEMPTS=1, no retries) to show a drill fails.
    router_env: dict[str, str] = field(default_factory=dict)
    # Called with what the runner is doing, every monitor tick with the load's counters, and
    # with each of the fault's events (inject, heal, abort) as it happens.
    on_step: Callable[[str], None] | None = None
    on_tick: TickCallback | None = None
    on_event: EventCallback | None = None
    keep_fabric_dir: bool = False
    # Where the tiny checkpoint and its weight origin are kept between runs of a suite, so a
    # run copies them instead of generating and pushing them again (None: every run makes its own).
    model_cache_dir: Path | None = None


def runnable(drill: Drill) -> str | None:
    """Why the local runner cannot run `drill` yet; None when it can."""
    if drill.fault.kind not in supported_kinds():
        return f"no local injector for '{drill.fault.kind}' yet"
    why = unavailable(drill.fault.kind)
    if why is not None:
        return f"{drill.fault.kind} cannot be injected on this machine: {why}"
    if drill.topology.netns_regions:
        why = netns_unavailable()
        if why is not None:
            return f"nodes in network namespaces cannot run on this machine: {why}"
    for needs, what in _UNSUPPORTED_TOPOLOGY:
        if needs(drill):
            return f"the local runner cannot start {what} yet"
    return None


def run_drill(drill: Drill, options: RunOptions) -> RunOutcome:
    """Run one drill (its short version with options.short) and write its report."""
    return asyncio.run(_Run(drill, options).run())


class _Run:
    def __init__(self, drill: Drill, options: RunOptions) -> None:
        self.drill = drill.short_version() if options.short else drill
        self.options = options
        self.out = options.out_dir
        self.run_id = f"{self.drill.name}-{secrets.token_hex(3)}"
        self._step = options.on_step or (lambda _m: None)
        self._proxies: dict[str, FaultProxy] = {}
        self._redis_proxy: FaultProxy | None = None
        self._postgres_proxy: FaultProxy | None = None
        self._sites: Sites | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> RunOutcome:
        why = runnable(self.drill)
        if why is not None:
            raise NotRunnable(f"drill {self.drill.name}: {why}")
        self._loop = asyncio.get_running_loop()
        self.out.mkdir(parents=True, exist_ok=True)
        journals = self.out / "journals"
        shutil.rmtree(journals, ignore_errors=True)
        client_log = self.out / "client.jsonl"
        client_log.unlink(missing_ok=True)
        fabric_dir = self.out / "fabric"
        started_at = datetime.now(UTC)
        fabric = LocalFabric(self._spec(fabric_dir, journals), on_step=self._step)
        env: DrillEnvironment | None = None
        fleet: SimulatedFleet | None = None
        # Undone last first after the fabric stopped (the run's database).
        cleanups: list[Callable[[], None]] = []
        try:
            await self._services(fabric, cleanups)
            self._use_model_cache(fabric)
            self._step(f"starting the fabric for {self.drill.name}")
            info = await asyncio.to_thread(fabric.start)
            self._fill_model_cache(fabric)
            if self.drill.topology.simulated_nodes:
                fleet = await SimulatedFleet.start(info.control_plane_url, info.cluster_token,
                                                   self.drill.topology.simulated_nodes, self._step)
            target, region_zones = await self._ready(fabric, info, journals)
            state = FaultState()
            with HistoryWriter(client_log) as writer:
                env = DrillEnvironment(fabric=fabric, info=info, clock_start=0.0, node_proxies=self._proxies,
                                       redis_proxy=self._redis_proxy, postgres_proxy=self._postgres_proxy,
                                       sites=self._sites,
                                       seed=self.options.seed, cleanups=cleanups,
                                       load=self.drill.load, load_target=target, writer=writer,
                                       key_prefix=self.run_id, on_event=self.options.on_event)
                generator = LoadGenerator(self.drill.load, target, writer, seed=self.options.seed,
                                          key_prefix=self.run_id)
                if self.drill.load.long_streams is not None:
                    env.streams = generator.tracker
                    await self._reference(generator, target, writer, journals)
                await drive(self.drill, generator, env, state, lambda f: create_injector(f, env),
                            injection_errors=(InjectionError, OSError, FabricError),
                            on_tick=self.options.on_tick)
                # An injector's own requests (a burst) end before the history is read.
                if env.background:
                    await asyncio.gather(*env.background, return_exceptions=True)
            history = self._history(client_log, journals)
            invariants: dict[str, bool] = {}
            if state.injector is not None:
                invariants.update(await state.injector.observe(history))
        finally:
            if fleet is not None:
                await fleet.stop()
                if env is not None:
                    env.event("fleet", fleet.summary())
            await self._stop(fabric, cleanups, fabric_dir)
        assert env is not None
        self._step("checking the request history against the pass criteria")
        # A history read after every writer stopped: no journal line is still on its way.
        return finish(self.drill, short=self.options.short, started_at=started_at,
                      history=self._history(client_log, journals), region_zones=region_zones, env=env,
                      state=state, invariants=invariants, out_dir=self.out)

    # -- set-up ------------------------------------------------------------------------

    async def _services(self, fabric: LocalFabric, cleanups: list[Callable[[], None]]) -> None:
        """What the topology asks for besides the fabric: Redis and Postgres behind fault
        proxies, regions in network namespaces; their undoing goes into `cleanups`."""
        if self.drill.topology.redis:
            redis = urlsplit(self.options.redis_url)
            self._redis_proxy = FaultProxy("127.0.0.1", 0, redis.hostname or "127.0.0.1", redis.port or 6379,
                                           seed=self.options.seed)
            await self._redis_proxy.start()
            fabric.spec.router_env.update(self._redis_env())
        if self.drill.topology.postgres:
            fabric.spec.database_url = await self._postgres_database(cleanups)
        if self.drill.topology.netns_regions:
            sites = await asyncio.to_thread(Sites(tuple(self.drill.topology.netns_regions)).open)
            cleanups.append(sites.close)
            self._sites = sites
            # The control plane on the bridge: reached from this host and from the namespaces.
            fabric.spec.control_plane_host = sites.bridge_address
            fabric.spec.node_placement = sites.placement

    async def _ready(self, fabric: LocalFabric, info: FabricInfo,
                     journals: Path) -> tuple[LoadTarget, dict[str, list[str]]]:
        """Keys for the drill's tenants, routers and nodes warmed up, the journals emptied of
        the warm-up; the load's target and the control plane's region -> zones."""
        admin = AdminApi(info.control_plane_url, info.admin_key)
        keys = {t: k.secret for t, k in (await admin.create_tenant_keys(self.drill.load.tenants)).items()}
        target = LoadTarget(tuple(info.router_urls), keys, DEMO_MODEL, tuple(info.grpc_targets))
        await warm_up(target, on_step=self._step)
        await self._warm_nodes(fabric, info.cluster_token)
        _empty_journals(journals)
        return target, await admin.region_zones()

    async def _reference(self, generator: LoadGenerator, target: LoadTarget, writer: HistoryWriter,
                         journals: Path) -> None:
        """The long streams' unbroken answers from the healthy fabric, before the load: the
        text each migrated stream must match (chaos.streams); its journal lines are dropped."""
        ls = self.drill.load.long_streams
        assert ls is not None
        self._step(f"reference run: {ls.count} long streams on the healthy fabric")
        await reference_run(target.router_urls[0], target.api_keys, generator.long_requests(), writer,
                            ls.request_timeout_s)
        _empty_journals(journals)

    async def _stop(self, fabric: LocalFabric, cleanups: list[Callable[[], None]], fabric_dir: Path) -> None:
        """Stop the fabric and the proxies, undo the clean-ups last first, drop the large caches."""
        self._step("stopping the fabric")
        await asyncio.to_thread(fabric.stop)
        services = [p for p in (self._redis_proxy, self._postgres_proxy) if p is not None]
        for proxy in [*self._proxies.values(), *services]:
            await proxy.stop()
        for cleanup in reversed(cleanups):
            try:
                await asyncio.to_thread(cleanup)
            except Exception:  # one failed cleanup must not keep the others from running
                log.exception("cleaning up after %s failed", self.drill.name)
        if not self.options.keep_fabric_dir:
            # The checkpoint and weight caches are large; the logs are worth keeping.
            for sub in ("models", "origin", "weights"):
                shutil.rmtree(fabric_dir / sub, ignore_errors=True)

    def _spec(self, fabric_dir: Path, journals: Path) -> FabricSpec:
        topo = self.drill.topology
        router_env = {k: v for k, v in topo.env.items() if k.startswith("MERIDIAN_ROUTER_")}
        router_env.update(self.options.router_env)
        node_env = {k: v for k, v in topo.env.items() if k.startswith("MERIDIAN_NODE_")}
        spec = FabricSpec(
            work_dir=fabric_dir,
            regions=tuple(topo.regions or DEMO_REGIONS),
            nodes_per_region=topo.nodes_per_region,
            region_nodes=dict(topo.region_nodes),
            region_roles={r: tuple(roles) for r, roles in topo.region_roles.items()},
            routers=topo.routers,
            seed=self.options.seed,
            router_env=router_env,
            node_env=node_env,
            drain_timeout_s=10.0,
            control_plane_replicas=topo.control_plane_replicas,
            control_plane_env={k: v for k, v in topo.env.items() if k.startswith("MERIDIAN_CP_")},
            journal_dir=journals,
            node_front=self._front_node,
        )
        prepare_fabric(self.drill.fault, spec)
        return spec

    def _use_model_cache(self, fabric: LocalFabric) -> None:
        cache = self.options.model_cache_dir
        if cache is None or not (cache / "origin" / "meridian-manifest.json").exists():
            return
        fabric.spec.model_dir = cache / "model"
        # A copy: a drill may corrupt its origin on purpose.
        shutil.copytree(cache / "origin", fabric.origin_dir, dirs_exist_ok=True)

    def _fill_model_cache(self, fabric: LocalFabric) -> None:
        cache = self.options.model_cache_dir
        if cache is None or (cache / "origin" / "meridian-manifest.json").exists():
            return
        staging = cache.with_name(cache.name + f".tmp-{secrets.token_hex(3)}")
        shutil.copytree(fabric.spec.model_dir or fabric.spec.work_dir / "models" / fabric.spec.model_name,
                        staging / "model")
        shutil.copytree(fabric.origin_dir, staging / "origin")
        cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(cache)  # whole or not at all
        except OSError:  # another run filled it first
            shutil.rmtree(staging, ignore_errors=True)

    def _front_node(self, node_id: str, port: int) -> str:
        """Called from the fabric's thread: a fault proxy in front of the node, on our loop."""
        assert self._loop is not None
        existing = self._proxies.get(node_id)
        if existing is not None:  # a restarted node keeps its proxy (and its port)
            existing.upstream_port = port
            return f"http://127.0.0.1:{existing.port}"
        proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", port, seed=self.options.seed)
        asyncio.run_coroutine_threadsafe(proxy.start(), self._loop).result(timeout=10)
        self._proxies[node_id] = proxy
        return f"http://127.0.0.1:{proxy.port}"

    def _redis_env(self) -> dict[str, str]:
        assert self._redis_proxy is not None
        redis = urlsplit(self.options.redis_url)
        netloc = f"{redis.username or ''}{':' + redis.password if redis.password else ''}"
        netloc = f"{netloc}@" if netloc else ""
        proxied = urlunsplit((redis.scheme, f"{netloc}127.0.0.1:{self._redis_proxy.port}", redis.path, "", ""))
        return {
            "MERIDIAN_ROUTER_REDIS_URL": proxied,
            # Runs never see each other's (or a production router's) shared state.
            "MERIDIAN_ROUTER_FLEET_KEY_PREFIX": f"meridian:chaos:{self.run_id}:",
        }

    async def _postgres_database(self, cleanups: list[Callable[[], None]]) -> str:
        """A fresh database for the run's control plane, reached through a fault proxy."""
        import psycopg
        from psycopg import sql
        from sqlalchemy.engine import make_url

        server = make_url(self.options.postgres_url)
        name = f"meridian_chaos_{secrets.token_hex(6)}"
        maintenance = server.set(drivername="postgresql").render_as_string(hide_password=False)

        def execute(statement: sql.Composable) -> None:
            with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as conn:
                conn.execute(statement)

        await asyncio.to_thread(execute, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        # FORCE: the control plane's connections may outlive a failed run.
        cleanups.append(lambda: execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name))))
        self._postgres_proxy = FaultProxy("127.0.0.1", 0, server.host or "127.0.0.1", server.port or 5432,
                                          seed=self.options.seed)
        await self._postgres_proxy.start()
        return server.set(host="127.0.0.1", port=self._postgres_proxy.port, database=name).render_as_string(
            hide_password=False)

    async def _warm_nodes(self, fabric: LocalFabric, cluster_token: str) -> None:
        """One generation on every node: a node's first one is much slower than the rest."""
        body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "warm up"}],
                "max_tokens": self.drill.load.max_tokens}
        headers = {"authorization": f"Bearer {cluster_token}"}
        async with httpx.AsyncClient(timeout=60.0, headers=headers) as http:
            for p in fabric.node_processes:
                r = await http.post(f"{p.url}/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise FabricError(f"warming {p.name} up failed: {r.status_code} {r.text[:200]}")

    # -- results -----------------------------------------------------------------------

    def _history(self, client_log: Path, journals: Path) -> History:
        paths = [client_log, *sorted(journals.glob("*.jsonl"))] if journals.exists() else [client_log]
        return History.read(*[p for p in paths if p.exists()])


def _empty_journals(journals: Path) -> None:
    """Warm-up requests are not the drill's: the journals start empty (their writers append,
    so the next line lands at the start of the truncated file)."""
    for path in journals.glob("*.jsonl"):
        os.truncate(path, 0)
