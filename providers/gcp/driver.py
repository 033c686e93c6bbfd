"""The GCP node-group driver: one regional managed instance group (MIG) per node group.

iac/ creates a regional instance template per machine type (and per Spot or on-demand) in each
region, and the MIG of each (model, region, machine type, Spot) at the plan's first size, leaving
its target size to the control plane afterwards. The driver finds the MIG by its name (computed
from those four alone, providers.gcp.naming) and adopts it; when there is none (a plan applied
before Terraform ran, or no iac at all) it creates it from the template (target size 0, spread
over the zones the catalog sells the machine type in). It resizes the MIG, deletes named
instances and deletes it. A MIG under the group's name whose `meridian-model` label (or model
metadata) is another model's, or whose instance template is for another machine type (or
market), is refused: never resized, adopted or deleted. The MIG is the durable record of a
group's nodes, so `ensure_group` ignores `known_nodes`. Node ids are the MIG's instance names
("<base instance name>-xxxx", see providers.gcp.naming).

The SDK (google-cloud-compute, REST transport) blocks; every call runs in a worker thread with
`call_timeout_s`, and the waits between calls are asyncio sleeps, so a caller that cancels
(the reconciler bounds each driver call) stops the polling at once. A whole method is bounded
by `operation_timeout_s`.

Resizing a MIG only sets its target size: the operation is DONE when the change is scheduled
and the instances are created afterwards (regionInstanceGroupManagers.resize). `resize`
therefore polls listManagedInstances until the group has `size` instances whose VMs exist
(PROVISIONING, STAGING or RUNNING), as the AWS driver waits for pending instances, not for
booted ones: a GPU VM takes minutes to boot, the reconciler bounds each driver call, and a
node counts as serving only once its agent registers. An instance whose `lastAttempt.errors`
says why the MIG cannot create it (QUOTA_EXCEEDED, ZONE_RESOURCE_POOL_EXHAUSTED, ...) raises
the typed error at once instead of waiting for the timeout. The MIG keeps retrying such
instances in the background; the next `resize` sees them come up.

Preemption: Compute Engine gives a Spot VM 30 s between its preemption notice and the hard
stop, and records a zonal operation of type `compute.instances.preempted` when it starts
(the documented way to detect a preemption). `preemption_notices` lists those operations in
the group's zones (zoneOperations.list with that filter) for the group's instances, from the
last PREEMPTION_LOOKBACK_S, with deadline = the operation's insertTime + 30 s (now + 30 s when
it carries none). Reading operations, rather than an instance's status, also catches a VM that
the MIG has already recreated under the same name.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from meridian.backoff import Backoff
from meridian.contracts import NODE_ID_PATTERN
from meridian.settings import ProviderSettings
from providers.driver import GroupSpec, GroupState, PreemptionNotice
from providers.errors import ProviderError
from providers.gcp import naming
from providers.gcp import offerings as gcp_offerings
from providers.gcp.clients import ComputeClients, LazyClients, call, call_or_none, read_retry
from providers.gcp.errors import ComputeErrorEntry, GcpOperationError, map_error
from providers.offerings import Offering

PROVIDER = "gcp"
PREEMPTION_NOTICE_S = 30.0
PREEMPTION_LOOKBACK_S = 120.0
PREEMPTED_FILTER = 'operationType="compute.instances.preempted"'
# BALANCED favours zones that have the hardware while spreading for availability; any target
# shape but EVEN requires proactive redistribution off (regional MIG distribution shape docs).
TARGET_SHAPE = "BALANCED"
DEFAULT_POLL = Backoff(base_s=0.1, max_s=5.0, jitter=0.1)
COMPUTE_URL = "https://www.googleapis.com/compute/v1"

_NODE_ID = re.compile(NODE_ID_PATTERN)
_GONE = {"DELETING", "ABANDONING"}
_CREATING = {"CREATING", "CREATING_WITHOUT_RETRIES", "RECREATING"}
_ZONE_IN_URL = re.compile(r"zones/([^/]+)")
_TEMPLATE_URL = re.compile(
    r"projects/(?P<project>[^/]+)/(?:regions/(?P<region>[^/]+)|global)/instanceTemplates/(?P<name>[^/]+)$"
)


def permanent_error(message: str) -> ProviderError:
    """A ProviderError that retrying cannot fix (configuration, a missing template, an unsold type)."""
    err = ProviderError(message, provider=PROVIDER)
    err.retryable = False
    return err


def location_of(region: str) -> str:
    """ "gcp:us-central1" → "us-central1"; another provider's region is a ProviderError."""
    provider, sep, location = region.partition(":")
    if not sep:
        return region
    if provider != PROVIDER or not location:
        raise ProviderError(f"{region} is not a GCP region", provider=PROVIDER)
    return location


def zone_url(project: str, zone: str) -> str:
    return f"{COMPUTE_URL}/projects/{project}/zones/{zone}"


def region_template_url(project: str, region: str, template: str) -> str:
    """A regional instance template's (partial) URL, as a MIG's instanceTemplate takes it."""
    return f"projects/{project}/regions/{region}/instanceTemplates/{template}"


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


def label_mismatch(mig: compute_v1.InstanceGroupManager, model: str) -> str | None:
    """Why a MIG's VMs are not labelled (and given the metadata) of `model`; None when they are."""
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
    return None


@dataclass(frozen=True, slots=True)
class _Group:
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
        return bool(self.status) and self.action not in _GONE

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


def _operation_errors(op: compute_v1.Operation) -> GcpOperationError | None:
    entries = [ComputeErrorEntry(e.code, e.message) for e in op.error.errors]
    return GcpOperationError(entries, op.http_error_status_code) if entries else None


def _parse_time(text: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


class GcpDriver:
    """Node groups as regional MIGs in `settings.gcp_project` (see the module docstring)."""

    provider = PROVIDER

    def __init__(
        self,
        settings: ProviderSettings,
        *,
        clients: LazyClients | None = None,
        offerings: Sequence[Offering] | None = None,
        poll: Backoff = DEFAULT_POLL,
    ) -> None:
        self._settings = settings
        self._clients = clients or LazyClients(settings)
        self._given_offerings = offerings
        self._poll = poll
        self._timeout = settings.call_timeout_s
        self._retry = read_retry(settings.call_timeout_s)
        # MIGs whose templates were checked: (project, region, name, MIG id, template URLs).
        self._checked: set[tuple[str, str, str, int, tuple[str, ...]]] = set()

    # --- resolving a spec --------------------------------------------------------------

    @cached_property
    def _catalog(self) -> dict[tuple[str, str], Offering]:
        offerings = self._given_offerings if self._given_offerings is not None else gcp_offerings.offerings()
        return {(o.region, o.instance_type): o for o in offerings if o.provider == PROVIDER}

    def _project(self) -> str:
        if not self._settings.gcp_project:
            raise permanent_error("no GCP project configured: set MERIDIAN_PROVIDER_GCP_PROJECT")
        return self._settings.gcp_project

    def offering(self, spec: GroupSpec) -> Offering:
        """The catalog's offering of the group's machine type in its region (ProviderError: none)."""
        if spec.provider != PROVIDER:
            raise ProviderError(f"group {spec.group_id} is on {spec.provider}, not GCP", provider=PROVIDER)
        location = location_of(spec.region)
        offering = self._catalog.get((f"{PROVIDER}:{location}", spec.instance_type))
        if offering is None:
            sold = sorted({r for r, t in self._catalog if t == spec.instance_type})
            where = f"it is sold in {', '.join(sold)}" if sold else "the GCP catalog has no such machine type"
            raise permanent_error(
                f"GCP machine type {spec.instance_type!r} is not offered in {spec.region} ({where})"
            )
        if offering.sku != spec.sku:
            raise permanent_error(f"{spec.instance_type} carries {offering.sku}, not {spec.sku}")
        return offering

    def _resolve(self, spec: GroupSpec) -> _Group:
        offering = self.offering(spec)
        prefix = self._settings.gcp_name_prefix
        try:
            mig = naming.mig_name(prefix, spec.model, spec.instance_type, spec.spot)
            template = naming.instance_template_name(prefix, spec.instance_type, spec.spot)
            base = naming.base_instance_name(prefix, spec.model, spec.region, spec.instance_type, spec.spot)
        except ValueError as e:
            raise permanent_error(f"cannot name the GCP resources of group {spec.group_id}: {e}") from e
        return _Group(
            project=self._project(),
            location=location_of(spec.region),
            machine_type=spec.instance_type,
            spot=spec.spot,
            model=spec.model,
            mig=mig,
            template=template,
            base_instance_name=base,
            gpus=offering.gpu_count,
            zones=offering.availability_zones,
        )

    async def _group(self, spec: GroupSpec) -> _Group:
        # The first call reads the catalog CSVs (a fraction of a second): off the event loop.
        return await asyncio.to_thread(self._resolve, spec)

    # --- calls and waits ---------------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._settings.operation_timeout_s

    async def _sleep(self, attempt: int, deadline: float, what: str, g: _Group) -> None:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise ProviderError(
                f"timed out after {self._settings.operation_timeout_s:g}s waiting for {what} ({g.where})",
                provider=PROVIDER,
            )
        await asyncio.sleep(min(self._poll.delay(attempt), left))

    async def _wait(self, g: _Group, op: compute_v1.Operation, deadline: float) -> None:
        """Poll a region operation until DONE; its errors come back typed."""
        attempt = 0
        name = op.name
        while op.status != compute_v1.Operation.Status.DONE:
            attempt += 1
            await self._sleep(attempt, deadline, f"operation {name}", g)
            op = await call(
                self._clients,
                g.where,
                lambda c: c.region_operations.get(
                    project=g.project,
                    region=g.location,
                    operation=name,
                    timeout=self._timeout,
                    retry=self._retry,
                ),
            )
        if (failed := _operation_errors(op)) is not None:
            raise map_error(failed, g.where)

    async def _get_mig(self, g: _Group) -> compute_v1.InstanceGroupManager | None:
        return await call_or_none(
            self._clients,
            g.where,
            lambda c: c.migs.get(
                project=g.project,
                region=g.location,
                instance_group_manager=g.mig,
                timeout=self._timeout,
                retry=self._retry,
            ),
        )

    async def _get_template(self, g: _Group, url: str) -> compute_v1.InstanceTemplate | None:
        """A regional or global instance template by its URL (None: it does not exist)."""
        m = _TEMPLATE_URL.search(url)
        if m is None:
            raise permanent_error(f"instance template URL {url!r} is neither regional nor global ({g.where})")
        project, region, name = m.group("project"), m.group("region"), m.group("name")
        if region is not None:
            return await call_or_none(
                self._clients,
                g.where,
                lambda c: c.region_templates.get(
                    project=project,
                    region=region,
                    instance_template=name,
                    timeout=self._timeout,
                    retry=self._retry,
                ),
            )
        return await call_or_none(
            self._clients,
            g.where,
            lambda c: c.templates.get(
                project=project, instance_template=name, timeout=self._timeout, retry=self._retry
            ),
        )

    async def _templates_mismatch(self, g: _Group, urls: Sequence[str]) -> str | None:
        """Why the templates at `urls` do not make the group's VMs; None when they all do."""
        if not urls:
            return "has no instance template"
        for url in urls:
            template = await self._get_template(g, url)
            if template is None:
                return f"uses instance template {url}, which does not exist"
            if (mismatch := template_mismatch(template, g.machine_type, g.spot)) is not None:
                return f"uses instance template {url}, which {mismatch}"
        return None

    async def _owned_mig(self, g: _Group) -> compute_v1.InstanceGroupManager | None:
        """The MIG under the group's name (None: there is none), once it is known to be the group's:
        labelled for its model and making VMs of its machine type (a non-retryable error if not)."""
        mig = await self._get_mig(g)
        if mig is None:
            return None
        urls = tuple(template_urls(mig))
        checked = (g.project, g.location, g.mig, mig.id, urls)
        problem = label_mismatch(mig, g.model)
        if problem is None and checked not in self._checked:
            # Templates are immutable: one look per (MIG, templates) is enough.
            problem = await self._templates_mismatch(g, urls)
        if problem is not None:
            raise permanent_error(
                f"MIG {g.mig} {problem}, so it is not the group of {g.model} on {g.machine_type}"
                f"{' (Spot)' if g.spot else ''} ({g.where}); rename or delete it"
            )
        self._checked.add(checked)
        return mig

    async def _members(self, g: _Group) -> list[Member] | None:
        """The MIG's instances; None when the MIG does not exist."""

        def run(c: ComputeClients) -> list[Member]:
            pager = c.migs.list_managed_instances(
                project=g.project,
                region=g.location,
                instance_group_manager=g.mig,
                timeout=self._timeout,
                retry=self._retry,
            )
            return [Member.of(mi) for mi in pager]

        return await call_or_none(self._clients, g.where, run)

    def _state(self, g: _Group, members: Sequence[Member]) -> GroupState:
        nodes = sorted(m.name for m in members if m.exists)
        bad = [n for n in nodes if not _NODE_ID.match(n)]
        if bad:
            raise ProviderError(
                f"instances {bad} of {g.where} are not valid Meridian node ids", provider=PROVIDER
            )
        return GroupState(nodes=tuple(nodes), gpus_per_node=g.gpus)

    async def _ensure_mig(
        self, g: _Group, spec: GroupSpec, deadline: float
    ) -> compute_v1.InstanceGroupManager:
        mig = await self._owned_mig(g)
        if mig is not None:
            return mig
        template = await self._get_template(g, g.template_url)
        if template is None:
            raise permanent_error(
                f"regional instance template {g.template} not found in project {g.project}, region "
                f"{g.location} (needed by {g.where}): synthesise and apply the Terraform stacks "
                "(`meridian iac synth`, then `terraform apply`) first"
            )
        if (mismatch := template_mismatch(template, g.machine_type, g.spot)) is not None:
            raise permanent_error(f"instance template {g.template_url} {mismatch} ({g.where})")
        resource = self._mig_resource(g, spec, g.template_url)
        op = await call_or_none(
            self._clients,
            g.where,
            lambda c: c.migs.insert_unary(
                project=g.project,
                region=g.location,
                instance_group_manager_resource=resource,
                timeout=self._timeout,
            ),
            absent=(api_exceptions.Conflict,),
        )
        if op is not None:  # None: someone else (a previous leader, Terraform) created it meanwhile
            await self._wait(g, op, deadline)
        mig = await self._owned_mig(g)
        if mig is None:
            raise ProviderError(f"the MIG was created but cannot be read back ({g.where})", provider=PROVIDER)
        return mig

    def _mig_resource(self, g: _Group, spec: GroupSpec, template_url: str) -> compute_v1.InstanceGroupManager:
        resource = compute_v1.InstanceGroupManager(
            name=g.mig,
            description=f"Meridian node group {spec.group_id}: {spec.model} on {spec.instance_type}"
            f"{' (Spot)' if spec.spot else ''}",
            base_instance_name=g.base_instance_name,
            instance_template=template_url,
            target_size=0,
            update_policy=compute_v1.InstanceGroupManagerUpdatePolicy(
                type_="OPPORTUNISTIC", instance_redistribution_type="NONE"
            ),
            all_instances_config=compute_v1.InstanceGroupManagerAllInstancesConfig(
                properties=compute_v1.InstancePropertiesPatch(
                    labels=naming.group_labels(spec.model, spec.group_id),
                    metadata={naming.METADATA_GROUP_ID: spec.group_id, naming.METADATA_MODEL: spec.model},
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

    async def _settle(self, g: _Group, size: int, deadline: float) -> GroupState:
        """Poll until the MIG has `size` instances whose VMs exist and nothing else; creation errors
        raise at once."""
        attempt = 0
        while True:
            members = await self._members(g)
            if members is None:
                raise ProviderError(f"the MIG disappeared while resizing ({g.where})", provider=PROVIDER)
            failing = [m for m in members if m.errors and m.action in _CREATING]
            if failing:
                m = failing[0]
                raise map_error(GcpOperationError(m.errors), f"{g.where}, creating instance {m.name}")
            if len(members) == size and all(m.exists for m in members):
                return self._state(g, members)
            attempt += 1
            created = sum(m.exists for m in members)
            await self._sleep(
                attempt,
                deadline,
                f"{size} instances ({created} created, {len(members)} in the group)",
                g,
            )

    # --- NodeGroupDriver ---------------------------------------------------------------

    async def ensure_group(self, spec: GroupSpec, known_nodes: Sequence[str] = ()) -> GroupState:
        """Adopt the group's MIG (iac's, at its size), or create it from its regional instance
        template (target size 0) when there is none.

        `known_nodes` is ignored: the MIG itself records the group's instances.
        """
        g = await self._group(spec)
        await self._ensure_mig(g, spec, self._deadline())
        return self._state(g, await self._members(g) or [])

    async def resize(self, spec: GroupSpec, size: int) -> GroupState:
        """Set the MIG's target size (adopting or creating it, as `ensure_group`) and wait until `size`
        instances exist."""
        if size < 0:
            raise ValueError("size must be >= 0")
        g = await self._group(spec)
        deadline = self._deadline()
        mig = await self._ensure_mig(g, spec, deadline)
        if mig.target_size != size:
            op = await call(
                self._clients,
                g.where,
                lambda c: c.migs.resize_unary(
                    project=g.project,
                    region=g.location,
                    instance_group_manager=g.mig,
                    size=size,
                    timeout=self._timeout,
                ),
            )
            await self._wait(g, op, deadline)
        return await self._settle(g, size, deadline)

    async def list_nodes(self, spec: GroupSpec) -> GroupState:
        """The MIG's instances that exist and are not being deleted (none when the MIG does not exist)."""
        g = await self._group(spec)
        if await self._owned_mig(g) is None:
            return GroupState(nodes=(), gpus_per_node=g.gpus)
        return self._state(g, await self._members(g) or [])

    async def terminate(self, spec: GroupSpec, node: str) -> GroupState:
        """Delete one instance through the MIG (its target size drops by one) and wait until it is gone."""
        g = await self._group(spec)
        deadline = self._deadline()
        members = await self._members(g) if await self._owned_mig(g) is not None else None
        if members is None:
            return GroupState(nodes=(), gpus_per_node=g.gpus)
        target = next((m for m in members if m.name == node), None)
        if target is None:
            return self._state(g, members)
        if target.action not in _GONE:
            request = compute_v1.RegionInstanceGroupManagersDeleteInstancesRequest(
                instances=[target.url], skip_instances_on_validation_error=True
            )
            op = await call(
                self._clients,
                g.where,
                lambda c: c.migs.delete_instances_unary(
                    project=g.project,
                    region=g.location,
                    instance_group_manager=g.mig,
                    region_instance_group_managers_delete_instances_request_resource=request,
                    timeout=self._timeout,
                ),
            )
            await self._wait(g, op, deadline)
        attempt = 0
        while True:
            members = await self._members(g) or []
            if all(m.name != node for m in members):
                return self._state(g, members)
            attempt += 1
            await self._sleep(attempt, deadline, f"instance {node} to be deleted", g)

    async def delete_group(self, spec: GroupSpec) -> None:
        """Delete the MIG and its instances; nothing to do when it does not exist."""
        g = await self._group(spec)
        if await self._owned_mig(g) is None:
            return
        op = await call_or_none(
            self._clients,
            g.where,
            lambda c: c.migs.delete_unary(
                project=g.project, region=g.location, instance_group_manager=g.mig, timeout=self._timeout
            ),
        )
        if op is not None:
            await self._wait(g, op, self._deadline())

    async def preemption_notices(self, spec: GroupSpec) -> list[PreemptionNotice]:
        """Spot VMs of the group that Compute Engine began to preempt recently (see the module docstring)."""
        if not spec.spot:
            return []
        g = await self._group(spec)
        mig = await self._owned_mig(g)
        if mig is None:
            return []
        names = {m.name for m in await self._members(g) or []}
        if not names:
            return []
        zones = sorted(
            {z for pz in mig.distribution_policy.zones if (z := pz.zone.rsplit("/", 1)[-1])} or set(g.zones)
        )
        now = datetime.now(UTC)
        notices: dict[str, PreemptionNotice] = {}
        for zone in zones:
            request = compute_v1.ListZoneOperationsRequest(
                project=g.project, zone=zone, filter=PREEMPTED_FILTER
            )

            def run(
                c: ComputeClients, request: compute_v1.ListZoneOperationsRequest = request
            ) -> list[compute_v1.Operation]:
                return list(c.zone_operations.list(request=request, timeout=self._timeout, retry=self._retry))

            for op in await call(self._clients, g.where, run):
                node = op.target_link.rsplit("/", 1)[-1]
                started = _parse_time(op.insert_time) or now
                if node not in names or now - started > timedelta(seconds=PREEMPTION_LOOKBACK_S):
                    continue
                deadline = started + timedelta(seconds=PREEMPTION_NOTICE_S)
                if node not in notices or notices[node].deadline < deadline:
                    notices[node] = PreemptionNotice(
                        node=node,
                        deadline=deadline,
                        reason=f"GCP is preempting Spot VM {node} in {zone} "
                        f"({op.status_message or op.operation_type})",
                    )
        return sorted(notices.values(), key=lambda n: n.node)
