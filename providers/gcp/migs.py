"""Managed instance groups and instance templates as the GCP driver reads and writes them.

Pure functions of Compute Engine resources, with no API call: the URLs the API takes, whether
a MIG and its templates are a group's (its model label, its machine type and market), the MIG
resource the driver creates, and a MIG's instances and operations as the driver reads them.
The driver (providers.gcp.driver) makes the calls and waits around them; this is what it
decides from their answers, kept apart so it is tested on plain resources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from google.cloud import compute_v1

from providers.driver import GroupSpec
from providers.gcp import naming
from providers.gcp import offerings as gcp_offerings
from providers.gcp.errors import ComputeErrorEntry, GcpOperationError

# BALANCED favours zones that have the hardware while spreading for availability; any target
# shape but EVEN requires proactive redistribution off (regional MIG distribution shape docs).
TARGET_SHAPE = "BALANCED"
COMPUTE_URL = "https://www.googleapis.com/compute/v1"
# A managed instance's currentAction while it goes away, and while the MIG creates it.
GONE_ACTIONS = frozenset({"DELETING", "ABANDONING"})
CREATING_ACTIONS = frozenset({"CREATING", "CREATING_WITHOUT_RETRIES", "RECREATING"})

_ZONE_IN_URL = re.compile(r"zones/([^/]+)")
_TEMPLATE_URL = re.compile(
    r"projects/(?P<project>[^/]+)/(?:regions/(?P<region>[^/]+)|global)/instanceTemplates/(?P<name>[^/]+)$"
)


def zone_url(project: str, zone: str) -> str:
    return f"{COMPUTE_URL}/projects/{project}/zones/{zone}"


def region_template_url(project: str, region: str, template: str) -> str:
    """A regional instance template's (partial) URL, as a MIG's instanceTemplate takes it."""
    return f"projects/{project}/regions/{region}/instanceTemplates/{template}"


def parse_template_url(url: str) -> tuple[str, str | None, str] | None:
    """(project, region or None for a global template, name) of an instance template URL; None
    when the URL is neither regional nor global."""
    m = _TEMPLATE_URL.search(url)
    return None if m is None else (m.group("project"), m.group("region"), m.group("name"))


def template_urls(mig: compute_v1.InstanceGroupManager) -> list[str]:
    """The instance templates a MIG creates VMs from: its versions' (iac sets those) and its own."""
    urls = [v.instance_template for v in mig.versions if v.instance_template]
    if mig.instance_template and mig.instance_template not in urls:
        urls.append(mig.instance_template)
    return urls


def template_mismatch(template: compute_v1.InstanceTemplate, instance_type: str, spot: bool) -> str | None:
    """Why a template does not make VMs of `instance_type` (Spot or not); None when it does.

    An attached-GPU offering ("n1+4xT4") is an n1 machine type of iac's choosing with that many
    GPUs of that kind attached (acceleratorType "nvidia-tesla-t4").
    """
    props = template.properties
    machine = props.machine_type.rsplit("/", 1)[-1]
    attached = gcp_offerings.attached_accelerator(instance_type)
    if attached is None:
        if machine != instance_type:
            return f"makes {machine or 'no machine type'} VMs, not {instance_type}"
    else:
        kind, count = attached
        gpus = sum(
            a.accelerator_count
            for a in props.guest_accelerators
            if a.accelerator_type.rsplit("/", 1)[-1].rsplit("-", 1)[-1] == kind.lower()
        )
        if not machine.startswith("n1-") or gpus != count:
            return f"makes {machine or 'no machine type'} VMs with {gpus} {kind} GPUs, not {instance_type}"
    scheduling = props.scheduling
    template_spot = scheduling.provisioning_model == "SPOT" or scheduling.preemptible
    if template_spot != spot:
        return f"makes {'Spot' if template_spot else 'on-demand'} VMs, not {'Spot' if spot else 'on-demand'}"
    return None


def label_mismatch(
    mig: compute_v1.InstanceGroupManager, model: str, role: str = naming.CO_LOCATED
) -> str | None:
    """Why a MIG's VMs are not labelled (and given the metadata) of `model` in prefill/decode role
    `role` (no role metadata: co-located); None when they are."""
    props = mig.all_instances_config.properties
    label = props.labels.get(naming.LABEL_MODEL)
    if label is None:
        return f"has no {naming.LABEL_MODEL} label (expected {naming.label_value(model)!r})"
    if label != naming.label_value(model):
        return f"is labelled {naming.LABEL_MODEL}={label!r}, not {naming.label_value(model)!r}"
    # The label is lossy (lowercased, cut to 63 characters); the metadata, where set, is exact.
    exact = props.metadata.get(naming.METADATA_MODEL)
    if exact is not None and exact != model:
        return f"serves {exact!r} (metadata {naming.METADATA_MODEL}), not {model!r}"
    runs = props.metadata.get(naming.METADATA_PD_ROLE, naming.CO_LOCATED)
    if runs != role:
        return f"runs {runs} nodes (metadata {naming.METADATA_PD_ROLE}), not {role}"
    return None


@dataclass(frozen=True, slots=True)
class Group:
    """A group spec resolved to its GCP names."""

    project: str
    location: str
    machine_type: str
    spot: bool
    model: str
    mig: str
    template: str  # a regional template in `location`
    base_instance_name: str
    gpus: int
    zones: tuple[str, ...]
    role: str = naming.CO_LOCATED  # the VMs' prefill/decode role

    @property
    def where(self) -> str:
        machine = f"machine type {self.machine_type}"
        return f"project {self.project}, region {self.location}, {machine}, MIG {self.mig}"

    @property
    def template_url(self) -> str:
        return region_template_url(self.project, self.location, self.template)


@dataclass(frozen=True, slots=True)
class Member:
    """One instance of a MIG as listManagedInstances reports it."""

    name: str
    url: str
    zone: str
    action: str  # currentAction: NONE, CREATING, DELETING, ...
    status: str  # instanceStatus; empty until the VM exists
    errors: tuple[ComputeErrorEntry, ...]

    @property
    def exists(self) -> bool:
        return bool(self.status) and self.action not in GONE_ACTIONS

    @property
    def ready(self) -> bool:
        return self.action == "NONE" and self.status == "RUNNING"

    @classmethod
    def of(cls, mi: compute_v1.ManagedInstance) -> Member:
        url = mi.instance
        zone = m.group(1) if (m := _ZONE_IN_URL.search(url)) else ""
        return cls(
            name=mi.name or url.rsplit("/", 1)[-1],
            url=url,
            zone=zone,
            action=mi.current_action or "NONE",
            status=mi.instance_status,
            errors=tuple(ComputeErrorEntry(e.code, e.message) for e in mi.last_attempt.errors.errors),
        )


def operation_errors(op: compute_v1.Operation) -> GcpOperationError | None:
    """A finished operation's errors as one typed error; None when it succeeded."""
    entries = [ComputeErrorEntry(e.code, e.message) for e in op.error.errors]
    return GcpOperationError(entries, op.http_error_status_code) if entries else None


def parse_time(text: str) -> datetime | None:
    """An RFC 3339 time of the API (UTC when it names no offset); None when it is not one."""
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def mig_resource(g: Group, spec: GroupSpec) -> compute_v1.InstanceGroupManager:
    """The MIG the driver creates for a group when iac has not: target size 0, spread over the
    zones the catalog sells its machine type in, its VMs labelled for the group and model."""
    resource = compute_v1.InstanceGroupManager(
        name=g.mig,
        description=f"Meridian node group {spec.group_id}: {spec.model} on {spec.instance_type}"
        f"{' (Spot)' if spec.spot else ''}",
        base_instance_name=g.base_instance_name,
        instance_template=g.template_url,
        target_size=0,
        update_policy=compute_v1.InstanceGroupManagerUpdatePolicy(
            type_="OPPORTUNISTIC", instance_redistribution_type="NONE"
        ),
        all_instances_config=compute_v1.InstanceGroupManagerAllInstancesConfig(
            properties=compute_v1.InstancePropertiesPatch(
                labels=naming.group_labels(spec.model, spec.group_id, pd_role=spec.role.value),
                metadata=naming.group_metadata(spec.model, spec.group_id, spec.role.value),
            )
        ),
    )
    if g.zones:
        resource.distribution_policy = compute_v1.DistributionPolicy(
            target_shape=TARGET_SHAPE,
            zones=[
                compute_v1.DistributionPolicyZoneConfiguration(zone=zone_url(g.project, z))
                for z in g.zones
            ],
        )
    return resource
