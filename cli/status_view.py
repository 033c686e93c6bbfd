"""The `meridian status` table (regions, nodes, health, models) and `meridian nodes` (every node
with its provider, state, engine and load)."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.table import Table

from meridian.cli_format import folding_table
from meridian.contracts import ColdStart, NodeRole, NodeStatus, NodeView, RegionInfo

_STATUS_STYLE = {
    NodeStatus.READY: "green",
    NodeStatus.STARTING: "yellow",
    NodeStatus.DRAINING: "yellow",
    NodeStatus.LOST: "red",
}


def status_table(regions: list[RegionInfo], nodes: list[NodeView], now: datetime | None = None) -> Table:
    """One row per node, plus one row per region that has no node but was asked about."""
    now = now or datetime.now(UTC)
    by_region = {r.name: r for r in regions}
    table = folding_table("Region", "Zones", "Node", "Health", "Models", "Running", "Waiting", "KV", "Cold start",
                          "Heartbeat", right=("Running", "Waiting", "KV", "Heartbeat"), title="Meridian fabric")
    for n in sorted(nodes, key=lambda n: (n.region, n.node_id)):
        region = by_region.get(n.region)
        zones = ",".join(region.zones) if region else "?"
        table.add_row(
            n.region,
            zones,
            _node_cell(n),
            _status_cell(n),
            _models_cell(n),
            str(n.load.running),
            str(n.load.waiting),
            f"{n.load.kv_cache_usage:.0%}",
            cold_start_cell(n.cold_start),
            _heartbeat_cell(n, now),
        )
    if not nodes:
        table.add_row("-", "-", "(no nodes registered)", "-", "-", "-", "-", "-", "-", "-")
    return table


def nodes_table(nodes: list[NodeView], now: datetime | None = None) -> Table:
    """One row per node, by region and id: where it runs, its state, what it serves and its load."""
    now = now or datetime.now(UTC)
    table = folding_table("Node", "Region", "Provider", "State", "Engine", "Models", "Running", "Waiting", "KV",
                          "Served", "Heartbeat", right=("Running", "Waiting", "KV", "Served", "Heartbeat"),
                          title="Nodes")
    for n in sorted(nodes, key=lambda n: (n.region, n.node_id)):
        served = n.load.requests_completed
        table.add_row(_node_cell(n), n.region, n.provider, _status_cell(n), n.engine, _models_cell(n),
                      str(n.load.running), str(n.load.waiting), f"{n.load.kv_cache_usage:.0%}",
                      "-" if served is None else f"{served:,}", _heartbeat_cell(n, now))
    if not nodes:
        table.add_row("(no nodes registered)", *["-"] * 10)
    return table


def _node_cell(n: NodeView) -> str:
    return n.node_id if n.role is NodeRole.BOTH else f"{n.node_id} ({n.role.value})"


def _status_cell(n: NodeView) -> str:
    style = _STATUS_STYLE.get(n.status, "")
    return f"[{style}]{n.status.value}[/{style}]" if style else n.status.value


def _models_cell(n: NodeView) -> str:
    return ", ".join([*n.models, *(f"+{a}" for a in n.load.lora_adapters)]) or "-"


def _heartbeat_cell(n: NodeView, now: datetime) -> str:
    return f"{max(0.0, (now - n.last_heartbeat).total_seconds()):.0f}s ago"


def cold_start_cell(c: ColdStart | None) -> str:
    """"weights 1.2s (peer) → loaded 3.4s → ready 3.5s": the node's start, step by step."""
    if c is None:
        return "-"
    steps = []
    if c.weights_cached_s is not None:
        steps.append(f"weights {c.weights_cached_s:.1f}s ({c.weights_source or '?'})")
    if c.loaded_s is not None:
        steps.append(f"loaded {c.loaded_s:.1f}s")
    if c.ready_s is not None:
        steps.append(f"ready {c.ready_s:.1f}s")
    return " → ".join(steps) or "starting"
