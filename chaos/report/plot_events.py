"""The timeline's event lane: the injector's events as numbered labels that never overlap,
and the numbered list of what each event was, under the plot.

Events come in clusters (a crash drill records `inject`, `busy` and `signal` within half a
second, `heal` and `restart` within ten milliseconds), so labels at their times collide.
Each label goes into the lowest row of the lane where it overlaps no label placed before
it: rows are assigned from the labels' widths in pixels, measured with the figure's own
renderer, before the figure's height is fixed, so the lane is as tall as the busiest
cluster needs. A label is short (number and action); the detail, which can be long, is in
the list, where there is room for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from chaos.timeline import FaultEvent

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.text import Text

LABEL_FONT_PT = 7.5
DETAIL_FONT_PT = 7.0
ROW_IN = 0.2  # one lane row, in inches
DETAIL_LINE_IN = 0.145
MAX_DETAILS = 14  # events listed under the plot; more are in report.json
MAX_DETAIL_CHARS = 140
_DOT_PT = 3.0  # the marker's radius: the label starts right of it
_GAP_PX = 6.0  # clear space between two labels of a row


def event_label(n: int, e: FaultEvent) -> str:
    return f"{n} {e.action}"


def stagger(spans: Sequence[tuple[float, float]], gap: float = _GAP_PX) -> list[int]:
    """A row for each (left, right) span, in order: the lowest row whose spans placed so
    far all end `gap` before this one starts (greedy, as interval-graph colouring)."""
    row_ends: list[float] = []
    rows: list[int] = []
    for left, right in spans:
        for r, end in enumerate(row_ends):
            if end + gap <= left:
                row_ends[r] = right
                rows.append(r)
                break
        else:
            row_ends.append(right)
            rows.append(len(row_ends) - 1)
    return rows


def label_rows(
    events: Sequence[FaultEvent], to_px: Callable[[float], float], renderer: RendererBase, dpi: float
) -> list[int]:
    """The lane row of each event's label; `to_px` maps seconds to the lane's x in pixels."""
    from matplotlib.font_manager import FontProperties

    font = FontProperties(size=LABEL_FONT_PT)
    dot_px = _DOT_PT * dpi / 72
    spans = []
    for n, e in enumerate(events, start=1):
        width, _, _ = renderer.get_text_width_height_descent(event_label(n, e), font, ismath=False)
        x = to_px(e.at_s)
        spans.append((x - dot_px, x + dot_px + width))
    return stagger(spans)


def draw_lane(ax: Axes, events: Sequence[FaultEvent], rows: Sequence[int]) -> list[Text]:
    """Each event as a dot at its time and its numbered label to the right, in its row
    (row 0 at the bottom); answers the labels. No line joins a dot to the axis: it would
    cross the labels of the rows below; the panels under the lane draw the event's time."""
    n_rows = max([0, *rows]) + 1
    ax.set_ylim(0, n_rows)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelbottom=False)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    labels: list[Text] = []
    for n, (e, row) in enumerate(zip(events, rows, strict=True), start=1):
        y = row + 0.5
        ax.plot([e.at_s], [y], marker="o", markersize=2 * _DOT_PT, color=_colour(e), clip_on=False)
        labels.append(
            ax.annotate(
                event_label(n, e),
                (e.at_s, y),
                xytext=(_DOT_PT + 1, 0),
                textcoords="offset points",
                va="center",
                ha="left",
                fontsize=LABEL_FONT_PT,
                annotation_clip=False,
            )
        )
    ax.set_ylabel("events", rotation=0, ha="right", va="center", fontsize=9)
    return labels


def detail_lines(events: Sequence[FaultEvent]) -> list[str]:
    """The list under the plot: number, time, action and what the injector did."""
    lines = []
    for n, e in enumerate(events[:MAX_DETAILS], start=1):
        detail = e.detail if len(e.detail) <= MAX_DETAIL_CHARS else e.detail[: MAX_DETAIL_CHARS - 1] + "…"
        lines.append(f"{n:>2}  {e.at_s:7.2f} s  {e.action}: {detail}")
    if len(events) > MAX_DETAILS:
        lines.append(f"    … and {len(events) - MAX_DETAILS} more events (report.json lists them all)")
    return lines


def _colour(e: FaultEvent) -> str:
    """Red for what the fault does, black for the rest (observations, restarts)."""
    return "tab:red" if e.action in ("inject", "heal", "abort", "signal", "terminate") else "black"
