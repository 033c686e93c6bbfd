"""`meridian keys`, `tenants`, `models`, `deployments`, `nodes`, `audit` and `fit`: the admin API's
resources from a shell.

Each command is one or two admin calls (meridian.admin_client) and a table, or with `-o json|yaml`
the API's models as they came. Request bodies are the kernel's models, built with
`request_body`, so a bad flag is refused here in the words the control plane would use.

A delete reads the resource first, asks (unless --yes) naming what goes with it, and deletes
only the version it showed (If-Match): what changed meanwhile is refused with 412, not
deleted unseen. A tenant's keys are revoked with it; a model with a deployment is refused
(409: delete the deployment first); a deployment's model stays registered.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.admin_session import (
    ApiKeyOpt,
    ControlPlaneOpt,
    OutputFormat,
    OutputOpt,
    YesOpt,
    admin_client,
    api_errors,
    confirm,
    console,
    emit,
    err_console,
    fail,
)
from cli.admin_views import audit_table, deployments_table, fit_table, keys_table, models_table, tenants_table
from cli.status_view import nodes_table
from meridian.admin_api import ApiKeyCreate, TenantCreate, TenantPatch
from meridian.admin_client import AdminAPIError, request_body

keys_app = typer.Typer(no_args_is_help=True, help="Tenants' API keys (admin scope).")
tenants_app = typer.Typer(no_args_is_help=True,
                          help="Tenants: residency zone, allowed models, rate limits, priority and weight.")
deployments_app = typer.Typer(no_args_is_help=True, help="Deployments (create them with `meridian deploy`).")
# `meridian models` alone lists them, as it did before the group had commands.
models_app = typer.Typer(invoke_without_command=True, help="Registered models (register them with `meridian deploy`).")

TenantZoneOpt = Annotated[str | None, typer.Option("--zone", help="Residency zone (eu, us, …) or global")]
ModelsOpt = Annotated[list[str] | None, typer.Option("--model", help="Allowed model (repeat)")]
RpmOpt = Annotated[int | None, typer.Option("--requests-per-minute", help="Request rate limit")]
TpmOpt = Annotated[int | None, typer.Option("--tokens-per-minute", help="Token rate limit")]
CacheGroupOpt = Annotated[str | None, typer.Option("--cache-group", help="Share prefix-cache entries with this group")]
# Ranges are the kernel's (request_body refuses them in its words), not typer's min/max.
PriorityOpt = Annotated[int | None, typer.Option(
    "--priority", help="Dispatch priority band, -10..10: larger is more urgent, below 0 is shed first when full")]
WeightOpt = Annotated[float | None, typer.Option(
    "--weight", help="Share of work within its priority band, relative to other tenants (> 0, ≤ 1000)")]


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to (it must exist, or see --create-tenant)")],
    zone: Annotated[str | None, typer.Option(help="Residency zone (eu, us, …) or global (default: the tenant's)")]
    = None,
    scope: Annotated[list[str] | None, typer.Option(help="admin, operator, read-only, inference")] = None,
    model: Annotated[list[str] | None, typer.Option(help="Allowed models (default: all)")] = None,
    name: Annotated[str | None, typer.Option(help="Label for the key")] = None,
    priority: Annotated[int | None, typer.Option(
        help="Dispatch priority band of this key's requests, -10..10 (default: its tenant's)")] = None,
    create_tenant: Annotated[bool, typer.Option(
        "--create-tenant", help="Create the tenant, in --zone, if it does not exist")] = False,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Create an API key; the key is printed once and never stored (with -o json|yaml: the key's
    record, the key in it)."""
    if create_tenant and zone is None:
        fail("--create-tenant needs --zone: the new tenant's residency zone (eu, us, …) or global", 2)
    with api_errors():
        body = request_body(ApiKeyCreate, name=name or tenant, tenant=tenant, zone=zone,
                            scopes=scope or ["inference"], models=model or None, priority=priority,
                            create_tenant=create_tenant)
        with admin_client(control_plane, api_key) as admin:
            try:
                k = admin.create_key(body)
            except AdminAPIError as e:
                if e.status == 404 and e.problem and not create_tenant:
                    fail(str(e), 1, [f"create it with: meridian tenants create {tenant} --zone ZONE, or "
                                     f"meridian keys create --tenant {tenant} --create-tenant --zone ZONE"])
                raise
    if k.tenant_created:
        err_console.print(f"created tenant {k.tenant} in zone {k.zone}", highlight=False)
    if output != OutputFormat.TABLE:
        emit(output, k)
        return
    console.print(f"key id {k.id} for tenant {k.tenant} (zone {k.zone}, scopes {', '.join(k.scopes)})",
                  highlight=False)
    console.print("[bold]store it now; it is not shown again:[/bold]")
    print(k.key)


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys")] = None,
    include_revoked: Annotated[bool, typer.Option("--include-revoked", help="List revoked keys too")] = False,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List API keys (never the keys themselves: their ids and prefixes)."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        keys = admin.list_keys(tenant, include_revoked)
    emit(output, keys, keys_table(keys))


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `meridian keys list`)")],
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Revoke an API key: routers refuse it from their next routing table on."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        admin.revoke_key(key_id)
    console.print(f"key {key_id} revoked", highlight=False)


@tenants_app.command("list")
def tenants_list(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
                 api_key: ApiKeyOpt = None) -> None:
    """List tenants with their zone, allowed models, rate limits, priority and weight."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        tenants = admin.tenants()
    emit(output, tenants, tenants_table(tenants))


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    zone: TenantZoneOpt = None,
    model: ModelsOpt = None,
    requests_per_minute: RpmOpt = None,
    tokens_per_minute: TpmOpt = None,
    cache_group: CacheGroupOpt = None,
    priority: PriorityOpt = None,
    weight: WeightOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Create a tenant (admin)."""
    fields = _given(zone=zone, models=model, requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute, cache_group=cache_group, priority=priority, weight=weight)
    with api_errors():
        body = request_body(TenantCreate, name=name, **fields)
        with admin_client(control_plane, api_key) as admin:
            tenant = admin.create_tenant(body)
    emit(output, tenant, tenants_table([tenant]))


@tenants_app.command("update")
def tenants_update(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    zone: TenantZoneOpt = None,
    model: ModelsOpt = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="Allow every model again")] = False,
    requests_per_minute: RpmOpt = None,
    tokens_per_minute: TpmOpt = None,
    cache_group: CacheGroupOpt = None,
    priority: PriorityOpt = None,
    weight: WeightOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Change a tenant's fields; those not given stay as they are (admin)."""
    fields = _given(zone=zone, models=model, requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute, cache_group=cache_group, priority=priority, weight=weight)
    if all_models:
        if model:
            fail("--model and --all-models contradict each other", 2)
        fields["models"] = None
    if not fields:
        fail("nothing to change: give --zone, --model, --all-models, --requests-per-minute, "
             "--tokens-per-minute, --cache-group, --priority or --weight", 2)
    with api_errors():
        body = request_body(TenantPatch, **fields)
        with admin_client(control_plane, api_key) as admin:
            tenant = admin.update_tenant(name, body)
    emit(output, tenant, tenants_table([tenant]))


@tenants_app.command("delete")
def tenants_delete(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    yes: YesOpt = False,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Delete a tenant; every key of it is revoked in the same transaction (admin)."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        tenant = admin.tenant(name)
        keys = admin.list_keys(name)
        confirm(f"delete tenant {name} (zone {tenant.zone}) and revoke its {len(keys)} key(s)?", yes)
        admin.delete_tenant(name, tenant.resource_version)
    console.print(f"tenant {name} deleted; its {len(keys)} key(s) revoked", highlight=False)


@models_app.callback()
def models_root(ctx: typer.Context, output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
                api_key: ApiKeyOpt = None) -> None:
    """List the registered models and their shapes (or: models list, models delete NAME)."""
    if ctx.invoked_subcommand is None:
        models_list(output, control_plane, api_key)


@models_app.command("list")
def models_list(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
                api_key: ApiKeyOpt = None) -> None:
    """List the registered models and their shapes."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        models = admin.models()
    emit(output, models, models_table(models))


@models_app.command("delete")
def models_delete(
    name: Annotated[str, typer.Argument(help="Model name")],
    yes: YesOpt = False,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Delete a registered model; refused while it has a deployment (operator)."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        model = admin.model(name)
        confirm(f"delete model {name}?", yes)
        admin.delete_model(name, model.resource_version)
    console.print(f"model {name} deleted", highlight=False)


@deployments_app.command("list")
def deployments_list(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
                     api_key: ApiKeyOpt = None) -> None:
    """List deployments: zone, replica bounds, desired replicas, placement."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        deployments = admin.deployments()
    emit(output, deployments, deployments_table(deployments))


@deployments_app.command("delete")
def deployments_delete(
    model: Annotated[str, typer.Argument(help="The deployed model's name")],
    yes: YesOpt = False,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Delete a model's deployment; the model stays registered (operator)."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        d = admin.deployment(model)
        confirm(f"delete the deployment of {model} (zone {d.zone}, {d.min_replicas}–{d.max_replicas} replicas)?",
                yes)
        admin.delete_deployment(model, d.resource_version)
    console.print(f"deployment of {model} deleted (the model stays registered: meridian models delete {model})",
                  highlight=False)


def nodes_list(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
               api_key: ApiKeyOpt = None) -> None:
    """List every node: region, provider, state, engine, models and load (lost ones too, until forgotten)."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        nodes = admin.nodes()
    emit(output, nodes, nodes_table(nodes))


def audit_log(
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Entries per page")] = 20,
    cursor: Annotated[str | None, typer.Option(help="The next page's cursor (printed under a page)")] = None,
    resource_type: Annotated[str | None, typer.Option(
        "--type", help="Only this kind of resource: tenant, api_key, model, deployment, placement_plan, …")] = None,
    resource_id: Annotated[str | None, typer.Option("--id", help="Only this resource (with --type)")] = None,
    actor: Annotated[str | None, typer.Option(help="Only changes by this actor id (a key's id, or system:…)")]
    = None,
    since: Annotated[str | None, typer.Option(help="Only entries at or after this instant (ISO 8601, with zone)")]
    = None,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Show the audit log, newest first, a page at a time: who changed what, when."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        page = admin.audit(limit, cursor, resource_type=resource_type, resource_id=resource_id, actor_id=actor,
                           since=since)
    emit(output, page.entries, audit_table(page.entries))
    if page.next_cursor:
        given = _given(limit=limit if limit != 20 else None, type=resource_type, id=resource_id, actor=actor,
                       since=since)
        flags = "".join(f" --{k} {v}" for k, v in given.items())
        err_console.print(f"older entries: meridian audit{flags} --cursor {page.next_cursor}", highlight=False,
                          soft_wrap=True)


def model_fit(
    model: Annotated[str, typer.Argument(help="A registered model's name")],
    spot: Annotated[bool, typer.Option("--spot", help="Price the offerings at their spot price")] = False,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Which GPU SKUs one replica of a model fits on: GPUs, memory, throughput, cheapest offering."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        fit = admin.model_fit(model, spot)
    emit(output, fit, fit_table(fit))
    if output == OutputFormat.TABLE and fit.does_not_fit:
        console.print(f"does not fit: {', '.join(fit.does_not_fit)}", highlight=False)


def _given(**fields: Any) -> dict[str, Any]:
    """The options that were given (None and empty lists: not given)."""
    return {k: v for k, v in fields.items() if v is not None and v != []}
