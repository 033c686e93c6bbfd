"""`meridian`: run each component, manage the fabric, and start a local demo."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console

from cli.admin_client import AdminAPIError, AdminClient
from cli.status_view import status_table
from iac.cli import app as iac_app
from meridian.security import weak_secrets
from meridian.settings import CLISettings, ControlPlaneSettings, NodeSettings, RouterSettings, WeightSettings

app = typer.Typer(no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
control_plane_app = typer.Typer(no_args_is_help=True, help="The control plane (admin API, state, reconciler).")
router_app = typer.Typer(no_args_is_help=True, help="The geo router (global OpenAI-compatible endpoint).")
node_app = typer.Typer(no_args_is_help=True, help="A data-plane node (runtime + node agent).")
model_app = typer.Typer(no_args_is_help=True, help="Model checkpoints.")
keys_app = typer.Typer(no_args_is_help=True, help="Tenants' API keys (admin scope).")
catalog_app = typer.Typer(no_args_is_help=True, help="The GPU SKU catalog: SKUs and providers' offerings.")
app.add_typer(control_plane_app, name="control-plane")
app.add_typer(router_app, name="router")
app.add_typer(node_app, name="node")
app.add_typer(model_app, name="model")
app.add_typer(keys_app, name="keys")
app.add_typer(catalog_app, name="catalog")
chaos_app = typer.Typer(no_args_is_help=True, help="Chaos drills: faults under load, checked from the request history.")
app.add_typer(chaos_app, name="chaos")
# cdktf stays inside iac/ (imported by its commands only, so other commands start fast).
app.add_typer(iac_app, name="iac", help="Terraform stacks from an infrastructure plan (cdktf synth, diff).")

console = Console()
err_console = Console(stderr=True)


T = TypeVar("T")


def _settings(cls: type[T], **overrides: Any) -> T:
    """Environment first, then CLI flags that were given; a clear message when invalid."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = cls(**given)
    except ValidationError as e:
        err_console.print(f"[red]invalid settings for {cls.__name__}:[/red]")
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            err_console.print(f"  {loc}: {err['msg']}")
        raise typer.Exit(2) from None
    weak = weak_secrets(settings)
    if weak:
        err_console.print(f"[red]weak secrets in {cls.__name__}:[/red]")
        for problem in weak:
            err_console.print(f"  {problem}")
        err_console.print("  make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        raise typer.Exit(2)
    return settings


# --- components -----------------------------------------------------------------------


@control_plane_app.command("serve")
def control_plane_serve(
    host: Annotated[str | None, typer.Option(help="Bind address [MERIDIAN_CP_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [MERIDIAN_CP_PORT]")] = None,
    database_url: Annotated[
        str | None, typer.Option(help="sqlite:///path or postgresql://… [MERIDIAN_CP_DATABASE_URL]")
    ] = None,
) -> None:
    """Run the control plane; applies database migrations at start-up."""
    from control_plane.app import serve

    serve(_settings(ControlPlaneSettings, host=host, port=port, database_url=database_url))


@router_app.command("serve")
def router_serve(
    host: Annotated[str | None, typer.Option(help="Bind address [MERIDIAN_ROUTER_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [MERIDIAN_ROUTER_PORT]")] = None,
    control_plane_url: Annotated[str | None, typer.Option(help="[MERIDIAN_ROUTER_CONTROL_PLANE_URL]")] = None,
    snapshot_path: Annotated[
        Path | None, typer.Option(help="Keep the last routing table here [MERIDIAN_ROUTER_SNAPSHOT_PATH]")
    ] = None,
    default_client_location: Annotated[
        str | None, typer.Option(help="Region name or 'lat,lon' [MERIDIAN_ROUTER_DEFAULT_CLIENT_LOCATION]")
    ] = None,
) -> None:
    """Run the geo router, the global inference endpoint."""
    from geo_router.app import serve

    serve(_settings(RouterSettings, host=host, port=port, control_plane_url=control_plane_url,
                    snapshot_path=snapshot_path, default_client_location=default_client_location))


@node_app.command("run")
def node_run(
    model_dir: Annotated[Path | None, typer.Option(help="Checkpoint directory [MERIDIAN_NODE_MODEL_DIR]")] = None,
    model_uri: Annotated[str | None, typer.Option(help="Pull the model from s3://, gs://, https://, file:// into the weight cache [MERIDIAN_NODE_MODEL_URI]")] = None,
    model_name: Annotated[str | None, typer.Option(help="Served model name [MERIDIAN_NODE_MODEL_NAME]")] = None,
    region: Annotated[str | None, typer.Option(help="e.g. aws:us-east-1 [MERIDIAN_NODE_REGION]")] = None,
    node_id: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_NODE_ID]")] = None,
    host: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="[MERIDIAN_NODE_PORT]")] = None,
    advertise_url: Annotated[str | None, typer.Option(help="URL routers use [MERIDIAN_NODE_ADVERTISE_URL]")] = None,
    control_plane_url: Annotated[str | None, typer.Option(help="[MERIDIAN_NODE_CONTROL_PLANE_URL]")] = None,
    engine: Annotated[str | None, typer.Option(help="torch or vllm [MERIDIAN_NODE_ENGINE]")] = None,
) -> None:
    """Run a data-plane node: load the model, serve it, register with the control plane."""
    from data_plane.node import serve

    serve(_settings(NodeSettings, model_dir=model_dir, model_uri=model_uri, model_name=model_name, region=region,
                    node_id=node_id, host=host, port=port, advertise_url=advertise_url,
                    control_plane_url=control_plane_url, engine=engine))


@model_app.command("make-tiny")
def model_make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into")],
    seed: Annotated[int, typer.Option(help="Same seed, same bytes")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace a checkpoint already there")] = False,
    engine: Annotated[str, typer.Option(
        help="torch: the smallest model; vllm: head_dim 64, which vLLM's CPU attention needs")] = "torch",
) -> None:
    """Write a tiny Llama-architecture checkpoint (config, safetensors, tokenizer)."""
    from data_plane.model.make_tiny import VLLM_CPU_ARCH, make_tiny_checkpoint

    if engine not in ("torch", "vllm"):
        err_console.print(f"[red]--engine must be torch or vllm, not {engine!r}[/red]")
        raise typer.Exit(2)
    try:
        make_tiny_checkpoint(out_dir, seed=seed, overwrite=overwrite,
                             arch=VLLM_CPU_ARCH if engine == "vllm" else None)
    except FileExistsError:
        err_console.print(f"[red]{out_dir} exists and is not empty; pass --overwrite to replace it[/red]")
        raise typer.Exit(1) from None
    console.print(f"wrote tiny Llama checkpoint to [bold]{out_dir}[/bold] (seed {seed})")


@model_app.command("make-tiny-lora")
def model_make_tiny_lora(
    base_dir: Annotated[Path, typer.Argument(help="Checkpoint the adapter is for (from `model make-tiny`)")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the adapter into")],
    seed: Annotated[int, typer.Option(help="Same seed, same bytes")] = 0,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank")] = 8,
    overwrite: Annotated[bool, typer.Option(help="Replace an adapter already there")] = False,
) -> None:
    """Write a tiny PEFT LoRA adapter (all seven projections) for a tiny checkpoint."""
    from data_plane.lora.make_tiny import make_tiny_lora
    from data_plane.model.loader import CheckpointError

    try:
        make_tiny_lora(base_dir, out_dir, seed=seed, rank=rank, overwrite=overwrite)
    except FileExistsError:
        err_console.print(f"[red]{out_dir} exists and is not empty; pass --overwrite to replace it[/red]")
        raise typer.Exit(1) from None
    except CheckpointError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"wrote tiny LoRA adapter for {base_dir} to [bold]{out_dir}[/bold] (seed {seed}, rank {rank})")


@model_app.command("push")
def model_push(
    model_dir: Annotated[Path, typer.Argument(help="Model directory (config, safetensors, tokenizer)")],
    uri: Annotated[str, typer.Argument(help="s3://bucket/prefix, gs://bucket/prefix or file:///dir")],
    name: Annotated[str | None, typer.Option(help="Model name in the manifest (default: the directory's)")] = None,
    zone: Annotated[str, typer.Option(help="Residency zone the weights may live in (eu, us, …) or global")] = "global",
) -> None:
    """Upload a model's files and its manifest (sizes, sha256, per-chunk digests)."""
    from cli import weights_cmd

    weights_cmd.push(model_dir, uri, _settings(WeightSettings), console, name=name, zone=zone)


@model_app.command("pull")
def model_pull(
    uri: Annotated[str, typer.Argument(help="s3://…, gs://…, https://…, file://… or peer://host:port/<digest>")],
    cache_dir: Annotated[Path | None, typer.Option(help="[MERIDIAN_WEIGHTS_CACHE_DIR]")] = None,
) -> None:
    """Fill the node cache with a model (verified, resumable, in parallel ranges)."""
    from cli import weights_cmd

    weights_cmd.pull(uri, _settings(WeightSettings, cache_dir=cache_dir), console)


@model_app.command("cache")
def model_cache(
    cache_dir: Annotated[Path | None, typer.Option(help="[MERIDIAN_WEIGHTS_CACHE_DIR]")] = None,
) -> None:
    """List the models in the node cache."""
    from cli import weights_cmd

    console.print(weights_cmd.cache_table(_settings(WeightSettings, cache_dir=cache_dir)))


# --- operating the fabric ---------------------------------------------------------------

ControlPlaneOpt = Annotated[str | None, typer.Option("--control-plane", help="[MERIDIAN_CONTROL_PLANE_URL]")]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="[MERIDIAN_API_KEY]")]


def _admin(control_plane: str | None, api_key: str | None) -> AdminClient:
    s = _settings(CLISettings, control_plane_url=control_plane)
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
            k = admin.create_key(name=name or tenant, tenant=tenant, zone=zone,
                                 scopes=scope or ["inference"], models=model or None)
    except AdminAPIError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"key id {k['id']} for tenant {k['tenant']} (zone {k['zone']}, scopes {', '.join(k['scopes'])})")
    console.print("[bold]store it now; it is not shown again:[/bold]")
    print(k["key"])


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
                p = admin.preview_plan(time_limit)
            if p["status"] == "infeasible":
                err_console.print("[red]no placement meets every constraint:[/red]")
                for line in (p.get("explanation") or "").splitlines():
                    err_console.print(f"  {line}")
                raise typer.Exit(1)
            console.print(plan_diff_table(p))
            console.print(plan_summary(p))
            if not apply:
                console.print(f"apply it with: meridian plan --apply (or POST /v1/placement/plans/{p['id']}/apply)")
                return
            if not yes and not typer.confirm("apply this plan?"):
                raise typer.Exit(1)
            applied = admin.apply_plan(p["id"])
            console.print(f"[green]plan {applied['id']} applied[/green]")
    except AdminAPIError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None


@chaos_app.command("list")
def chaos_list(
    directory: Annotated[
        Path | None, typer.Option("--dir", help="A folder of drill YAML files (default: the built-in drills)")
    ] = None,
) -> None:
    """The drills: their fault, its target, and how long each runs (in full and in CI's short form)."""
    from rich.table import Table

    from chaos.drill import DRILLS_DIR, DrillError, load_drills

    try:
        drills = load_drills(directory or DRILLS_DIR)
    except DrillError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    table = Table(title=f"{len(drills)} drills")
    for column in ("drill", "fault", "target", "fault window", "full", "short", "what it proves"):
        table.add_column(column, overflow="fold")
    for d in drills:
        t = d.fault.target
        target = next((f"{k} {v}" for k, v in (("node", t.node), ("region", t.region), ("provider", t.provider),
                                                ("service", t.service), ("model", t.model)) if v), "-")
        short = d.short_version()
        table.add_row(d.name, d.fault.kind, target, f"{d.fault.start_s:g}–{d.fault.end_s:g} s",
                      f"{d.load.duration_s:g} s", f"{short.load.duration_s:g} s", d.description.splitlines()[0])
    console.print(table)


@chaos_app.command("run")
def chaos_run(
    drills: Annotated[list[str], typer.Argument(help="Drill names, or `all`")],
    short: Annotated[bool, typer.Option("--short/--full", help="CI's short form (each at most 60 s) or the full drill")] = False,
    out: Annotated[Path, typer.Option(help="Reports go to OUT/<drill>/ (report.json, report.md, timeline.png)")] = Path(
        ".meridian/chaos"),
    seed: Annotated[int, typer.Option(help="Seeds the load's arrivals and the injectors' choices")] = 0,
    directory: Annotated[
        Path | None, typer.Option("--dir", help="A folder of drill YAML files (default: the built-in drills)")
    ] = None,
    redis_url: Annotated[str, typer.Option(
        envvar="MERIDIAN_CHAOS_REDIS_URL", help="Redis for drills whose routers share state (through a fault proxy)"
    )] = "redis://127.0.0.1:6379/0",
    deployment: Annotated[Path | None, typer.Option(
        help="Run against this deployment (a YAML file: routers, control plane, journals, fault actions) "
             "instead of starting a local fabric"
    )] = None,
) -> None:
    """Run drills against a local fabric or a deployment; exit code 1 when one fails or cannot run."""
    from chaos.deployment import DeploymentError, load_deployment
    from chaos.drill import DRILLS_DIR, DrillError, load_drills
    from cli import chaos_cmd

    try:
        chosen = chaos_cmd.pick(load_drills(directory or DRILLS_DIR), drills)
        if deployment is not None:
            target = load_deployment(deployment)
            target.admin_key()  # a missing key is a usage error, before any drill starts
            runner = chaos_cmd.deployment_runner(target, short=short, seed=seed)
        else:
            runner = chaos_cmd.local_runner(out, short=short, seed=seed, redis_url=redis_url)
    except (DrillError, DeploymentError, ValueError) as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    if not chaos_cmd.run(chosen, out, runner, short=short, console=console):
        raise typer.Exit(1)


@catalog_app.command("gpus")
def catalog_gpus(
    sku: Annotated[
        str | None, typer.Argument(help="List this SKU's offerings (any spelling: H100-SXM, a100 80gb)")
    ] = None,
    provider: Annotated[str | None, typer.Option(help="A registered provider: aws, gcp, onprem, ...")] = None,
    region: Annotated[str | None, typer.Option(help="Only this region, e.g. aws:us-east-1")] = None,
    onprem_inventory: Annotated[
        Path | None, typer.Option(envvar="MERIDIAN_CP_ONPREM_INVENTORY", help="On-prem inventory YAML")
    ] = None,
) -> None:
    """Show GPU SKUs with the cheapest $/GPU-hour per provider, or one SKU's offerings."""
    from cli.catalog_view import gpus_table, sku_offerings_table
    from meridian.registry import UnknownName
    from providers.catalog import load_catalog
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
        console.print(f"no offerings of {canonical or 'GPUs'} match{where}")
        return
    if canonical is not None:
        console.print(sku_offerings_table(catalog, canonical))
    else:
        console.print(gpus_table(catalog, (provider,) if provider else catalog.providers))


@app.command("demo")
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where state, logs and the model go")] = Path(".meridian/demo"),
    port: Annotated[int, typer.Option(help="Router port (a free one if taken)")] = 8080,
    engine: Annotated[str, typer.Option(
        help="torch (starts in seconds) or vllm (vLLM's CPU build where there is no GPU: `make vllm`)")] = "torch",
) -> None:
    """Start a three-region local fabric on embedded defaults; Ctrl-C stops it."""
    from cli.demo import run_demo

    if engine not in ("torch", "vllm"):
        err_console.print(f"[red]--engine must be torch or vllm, not {engine!r}[/red]")
        raise typer.Exit(2)
    if engine == "vllm":
        import importlib.util

        from data_plane.engine.vllm.command import default_vllm_python

        if default_vllm_python() == sys.executable and importlib.util.find_spec("vllm") is None:
            err_console.print("[red]vLLM is not installed: run `make vllm` (its CPU build) first[/red]")
            raise typer.Exit(2)
        if work_dir == Path(".meridian/demo"):
            work_dir = Path(".meridian/demo-vllm")  # its own checkpoint, origin and caches
    run_demo(work_dir, port, console, engine=engine)


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
