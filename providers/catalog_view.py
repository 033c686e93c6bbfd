"""The tables of `meridian catalog gpus` (providers/cli.py): the GPU SKU catalog, in the manner
of SkyPilot's `sky show-gpus`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table

from meridian.cli_format import folding_table
from providers.catalog import Catalog, per_gpu_hour

PRICE_NOTE = (
    "$/GPU-h: cheapest on-demand price of an instance divided by its GPUs. gcp n1+NxGPU offerings price "
    "the GPUs only (the n1 host VM is extra); onprem prices are amortised host costs."
)


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.3f}"


def gpus_rows(catalog: Catalog, providers: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """`gpus_table`'s rows as data (`-o json`): each offered SKU and its cheapest $/GPU-hour per provider."""
    providers = catalog.providers if providers is None else providers
    offered = {o.sku for o in catalog.offerings}
    return [
        {**asdict(sku), "gpu_counts": catalog.gpu_counts(sku.name),
         "per_gpu_hour": {p: catalog.cheapest_per_gpu_hour(p, sku.name) for p in providers}}
        for sku in catalog.skus.values() if sku.name in offered
    ]


def sku_offerings_rows(catalog: Catalog, sku: str) -> list[dict[str, Any]]:
    """`sku_offerings_table`'s rows as data (`-o json`): every offering of one SKU, cheapest first."""
    return [{**asdict(o), "per_gpu_hour": per_gpu_hour(o)} for o in catalog.for_sku(catalog.skus[sku].name)]


def gpus_table(catalog: Catalog, providers: tuple[str, ...] | None = None) -> Table:
    """One row per SKU that is offered: memory, speed, GPUs per instance, cheapest $/GPU-hour per
    provider (those given, or every provider of the catalog)."""
    if providers is None:
        providers = catalog.providers
    prices = tuple(f"{p} $/GPU-h" for p in providers)
    table = folding_table("SKU", "Memory", "bf16 TFLOP/s", "GPUs per instance", *prices,
                          right=("Memory", "bf16 TFLOP/s", *prices), title="GPU SKUs", caption=PRICE_NOTE)
    offered = {o.sku for o in catalog.offerings}
    for sku in catalog.skus.values():
        if sku.name not in offered:
            continue
        table.add_row(
            sku.name,
            f"{sku.memory_gib:g} GiB",
            f"{sku.bf16_tflops:g}",
            ", ".join(str(n) for n in catalog.gpu_counts(sku.name)),
            *(_money(catalog.cheapest_per_gpu_hour(p, sku.name)) for p in providers),
        )
    return table


def sku_offerings_table(catalog: Catalog, sku: str) -> Table:
    """Every offering of one SKU, cheapest on-demand $/GPU-hour first (unpriced last)."""
    canonical = catalog.skus[sku]
    numbers = ("GPUs", "vCPUs", "Memory", "$/h", "Spot $/h", "$/GPU-h")
    table = folding_table("Provider", "Instance type", "Region", *numbers, right=numbers,
                          title=f"{canonical.name} ({canonical.memory_gib:g} GiB, {canonical.interconnect})",
                          caption=PRICE_NOTE)
    for o in catalog.for_sku(canonical.name):
        table.add_row(
            o.provider, o.instance_type, o.region, str(o.gpu_count),
            f"{o.vcpus:g}" if o.vcpus else "-", f"{o.memory_gib:g} GiB" if o.memory_gib else "-",
            _money(o.price_per_hour), _money(o.spot_price_per_hour), _money(per_gpu_hour(o)),
        )
    return table
