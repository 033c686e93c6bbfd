"""The tables of `meridian keys list`, `tenants list`, `models` and `deployments list`."""

from __future__ import annotations

from datetime import datetime

from rich.table import Table

from meridian.admin_api import ApiKeyView, ModelView, TenantView
from meridian.cli_format import folding_table, human_params
from meridian.contracts import DeploymentView


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M")


def _names(values: list[str] | None) -> str:
    return "all" if values is None else ", ".join(values) or "none"


def _limit(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def keys_table(keys: list[ApiKeyView]) -> Table:
    table = folding_table("ID", "Name", "Tenant", "Zone", "Scopes", "Models", "Prefix", "Created", "Revoked",
                          title="API keys")
    for k in keys:
        table.add_row(k.id, k.name, k.tenant, k.zone, ", ".join(k.scopes), _names(k.models), k.key_prefix,
                      _when(k.created_at), _when(k.revoked_at))
    if not keys:
        table.add_row("(no keys)", *["-"] * 8)
    return table


def tenants_table(tenants: list[TenantView]) -> Table:
    table = folding_table("Tenant", "Zone", "Models", "Requests/min", "Tokens/min", "Cache group", "Version",
                          right=("Requests/min", "Tokens/min", "Version"), title="Tenants")
    for t in tenants:
        table.add_row(t.name, t.zone, _names(t.models), _limit(t.requests_per_minute),
                      _limit(t.tokens_per_minute), t.cache_group or "-", str(t.resource_version))
    if not tenants:
        table.add_row("(no tenants)", *["-"] * 6)
    return table


def models_table(models: list[ModelView]) -> Table:
    table = folding_table("Model", "Params", "Layers", "KV heads", "Head dim", "Quant", "Context", "Weights",
                          right=("Params", "Layers", "KV heads", "Head dim", "Context"), title="Models")
    for m in models:
        table.add_row(m.name, human_params(m.params_b), str(m.layers), str(m.kv_heads), str(m.head_dim),
                      m.quantization, f"{m.max_context:,}", m.weights_uri or "-")
    if not models:
        table.add_row("(no models registered)", *["-"] * 7)
    return table


def deployments_table(deployments: list[DeploymentView]) -> Table:
    table = folding_table("Model", "Zone", "Replicas", "Desired", "Regions", "Target conc.", "Updated",
                          right=("Replicas", "Desired", "Target conc."), title="Deployments")
    for d in deployments:
        regions = ", ".join(f"{r}×{n}" for r, n in sorted(d.placement.replicas.items())) or "any"
        table.add_row(d.model, d.zone, f"{d.min_replicas}–{d.max_replicas}", str(d.desired_replicas), regions,
                      f"{d.autoscaling.target_concurrency:g}", _when(d.updated_at))
    if not deployments:
        table.add_row("(no deployments)", *["-"] * 6)
    return table
