"""The on-prem inventory file: sites (one Meridian region each) and the host classes racked there.

```yaml
sites:
  - name: tokyo-1
    latitude: 35.68
    longitude: 139.69
    zones: [apac]
    hosts:
      - {instance_type: dgx-h100, sku: H100-80GB-SXM, gpu_count: 8, count: 4,
         vcpus: 224, memory_gib: 2048, price_per_hour: 14.0}
```

`count` is how many such hosts the site has: unlike a cloud, a site's capacity is finite.
`price_per_hour` is the amortised cost of one host (0 when sunk). `sku` may be any spelling
`normalise_gpu_name` resolves without ambiguity; it is stored canonical.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meridian.contracts import ZoneName
from providers.skus import UnknownGpuError, normalise_gpu_name

DEFAULT_INVENTORY = Path(__file__).with_name("default_inventory.yaml")


class InventoryError(ValueError):
    """The on-prem inventory file is missing or malformed."""


class HostClass(BaseModel):
    """One kind of host at a site (same GPUs, CPUs, memory) and how many of them there are."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    instance_type: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    sku: str
    gpu_count: int = Field(ge=1, le=64)
    count: int = Field(ge=1)
    vcpus: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    price_per_hour: float = Field(0.0, ge=0)

    @field_validator("sku")
    @classmethod
    def _canonical_sku(cls, v: str) -> str:
        try:
            return normalise_gpu_name(v).name
        except UnknownGpuError as e:
            raise ValueError(str(e)) from None


class Site(BaseModel):
    """One on-prem data centre; it becomes the region `onprem:<name>`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    zones: list[ZoneName] = Field(min_length=1)
    hosts: list[HostClass] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_host_classes(self) -> Site:
        names = [h.instance_type for h in self.hosts]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"site {self.name}: host class listed twice: {', '.join(dupes)}")
        return self

    @property
    def region(self) -> str:
        return f"onprem:{self.name}"


class Inventory(BaseModel):
    """The whole inventory file; keys other than `sites` are left to their own readers."""

    model_config = ConfigDict(extra="allow", frozen=True)
    sites: list[Site] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_sites(self) -> Inventory:
        names = [s.name for s in self.sites]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"site listed twice: {', '.join(dupes)}")
        return self


def load_inventory(source: Path | Inventory | None = None) -> Inventory:
    """Parse and validate an inventory file (the built-in default when None; an Inventory
    already parsed is returned as it is); InventoryError when bad."""
    if isinstance(source, Inventory):
        return source
    path = source or DEFAULT_INVENTORY
    try:
        raw = yaml.safe_load(path.read_text())
        return Inventory.model_validate(raw or {})
    except OSError as e:
        raise InventoryError(f"cannot read on-prem inventory {path}: {e}") from e
    except (yaml.YAMLError, ValidationError) as e:
        raise InventoryError(f"invalid on-prem inventory {path}: {e}") from e
