"""The AWS provider against moto's EC2, Auto Scaling and Service Quotas APIs over HTTP on loopback.

The network, launch templates and (for adoption) Auto Scaling groups are made with boto3 the way
the iac stacks make them; the driver then finds them by the names and tags of providers.aws.naming.
Group names hold no group id, so each test serves a model of its own unless it names one.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from aws_moto import aws_client, make_network

from meridian.clock import ManualClock
from meridian.contracts import NODE_ID_PATTERN, NodeRole
from meridian.settings.providers import ProviderSettings
from providers.aws import naming
from providers.aws.clients import AwsClients
from providers.aws.driver import AwsDriver
from providers.aws.provider import AwsProvider
from providers.aws.quotas import AwsQuotas
from providers.driver import FailsInstances, GroupSpec, NodeGroupDriver
from providers.errors import AuthError, ProviderError
from providers.provider import Provider, ProviderConfig, ProviderRegistry


@pytest.fixture(scope="module")
def aws(private_moto_server: str) -> Iterator[dict[str, Any]]:
    """moto with us-east-1 set up: GPU subnets in us-east-1a (use1-az6), -1b (use1-az1) and -1e
    (use1-az3), an untagged subnet in -1c, and launch templates for p5.48xlarge (on-demand and
    spot) and g6.xlarge (which the catalog does not list in use1-az3)."""
    subnets = make_network(
        private_moto_server, "us-east-1",
        {"us-east-1a": True, "us-east-1b": True, "us-east-1c": False, "us-east-1e": True},
        [("p5.48xlarge", False), ("p5.48xlarge", True), ("g6.xlarge", False)],
    )
    # moto builds its Auto Scaling backend on the first call, seconds on a loaded box: done here,
    # under boto3's own timeouts, so that no test's bounded driver call pays for it.
    aws_client(private_moto_server, "autoscaling", "us-east-1").describe_auto_scaling_groups()
    yield {"endpoint": private_moto_server, "gpu_subnets": subnets}


@pytest.fixture(autouse=True)
def _aws_env(aws_env: None) -> None:
    """Every test here runs with moto's keys."""


def settings(endpoint: str, **fields: Any) -> ProviderSettings:
    values: dict[str, Any] = {"aws_endpoint_url": endpoint, "call_timeout_s": 20.0, "operation_timeout_s": 20.0,
                              **fields}
    return ProviderSettings(**values)


def driver(endpoint: str, **kw: Any) -> AwsDriver:
    return AwsDriver(settings(endpoint), poll_interval_s=0.05, **kw)


def spec(instance_type: str = "p5.48xlarge", *, spot: bool = False, region: str = "aws:us-east-1",
         model: str = "") -> GroupSpec:
    """A group of a fresh group id, serving `model` (by default a model no other test serves)."""
    model = model or f"model-{uuid.uuid4().hex[:8]}"
    return GroupSpec(group_id=str(uuid.uuid4()), model=model, provider="aws", region=region,
                     instance_type=instance_type, sku="H100-80GB-SXM", spot=spot)


def terraform_group(endpoint: str, s: GroupSpec, size: int, *, model: str | None = None,
                    instance_type: str | None = None) -> str:
    """Create the group's Auto Scaling group as iac's stack does: under the group's name, from the
    launch template by id, tagged with the model and role (by default the spec's) but no group id,
    `size` instances. `instance_type` picks another type's launch template (a mismatch)."""
    region = s.region.removeprefix("aws:")
    name = naming.auto_scaling_group_name("meridian", s.model, s.instance_type, s.spot)
    ec2 = aws_client(endpoint, "ec2", region)
    template_name = naming.launch_template_name("meridian", instance_type or s.instance_type, s.spot)
    template_id = ec2.describe_launch_templates(LaunchTemplateNames=[template_name])["LaunchTemplates"][0][
        "LaunchTemplateId"]
    gpu_subnets = [{"Name": f"tag:{naming.ROLE_TAG}", "Values": [naming.SUBNET_ROLE]}]
    subnets = ec2.describe_subnets(Filters=gpu_subnets)
    template = {"LaunchTemplateId": template_id, "Version": "$Default"}
    placement: dict[str, Any] = {"LaunchTemplate": template}
    if s.spot:
        placement = {"MixedInstancesPolicy": {
            "LaunchTemplate": {"LaunchTemplateSpecification": template,
                               "Overrides": [{"InstanceType": instance_type or s.instance_type}]},
            "InstancesDistribution": {"OnDemandBaseCapacity": 0, "OnDemandPercentageAboveBaseCapacity": 0,
                                      "SpotAllocationStrategy": "price-capacity-optimized"}}}
    tags = {naming.MODEL_TAG: model or s.model, naming.ROLE_TAG: naming.NODE_ROLE, "Name": name}
    aws_client(endpoint, "autoscaling", region).create_auto_scaling_group(
        AutoScalingGroupName=name, MinSize=0, MaxSize=4, DesiredCapacity=size,
        VPCZoneIdentifier=",".join(sorted(n["SubnetId"] for n in subnets["Subnets"])),
        Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True, "ResourceId": name,
               "ResourceType": "auto-scaling-group"} for k, v in tags.items()],
        **placement,
    )
    return name


def group_names(endpoint: str, region: str = "us-east-1") -> list[str]:
    groups = aws_client(endpoint, "autoscaling", region).describe_auto_scaling_groups()["AutoScalingGroups"]
    return sorted(g["AutoScalingGroupName"] for g in groups)


def asg(endpoint: str, name: str, region: str = "us-east-1") -> dict[str, Any] | None:
    groups = aws_client(endpoint, "autoscaling", region).describe_auto_scaling_groups(
        AutoScalingGroupNames=[name])["AutoScalingGroups"]
    return groups[0] if groups else None


def ec2_states(endpoint: str, ids: list[str], region: str = "us-east-1") -> dict[str, str]:
    reservations = aws_client(endpoint, "ec2", region).describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: i["State"]["Name"] for r in reservations for i in r["Instances"]}


async def test_ensure_group_creates_an_empty_group_from_the_launch_template_once(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"]), spec(model="Llama-3.1-70B-Instruct")
    assert isinstance(d, NodeGroupDriver)
    state = await d.ensure_group(s, known_nodes=["i-0123456789abcdef0"])  # AWS's record wins
    assert state.nodes == () and state.gpus_per_node == 8
    name = d.group_name(s)
    assert name == "meridian-llama-3-1-70b-instruct-p5-48xlarge"  # the name iac gives it too
    group = asg(aws["endpoint"], name)
    assert group is not None
    assert (group["MinSize"], group["DesiredCapacity"]) == (0, 0) and group["MaxSize"] >= 1
    assert group["LaunchTemplate"]["LaunchTemplateName"] == "meridian-p5-48xlarge"
    assert sorted(group["VPCZoneIdentifier"].split(",")) == sorted(aws["gpu_subnets"])  # not the untagged one
    tags = {t["Key"]: (t["Value"], t["PropagateAtLaunch"]) for t in group["Tags"]}
    assert tags[naming.GROUP_ID_TAG] == (s.group_id, True)
    assert tags[naming.MODEL_TAG] == ("Llama-3.1-70B-Instruct", True)
    assert tags[naming.ROLE_TAG] == (naming.NODE_ROLE, True)

    # Idempotent: the same group, not a second one nor an error.
    assert (await d.ensure_group(s)).nodes == ()
    all_groups = aws_client(aws["endpoint"], "autoscaling", "us-east-1").describe_auto_scaling_groups()
    assert [g["AutoScalingGroupName"] for g in all_groups["AutoScalingGroups"]].count(name) == 1

    # A g6.xlarge group skips the GPU subnet in use1-az3, where the catalog sells no g6.
    g6 = spec("g6.xlarge")
    await d.ensure_group(g6)
    g6_group = asg(aws["endpoint"], d.group_name(g6))
    assert g6_group is not None
    assert sorted(g6_group["VPCZoneIdentifier"].split(",")) == sorted(aws["gpu_subnets"][:2])
    await d.delete_group(s)
    await d.delete_group(g6)


async def test_resize_launches_and_removes_instances_whose_ids_are_node_ids(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"], max_size=2), spec()
    await d.ensure_group(s)
    grown = await d.resize(s, 3)
    assert grown.size == 3 and grown.gpus_per_node == 8
    assert all(re.match(NODE_ID_PATTERN, n) and n.startswith("i-") for n in grown.nodes)
    assert set(ec2_states(aws["endpoint"], list(grown.nodes)).values()) == {"running"}
    group = asg(aws["endpoint"], d.group_name(s))
    assert group is not None and group["DesiredCapacity"] == 3 and group["MaxSize"] == 3  # raised from 2
    assert (await d.list_nodes(s)).nodes == grown.nodes
    assert (await d.resize(s, 3)).nodes == grown.nodes  # idempotent

    shrunk = await d.resize(s, 1)
    assert shrunk.size == 1 and set(shrunk.nodes) < set(grown.nodes)
    gone = [n for n in grown.nodes if n not in shrunk.nodes]
    assert set(ec2_states(aws["endpoint"], gone).values()) == {"terminated"}
    assert (await d.list_nodes(s)).nodes == shrunk.nodes
    await d.delete_group(s)


async def test_resize_creates_a_missing_group_and_refuses_a_negative_size(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"]), spec()
    assert (await d.resize(s, 1)).size == 1
    with pytest.raises(ValueError):
        await d.resize(s, -1)
    await d.delete_group(s)


async def test_a_resize_aws_cannot_finish_gives_up_after_the_operation_timeout(aws: dict[str, Any]) -> None:
    # Ten minutes of the control plane's clock, not of the test's: the driver waits on it.
    clock = ManualClock()
    d = AwsDriver(settings(aws["endpoint"], operation_timeout_s=600.0), poll_interval_s=60.0, clock=clock)
    s = spec()
    nodes = (await d.resize(s, 2)).nodes
    # Instances protected from scale-in are never picked to go, so the group cannot shrink.
    aws_client(aws["endpoint"], "autoscaling", "us-east-1").set_instance_protection(
        AutoScalingGroupName=d.group_name(s), InstanceIds=list(nodes), ProtectedFromScaleIn=True)
    shrinking = asyncio.ensure_future(d.resize(s, 1))
    polls = 0
    while not shrinking.done():
        if clock.sleepers:  # between two polls of AWS (each a real call to moto, in a thread)
            clock.advance(60.0)
            polls += 1
        await asyncio.sleep(0.005)
    with pytest.raises(ProviderError, match=r"has 2 of 1 p5.48xlarge instances after 600s") as caught:
        shrinking.result()
    assert caught.value.retryable and polls == 10
    await d.delete_group(s)


async def test_terminate_removes_the_named_node_once(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"]), spec()
    nodes = (await d.resize(s, 2)).nodes
    victim, survivor = nodes
    assert (await d.terminate(s, victim)).nodes == (survivor,)
    group = asg(aws["endpoint"], d.group_name(s))
    assert group is not None and group["DesiredCapacity"] == 1  # no replacement is launched
    assert ec2_states(aws["endpoint"], [victim]) == {victim: "terminated"}
    # Again, and a node that was never the group's: nothing changes, no error.
    assert (await d.terminate(s, victim)).nodes == (survivor,)
    assert (await d.terminate(s, "i-0123456789abcdef0")).nodes == (survivor,)
    assert ec2_states(aws["endpoint"], [survivor]) == {survivor: "running"}
    await d.delete_group(s)


async def test_fail_instance_ends_the_instance_without_shrinking_its_group(aws: dict[str, Any]) -> None:
    """What a chaos drill's terminate_instance action does: a host failure, not a scale-in."""
    d, s = driver(aws["endpoint"]), spec()
    assert isinstance(d, FailsInstances)
    victim, survivor = (await d.resize(s, 2)).nodes
    await d.fail_instance(s.region, victim)
    assert ec2_states(aws["endpoint"], [victim, survivor]) == {victim: "terminated", survivor: "running"}
    group = asg(aws["endpoint"], d.group_name(s))
    assert group is not None and group["DesiredCapacity"] == 2  # the group will replace it
    # Again, and an instance that never existed: already gone, no error.
    await d.fail_instance(s.region, victim)
    await d.fail_instance(s.region, "i-0123456789abcdef0")
    with pytest.raises(ProviderError, match="not an AWS region"):
        await d.fail_instance("gcp:us-central1", survivor)
    await d.delete_group(s)


async def test_delete_group_removes_the_group_and_its_instances_once(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"]), spec()
    nodes = (await d.resize(s, 2)).nodes
    await d.delete_group(s)
    assert asg(aws["endpoint"], d.group_name(s)) is None
    assert set(ec2_states(aws["endpoint"], list(nodes)).values()) == {"terminated"}
    await d.delete_group(s)  # idempotent
    assert (await d.list_nodes(s)).nodes == ()


@pytest.mark.parametrize("spot", [False, True], ids=["on-demand", "spot"])
async def test_a_group_iac_created_is_adopted_not_created_again(aws: dict[str, Any], spot: bool) -> None:
    endpoint = aws["endpoint"]
    d, s = driver(endpoint), spec(spot=spot)
    name = terraform_group(endpoint, s, 2)
    assert d.group_name(s) == name
    before = group_names(endpoint)

    adopted = await d.ensure_group(s)

    assert adopted.size == 2  # the instances iac's first size launched are the group's nodes
    group = asg(endpoint, name)
    assert group is not None
    tags = {t["Key"]: t["Value"] for t in group["Tags"]}
    assert tags[naming.GROUP_ID_TAG] == s.group_id and tags[naming.MODEL_TAG] == s.model  # traceable now
    grown = await d.resize(s, 3)
    assert grown.size == 3 and set(adopted.nodes) < set(grown.nodes)
    assert group_names(endpoint) == before  # no second group
    group = asg(endpoint, name)
    assert group is not None and group["DesiredCapacity"] == 3

    # A new group record (another control plane, a recreated group) takes the same group over.
    successor = replace(s, group_id=str(uuid.uuid4()))
    assert (await d.list_nodes(successor)).nodes == grown.nodes
    assert (await d.resize(successor, 1)).size == 1
    group = asg(endpoint, name)
    assert group is not None and {t["Key"]: t["Value"] for t in group["Tags"]}[naming.GROUP_ID_TAG] == \
        successor.group_id
    assert group_names(endpoint) == before
    await d.delete_group(successor)
    assert asg(endpoint, name) is None


def instance_tags(endpoint: str, ids: list[str], region: str = "us-east-1") -> dict[str, dict[str, str]]:
    reservations = aws_client(endpoint, "ec2", region).describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: {t["Key"]: t["Value"] for t in i.get("Tags", [])}
            for r in reservations for i in r["Instances"]}


async def test_prefill_and_decode_groups_are_groups_of_their_own_whose_instances_carry_their_role(
    aws: dict[str, Any],
) -> None:
    endpoint = aws["endpoint"]
    d, both = driver(endpoint), spec(model="Llama-3.1-8B-PD")
    prefill = replace(both, group_id=str(uuid.uuid4()), role=NodeRole.PREFILL)
    decode = replace(both, group_id=str(uuid.uuid4()), role=NodeRole.DECODE)
    assert d.group_name(both) == "meridian-llama-3-1-8b-pd-p5-48xlarge"  # a co-located group's name, as before
    assert d.group_name(prefill) == "meridian-llama-3-1-8b-pd-p5-48xlarge-prefill"
    assert d.group_name(decode) == "meridian-llama-3-1-8b-pd-p5-48xlarge-decode"
    p_nodes = (await d.resize(prefill, 1)).nodes
    d_nodes = (await d.resize(decode, 2)).nodes
    b_nodes = (await d.resize(both, 1)).nodes
    assert len({*p_nodes, *d_nodes, *b_nodes}) == 4
    # The role reaches the instances (propagated at launch), where the node's boot reads it.
    tags = instance_tags(endpoint, [*p_nodes, *d_nodes, *b_nodes])
    assert [tags[n][naming.PD_ROLE_TAG] for n in (*p_nodes, *d_nodes)] == ["prefill", "decode", "decode"]
    assert naming.PD_ROLE_TAG not in tags[b_nodes[0]]
    # Each pool resizes alone.
    assert (await d.resize(decode, 1)).size == 1
    assert (await d.list_nodes(prefill)).nodes == p_nodes
    for s in (prefill, decode, both):
        await d.delete_group(s)


async def test_a_group_of_another_role_under_the_name_is_refused(aws: dict[str, Any]) -> None:
    endpoint = aws["endpoint"]
    d, s = driver(endpoint), spec()
    decode = replace(s, role=NodeRole.DECODE)
    await d.ensure_group(decode)
    name = d.group_name(decode)
    aws_client(endpoint, "autoscaling", "us-east-1").create_or_update_tags(Tags=[
        {"ResourceId": name, "ResourceType": "auto-scaling-group", "Key": naming.PD_ROLE_TAG, "Value": "prefill",
         "PropagateAtLaunch": True}])
    with pytest.raises(ProviderError, match=rf"{name} in us-east-1 runs prefill nodes \(meridian:pd-role\), "
                                            "not decode") as caught:
        await d.resize(decode, 1)
    assert not caught.value.retryable
    aws_client(endpoint, "autoscaling", "us-east-1").delete_auto_scaling_group(AutoScalingGroupName=name,
                                                                               ForceDelete=True)


async def test_a_group_of_another_model_under_the_name_is_refused(aws: dict[str, Any]) -> None:
    endpoint = aws["endpoint"]
    d, s = driver(endpoint), spec()
    name = terraform_group(endpoint, s, 1, model="someone-elses-model")
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: d.ensure_group(s), lambda: d.resize(s, 3), lambda: d.list_nodes(s),
        lambda: d.terminate(s, "i-0123456789abcdef0"), lambda: d.delete_group(s)]
    for call in calls:
        with pytest.raises(ProviderError, match=rf"Auto Scaling group {name} in us-east-1 is tagged meridian:"
                                                rf"model='someone-elses-model', not '{s.model}'") as caught:
            await call()
        assert not caught.value.retryable
    group = asg(endpoint, name)
    assert group is not None and group["DesiredCapacity"] == 1 and len(group["Instances"]) == 1  # untouched
    assert naming.GROUP_ID_TAG not in {t["Key"] for t in group["Tags"]}
    aws_client(endpoint, "autoscaling", "us-east-1").delete_auto_scaling_group(AutoScalingGroupName=name,
                                                                               ForceDelete=True)


@pytest.mark.parametrize("spot", [False, True], ids=["on-demand", "spot"])
async def test_a_group_of_another_instance_type_under_the_name_is_refused(aws: dict[str, Any],
                                                                         spot: bool) -> None:
    endpoint = aws["endpoint"]
    d, s = driver(endpoint), spec(spot=spot)
    # The spot case keeps the p5 spot template but overrides the type; the on-demand one uses g6's template.
    name = terraform_group(endpoint, s, 0, instance_type="g6.xlarge" if not spot else None)
    if spot:
        aws_client(endpoint, "autoscaling", "us-east-1").update_auto_scaling_group(
            AutoScalingGroupName=name, MixedInstancesPolicy={"LaunchTemplate": {
                "LaunchTemplateSpecification": {"LaunchTemplateName": "meridian-p5-48xlarge-spot",
                                                "Version": "$Default"},
                "Overrides": [{"InstanceType": "g6.xlarge"}]}})
    expected = "launches g6.xlarge, not p5.48xlarge" if spot else \
        "launches from launch template meridian-g6-xlarge, not meridian-p5-48xlarge"
    with pytest.raises(ProviderError, match=expected) as caught:
        await d.ensure_group(s)
    assert not caught.value.retryable
    with pytest.raises(ProviderError, match=expected):
        await d.delete_group(s)
    assert asg(endpoint, name) is not None
    aws_client(endpoint, "autoscaling", "us-east-1").delete_auto_scaling_group(AutoScalingGroupName=name,
                                                                               ForceDelete=True)


async def test_a_missing_launch_template_says_to_apply_the_iac_stack(aws: dict[str, Any]) -> None:
    d, s = driver(aws["endpoint"]), spec("g5.xlarge")
    with pytest.raises(ProviderError, match=r"launch template meridian-g5-xlarge does not exist in us-east-1; "
                                            r"run `meridian iac synth` and apply") as caught:
        await d.ensure_group(s)
    assert not caught.value.retryable
    assert asg(aws["endpoint"], d.group_name(s)) is None


async def test_a_region_without_gpu_subnets_is_a_clear_error(aws: dict[str, Any]) -> None:
    make_network(aws["endpoint"], "eu-west-1", {"eu-west-1a": False}, [("p5.48xlarge", False)])
    d = driver(aws["endpoint"])
    with pytest.raises(ProviderError, match="no subnet in eu-west-1 is tagged meridian:role=gpu-subnet"):
        await d.ensure_group(spec(region="aws:eu-west-1"))


async def test_specs_the_driver_cannot_serve_fail_before_any_call(aws: dict[str, Any]) -> None:
    d = driver("http://127.0.0.1:9")  # nothing listens: a call would fail differently
    with pytest.raises(ProviderError, match="'m9.huge' is not a GPU instance type"):
        await d.ensure_group(spec("m9.huge"))
    with pytest.raises(ProviderError, match="not an AWS region"):
        await d.ensure_group(spec(region="gcp:us-central1"))


async def test_spot_groups_ask_for_spot_only_and_report_interrupted_instances(aws: dict[str, Any]) -> None:
    endpoint = aws["endpoint"]
    d, s = driver(endpoint), spec(spot=True)
    nodes = (await d.resize(s, 1)).nodes
    name = d.group_name(s)
    group = asg(endpoint, name)
    assert group is not None and name == f"meridian-{s.model}-p5-48xlarge-spot"
    policy = group["MixedInstancesPolicy"]
    assert policy["LaunchTemplate"]["LaunchTemplateSpecification"]["LaunchTemplateName"] == "meridian-p5-48xlarge-spot"
    assert policy["InstancesDistribution"]["OnDemandPercentageAboveBaseCapacity"] == 0
    assert policy["InstancesDistribution"]["OnDemandBaseCapacity"] == 0
    # moto launches the group's own instances as on-demand: nothing to report about them.
    assert await d.preemption_notices(s) == []

    # A spot instance in the group that EC2 stops (an interruption with the "stop" behaviour)
    # while the group still counts it. (moto, like AWS, replaces a terminated instance at once.)
    ec2 = aws_client(endpoint, "ec2", "us-east-1")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    spot_id = ec2.run_instances(ImageId=image, InstanceType="p5.48xlarge", MinCount=1, MaxCount=1,
                                SubnetId=aws["gpu_subnets"][0],
                                InstanceMarketOptions={"MarketType": "spot"})["Instances"][0]["InstanceId"]
    aws_client(endpoint, "autoscaling", "us-east-1").attach_instances(AutoScalingGroupName=name, InstanceIds=[spot_id])
    assert set((await d.list_nodes(s)).nodes) == {*nodes, spot_id}
    assert await d.preemption_notices(s) == []  # running: no notice
    ec2.stop_instances(InstanceIds=[spot_id])
    before = datetime.now(UTC)
    (notice,) = await d.preemption_notices(s)
    assert notice.node == spot_id and "stopped" in notice.reason
    assert before - timedelta(seconds=5) <= notice.deadline <= datetime.now(UTC) + timedelta(minutes=2)
    # An on-demand group is never interrupted.
    assert await d.preemption_notices(spec()) == []
    await d.delete_group(s)


async def test_the_registry_builds_the_aws_provider_by_name(aws: dict[str, Any]) -> None:
    provider = ProviderRegistry().create("aws", ProviderConfig(settings(aws["endpoint"])))
    assert isinstance(provider, AwsProvider) and isinstance(provider, Provider)
    assert provider.name == "aws"
    assert "aws:us-east-1" in {r.name for r in provider.regions()}
    offerings = provider.offerings()
    assert offerings and {o.provider for o in offerings} == {"aws"}
    assert any(o.instance_type == "p5.48xlarge" and o.region == "aws:us-east-1" for o in offerings)
    d = provider.driver()
    assert isinstance(d, NodeGroupDriver) and d.provider == "aws" and provider.driver() is d
    s = spec()
    assert (await d.resize(s, 1)).size == 1
    await d.delete_group(s)


async def test_quotas_count_the_vcpus_of_running_gpu_instances(aws: dict[str, Any]) -> None:
    endpoint = aws["endpoint"]
    subnets = make_network(endpoint, "us-west-2", {"us-west-2a": True}, [("p5.48xlarge", False)])
    provider = AwsProvider(settings(endpoint))
    region = "aws:us-west-2"
    s = spec(region=region)
    await provider.driver().resize(s, 2)
    ec2 = aws_client(endpoint, "ec2", "us-west-2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.run_instances(ImageId=image, InstanceType="g5.xlarge", MinCount=1, MaxCount=1, SubnetId=subnets[0],
                      InstanceMarketOptions={"MarketType": "spot"})
    ec2.run_instances(ImageId=image, InstanceType="m5.large", MinCount=1, MaxCount=1, SubnetId=subnets[0])
    stopped = ec2.run_instances(ImageId=image, InstanceType="p5.48xlarge", MinCount=1, MaxCount=1,
                                SubnetId=subnets[0])["Instances"][0]["InstanceId"]
    ec2.stop_instances(InstanceIds=[stopped])

    usage = await AwsQuotas(AwsClients(settings(endpoint)), provider.offerings()).usage(region)
    assert usage == {"L-417A185B": 2 * 192.0, "L-DB2E81BA": 0.0, "L-7212CCBC": 0.0, "L-3819A6DF": 4.0}
    # moto's Service Quotas knows no EC2 quota (it answers NoSuchResource for them all), so no
    # limit is known and none is reported rather than a made-up one.
    assert await provider.quotas(region) == []
    await provider.driver().delete_group(s)


async def _moto_auth(endpoint: str, free_requests: str) -> None:
    """Set how many requests moto serves before it checks keys against its IAM ("inf": never)."""
    async with httpx.AsyncClient(timeout=10) as http:
        (await http.post(f"{endpoint}/moto-api/reset-auth", content=free_requests.encode())).raise_for_status()


async def test_rejected_keys_are_an_auth_error(aws: dict[str, Any]) -> None:
    endpoint = aws["endpoint"]
    d = driver(endpoint)
    await _moto_auth(endpoint, "0")  # from now on "testing" is no IAM user's key
    try:
        with pytest.raises(AuthError, match="AWS describing group .* in us-east-1 .*InvalidClientTokenId") as c1:
            await d.list_nodes(spec())
        with pytest.raises(AuthError, match="InvalidClientTokenId|AuthFailure"):
            await AwsProvider(settings(endpoint)).quotas("aws:us-east-1")
    finally:
        await _moto_auth(endpoint, "inf")
    assert not c1.value.retryable
    assert (await d.list_nodes(spec())).nodes == ()  # accepted again


async def test_missing_credentials_are_an_auth_error(aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AuthError, match="no usable AWS credentials") as caught:
        await driver(aws["endpoint"]).list_nodes(spec())
    assert not caught.value.retryable


async def test_an_unreachable_endpoint_is_a_retryable_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        d = AwsDriver(settings(f"http://127.0.0.1:{port}", call_timeout_s=5.0), poll_interval_s=0.05)
        with pytest.raises(ProviderError, match="cannot reach the AWS endpoint|no answer in time") as caught:
            await d.list_nodes(spec())
    assert caught.value.retryable and type(caught.value) is ProviderError
