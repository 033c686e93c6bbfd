"""What every cloud region's stack (AWS, GCP) is made of, in this order: its provider and own
variables, the addresses of the routers that may reach its nodes, its network, and its GPU
node groups when the plan places any there. The order is the order of the synthesised JSON,
so it is fixed here once rather than in each cloud's stack."""

from __future__ import annotations

from typing import ClassVar

from cdktf import TerraformStack, TerraformVariable
from constructs import Construct

from iac import layout
from iac.layout import RegionStack
from meridian.infra_plan import InfraPlan


class CloudRegionStack(TerraformStack):
    """A cloud region's stack; a cloud's subclass makes its resources in the three hooks."""

    # The router_cidrs variable's description: what the cloud's network calls itself.
    ROUTER_CIDRS_DESCRIPTION: ClassVar[str]

    def __init__(self, scope: Construct, plan: InfraPlan, rs: RegionStack) -> None:
        super().__init__(scope, rs.name)
        self.plan, self.rs = plan, rs
        self.location = rs.region.location
        self.prefix = layout.prefix(plan)
        self._provider()
        self.router_cidrs = TerraformVariable(
            self, "router_cidrs", type="list(string)", default=[], description=self.ROUTER_CIDRS_DESCRIPTION
        )
        self._network()
        if rs.groups:
            self._nodes()

    def _provider(self) -> None:
        """The cloud's provider and the stack's own variables."""
        raise NotImplementedError

    def _network(self) -> None:
        raise NotImplementedError

    def _nodes(self) -> None:
        """The GPU node groups and what they need (called only when the region has groups)."""
        raise NotImplementedError
