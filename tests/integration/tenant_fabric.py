"""A real torch-engine node behind a real router, in this event loop, with several tenants:
what the tenant-isolation tests attack (issue 18).

The node is the node app of `meridian node run` (tiny generated checkpoint, cluster token);
the router is the router app on a static routing table naming the node and the tenants.
Both run under uvicorn on free ports, so clients talk real HTTP to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from pydantic import SecretStr
from router_harness import CLUSTER_TOKEN, REGIONS, ServerGroup, router_settings

from data_plane.server.app import create_app as create_node_app
from geo_router import create_app as create_router_app
from geo_router.app import RouterState
from geo_router.state.table import StaticTableSource
from meridian.contracts import NodeStatus, RoutingNode, RoutingTable, TenantEntry
from meridian.http_server import limited_config, openai_error_body
from meridian.security import hash_api_key
from meridian.settings.node import NodeSettings

MODEL = "tiny-llama"
NODE_ID = "eu-node-1"


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    zone: str = "eu"
    cache_group: str | None = None

    def entry(self) -> TenantEntry:
        return TenantEntry(key_hash=hash_api_key(self.key), key_prefix=self.key[:10], tenant=self.name,
                           zone=self.zone, cache_group=self.cache_group)


@dataclass
class TenantFabric:
    router_url: str
    node_url: str
    router: FastAPI
    node: FastAPI

    @property
    def state(self) -> RouterState:
        return self.router.state.router  # type: ignore[no-any-return]

    def client(self, tenant: Tenant, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 30)
        return httpx.AsyncClient(base_url=self.router_url,
                                 headers={"authorization": f"Bearer {tenant.key}"}, **kwargs)

    def node_ejected(self) -> bool:
        return self.state.fleet.is_ejected(NODE_ID)


def node_settings(checkpoint: Path, **overrides: Any) -> NodeSettings:
    values: dict[str, Any] = {
        "model_dir": checkpoint, "model_name": MODEL, "control_plane_url": None,
        "cluster_token": SecretStr(CLUSTER_TOKEN), "node_id": NODE_ID, "region": REGIONS["eu"].name,
        # Short answers by default: the tests send many requests.
        "max_tokens_limit": 16, "max_num_seqs": 16,
    }
    values.update(overrides)
    return NodeSettings(**values)


@contextlib.asynccontextmanager
async def tenant_fabric(
    checkpoint: Path, tenants: Sequence[Tenant], *, node: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None, plain_listener: bool = False,
) -> AsyncIterator[TenantFabric]:
    """Serve a node and a router in front of it for `tenants` until the block ends; the
    router on the listener `meridian router serve` uses (or uvicorn's plain one)."""
    servers = ServerGroup()
    try:
        node_app = create_node_app(node_settings(checkpoint, **(node or {})))
        node_url = await servers.start(node_app)
        await node_app.state.runtime.wait_ready()
        table = RoutingTable(
            version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()),
            nodes=[RoutingNode(node_id=NODE_ID, region=REGIONS["eu"].name, url=node_url, models=[MODEL],
                               status=NodeStatus.READY)],
            tenants=[t.entry() for t in tenants], deployments=[],
        )
        settings = router_settings(**(router or {}))
        router_app = create_router_app(settings, table_source=StaticTableSource(table))
        config = None if plain_listener else limited_config(
            router_app, settings, openai_error_body, lifespan="on", log_level="warning", timeout_graceful_shutdown=2)
        router_url = await servers.start(router_app, config=config)
        yield TenantFabric(router_url, node_url, router_app, node_app)
    finally:
        await servers.stop()
