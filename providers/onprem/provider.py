"""The on-prem provider: the inventory's sites, their host classes, and the allocation driver."""

from __future__ import annotations

from meridian.contracts import RegionInfo
from providers.driver import NodeGroupDriver
from providers.offerings import Offering
from providers.onprem import offerings as onprem_offerings
from providers.onprem import regions as onprem_regions
from providers.onprem.driver import PROVIDER, OnPremDriver
from providers.onprem.inventory import Inventory, load_inventory
from providers.provider import ProviderConfig, Quota


class OnPremProvider:
    """Sites of an inventory file; the only quota is the hosts racked at each site."""

    name = PROVIDER

    def __init__(self, inventory: Inventory | None = None) -> None:
        self._inventory = load_inventory(inventory)
        self._driver = OnPremDriver(self._inventory)

    @classmethod
    def from_config(cls, config: ProviderConfig) -> OnPremProvider:
        return cls(config.onprem_inventory)

    def regions(self) -> list[RegionInfo]:
        return onprem_regions.regions(self._inventory)

    def offerings(self) -> list[Offering]:
        return onprem_offerings.offerings(self._inventory)

    async def quotas(self, region: str) -> list[Quota]:
        """Per host class at the site: hosts racked (limit) and hosts groups hold (used)."""
        out = []
        for site in self._inventory.sites:
            if site.region != region:
                continue
            for h in site.hosts:
                free = self._driver.free_hosts(region, h.instance_type)
                out.append(Quota(region=region, name=f"{h.instance_type} hosts", unit="instances",
                                 limit=h.count, used=h.count - free))
        return out

    def driver(self) -> NodeGroupDriver:
        return self._driver
