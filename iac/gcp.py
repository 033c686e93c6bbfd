"""One GCP region's stack: network, node service account, weights bucket, instance templates and MIGs.

Instance templates are regional (compute_region_instance_template): each one carries its region's
subnetwork and node settings, so the same machine type in two regions of one project gets two
templates under the one name providers.gcp.naming gives it.
"""

from __future__ import annotations

import re

from cdktf import (
    Fn,
    TerraformOutput,
    TerraformResourceLifecycle,
    TerraformVariable,
    Token,
)
from cdktf_cdktf_provider_google.compute_firewall import ComputeFirewall, ComputeFirewallAllow
from cdktf_cdktf_provider_google.compute_network import ComputeNetwork
from cdktf_cdktf_provider_google.compute_region_instance_group_manager import (
    ComputeRegionInstanceGroupManager,
    ComputeRegionInstanceGroupManagerAllInstancesConfig,
    ComputeRegionInstanceGroupManagerNamedPort,
    ComputeRegionInstanceGroupManagerUpdatePolicy,
    ComputeRegionInstanceGroupManagerVersion,
)
from cdktf_cdktf_provider_google.compute_region_instance_template import (
    ComputeRegionInstanceTemplate,
    ComputeRegionInstanceTemplateDisk,
    ComputeRegionInstanceTemplateGuestAccelerator,
    ComputeRegionInstanceTemplateNetworkInterface,
    ComputeRegionInstanceTemplateScheduling,
    ComputeRegionInstanceTemplateServiceAccount,
)
from cdktf_cdktf_provider_google.compute_router import ComputeRouter
from cdktf_cdktf_provider_google.compute_router_nat import ComputeRouterNat
from cdktf_cdktf_provider_google.compute_subnetwork import ComputeSubnetwork
from cdktf_cdktf_provider_google.provider import GoogleProvider
from cdktf_cdktf_provider_google.secret_manager_secret_iam_member import SecretManagerSecretIamMember
from cdktf_cdktf_provider_google.service_account import ServiceAccount
from cdktf_cdktf_provider_google.storage_bucket import StorageBucket, StorageBucketVersioning
from cdktf_cdktf_provider_google.storage_bucket_iam_member import StorageBucketIamMember
from constructs import Construct

from iac import layout
from iac.layout import NODE_PORT, NODE_PORTS, PlanError
from iac.node_boot import NodeBoot, startup_script
from iac.region_stack import CloudRegionStack
from meridian.infra_plan import InfraGroup
from providers.gcp import naming as gcp_naming
from providers.gcp.offerings import host_accelerator
from providers.offerings import CatalogDataError

# Compute Engine accelerator types of the canonical SKUs (providers.skus) that GCP sells.
ACCELERATOR_BY_SKU = {
    "B200": "nvidia-b200",
    "H200-141GB": "nvidia-h200-141gb",
    "H100-80GB-SXM": "nvidia-h100-80gb",
    "A100-80GB": "nvidia-a100-80gb",
    "A100-40GB": "nvidia-tesla-a100",
    "L4-24GB": "nvidia-l4",
    "T4-16GB": "nvidia-tesla-t4",
    "V100-16GB": "nvidia-tesla-v100",
    "P100-16GB": "nvidia-tesla-p100",
    "P4-8GB": "nvidia-tesla-p4",
}
# a3-megagpu carries the same H100 SXM part under its own accelerator type.
ACCELERATOR_BY_FAMILY = {"a3-megagpu": "nvidia-h100-mega-80gb"}
# These machine families boot only from Hyperdisk; the rest take a balanced persistent disk.
HYPERDISK_FAMILIES = ("a3-ultragpu", "a4-highgpu")
# Deep Learning VM image with the NVIDIA driver and CUDA (Ubuntu 22.04, so the boot script's apt works).
DEFAULT_IMAGE = (
    "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
)
NODE_SCOPES = [
    "https://www.googleapis.com/auth/cloud-platform"
]  # access is bounded by the account's IAM roles
N1_OFFERING = re.compile(r"^n1\+(?P<count>1|2|4|8)x[A-Za-z0-9-]+$")
N1_VCPUS_PER_GPU = 8
# MIG attributes the control plane changes at run time (see iac.app): ignored after creation.
MIG_RUNTIME_OWNED = ("target_size",)
INSTALLATION_LABEL = "meridian-installation"
REGION_LABEL = "meridian-region"


def accelerator(group: InfraGroup) -> tuple[str, int]:
    """(accelerator type, count) of a group's machine type, from its SKU; checked against the
    machine type's built-in GPUs where the type fixes them (a3-highgpu-8g carries 8)."""
    family = next((f for f in ACCELERATOR_BY_FAMILY if group.instance_type.startswith(f + "-")), None)
    kind = ACCELERATOR_BY_FAMILY[family] if family else ACCELERATOR_BY_SKU.get(group.sku)
    if kind is None:
        raise PlanError(
            f"group {group.model}@{group.region}: SKU {group.sku} has no GCP accelerator type "
            f"(known: {', '.join(sorted(ACCELERATOR_BY_SKU))})"
        )
    try:
        _, built_in = host_accelerator(group.instance_type)
    except CatalogDataError:
        built_in = None  # n1 hosts take attached GPUs: the plan's count is the one to attach
    if built_in is not None and built_in != group.gpus_per_instance:
        raise PlanError(
            f"group {group.model}@{group.region}: {group.instance_type} carries {built_in} GPUs, "
            f"the plan says {group.gpus_per_instance}"
        )
    return kind, group.gpus_per_instance


def machine_type(instance_type: str) -> str:
    """The Compute Engine machine type of a plan's instance type: itself, or for an attached-GPU offering
    ("n1+4xT4", see providers.gcp.offerings) an n1-standard host with 8 vCPUs per GPU, which is within
    every attachable GPU's n1 vCPU limit (V100: 12 per GPU)."""
    m = N1_OFFERING.match(instance_type)
    if m is None:
        return instance_type
    return f"n1-standard-{N1_VCPUS_PER_GPU * int(m.group('count'))}"


def disk_type(machine_type: str) -> str:
    return "hyperdisk-balanced" if machine_type.startswith(HYPERDISK_FAMILIES) else "pd-balanced"


def google_provider(
    stack: Construct, project: TerraformVariable, location: str, prefix: str, region: str
) -> GoogleProvider:
    """The Google provider of a stack in one region, which labels everything it makes with the
    installation and Meridian's region name."""
    return GoogleProvider(
        stack,
        "google",
        project=project.string_value,
        region=location,
        default_labels={
            INSTALLATION_LABEL: prefix,
            REGION_LABEL: gcp_naming.label_value(region),
        },
    )


class GcpRegionStack(CloudRegionStack):
    """Everything one GCP region of the plan needs for its GPU node groups."""

    ROUTER_CIDRS_DESCRIPTION = "Addresses outside the network that reach nodes (routers, control plane)."

    def _provider(self) -> None:
        self.project = TerraformVariable(
            self, "project", type="string", description="GCP project that holds this region's resources."
        )
        google_provider(self, self.project, self.location, self.prefix, self.rs.region.name)
        self.subnet_cidr = TerraformVariable(
            self,
            "subnet_cidr",
            type="string",
            default="10.0.0.0/20",
            description="The nodes' subnetwork in this region.",
        )

    def _network(self) -> None:
        r = self.location
        name = layout.resource_name(self.plan, "nodes", r, limit=gcp_naming.NAME_MAX)
        self.network = ComputeNetwork(
            self, "network", name=name, auto_create_subnetworks=False, routing_mode="REGIONAL"
        )
        self.subnet = ComputeSubnetwork(
            self,
            "subnetwork",
            name=name,
            region=r,
            network=self.network.id,
            ip_cidr_range=self.subnet_cidr.string_value,
            private_ip_google_access=True,
        )
        # Nodes have no public address; Cloud NAT gives them egress (packages, weights, control plane).
        router = ComputeRouter(self, "router", name=name, region=r, network=self.network.id)
        ComputeRouterNat(
            self,
            "nat",
            name=name,
            region=r,
            router=router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
        )
        TerraformOutput(self, "network_name", value=self.network.name)
        TerraformOutput(self, "subnetwork_self_link", value=self.subnet.self_link)

    def _nodes(self) -> None:
        r, plan = self.location, self.plan
        image = TerraformVariable(
            self,
            "boot_image",
            type="string",
            default=DEFAULT_IMAGE,
            description="Boot image of GPU nodes (a Deep Learning VM image family).",
        )
        boot_gb = TerraformVariable(
            self,
            "boot_disk_gb",
            type="number",
            default=500,
            description="Boot disk of a GPU node (holds the weight cache).",
        )
        account = ServiceAccount(
            self,
            "node_sa",
            account_id=layout.gcp_account_id(plan, self.rs.region),
            display_name=f"Meridian GPU nodes in {r}",
        )
        member = f"serviceAccount:{account.email}"
        ComputeFirewall(
            self,
            "node_ingress",
            name=layout.resource_name(plan, "node", r, limit=gcp_naming.NAME_MAX),
            network=self.network.id,
            direction="INGRESS",
            target_service_accounts=[account.email],
            allow=[ComputeFirewallAllow(protocol="tcp", ports=[str(p) for p in NODE_PORTS])],
            source_ranges=Token.as_list(
                Fn.concat([[self.subnet.ip_cidr_range], self.router_cidrs.list_value])
            ),
        )
        bucket = StorageBucket(
            self,
            "weights",
            name=layout.bucket_name(plan, self.rs.region),
            location=r.upper(),
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            force_destroy=False,
            versioning=StorageBucketVersioning(enabled=True),
        )
        # objectViewer on this bucket only (read and list its objects), and the cluster token.
        StorageBucketIamMember(
            self, "node_reads_weights", bucket=bucket.name, role="roles/storage.objectViewer", member=member
        )
        token = layout.cluster_token_name(plan, "gcp")
        SecretManagerSecretIamMember(
            self,
            "node_reads_cluster_token",
            project=self.project.string_value,
            secret_id=token,
            role="roles/secretmanager.secretAccessor",
            member=member,
        )
        script = layout.tf_literal(startup_script(NodeBoot.of(plan, self.rs.region, "gcp")))
        templates = {
            (instance_type, spot): self._instance_template(
                instance_type, spot, image=image, boot_gb=boot_gb, account=account, script=script
            )
            for instance_type, spot in layout.templates(self.rs.groups)
        }
        for group in self.rs.groups:
            self._group(group, templates[(group.instance_type, group.spot)])
        TerraformOutput(self, "weights_bucket", value=bucket.name)
        TerraformOutput(self, "node_service_account", value=account.email)

    def _instance_template(
        self,
        instance_type: str,
        spot: bool,
        *,
        image: TerraformVariable,
        boot_gb: TerraformVariable,
        account: ServiceAccount,
        script: str,
    ) -> ComputeRegionInstanceTemplate:
        """The instance template of the groups on one machine type and provisioning model; the groups
        on a machine type must agree on its GPUs."""
        r, plan = self.location, self.plan
        kinds = {accelerator(g) for g in self.rs.groups if g.instance_type == instance_type}
        if len(kinds) != 1:
            raise PlanError(
                f"{self.rs.region.name}: groups on {instance_type} disagree on their GPUs: {sorted(kinds)}"
            )
        ((kind, count),) = kinds
        name = layout.instance_template_name(plan, instance_type, spot)
        return ComputeRegionInstanceTemplate(
            self,
            layout.tf_id("it", name),
            name=name,
            region=r,
            machine_type=machine_type(instance_type),
            disk=[
                ComputeRegionInstanceTemplateDisk(
                    source_image=image.string_value,
                    boot=True,
                    auto_delete=True,
                    disk_size_gb=boot_gb.number_value,
                    disk_type=disk_type(machine_type(instance_type)),
                )
            ],
            guest_accelerator=[ComputeRegionInstanceTemplateGuestAccelerator(type=kind, count=count)],
            # GPU VMs cannot live-migrate; Spot VMs are deleted on preemption and the MIG recreates them.
            scheduling=ComputeRegionInstanceTemplateScheduling(
                on_host_maintenance="TERMINATE",
                automatic_restart=not spot,
                preemptible=spot,
                provisioning_model="SPOT" if spot else "STANDARD",
                instance_termination_action="DELETE" if spot else None,
            ),
            network_interface=[ComputeRegionInstanceTemplateNetworkInterface(subnetwork=self.subnet.id)],
            service_account=ComputeRegionInstanceTemplateServiceAccount(
                email=account.email, scopes=NODE_SCOPES
            ),
            metadata={
                "startup-script": script,
                "install-nvidia-driver": "True",
                "enable-oslogin": "TRUE",
            },
            labels={gcp_naming.LABEL_ROLE: gcp_naming.ROLE_NODE},
        )

    def _group(self, group: InfraGroup, template: ComputeRegionInstanceTemplate) -> None:
        """The group's regional MIG at the plan's size, spread over the region's zones, model in its
        metadata and labels (no group id: the control plane's is unknown here; the driver adopts the MIG
        by its name)."""
        zones = sorted(self.rs.region.availability_zones)
        ComputeRegionInstanceGroupManager(
            self,
            layout.tf_id("mig", layout.mig_name(self.plan, group)),
            name=layout.mig_name(self.plan, group),
            region=self.location,
            base_instance_name=layout.base_instance_name(self.plan, group),
            version=[
                ComputeRegionInstanceGroupManagerVersion(name="primary", instance_template=template.self_link)
            ],
            target_size=group.instances,
            distribution_policy_zones=zones or None,
            distribution_policy_target_shape="BALANCED" if zones else None,
            all_instances_config=ComputeRegionInstanceGroupManagerAllInstancesConfig(
                metadata={gcp_naming.METADATA_MODEL: layout.tf_literal(group.model)},
                labels={
                    gcp_naming.LABEL_MODEL: gcp_naming.label_value(group.model),
                    gcp_naming.LABEL_ROLE: gcp_naming.ROLE_NODE,
                },
            ),
            named_port=[ComputeRegionInstanceGroupManagerNamedPort(name="http", port=NODE_PORT)],
            update_policy=ComputeRegionInstanceGroupManagerUpdatePolicy(
                type="OPPORTUNISTIC", minimal_action="REPLACE", instance_redistribution_type="NONE"
            ),
            wait_for_instances=False,
            # Terraform creates the MIG at the plan's size; from then on the control plane's reconciler and
            # autoscaler own its target size, so a later apply must not put it back.
            lifecycle=TerraformResourceLifecycle(ignore_changes=list(MIG_RUNTIME_OWNED)),
        )
