"""A deployment as the fault injectors of a deployed run see it (chaos.faults.deployed):
the nodes its control plane lists, the busiest of them, and the run's clock and event log.

It lives apart from the run (chaos.deployed), which creates the injectors, so that the
injectors can name what they act on without importing the module that imports them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from chaos.admin_api import AdminApi, AdminApiError
from chaos.deployment import Deployment
from chaos.drill import Fault, Target
from chaos.environment import InjectionError
from chaos.observe import RouterMetrics, answers, busiest
from chaos.timeline import Timeline
from meridian.contracts import NodeRole, NodeStatus, NodeView


@dataclass(frozen=True, slots=True)
class DeployedNode:
    """A node as the control plane lists it."""

    node_id: str
    region: str
    provider: str
    url: str
    models: tuple[str, ...]
    status: str
    role: NodeRole = NodeRole.BOTH

    @classmethod
    def of(cls, view: NodeView) -> DeployedNode:
        return cls(node_id=view.node_id, region=view.region, provider=view.provider, url=view.url,
                   models=tuple(view.models), status=view.status, role=view.role)

    def fields(self) -> dict[str, str]:
        """What a command template may say about the node (chaos.deployment.NODE_FIELDS)."""
        return {"node_id": self.node_id, "region": self.region, "provider": self.provider, "url": self.url,
                "host": urlsplit(self.url).hostname or "", "model": ",".join(self.models)}


@dataclass(kw_only=True)
class DeployedEnvironment(Timeline):
    """The deployment as injectors see it."""

    deployment: Deployment
    admin: AdminApi
    run_id: str
    seed: int = 0

    def __post_init__(self) -> None:
        self.routers = RouterMetrics(tuple(self.deployment.routers), token=self.deployment.metrics_token())

    def run_fields(self, fault: Fault) -> dict[str, str]:
        """The run's and the fault's template fields (a command's node fields come per node)."""
        fields = {"run_id": self.run_id, "kind": fault.kind, "deployment": self.deployment.name}
        fields.update({f"param_{k}": str(v) for k, v in fault.params.items()})
        return fields

    async def nodes(self, target: Target) -> list[DeployedNode]:
        """Ready nodes matching the target; `node: any` picks the busiest of them."""
        found = [n for n in await self.ready_nodes() if target.matches(n.node_id, n.region, n.models, n.role)]
        if not found:
            raise InjectionError(f"no ready node of {self.deployment.name} matches the target "
                                 f"{target.model_dump(exclude_none=True)}")
        if target.node == "any":
            return [busiest(found, lambda n: n.node_id, await self.routers.requests_by_node(), self.seed)]
        return found

    async def ready_nodes(self) -> list[DeployedNode]:
        """The deployment's ready nodes, sorted by id."""
        nodes = (await self.all_nodes()).values()
        return sorted((n for n in nodes if n.status == NodeStatus.READY), key=lambda n: n.node_id)

    async def all_nodes(self) -> dict[str, DeployedNode]:
        """Every node the control plane lists (any status), by id."""
        try:
            return {n.node_id: n for n in map(DeployedNode.of, await self.admin.nodes())}
        except (AdminApiError, httpx.HTTPError) as exc:
            raise InjectionError(f"listing the nodes of {self.deployment.name} failed: {exc}") from exc

    async def ready_counts(self, regions: Iterable[str]) -> dict[str, int]:
        """How many ready nodes each region has now."""
        ready = await self.ready_nodes()
        return {r: sum(n.region == r for n in ready) for r in regions}

    async def wait_for_ready(self, want: Mapping[str, int], timeout_s: float, exclude: Set[str] = frozenset(),
                             poll_s: float = 1.0) -> bool:
        """Until each region has `want` ready nodes besides `exclude` (True), or the timeout (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ready = [n for n in await self.ready_nodes() if n.node_id not in exclude]
            if all(sum(n.region == r for n in ready) >= count for r, count in want.items()):
                self.event("healthy", f"ready nodes back to {dict(want)}")
                return True
            if loop.time() >= deadline:
                self.event("check", f"ready nodes not back to {dict(want)} within {timeout_s:g}s")
                return False
            await asyncio.sleep(poll_s)

    async def control_plane_answers(self) -> bool:
        """Whether the control plane answers /health right now."""
        return await answers(self.deployment.control_plane)
