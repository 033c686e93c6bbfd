"""`meridian catalog`: the GPU SKU catalog's commands, mounted by the CLI (cli/main.py).

The catalog, and with it every provider's offerings, is loaded by the command itself, so
that the CLI starts without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from meridian.cli_format import OutputConsole, OutputFormat, OutputOpt, emit

app = typer.Typer(no_args_is_help=True, help="The GPU SKU catalog: SKUs and providers' offerings.")

console = OutputConsole()  # piped: wide enough that no table row folds
err_console = Console(stderr=True)


@app.command("gpus")
def catalog_gpus(
    sku: Annotated[
        str | None, typer.Argument(help="List this SKU's offerings (any spelling: H100-SXM, a100 80gb)")
    ] = None,
    provider: Annotated[str | None, typer.Option(help="A registered provider: aws, gcp, onprem, ...")] = None,
    region: Annotated[str | None, typer.Option(help="Only this region, e.g. aws:us-east-1")] = None,
    onprem_inventory: Annotated[
        Path | None, typer.Option(envvar="MERIDIAN_CP_ONPREM_INVENTORY", help="On-prem inventory YAML")
    ] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Show GPU SKUs with the cheapest $/GPU-hour per provider, or one SKU's offerings."""
    from meridian.registry import UnknownName
    from providers.catalog import load_catalog
    from providers.catalog_view import gpus_rows, gpus_table, sku_offerings_rows, sku_offerings_table
    from providers.onprem.inventory import InventoryError
    from providers.provider import PROVIDERS
    from providers.regions import region_catalog
    from providers.skus import UnknownGpuError, normalise_gpu_name

    if provider is not None and provider not in PROVIDERS:
        err_console.print(f"[red]{UnknownName(PROVIDERS.kind, provider, PROVIDERS.names())}[/red]")
        raise typer.Exit(2)
    try:
        catalog = load_catalog(onprem_inventory)
        if region is not None and region not in region_catalog(onprem_inventory):
            err_console.print(f"[red]unknown region {region!r} (regions look like aws:us-east-1)[/red]")
            raise typer.Exit(2)
        canonical = normalise_gpu_name(sku).name if sku is not None else None
    except (InventoryError, UnknownGpuError) as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    catalog = catalog.where(provider=provider, region=region)
    if not catalog.offerings or (canonical and not catalog.for_sku(canonical)):
        where = (f" provider {provider}" if provider else "") + (f" region {region}" if region else "")
        if output != OutputFormat.TABLE:
            emit(output, [])
        (err_console if output != OutputFormat.TABLE else console).print(
            f"no offerings of {canonical or 'GPUs'} match{where}")
        return
    if canonical is not None:
        emit(output, sku_offerings_rows(catalog, canonical), sku_offerings_table(catalog, canonical), console)
    else:
        providers = (provider,) if provider else catalog.providers
        emit(output, gpus_rows(catalog, providers), gpus_table(catalog, providers), console)
