"""bench.flow_control's figures from what its runs saw: Jain's index, the weighted share
error, and each must-show figure named and computed from the right runs."""

from __future__ import annotations

import pytest

from bench.common import Figure
from bench.flow_control import Bench, Load, Tally, _count_served, _figures, jain, median_figures, share_error


def test_jain_is_one_for_equal_shares_and_one_over_n_when_one_takes_all() -> None:
    assert jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([0.0, 0.0]) == 0.0


def test_share_error_is_the_largest_relative_miss_of_a_weighted_share() -> None:
    assert share_error([200, 100, 100], [2, 1, 1]) == pytest.approx(0.0)
    assert share_error([100, 100, 100], [2, 1, 1]) == pytest.approx(1 / 3)  # the 2 got 1/3, not 1/2
    assert share_error([0, 0, 0], [2, 1, 1]) == 1.0


def _tally(ttfts: dict[str, list[float]], tokens: dict[str, int] | None = None, generated: int = 0) -> Tally:
    t = Tally()
    for tenant, values in ttfts.items():
        t.ttfts[tenant].extend(values)
    for tenant, n in (tokens or {}).items():
        t.tokens[tenant] = n
    t.generated = generated
    return t


def test_the_figures_compare_the_right_runs() -> None:
    load = Load(seconds=10)
    bench = Bench(fabric=None, routers={}, keys={}, admin=lambda: None, load=load)  # type: ignore[arg-type]
    bench.tallies = {
        "alone": _tally({"light": [0.010] * 10}),
        "flood": _tally({"light": [0.012] * 10}, generated=950),
        "flood_off": _tally({"light": [0.300] * 10}, generated=1000),
        "fair": _tally({}, {"first": 100, "second": 100, "third": 100}),
        "fair_off": _tally({}, {"first": 300, "second": 0, "third": 0}),
        "full": _tally({"light": [0.008] * 10}),
    }
    figures = {f.metric: f for f in _figures(bench)}
    assert figures["noisy_neighbour_ttft_p90_vs_alone"].ratio == pytest.approx(1.2)
    assert figures["throughput_vs_no_flow_control"].ratio == pytest.approx(0.95)
    assert figures["jain_index"].ours == pytest.approx(1.0)
    assert figures["jain_index"].baseline == pytest.approx(1 / 3)
    assert "weighted_share_error" not in figures  # its runs were not measured
    # The engines' floor (B beside full batches, nothing waiting) divides the saturated runs.
    assert figures["noisy_neighbour_ttft_p90_vs_full_batch"].ratio == pytest.approx(1.5)
    assert figures["noisy_neighbour_ttft_p90_vs_full_batch"].baseline == pytest.approx(8.0)
    assert "high_band_ttft_p90_vs_full_batch" not in figures


def test_repeated_rounds_report_each_metric_from_its_median_round() -> None:
    def fig(metric: str, ours: float, baseline: float) -> Figure:
        return Figure("flow_control", metric, ours, baseline, "b", "g", "ms")

    rounds = [[fig("a", 30, 10), fig("b", 1, 1)], [fig("a", 50, 10), fig("b", 4, 1)],
              [fig("a", 12, 3), fig("b", 2, 1)]]
    got = {f.metric: f for f in median_figures(rounds)}
    assert (got["a"].ours, got["a"].baseline) == (12, 3)  # ratio 4: the middle of 3, 4 and 5
    assert got["b"].ours == 2
    assert median_figures([[fig("a", 1, 1)], [fig("a", 3, 1)]])[0].ours == 1  # even: the lower


def test_tokens_count_when_they_are_served_not_when_the_request_ends() -> None:
    tally = Tally(window=(10.0, 20.0))
    # Prefilled before the window, four chunks after it opened, ended in it: the chunks only.
    _count_served(tally, "third", 9.0, 500, [9.5, 11.0, 12.0, 13.0, 14.0])
    assert tally.tokens["third"] == 4
    # Its answer said 2 tokens a chunk: later chunks count 2 each.
    tally.per_chunk["third"] = 2.0
    tally.prompt_tokens["third"] = 500
    # Prefilled inside, cut off at the window's end: its prompt as the last one's, its chunks.
    _count_served(tally, "third", 19.0, None, [19.5, 20.5])
    assert tally.tokens["third"] == 4 + 500 + 2
    assert tally.generated == 4 + 2
    # Never started: nothing.
    _count_served(tally, "third", None, None, [])
    assert tally.tokens["third"] == 506


def test_the_shedding_figure_is_the_share_of_refusals_outside_the_sheddable_band() -> None:
    bench = Bench(fabric=None, routers={}, keys={}, admin=lambda: None, load=Load())  # type: ignore[arg-type]
    shed = Tally()
    shed.sent.update({"flood": 20, "batch": 80})
    shed.refused.update({"flood": 3, "batch": 9})
    bench.tallies = {"shed": shed}
    figure = {f.metric: f for f in _figures(bench)}["refused_outside_the_sheddable_band"]
    # A quarter of the refusals were band 0's; a drop blind to bands would refuse a fifth.
    assert (figure.ours, figure.baseline) == (pytest.approx(0.25), pytest.approx(0.2))
