"""Separate hosts on one machine: a region's nodes in their own network namespace, joined
to this host by a veth pair on a bridge, so that faults are real packets dropped by
nftables inside the namespace (a partition, random loss) rather than a proxy's doing.

Needs root, `ip` (iproute2) and `nft` (nftables); `netns_unavailable()` says what is missing.
The control plane binds the bridge's address, which this host's processes and the
namespaces' nodes both reach; routers reach the nodes at their namespace addresses.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from chaos.drill import Fault
from chaos.environment import DrillEnvironment, InjectionError
from chaos.faults.injector import register
from chaos.history import History
from localfabric import NodePlacement

_COMMAND_TIMEOUT_S = 15.0
_TABLE = "meridian_chaos"


class NetnsError(RuntimeError):
    """A namespace, link or nftables rule could not be set up (the message has ip's/nft's words)."""


def _run(*args: str) -> None:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")


def netns_unavailable() -> str | None:
    """Why separate hosts in network namespaces cannot be made here; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package})"
    name = f"mrd-probe-{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "netns", "exec", name, "nft", "list", "tables")
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace with nftables in it: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    return None


@dataclass
class Site:
    """One region's namespace: its name, its veth pair and its address on the bridge."""

    region: str
    namespace: str
    host_link: str
    ns_link: str
    address: str

    def placement(self) -> NodePlacement:
        return NodePlacement(command_prefix=("ip", "netns", "exec", self.namespace), host=self.address)

    def nft(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.namespace, "nft", *args)


@dataclass
class Sites:
    """The bridge and a namespace per region; `close()` removes all of it."""

    regions: tuple[str, ...]
    bridge: str = ""
    bridge_address: str = ""
    by_region: dict[str, Site] = field(default_factory=dict)

    def open(self) -> Sites:
        tag = secrets.token_hex(2)
        # A /24 of 10.231/16 picked at random: concurrent runs on one machine do not collide.
        subnet = f"10.231.{secrets.randbelow(250) + 1}"
        self.bridge, self.bridge_address = f"mrdbr{tag}", f"{subnet}.1"
        try:
            _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, region in enumerate(self.regions):
                site = Site(region, f"mrd-{tag}-{i}", f"mrdh{tag}{i}", f"mrdn{tag}{i}", f"{subnet}.{10 + i}")
                _run("ip", "netns", "add", site.namespace)
                self.by_region[region] = site
                _run("ip", "link", "add", site.host_link, "type", "veth", "peer", "name", site.ns_link)
                _run("ip", "link", "set", site.ns_link, "netns", site.namespace)
                _run("ip", "link", "set", site.host_link, "master", self.bridge, "up")
                inside = ("ip", "netns", "exec", site.namespace)
                _run(*inside, "ip", "addr", "add", f"{site.address}/24", "dev", site.ns_link)
                _run(*inside, "ip", "link", "set", site.ns_link, "up")
                _run(*inside, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def placement(self, node_id: str, region: str) -> NodePlacement | None:
        site = self.by_region.get(region)
        return site.placement() if site else None

    def close(self) -> None:
        # Deleting a namespace deletes its end of the veth pair, and with it the host's end.
        for site in self.by_region.values():
            subprocess.run(["ip", "netns", "del", site.namespace], capture_output=True,
                           timeout=_COMMAND_TIMEOUT_S, check=False)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True,
                           timeout=_COMMAND_TIMEOUT_S, check=False)
        self.by_region.clear()


@register("packet_loss")
class PacketLoss:
    """nftables inside the target region's namespace drops `percent` of the packets to and
    from its link (100: a partition; SYNs, data and FINs alike), both ways."""

    @staticmethod
    def unavailable() -> str | None:
        return netns_unavailable()

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        region = fault.target.region
        if env.sites is None or region not in env.sites.by_region:
            raise InjectionError(f"packet_loss needs the target region in topology.netns_regions (got {region})")
        self._env = env
        self._site = env.sites.by_region[region]
        self._percent = float(fault.params["percent"])
        self._ejections_before: dict[str, float] = {}
        self._victims = [p.node_id or "" for p in env.live_nodes() if p.region == region]

    async def inject(self) -> None:
        self._ejections_before = await self._env.routers.ejections(self._victims)
        site, percent = self._site, int(round(self._percent))
        match = () if percent >= 100 else ("numgen", "random", "mod", "100", "<", str(percent))
        site.nft("add", "table", "inet", _TABLE)
        for chain, hook, direction in (("in", "input", "iifname"), ("out", "output", "oifname")):
            site.nft("add", "chain", "inet", _TABLE, chain, "{", "type", "filter", "hook", hook, "priority", "0", ";",
                     "policy", "accept", ";", "}")
            site.nft("add", "rule", "inet", _TABLE, chain, direction, site.ns_link, *match, "drop")
        self._env.event("inject", f"nftables in {site.namespace} drops {percent}% of packets on {site.ns_link} "
                                  f"({site.region})")

    async def heal(self) -> None:
        self._site.nft("delete", "table", "inet", _TABLE)
        self._env.event("heal", f"{self._site.region}'s packets flow again")

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {"region_ejected": await self._env.routers.all_ejected_since(self._ejections_before)}
