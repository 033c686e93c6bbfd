"""The GPU catalog placement works from: canonical SKUs and every provider's offerings of them.

Built fresh by `load_catalog` from the registered providers (`providers.provider.PROVIDERS`:
the built-ins read vendored AWS/GCP rows and the on-prem inventory), so a provider registered
later is in the next catalog with no change here; nothing is cached at module level, so a
changed inventory file is seen by the next load too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from providers.offerings import Offering
from providers.onprem.inventory import Inventory, load_inventory
from providers.provider import PROVIDERS, ProviderRegistry
from providers.skus import SKUS, GpuSku, normalise_gpu_name


def per_gpu_hour(offering: Offering, spot: bool = False) -> float | None:
    """The offering's on-demand (or spot) price divided by its GPU count; None when not sold that way."""
    price = offering.spot_price_per_hour if spot else offering.price_per_hour
    return None if price is None else price / offering.gpu_count


@dataclass(frozen=True)
class Catalog:
    """Canonical SKUs, the offerings of all providers, and the instance limits of finite (on-prem) sites."""

    skus: dict[str, GpuSku]
    offerings: tuple[Offering, ...]
    # The providers it was built from, in name order (one may have no offerings).
    providers: tuple[str, ...]
    # Most instances of an offering there are, keyed by (region, instance type). Absent means the
    # catalog knows no limit (clouds: quotas are enforced at provisioning time, not here).
    host_limits: dict[tuple[str, str], int] = field(default_factory=dict)

    def where(
        self, provider: str | None = None, region: str | None = None, sku: str | None = None
    ) -> Catalog:
        """The catalog narrowed to a provider, a region and/or a SKU (any spelling of it)."""
        canonical = normalise_gpu_name(sku).name if sku is not None else None
        kept = tuple(
            o for o in self.offerings
            if (provider is None or o.provider == provider)
            and (region is None or o.region == region)
            and (canonical is None or o.sku == canonical)
        )
        keys = {(o.region, o.instance_type) for o in kept}
        limits = {k: v for k, v in self.host_limits.items() if k in keys}
        return replace(self, offerings=kept, host_limits=limits)

    def for_region(self, region: str) -> list[Offering]:
        """Offerings in one region ("aws:us-east-1")."""
        return [o for o in self.offerings if o.region == region]

    def for_sku(self, sku: str) -> list[Offering]:
        """Offerings of one SKU (any spelling), cheapest on-demand $/GPU-hour first, unpriced last."""
        canonical = normalise_gpu_name(sku).name
        return sorted((o for o in self.offerings if o.sku == canonical), key=_price_order)

    def regions(self) -> set[str]:
        """Every region with at least one offering."""
        return {o.region for o in self.offerings}

    def gpu_counts(self, sku: str, provider: str | None = None) -> list[int]:
        """Distinct GPUs-per-instance a SKU comes in (e.g. [1, 2, 4, 8]), ascending."""
        canonical = normalise_gpu_name(sku).name
        return sorted({o.gpu_count for o in self.offerings
                       if o.sku == canonical and (provider is None or o.provider == provider)})

    def cheapest_per_gpu_hour(
        self, provider: str, sku: str, region: str | None = None, spot: bool = False
    ) -> float | None:
        """Lowest $/GPU-hour of a SKU at a provider (optionally in one region); None when not offered."""
        canonical = normalise_gpu_name(sku).name
        prices = [
            p for o in self.offerings
            if o.provider == provider and o.sku == canonical and (region is None or o.region == region)
            and (p := per_gpu_hour(o, spot)) is not None
        ]
        return min(prices) if prices else None

    def gpu_capacity(self, region: str, sku: str) -> int | None:
        """GPUs of a SKU a finite site has (hosts × GPUs per host); None when the region has no limit."""
        canonical = normalise_gpu_name(sku).name
        limited = [o for o in self.for_region(region) if (o.region, o.instance_type) in self.host_limits]
        if not limited:
            return None
        return sum(self.host_limits[(o.region, o.instance_type)] * o.gpu_count
                   for o in limited if o.sku == canonical)


def _price_order(o: Offering) -> tuple[bool, float, int, str, str]:
    p = per_gpu_hour(o)
    # Rounded so that float noise (21.533/4 vs 43.066/8) does not decide between equal prices.
    return (p is None, round(p, 6) if p is not None else 0.0, o.gpu_count, o.region, o.instance_type)


def load_catalog(
    onprem_inventory: Path | Inventory | None = None, providers: ProviderRegistry | None = None
) -> Catalog:
    """The catalog of every registered provider (`PROVIDERS` unless given), on-prem sites from
    the inventory (built-in when None)."""
    sites = load_inventory(onprem_inventory)
    described = (providers or PROVIDERS).descriptions()
    return Catalog(
        skus=dict(SKUS),
        offerings=tuple(o for d in described for o in d.offerings(sites)),
        providers=tuple(d.name for d in described),
        host_limits={key: n for d in described for key, n in d.host_limits(sites).items()},
    )
