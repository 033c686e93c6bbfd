"""The timeline's node panel: one strip per serving node, grouped and coloured by region, on
one shared scale, with arrows where traffic moved between nodes.

Strips rather than lines on one axis: at a few requests per second per node, lines of
several nodes cross and hide each other at every bucket, while a strip per node shows at a
glance which node fell silent and which one took its requests. Siblings (nodes of one
region) are next to each other and share the region's colour.

Arrows go from the node that lost requests to the one that got them, at that time: solid
black for the routers' failovers (a request retried on another node, from the routers'
journals; `×n` when there were n in one bucket), dashed orange for a traffic shift read from
the series (the node fell silent while its sibling's requests rose; chaos.report.traffic).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from chaos.report.series import NO_NODE, TimelineSeries

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FAILOVER_COLOUR = "black"
SHIFT_COLOUR = "tab:orange"
NO_NODE_COLOUR = "dimgrey"


def draw_nodes(
    fig: Figure, axes: Sequence[Axes], timeline: TimelineSeries, edges: list[float], colours: Mapping[str, str]
) -> None:
    """Requests/s of each of `timeline.nodes` in its strip of `axes`, then the arrows."""
    rates = timeline.node_requests_per_s
    top = max([1.0, *(max(rates[n], default=0.0) for n in timeline.nodes)])
    for ax, node in zip(axes, timeline.nodes, strict=True):
        series = rates[node]
        region = timeline.node_regions.get(node)
        colour = NO_NODE_COLOUR if node == NO_NODE else colours.get(region or "", NO_NODE_COLOUR)
        ys = [*series, series[-1]]
        ax.fill_between(edges, ys, step="post", color=colour, alpha=0.3, linewidth=0)
        ax.plot(edges, ys, drawstyle="steps-post", color=colour, linewidth=1.2)
        # Headroom above the highest bucket for the node's name: it never covers a step.
        ax.set_ylim(0, top * 1.6)
        ax.set_yticks([0, top])
        ax.set_yticklabels(["0", f"{top:g}"], fontsize=7)
        ax.tick_params(axis="x", labelbottom=False)
        name = "no node (not answered)" if node == NO_NODE else node
        ax.text(
            0.005, 0.96, name, transform=ax.transAxes, va="top", ha="left", fontsize=7.5)
    strip = dict(zip(timeline.nodes, axes, strict=True))
    # Inside their bucket, apart from each other and from its start, where the fault's
    # window often begins: a line there would hide an arrow.
    b = timeline.bucket_s
    for f in timeline.failovers:
        label = f"×{f.count}" if f.count > 1 else None
        _arrow(fig, strip, f.from_node, f.to_node, f.at_s + 0.65 * b, FAILOVER_COLOUR, "solid", label)
    for s in timeline.traffic_shifts:
        _arrow(fig, strip, s.from_node, s.to_node, s.at_s + 0.3 * b, SHIFT_COLOUR, "dashed", None)


def arrow_legend_handles(timeline: TimelineSeries) -> list[object]:
    """Legend entries for the kinds of arrow the panel has (none when it has none)."""
    from matplotlib.lines import Line2D

    handles: list[object] = []
    if timeline.failovers:
        n = sum(f.count for f in timeline.failovers)
        handles.append(Line2D([], [], color=FAILOVER_COLOUR, linewidth=1.2,
                              label=f"router failover ({n} request{'s' if n != 1 else ''})"))
    if timeline.traffic_shifts:
        handles.append(Line2D([], [], color=SHIFT_COLOUR, linewidth=1.5, linestyle="--",
                              label="traffic moved (node silent,\nsibling rose)"))
    return handles


def _arrow(
    fig: Figure, strip: Mapping[str, Axes], a: str, b: str, x: float, colour: str, style: str, label: str | None
) -> None:
    """An arrow at time x from strip a's middle to strip b's; a marker on b alone when a has
    no strip (a node that never answered a request the client saw)."""
    from matplotlib.patches import ConnectionPatch

    to = strip.get(b)
    if to is None:
        return
    frm = strip.get(a)
    if frm is None:
        to.plot([x], [0.5], marker="v", color=colour, transform=to.get_xaxis_transform(), clip_on=False)
    else:
        down = frm.get_position().y0 > to.get_position().y0
        fig.add_artist(ConnectionPatch(
            xyA=(x, 0.5), coordsA=frm.get_xaxis_transform(),
            xyB=(x, 0.65 if down else 0.35), coordsB=to.get_xaxis_transform(),
            arrowstyle="-|>", color=colour, linestyle=style, linewidth=1.5, mutation_scale=12, zorder=5,
        ))
    if label is not None:
        to.annotate(label, (x, 0.5), xycoords=to.get_xaxis_transform(), xytext=(4, 0),
                    textcoords="offset points", fontsize=7, va="center", color=colour)
