"""`meridian control-plane`: the control plane's commands, mounted by the CLI (cli/main.py).

The server and its database stack are imported by the command itself, so that the CLI starts
without them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from meridian.cli_settings import settings_or_exit
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings

app = typer.Typer(no_args_is_help=True, help="The control plane (admin API, state, reconciler).")


@app.command("serve")
def control_plane_serve(
    host: Annotated[str | None, typer.Option(help="Bind address [MERIDIAN_CP_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [MERIDIAN_CP_PORT]")] = None,
    database_url: Annotated[
        str | None, typer.Option(help="sqlite:///path or postgresql://… [MERIDIAN_CP_DATABASE_URL]")
    ] = None,
) -> None:
    """Run the control plane; applies database migrations at start-up."""
    from control_plane.app import serve

    serve(settings_or_exit(ControlPlaneSettings, host=host, port=port, database_url=database_url),
          settings_or_exit(ProviderSettings))
