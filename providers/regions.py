"""Every region Meridian knows, across the registered providers, keyed by name ("aws:us-east-1")."""

from __future__ import annotations

from pathlib import Path

from meridian.contracts import RegionInfo
from providers.onprem.inventory import Inventory, load_inventory
from providers.provider import PROVIDERS, ProviderRegistry


def region_catalog(
    onprem_inventory: Path | Inventory | None = None, providers: ProviderRegistry | None = None
) -> dict[str, RegionInfo]:
    """All regions of all registered providers (`PROVIDERS` unless given); on-prem sites come
    from the inventory file (built-in when None)."""
    sites = load_inventory(onprem_inventory)
    return {r.name: r for d in (providers or PROVIDERS).descriptions() for r in d.regions(sites)}
