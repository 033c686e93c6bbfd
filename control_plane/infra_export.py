"""A placement plan as an infrastructure plan: the file `meridian iac synth` reads.

The placement solver decides which instances each deployment runs where; the stacks need
more than that (each region's availability zones, GPUs per instance, the deployment's
residency zone and weights, where the control plane and the endpoint live). This module
joins the plan with the catalog and the deployments into a `meridian.infra_plan.InfraPlan`,
whose validation refuses anything that would break residency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from control_plane.placement.problem import Assignment
from meridian.contracts import GLOBAL_ZONE, NodeRole, RegionInfo
from meridian.infra_plan import (
    GlobalInfra,
    InfraDeployment,
    InfraGroup,
    InfraPlan,
    InfraRegion,
    KubernetesTarget,
    OnPremSite,
)
from providers.catalog import Catalog
from providers.offerings import Offering


@dataclass(frozen=True, slots=True)
class InfraOptions:
    """What the placement does not know: where the control plane and the endpoint live."""

    control_plane_url: str
    endpoint_domain: str
    dns_zone: str
    global_region: str  # e.g. "aws:us-east-1": Postgres, Redis and DNS go there
    router_addresses: tuple[str, ...] = ()
    name: str = "meridian"
    agent_package: str = "meridian"
    # On-prem regions whose GPU hosts run Kubernetes (the others are inventory hosts).
    kubernetes_sites: Mapping[str, KubernetesTarget] = field(default_factory=dict)
    # Deployments' weights locations (model -> URI), when pushed.
    weights_uris: Mapping[str, str] = field(default_factory=dict)
    # Headroom the autoscaler may grow a group to: max_instances = ceil(instances × this).
    max_scale: float = 2.0


class InfraExportError(ValueError):
    """The plan cannot be expressed as infrastructure (an unknown region or instance type)."""


def infra_plan(
    assignments: Sequence[Assignment],
    deployment_zones: Mapping[str, str],
    regions: Mapping[str, RegionInfo],
    catalog: Catalog,
    options: InfraOptions,
    plan_id: str | None = None,
) -> InfraPlan:
    """The infrastructure plan of `assignments` (one group each); deployments without any
    assignment are listed too, so their weights buckets exist before they are placed."""
    groups: list[InfraGroup] = []
    used_regions: set[str] = {options.global_region, *options.kubernetes_sites}
    disaggregated = sorted({a.deployment for a in assignments if a.role != NodeRole.BOTH})
    if disaggregated:
        # Terraform groups have no role yet: a prefill and a decode group would become one
        # co-located group under one name. Refused rather than written wrong.
        raise InfraExportError(
            f"prefill/decode-disaggregated deployments ({', '.join(disaggregated)}) cannot be exported as "
            "Terraform groups yet; the reconciler's cloud drivers create their role groups")
    for a in sorted(assignments, key=lambda a: a.key):
        offering = _offering(catalog, a)
        used_regions.add(a.region)
        groups.append(InfraGroup(
            model=a.deployment, region=a.region, instance_type=a.instance_type, sku=a.sku,
            gpus_per_instance=offering.gpu_count, instances=a.instances,
            max_instances=max(a.instances, math.ceil(a.instances * options.max_scale)), spot=a.spot,
        ))
    unknown = sorted(r for r in used_regions if r not in regions)
    if unknown:
        raise InfraExportError(f"unknown regions: {', '.join(unknown)}")
    return InfraPlan(
        name=options.name,
        plan_id=plan_id,
        control_plane_url=options.control_plane_url,
        agent_package=options.agent_package,
        regions=[_region(regions[r], catalog) for r in sorted(used_regions)],
        deployments=[
            InfraDeployment(model=m, zone=deployment_zones[m] or GLOBAL_ZONE, weights_uri=options.weights_uris.get(m))
            for m in sorted(deployment_zones)
        ],
        groups=groups,
        onprem_sites=[
            OnPremSite(region=r, kubernetes=options.kubernetes_sites.get(r))
            for r in sorted({g.region for g in groups if regions[g.region].provider == "onprem"}
                            | set(options.kubernetes_sites))
        ],
        global_=GlobalInfra(
            provider=_cloud(regions[options.global_region]), region=options.global_region,
            endpoint_domain=options.endpoint_domain, dns_zone=options.dns_zone,
            router_addresses=list(options.router_addresses),
        ),
    )


def _offering(catalog: Catalog, a: Assignment) -> Offering:
    for o in catalog.for_region(a.region):
        if o.instance_type == a.instance_type and o.sku == a.sku:
            return o
    raise InfraExportError(f"{a.region} offers no {a.instance_type} with {a.sku} in the catalog")


def _region(r: RegionInfo, catalog: Catalog) -> InfraRegion:
    zones = sorted({z for o in catalog.for_region(r.name) for z in o.availability_zones})
    return InfraRegion(name=r.name, provider=r.provider, location=r.location, zones=list(r.zones),
                       availability_zones=zones)


def _cloud(r: RegionInfo) -> Literal["aws", "gcp"]:
    """The cloud of the global stack's region: iac builds it on AWS or GCP only."""
    if r.provider == "aws":
        return "aws"
    if r.provider == "gcp":
        return "gcp"
    raise InfraExportError(f"the global stack needs a cloud region, not {r.name}")
