"""On-prem sites, read from an inventory YAML file (one region per site)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meridian.contracts import RegionInfo, ZoneName

DEFAULT_INVENTORY = Path(__file__).with_name("default_inventory.yaml")


class InventoryError(ValueError):
    """The on-prem inventory file is missing or malformed."""


class _Site(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    zones: list[ZoneName] = Field(min_length=1)


class _Inventory(BaseModel):
    model_config = ConfigDict(extra="allow")
    sites: list[_Site] = Field(default_factory=list)


def regions(inventory: Path | None = None) -> list[RegionInfo]:
    path = inventory or DEFAULT_INVENTORY
    try:
        raw = yaml.safe_load(path.read_text())
        inv = _Inventory.model_validate(raw or {})
    except OSError as e:
        raise InventoryError(f"cannot read on-prem inventory {path}: {e}") from e
    except (yaml.YAMLError, ValidationError) as e:
        raise InventoryError(f"invalid on-prem inventory {path}: {e}") from e
    return [
        RegionInfo(
            name=f"onprem:{s.name}", provider="onprem", location=s.name,
            zones=s.zones, latitude=s.latitude, longitude=s.longitude,
        )
        for s in inv.sites
    ]
