"""AWS set-up shared by the integration tests that use moto: fake credentials for boto3's
chain (the `aws_env` fixture in conftest.py), and the network and launch templates the
iac stacks would have made."""

from __future__ import annotations

from typing import Any

import boto3

from providers.aws import naming

KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
PREFIX = "meridian"


def aws_client(endpoint: str, service: str, region: str) -> Any:
    return boto3.client(service, endpoint_url=endpoint, region_name=region, **KEYS)


def make_network(endpoint: str, region: str, azs: dict[str, bool], templates: list[tuple[str, bool]]) -> list[str]:
    """A VPC with a subnet per AZ (tagged for GPU nodes where `azs` says so) and a launch
    template per (instance type, spot), as iac creates them; the tagged subnets' ids."""
    ec2 = aws_client(endpoint, "ec2", region)
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    tagged = []
    for i, (az, gpu) in enumerate(azs.items()):
        tags = [{"Key": k, "Value": v} for k, v in naming.subnet_tags().items()] if gpu else [{"Key": "x", "Value": "y"}]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{i}.0/24", AvailabilityZone=az,
                                   TagSpecifications=[{"ResourceType": "subnet", "Tags": tags}])["Subnet"]["SubnetId"]
        if gpu:
            tagged.append(subnet)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    for instance_type, spot in templates:
        ec2.create_launch_template(
            LaunchTemplateName=naming.launch_template_name(PREFIX, instance_type, spot),
            LaunchTemplateData={"ImageId": image, "InstanceType": instance_type},
        )
    return tagged
