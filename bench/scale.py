"""Fleet scale (issue 34): the real control plane on Postgres, simulated nodes, real router code.

    python -m bench.scale [--full] [--points 100,1000,...] [--out curve.json] [--plot curve.png]

Each point runs chaos.scale.run: N simulated nodes (asyncio agents speaking the real node
protocol) in R of the control plane's catalog regions, routers as in-process
RoutingTableClients plus one or two real `meridian router serve` processes, everything on this
machine; nodes join at 100 a second (--join-per-s). The quick form (`make bench`) runs one small point: 300 nodes, 10 regions, 5 routers
(and says so in each figure's `goal`). `--full` runs 100, 1,000, 3,000 and 10,000 nodes with
regions and routers growing with the square root of the fleet (10 -> 100, 5 -> 50; regions
capped by the catalog, which has 48); `--points` picks the sizes.

JSON lines (bench.common.Figure, bench "scale") for the largest point that held, against the
issue's goals (baseline_name "goal", as bench.placement does for its time budget; ratio <= 1
meets it):

- death_to_all_routers_p99_s: a node's death (it stops heartbeating) -> the last router
  excluding it, measured from the control plane marking it lost (<= 2 s); the time to notice
  is printed beside it;
- cp_cpu_cores: the control plane's CPU over a steady window of heartbeats and table
  long-polls (<= 1 core);
- router_table_install_ms: what a router pays per table change, a one-node delta parsed and
  applied (<= 50 ms); the full table's parse + build (a router's start) is in --out;
- router_rss_mib: a real router's RSS with the table installed, plus the KV index measured
  in-process for the stated blocks per node (<= 300 MiB), of the nodes a router indexes with
  kv_events_max_rtt_ms (--kv-scope-ms, 50 ms: a continent; geo_router.state.kv_scope), placed where
  that is the most nodes; router_rss_unscoped_mib (in --out) is with every node indexed;
- placement_3000_s and placement_3000_gap: with --full, bench.placement's `scale_point(3000)`
  (3,000 deployments on the real catalog with the production options, the plan checked against
  every hard rule; <= 60 s, and the gap to the proven lower bound reported).

The whole curve (every point, every figure) goes to --out; --plot draws it log-log; the growth
exponent of each figure is printed in a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from bench import placement
from bench.common import Figure
from chaos.scale import curve
from chaos.scale.run import PointResult, PointSpec, point_for, run_point

BENCH = "scale"
FULL_POINTS = (100, 1000, 3000, 10_000)
QUICK = PointSpec(nodes=300, regions=10, routers=5, steady_s=15.0, deaths=5, drains=3)
# (metric, unit, goal) at 10,000 nodes, 100 regions, 50 routers on two cores.
GOALS = (
    ("death_to_all_routers_p99_s", "s", 2.0),
    ("cp_cpu_cores", "cores", 1.0),
    ("router_table_install_ms", "ms", 50.0),
    ("router_rss_mib", "MiB", 300.0),
)
PLACEMENT_GOAL_S = 60.0


def _spec(nodes: int, steady_s: float, join_per_s: float, routers_after: bool,
          kv_scope_ms: float | None = QUICK.kv_scope_rtt_ms) -> PointSpec:
    return replace(point_for(nodes), steady_s=steady_s, deaths=8, drains=4, join_per_s=join_per_s,
                   routers_after_fleet=routers_after, kv_scope_rtt_ms=kv_scope_ms)


def run_points(specs: Sequence[PointSpec]) -> list[PointResult]:
    results = []
    for spec in specs:
        print(f"# scale point: {spec.nodes} nodes, {spec.regions} regions, {spec.routers} in-process routers"
              f" + {spec.real_routers} real", file=sys.stderr, flush=True)
        results.append(run_point(spec))
    return results


def _where(r: PointResult, quick: bool) -> str:
    s = r.spec
    size = f"{s.nodes:,} nodes, {int(r.figures.get('regions') or s.regions)} regions, {s.routers}+{s.real_routers} routers"
    return f"quick form: {size}" if quick else size


def figures(results: Sequence[PointResult], quick: bool,
            placement_3000: Callable[[], placement.PlacementScalePoint] | None = None) -> list[Figure]:
    """The goal figures of the largest point that held (the collapsed ones are named)."""
    held = [r for r in results if r.collapsed is None]
    if not held:
        return []
    top = held[-1]
    # Why a point collapsed is on stderr and in --out; the goal field names it only.
    collapsed = ", ".join(f"{r.spec.nodes:,}" for r in results if r.collapsed)
    collapsed = f"{collapsed} nodes collapsed" if collapsed else ""
    where = _where(top, quick) + (f" ({collapsed})" if collapsed else "")
    out = []
    for metric, unit, goal in GOALS:
        value = top.figures.get(metric)
        if value is not None:
            what = f"<= {goal:g} at 10,000 nodes; {where}"
            if metric == "router_rss_mib":
                what += _kv_held(top)
            out.append(Figure(BENCH, metric, value, goal, "goal", what, unit))
    if placement_3000 is not None:
        solved = placement_3000()
        out.append(Figure(BENCH, "placement_3000_s", solved.seconds, PLACEMENT_GOAL_S, "goal",
                          f"<= {PLACEMENT_GOAL_S:g} (3,000 deployments; {solved.method})", "s"))
        # The gap is reported, not bounded: against the proven lower bound (0 = optimal).
        out.append(Figure(BENCH, "placement_3000_gap", solved.gap, 0.0, "proven lower bound",
                          "reported (3,000 deployments)", "ratio"))
    return out


def _kv_held(r: PointResult) -> str:
    """What the KV index in router_rss_mib holds."""
    blocks = f"{r.spec.kv_blocks_per_node} KV blocks a node"
    if r.spec.kv_scope_rtt_ms is None:
        return f"; KV index of every node, {blocks}"
    nodes = r.figures.get("kv_scope_nodes")
    return (f"; KV index of the {nodes or 0:.0f} nodes within {r.spec.kv_scope_rtt_ms:g} ms of the"
            f" router holding the most (kv_events_max_rtt_ms), {blocks}")


def write_curve(results: Sequence[PointResult], path: Path) -> None:
    points = [(r.spec.nodes, r.figures) for r in results]
    doc = {
        "points": [{"spec": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(r.spec).items()},
                    "figures": r.figures, "notes": r.notes, "collapsed": r.collapsed} for r in results],
        "exponents": curve.exponents(points),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def report(results: Sequence[PointResult]) -> None:
    points = [(r.spec.nodes, r.figures) for r in results]
    print(curve.table(points, {r.spec.nodes: r.collapsed for r in results}), file=sys.stderr)
    for r in results:
        for note in r.notes:
            print(f"# {r.spec.nodes:,} nodes: {note}", file=sys.stderr)
    print(file=sys.stderr, flush=True)


def run(full: bool = False, points: Sequence[int] | None = None, steady_s: float = 30.0,
        out: Path | None = None, plot: Path | None = None, join_per_s: float = QUICK.join_per_s,
        routers_after: bool = False, kv_scope_ms: float | None = QUICK.kv_scope_rtt_ms) -> list[Figure]:
    if points:
        specs = [_spec(n, steady_s, join_per_s, routers_after, kv_scope_ms) for n in points]
    elif full:
        specs = [_spec(n, steady_s, join_per_s, routers_after, kv_scope_ms) for n in FULL_POINTS]
    else:
        specs = [replace(QUICK, kv_scope_rtt_ms=kv_scope_ms)]
    results = run_points(specs)
    report(results)
    if out is not None:
        write_curve(results, out)
    if plot is not None:
        curve.plot([(r.spec.nodes, r.figures) for r in results], plot)
    # Another bench exposes the 3,000-deployment solve; it is a minute of its own, so --full only.
    return figures(results, quick=not (full or points), placement_3000=_placement_3000 if full else None)


def _placement_3000() -> placement.PlacementScalePoint:
    return placement.scale_point(3000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="100, 1,000, 3,000 and 10,000 nodes")
    ap.add_argument("--points", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="fleet sizes, e.g. 100,1000")
    ap.add_argument("--steady-s", type=float, default=30.0, help="steady window of a --full/--points run")
    ap.add_argument("--join-per-s", type=float, default=QUICK.join_per_s,
                    help="nodes join (register) at this rate in a --full/--points run")
    ap.add_argument("--routers-after-fleet", action="store_true",
                    help="start the routers once the fleet has registered (steady-state figures of a"
                         " control plane that cannot register the fleet under its routers)")
    ap.add_argument("--kv-scope-ms", type=float, default=QUICK.kv_scope_rtt_ms,
                    help="the routers' kv_events_max_rtt_ms for router_rss_mib (0: every node indexed)")
    ap.add_argument("--out", type=Path, default=None, help="write every point's figures here (JSON)")
    ap.add_argument("--plot", type=Path, default=None, help="draw the growth curves here (PNG)")
    args = ap.parse_args()
    for fig in run(args.full, args.points, args.steady_s, args.out, args.plot, args.join_per_s,
                   args.routers_after_fleet, args.kv_scope_ms or None):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
