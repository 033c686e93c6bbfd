"""`meridian router`: the geo router's commands, mounted by the CLI (cli/main.py).

The router app is imported by the command itself, so that the CLI starts without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meridian.cli_settings import settings_or_exit
from meridian.settings.router import RouterSettings

app = typer.Typer(no_args_is_help=True, help="The geo router (global OpenAI-compatible endpoint).")


@app.command("serve")
def router_serve(
    host: Annotated[str | None, typer.Option(help="Bind address [MERIDIAN_ROUTER_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [MERIDIAN_ROUTER_PORT]")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Processes serving the port as one router; 0: one per core [MERIDIAN_ROUTER_WORKERS]")
    ] = None,
    control_plane_url: Annotated[str | None, typer.Option(help="[MERIDIAN_ROUTER_CONTROL_PLANE_URL]")] = None,
    snapshot_path: Annotated[
        Path | None, typer.Option(help="Keep the last routing table here [MERIDIAN_ROUTER_SNAPSHOT_PATH]")
    ] = None,
    default_client_location: Annotated[
        str | None, typer.Option(help="Region name or 'lat,lon' [MERIDIAN_ROUTER_DEFAULT_CLIENT_LOCATION]")
    ] = None,
) -> None:
    """Run the geo router, the global inference endpoint."""
    from geo_router.listener import serve

    serve(settings_or_exit(RouterSettings, host=host, port=port, workers=workers, control_plane_url=control_plane_url,
                           snapshot_path=snapshot_path, default_client_location=default_client_location))
