"""Packet loss inside a region's network namespace (chaos.faults.netns): nftables drops a
share of the packets on the namespace's link, so a partition is real packets lost, not a
proxy's doing."""

from __future__ import annotations

from collections.abc import Mapping

from chaos.drill import Fault
from chaos.environment import DrillEnvironment, InjectionError
from chaos.faults.netns import netns_unavailable
from chaos.history import History

_TABLE = "meridian_chaos"


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
