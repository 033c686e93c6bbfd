"""On-prem sites, read from an inventory YAML file (one region per site)."""

from __future__ import annotations

from pathlib import Path

from meridian.contracts import RegionInfo
from providers.onprem.inventory import DEFAULT_INVENTORY, Inventory, InventoryError, load_inventory

__all__ = ["DEFAULT_INVENTORY", "InventoryError", "regions"]


def regions(inventory: Path | Inventory | None = None) -> list[RegionInfo]:
    """The inventory's sites as regions `onprem:<site>` (the built-in inventory when None)."""
    return [
        RegionInfo(
            name=s.region, provider="onprem", location=s.name,
            zones=s.zones, latitude=s.latitude, longitude=s.longitude,
        )
        for s in load_inventory(inventory).sites
    ]
