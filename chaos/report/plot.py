"""timeline.png: requests/s and errors/s per region and the p99 latency over the run, with the
fault's window shaded and the injector's events marked.

Needs matplotlib (the `chaos` extra), imported when a timeline is drawn; without it
`draw_timeline` answers None and the report says the PNG was not drawn.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

from chaos.report.inputs import RunReport, verdict_word
from chaos.report.series import NO_REGION, TimelineSeries

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def draw_timeline(report: RunReport, timeline: TimelineSeries) -> bytes | None:
    """The timeline as PNG bytes; None when matplotlib is not installed."""
    try:
        # The object API with its own Agg canvas: no pyplot, so no global figure registry
        # and no change to the process's default backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    # Fixed margins, legends in the right margin: constrained layout would double the drawing time.
    fig.subplots_adjust(left=0.07, right=0.8, top=0.92, bottom=0.07, hspace=0.1)
    ax_req, ax_err, ax_p99 = fig.subplots(3, 1, sharex=True)
    xs = list(timeline.starts_s)
    # steps-post draws bucket i flat from its start to the next point: one more point closes the last bucket.
    edges = [*xs, xs[-1] + timeline.bucket_s] if xs else []
    _plot_regions(ax_req, ax_err, timeline, edges)
    _plot_p99(ax_p99, report, timeline)
    for ax in (ax_req, ax_err, ax_p99):
        _mark_fault(ax, report)
    for e in report.events:
        ax_req.annotate(
            e.action,
            (e.at_s, 1.0),
            xycoords=ax_req.get_xaxis_transform(),
            xytext=(2, 4),
            textcoords="offset points",
            fontsize=7,
            rotation=30,
        )
    ax_req.set_ylabel("requests/s")
    ax_err.set_ylabel("errors/s")
    ax_p99.set_ylabel("p99 latency (ms)")
    ax_p99.set_xlabel("seconds since load start")
    if timeline.regions:
        ax_req.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="region", title_fontsize=8
        )
    ax_p99.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax_p99.set_xlim(min([0.0, *edges]), max([report.duration_s, report.drill.load.duration_s, *edges]))
    mode = "short" if report.short else "full"
    fs, fe = report.fault_start_s, report.fault_end_s
    fig.suptitle(
        f"{report.drill.name} ({mode}): {verdict_word(report.passed)}  fault [{fs:.1f}, {fe:.1f}) s shaded"
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _plot_regions(ax_req: Axes, ax_err: Axes, timeline: TimelineSeries, edges: list[float]) -> None:
    """Requests/s and errors/s as steps, a line per region."""
    for n, region in enumerate(timeline.regions):
        # Red is the fault's colour; unanswered requests ("none") are grey so they do not read as regions.
        style = (
            {"color": "dimgrey", "linestyle": "--"}
            if region == NO_REGION
            else {"color": _COLOURS[n % len(_COLOURS)]}
        )
        for ax, series in (
            (ax_req, timeline.requests_per_s[region]),
            (ax_err, timeline.errors_per_s[region]),
        ):
            ax.plot(
                edges, [*series, series[-1]], drawstyle="steps-post", label=region, linewidth=1.2, **style
            )


def _plot_p99(ax: Axes, report: RunReport, timeline: TimelineSeries) -> None:
    """The p99 of ok requests per bucket, and the steady state's bound when the drill has one."""
    # At bucket centres; NaN leaves a gap where a bucket had no ok request instead of drawing through it.
    centres = [x + timeline.bucket_s / 2 for x in timeline.starts_s]
    p99 = [math.nan if p is None else p for p in timeline.p99_ms]
    ax.plot(centres, p99, marker=".", linewidth=1.2, color="tab:purple", label="p99 (ok requests)")
    if report.drill.steady_state.max_p99_ms is not None:
        ax.axhline(
            report.drill.steady_state.max_p99_ms,
            color="grey",
            linestyle=":",
            linewidth=1,
            label="steady-state p99 bound",
        )


def _mark_fault(ax: Axes, report: RunReport) -> None:
    """The fault's window shaded, its ends dashed, the injector's events as ticks on the top edge."""
    fs, fe = report.fault_start_s, report.fault_end_s
    ax.axvspan(fs, fe, color="tab:red", alpha=0.12, linewidth=0)
    ax.axvline(fs, color="tab:red", linestyle="--", linewidth=1)
    ax.axvline(fe, color="tab:red", linestyle="--", linewidth=1)
    trans = ax.get_xaxis_transform()  # x in seconds, y in axes fractions: markers sit on the top edge
    for e in report.events:
        ax.plot([e.at_s], [1.0], marker="v", color="black", markersize=5, transform=trans, clip_on=False)
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
