"""One AWS region's stack: network, node role, weights bucket, launch templates and Auto Scaling groups.

Every regional resource names its region explicitly (AWS provider 6 takes `region` per resource)
as well as through the provider, so the JSON alone shows where each one lives. Names shared with
the runtime driver (launch templates, Auto Scaling groups, the GPU-subnet tag) come through
iac.layout from providers.aws.naming.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from cdktf import (
    Fn,
    TerraformOutput,
    TerraformResourceLifecycle,
    TerraformVariable,
    Token,
)
from cdktf_cdktf_provider_aws.autoscaling_group import (
    AutoscalingGroup,
    AutoscalingGroupLaunchTemplate,
    AutoscalingGroupMixedInstancesPolicy,
    AutoscalingGroupMixedInstancesPolicyInstancesDistribution,
    AutoscalingGroupMixedInstancesPolicyLaunchTemplate,
    AutoscalingGroupMixedInstancesPolicyLaunchTemplateLaunchTemplateSpecification,
    AutoscalingGroupMixedInstancesPolicyLaunchTemplateOverride,
    AutoscalingGroupTag,
)
from cdktf_cdktf_provider_aws.data_aws_ami import DataAwsAmi, DataAwsAmiFilter
from cdktf_cdktf_provider_aws.data_aws_availability_zones import DataAwsAvailabilityZones
from cdktf_cdktf_provider_aws.eip import Eip
from cdktf_cdktf_provider_aws.iam_instance_profile import IamInstanceProfile
from cdktf_cdktf_provider_aws.internet_gateway import InternetGateway
from cdktf_cdktf_provider_aws.launch_template import (
    LaunchTemplate,
    LaunchTemplateBlockDeviceMappings,
    LaunchTemplateBlockDeviceMappingsEbs,
    LaunchTemplateIamInstanceProfile,
    LaunchTemplateMetadataOptions,
    LaunchTemplateTagSpecifications,
)
from cdktf_cdktf_provider_aws.nat_gateway import NatGateway
from cdktf_cdktf_provider_aws.provider import AwsProvider, AwsProviderDefaultTags
from cdktf_cdktf_provider_aws.route_table import RouteTable, RouteTableRoute
from cdktf_cdktf_provider_aws.route_table_association import RouteTableAssociation
from cdktf_cdktf_provider_aws.security_group import SecurityGroup, SecurityGroupEgress, SecurityGroupIngress
from cdktf_cdktf_provider_aws.subnet import Subnet
from cdktf_cdktf_provider_aws.vpc import Vpc
from constructs import Construct

from iac import layout
from iac.aws_weights import node_profile, weights_bucket
from iac.layout import NODE_PORTS, PlanError
from iac.node_boot import NodeBoot, cloud_init
from iac.region_stack import CloudRegionStack
from meridian.infra_plan import InfraGroup
from providers.aws import naming as aws_naming

# Deep Learning Base AMIs (NVIDIA driver, CUDA, Docker) published by Amazon; the newest matching one.
DLAMI_NAME = {
    "x86_64": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *",
    "arm64": "Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *",
}
# GPU instance families on Graviton (arm64); every other GPU family is x86_64.
ARM_FAMILIES = frozenset({"g5g"})
ROOT_DEVICE = "/dev/sda1"
# vLLM loads a large checkpoint (and compiles CUDA graphs) before the node reports healthy.
HEALTH_CHECK_GRACE_S = 1800
# Subnet numbers inside the VPC (/20s of a /16): private GPU subnets 0-7, public ones 8-15.
SUBNET_NEWBITS = 4
PUBLIC_SUBNET_OFFSET = 8
TIER_TAG = "meridian:tier"
INSTALLATION_TAG = "meridian:installation"
REGION_TAG = "meridian:region"
# Auto Scaling group attributes the control plane changes at run time (see iac.app), ignored after creation:
# its size; its MaxSize, which the driver raises when asked for more (and a lower MaxSize makes AWS scale
# the group in); and its tags, to which the driver adds the group id when it adopts the group.
ASG_RUNTIME_OWNED = ("desired_capacity", "max_size", "tag")
AZ_ID = re.compile(r"^[a-z]{2,5}\d+-az\d+$")


def zone_of(az: str) -> dict[str, str]:
    """A subnet's zone argument: plans name AZs ("us-east-1a") or, from the catalog, AZ ids ("use1-az1"),
    which are the same physical zone in every account."""
    return {"availability_zone_id" if AZ_ID.match(az) else "availability_zone": az}


def architecture(instance_type: str) -> str:
    return "arm64" if instance_type.split(".", 1)[0] in ARM_FAMILIES else "x86_64"


def aws_provider(stack: Construct, location: str, prefix: str, region: str) -> AwsProvider:
    """The AWS provider of a stack in one region, which tags everything it makes with the
    installation and Meridian's region name."""
    return AwsProvider(
        stack,
        "aws",
        region=location,
        default_tags=[
            AwsProviderDefaultTags(
                tags={
                    INSTALLATION_TAG: prefix,
                    REGION_TAG: region,
                    "managed-by": "meridian-iac",
                }
            )
        ],
    )


class AwsRegionStack(CloudRegionStack):
    """Everything one AWS region of the plan needs for its GPU node groups."""

    ROUTER_CIDRS_DESCRIPTION = (
        "Addresses outside the VPC that reach nodes (routers, control plane): the node "
        "port and KV-event ports are open to these and to the VPC, to nothing else."
    )

    def _provider(self) -> None:
        aws_provider(self, self.location, self.prefix, self.rs.region.name)
        self.vpc_cidr = TerraformVariable(
            self,
            "vpc_cidr",
            type="string",
            default="10.0.0.0/16",
            description="The VPC's address range; give each region its own when networks are peered.",
        )

    # --- network ---------------------------------------------------------------------

    def _azs(self) -> list[str]:
        """The plan's availability zones, else the region's first two (looked up at apply time)."""
        if len(self.rs.region.availability_zones) > PUBLIC_SUBNET_OFFSET:
            raise PlanError(f"{self.rs.region.name}: at most {PUBLIC_SUBNET_OFFSET} availability zones")
        if self.rs.region.availability_zones:
            return sorted(self.rs.region.availability_zones)
        found = DataAwsAvailabilityZones(self, "available_azs", state="available", region=self.location)
        return [Fn.element(found.names, i) for i in range(2)]

    def _network(self) -> None:
        r, name = self.location, layout.resource_name(self.plan, "nodes", self.location)
        vpc = Vpc(
            self,
            "vpc",
            cidr_block=self.vpc_cidr.string_value,
            enable_dns_hostnames=True,
            enable_dns_support=True,
            region=r,
            tags={"Name": name},
        )
        self.vpc = vpc
        igw = InternetGateway(self, "igw", vpc_id=vpc.id, region=r, tags={"Name": name})
        public_rt = self._default_route("public_rt", f"{name}-public", gateway_id=igw.id)
        private, public = [], []
        for i, az in enumerate(self._azs()):
            priv = Subnet(
                self,
                f"gpu_subnet_{i}",
                vpc_id=vpc.id,
                **zone_of(az),
                region=r,
                cidr_block=Fn.cidrsubnet(vpc.cidr_block, SUBNET_NEWBITS, i),
                tags={"Name": f"{name}-gpu-{i}", TIER_TAG: "private", **aws_naming.subnet_tags()},
            )
            pub = Subnet(
                self,
                f"public_subnet_{i}",
                vpc_id=vpc.id,
                **zone_of(az),
                region=r,
                cidr_block=Fn.cidrsubnet(vpc.cidr_block, SUBNET_NEWBITS, PUBLIC_SUBNET_OFFSET + i),
                tags={"Name": f"{name}-public-{i}", TIER_TAG: "public"},
            )
            RouteTableAssociation(
                self, f"public_rta_{i}", subnet_id=pub.id, route_table_id=public_rt.id, region=r
            )
            private.append(priv)
            public.append(pub)
        # One NAT gateway: nodes only need egress for packages, weights and the control plane.
        eip = Eip(self, "nat_eip", domain="vpc", region=r, tags={"Name": f"{name}-nat"})
        nat = NatGateway(
            self,
            "nat",
            allocation_id=eip.id,
            subnet_id=public[0].id,
            region=r,
            tags={"Name": f"{name}-nat"},
            depends_on=[igw],
        )
        private_rt = self._default_route("private_rt", f"{name}-private", nat_gateway_id=nat.id)
        for i, subnet in enumerate(private):
            RouteTableAssociation(
                self, f"gpu_rta_{i}", subnet_id=subnet.id, route_table_id=private_rt.id, region=r
            )
        self.gpu_subnets = private
        TerraformOutput(self, "vpc_id", value=vpc.id)
        TerraformOutput(self, "gpu_subnet_ids", value=[s.id for s in private])

    def _default_route(self, tf_id: str, name: str, **gateway: str) -> RouteTable:
        """A route table of the VPC that sends everything outside it to one gateway (`gateway_id` or
        `nat_gateway_id`)."""
        return RouteTable(
            self,
            tf_id,
            vpc_id=self.vpc.id,
            region=self.location,
            tags={"Name": name},
            route=[RouteTableRoute(cidr_block="0.0.0.0/0", **gateway)],
        )

    # --- GPU nodes -------------------------------------------------------------------

    def _nodes(self) -> None:
        r = self.location
        root_gb = TerraformVariable(
            self,
            "root_volume_gb",
            type="number",
            default=500,
            description="Root volume of a GPU node (holds the weight cache).",
        )
        sg = self._node_firewall()
        bucket = weights_bucket(self, self.plan, self.rs.region)
        profile = node_profile(self, self.plan, self.rs, bucket)
        user_data = base64.b64encode(cloud_init(NodeBoot.of(self.plan, self.rs.region, "aws")).encode()).decode()
        amis = {
            arch: DataAwsAmi(
                self,
                f"dlami_{arch}",
                most_recent=True,
                owners=["amazon"],
                region=r,
                filter=[
                    DataAwsAmiFilter(name="name", values=[DLAMI_NAME[arch]]),
                    DataAwsAmiFilter(name="architecture", values=[arch]),
                    DataAwsAmiFilter(name="state", values=["available"]),
                ],
            )
            for arch in sorted({architecture(g.instance_type) for g in self.rs.groups})
        }
        templates = {
            (instance_type, spot): self._launch_template(
                instance_type,
                spot,
                image_id=amis[architecture(instance_type)].id,
                user_data=user_data,
                profile=profile,
                sg=sg,
                root_gb=root_gb,
            )
            for instance_type, spot in layout.templates(self.rs.groups)
        }
        for group in self.rs.groups:
            self._group(group, templates[(group.instance_type, group.spot)])
        TerraformOutput(self, "weights_bucket", value=bucket)
        TerraformOutput(self, "node_instance_profile", value=profile.name)

    def _node_firewall(self) -> SecurityGroup:
        """The nodes' ports open to the VPC and the routers only; egress anywhere."""
        r = self.location
        # The VPC's own range plus the routers' (a list only known at apply time).
        sources = Token.as_list(Fn.concat([[self.vpc.cidr_block], self.router_cidrs.list_value]))
        return SecurityGroup(
            self,
            "node_sg",
            name=layout.resource_name(self.plan, "node", r),
            vpc_id=self.vpc.id,
            region=r,
            description="Meridian GPU nodes: HTTP and KV events from the VPC and the routers only",
            ingress=[
                SecurityGroupIngress(
                    from_port=p,
                    to_port=p,
                    protocol="tcp",
                    cidr_blocks=sources,
                    description=f"meridian node port {p}",
                )
                for p in NODE_PORTS
            ],
            egress=[
                SecurityGroupEgress(
                    from_port=0,
                    to_port=0,
                    protocol="-1",
                    cidr_blocks=["0.0.0.0/0"],
                    ipv6_cidr_blocks=["::/0"],
                    description="packages, weights, control plane",
                )
            ],
        )

    def _launch_template(
        self,
        instance_type: str,
        spot: bool,
        *,
        image_id: str,
        user_data: str,
        profile: IamInstanceProfile,
        sg: SecurityGroup,
        root_gb: TerraformVariable,
    ) -> LaunchTemplate:
        """The launch template of the groups on one instance type and purchase option."""
        name = layout.launch_template_name(self.plan, instance_type, spot)
        return LaunchTemplate(
            self,
            layout.tf_id("lt", name),
            name=name,
            region=self.location,
            instance_type=instance_type,
            image_id=image_id,
            user_data=user_data,
            update_default_version=True,
            iam_instance_profile=LaunchTemplateIamInstanceProfile(arn=profile.arn),
            vpc_security_group_ids=[sg.id],
            # IMDSv2 only; instance tags in the metadata are how a node learns its model.
            metadata_options=LaunchTemplateMetadataOptions(
                http_endpoint="enabled",
                http_tokens="required",
                http_put_response_hop_limit=1,
                instance_metadata_tags="enabled",
            ),
            block_device_mappings=[
                LaunchTemplateBlockDeviceMappings(
                    device_name=ROOT_DEVICE,
                    ebs=LaunchTemplateBlockDeviceMappingsEbs(
                        volume_size=root_gb.number_value,
                        volume_type="gp3",
                        encrypted="true",
                        delete_on_termination="true",
                    ),
                )
            ],
            tag_specifications=[
                LaunchTemplateTagSpecifications(
                    resource_type=kind,
                    tags={INSTALLATION_TAG: self.prefix, REGION_TAG: self.rs.region.name},
                )
                for kind in ("instance", "volume")
            ],
        )

    def _group(self, group: InfraGroup, template: LaunchTemplate) -> None:
        """The group's Auto Scaling group, created at the plan's size; spot capacity only through a mixed
        instances policy."""
        name = layout.auto_scaling_group_name(self.plan, group)
        # No group-id tag: the control plane's group id is unknown here; the driver adds it when it
        # adopts the group.
        tags = {
            aws_naming.MODEL_TAG: group.model,
            aws_naming.ROLE_TAG: aws_naming.NODE_ROLE,
            "Name": name,
            INSTALLATION_TAG: self.prefix,
            REGION_TAG: self.rs.region.name,
        }
        placement: dict[str, Any]
        if group.spot:
            placement = {
                "capacity_rebalance": True,
                "mixed_instances_policy": AutoscalingGroupMixedInstancesPolicy(
                    instances_distribution=AutoscalingGroupMixedInstancesPolicyInstancesDistribution(
                        on_demand_base_capacity=0,
                        on_demand_percentage_above_base_capacity=0,
                        spot_allocation_strategy="price-capacity-optimized",
                    ),
                    launch_template=AutoscalingGroupMixedInstancesPolicyLaunchTemplate(
                        launch_template_specification=(
                            AutoscalingGroupMixedInstancesPolicyLaunchTemplateLaunchTemplateSpecification(
                                launch_template_id=template.id, version="$Default"
                            )
                        ),
                        override=[
                            AutoscalingGroupMixedInstancesPolicyLaunchTemplateOverride(
                                instance_type=group.instance_type
                            )
                        ],
                    ),
                ),
            }
        else:
            placement = {
                "launch_template": AutoscalingGroupLaunchTemplate(id=template.id, version="$Default")
            }
        AutoscalingGroup(
            self,
            layout.tf_id("asg", name),
            name=name,
            region=self.location,
            min_size=0,
            max_size=group.max_instances,
            desired_capacity=group.instances,
            vpc_zone_identifier=[s.id for s in self.gpu_subnets],
            health_check_type="EC2",
            health_check_grace_period=HEALTH_CHECK_GRACE_S,
            # Apply returns once the group exists; GPUs come up (and load weights) afterwards.
            wait_for_capacity_timeout="0",
            tag=[
                AutoscalingGroupTag(key=k, value=layout.tf_literal(v), propagate_at_launch=True)
                for k, v in sorted(tags.items())
            ],
            **placement,
            # Terraform creates the group at the plan's size; from then on the control plane's reconciler
            # and autoscaler own its size (and the driver its MaxSize and group-id tag), so a later apply
            # must not put them back.
            lifecycle=TerraformResourceLifecycle(ignore_changes=list(ASG_RUNTIME_OWNED)),
        )
