"""Growth curves of the fleet figures: their exponents, a table and a log-log plot.

`growth_exponent` fits log(figure) = a + k log(nodes) by least squares over the points where
the figure is positive: k is how the figure grows with the fleet (0 flat, 0.5 like the square
root, 1 linear, 2 quadratic). Regions and routers grow with the fleet too (the issue's curve:
both with its square root), so a figure that depends on the routers (bytes per change) grows
by their exponent as well. `exponent_word` names k; `table` lays the figures out per point;
`plot` draws them (matplotlib's Agg backend: no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

Figures = Mapping[str, float | None]

# What the curve plots and tables, with units: the rest of a point's figures are kept in its JSON.
CURVE: dict[str, str] = {
    "heartbeats_asked_per_s": "1/s",
    "heartbeats_reached_per_s": "1/s",
    "cp_cpu_cores": "cores",
    "cp_cpu_ms_per_heartbeat": "ms",
    "pg_cpu_cores": "cores",
    "pg_commits_per_s": "1/s",
    "pg_rows_written_per_s": "1/s",
    "table_bytes": "B",
    "table_get_ms": "ms",
    "death_notice_p50_s": "s",
    "death_to_all_routers_p50_s": "s",
    "death_to_all_routers_p99_s": "s",
    "death_lost_to_build_p50_s": "s",
    "death_lost_to_build_p99_s": "s",
    "death_build_to_first_router_p50_s": "s",
    "death_build_to_first_router_p99_s": "s",
    "death_first_to_last_router_p99_s": "s",
    "drain_to_all_routers_p50_s": "s",
    "drain_to_all_routers_p99_s": "s",
    "cp_cpu_s_per_table_change": "s",
    "bytes_per_table_change": "B",
    "router_table_install_ms": "ms",
    "router_table_full_install_ms": "ms",
    "router_table_install_inflight_p50_ms": "ms",
    "router_rss_table_mib": "MiB",
    "router_rss_mib": "MiB",
    "router_rss_unscoped_mib": "MiB",
    "select_candidates_us": "µs",
    "kv_index_mib": "MiB",
    "kv_scope_nodes": "nodes",
    "kv_index_scoped_mib": "MiB",
    "kv_ingest_events_per_s": "1/s",
}


def growth_exponent(nodes: Sequence[float], values: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(value) against log(nodes); None with fewer than two usable points."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(nodes, values, strict=True)
           if v is not None and v > 0 and n > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def exponent_word(k: float | None) -> str:
    if k is None:
        return "-"
    for bound, word in ((0.25, "flat"), (0.75, "~sqrt(n)"), (1.25, "linear"), (1.75, "~n^1.5")):
        if k < bound:
            return word
    return "quadratic or worse"


def exponents(points: Sequence[tuple[int, Figures]]) -> dict[str, float | None]:
    nodes = [float(n) for n, _ in points]
    return {name: growth_exponent(nodes, [f.get(name) for _, f in points]) for name in CURVE}


def _cell(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or 0.01 <= abs(v) < 10_000:
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return f"{v:.2e}"


def table(points: Sequence[tuple[int, Figures]], collapsed: Mapping[int, str | None] | None = None) -> str:
    """A Markdown table: one row per figure, one column per fleet size, then the exponent."""
    ks = exponents(points)
    head = ["figure", "unit", *[f"{n:,} nodes" for n, _ in points], "exponent", "growth"]
    rows = [head, ["---"] * len(head)]
    for name, unit in CURVE.items():
        k = ks[name]
        rows.append([name, unit, *[_cell(f.get(name)) for _, f in points],
                     "-" if k is None else f"{k:.2f}", exponent_word(k)])
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    for n, why in (collapsed or {}).items():
        if why:
            lines.append(f"\n{n:,} nodes collapsed: {why}")
    return "\n".join(lines)


def plot(points: Sequence[tuple[int, Figures]], path: Path, title: str = "Meridian fleet growth") -> None:
    """One log-log panel per unit group, each figure against the number of nodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = {}
    for name, unit in CURVE.items():
        groups.setdefault(unit, []).append(name)
    fig, axes = plt.subplots(math.ceil(len(groups) / 3), 3, figsize=(15, 4 * math.ceil(len(groups) / 3)))
    ks = exponents(points)
    for ax, (unit, names) in zip(axes.flat, groups.items(), strict=False):
        for name in names:
            xy = [(n, f.get(name)) for n, f in points]
            xy = [(n, v) for n, v in xy if v is not None and v > 0]
            if xy:
                k = ks[name]
                label = name if k is None else f"{name} (k={k:.2f})"
                ax.plot([n for n, _ in xy], [v for _, v in xy], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
