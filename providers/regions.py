"""Every region Meridian knows, across providers, keyed by name ("aws:us-east-1")."""

from __future__ import annotations

from pathlib import Path

from meridian.contracts import RegionInfo
from providers.aws import regions as aws_regions
from providers.gcp import regions as gcp_regions
from providers.onprem import regions as onprem_regions
from providers.onprem.inventory import Inventory


def region_catalog(onprem_inventory: Path | Inventory | None = None) -> dict[str, RegionInfo]:
    """All known regions of all providers; on-prem sites come from the inventory file."""
    out: dict[str, RegionInfo] = {}
    for r in [*aws_regions.regions(), *gcp_regions.regions(), *onprem_regions.regions(onprem_inventory)]:
        out[r.name] = r
    return out
