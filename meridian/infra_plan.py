"""The infrastructure plan: the file `meridian iac synth` turns into Terraform stacks.

The control plane writes it from a placement plan (`control_plane.infra_export`); `iac/`
reads it and nothing else, so infrastructure can be synthesised without a control plane
(see `examples/plans/three-clouds.json`). It carries every fact the stacks need: the
regions and their residency zones, the deployments and their zones, one group per
placement assignment (deployment × region × instance type × spot), the on-prem sites
that run Kubernetes, and where the global pieces (Postgres, Redis, the endpoint's DNS
name) live.

Validation refuses a plan that breaks residency (a zoned deployment's group in a region
outside its zone), so no stack is ever synthesised from one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meridian import residency
from meridian.contracts import NODE_ID_PATTERN, ModelName, ProviderName, RegionName, ZoneName
from meridian.residency import GLOBAL_ZONE

FORMAT = "meridian-infra-plan/v1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InfraRegion(_Strict):
    """A region the plan uses; `location` is the cloud's own region name ("us-east-1")."""

    name: RegionName
    # Any well-formed provider name: iac refuses a plan with a provider it has no stacks for.
    provider: ProviderName
    location: str = Field(min_length=1, max_length=63)
    zones: list[ZoneName] = Field(min_length=1)
    # The availability zones to spread a group over: AWS zone IDs ("use1-az1", the same
    # physical zone in every account; subnets take them as availability_zone_id), GCP zone
    # names ("europe-west4-b").
    availability_zones: list[str] = Field(default_factory=list)

    def admits(self, zone: str) -> bool:
        """Whether a deployment bound to `zone` may have groups here (meridian.residency)."""
        return residency.admits(self.zones, zone)


class InfraDeployment(_Strict):
    """A deployment (one model) and the residency zone its replicas and weights must stay in."""

    model: ModelName
    zone: ZoneName = GLOBAL_ZONE
    # Where its weights are pushed (s3://, gs://, https://, file://); None: not yet pushed.
    weights_uri: str | None = None


class InfraGroup(_Strict):
    """One placement assignment: `instances` machines of one type for one deployment in one region."""

    model: ModelName
    region: RegionName
    # Cloud instance types ("p5.48xlarge", "a3-highgpu-8g"), GCP n1 hosts with attached GPUs
    # as the catalog names them ("n1+4xT4"), or an on-prem host class.
    instance_type: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,62}$")
    sku: str = Field(min_length=1, max_length=64)
    gpus_per_instance: int = Field(ge=1, le=64)
    instances: int = Field(ge=0, le=10_000)
    # The most the autoscaler may grow it to; at least `instances`.
    max_instances: int = Field(ge=0, le=10_000)
    spot: bool = False

    @model_validator(mode="after")
    def _max_covers_instances(self) -> InfraGroup:
        if self.max_instances < self.instances:
            raise ValueError(f"{self.model}@{self.region}/{self.instance_type}: max_instances < instances")
        return self


class KubernetesTarget(_Strict):
    """An on-prem site whose GPU hosts run Kubernetes: the node agent goes on as a DaemonSet."""

    config_context: str | None = None  # kubeconfig context; None: the current one
    namespace: str = Field("meridian", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    gpu_node_label: str = "nvidia.com/gpu.present"


class OnPremSite(_Strict):
    """An on-prem region; without `kubernetes` its hosts are an inventory and need no resources."""

    region: RegionName
    kubernetes: KubernetesTarget | None = None


class GlobalInfra(_Strict):
    """Where the control plane's state and the global endpoint live."""

    provider: Literal["aws", "gcp"]
    region: RegionName
    endpoint_domain: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$")
    dns_zone: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$")
    # The router addresses the endpoint's DNS name points at (anycast or per-region routers).
    router_addresses: list[str] = Field(default_factory=list)


class InfraPlan(_Strict):
    """Everything `iac` needs to synthesise one deployment of Meridian."""

    format: Literal["meridian-infra-plan/v1"] = FORMAT
    # A short name for this installation; prefixes every resource name.
    name: str = Field("meridian", pattern=NODE_ID_PATTERN)
    plan_id: str | None = None  # the placement plan it was written from
    control_plane_url: str = Field(pattern=r"^https?://")
    # What cloud-init installs on a GPU node (a pip requirement) and the node settings it gets.
    agent_package: str = "meridian"
    regions: list[InfraRegion]
    deployments: list[InfraDeployment]
    groups: list[InfraGroup]
    onprem_sites: list[OnPremSite] = Field(default_factory=list)
    global_: GlobalInfra = Field(alias="global")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _consistent_and_resident(self) -> InfraPlan:
        regions = {r.name: r for r in self.regions}
        if len(regions) != len(self.regions):
            raise ValueError("a region is listed twice")
        models = {d.model: d for d in self.deployments}
        if len(models) != len(self.deployments):
            raise ValueError("a deployment is listed twice")
        seen: set[tuple[str, str, str, bool]] = set()
        for g in self.groups:
            where = f"group {g.model}@{g.region}/{g.instance_type}"
            region = regions.get(g.region)
            if region is None:
                raise ValueError(f"{where}: region {g.region} is not in the plan's regions")
            deployment = models.get(g.model)
            if deployment is None:
                raise ValueError(f"{where}: deployment {g.model} is not in the plan's deployments")
            if not region.admits(deployment.zone):
                raise ValueError(
                    f"{where}: residency: deployment {g.model} is zoned {deployment.zone!r}, "
                    f"region {g.region} is in {region.zones}"
                )
            if region.provider == "onprem" and g.spot:
                raise ValueError(f"{where}: on-prem hosts have no spot market")
            key = (g.model, g.region, g.instance_type, g.spot)
            if key in seen:
                raise ValueError(f"{where}: listed twice")
            seen.add(key)
        for site in self.onprem_sites:
            r = regions.get(site.region)
            if r is None or r.provider != "onprem":
                raise ValueError(f"on-prem site {site.region} is not an on-prem region of the plan")
        g = self.global_
        if g.region not in regions or regions[g.region].provider != g.provider:
            raise ValueError(f"global: {g.region} is not a {g.provider} region of the plan")
        return self

    def region(self, name: str) -> InfraRegion:
        return next(r for r in self.regions if r.name == name)

    def deployment(self, model: str) -> InfraDeployment:
        return next(d for d in self.deployments if d.model == model)

    def zones_of(self, region: str) -> list[str]:
        """The residency zones whose data may live in `region`."""
        return self.region(region).zones

    def provider_regions(self) -> list[InfraRegion]:
        """Regions with at least one group or on-prem site, in name order (one stack each)."""
        used = {g.region for g in self.groups} | {s.region for s in self.onprem_sites}
        return sorted((r for r in self.regions if r.name in used), key=lambda r: r.name)
