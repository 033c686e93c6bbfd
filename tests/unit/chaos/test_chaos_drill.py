"""Drill files: the shipped drills load, and a broken one is refused with the file and field named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from chaos.drill import (
    DRILLS_DIR,
    FAULT_PARAMS,
    MAX_SHORT_DURATION_S,
    DrillError,
    FaultKind,
    load_drill,
    load_drills,
)
from chaos.faults.injector import INJECTORS

ISSUE_DRILLS = {
    "node-crash": "process_crash",
    "gray-failure": "process_hang",
    "region-outage": "region_outage",
    "provider-outage": "provider_outage",
    "partition": "proxy_blackhole",
    "control-plane-down": "control_plane_outage",
    "redis-down": "redis_outage",
    "postgres-restart": "postgres_restart",
    "spot-preemption": "spot_preemption",
    "corrupt-weight-chunk": "corrupt_weight_chunk",
    "disk-full": "disk_full_during_fetch",
    "scale-from-zero-burst": "scale_from_zero_burst",
    "clock-skew": "clock_skew",
    # Beyond the issue's list: the partition again, with real packets dropped in a netns.
    "packet-partition": "packet_loss",
    # Issue 22: long streams struck mid-generation, resumed by the router.
    "mid-stream-crash": "mid_stream_crash",
    "mid-stream-gray": "mid_stream_hang",
    # Issue 24: a disaggregated region loses a prefill worker, then a decode worker.
    "pd-worker-crash": "pd_worker_crash",
    # Issue 34: the control plane frozen past the node TTL must not reap a healthy fleet.
    "control-plane-stall": "control_plane_stall",
    # Issue 37: a node killed while flow control holds a saturated zone's backlog.
    "saturated-node-crash": "process_crash",
}


def _base() -> dict:
    return yaml.safe_load((DRILLS_DIR / "01-node-crash.yaml").read_text())


def _write(tmp_path: Path, data: dict, name: str = "drill.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_issue_drill_ships_with_its_fault_and_a_short_version_within_a_minute() -> None:
    drills = load_drills()
    assert {d.name: d.fault.kind for d in drills} == ISSUE_DRILLS
    assert [d.name for d in drills] == sorted(ISSUE_DRILLS)
    for d in drills:
        short = d.short_version()
        assert short.short is None
        assert short.load.duration_s <= MAX_SHORT_DURATION_S, d.name
        assert short.steady_state.window_s <= short.fault.start_s <= short.fault.end_s <= short.load.duration_s
        assert short.pass_criteria == d.pass_criteria  # only timings change
        # Every drill asserts the history properties the issue requires of all of them.
        assert (d.pass_criteria.max_lost, d.pass_criteria.max_duplicated) == (0, 0), d.name
        assert d.pass_criteria.max_residency_violations == 0, d.name


def test_every_fault_kind_has_its_params_and_an_injector_that_loads() -> None:
    """A fault kind is declared once (chaos.drill.FAULTS); the injector registry is built
    from it, so a kind cannot be listed in one place and missing from another."""
    assert set(INJECTORS.names()) == {k.value for k in FaultKind} == set(FAULT_PARAMS)
    for kind in FaultKind:
        assert callable(INJECTORS.get(kind)), kind


def test_only_the_stall_drill_runs_a_simulated_fleet() -> None:
    # Issue 34's drill: a fleet beside the real nodes; every other drill runs the fabric alone.
    fleets = {d.name: d.topology.simulated_nodes for d in load_drills() if d.topology.simulated_nodes}
    assert fleets == {"control-plane-stall": 200}


def test_short_version_applies_the_override() -> None:
    d = load_drill(DRILLS_DIR / "06-control-plane-down.yaml")
    assert d.load.duration_s == 100 and d.fault.end_s - d.fault.start_s == 60
    s = d.short_version()
    assert (s.load.duration_s, s.fault.start_s, s.fault.end_s, s.steady_state.window_s) == (40, 8, 32, 5)
    assert s.load.tenants == d.load.tenants and s.fault.kind == d.fault.kind


def test_a_drill_without_short_block_is_its_own_short_version(tmp_path: Path) -> None:
    data = _base()
    del data["short"]
    data["load"]["duration_s"] = 45
    d = load_drill(_write(tmp_path, data))
    assert d.short_version() is d


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["pass"].update(max_lots=0), "pass.max_lots: Extra inputs are not permitted"),
        (lambda d: d["fault"].update(kind="meteor_strike"), "fault.kind: Input should be 'process_crash'"),
        (lambda d: d["load"].update(streaming_fraction=1.5), "load.streaming_fraction: Input should be less than or equal to 1"),
        (lambda d: d["fault"].update(kind="proxy_latency"), "proxy_latency needs params ['latency_ms']"),
        (lambda d: d["fault"].update(params={"latency": 5}), "process_crash does not take params ['latency']"),
        (lambda d: d["fault"].update(end_s=500), "fault.end_s (500.0) is after the load ends"),
        (lambda d: d["short"].update(duration_s=90), "short.duration_s: Input should be less than or equal to 60"),
        (lambda d: d["short"].update(fault_end_s=45), "short version is invalid"),
        (lambda d: d.pop("steady_state"), "steady_state: Field required"),
        (lambda d: d["topology"].update(env={"PATH": "/tmp"}), "not MERIDIAN_* settings"),
        (lambda d: d["topology"].update(simulated_nodes=-1), "topology.simulated_nodes: Input should be greater"),
        (lambda d: d["load"]["tenants"].append(dict(d["load"]["tenants"][0])), "tenant names must be unique"),
    ],
)
def test_invalid_drill_is_refused_naming_file_and_field(tmp_path: Path, mutate, expected: str) -> None:
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(DrillError) as e:
        load_drill(path)
    assert str(path) in str(e.value)
    assert expected in str(e.value)


def test_unparsable_yaml_and_non_mapping_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(DrillError, match="bad.yaml: cannot read drill"):
        load_drill(bad)
    bad.write_text("- a list\n")
    with pytest.raises(DrillError, match="a drill is a YAML mapping"):
        load_drill(bad)


def test_recovery_bound_must_be_measurable_before_the_load_ends(tmp_path: Path) -> None:
    data = _base()
    data["pass"].update(recovery_from="fault_end", max_recovery_s=30)
    with pytest.raises(DrillError, match="too soon to measure recovery"):
        load_drill(_write(tmp_path, data))


def test_duplicate_drill_names_are_refused(tmp_path: Path) -> None:
    _write(tmp_path, _base(), "a.yaml")
    _write(tmp_path, _base(), "b.yml")
    with pytest.raises(DrillError, match=r"b\.yml: drill name 'node-crash' is already used by .*a\.yaml"):
        load_drills(tmp_path)
