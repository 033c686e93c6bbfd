"""Plans for the iac tests: three clouds, two residency zones (us, eu) and a global deployment."""

from __future__ import annotations

import copy
from typing import Any

US_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EU_MODEL = "mistralai/Mistral-7B-Instruct-v0.3"
GLOBAL_MODEL = "Qwen/Qwen2.5-72B-Instruct"

PLAN: dict[str, Any] = {
    "format": "meridian-infra-plan/v1",
    "name": "acme",
    "plan_id": "plan-42",
    "control_plane_url": "https://cp.acme.example.com",
    "agent_package": "meridian[vllm]==0.1.0",
    "regions": [
        {
            "name": "aws:us-east-1",
            "provider": "aws",
            "location": "us-east-1",
            "zones": ["us"],
            "availability_zones": ["us-east-1a", "us-east-1b"],
        },
        {
            "name": "aws:us-west-2",
            "provider": "aws",
            "location": "us-west-2",
            "zones": ["us"],
            "availability_zones": ["us-west-2a", "us-west-2b", "us-west-2c"],
        },
        {
            "name": "aws:eu-west-1",
            "provider": "aws",
            "location": "eu-west-1",
            "zones": ["eu"],
            "availability_zones": ["eu-west-1a", "eu-west-1b"],
        },
        {
            "name": "aws:eu-central-1",
            "provider": "aws",
            "location": "eu-central-1",
            "zones": ["eu"],
            # AZ ids, as the catalog (control_plane.infra_export) writes them.
            "availability_zones": ["euc1-az2", "euc1-az3"],
        },
        {
            "name": "gcp:us-central1",
            "provider": "gcp",
            "location": "us-central1",
            "zones": ["us"],
            "availability_zones": ["us-central1-a", "us-central1-c"],
        },
        {
            "name": "gcp:europe-west4",
            "provider": "gcp",
            "location": "europe-west4",
            "zones": ["eu"],
            "availability_zones": ["europe-west4-a", "europe-west4-b"],
        },
        {"name": "onprem:tokyo-1", "provider": "onprem", "location": "tokyo-1", "zones": ["apac"]},
        {"name": "onprem:berlin-1", "provider": "onprem", "location": "berlin-1", "zones": ["eu"]},
    ],
    "deployments": [
        {"model": US_MODEL, "zone": "us", "weights_uri": "s3://acme-weights-us-east-1/models/llama-3-1-8b"},
        {"model": EU_MODEL, "zone": "eu"},
        {"model": GLOBAL_MODEL, "zone": "global", "weights_uri": "https://weights.acme.example.com/qwen"},
    ],
    "groups": [
        {
            "model": US_MODEL,
            "region": "aws:us-east-1",
            "instance_type": "p5.48xlarge",
            "sku": "H100-80GB-SXM",
            "gpus_per_instance": 8,
            "instances": 2,
            "max_instances": 4,
        },
        {
            "model": US_MODEL,
            "region": "aws:us-west-2",
            "instance_type": "g6e.12xlarge",
            "sku": "L40S-48GB",
            "gpus_per_instance": 4,
            "instances": 1,
            "max_instances": 3,
            "spot": True,
        },
        {
            "model": US_MODEL,
            "region": "gcp:us-central1",
            "instance_type": "a3-highgpu-8g",
            "sku": "H100-80GB-SXM",
            "gpus_per_instance": 8,
            "instances": 1,
            "max_instances": 2,
        },
        {
            # An attached-GPU offering (providers.gcp.offerings): n1 host with 2 T4s.
            "model": US_MODEL,
            "region": "gcp:us-central1",
            "instance_type": "n1+2xT4",
            "sku": "T4-16GB",
            "gpus_per_instance": 2,
            "instances": 2,
            "max_instances": 4,
            "spot": True,
        },
        {
            "model": EU_MODEL,
            "region": "aws:eu-west-1",
            "instance_type": "p4de.24xlarge",
            "sku": "A100-80GB",
            "gpus_per_instance": 8,
            "instances": 1,
            "max_instances": 2,
        },
        {
            "model": EU_MODEL,
            "region": "aws:eu-central-1",
            "instance_type": "g6.xlarge",
            "sku": "L4-24GB",
            "gpus_per_instance": 1,
            "instances": 3,
            "max_instances": 6,
            "spot": True,
        },
        {
            "model": EU_MODEL,
            "region": "gcp:europe-west4",
            "instance_type": "g2-standard-48",
            "sku": "L4-24GB",
            "gpus_per_instance": 4,
            "instances": 2,
            "max_instances": 4,
            "spot": True,
        },
        {
            "model": EU_MODEL,
            "region": "onprem:berlin-1",
            "instance_type": "dgx-a100",
            "sku": "A100-80GB",
            "gpus_per_instance": 8,
            "instances": 1,
            "max_instances": 1,
        },
        {
            "model": GLOBAL_MODEL,
            "region": "aws:us-east-1",
            "instance_type": "g6e.12xlarge",
            "sku": "L40S-48GB",
            "gpus_per_instance": 4,
            "instances": 1,
            "max_instances": 2,
        },
        {
            "model": GLOBAL_MODEL,
            "region": "aws:us-west-2",
            "instance_type": "g6e.12xlarge",
            "sku": "L40S-48GB",
            "gpus_per_instance": 4,
            "instances": 1,
            "max_instances": 2,
        },
        {
            "model": GLOBAL_MODEL,
            "region": "aws:eu-west-1",
            "instance_type": "g6e.12xlarge",
            "sku": "L40S-48GB",
            "gpus_per_instance": 4,
            "instances": 1,
            "max_instances": 2,
        },
        {
            "model": GLOBAL_MODEL,
            "region": "gcp:europe-west4",
            "instance_type": "a2-ultragpu-1g",
            "sku": "A100-80GB",
            "gpus_per_instance": 1,
            "instances": 1,
            "max_instances": 1,
        },
        {
            "model": GLOBAL_MODEL,
            "region": "onprem:tokyo-1",
            "instance_type": "dgx-h100",
            "sku": "H100-80GB-SXM",
            "gpus_per_instance": 8,
            "instances": 2,
            "max_instances": 2,
        },
    ],
    "onprem_sites": [
        {
            "region": "onprem:tokyo-1",
            "kubernetes": {"config_context": "tokyo-gpu", "namespace": "meridian-gpu"},
        },
        {"region": "onprem:berlin-1"},
    ],
    "global": {
        "provider": "aws",
        "region": "aws:us-east-1",
        "endpoint_domain": "api.acme.example.com",
        "dns_zone": "acme.example.com",
        "router_addresses": ["198.51.100.20", "203.0.113.10"],
    },
}


# The plan's region stacks, sorted: one per region with groups, none for the inventory-only site
# (onprem:berlin-1, an on-prem site without Kubernetes).
REGION_STACKS = [
    "aws-eu-central-1",
    "aws-eu-west-1",
    "aws-us-east-1",
    "aws-us-west-2",
    "gcp-europe-west4",
    "gcp-us-central1",
    "onprem-tokyo-1",
]


def plan_dict() -> dict[str, Any]:
    """A fresh copy of the three-cloud plan, to modify."""
    return copy.deepcopy(PLAN)
