"""On-prem sites that take the simulated fleet to the issue's 100 regions.

The catalog (providers.catalog, from ../shared/data) describes 45 cloud regions, and the
built-in inventory 3 on-prem sites: 48 regions, short of the 100 the growth curve asks for at
10,000 nodes. The rest are colocation sites, as operators rack their own GPUs next to the cloud
regions they peer with: each takes the coordinates and zones of a real catalog region (so
distances and residency stay those of real places), is named `colo-<provider>-<region>-<n>`,
and goes into an inventory file the control plane reads (MERIDIAN_CP_ONPREM_INVENTORY): the
same path an operator's own sites take, so the control plane and every router see 100 regions
as they would in production.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from meridian.contracts import RegionInfo
from providers.onprem.inventory import DEFAULT_INVENTORY
from providers.regions import region_catalog

# One small host class per colocation site: the simulator places no replica by capacity.
_HOST = {"instance_type": "colo-l40s-4x", "sku": "L40S-48GB", "gpu_count": 4, "count": 2,
         "vcpus": 64, "memory_gib": 512, "price_per_hour": 2.4}


def colo_sites(regions: list[RegionInfo], count: int) -> list[dict[str, object]]:
    """`count` colocation sites, one per cloud region in turn (sorted by name), then a second
    round, and so on."""
    clouds = sorted((r for r in regions if r.provider != "onprem"), key=lambda r: r.name)
    if count > 0 and not clouds:
        raise ValueError("no cloud region to place colocation sites beside")
    sites = []
    for i in range(count):
        r = clouds[i % len(clouds)]
        name = f"colo-{r.name.replace(':', '-')}-{i // len(clouds) + 1}"
        sites.append({"name": name, "latitude": r.latitude, "longitude": r.longitude,
                      "zones": list(r.zones), "hosts": [dict(_HOST)]})
    return sites


def inventory_for(total_regions: int, path: Path) -> Path | None:
    """Write an inventory with the built-in sites plus enough colocation sites for the
    catalog to reach `total_regions`; None (no file needed) when it already has as many."""
    regions = list(region_catalog().values())
    missing = total_regions - len(regions)
    if missing <= 0:
        return None
    builtin = yaml.safe_load(DEFAULT_INVENTORY.read_text())
    builtin["sites"] = list(builtin["sites"]) + colo_sites(regions, missing)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(builtin, sort_keys=False))
    return path
