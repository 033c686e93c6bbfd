"""The GCP node-group driver: one regional managed instance group (MIG) per node group.

iac/ creates a regional instance template per machine type (and per Spot or on-demand) in each
region, and the MIG of each (model, region, machine type, Spot) at the plan's first size, leaving
its target size to the control plane afterwards. The driver finds the MIG by its name (computed
from those four alone, providers.gcp.naming) and adopts it; when there is none (a plan applied
before Terraform ran, or no iac at all) it creates it from the template (target size 0, spread
over the zones the catalog sells the machine type in). It resizes the MIG, deletes named
instances and deletes it. A MIG under the group's name whose `meridian-model` label (or model
metadata) is another model's, whose prefill/decode role metadata is another role's, or whose
instance template is for another machine type (or market), is refused: never resized, adopted
or deleted. A prefill or decode group's MIG has names of its own and gives its VMs their role
(providers.gcp.naming.METADATA_PD_ROLE, read into MERIDIAN_NODE_ROLE by the node's boot). The MIG is the durable record of a
group's nodes, so `ensure_group` ignores `known_nodes`. Node ids are the MIG's instance names
("<base instance name>-xxxx", see providers.gcp.naming). What the driver decides from the
API's answers (is a MIG the group's, which MIG to create, a MIG's instances) is the pure
providers.gcp.migs; this module makes the calls and waits around them.

The SDK (google-cloud-compute, REST transport) blocks; every call runs in a worker thread with
`call_timeout_s`, and the waits between calls are sleeps on its clock, so a caller that cancels
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
from datetime import timedelta
from functools import cached_property

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from meridian.backoff import Backoff
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NODE_ID_PATTERN
from meridian.settings.providers import ProviderSettings
from providers.driver import GroupSpec, GroupState, PreemptionNotice
from providers.errors import ProviderError
from providers.gcp import naming
from providers.gcp import offerings as gcp_offerings
from providers.gcp.clients import ComputeClients, LazyClients, call, call_or_none, read_retry
from providers.gcp.errors import GcpOperationError, map_error
from providers.gcp.migs import (
    CREATING_ACTIONS,
    GONE_ACTIONS,
    Group,
    Member,
    label_mismatch,
    mig_resource,
    operation_errors,
    parse_template_url,
    parse_time,
    template_mismatch,
    template_urls,
)
from providers.offerings import Offering

PROVIDER = "gcp"
PREEMPTION_NOTICE_S = 30.0
PREEMPTION_LOOKBACK_S = 120.0
PREEMPTED_FILTER = 'operationType="compute.instances.preempted"'
DEFAULT_POLL = Backoff(base_s=0.1, max_s=5.0, jitter=0.1)

_NODE_ID = re.compile(NODE_ID_PATTERN)


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
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._clock = clock
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

    def _resolve(self, spec: GroupSpec) -> Group:
        offering = self.offering(spec)
        prefix = self._settings.gcp_name_prefix
        try:
            role = spec.role.value
            mig = naming.mig_name(prefix, spec.model, spec.instance_type, spec.spot, role)
            template = naming.instance_template_name(prefix, spec.instance_type, spec.spot)
            base = naming.base_instance_name(prefix, spec.model, spec.region, spec.instance_type, spec.spot, role)
        except ValueError as e:
            raise permanent_error(f"cannot name the GCP resources of group {spec.group_id}: {e}") from e
        return Group(
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
            role=spec.role.value,
        )

    async def _group(self, spec: GroupSpec) -> Group:
        # The first call reads the catalog CSVs (a fraction of a second): off the event loop.
        return await asyncio.to_thread(self._resolve, spec)

    # --- calls and waits ---------------------------------------------------------------

    def _deadline(self) -> float:
        return self._clock.monotonic() + self._settings.operation_timeout_s

    async def _sleep(self, attempt: int, deadline: float, what: str, g: Group) -> None:
        left = deadline - self._clock.monotonic()
        if left <= 0:
            raise ProviderError(
                f"timed out after {self._settings.operation_timeout_s:g}s waiting for {what} ({g.where})",
                provider=PROVIDER,
            )
        await self._clock.sleep(min(self._poll.delay(attempt), left))

    async def _wait(self, g: Group, op: compute_v1.Operation, deadline: float) -> None:
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
        if (failed := operation_errors(op)) is not None:
            raise map_error(failed, g.where)

    async def _get_mig(self, g: Group) -> compute_v1.InstanceGroupManager | None:
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

    async def _get_template(self, g: Group, url: str) -> compute_v1.InstanceTemplate | None:
        """A regional or global instance template by its URL (None: it does not exist)."""
        parsed = parse_template_url(url)
        if parsed is None:
            raise permanent_error(f"instance template URL {url!r} is neither regional nor global ({g.where})")
        project, region, name = parsed
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

    async def _templates_mismatch(self, g: Group, urls: Sequence[str]) -> str | None:
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

    async def _owned_mig(self, g: Group) -> compute_v1.InstanceGroupManager | None:
        """The MIG under the group's name (None: there is none), once it is known to be the group's:
        labelled for its model and making VMs of its machine type (a non-retryable error if not)."""
        mig = await self._get_mig(g)
        if mig is None:
            return None
        urls = tuple(template_urls(mig))
        checked = (g.project, g.location, g.mig, mig.id, urls)
        problem = label_mismatch(mig, g.model, g.role)
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

    async def _members(self, g: Group) -> list[Member] | None:
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

    def _state(self, g: Group, members: Sequence[Member]) -> GroupState:
        nodes = sorted(m.name for m in members if m.exists)
        bad = [n for n in nodes if not _NODE_ID.match(n)]
        if bad:
            raise ProviderError(
                f"instances {bad} of {g.where} are not valid Meridian node ids", provider=PROVIDER
            )
        return GroupState(nodes=tuple(nodes), gpus_per_node=g.gpus)

    async def _ensure_mig(
        self, g: Group, spec: GroupSpec, deadline: float
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
        resource = mig_resource(g, spec)
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

    async def _settle(self, g: Group, size: int, deadline: float) -> GroupState:
        """Poll until the MIG has `size` instances whose VMs exist and nothing else; creation errors
        raise at once."""
        attempt = 0
        while True:
            members = await self._members(g)
            if members is None:
                raise ProviderError(f"the MIG disappeared while resizing ({g.where})", provider=PROVIDER)
            failing = [m for m in members if m.errors and m.action in CREATING_ACTIONS]
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
        if target.action not in GONE_ACTIONS:
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
        now = self._clock.now()
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
                started = parse_time(op.insert_time) or now
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
