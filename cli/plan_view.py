"""`meridian plan`: a placement preview as a diff table against the placement in force."""

from __future__ import annotations

from rich.table import Table

from meridian.admin_api import PlanView
from meridian.cli_format import folding_table

_KIND_STYLE = {"added": "green", "removed": "red", "changed": "yellow"}


def plan_diff_table(plan: PlanView) -> Table:
    """One row per deployment × region × instance type whose count changes."""
    table = folding_table("", "Deployment", "Region", "Instance type", "SKU", "Instances", "Replicas", "$/h",
                          right=("Instances", "Replicas", "$/h"), title=f"Placement plan {plan.id} ({plan.status})",
                          title_justify="left")
    diff = plan.diff or {}
    for kind in ("added", "changed", "removed"):
        style = _KIND_STYLE[kind]
        sign = {"added": "+", "removed": "-", "changed": "~"}[kind]
        for c in diff.get(kind, []):
            delta = c["cost_after"] - c["cost_before"]
            table.add_row(
                f"[{style}]{sign}[/{style}]",
                c["deployment"],
                c["region"],
                c["instance_type"] + (" (spot)" if c["spot"] else ""),
                c["sku"],
                f"{c['instances_before']} → {c['instances_after']}",
                f"{c['replicas_before']} → {c['replicas_after']}",
                f"[{style}]{delta:+,.2f}[/{style}]",
            )
    return table


def plan_summary(plan: PlanView) -> str:
    """The plan's cost and what it changes, in one line."""
    diff = plan.diff or {}
    counts = ", ".join(f"{len(diff.get(k, []))} {k}" for k in ("added", "changed", "removed"))
    cost = plan.cost_per_hour or 0.0
    delta = diff.get("cost_delta_per_hour", 0.0)
    return f"${cost:,.2f}/h ({delta:+,.2f} $/h); {counts}; solved in {plan.solve_seconds:.2f} s"
