"""`meridian`: run each component, manage the fabric, and start a local demo."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from chaos.cli import app as chaos_app
from cli.status_view import status_table
from control_plane.cli import app as control_plane_app
from data_plane.cli import model_app, node_app
from geo_router.cli import app as router_app
from iac.cli import app as iac_app
from meridian.admin_api import ApiKeyCreate, PlanRequest, PlanStatus
from meridian.admin_client import AdminAPIError, AdminClient, request_body
from meridian.cli_settings import settings_or_exit
from meridian.settings import CLISettings
from providers.cli import app as catalog_app

# The CLI composes the planes' own sub-apps (each imports its heavy modules inside its
# commands) with the commands that cut across them: status, keys, plan, demo.
app = typer.Typer(no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
keys_app = typer.Typer(no_args_is_help=True, help="Tenants' API keys (admin scope).")
app.add_typer(control_plane_app, name="control-plane")
app.add_typer(router_app, name="router")
app.add_typer(node_app, name="node")
app.add_typer(model_app, name="model")
app.add_typer(keys_app, name="keys")
app.add_typer(catalog_app, name="catalog")
app.add_typer(chaos_app, name="chaos")
# cdktf stays inside iac/ (imported by its commands only, so other commands start fast).
app.add_typer(iac_app, name="iac", help="Terraform stacks from an infrastructure plan (cdktf synth, diff).")

console = Console()
err_console = Console(stderr=True)


# --- operating the fabric ---------------------------------------------------------------

ControlPlaneOpt = Annotated[str | None, typer.Option("--control-plane", help="[MERIDIAN_CONTROL_PLANE_URL]")]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="[MERIDIAN_API_KEY]")]


def _admin(control_plane: str | None, api_key: str | None) -> AdminClient:
    s = settings_or_exit(CLISettings, control_plane_url=control_plane)
    key = api_key or (s.api_key.get_secret_value() if s.api_key else None)
    if not key:
        err_console.print("[red]an API key is needed: --api-key or MERIDIAN_API_KEY[/red]")
        raise typer.Exit(2)
    return AdminClient(s.control_plane_url, key, s.timeout_s)


@app.command("status")
def status(control_plane: ControlPlaneOpt = None, api_key: ApiKeyOpt = None) -> None:
    """Show regions, nodes, health and models as a table."""
    try:
        with _admin(control_plane, api_key) as admin:
            console.print(status_table(admin.regions(), admin.nodes()))
    except AdminAPIError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to")],
    zone: Annotated[str, typer.Option(help="Residency zone (eu, us, …) or global")] = "global",
    scope: Annotated[list[str] | None, typer.Option(help="admin, operator, read-only, inference")] = None,
    model: Annotated[list[str] | None, typer.Option(help="Allowed models (default: all)")] = None,
    name: Annotated[str | None, typer.Option(help="Label for the key")] = None,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Create an API key; the key is printed once and never stored."""
    try:
        with _admin(control_plane, api_key) as admin:
            k = admin.create_key(request_body(ApiKeyCreate, name=name or tenant, tenant=tenant, zone=zone,
                                              scopes=scope or ["inference"], models=model or None))
    except AdminAPIError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"key id {k.id} for tenant {k.tenant} (zone {k.zone}, scopes {', '.join(k.scopes)})")
    console.print("[bold]store it now; it is not shown again:[/bold]")
    print(k.key)


@app.command("plan")
def plan(
    apply: Annotated[bool, typer.Option("--apply", help="Apply the plan after showing it")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask before applying")] = False,
    time_limit: Annotated[float, typer.Option(help="Solver time limit, seconds")] = 10.0,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Preview a placement of every deployment as a diff against the one in force (operator)."""
    from cli.plan_view import plan_diff_table, plan_summary

    try:
        with _admin(control_plane, api_key) as admin:
            with console.status("solving placement…"):
                p = admin.preview_plan(request_body(PlanRequest, time_limit_s=time_limit))
            if p.status == PlanStatus.INFEASIBLE:
                err_console.print("[red]no placement meets every constraint:[/red]")
                for line in (p.explanation or "").splitlines():
                    err_console.print(f"  {line}")
                raise typer.Exit(1)
            console.print(plan_diff_table(p))
            console.print(plan_summary(p))
            if not apply:
                console.print(f"apply it with: meridian plan --apply (or POST /v1/placement/plans/{p.id}/apply)")
                return
            if not yes and not typer.confirm("apply this plan?"):
                raise typer.Exit(1)
            applied = admin.apply_plan(p.id)
            console.print(f"[green]plan {applied.id} applied[/green]")
    except AdminAPIError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None


@app.command("demo")
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where state, logs and the model go")] = Path(".meridian/demo"),
    port: Annotated[int, typer.Option(help="Router port (a free one if taken)")] = 8080,
    engine: Annotated[str, typer.Option(
        help="torch (starts in seconds) or vllm (vLLM's CPU build where there is no GPU: `make vllm`)")] = "torch",
    model_dir: Annotated[Path | None, typer.Option(
        help="Serve this checkpoint (config.json, *.safetensors, tokenizer.json) instead of the tiny random one")] = None,
    model_uri: Annotated[str | None, typer.Option(
        help="Serve a model pushed with `meridian model push` to s3://, gs://, https:// or file://")] = None,
    model_name: Annotated[str | None, typer.Option(
        help="Served model name (default: the directory's or the URI's last segment)")] = None,
) -> None:
    """Start a three-region local fabric on embedded defaults; Ctrl-C stops it."""
    from cli.demo import run_demo
    from cli.demo_model import DemoModelError, resolve_demo_model

    if engine not in ("torch", "vllm"):
        err_console.print(f"[red]--engine must be torch or vllm, not {engine!r}[/red]")
        raise typer.Exit(2)
    try:
        model = resolve_demo_model(model_dir, model_uri, model_name, engine)
    except DemoModelError as e:
        err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if engine == "vllm":
        import importlib.util

        from data_plane.engine.vllm.command import default_vllm_python

        if default_vllm_python() == sys.executable and importlib.util.find_spec("vllm") is None:
            err_console.print("[red]vLLM is not installed: run `make vllm` (its CPU build) first[/red]")
            raise typer.Exit(2)
        if work_dir == Path(".meridian/demo"):
            work_dir = Path(".meridian/demo-vllm")  # its own checkpoint, origin and caches
    run_demo(work_dir, port, console, engine=engine, model=model)


def main() -> None:
    """Console-script entry: operators get a one-line error, not a traceback."""
    try:
        app(prog_name="meridian")
    except Exception as e:
        if os.environ.get("MERIDIAN_DEBUG") == "1":
            raise
        err_console.print(f"[red]error:[/red] {e}  [dim](MERIDIAN_DEBUG=1 for a traceback)[/dim]")
        sys.exit(1)


if __name__ == "__main__":
    main()
