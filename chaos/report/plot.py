"""timeline.png: what happened during a drill run, on one time axis, top to bottom:

- events: the injector's events as numbered labels that never overlap (plot_events), listed
  with their detail under the plot;
- requests/s per serving node, a strip per node grouped by region, with arrows where traffic
  moved to another node (plot_nodes);
- errors per bucket as bars stacked by region, on an axis that always reaches 1 and shows
  its zero line, so that no errors reads as an empty panel with "0 errors" and a single
  error as a bar of full height (a line of errors/s on an autoscaled axis reads the same
  either way);
- the p99 latency of ok requests and the steady state's bound.

The fault's window is shaded and every event's time is a dotted line in every panel.

Needs matplotlib (the `chaos` extra), imported when a timeline is drawn; without it
`draw_timeline` answers None and the report says the PNG was not drawn. The layout is fixed
in inches (it depends on the number of nodes, label rows and events), not computed by a
layout engine: constrained layout would double the drawing time.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chaos.report.inputs import RunReport, verdict_word
from chaos.report.plot_events import (
    DETAIL_FONT_PT,
    DETAIL_LINE_IN,
    ROW_IN,
    detail_lines,
    draw_lane,
    label_rows,
)
from chaos.report.plot_nodes import arrow_legend_handles, draw_nodes
from chaos.report.series import NO_REGION, TimelineSeries

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

_COLOURS = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:cyan", "tab:olive", "tab:pink", "tab:grey"]
WIDTH_IN, DPI = 11.0, 100
LEFT_IN, RIGHT_IN = 0.95, 2.45  # the right margin holds the legends
TITLE_IN, GAP_IN, XLABEL_IN = 0.5, 0.14, 0.38
STRIP_IN, STRIP_GAP_IN, NODES_MAX_IN = 0.55, 0.05, 5.0
ERRORS_IN, P99_IN = 1.25, 1.5


@dataclass(frozen=True)
class TimelineFigure:
    """The drawn figure and its parts, for draw_timeline to save and tests to measure."""

    fig: Figure
    lane: Axes
    nodes: tuple[Axes, ...]
    errors: Axes
    p99: Axes
    event_labels: tuple[Text, ...]


def draw_timeline(report: RunReport, timeline: TimelineSeries) -> bytes | None:
    """The timeline as PNG bytes; None when matplotlib is not installed."""
    try:
        drawn = timeline_figure(report, timeline)
    except ImportError:
        return None
    buf = io.BytesIO()
    drawn.fig.savefig(buf, format="png")
    return buf.getvalue()


def timeline_figure(report: RunReport, timeline: TimelineSeries) -> TimelineFigure:
    """The whole figure, laid out; raises ImportError without matplotlib."""
    # The object API with its own Agg canvas: no pyplot, so no global figure registry
    # and no change to the process's default backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, 8.0), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    xs = list(timeline.starts_s)
    # steps-post draws bucket i flat from its start to the next point: one more point closes the last bucket.
    edges = [*xs, xs[-1] + timeline.bucket_s] if xs else []
    xlim = (min([0.0, *edges]), max([report.duration_s, report.drill.load.duration_s, *edges]))
    width_px = (WIDTH_IN - LEFT_IN - RIGHT_IN) * DPI
    rows = label_rows(
        report.events,
        lambda t: LEFT_IN * DPI + (t - xlim[0]) / (xlim[1] - xlim[0]) * width_px,
        canvas.get_renderer(),
        DPI,
    )
    details = detail_lines(report.events)
    lane, node_axes, ax_err, ax_p99 = _layout(fig, max([0, *rows]) + 1, max(1, len(timeline.nodes)), len(details))
    colours = _region_colours(timeline)
    labels = draw_lane(lane, report.events, rows)
    if timeline.nodes:
        draw_nodes(fig, node_axes, timeline, edges, colours)
        _node_legend(node_axes[0], timeline, colours)
    else:
        node_axes[0].text(0.5, 0.5, "no requests", transform=node_axes[0].transAxes, ha="center", va="center")
    _plot_errors(ax_err, timeline, colours)
    _plot_p99(ax_p99, report, timeline)
    for ax in (lane, *node_axes, ax_err, ax_p99):
        ax.set_xlim(*xlim)
        _mark_fault(ax, report, grid=ax is not lane)
    for ax in (*node_axes, ax_err):
        ax.tick_params(axis="x", labelbottom=False)
    fig.text(0.012, _middle(node_axes), "requests/s by serving node", rotation=90, va="center", fontsize=10)
    ax_p99.set_xlabel("seconds since load start")
    fig.text(LEFT_IN / WIDTH_IN, 0.12 / fig.get_figheight(), "\n".join(details), fontsize=DETAIL_FONT_PT,
             family="monospace", va="bottom", ha="left", linespacing=1.45)
    mode = "short" if report.short else "full"
    fs, fe = report.fault_start_s, report.fault_end_s
    fig.suptitle(
        f"{report.drill.name} ({mode}): {verdict_word(report.passed)}  fault [{fs:.1f}, {fe:.1f}) s shaded",
        y=1 - 0.12 / fig.get_figheight(), va="top",
    )
    return TimelineFigure(fig, lane, tuple(node_axes), ax_err, ax_p99, tuple(labels))


def _layout(fig: Figure, lane_rows: int, n_nodes: int, n_details: int) -> tuple[Axes, list[Axes], Axes, Axes]:
    """Sizes the figure for its parts and places their axes, top to bottom, in inches."""
    strip = min(STRIP_IN, NODES_MAX_IN / n_nodes)
    lane_h = lane_rows * ROW_IN + 0.04
    details_h = n_details * DETAIL_LINE_IN + 0.25 if n_details else 0.0
    blocks = [lane_h, n_nodes * (strip + STRIP_GAP_IN), ERRORS_IN, P99_IN]
    height = TITLE_IN + sum(blocks) + GAP_IN * len(blocks) + XLABEL_IN + details_h
    fig.set_size_inches(WIDTH_IN, height)
    width = (WIDTH_IN - LEFT_IN - RIGHT_IN) / WIDTH_IN
    y = height - TITLE_IN

    def take(h: float, gap: float = GAP_IN) -> Axes:
        nonlocal y
        y -= h
        ax = fig.add_axes((LEFT_IN / WIDTH_IN, y / height, width, h / height))
        y -= gap
        return ax

    lane = take(lane_h)
    nodes = [take(strip, STRIP_GAP_IN) for _ in range(n_nodes)]
    y -= GAP_IN - STRIP_GAP_IN
    return lane, nodes, take(ERRORS_IN), take(P99_IN)


def _middle(axes: list[Axes]) -> float:
    return (axes[0].get_position().y1 + axes[-1].get_position().y0) / 2


def _region_colours(timeline: TimelineSeries) -> dict[str, str]:
    """A colour per region (red is the fault's), the same in every panel."""
    regions = sorted({*timeline.regions, *timeline.node_regions.values()} - {NO_REGION})
    colours = {r: _COLOURS[n % len(_COLOURS)] for n, r in enumerate(regions)}
    colours[NO_REGION] = "dimgrey"
    return colours


def _node_legend(ax: Axes, timeline: TimelineSeries, colours: dict[str, str]) -> None:
    from matplotlib.patches import Patch

    present = {timeline.node_regions.get(n, NO_REGION) for n in timeline.nodes}
    handles: list[object] = [
        Patch(color=c, alpha=0.5, label="no region" if r == NO_REGION else r)
        for r, c in colours.items()
        if r in present
    ]
    handles += arrow_legend_handles(timeline)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title="region / arrows", title_fontsize=8, frameon=False)


def _plot_errors(ax: Axes, timeline: TimelineSeries, colours: dict[str, str]) -> None:
    """Errors per bucket as bars stacked by region; the axis reaches at least 1 error with
    integer ticks, and its zero line sits above the frame so that zero is seen, not guessed."""
    from matplotlib.ticker import MaxNLocator

    bottom = [0.0] * len(timeline.starts_s)
    width = timeline.bucket_s * 0.8
    lefts = [x + timeline.bucket_s * 0.1 for x in timeline.starts_s]
    for region in timeline.regions:
        counts = [r * timeline.bucket_s for r in timeline.errors_per_s[region]]
        if any(counts):
            ax.bar(lefts, counts, width=width, bottom=bottom, align="edge", color=colours[region],
                   label="no region" if region == NO_REGION else region)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    top = max([1.0, *bottom]) * 1.15
    ax.set_ylim(-0.08 * top, top)
    ax.axhline(0, color="black", linewidth=1.0, zorder=3)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=2))
    ax.set_ylabel(f"errors per {timeline.bucket_s:g} s")
    total = sum(timeline.errors)
    requests = round(sum(sum(s) for s in timeline.requests_per_s.values()) * timeline.bucket_s)
    note = "0 errors" if total == 0 else f"{total} error{'s' if total != 1 else ''}"
    ax.text(0.005, 0.93, f"{note} of {requests} requests", transform=ax.transAxes, va="top", fontsize=8,
            color="black" if total == 0 else "tab:red",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.75, "pad": 1})
    if total:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="errors by region",
                  title_fontsize=8, frameon=False)


def _plot_p99(ax: Axes, report: RunReport, timeline: TimelineSeries) -> None:
    """The p99 of ok requests per bucket, and the steady state's bound when the drill has one."""
    # At bucket centres; NaN leaves a gap where a bucket had no ok request instead of drawing through it.
    centres = [x + timeline.bucket_s / 2 for x in timeline.starts_s]
    p99 = [math.nan if p is None else p for p in timeline.p99_ms]
    ax.plot(centres, p99, marker=".", linewidth=1.2, color="tab:purple", label="p99 (ok requests)")
    if report.drill.steady_state.max_p99_ms is not None:
        ax.axhline(report.drill.steady_state.max_p99_ms, color="grey", linestyle=":", linewidth=1,
                   label="steady-state p99 bound")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _mark_fault(ax: Axes, report: RunReport, *, grid: bool) -> None:
    """The fault's window shaded, its ends dashed, every event's time dotted."""
    fs, fe = report.fault_start_s, report.fault_end_s
    ax.axvspan(fs, fe, color="tab:red", alpha=0.1, linewidth=0)
    ax.axvline(fs, color="tab:red", linestyle="--", linewidth=1)
    ax.axvline(fe, color="tab:red", linestyle="--", linewidth=1)
    for e in report.events:
        ax.axvline(e.at_s, color="black", linestyle=":", linewidth=0.6, alpha=0.6)
    if grid:
        ax.grid(True, axis="x", alpha=0.3)
