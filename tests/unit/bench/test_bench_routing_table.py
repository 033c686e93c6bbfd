"""bench.routing_table on a small fleet: every figure is there, and what the bench checks on
the way (the delta gives the full table, the index gives the scan's candidates) holds."""

from __future__ import annotations

from bench.routing_table import run


def test_the_routing_table_bench_measures_every_figure_on_a_small_fleet():
    figures = {f.metric: f for f in run(sizes=(300,), routers=5)}
    assert set(figures) == {
        "cp_cpu_ms_per_change_300", "cp_bytes_per_change_300", "router_install_ms_300",
        "router_install_with_listeners_ms_300", "select_candidates_us_300",
    }
    # One node changed: five deltas are far smaller than five full tables.
    assert figures["cp_bytes_per_change_300"].ours * 10 < figures["cp_bytes_per_change_300"].baseline
    assert all(f.ours > 0 and f.baseline > 0 for f in figures.values())
