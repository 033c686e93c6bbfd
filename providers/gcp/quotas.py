"""GCP's per-region GPU quotas, read from `regions.get` (Region.quotas: metric, limit, usage).

Compute Engine counts GPUs per model and region: NVIDIA_H100_GPUS, NVIDIA_A100_80GB_GPUS,
NVIDIA_L4_GPUS, ...; Spot and preemptible VMs count against PREEMPTIBLE_NVIDIA_*_GPUS instead,
and committed-use GPUs against COMMITTED_NVIDIA_*_GPUS. Every metric ending in "_GPUS" is
reported, in GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from google.cloud import compute_v1

from providers.errors import ProviderError
from providers.gcp.clients import LazyClients, call, read_retry
from providers.gcp.offerings import host_accelerator
from providers.offerings import CatalogDataError
from providers.provider import Quota

PROVIDER = "gcp"
PREEMPTIBLE = "PREEMPTIBLE_"

# GCP accelerator name (providers.gcp.offerings) → the quota metric its GPUs count against.
GPU_METRICS = {
    "A100": "NVIDIA_A100_GPUS",
    "A100-80GB": "NVIDIA_A100_80GB_GPUS",
    "H100": "NVIDIA_H100_GPUS",
    "H100-MEGA": "NVIDIA_H100_MEGA_GPUS",
    "H200": "NVIDIA_H200_GPUS",
    "B200": "NVIDIA_B200_GPUS",
    "L4": "NVIDIA_L4_GPUS",
    "T4": "NVIDIA_T4_GPUS",
    "V100": "NVIDIA_V100_GPUS",
    "P4": "NVIDIA_P4_GPUS",
    "P100": "NVIDIA_P100_GPUS",
}
_N1_OFFERING = re.compile(r"^n1\+(?P<n>\d+)x(?P<accelerator>[A-Za-z0-9-]+)$")


def gpu_quota_metric(instance_type: str, spot: bool = False) -> str:
    """The quota metric of a machine type's GPUs: a3-highgpu-8g → NVIDIA_H100_GPUS (Spot: PREEMPTIBLE_…)."""
    if m := _N1_OFFERING.match(instance_type):
        accelerator = m.group("accelerator")
    else:
        try:
            accelerator, _ = host_accelerator(instance_type)
        except CatalogDataError as e:
            raise ProviderError(str(e), provider=PROVIDER) from e
    metric = GPU_METRICS.get(accelerator)
    if metric is None:
        raise ProviderError(f"no GCP quota metric known for accelerator {accelerator}", provider=PROVIDER)
    return PREEMPTIBLE + metric if spot else metric


def gpu_quotas(region: str, quotas: Iterable[tuple[str, float, float]]) -> list[Quota]:
    """The GPU metrics among a region's (metric, limit, usage) rows, as Quotas of `region`, by name."""
    return sorted(
        (
            Quota(region=region, name=metric, unit="gpus", limit=limit, used=usage)
            for metric, limit, usage in quotas
            if metric.endswith("_GPUS")
        ),
        key=lambda q: q.name,
    )


async def region_quotas(clients: LazyClients, project: str, region: str, timeout_s: float) -> list[Quota]:
    """The project's GPU quotas in `region` ("gcp:us-central1" or "us-central1"), from regions.get."""
    location = region.split(":", 1)[1] if region.startswith(f"{PROVIDER}:") else region
    if ":" in location:
        raise ProviderError(f"{region} is not a GCP region", provider=PROVIDER)
    retry = read_retry(timeout_s)
    found: compute_v1.Region = await call(
        clients,
        f"project {project}, region {location}",
        lambda c: c.regions.get(project=project, region=location, timeout=timeout_s, retry=retry),
    )
    return gpu_quotas(f"{PROVIDER}:{location}", ((q.metric, q.limit, q.usage) for q in found.quotas))
