"""The history checker on hand-built histories: each anomaly is counted, and the verdict follows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chaos.checker import CheckResult, check, percentile
from chaos.drill import DRILLS_DIR, Drill, load_drill
from chaos.history import ClientOp, History, Outcome, Routed, Served

ZONES = {"aws:us-east-1": ["us"], "gcp:europe-west4": ["eu"], "onprem:tokyo-1": ["apac"]}
HOME = {"global": "aws:us-east-1", "us": "aws:us-east-1", "eu": "gcp:europe-west4", "apac": "onprem:tokyo-1"}
TENANTS = [("acme-global", "global"), ("acme-eu", "eu"), ("acme-us", "us"), ("acme-apac", "apac")]


def drill(**criteria: object) -> Drill:
    """A 30 s drill, fault at [10, 20) s, steady state over 5 s, with the given pass criteria."""
    return Drill.model_validate(
        {
            "name": "t",
            "description": "test drill",
            "steady_state": {"min_success_rate": 0.99, "max_p99_ms": 500, "window_s": 5},
            "load": {
                "arrivals_per_s": 10, "duration_s": 30, "streaming_fraction": 0.0,
                "tenants": [{"name": t, "zone": z, "weight": 1} for t, z in TENANTS],
            },
            "fault": {"kind": "process_crash", "target": {"node": "any"}, "start_s": 10, "end_s": 20},
            "pass": criteria,
        }
    )


def served(h: History, key: str, t: float, *, latency_s: float = 0.1, zone: str = "global",
           region: str | None = None, stream: bool = False, node: str | None = None) -> None:
    """One request answered ok from `region` (the tenant's home by default)."""
    tenant = dict((z, t) for t, z in TENANTS)[zone]
    region = region or HOME[zone]
    node = node or f"n-{region.split(':')[1]}"
    h.client.append(ClientOp(key, tenant, zone, stream, t, t + latency_s / 2 if stream else None, t + latency_s,
                             Outcome.OK, 200, region=region, node=node))
    h.routed.append(Routed(key, node, region, 1))
    h.served.append(Served(key, node, True))


def steady(h: History, start: float = 0.0, end: float = 30.0, rate: float = 10, skip: tuple[float, float] | None = None) -> None:
    """Healthy load over [start, end), tenants in turn; `skip` leaves a gap for the test to fill."""
    for i in range(round((end - start) * rate)):
        t = round(start + i / rate, 6)
        if skip and skip[0] <= t < skip[1]:
            continue
        served(h, f"s{i}-{t}", t, zone=TENANTS[i % 4][1])


def run(h: History, d: Drill) -> CheckResult:
    return check(h, d, ZONES)


def test_a_clean_run_passes_every_criterion() -> None:
    h = History()
    steady(h)
    d = drill(max_error_rate_during_fault=0.0, max_p99_during_fault_ms=500, max_recovery_s=0, max_indeterminate=0)
    r = run(h, d)
    assert (r.attempts, r.acknowledged, r.ok) == (300, 300, 300)
    assert r.lost == r.duplicated == r.unexpected == r.recovered == r.unclean_errors == ()
    assert r.residency_violations == ()
    assert r.recovery_s == 0.0 and r.error_rate_during_fault == 0.0
    v = r.verdict(d)
    assert v.passed, v.failures()
    assert {c.name for c in v.criteria} >= {"lost", "duplicated", "residency_violations", "recovery_s", "p99_during_fault_ms"}


def test_acknowledged_but_never_served_is_lost() -> None:
    h = History()
    steady(h)
    h.client.append(ClientOp("ghost", "acme-us", "us", False, 12.0, None, 12.1, Outcome.OK, 200, region="aws:us-east-1"))
    r = run(h, drill())
    assert r.lost == ("ghost",) and r.ok == 300 and r.acknowledged == 301
    lost = next(c for c in r.verdict(drill()).criteria if c.name == "lost")
    assert (lost.passed, lost.measured, lost.bound, lost.detail) == (False, 1, 0, "ghost")


def test_a_request_without_final_outcome_is_lost_unless_streaming() -> None:
    h = History()
    steady(h)
    h.client.append(ClientOp("hung", "acme-us", "us", False, 12.0))
    h.client.append(ClientOp("hung-stream", "acme-us", "us", True, 12.0))
    # A send-time record followed by the final one is a single finished request.
    h.client.append(ClientOp("two-phase", "acme-us", "us", False, 13.0))
    served(h, "two-phase", 13.0, zone="us")
    r = run(h, drill(streams_end_with_error_event=True))
    assert r.lost == ("hung",)
    assert r.pending == ("hung", "hung-stream")
    assert r.streams_without_error_event == ("hung-stream",)
    assert r.max_latency_during_fault_ms == float("inf")
    assert {c.name for c in r.verdict(drill(streams_end_with_error_event=True)).failures()} == {
        "lost", "streams_without_error_event"}


def test_a_retry_completed_twice_is_duplicated_and_fails_a_drill_requiring_none() -> None:
    h = History()
    steady(h)
    h.client.append(ClientOp("dup", "acme-us", "us", False, 12.0, None, 14.0, Outcome.OK, 200, region="aws:us-east-1", node="n-b"))
    h.routed += [Routed("dup", "n-a", "aws:us-east-1", 1), Routed("dup", "n-b", "aws:us-east-1", 2)]
    h.served += [Served("dup", "n-a", True), Served("dup", "n-b", True)]
    # A retry after an attempt that did not complete is not a duplicate.
    h.client.append(ClientOp("retried", "acme-us", "us", False, 12.0, None, 14.0, Outcome.OK, 200))
    h.routed += [Routed("retried", "n-a", "aws:us-east-1", 1), Routed("retried", "n-b", "aws:us-east-1", 2)]
    h.served += [Served("retried", "n-a", False), Served("retried", "n-b", True)]
    r = run(h, drill())
    assert r.duplicated == ("dup",) and r.lost == ()
    assert [c.name for c in r.verdict(drill()).failures()] == ["duplicated"]
    assert r.verdict(drill(max_duplicated=1)).passed


def test_indeterminate_is_recovered_when_served_and_never_lost() -> None:
    h = History()
    steady(h)
    h.client.append(ClientOp("timed-out", "acme-us", "us", False, 12.0, None, 42.0, Outcome.INDETERMINATE))
    h.routed.append(Routed("timed-out", "n-us", "aws:us-east-1", 1))
    h.served.append(Served("timed-out", "n-us", True))
    h.client.append(ClientOp("reset", "acme-us", "us", False, 12.5, None, 12.6, Outcome.INDETERMINATE))
    r = run(h, drill())
    assert r.recovered == ("timed-out",)
    assert r.indeterminate == ("reset", "timed-out")
    assert r.lost == ()
    assert r.verdict(drill()).passed
    assert [c.name for c in r.verdict(drill(max_indeterminate=0)).failures()] == ["indeterminate"]


def test_records_without_a_client_invocation_are_unexpected() -> None:
    h = History()
    steady(h)
    h.served.append(Served("from-nowhere", "n-us", True))
    r = run(h, drill())
    assert r.unexpected == ("from-nowhere",)
    assert not r.verdict(drill()).passed


def test_an_eu_tenant_served_in_a_us_region_is_a_residency_violation() -> None:
    h = History()
    steady(h)
    served(h, "eu-in-us", 12.0, zone="eu", region="aws:us-east-1")
    # Routed out of zone, then served in zone: the prompt still left the zone.
    served(h, "eu-routed-out", 12.1, zone="eu")
    h.routed.append(Routed("eu-routed-out", "n-us", "aws:us-east-1", 2))
    served(h, "global-anywhere", 12.2, zone="global", region="onprem:tokyo-1")
    served(h, "unknown-region", 12.3, zone="apac", region="onprem:osaka-9")
    r = run(h, drill())
    assert [(v.key, v.region) for v in r.residency_violations] == [
        ("eu-in-us", "aws:us-east-1"), ("eu-routed-out", "aws:us-east-1"), ("unknown-region", "onprem:osaka-9")]
    res = next(c for c in r.verdict(drill()).criteria if c.name == "residency_violations")
    assert not res.passed and res.measured == 3 and "eu tenant acme-eu in aws:us-east-1" in res.detail


def test_clean_errors_are_the_allowed_ones_only() -> None:
    allowed = [{"status": 503, "code": "no_replica_in_zone"},
               {"status": 503, "code": "model_scaling_from_zero", "retry_after": True}]
    d = drill(allowed_errors=allowed, max_error_rate_during_fault=0.0)
    h = History()
    steady(h)
    h.client += [
        ClientOp("zone-down", "acme-eu", "eu", False, 12.0, None, 12.01, Outcome.FAIL, 503, "no_replica_in_zone"),
        ClientOp("scaled", "acme-us", "us", False, 12.0, None, 13.0, Outcome.FAIL, 503, "model_scaling_from_zero",
                 retry_after=True),
    ]
    r = run(h, d)
    assert r.clean_errors == ("scaled", "zone-down") and r.unclean_errors == ()
    assert r.verdict(d).passed
    h.client += [
        ClientOp("no-retry-after", "acme-us", "us", False, 12.0, None, 13.0, Outcome.FAIL, 503, "model_scaling_from_zero"),
        ClientOp("bad-gateway", "acme-us", "us", False, 12.0, None, 12.1, Outcome.FAIL, 502, None),
    ]
    r = run(h, d)
    assert r.unclean_errors == ("bad-gateway", "no-retry-after")
    assert {c.name for c in r.verdict(d).failures()} == {"unclean_errors", "error_rate_during_fault"}


def test_p99_during_the_fault_is_nearest_rank_over_successes_only() -> None:
    h = History()
    steady(h, skip=(10, 20))
    for i in range(100):  # latencies 1..100 ms inside the fault window
        served(h, f"f{i}", 10 + i * 0.1, latency_s=(i + 1) / 1000, stream=i % 2 == 0)
    h.client.append(ClientOp("slow-fail", "acme-us", "us", False, 15.0, None, 19.0, Outcome.FAIL, 502))
    r = run(h, drill())
    # Streams count their time to first byte: half of (i + 1) ms.
    expected = sorted([(i + 1) / 2 if i % 2 == 0 else i + 1 for i in range(100)])[98]
    assert r.p99_during_fault_ms == pytest.approx(expected)
    assert r.max_latency_during_fault_ms == pytest.approx(4000)
    assert r.requests_during_fault == 101
    assert percentile([1, 2, 3], 99) == 3 and percentile([], 99) is None
    assert not run(h, drill(max_p99_during_fault_ms=50)).verdict(drill(max_p99_during_fault_ms=50)).passed


def test_time_to_recovery_is_measured_from_the_fault_end() -> None:
    d = drill(max_recovery_s=5, recovery_window_s=2)
    h = History()
    steady(h, skip=(10, 23))
    for i in range(130):  # failing until 3 s after the fault ends, then healthy again
        t = round(10 + i * 0.1, 6)
        h.client.append(ClientOp(f"e{i}", "acme-us", "us", False, t, None, t + 0.01, Outcome.FAIL, 502))
    r = run(h, d)
    assert r.recovery_s == pytest.approx(3.0)
    assert {c.name for c in r.verdict(d).failures()} == {"unclean_errors"}
    tight = drill(max_recovery_s=2.5)
    assert {c.name for c in run(h, tight).verdict(tight).failures()} == {"unclean_errors", "recovery_s"}


def test_recovery_counts_latency_and_from_the_fault_start_when_asked() -> None:
    d = drill(max_recovery_s=10, recovery_from="fault_start", recovery_window_s=2)
    h = History()
    steady(h, skip=(10, 14))
    for i in range(40):  # slow (2 s > the 500 ms steady-state p99) for 4 s, then ejected
        served(h, f"slow{i}", round(10 + i * 0.1, 6), latency_s=2.0)
    r = run(h, d)
    assert r.recovery_s == pytest.approx(4.0)
    assert r.error_rate_during_fault == 0.0
    # The report says why recovery came when it did: the last window that missed the steady
    # state, and its slowest request.
    assert r.last_unmet is not None and r.last_unmet.worst.key == "slow39"
    assert r.last_unmet.start_s < 14 <= r.last_unmet.end_s and r.last_unmet.p99_ms == pytest.approx(2000)
    tight = drill(max_recovery_s=3, recovery_from="fault_start", recovery_window_s=2)
    rec = next(c for c in run(h, tight).verdict(tight).failures() if c.name == "recovery_s")
    assert "p99 2000 ms; worst slow39 (http, node " in rec.detail and "invoked 13.9 s): 2000 ms" in rec.detail


def test_a_fabric_that_never_recovers_fails_the_recovery_criterion() -> None:
    d = drill(max_recovery_s=5)
    h = History()
    steady(h, end=10)
    for i in range(200):
        t = round(10 + i * 0.1, 6)
        h.client.append(ClientOp(f"e{i}", "acme-us", "us", False, t, None, t + 0.01, Outcome.INDETERMINATE))
    r = run(h, d)
    assert r.recovery_s is None
    rec = next(c for c in r.verdict(d).criteria if c.name == "recovery_s")
    assert not rec.passed and rec.detail.startswith("did not recover; last unmet window [")
    assert r.last_unmet is not None and r.last_unmet.good_rate == 0.0
    assert "indeterminate" in rec.detail


def test_invariants_not_observed_by_the_runner_fail() -> None:
    d = drill(invariants=["single_leader", "no_healthy_node_flapped"])
    h = History()
    steady(h)
    r = run(h, d)
    v = r.verdict(d, {"single_leader": True})
    assert [(c.name, c.detail) for c in v.failures()] == [("invariant:no_healthy_node_flapped", "not observed by the runner")]
    assert r.verdict(d, {"single_leader": True, "no_healthy_node_flapped": True}).passed
    assert not r.verdict(d, {"single_leader": False, "no_healthy_node_flapped": True}).passed


def test_a_steady_state_that_does_not_hold_before_the_fault_fails_the_drill() -> None:
    h = History()
    steady(h, skip=(6, 10))
    for i in range(40):
        t = round(6 + i * 0.1, 6)
        h.client.append(ClientOp(f"e{i}", "acme-us", "us", False, t, None, t + 0.01, Outcome.FAIL, 500))
    failures = [c.name for c in run(h, drill(max_unclean_errors=100)).verdict(drill(max_unclean_errors=100)).failures()]
    assert failures == ["steady_state_before_fault"]


def _node_crash_history(d: Drill, *, retries: bool) -> History:
    """What the load generator, router and nodes record when node n-us-1 (one of two) is SIGKILLed.

    Requests in flight on n-us-1 when it dies either fail over to n-us-2 (retries) or come
    back to the client as 502s (a build with retries disabled). Streams that already sent
    their first byte cannot move and end with an error event in both builds.
    """
    h = History()
    crash = d.fault.start_s
    rate = d.load.arrivals_per_s
    for i in range(int(d.load.duration_s * rate)):
        t = round(i / rate, 6)
        tenant, zone = TENANTS[i % 4]
        region = HOME[zone]
        stream = i % 3 == 0
        node = f"n-{region.split(':')[1]}" if region != "aws:us-east-1" else f"n-us-{i % 2 + 1}"
        in_flight_on_victim = node == "n-us-1" and crash - 0.5 <= t < crash
        after_crash_on_victim = node == "n-us-1" and t >= crash
        if after_crash_on_victim:
            node = "n-us-2"  # connection refused ejects n-us-1 at once; never counted as a retry
        if not in_flight_on_victim:
            served(h, f"k{i}", t, zone=zone, region=region, node=node, stream=stream)
            continue
        h.routed.append(Routed(f"k{i}", "n-us-1", region, 1))  # SIGKILL: n-us-1 writes no served record
        if stream:
            h.client.append(ClientOp(f"k{i}", tenant, zone, True, t, t + 0.05, crash, Outcome.FAIL, 200,
                                     "upstream_disconnected", region=region, node="n-us-1", stream_error_event=True))
        elif retries:
            h.client.append(ClientOp(f"k{i}", tenant, zone, False, t, None, crash + 0.2, Outcome.OK, 200,
                                     region=region, node="n-us-2"))
            h.routed.append(Routed(f"k{i}", "n-us-2", region, 2))
            h.served.append(Served(f"k{i}", "n-us-2", True))
        else:
            h.client.append(ClientOp(f"k{i}", tenant, zone, False, t, None, crash, Outcome.FAIL, 502,
                                     "upstream_disconnected", region=region, node="n-us-1"))
    return h


def test_node_crash_drill_passes_with_retries_and_fails_when_retries_are_disabled() -> None:
    d = load_drill(DRILLS_DIR / "01-node-crash.yaml")

    with_retries = check(_node_crash_history(d, retries=True), d, ZONES)
    assert with_retries.lost == () and with_retries.unclean_errors == ()
    assert with_retries.clean_errors  # the broken streams, which ended with an error event
    assert with_retries.verdict(d).passed, with_retries.verdict(d).failures()

    without = check(_node_crash_history(d, retries=False), d, ZONES)
    failed = {c.name for c in without.verdict(d).failures()}
    assert "unclean_errors" in failed and without.unclean_errors
    # A broken stream without its error event would fail the drill too.
    h = _node_crash_history(d, retries=True)
    h.client = [replace(op, stream_error_event=False) if op.node == "n-us-1" and op.stream and op.outcome is Outcome.FAIL
                else op for op in h.client]
    assert "streams_without_error_event" in {c.name for c in check(h, d, ZONES).verdict(d).failures()}
