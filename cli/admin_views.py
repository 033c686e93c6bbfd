"""The tables of `meridian keys list`, `tenants list`, `models`, `deployments list`, `audit` and `fit`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from meridian.admin_api import ApiKeyView, AuditEntryView, ModelFitView, ModelView, TenantView
from meridian.cli_format import folding_table, human_params, human_time
from meridian.contracts import DeploymentView


def _names(values: list[str] | None) -> str:
    return "all" if values is None else ", ".join(values) or "none"


def _limit(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def keys_table(keys: list[ApiKeyView]) -> Table:
    table = folding_table("ID", "Name", "Tenant", "Zone", "Scopes", "Models", "Prefix", "Created", "Revoked",
                          title="API keys")
    for k in keys:
        table.add_row(k.id, k.name, k.tenant, k.zone or "-", ", ".join(k.scopes), _names(k.models), k.key_prefix,
                      human_time(k.created_at), human_time(k.revoked_at))
    if not keys:
        table.add_row("(no keys)", *["-"] * 8)
    return table


def tenants_table(tenants: list[TenantView]) -> Table:
    table = folding_table("Tenant", "Zone", "Models", "Requests/min", "Tokens/min", "Cache group", "Priority",
                          "Weight", "Version", right=("Requests/min", "Tokens/min", "Priority", "Weight", "Version"),
                          title="Tenants")
    for t in tenants:
        table.add_row(t.name, t.zone, _names(t.models), _limit(t.requests_per_minute),
                      _limit(t.tokens_per_minute), t.cache_group or "-", str(t.priority), f"{t.weight:g}",
                      str(t.resource_version))
    if not tenants:
        table.add_row("(no tenants)", *["-"] * 8)
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
                      f"{d.autoscaling.target_concurrency:g}", human_time(d.updated_at))
    if not deployments:
        table.add_row("(no deployments)", *["-"] * 6)
    return table


# Fields every change touches; an audit line names the others.
_BOOKKEEPING = frozenset({"resource_version", "created_at", "updated_at"})


def changes(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """What an audit entry changed, in a line: "zone: eu → us; requests_per_minute: - → 600"."""
    if before is None or after is None:
        return "-"
    keys = [k for k in {**before, **after} if k not in _BOOKKEEPING and before.get(k) != after.get(k)]
    return "; ".join(f"{k}: {_value(before.get(k))} → {_value(after.get(k))}" for k in keys) or "-"


def _value(v: Any) -> str:
    return "-" if v is None else str(v)


def audit_table(entries: list[AuditEntryView]) -> Table:
    table = folding_table("When", "Actor", "Action", "Resource", "Changes", title="Audit log (newest first)")
    for e in entries:
        table.add_row(human_time(e.at, seconds=True), e.actor_name, e.action, f"{e.resource_type} {e.resource_id}",
                      changes(e.before, e.after))
    if not entries:
        table.add_row("(no entries)", *["-"] * 4)
    return table


def fit_table(fit: ModelFitView) -> Table:
    table = folding_table("SKU", "GPUs", "Weights GiB/GPU", "KV GiB/GPU", "Used of usable GiB", "Decode tok/s",
                          "Prefill tok/s", "Cheapest offering", "$/M tokens",
                          right=("GPUs", "Weights GiB/GPU", "KV GiB/GPU", "Used of usable GiB", "Decode tok/s",
                                 "Prefill tok/s", "$/M tokens"),
                          title=f"Where one replica of {fit.model} fits (cheapest per token first)")
    for f in fit.fits:
        c = f.cheapest
        table.add_row(f.sku, str(f.tensor_parallel), f"{f.weights_gib_per_gpu:.1f}", f"{f.kv_cache_gib_per_gpu:.1f}",
                      f"{f.used_gib_per_gpu:.1f} / {f.usable_gib_per_gpu:.1f}", f"{f.decode_tokens_per_s:,.0f}",
                      f"{f.prefill_tokens_per_s:,.0f}",
                      "-" if c is None else f"{c.provider} {c.region} {c.instance_type}",
                      "-" if c is None else f"{c.usd_per_million_tokens:.3g}")
    if not fit.fits:
        table.add_row("(fits no SKU)", *["-"] * 8)
    return table
