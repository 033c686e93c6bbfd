"""Faults on the network, through the fault-injecting proxies the runner puts in front of
every node and of Redis (kernel latency injection is not available on these machines)."""

from __future__ import annotations

from collections.abc import Mapping

from chaos.admin_api import AdminApi
from chaos.admin_writes import AdminWrites
from chaos.drill import Fault
from chaos.environment import DrillEnvironment, InjectionError
from chaos.faults.tcp_proxy import FaultProxy
from chaos.history import History
from localfabric import Proc


class NodeLinkFault:
    """A proxy fault on the links to the target's nodes (one node, a region: a partition)."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []
        self._proxies: list[FaultProxy] = []
        self._ejections_before: dict[str, float] = {}

    async def inject(self) -> None:
        self._victims = await self._env.nodes(self._fault.target)
        self._proxies = self._env.proxies_of(self._victims)
        self._ejections_before = await self._env.routers.ejections(p.node_id or "" for p in self._victims)
        params = {k: float(v) for k, v in self._fault.params.items()}
        for p, proxy in zip(self._victims, self._proxies, strict=True):
            proxy.apply(self._fault.kind, params)
            self._env.event("inject", f"{self._fault.kind} {params or ''} on the link to {p.name}")

    async def heal(self) -> None:
        for p, proxy in zip(self._victims, self._proxies, strict=True):
            proxy.heal()
            self._env.event("heal", f"link to {p.name} healed")

    async def observe(self, history: History) -> Mapping[str, bool]:
        # Every node behind the cut must have been ejected by the routers at least once.
        ejected = await self._env.routers.all_ejected_since(self._ejections_before)
        return {"region_ejected": ejected, "outlier_ejected": ejected}


class RedisOutage:
    """Redis unreachable for the routers: every connection reset, new ones refused by reset."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if env.redis_proxy is None:
            raise InjectionError("redis_outage needs topology.redis: true (routers sharing state through Redis)")
        self._env = env
        self._proxy: FaultProxy = env.redis_proxy
        self._hits_at_start = 0.0
        self._hits_at_end = 0.0

    async def inject(self) -> None:
        self._hits_at_start = await self._env.routers.metric("meridian_router_predicted_cache_hit_tokens")
        self._proxy.reset(1.0)
        self._env.event("inject", f"Redis down: {self._proxy.stats.reset} connections reset, new ones refused")

    async def heal(self) -> None:
        self._hits_at_end = await self._env.routers.metric("meridian_router_predicted_cache_hit_tokens")
        self._proxy.heal()
        self._env.event("heal", "Redis reachable again")

    async def observe(self, history: History) -> Mapping[str, bool]:
        # Graceful: while shared state was gone the routers still predicted prefix-cache hits
        # from their own indexes and routing history instead of routing blind.
        return {"kv_routing_degraded_gracefully": self._hits_at_end > self._hits_at_start}


class PostgresRestart:
    """The control plane's Postgres goes away for `down_s` (every connection cut, new ones
    reset, as clients see a restart) while an operator keeps writing through the admin API."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if env.postgres_proxy is None:
            raise InjectionError("postgres_restart needs topology.postgres: true (a control plane on Postgres)")
        self._env = env
        self._proxy: FaultProxy = env.postgres_proxy
        self._writes = AdminWrites(AdminApi(env.info.control_plane_url, env.info.admin_key), env.key_prefix,
                                   env.event)

    async def inject(self) -> None:
        self._env.background.append(await self._writes.start_before_fault())
        self._proxy.reset(1.0)
        self._env.event("inject", f"Postgres down: {self._proxy.stats.reset} connections cut, new ones reset")

    async def heal(self) -> None:
        self._proxy.heal()
        self._env.event("heal", "Postgres accepts connections again")
        await self._writes.stop_after_heal()

    async def observe(self, history: History) -> Mapping[str, bool]:
        return await self._writes.verify()
