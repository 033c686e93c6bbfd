"""The AWS node-group driver: each node group is an EC2 Auto Scaling group.

iac creates what groups are made from (a launch template per instance type, subnets tagged
`meridian:role=gpu-subnet`, see providers.aws.naming); the driver creates one Auto Scaling
group per node group from them, sets its desired capacity, and removes named instances.
A node's id is its EC2 instance id, under which its node agent registers.

AWS holds the state: the group is found again by its name, computed from (prefix, model,
instance type, spot) alone, so a new control plane needs no `known_nodes` and ignores them.
Every call is idempotent. iac creates the same group (same name) at the plan's first size and
leaves its size to the control plane afterwards; the driver adopts such a group, tagging it with
the control plane's group id, and creates the group itself only when none exists. A group under
that name that is tagged for another model or prefill/decode role, or launches another
instance type, is refused (never resized, adopted or deleted). A prefill or decode group's
instances are launched in their role: its name and tags (providers.aws.naming.PD_ROLE_TAG,
propagated at launch and read into MERIDIAN_NODE_ROLE by the node's boot) say which.

Spot groups ask for spot capacity through a mixed instances policy with no on-demand share.
`preemption_notices` reads what EC2's API shows of an interruption: the spot request's
status (`marked-for-termination`, `instance-terminated-by-price`, ...) and spot instances
the group still counts that are already shutting down or stopped. moto launches Auto Scaling
instances as on-demand, never marks a spot request and does not report an instance's spot
request id, so against moto only the second can be seen (a spot instance attached to the
group, then stopped); `spot_interruption` reads the status codes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import boto3

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NODE_ID_PATTERN
from meridian.settings.providers import ProviderSettings
from providers.aws import naming
from providers.aws import offerings as aws_offerings
from providers.aws.clients import AwsClients, location
from providers.aws.errors import PROVIDER, ScalingActivityFailed, error_code, map_error
from providers.driver import GroupSpec, GroupState, PreemptionNotice
from providers.errors import ProviderError
from providers.offerings import Offering

log = logging.getLogger(__name__)

_NODE_ID = re.compile(NODE_ID_PATTERN)
# Instances the group counts: launched or launching, not on their way out.
LIVE_STATES = frozenset({"Pending", "Pending:Wait", "Pending:Proceed", "InService"})
# AWS warns two minutes before it takes a spot instance back.
SPOT_WARNING = timedelta(minutes=2)
# MaxSize of a new group; `resize` raises it when asked for more (quotas are the real bound).
DEFAULT_MAX_SIZE = 16
# A scaling activity that started this long before a resize is still taken as its own
# (the local clock and AWS's may disagree a little).
CLOCK_SKEW = timedelta(seconds=5)


def _fatal(message: str) -> ProviderError:
    error = ProviderError(message, provider=PROVIDER)
    error.retryable = False
    return error


def _aws_code(error: ProviderError) -> str | None:
    """AWS's error code behind a mapped error (AwsClients.call chains the ClientError)."""
    return error_code(error.__cause__) if error.__cause__ is not None else None


def _not_found(error: ProviderError) -> bool:
    # Auto Scaling says "not found" in a ValidationError's message; it has no code of its own.
    return _aws_code(error) == "ValidationError" and "not found" in str(error).lower()


def _template_names(group: Mapping[str, Any]) -> list[str]:
    """The launch templates a group launches from (plain, or through a mixed instances policy)."""
    plain = group.get("LaunchTemplate") or {}
    mixed = ((group.get("MixedInstancesPolicy") or {}).get("LaunchTemplate") or {}).get(
        "LaunchTemplateSpecification") or {}
    return [str(t["LaunchTemplateName"]) for t in (plain, mixed) if t.get("LaunchTemplateName")]


def foreign_group(
    group: Mapping[str, Any], model: str, instance_type: str, template: str, role: str = naming.CO_LOCATED
) -> str | None:
    """Why an Auto Scaling group found under a node group's name is not that node group's (None:
    it is): its model tag is not `model`, its prefill/decode role tag is not `role` (absent:
    co-located), or it launches from another launch template than `template` (iac's template of
    `instance_type`) or overrides the instance type."""
    tags = {t.get("Key"): t.get("Value") for t in group.get("Tags", [])}
    tagged = tags.get(naming.MODEL_TAG)
    if tagged != model:
        return (f"is tagged {naming.MODEL_TAG}={tagged!r}, not {model!r}" if tagged is not None
                else f"has no {naming.MODEL_TAG} tag (expected {model!r})")
    tagged_role = tags.get(naming.PD_ROLE_TAG, naming.CO_LOCATED)
    if tagged_role != role:
        return f"runs {tagged_role} nodes ({naming.PD_ROLE_TAG}), not {role}"
    if group.get("LaunchConfigurationName"):
        config = group["LaunchConfigurationName"]
        return f"launches from launch configuration {config}, not launch template {template}"
    others = [t for t in _template_names(group) if t != template]
    if others:
        return f"launches from launch template {others[0]}, not {template} (the template of {instance_type})"
    overrides = ((group.get("MixedInstancesPolicy") or {}).get("LaunchTemplate") or {}).get("Overrides") or []
    types = sorted({str(o["InstanceType"]) for o in overrides if o.get("InstanceType")} - {instance_type})
    if types:
        return f"launches {', '.join(types)}, not {instance_type}"
    return None


def spot_interruption(status_code: str | None) -> str | None:
    """Why a spot request's status means its instance is being taken back (None: it is not)."""
    code = status_code or ""
    if code.startswith("marked-for-"):
        return f"spot interruption: {code}"
    if code.startswith(("instance-terminated-", "instance-stopped-")) and not code.endswith("-by-user"):
        return f"spot interruption: {code}"
    return None


def latest_failure(group: str, activities: Iterable[Mapping[str, Any]], since: datetime) -> ScalingActivityFailed | None:
    """The newest scaling activity since `since` when it failed (a launch AWS could not make);
    None when it did not, or when a later activity is still trying (another AZ may succeed)."""
    recent = [a for a in activities if isinstance(a.get("StartTime"), datetime) and a["StartTime"] >= since]
    recent.sort(key=lambda a: a["StartTime"], reverse=True)
    for activity in recent:
        if activity.get("StatusCode") == "Cancelled":
            continue  # superseded by a later desired capacity
        if activity.get("StatusCode") == "Failed":
            return ScalingActivityFailed(group, str(activity.get("StatusMessage") or activity.get("Description") or
                                                    "no reason given"))
        return None
    return None


def interruption_notices(
    instances: Iterable[Mapping[str, Any]], requests: Mapping[str, Mapping[str, Any]], now: datetime
) -> list[PreemptionNotice]:
    """Notices for the spot `instances` (DescribeInstances items) that AWS is taking back, given
    their spot requests by instance id (DescribeSpotInstanceRequests items)."""
    notices = []
    for instance in instances:
        node = str(instance["InstanceId"])
        status = requests.get(node, {}).get("Status", {})
        reason = spot_interruption(status.get("Code"))
        if reason is not None:
            # The warning comes two minutes before the end; AWS stamps the status when it marks.
            marked = status.get("UpdateTime")
            since = marked if isinstance(marked, datetime) and marked <= now else now
            notices.append(PreemptionNotice(node=node, deadline=since + SPOT_WARNING, reason=reason))
            continue
        ec2_state = str(instance.get("State", {}).get("Name", ""))
        if ec2_state in ("shutting-down", "terminated", "stopping", "stopped"):
            notices.append(PreemptionNotice(node=node, deadline=now,
                                            reason=f"spot instance is {ec2_state} while the group counts it"))
    return sorted(notices, key=lambda n: n.node)


class AwsDriver:
    """Node groups as Auto Scaling groups; see the module's docstring."""

    provider = PROVIDER

    def __init__(
        self,
        settings: ProviderSettings | None = None,
        *,
        offerings: Sequence[Offering] | None = None,
        session: boto3.session.Session | None = None,
        clients: AwsClients | None = None,
        poll_interval_s: float = 2.0,
        max_size: int = DEFAULT_MAX_SIZE,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clients = clients or AwsClients(settings or ProviderSettings(), session)
        self._settings = self._clients.settings
        rows = offerings if offerings is not None else aws_offerings.offerings()
        self._gpus: dict[str, int] = {o.instance_type: o.gpu_count for o in rows if o.provider == PROVIDER}
        self._azs: dict[tuple[str, str], frozenset[str]] = {
            (o.region, o.instance_type): frozenset(o.availability_zones) for o in rows if o.provider == PROVIDER
        }
        self._poll_s = poll_interval_s
        self._max_size = max_size
        self._clock = clock

    @property
    def clients(self) -> AwsClients:
        return self._clients

    # --- names ----------------------------------------------------------------------------

    def group_name(self, spec: GroupSpec) -> str:
        """The Auto Scaling group of a node group (providers.aws.naming)."""
        prefix = self._settings.aws_name_prefix
        return naming.auto_scaling_group_name(prefix, spec.model, spec.instance_type, spec.spot, spec.role.value)

    def launch_template(self, spec: GroupSpec) -> str:
        """The launch template iac made for the group's instance type."""
        return naming.launch_template_name(self._settings.aws_name_prefix, spec.instance_type, spec.spot)

    def _check(self, spec: GroupSpec) -> tuple[str, int]:
        """(AWS region, GPUs per node) of a spec this driver can serve."""
        if spec.provider != PROVIDER:
            raise _fatal(f"group {spec.group_id} is on {spec.provider}, not AWS")
        aws_region = location(spec.region)
        gpus = self._gpus.get(spec.instance_type)
        if gpus is None:
            raise _fatal(f"{spec.instance_type!r} is not a GPU instance type of the AWS catalog")
        return aws_region, gpus

    # --- AWS calls ------------------------------------------------------------------------

    async def _describe(self, spec: GroupSpec, aws_region: str) -> dict[str, Any] | None:
        name = self.group_name(spec)
        answer = await self._clients.call(
            "autoscaling", aws_region, "describe_auto_scaling_groups", action=f"describing group {name}",
            instance_type=spec.instance_type, AutoScalingGroupNames=[name],
        )
        groups = answer.get("AutoScalingGroups", [])
        if not groups:
            return None
        group: dict[str, Any] = groups[0]
        problem = foreign_group(group, spec.model, spec.instance_type, self.launch_template(spec), spec.role.value)
        if problem is not None:
            raise _fatal(f"Auto Scaling group {name} in {aws_region} {problem}, so it is not the group of "
                         f"{spec.model} on {spec.instance_type}; rename or delete it")
        return group

    async def _adopt(self, spec: GroupSpec, aws_region: str, group: Mapping[str, Any]) -> None:
        """Tag a group this control plane did not create (iac's, or an earlier group record's) with
        the group's id, so that its instances can be traced to the group."""
        tags = {t.get("Key"): t.get("Value") for t in group.get("Tags", [])}
        if tags.get(naming.GROUP_ID_TAG) == spec.group_id or group.get("Status") == "Delete in progress":
            return
        name = self.group_name(spec)
        await self._clients.call(
            "autoscaling", aws_region, "create_or_update_tags", action=f"tagging group {name}",
            instance_type=spec.instance_type,
            Tags=[{"ResourceId": name, "ResourceType": "auto-scaling-group", "Key": naming.GROUP_ID_TAG,
                   "Value": spec.group_id, "PropagateAtLaunch": True}],
        )
        log.info("adopted Auto Scaling group %s in %s for group %s (it was tagged %s=%r)", name, aws_region,
                 spec.group_id, naming.GROUP_ID_TAG, tags.get(naming.GROUP_ID_TAG))

    async def _ensure(self, spec: GroupSpec, aws_region: str) -> dict[str, Any]:
        """The group's Auto Scaling group: found (and adopted) or created empty."""
        group = await self._describe(spec, aws_region)
        if group is not None:
            await self._adopt(spec, aws_region, group)
            return group
        await self._create(spec, aws_region)
        group = await self._describe(spec, aws_region)
        if group is None:
            raise ProviderError(f"Auto Scaling group {self.group_name(spec)} in {aws_region} vanished after "
                                "it was created", provider=PROVIDER)
        # Another caller may have created it between our look and our create (AlreadyExists).
        await self._adopt(spec, aws_region, group)
        return group

    def _state(self, group: Mapping[str, Any] | None, gpus: int) -> GroupState:
        nodes = sorted(
            str(i["InstanceId"]) for i in (group or {}).get("Instances", []) if i.get("LifecycleState") in LIVE_STATES
        )
        bad = [n for n in nodes if not _NODE_ID.match(n)]
        if bad:
            raise _fatal(f"instance ids {bad} are not valid node ids")
        return GroupState(nodes=tuple(nodes), gpus_per_node=gpus)

    async def _subnets(self, spec: GroupSpec, aws_region: str) -> list[str]:
        """Subnets tagged for GPU nodes, narrowed to the AZs that sell the instance type when
        the catalog knows them (so AWS does not answer "Unsupported" in the others)."""
        answer = await self._clients.call(
            "ec2", aws_region, "describe_subnets", action="finding GPU subnets", paginate=True,
            Filters=[{"Name": f"tag:{naming.ROLE_TAG}", "Values": [naming.SUBNET_ROLE]}],
        )
        subnets = sorted(answer.get("Subnets", []), key=lambda s: str(s["SubnetId"]))
        if not subnets:
            raise _fatal(f"no subnet in {aws_region} is tagged {naming.ROLE_TAG}={naming.SUBNET_ROLE}; "
                         "run `meridian iac synth` and apply the network stack for this region")
        offered = self._azs.get((spec.region, spec.instance_type), frozenset())
        usable = [s for s in subnets if s.get("AvailabilityZoneId") in offered]
        if not usable:
            log.warning("no GPU subnet of %s is in an AZ the catalog lists for %s (%s); using all of them",
                        aws_region, spec.instance_type, ", ".join(sorted(offered)) or "none listed")
            usable = subnets
        return [str(s["SubnetId"]) for s in usable]

    async def _require_launch_template(self, spec: GroupSpec, aws_region: str) -> str:
        name = self.launch_template(spec)
        try:
            await self._clients.call(
                "ec2", aws_region, "describe_launch_templates", action=f"finding launch template {name}",
                instance_type=spec.instance_type, LaunchTemplateNames=[name],
            )
        except ProviderError as e:
            if _aws_code(e) != "InvalidLaunchTemplateName.NotFoundException":
                raise
            raise _fatal(f"launch template {name} does not exist in {aws_region}; run `meridian iac synth` "
                         f"and apply the stack that creates it") from e
        return name

    async def _create(self, spec: GroupSpec, aws_region: str) -> None:
        name = self.group_name(spec)
        template = await self._require_launch_template(spec, aws_region)
        subnets = await self._subnets(spec, aws_region)
        tags = [
            {"Key": k, "Value": v, "PropagateAtLaunch": True, "ResourceId": name,
             "ResourceType": "auto-scaling-group"}
            for k, v in naming.group_tags(spec.group_id, spec.model, spec.role.value).items()
        ]
        template_spec = {"LaunchTemplateName": template, "Version": "$Default"}
        placement: dict[str, Any]
        if spec.spot:
            placement = {"MixedInstancesPolicy": {
                "LaunchTemplate": {"LaunchTemplateSpecification": template_spec,
                                   "Overrides": [{"InstanceType": spec.instance_type}]},
                "InstancesDistribution": {"OnDemandBaseCapacity": 0, "OnDemandPercentageAboveBaseCapacity": 0,
                                          "SpotAllocationStrategy": "price-capacity-optimized"},
            }}
        else:
            placement = {"LaunchTemplate": template_spec}
        try:
            await self._clients.call(
                "autoscaling", aws_region, "create_auto_scaling_group", action=f"creating group {name}",
                instance_type=spec.instance_type, AutoScalingGroupName=name, MinSize=0, MaxSize=self._max_size,
                DesiredCapacity=0, VPCZoneIdentifier=",".join(subnets), Tags=tags, **placement,
            )
        except ProviderError as e:
            # Another call (or one that timed out after AWS acted) created it first.
            if _aws_code(e) != "AlreadyExists":
                raise
        log.info("created Auto Scaling group %s in %s (%s, %s)", name, aws_region, spec.instance_type,
                 "spot" if spec.spot else "on-demand")

    # --- NodeGroupDriver ------------------------------------------------------------------

    async def ensure_group(self, spec: GroupSpec, known_nodes: Sequence[str] = ()) -> GroupState:
        """Adopt the group's Auto Scaling group (iac's, at its size), or create it empty when there
        is none. `known_nodes` is ignored: AWS knows the group's instances."""
        aws_region, gpus = self._check(spec)
        return self._state(await self._ensure(spec, aws_region), gpus)

    async def resize(self, spec: GroupSpec, size: int) -> GroupState:
        """Set the desired capacity (adopting or creating the group, as `ensure_group`) and wait (up
        to `operation_timeout_s`) until the group has `size` live instances; a failed launch raises
        its typed error at once."""
        if size < 0:
            raise ValueError("size must be >= 0")
        aws_region, gpus = self._check(spec)
        name = self.group_name(spec)
        since = self._clock.now() - CLOCK_SKEW
        group = await self._ensure(spec, aws_region)
        if group.get("Status") == "Delete in progress":
            raise ProviderError(f"Auto Scaling group {name} in {aws_region} is being deleted", provider=PROVIDER)
        if size > int(group.get("MaxSize", 0)):
            await self._clients.call(
                "autoscaling", aws_region, "update_auto_scaling_group", action=f"raising the MaxSize of {name}",
                instance_type=spec.instance_type, AutoScalingGroupName=name, MaxSize=size,
            )
        if int(group.get("DesiredCapacity", -1)) != size:
            await self._clients.call(
                "autoscaling", aws_region, "set_desired_capacity", action=f"resizing {name} to {size}",
                instance_type=spec.instance_type, AutoScalingGroupName=name, DesiredCapacity=size,
                HonorCooldown=False,
            )
        return await self._wait_for_size(spec, aws_region, gpus, size, since)

    async def _wait_for_size(
        self, spec: GroupSpec, aws_region: str, gpus: int, size: int, since: datetime
    ) -> GroupState:
        name = self.group_name(spec)
        deadline = self._clock.monotonic() + self._settings.operation_timeout_s
        while True:
            state = self._state(await self._describe(spec, aws_region), gpus)
            if state.size == size:
                return state
            if state.size < size:
                activities = await self._clients.call(
                    "autoscaling", aws_region, "describe_scaling_activities", action=f"checking launches of {name}",
                    instance_type=spec.instance_type, AutoScalingGroupName=name, MaxRecords=20,
                )
                failure = latest_failure(name, activities.get("Activities", []), since)
                if failure is not None:
                    raise map_error(failure, action=f"launching instances of {name}", region=aws_region,
                                    instance_type=spec.instance_type)
            left = deadline - self._clock.monotonic()
            if left <= 0:
                raise ProviderError(
                    f"Auto Scaling group {name} in {aws_region} has {state.size} of {size} {spec.instance_type} "
                    f"instances after {self._settings.operation_timeout_s:g}s", provider=PROVIDER)
            await self._clock.sleep(min(self._poll_s, left))

    async def list_nodes(self, spec: GroupSpec) -> GroupState:
        """The group's pending and in-service instances (none when the group does not exist)."""
        aws_region, gpus = self._check(spec)
        return self._state(await self._describe(spec, aws_region), gpus)

    async def terminate(self, spec: GroupSpec, node: str) -> GroupState:
        """Terminate one instance of the group and decrement its desired capacity; a node the
        group does not hold (gone already, or never its) changes nothing."""
        aws_region, gpus = self._check(spec)
        group = await self._describe(spec, aws_region)
        if node in self._state(group, gpus).nodes:
            try:
                await self._clients.call(
                    "autoscaling", aws_region, "terminate_instance_in_auto_scaling_group",
                    action=f"terminating {node} of {self.group_name(spec)}", instance_type=spec.instance_type,
                    InstanceId=node, ShouldDecrementDesiredCapacity=True,
                )
            except ProviderError as e:
                # Terminated between our look and the call: what we wanted.
                if not _not_found(e):
                    raise
            group = await self._describe(spec, aws_region)
        return self._state(group, gpus)

    async def fail_instance(self, region: str, node: str) -> None:
        """Terminate instance `node` (EC2 TerminateInstances) without telling its group: the
        group sees an unhealthy instance and launches a replacement, as after a host failure."""
        try:
            await self._clients.call("ec2", location(region), "terminate_instances",
                                     action=f"terminating instance {node}", InstanceIds=[node])
        except ProviderError as e:
            if _aws_code(e) != "InvalidInstanceID.NotFound":
                raise

    async def delete_group(self, spec: GroupSpec) -> None:
        """Delete the Auto Scaling group and terminate its instances (ForceDelete); AWS finishes
        in the background. Nothing to do when it is gone or already being deleted."""
        aws_region, _ = self._check(spec)
        name = self.group_name(spec)
        group = await self._describe(spec, aws_region)
        if group is None or group.get("Status") == "Delete in progress":
            return
        try:
            await self._clients.call(
                "autoscaling", aws_region, "delete_auto_scaling_group", action=f"deleting group {name}",
                instance_type=spec.instance_type, AutoScalingGroupName=name, ForceDelete=True,
            )
        except ProviderError as e:
            if not _not_found(e):
                raise

    async def preemption_notices(self, spec: GroupSpec) -> list[PreemptionNotice]:
        """Spot instances of the group that AWS is taking back: their spot request is marked for
        termination (deadline: two minutes after AWS marked it), or they are already shutting
        down while the group still counts them (deadline: now)."""
        if not spec.spot:
            return []
        aws_region, gpus = self._check(spec)
        wanted = self._state(await self._describe(spec, aws_region), gpus).nodes
        if not wanted:
            return []
        answer = await self._clients.call(
            "ec2", aws_region, "describe_instances", action="reading spot instances", paginate=True,
            instance_type=spec.instance_type, Filters=[{"Name": "instance-id", "Values": list(wanted)}],
        )
        instances = [i for r in answer.get("Reservations", []) for i in r.get("Instances", [])]
        spot = [i for i in instances if i.get("InstanceLifecycle") == "spot"]
        requests: dict[str, Mapping[str, Any]] = {}
        request_ids = [str(i["SpotInstanceRequestId"]) for i in spot if i.get("SpotInstanceRequestId")]
        if request_ids:
            answer = await self._clients.call(
                "ec2", aws_region, "describe_spot_instance_requests", action="reading spot requests",
                paginate=True, instance_type=spec.instance_type, SpotInstanceRequestIds=request_ids,
            )
            requests = {str(r.get("InstanceId")): r for r in answer.get("SpotInstanceRequests", [])}
        return interruption_notices(spot, requests, self._clock.now())

    def close(self) -> None:
        """Close the boto3 clients' connections."""
        self._clients.close()
