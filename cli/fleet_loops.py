"""`meridian reconciler` and `meridian autoscaler`: where the control plane's fleet loops stand.

The reconciler's view is the placement in force against what the providers hold: one word for
the whole (in force only once every node group holds its target; reconciling; failing, with the
error), then each node group's desired, actual and ready nodes and its last error. The
autoscaler's is each deployment's pool: its bounds, the replicas ready and desired, and the last
decision with its reason. Both come from the admin API (`GET /v1/reconciler/status`,
`GET /v1/autoscaler/status`) and print as the API sends them with `-o json|yaml`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from cli.admin_session import (
    ApiKeyOpt,
    ControlPlaneOpt,
    OutputFormat,
    OutputOpt,
    admin_client,
    api_errors,
    emit,
)
from meridian.admin_api import AutoscalerStatus, NodeGroupProgress, ReconcilerState, ReconcilerStatus
from meridian.cli_format import folding_table, human_time
from meridian.contracts import NodeRole

_STATE_STYLE = {
    ReconcilerState.IN_FORCE: ("green", "in force"),
    ReconcilerState.RECONCILING: ("yellow", "reconciling"),
    ReconcilerState.FAILING: ("red", "failing"),
    ReconcilerState.NO_PLAN: ("dim", "no plan"),
}


def _error_cell(g: NodeGroupProgress) -> str:
    if g.last_error is None:
        return "-"
    retry = f"; retried {human_time(g.retry_at, seconds=True)}" if g.retry_at else ""
    return f"[red]{escape(g.last_error)}[/red] ({human_time(g.error_at, seconds=True)}, {g.failures}× {retry})"


def reconciler_table(status: ReconcilerStatus) -> Table:
    """The whole's state as the title, why as the caption, one row per node group."""
    style, word = _STATE_STYLE[status.state]
    plan = f"placement {status.plan_id}" if status.plan_id else "placement"
    table = folding_table("Deployment", "Region", "Instance type", "Desired", "Actual", "Ready", "State", "Last error",
                          right=("Desired", "Actual", "Ready"), title=f"{plan}: [{style}]{word}[/{style}]",
                          caption=escape(status.summary), title_justify="left", caption_justify="left")
    for g in status.groups:
        at_target = g.actual == g.desired and g.last_error is None
        table.add_row(
            g.model if g.role is NodeRole.BOTH else f"{g.model} ({g.role.value})",
            g.region,
            g.instance_type + (" (spot)" if g.spot else ""),
            str(g.desired),
            str(g.actual) if at_target else f"[yellow]{g.actual}[/yellow]",
            str(g.ready),
            g.state or "not created",
            _error_cell(g),
        )
    if not status.groups:
        table.add_row("(no node groups)", *["-"] * 7)
    return table


def autoscaler_table(pools: list[AutoscalerStatus]) -> Table:
    table = folding_table("Deployment", "Pool", "Ready", "Desired", "Min–max", "Decided", "Mode", "Reason",
                          right=("Ready", "Desired"), title="Autoscaler")
    for p in pools:
        d = p.last_decision
        table.add_row(p.model, p.pool.value, str(p.ready), str(p.desired), f"{p.min_replicas}–{p.max_replicas}",
                      human_time(d.at, seconds=True) if d else "-", d.mode if d else "-",
                      escape(d.reason) if d else "(no decision recorded yet)")
    if not pools:
        table.add_row("(no deployments)", *["-"] * 7)
    return table


def reconciler(output: OutputOpt = OutputFormat.TABLE, control_plane: ControlPlaneOpt = None,
               api_key: ApiKeyOpt = None) -> None:
    """Show the placement in force against what the providers hold: desired and actual nodes per
    node group, and the reconciler's errors."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        status = admin.reconciler_status()
    emit(output, status, reconciler_table(status))


def autoscaler(
    model: Annotated[str | None, typer.Option(help="Only this deployment")] = None,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Show each deployment's replicas (ready, desired, bounds) and the autoscaler's last decision and reason."""
    with api_errors(), admin_client(control_plane, api_key) as admin:
        pools = admin.autoscaler_status(model)
    emit(output, pools, autoscaler_table(pools))
