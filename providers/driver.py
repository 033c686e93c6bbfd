"""The runtime scaling interface every provider implements: node groups that grow and shrink.

A node group is the nodes of one instance type in one region that serve one deployment (an
AWS Auto Scaling group, a GCP managed instance group, a set of on-prem hosts). The control
plane's reconciler drives it; draining a node before its removal is the control plane's job
(routers must stop sending first), so a driver only adds capacity and removes named nodes.

Calls are idempotent: `ensure_group` of an existing group and `resize` to the current size
change nothing, so a reconciler that retries, or a new leader that repeats its predecessor's
last step, converges. A node's id is its host or instance name; the node agent running on
it registers with the control plane under that id.

A group's nodes share one prefill/decode role (`GroupSpec.role`, meridian.contracts.NodeRole):
a disaggregated deployment has a prefill group and a decode group where a co-located one has
a single group. A driver launches a prefill or decode group's nodes with that role
(`MERIDIAN_NODE_ROLE`, see `role_env`) and keeps the two groups apart (their own cloud
group, names and tags); a co-located group (`NodeRole.BOTH`) is named, tagged and launched
exactly as before roles existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from meridian.contracts import NodeRole
from meridian.registry import Registry

# NodeSettings.role's environment variable (meridian.settings: prefix MERIDIAN_NODE_).
ROLE_ENV = "MERIDIAN_NODE_ROLE"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What a node group is: its control-plane id, deployment, place and kind of machine."""

    group_id: str
    model: str
    provider: str
    region: str
    instance_type: str
    sku: str
    spot: bool = False
    # The nodes' prefill/decode role; BOTH (co-located) unless the deployment is disaggregated.
    role: NodeRole = NodeRole.BOTH

    @property
    def disaggregated(self) -> bool:
        return self.role is not NodeRole.BOTH


def role_env(spec: GroupSpec) -> dict[str, str]:
    """The node settings a group's role adds to its nodes' environment: `MERIDIAN_NODE_ROLE` for a
    prefill or decode group, nothing for a co-located one (whose nodes start as they always did)."""
    return {ROLE_ENV: spec.role.value} if spec.disaggregated else {}


@dataclass(frozen=True, slots=True)
class GroupState:
    """What the provider runs for a group now."""

    nodes: tuple[str, ...]
    gpus_per_node: int

    @property
    def size(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True, slots=True)
class PreemptionNotice:
    """A node the provider will take back (a spot interruption): drain it before `deadline`."""

    node: str
    deadline: datetime
    reason: str


@runtime_checkable
class NodeGroupDriver(Protocol):
    """One provider's node groups. Methods are async; callers bound them with timeouts."""

    provider: str

    async def ensure_group(self, spec: GroupSpec, known_nodes: Sequence[str] = ()) -> GroupState:
        """Create the group if it does not exist (idempotent); `known_nodes` are the nodes the
        control plane recorded for it, which a driver without durable state of its own adopts."""
        ...

    async def resize(self, spec: GroupSpec, size: int) -> GroupState:
        """Make the group `size` nodes; shrinking removes nodes of the driver's choosing."""
        ...

    async def list_nodes(self, spec: GroupSpec) -> GroupState:
        """The group's nodes as the provider reports them."""
        ...

    async def terminate(self, spec: GroupSpec, node: str) -> GroupState:
        """Remove one (drained) node and shrink the group by one; idempotent."""
        ...

    async def delete_group(self, spec: GroupSpec) -> None:
        """Remove the group and any node left in it; idempotent."""
        ...

    async def preemption_notices(self, spec: GroupSpec) -> list[PreemptionNotice]:
        """The group's nodes the provider has announced it will take back (spot interruptions)."""
        ...


@runtime_checkable
class FailsInstances(Protocol):
    """Optional capability of a driver, for chaos drills: end one instance as a hardware
    failure would. Its group is not told, so the group (or the reconciler) replaces it."""

    async def fail_instance(self, region: str, node: str) -> None:
        """End instance `node` in Meridian region `region` now; one already gone is no error."""
        ...


class DriverRegistry(Registry[NodeGroupDriver]):
    """Node-group drivers by provider name. The control plane builds one at start-up from
    the enabled providers (no global registry, so tests and several apps in one process each
    have their own); a provider without one is `UnknownName`, listing those there are."""

    def __init__(self) -> None:
        super().__init__("node-group driver")

    def register_driver(self, driver: NodeGroupDriver) -> None:
        """Add (or replace) the driver of `driver.provider`."""
        self.register(driver.provider, driver)

    def get_driver(self, provider: str) -> NodeGroupDriver:
        """The driver of `provider`; UnknownName when none is registered."""
        return self.get(provider)

    def providers(self) -> list[str]:
        return self.names()

