"""The on-prem node-group driver: node groups are allocations of the inventory's hosts.

A site has `count` hosts of each host class (providers.onprem.inventory); host `i` of class
`t` at site `s` is the node `s-t-i` (its node agent registers under that id). A group takes
free hosts of its class when it grows and gives named hosts back when the control plane
removes them; it can never take more hosts than the site has (CapacityError).

The allocation table lives in this object. It is not durable on purpose: the control plane's
database is the record of which hosts each group holds, and a control plane that takes over
passes them back through `ensure_group(spec, known_nodes)`.

A host runs what its group says: `host_env` gives the node settings a host's node agent
starts with (its model and region, and `MERIDIAN_NODE_ROLE` when its group is a prefill or
decode pool's), which whoever starts the agent on the host (the site's operator or its
host agent) applies. A co-located group's hosts get no role variable, as before P/D.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from meridian.contracts import NODE_ID_PATTERN
from providers.driver import GroupSpec, GroupState, PreemptionNotice, role_env
from providers.errors import CapacityError, ProviderError
from providers.onprem.inventory import HostClass, Inventory, Site, load_inventory

PROVIDER = "onprem"
_NODE_ID = re.compile(NODE_ID_PATTERN)


def host_name(site: Site, host_class: HostClass, index: int) -> str:
    """The node id of host `index` (from 1) of a host class at a site."""
    return f"{site.name}-{host_class.instance_type}-{index}"


class OnPremDriver:
    """Allocates inventory hosts to node groups; `resize` beyond the site's hosts raises CapacityError."""

    provider = PROVIDER

    def __init__(self, inventory: Inventory | Path | None = None) -> None:
        inv = load_inventory(inventory)
        self._classes: dict[tuple[str, str], tuple[Site, HostClass]] = {
            (site.region, h.instance_type): (site, h) for site in inv.sites for h in site.hosts
        }
        # group id → hosts it holds, in allocation order. Every method body runs without an
        # await, so on one event loop each call is atomic and needs no lock.
        self._groups: dict[str, list[str]] = {}
        # group id → its spec as last seen, for what its hosts run (host_env).
        self._specs: dict[str, GroupSpec] = {}

    def _host_class(self, spec: GroupSpec) -> tuple[Site, HostClass]:
        if spec.provider != PROVIDER:
            raise ProviderError(f"group {spec.group_id} is on {spec.provider}, not on-prem", provider=PROVIDER)
        found = self._classes.get((spec.region, spec.instance_type))
        if found is None:
            raise CapacityError(
                f"site {spec.region} has no hosts of type {spec.instance_type!r} in the inventory", provider=PROVIDER
            )
        site, host_class = found
        if (known := self._specs.get(spec.group_id)) is not None and known.role is not spec.role:
            raise ProviderError(
                f"group {spec.group_id} runs {known.role.value} nodes, not {spec.role.value}", provider=PROVIDER
            )
        if host_class.sku != spec.sku:
            raise ProviderError(
                f"{spec.instance_type} hosts at {spec.region} carry {host_class.sku}, not {spec.sku}", provider=PROVIDER
            )
        if spec.spot:
            raise ProviderError("on-prem hosts have no spot market", provider=PROVIDER)
        return site, host_class

    def _hosts(self, site: Site, host_class: HostClass) -> list[str]:
        names = [host_name(site, host_class, i) for i in range(1, host_class.count + 1)]
        if not all(_NODE_ID.match(n) for n in names):
            raise ProviderError(
                f"host names of {host_class.instance_type} at {site.name} are not valid node ids", provider=PROVIDER
            )
        return names

    def _taken(self, hosts: list[str], except_group: str) -> set[str]:
        pool = set(hosts)
        return {h for gid, held in self._groups.items() if gid != except_group for h in held if h in pool}

    def _state(self, spec: GroupSpec, host_class: HostClass) -> GroupState:
        return GroupState(nodes=tuple(self._groups.get(spec.group_id, ())), gpus_per_node=host_class.gpu_count)

    async def ensure_group(self, spec: GroupSpec, known_nodes: Sequence[str] = ()) -> GroupState:
        """Register the group, adopting `known_nodes` (hosts of its class no other group holds)."""
        site, host_class = self._host_class(spec)
        hosts = self._hosts(site, host_class)
        held = self._groups.setdefault(spec.group_id, [])
        self._specs[spec.group_id] = spec
        taken = self._taken(hosts, spec.group_id)
        for node in known_nodes:
            if node not in hosts:
                raise ProviderError(f"{node} is not a {spec.instance_type} host of {spec.region}", provider=PROVIDER)
            if node in taken:
                raise ProviderError(f"{node} is already allocated to another group", provider=PROVIDER)
            if node not in held:
                held.append(node)
        return self._state(spec, host_class)

    async def resize(self, spec: GroupSpec, size: int) -> GroupState:
        """Take free hosts (lowest index first) or give back the most recently taken ones."""
        if size < 0:
            raise ValueError("size must be >= 0")
        site, host_class = self._host_class(spec)
        hosts = self._hosts(site, host_class)
        held = self._groups.setdefault(spec.group_id, [])
        self._specs[spec.group_id] = spec
        if size > len(held):
            taken = self._taken(hosts, spec.group_id) | set(held)
            free = [h for h in hosts if h not in taken]
            missing = size - len(held)
            if missing > len(free):
                raise CapacityError(
                    f"{spec.region} has {len(free)} free {spec.instance_type} host(s) of {host_class.count}; "
                    f"group {spec.group_id} needs {missing} more",
                    provider=PROVIDER,
                )
            held.extend(free[:missing])
        else:
            del held[size:]
        return self._state(spec, host_class)

    async def list_nodes(self, spec: GroupSpec) -> GroupState:
        _, host_class = self._host_class(spec)
        return self._state(spec, host_class)

    async def terminate(self, spec: GroupSpec, node: str) -> GroupState:
        """Give one host back to the site (no-op when the group does not hold it)."""
        _, host_class = self._host_class(spec)
        held = self._groups.get(spec.group_id, [])
        if node in held:
            held.remove(node)
        return self._state(spec, host_class)

    async def delete_group(self, spec: GroupSpec) -> None:
        self._groups.pop(spec.group_id, None)
        self._specs.pop(spec.group_id, None)

    async def preemption_notices(self, spec: GroupSpec) -> list[PreemptionNotice]:
        """Owned hosts are never taken back."""
        return []

    def host_env(self, node: str) -> dict[str, str]:
        """The node settings host `node` runs its node agent with, as its group says (empty when
        no group holds it): model and region, and the group's prefill/decode role (`role_env`)."""
        for group_id, held in self._groups.items():
            if node in held:
                spec = self._specs[group_id]
                return {"MERIDIAN_NODE_MODEL_NAME": spec.model, "MERIDIAN_NODE_REGION": spec.region, **role_env(spec)}
        return {}

    def free_hosts(self, region: str, instance_type: str) -> int:
        """Hosts of a class at a site that no group holds."""
        site, host_class = self._classes[(region, instance_type)]
        hosts = self._hosts(site, host_class)
        return len(hosts) - len(self._taken(hosts, except_group=""))
