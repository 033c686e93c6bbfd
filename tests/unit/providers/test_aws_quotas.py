"""GPU quotas of an AWS region: which quota counts an instance, and the vCPUs in use."""

from __future__ import annotations

from providers.aws.quotas import GPU_QUOTAS, family, gpu_quotas, quota_for, quota_value, vcpus_used
from providers.provider import Quota

VCPUS = {"p5.48xlarge": 192.0, "p4d.24xlarge": 96.0, "g6e.xlarge": 4.0, "vt1.3xlarge": 12.0}


def instance(instance_type: str, state: str = "running", spot: bool = False) -> dict[str, object]:
    out: dict[str, object] = {"InstanceId": "i-0abc", "InstanceType": instance_type, "State": {"Name": state}}
    if spot:
        out["InstanceLifecycle"] = "spot"
    return out


def test_each_gpu_family_and_market_has_its_quota() -> None:
    assert [family(t) for t in ("p5.48xlarge", "g4dn.xlarge", "gr6.4xlarge", "vt1.3xlarge", "m5.large")] == [
        "p", "g", "gr", "vt", "m"]
    assert quota_for("p5.48xlarge", spot=False).code == "L-417A185B"  # type: ignore[union-attr]
    assert quota_for("g6e.xlarge", spot=False).code == "L-DB2E81BA"  # type: ignore[union-attr]
    assert quota_for("p4d.24xlarge", spot=True).code == "L-7212CCBC"  # type: ignore[union-attr]
    assert quota_for("vt1.3xlarge", spot=True).code == "L-3819A6DF"  # type: ignore[union-attr]
    assert quota_for("m5.large", spot=False) is None
    assert {q.code for q in GPU_QUOTAS} == {"L-417A185B", "L-DB2E81BA", "L-7212CCBC", "L-3819A6DF"}


def test_vcpus_in_use_count_live_instances_by_quota() -> None:
    used = vcpus_used([
        instance("p5.48xlarge"), instance("p5.48xlarge", "pending"), instance("p5.48xlarge", "stopped"),
        instance("p4d.24xlarge", spot=True), instance("g6e.xlarge"), instance("vt1.3xlarge", spot=True),
        instance("m5.large"),
    ], VCPUS)
    assert used == {"L-417A185B": 384.0, "L-DB2E81BA": 4.0, "L-7212CCBC": 96.0, "L-3819A6DF": 12.0}
    # An instance type of unknown size makes its quota's use unknown, not under-counted.
    unknown = vcpus_used([instance("p6-b200.48xlarge"), instance("g6e.xlarge")], VCPUS)
    assert unknown["L-417A185B"] is None and unknown["L-DB2E81BA"] == 4.0


def test_quotas_are_reported_where_the_limit_is_known() -> None:
    # GetServiceQuota's answer, as AWS gives it.
    answer = {"Quota": {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                        "QuotaArn": "arn:aws:servicequotas:us-east-1:123456789012:ec2/L-417A185B",
                        "QuotaCode": "L-417A185B", "QuotaName": "Running On-Demand P instances",
                        "Value": 384.0, "Unit": "None", "Adjustable": True, "GlobalQuota": False}}
    limits = {"L-417A185B": quota_value(answer), "L-3819A6DF": 64.0}
    quotas = gpu_quotas("aws:us-east-1", limits, {"L-417A185B": 192.0, "L-3819A6DF": None})
    assert quotas == [
        Quota(region="aws:us-east-1", name="Running On-Demand P instances", unit="vcpus", limit=384.0, used=192.0),
        Quota(region="aws:us-east-1", name="All G and VT Spot Instance Requests", unit="vcpus", limit=64.0,
              used=None),
    ]
    assert quotas[0].free == 192.0
