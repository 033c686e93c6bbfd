"""What the AWS driver reads from Auto Scaling groups and activities and spot request statuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from providers.aws.driver import (
    SPOT_WARNING,
    foreign_group,
    interruption_notices,
    latest_failure,
    spot_interruption,
)
from providers.driver import PreemptionNotice

T0 = datetime(2025, 5, 1, 10, 0, tzinfo=UTC)


def activity(status: str, minutes: int, message: str = "") -> dict[str, object]:
    return {"ActivityId": f"a-{minutes}", "AutoScalingGroupName": "g", "StatusCode": status,
            "StatusMessage": message, "StartTime": T0 + timedelta(minutes=minutes), "Progress": 100,
            "Description": "Launching a new EC2 instance.  Status Reason: " + message}


def test_the_newest_failed_launch_since_the_resize_is_reported() -> None:
    failed = activity("Failed", 2, "We currently do not have sufficient p5.48xlarge capacity in the AZ.")
    found = latest_failure("g", [activity("Successful", 1), failed], since=T0)
    assert found is not None and "sufficient p5.48xlarge capacity" in found.status_message
    # A cancelled activity (a newer desired capacity superseded it) does not hide the failure.
    assert latest_failure("g", [failed, activity("Cancelled", 3)], since=T0) is not None


def test_no_failure_when_a_later_launch_is_trying_or_the_failure_is_older() -> None:
    failed = activity("Failed", 1, "insufficient capacity in us-east-1a")
    assert latest_failure("g", [failed, activity("InProgress", 2)], since=T0) is None  # another AZ may work
    assert latest_failure("g", [failed], since=T0 + timedelta(minutes=5)) is None  # before this resize
    assert latest_failure("g", [], since=T0) is None


def test_spot_request_statuses_that_mean_an_interruption() -> None:
    for code in ("marked-for-termination", "marked-for-stop", "instance-terminated-by-price",
                 "instance-terminated-no-capacity", "instance-stopped-capacity-oversubscribed"):
        assert spot_interruption(code) == f"spot interruption: {code}"
    for code in ("fulfilled", "pending-fulfillment", "instance-terminated-by-user", "request-canceled-and-instance-running",
                 None):
        assert spot_interruption(code) is None


def test_notices_for_marked_and_stopping_spot_instances() -> None:
    now = T0 + timedelta(seconds=30)

    def spot(instance_id: str, state: str = "running") -> dict[str, object]:
        return {"InstanceId": instance_id, "InstanceType": "p5.48xlarge", "InstanceLifecycle": "spot",
                "SpotInstanceRequestId": f"sir-{instance_id}", "State": {"Name": state}}

    def request(instance_id: str, code: str, when: datetime) -> dict[str, object]:
        return {"SpotInstanceRequestId": f"sir-{instance_id}", "InstanceId": instance_id, "State": "active",
                "Status": {"Code": code, "UpdateTime": when, "Message": "Spot Instance is marked for termination"}}

    notices = interruption_notices(
        [spot("i-0aaa"), spot("i-0bbb"), spot("i-0ccc", "shutting-down"), spot("i-0ddd")],
        {"i-0aaa": request("i-0aaa", "marked-for-termination", T0),
         "i-0bbb": request("i-0bbb", "fulfilled", T0),
         "i-0ddd": request("i-0ddd", "marked-for-stop", now + timedelta(hours=1))},  # a clock ahead of ours
        now,
    )
    assert notices == [
        PreemptionNotice("i-0aaa", T0 + SPOT_WARNING, "spot interruption: marked-for-termination"),
        PreemptionNotice("i-0ccc", now, "spot instance is shutting-down while the group counts it"),
        PreemptionNotice("i-0ddd", now + SPOT_WARNING, "spot interruption: marked-for-stop"),
    ]
    assert SPOT_WARNING == timedelta(minutes=2)


def test_which_groups_under_a_node_groups_name_are_not_its_own() -> None:
    def group(**fields: object) -> dict[str, object]:
        tags = [{"Key": "meridian:model", "Value": "llama"}, {"Key": "meridian:role", "Value": "gpu-node"}]
        return {"AutoScalingGroupName": "meridian-llama-p5-48xlarge", "Tags": tags,
                "LaunchTemplate": {"LaunchTemplateId": "lt-1", "LaunchTemplateName": "meridian-p5-48xlarge"}, **fields}

    # iac's group (no group id tag) is the node group's.
    assert foreign_group(group(), "llama", "p5.48xlarge", "meridian-p5-48xlarge") is None
    assert foreign_group(group(Tags=[]), "llama", "p5.48xlarge", "meridian-p5-48xlarge") == \
        "has no meridian:model tag (expected 'llama')"
    assert foreign_group(group(), "Llama", "p5.48xlarge", "meridian-p5-48xlarge") == \
        "is tagged meridian:model='llama', not 'Llama'"
    old_style = group(LaunchTemplate=None, LaunchConfigurationName="hand-made")
    assert foreign_group(old_style, "llama", "p5.48xlarge", "meridian-p5-48xlarge") == \
        "launches from launch configuration hand-made, not launch template meridian-p5-48xlarge"
