"""On-prem offerings: each host class of each site in the inventory, and how many hosts there are."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from providers.offerings import Offering
from providers.onprem.inventory import Inventory, load_inventory


def offerings(inventory: Path | Inventory | None = None) -> list[Offering]:
    """One offering per (site, host class); price is the amortised cost per host, no spot market."""
    return [
        Offering(
            provider="onprem", region=site.region, instance_type=h.instance_type, sku=h.sku,
            gpu_count=h.gpu_count, vcpus=h.vcpus, memory_gib=h.memory_gib,
            price_per_hour=h.price_per_hour, spot_price_per_hour=None,
        )
        for site in load_inventory(inventory).sites
        for h in site.hosts
    ]


def host_capacity(inventory: Path | Inventory | None = None) -> dict[tuple[str, str], int]:
    """Hosts per (region, instance type): the most instances of an offering placement may use."""
    sites = load_inventory(inventory).sites
    return {(site.region, h.instance_type): h.count for site in sites for h in site.hosts}


def onprem_capacity(inventory: Path | Inventory | None = None) -> dict[tuple[str, str], int]:
    """GPUs per (region, SKU) over all host classes of each site."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for site in load_inventory(inventory).sites:
        for h in site.hosts:
            out[(site.region, h.sku)] += h.count * h.gpu_count
    return dict(out)
