"""The tables of `meridian catalog gpus` (providers/cli.py): the GPU SKU catalog, in the manner
of SkyPilot's `sky show-gpus`."""

from __future__ import annotations

from rich.table import Table

from providers.catalog import Catalog, per_gpu_hour

PRICE_NOTE = (
    "$/GPU-h: cheapest on-demand price of an instance divided by its GPUs. gcp n1+NxGPU offerings price "
    "the GPUs only (the n1 host VM is extra); onprem prices are amortised host costs."
)


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.3f}"


def gpus_table(catalog: Catalog, providers: tuple[str, ...] | None = None) -> Table:
    """One row per SKU that is offered: memory, speed, GPUs per instance, cheapest $/GPU-hour per
    provider (those given, or every provider of the catalog)."""
    if providers is None:
        providers = catalog.providers
    table = Table(title="GPU SKUs", header_style="bold", caption=PRICE_NOTE)
    table.add_column("SKU")
    table.add_column("Memory", justify="right")
    table.add_column("bf16 TFLOP/s", justify="right")
    table.add_column("GPUs per instance")
    for provider in providers:
        table.add_column(f"{provider} $/GPU-h", justify="right")
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
    table = Table(title=f"{canonical.name} ({canonical.memory_gib:g} GiB, {canonical.interconnect})",
                  header_style="bold", caption=PRICE_NOTE)
    text_columns = ("Provider", "Instance type", "Region")
    for col in (*text_columns, "GPUs", "vCPUs", "Memory", "$/h", "Spot $/h", "$/GPU-h"):
        table.add_column(col, justify="left" if col in text_columns else "right")
    for o in catalog.for_sku(canonical.name):
        table.add_row(
            o.provider, o.instance_type, o.region, str(o.gpu_count),
            f"{o.vcpus:g}" if o.vcpus else "-", f"{o.memory_gib:g} GiB" if o.memory_gib else "-",
            _money(o.price_per_hour), _money(o.spot_price_per_hour), _money(per_gpu_hour(o)),
        )
    return table
