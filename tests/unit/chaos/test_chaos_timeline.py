"""The drill report's timeline: per-node series, failovers and traffic shifts from a node-crash
history built from the real record types, event labels that never overlap (measured with the
figure's renderer), an error axis that tells zero from one, and the PNG itself."""

from __future__ import annotations

import io
import itertools
import json
from datetime import UTC, datetime
from pathlib import Path

import matplotlib.image
import pytest

from chaos.checker import check
from chaos.drill import DRILLS_DIR, Drill, load_drill
from chaos.history import ClientOp, History, Outcome, Routed
from chaos.report import NO_NODE, NO_REGION, FaultEvent, ReportModel, RunReport, timeline_series, write_report
from chaos.report.plot import TimelineFigure, draw_timeline, timeline_figure
from chaos.report.plot_events import stagger
from chaos.report.traffic import SHIFT_MIN_BEFORE, Failover, TrafficShift, traffic_shifts

US, EU = "aws:us-east-1", "gcp:europe-west4"
N1, N2, N_EU = "node-aws-us-east-1-1", "node-aws-us-east-1-2", "node-gcp-europe-west4"
ZONES = {US: ["us"], EU: ["eu"]}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def drill() -> Drill:
    """The node-crash drill as CI runs it: 30 s of load, fault [10, 18) s."""
    return load_drill(DRILLS_DIR / "01-node-crash.yaml").short_version()


def served(h: History, key: str, t: float, node: str, region: str, *, attempts: tuple[str, ...] = ()) -> None:
    """A request invoked at t and answered ok by `node`, after failed attempts on `attempts`."""
    h.client.append(ClientOp(key, "acme-us", "us", False, t))
    h.client.append(ClientOp(key, "acme-us", "us", False, t, None, t + 0.1, Outcome.OK, 200, region=region, node=node))
    for n, tried in enumerate((*attempts, node), start=1):
        h.routed.append(Routed(key, tried, US if "us-east" in tried else EU, n))


def node_crash() -> History:
    """Two requests/s per us-east-1 node and one for Europe; node 2 dies at 10 s and node 1
    takes all of us-east-1's requests until 18 s, when node 2 is back. The request in flight
    on node 2 at 10.2 s fails over to node 1; one at 12.5 s never gets an answer."""
    h = History()
    keys = itertools.count()
    for second in range(30):
        down = 10 <= second < 18
        for half in (0.0, 0.5):
            t = second + half + 0.05
            served(h, f"k{next(keys)}", t, N1, US)
            served(h, f"k{next(keys)}", t + 0.01, N1 if down else N2, US)
        served(h, f"k{next(keys)}", second + 0.3, N_EU, EU)
    served(h, "in-flight", 10.2, N1, US, attempts=(N2,))
    h.client.append(ClientOp("hung", "acme-us", "us", False, 12.5))
    h.client.append(ClientOp("hung", "acme-us", "us", False, 12.5, None, 42.5, Outcome.INDETERMINATE))
    return h


def run_report(drill: Drill, h: History, events: tuple[FaultEvent, ...]) -> RunReport:
    result = check(h, drill, ZONES, fault_start_s=10.0, fault_end_s=18.0)
    return RunReport(
        drill=drill, short=True, started_at=datetime(2026, 1, 5, 9, 0, tzinfo=UTC), duration_s=30.5,
        fault_start_s=10.0, fault_end_s=18.0, events=events, result=result,
        verdict=result.verdict(drill, {}), invariants={},
    )


def test_series_counts_requests_per_serving_node_and_where_they_moved() -> None:
    tl = timeline_series(node_crash())
    # Siblings next to each other, ordered by region; the unanswered request under "none", last.
    assert tl.nodes == (N1, N2, N_EU, NO_NODE)
    assert tl.node_regions == {N1: US, N2: US, N_EU: EU}
    rates = tl.node_requests_per_s
    assert rates[N1] == (2,) * 10 + (5,) + (4,) * 7 + (2,) * 12  # + the request that failed over at 10.2 s
    assert rates[N2] == (2,) * 10 + (0,) * 8 + (2,) * 12
    assert rates[N_EU] == (1,) * 30
    assert rates[NO_NODE] == (0,) * 12 + (1,) + (0,) * 17
    # The region's total hides the move entirely: 4/s (5/s with the failover) throughout.
    assert set(tl.requests_per_s[US]) == {4, 5}
    assert tl.errors == (0,) * 12 + (1,) + (0,) * 17
    assert tl.errors_per_s[NO_REGION][12] == 1
    assert tl.failovers == (Failover(at_s=10.0, from_node=N2, to_node=N1, count=1),)
    assert tl.traffic_shifts == (TrafficShift(at_s=10.0, from_node=N2, to_node=N1),)


def test_failovers_are_node_changes_between_a_requests_attempts() -> None:
    h = History()
    served(h, "two-hops", 3.4, N_EU, EU, attempts=(N2, N1))
    served(h, "same-node", 3.6, N1, US, attempts=(N1,))  # a retry on the same node moves nothing
    served(h, "other", 5.1, N1, US, attempts=(N2,))
    h.routed += [Routed("journal-only", N2, US, 1), Routed("journal-only", N1, US, 2)]  # no client record: no time
    tl = timeline_series(h, bucket_s=2.0)
    assert tl.failovers == (
        Failover(2.0, N1, N_EU, 1),
        Failover(2.0, N2, N1, 1),
        Failover(4.0, N2, N1, 1),
    )


def test_a_shift_needs_a_steady_node_a_long_silence_and_a_sibling_that_rose() -> None:
    regions = {N1: US, N2: US, N_EU: EU}
    starts = [float(i) for i in range(20)]
    steady = [2] * 8 + [0] * 6 + [2] * 6
    # Sparse: a node with a request every other second falls silent for 6 s by chance.
    sparse = [1, 0] * 4 + [0] * 6 + [1, 0] * 3
    rising = [1] * 8 + [3] * 6 + [1] * 6
    assert traffic_shifts({N2: steady, N1: rising, N_EU: [1] * 20}, regions, starts, 1.0) == (
        TrafficShift(8.0, N2, N1),
    )
    assert sum(sparse[3:8]) < SHIFT_MIN_BEFORE
    assert traffic_shifts({N2: sparse, N1: rising}, regions, starts, 1.0) == ()
    # Nobody took the requests (they failed): silence alone is not a shift.
    assert traffic_shifts({N2: steady, N1: [1] * 20}, regions, starts, 1.0) == ()
    # A node with no sibling hands over to whichever node rose, in another region.
    assert traffic_shifts({N_EU: steady, N1: rising}, regions, starts, 1.0) == (TrafficShift(8.0, N_EU, N1),)


def test_stagger_puts_a_span_in_the_lowest_row_it_fits() -> None:
    assert stagger([(0, 30), (25, 50), (32, 60), (40, 70), (66, 90)], gap=5) == [0, 1, 2, 0, 1]
    assert stagger([(0, 10), (0, 10), (0, 10)], gap=0) == [0, 1, 2]


def label_boxes(drawn: TimelineFigure) -> list[object]:
    drawn.fig.canvas.draw()
    renderer = drawn.fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in drawn.event_labels]


@pytest.mark.parametrize(
    "times",
    [
        pytest.param([10.0, 11.0, 12.0, 13.0, 14.0, 15.0], id="one-second-apart"),
        pytest.param([10.0, 10.33, 10.335, 18.0, 18.01, 27.8], id="node-crash-clusters"),
    ],
)
def test_event_labels_never_overlap(drill: Drill, times: list[float]) -> None:
    actions = ["inject", "busy", "signal", "heal", "restart", "healthy"]
    events = tuple(FaultEvent(t, a, f"{a} node-aws-us-east-1-2") for t, a in zip(times, actions, strict=True))
    drawn = timeline_figure(run_report(drill, node_crash(), events), timeline_series(node_crash()))
    boxes = label_boxes(drawn)
    assert [t.get_text() for t in drawn.event_labels] == [f"{n} {a}" for n, a in enumerate(actions, start=1)]
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert not a.overlaps(b), f"label {i + 1} {a} overlaps label {j + 1} {b}"
    fig_box = drawn.fig.bbox
    lane = drawn.lane
    for box, e in zip(boxes, events, strict=True):
        assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and fig_box.y0 <= box.y0 and box.y1 <= fig_box.y1
        # Each label starts just right of its event's time, inside the lane's height.
        x_event = lane.transData.transform((e.at_s, 0))[0]
        assert 0 <= box.x0 - x_event < 15
        assert lane.bbox.y0 <= box.y0 and box.y1 <= lane.bbox.y1 + 1
    # They were close enough to collide on one line: the lane had to stagger them.
    assert len({round(b.y0) for b in boxes}) > 1


def error_bars(drawn: TimelineFigure) -> list[float]:
    return [bar.get_height() for bars in drawn.errors.containers for bar in bars if bar.get_height() > 0]


def test_error_axis_shows_zero_errors_as_zero(drill: Drill) -> None:
    h = History()
    for i in range(60):
        served(h, f"k{i}", i / 2, N1, US)
    drawn = timeline_figure(run_report(drill, h, ()), timeline_series(h))
    bottom, top = drawn.errors.get_ylim()
    assert bottom < 0 < 1 <= top < 1.5  # the zero line above the frame, the axis up to one error
    assert {0, 1} <= set(drawn.errors.get_yticks()) and all(t == int(t) for t in drawn.errors.get_yticks())
    assert error_bars(drawn) == []
    assert any(t.get_text() == "0 errors of 60 requests" for t in drawn.errors.texts)


def test_error_axis_shows_a_single_error_as_a_full_bar(drill: Drill) -> None:
    h = History()
    for i in range(60):
        served(h, f"k{i}", i / 2, N1, US)
    h.client.append(ClientOp("bad", "acme-us", "us", False, 12.2, None, 12.3, Outcome.FAIL, 502, region=US))
    drawn = timeline_figure(run_report(drill, h, ()), timeline_series(h))
    bottom, top = drawn.errors.get_ylim()
    assert error_bars(drawn) == [1.0]
    assert bottom < 0 and 1 / top > 0.8  # the one error's bar fills most of the panel
    assert all(t == int(t) for t in drawn.errors.get_yticks())
    assert any(t.get_text() == "1 error of 61 requests" for t in drawn.errors.texts)


def test_draw_timeline_returns_a_png_with_a_strip_per_node(drill: Drill) -> None:
    events = (FaultEvent(10.0, "inject", "SIGKILL node-aws-us-east-1-2"), FaultEvent(18.0, "heal", "restart"))
    report, tl = run_report(drill, node_crash(), events), timeline_series(node_crash())
    png = draw_timeline(report, tl)
    assert png is not None and png.startswith(PNG_MAGIC)
    image = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert image.shape[1] == 1100  # 11 in at 100 dpi
    drawn = timeline_figure(report, tl)
    assert len(drawn.nodes) == 4
    assert [ax.texts[0].get_text() for ax in drawn.nodes] == [N1, N2, N_EU, "no node (not answered)"]


def test_report_json_has_the_node_series_and_still_reads_without_them(drill: Drill, tmp_path: Path) -> None:
    h = node_crash()
    files = write_report(run_report(drill, h, ()), h, tmp_path)
    data = json.loads(files.report_json.read_text(encoding="utf-8"))
    timeline = data["timeline"]
    assert timeline["nodes"] == [N1, N2, N_EU, NO_NODE]
    assert timeline["node_requests_per_s"][N2][9:11] == [2, 0]
    assert timeline["failovers"] == [{"at_s": 10.0, "from_node": N2, "to_node": N1, "count": 1}]
    assert timeline["traffic_shifts"] == [{"at_s": 10.0, "from_node": N2, "to_node": N1}]
    assert sum(timeline["errors"]) == 1
    # A report.json written before these fields existed is still a valid report.
    for name in ("nodes", "node_regions", "node_requests_per_s", "errors", "failovers", "traffic_shifts"):
        del timeline[name]
    assert ReportModel.model_validate(data).timeline.nodes == []


def test_a_run_aborted_before_any_request_still_draws(drill: Drill) -> None:
    events = (FaultEvent(0.5, "abort", "fabric did not start: " + "x" * 300),)
    drawn = timeline_figure(run_report(drill, History(), events), timeline_series(History()))
    assert [t.get_text() for t in drawn.nodes[0].texts] == ["no requests"]
    assert drawn.errors.get_ylim()[1] >= 1
    png = draw_timeline(run_report(drill, History(), events), timeline_series(History()))
    assert png is not None and png.startswith(PNG_MAGIC)
