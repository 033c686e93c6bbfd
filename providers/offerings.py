"""What a provider sells (or an on-prem site has): an instance type of SKU × count, per region."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Offering:
    """One instance type in one region, with the GPUs it carries as a canonical SKU.

    Rows of a cloud's catalog that differ only by availability zone are one offering;
    `availability_zones` lists them. Prices are USD per hour for the whole instance
    (on GCP: host VM plus its attached GPUs). None means not sold that way (no spot
    market, or no on-demand price) in that region.
    """

    provider: str  # "aws" | "gcp" | "onprem"
    region: str  # Meridian region name, "<provider>:<location>", e.g. "aws:us-east-1"
    instance_type: str  # "p5.48xlarge", "a3-highgpu-8g", an on-prem host class
    sku: str  # key of providers.skus.SKUS
    gpu_count: int
    vcpus: float
    memory_gib: float
    price_per_hour: float | None
    spot_price_per_hour: float | None
    availability_zones: tuple[str, ...] = ()


class CatalogDataError(ValueError):
    """A catalog row (cloud CSV or on-prem host) that cannot be read as an offering."""


def parse_price(cell: str | None, where: str, column: str) -> float | None:
    """A catalog price cell in USD/h; blank means not sold that way (no on-demand price, no spot)."""
    text = (cell or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise CatalogDataError(f"{where}: {column} {text!r} is not a number") from None
