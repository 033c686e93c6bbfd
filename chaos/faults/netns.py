"""Separate hosts on one machine: a region's nodes in their own network namespace, joined
to this host by a veth pair on a bridge, so that faults are real packets dropped by
nftables inside the namespace (a partition, random loss) rather than a proxy's doing.

Needs root, `ip` (iproute2) and `nft` (nftables); `netns_unavailable()` says what is missing.
The control plane binds the bridge's address, which this host's processes and the
namespaces' nodes both reach; routers reach the nodes at their namespace addresses.
The fault that acts on a site is chaos.faults.packet_loss.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from localfabric import NodePlacement

_COMMAND_TIMEOUT_S = 15.0


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
