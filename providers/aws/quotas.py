"""The account's GPU-relevant EC2 quotas in a region, from Service Quotas, with their use.

AWS limits GPU instances by vCPUs per instance family and market: the on-demand P, on-demand
G and VT, spot P, and spot G and VT quotas below. The limit is the applied value
(GetServiceQuota), or AWS's default where none was applied; what is used is the vCPUs of
the region's pending and running instances of those families, summed the way AWS counts
them (the instance type's default vCPUs).

moto answers Service Quotas for the `vpc` service only, so against moto no limit is found
and `quotas` returns none; `usage` works against moto's EC2.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from providers.aws.clients import AwsClients, location
from providers.aws.errors import error_code
from providers.errors import ProviderError
from providers.offerings import Offering
from providers.provider import Quota

log = logging.getLogger(__name__)

SERVICE_CODE = "ec2"
LIVE_STATES = ("pending", "running")


@dataclass(frozen=True, slots=True)
class GpuQuota:
    """One EC2 quota that bounds GPU instances: the families it counts and whether spot."""

    code: str
    name: str
    families: frozenset[str]
    spot: bool


_P = frozenset({"p"})
_G_VT = frozenset({"g", "gr", "vt"})
GPU_QUOTAS = (
    GpuQuota("L-417A185B", "Running On-Demand P instances", _P, spot=False),
    GpuQuota("L-DB2E81BA", "Running On-Demand G and VT instances", _G_VT, spot=False),
    GpuQuota("L-7212CCBC", "All P Spot Instance Requests", _P, spot=True),
    GpuQuota("L-3819A6DF", "All G and VT Spot Instance Requests", _G_VT, spot=True),
)
_FAMILY = re.compile(r"^[a-z]+")


def family(instance_type: str) -> str:
    """The letters an instance type starts with: "p5.48xlarge" → "p", "g4dn.xlarge" → "g", "vt1.3xlarge" → "vt"."""
    found = _FAMILY.match(instance_type.lower())
    return found.group(0) if found else ""


def quota_for(instance_type: str, spot: bool) -> GpuQuota | None:
    """The GPU quota that counts an instance type in a market (None: not one of them)."""
    fam = family(instance_type)
    return next((q for q in GPU_QUOTAS if fam in q.families and q.spot == spot), None)


def vcpus_used(instances: Iterable[Mapping[str, Any]], vcpus: Mapping[str, float]) -> dict[str, float | None]:
    """vCPUs each GPU quota has in use by `instances` (EC2's DescribeInstances items); None for a
    quota that counts an instance type whose vCPUs `vcpus` does not know."""
    used: dict[str, float | None] = {q.code: 0.0 for q in GPU_QUOTAS}
    for instance in instances:
        if instance.get("State", {}).get("Name") not in LIVE_STATES:
            continue
        instance_type = str(instance.get("InstanceType", ""))
        quota = quota_for(instance_type, instance.get("InstanceLifecycle") == "spot")
        if quota is None:
            continue
        count, known = used[quota.code], vcpus.get(instance_type)
        used[quota.code] = None if count is None or known is None else count + known
    return used


def quota_value(answer: Mapping[str, Any]) -> float:
    """The limit in a GetServiceQuota / GetAWSDefaultServiceQuota answer."""
    return float(answer["Quota"]["Value"])


def gpu_quotas(region: str, limits: Mapping[str, float], used: Mapping[str, float | None]) -> list[Quota]:
    """The GPU quotas whose limit is known (by quota code), each with its vCPUs in use."""
    return [Quota(region=region, name=q.name, unit="vcpus", limit=limits[q.code], used=used.get(q.code))
            for q in GPU_QUOTAS if q.code in limits]


class AwsQuotas:
    """Reads the GPU quotas of a region through the shared clients."""

    def __init__(self, clients: AwsClients, offerings: Sequence[Offering]) -> None:
        self._clients = clients
        self._vcpus = {o.instance_type: o.vcpus for o in offerings if o.provider == "aws"}

    async def limits(self, region: str) -> dict[str, float]:
        """Each GPU quota's limit by code; quotas Service Quotas does not report are left out."""
        aws_region = location(region)

        async def applied(q: GpuQuota) -> float | None:
            try:
                answer = await self._clients.call(
                    "service-quotas", aws_region, "get_service_quota", action=f"reading quota {q.name}",
                    ServiceCode=SERVICE_CODE, QuotaCode=q.code,
                )
            except ProviderError as e:
                if e.__cause__ is None or error_code(e.__cause__) != "NoSuchResourceException":
                    raise
                return None
            return quota_value(answer)

        values = dict(zip((q.code for q in GPU_QUOTAS), await asyncio.gather(*map(applied, GPU_QUOTAS)),
                          strict=True))
        missing = [code for code, v in values.items() if v is None]
        if missing:
            defaults = await self._defaults(aws_region)
            for code in missing:
                values[code] = defaults.get(code)
        unknown = [code for code, v in values.items() if v is None]
        if unknown:
            log.warning("Service Quotas in %s reports no value for %s", aws_region, ", ".join(unknown))
        return {code: v for code, v in values.items() if v is not None}

    async def _defaults(self, aws_region: str) -> dict[str, float]:
        try:
            answer = await self._clients.call(
                "service-quotas", aws_region, "list_aws_default_service_quotas", action="reading default EC2 quotas",
                paginate=True, ServiceCode=SERVICE_CODE,
            )
        except ProviderError as e:
            if e.__cause__ is None or error_code(e.__cause__) != "NoSuchResourceException":
                raise
            return {}
        return {str(q["QuotaCode"]): float(q["Value"]) for q in answer.get("Quotas", []) if "Value" in q}

    async def usage(self, region: str) -> dict[str, float | None]:
        """vCPUs in use per GPU quota code: the region's pending and running P, G and VT instances."""
        aws_region = location(region)
        answer = await self._clients.call(
            "ec2", aws_region, "describe_instances", action="counting GPU instances", paginate=True,
            Filters=[{"Name": "instance-state-name", "Values": list(LIVE_STATES)}],
        )
        instances = [i for r in answer.get("Reservations", []) for i in r.get("Instances", [])]
        unknown = sorted({str(i.get("InstanceType")) for i in instances
                          if quota_for(str(i.get("InstanceType", "")), False) and i.get("InstanceType") not in self._vcpus})
        vcpus = dict(self._vcpus)
        if unknown:
            types = await self._clients.call(
                "ec2", aws_region, "describe_instance_types", action="reading vCPUs of instance types", paginate=True,
                InstanceTypes=unknown,
            )
            vcpus.update({str(t["InstanceType"]): float(t["VCpuInfo"]["DefaultVCpus"])
                          for t in types.get("InstanceTypes", [])})
        return vcpus_used(instances, vcpus)

    async def quotas(self, region: str) -> list[Quota]:
        """The GPU quotas Service Quotas reports in `region`, each with the vCPUs in use."""
        limits, used = await asyncio.gather(self.limits(region), self.usage(region))
        return gpu_quotas(region, limits, used)
