"""Drill reports on hand-built histories of the node-crash drill: the files agree with the checker."""

from __future__ import annotations

import json
import os
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from chaos.checker import CheckResult, check, latency_ms, percentile
from chaos.drill import DRILLS_DIR, Drill, load_drill
from chaos.history import ClientOp, History, Outcome, Routed, Served
from chaos.report import (
    NO_MATPLOTLIB,
    NO_REGION,
    FaultEvent,
    ReportModel,
    RunReport,
    summary_rows,
    timeline_series,
    write_report,
    write_suite_summary,
)

ZONES = {"aws:us-east-1": ["us"], "gcp:europe-west4": ["eu"], "onprem:tokyo-1": ["apac"]}
HOME = {"global": "aws:us-east-1", "us": "aws:us-east-1", "eu": "gcp:europe-west4", "apac": "onprem:tokyo-1"}
TENANTS = {"global": "acme-global", "eu": "acme-eu", "us": "acme-us", "apac": "acme-apac"}
EVENTS = (
    FaultEvent(10.02, "inject", "SIGKILL node-aws-us-east-1-2 (pid 1234)"),
    FaultEvent(18.01, "heal", "restart node-aws-us-east-1-2 (pid 1301)"),
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def drill() -> Drill:
    """The node-crash drill as CI runs it: 30 s, fault [10, 18) s, steady state over 5 s."""
    return load_drill(DRILLS_DIR / "01-node-crash.yaml").short_version()


def ok(
    h: History,
    key: str,
    t: float,
    zone: str = "global",
    *,
    latency_s: float = 0.1,
    stream: bool = False,
    completions: int = 1,
) -> None:
    """A request answered ok from the tenant's home region, completed `completions` times by nodes."""
    region = HOME[zone]
    node = f"node-{region.split(':')[1]}-1"
    first_byte = t + latency_s / 2 if stream else None
    h.client.append(
        ClientOp(
            key,
            TENANTS[zone],
            zone,
            stream,
            t,
            first_byte,
            t + latency_s,
            Outcome.OK,
            200,
            region=region,
            node=node,
        )
    )
    h.routed.append(Routed(key, node, region, 1))
    h.served.extend(Served(key, node, True) for _ in range(completions))


def healthy(rate: float = 2.0, duration: float = 30.0) -> History:
    """Every request ok for the whole load, tenants in turn."""
    h = History()
    zones = list(HOME)
    for i in range(round(duration * rate)):
        ok(h, f"k{i:03d}", round(i / rate, 6), zones[i % len(zones)])
    # A stream cut by the crash that ends with an SSE error event: the correct answer.
    h.client.append(
        ClientOp(
            "cut-stream",
            "acme-us",
            "us",
            True,
            12.3,
            12.35,
            12.6,
            Outcome.FAIL,
            200,
            error_code="upstream_error",
            region="aws:us-east-1",
            node="node-us-east-1-2",
            stream_error_event=True,
        )
    )
    h.routed.append(Routed("cut-stream", "node-us-east-1-2", "aws:us-east-1", 1))
    h.served.append(Served("cut-stream", "node-us-east-1-2", False))
    return h


def broken() -> History:
    """A healthy run plus a lost ack, a double serve, an unclean 502 and a request that never ended."""
    h = healthy()
    h.client.append(
        ClientOp(
            "ghost", "acme-eu", "eu", False, 11.2, None, 11.4, Outcome.OK, 200, region="gcp:europe-west4"
        )
    )
    ok(h, "twice", 13.1, "us", completions=2)
    h.client.append(
        ClientOp(
            "bad-gateway",
            "acme-global",
            "global",
            False,
            11.5,
            None,
            11.6,
            Outcome.FAIL,
            502,
            error_code="bad_gateway",
        )
    )
    h.client.append(ClientOp("hung", "acme-apac", "apac", False, 12.0))
    return h


def make_report(drill: Drill, h: History, **kw: object) -> tuple[RunReport, CheckResult]:
    result = check(h, drill, ZONES, fault_start_s=10.02, fault_end_s=18.01)
    invariants = {"no_healthy_node_flapped": True}
    fields: dict[str, object] = {
        "drill": drill,
        "short": True,
        "started_at": datetime(2025, 3, 1, 12, 0, tzinfo=UTC),
        "duration_s": 30.2,
        "fault_start_s": 10.02,
        "fault_end_s": 18.01,
        "events": EVENTS,
        "result": result,
        "verdict": result.verdict(drill, invariants),
        "invariants": invariants,
    }
    fields.update(kw)
    return RunReport(**fields), result  # type: ignore[arg-type]


def strict_json(path: Path) -> dict[str, object]:
    """Parse as strict JSON: NaN and Infinity literals are not JSON and fail the test."""

    def refuse(name: str) -> object:
        raise AssertionError(f"{path.name} contains the non-JSON literal {name}")

    data = json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)
    assert isinstance(data, dict)
    return data


def without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import matplotlib...` fail, as on a machine without the `chaos` extra."""
    # None in sys.modules makes `import` raise ImportError.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)


def test_a_failing_run_writes_three_files_that_agree_with_the_checker(drill: Drill, tmp_path: Path) -> None:
    report, result = make_report(drill, broken())
    files = write_report(report, broken(), tmp_path / "run")
    assert not report.verdict.passed

    data = strict_json(files.report_json)
    ReportModel.model_validate(data)  # the file matches its own boundary model
    assert data["drill"] == "node-crash" and data["short"] is True and data["passed"] is False
    assert data["started_at"] == "2025-03-01T12:00:00+00:00"
    assert data["fault"]["start_s"] == 10.02 and data["fault"]["planned_start_s"] == 10
    assert [e["action"] for e in data["events"]] == ["inject", "heal"]
    counts = data["counts"]
    assert (counts["attempts"], counts["acknowledged"], counts["ok"]) == (
        result.attempts,
        result.acknowledged,
        result.ok,
    )
    for name in (
        "lost",
        "duplicated",
        "unexpected",
        "indeterminate",
        "clean_errors",
        "unclean_errors",
        "residency_violations",
    ):
        assert counts[name] == len(getattr(result, name)), name
    assert (counts["lost"], counts["duplicated"], counts["unclean_errors"], counts["clean_errors"]) == (
        2,
        1,
        1,
        1,
    )
    assert data["examples"]["lost"] == ["ghost", "hung"] and data["examples"]["duplicated"] == ["twice"]
    # A request that never ended has an infinite latency, kept distinct from "nothing measured".
    assert data["during_fault"]["max_latency_ms"] == "Infinity"
    assert data["verdict"]["passed"] is False
    assert [(c["name"], c["passed"]) for c in data["verdict"]["criteria"]] == [
        (c.name, c.passed) for c in report.verdict.criteria
    ]
    assert {c["name"] for c in data["verdict"]["criteria"] if not c["passed"]} == {
        "lost",
        "duplicated",
        "unclean_errors",
        "error_rate_during_fault",
    }
    assert data["invariants"] == {"no_healthy_node_flapped": True}
    assert sum(data["timeline"]["requests_per_s"][NO_REGION]) == 2  # the 502 and the hung request

    md = files.report_md.read_text(encoding="utf-8")
    assert md.splitlines()[0] == "# Drill `node-crash`: FAIL"
    for c in report.verdict.criteria:
        assert f"`{c.name}`" in md
    assert "| lost | 2 |" in md and "| duplicated | 1 |" in md and "| attempts | " in md
    assert "SIGKILL node-aws-us-east-1-2 (pid 1234)" in md and "`ghost`" in md
    assert "![timeline of node-crash](timeline.png)" in md

    assert files.timeline_png is not None
    png = files.timeline_png.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_a_passing_run_reads_pass_everywhere(drill: Drill, tmp_path: Path) -> None:
    report, _ = make_report(drill, healthy())
    files = write_report(report, healthy(), tmp_path)
    assert report.verdict.passed, report.verdict.failures()
    data = strict_json(files.report_json)
    assert data["passed"] is True and data["verdict"]["passed"] is True
    assert data["counts"]["clean_errors"] == 1 and data["recovery_s"] == 0.0
    assert files.report_md.read_text(encoding="utf-8").startswith("# Drill `node-crash`: PASS\n")
    rows = summary_rows(report)
    assert [r[0] for r in rows] == [c.name for c in report.verdict.criteria]
    assert {r[3] for r in rows} == {"PASS"}


def test_summary_rows_format_measured_values_and_bounds(drill: Drill) -> None:
    report, _ = make_report(drill, broken())
    rows = {r[0]: r[1:] for r in summary_rows(report)}
    assert rows["lost"] == ("2", "≤ 0", "FAIL")
    assert rows["steady_state_before_fault"] == ("100.00%", "≥ 99.00%", "PASS")
    measured, bound, verdict = rows["error_rate_during_fault"]
    assert measured.endswith("%") and bound == "≤ 0.00%" and verdict == "FAIL"
    assert rows["recovery_s"][1:] == ("≤ 5.00 s", "PASS")


def test_an_aborted_run_fails_even_when_every_criterion_passes(drill: Drill, tmp_path: Path) -> None:
    report, _ = make_report(
        drill,
        healthy(),
        aborted="error rate above 50% for 5 s at 14.0 s",
        not_checked=("leader lease not observed: control plane has one replica",),
    )
    files = write_report(report, healthy(), tmp_path)
    data = strict_json(files.report_json)
    assert data["verdict"]["passed"] is True and data["passed"] is False
    assert data["aborted"] == "error rate above 50% for 5 s at 14.0 s"
    assert data["not_checked"] == ["leader lease not observed: control plane has one replica"]
    md = files.report_md.read_text(encoding="utf-8")
    assert md.startswith("# Drill `node-crash`: FAIL") and "**Aborted:** error rate above 50%" in md
    assert "- leader lease not observed: control plane has one replica" in md
    assert summary_rows(report)[-1] == (
        "aborted",
        "error rate above 50% for 5 s at 14.0 s",
        "not aborted",
        "FAIL",
    )


def test_timeline_counts_requests_and_errors_per_region_per_bucket() -> None:
    h = History()
    us, eu = "aws:us-east-1", "gcp:europe-west4"
    h.client += [
        ClientOp("a", "t", "us", False, 0.1, None, 0.2, Outcome.OK, 200, region=us),
        ClientOp("b", "t", "us", False, 0.5, None, 0.7, Outcome.FAIL, 500, region=us),
        ClientOp("c", "t", "us", False, 0.9, None, 1.4, Outcome.OK, 200, region=us),
        ClientOp("d", "t", "us", False, 0.95, None, 30.95, Outcome.INDETERMINATE),  # timed out: no region
        ClientOp("e", "t", "eu", False, 2.0, None, 2.1, Outcome.OK, 200, region=eu),
        ClientOp("f", "t", "eu", False, 2.5),  # sent, end never recorded
        ClientOp("g", "t", "eu", False, 2.6),  # sent ...
        ClientOp("g", "t", "eu", False, 2.6, None, 2.7, Outcome.OK, 200, region=eu),  # ... and answered
    ]
    tl = timeline_series(h)
    assert tl.starts_s == (0.0, 1.0, 2.0)
    assert tl.regions == (us, eu, NO_REGION)  # sorted, requests without a region last
    # An unanswered request carries no x-meridian-region header, so it counts under "none".
    assert tl.requests_per_s == {us: (3, 0, 0), eu: (0, 0, 2), NO_REGION: (1, 0, 1)}
    assert tl.errors_per_s == {us: (1, 0, 0), eu: (0, 0, 0), NO_REGION: (1, 0, 1)}
    assert tl.p99_ms[0] == pytest.approx(500)  # nearest rank of [100, 500] ms
    assert tl.p99_ms[1] is None  # nothing invoked in [1, 2)

    half = timeline_series(h, bucket_s=0.5)
    assert half.starts_s == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5)
    assert half.requests_per_s[us] == (2.0, 4.0, 0, 0, 0, 0)  # counts per bucket / 0.5 s
    assert half.errors_per_s[NO_REGION] == (0, 2.0, 0, 0, 0, 2.0)
    assert timeline_series(History()).starts_s == ()


def test_timeline_p99_is_the_checkers_nearest_rank_over_ok_requests() -> None:
    h = History()
    ops = [
        ClientOp(
            f"o{i}",
            "t",
            "us",
            i % 3 == 0,
            5.0 + i / 1000,
            5.0 + i / 1000 + i / 2000,
            5.0 + i / 1000 + (i % 17) / 10,
            Outcome.OK,
            200,
            region="aws:us-east-1",
        )
        for i in range(150)
    ]
    # Failures are slower than everything and must not move the p99.
    ops += [ClientOp(f"x{i}", "t", "us", False, 5.5, None, 9.0, Outcome.FAIL, 503) for i in range(20)]
    h.client += ops
    tl = timeline_series(h)
    expected = percentile([x for o in ops if o.outcome is Outcome.OK if (x := latency_ms(o)) is not None], 99)
    assert expected is not None
    assert tl.p99_ms[5] == expected
    assert tl.p99_ms[5] < 3000  # the 3.5 s failures were left out
    assert tl.p99_ms[:5] == (None,) * 5


def test_writes_are_atomic_and_leave_no_temporary_files(
    drill: Drill, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, _ = make_report(drill, healthy())
    write_report(report, healthy(), tmp_path)
    write_suite_summary([report], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "report.json",
        "report.md",
        "summary.md",
        "timeline.png",
    ]
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {0o644}
    before = (tmp_path / "report.json").read_bytes()

    real_replace = os.replace

    def crash(src: str, dst: str) -> None:
        if str(dst).endswith("report.json"):
            raise OSError("disk went away")
        real_replace(src, dst)

    # A failure between writing the new report and renaming it must leave the old one whole.
    monkeypatch.setattr(os, "replace", crash)
    failing, _ = make_report(drill, broken())
    with pytest.raises(OSError, match="disk went away"):
        write_report(failing, broken(), tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "report.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "report.json",
        "report.md",
        "summary.md",
        "timeline.png",
    ]


def test_report_json_is_byte_for_byte_deterministic(
    drill: Drill, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_matplotlib(monkeypatch)  # the PNG plays no part in the JSON; skipping it keeps the test fast
    report, _ = make_report(drill, broken(), invariants={"z_last": False, "a_first": True})
    a = write_report(report, broken(), tmp_path / "a").report_json.read_bytes()
    b = write_report(report, broken(), tmp_path / "b").report_json.read_bytes()
    assert a == b
    assert list(json.loads(a)["invariants"]) == ["a_first", "z_last"]


def test_without_matplotlib_json_and_md_are_written_with_a_note(
    drill: Drill, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_matplotlib(monkeypatch)
    report, _ = make_report(drill, healthy())
    files = write_report(report, healthy(), tmp_path)
    assert files.timeline_png is None and not (tmp_path / "timeline.png").exists()
    assert strict_json(files.report_json)["not_checked"] == [NO_MATPLOTLIB]
    md = files.report_md.read_text(encoding="utf-8")
    assert NO_MATPLOTLIB in md and "timeline.png)" not in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_suite_summary_has_a_row_per_run_with_its_first_failure(drill: Drill, tmp_path: Path) -> None:
    passing, _ = make_report(drill, healthy())
    failing, _ = make_report(drill, broken())
    aborted, _ = make_report(drill, healthy(), aborted="error rate above 50% for 5 s")
    path = write_suite_summary([passing, failing, aborted], tmp_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# Chaos drills: 1 of 3 passed"
    rows = [line for line in lines if line.startswith("| node-crash")]
    assert len(rows) == 3
    assert rows[0] == "| node-crash | yes | PASS | 0 | 0 | 0.00 |  |"
    assert rows[1].startswith("| node-crash | yes | **FAIL** | 2 | 1 |") and rows[1].endswith("| lost (2) |")
    assert rows[2].endswith("| aborted: error rate above 50% for 5 s |")


def test_a_prefill_hop_is_not_a_second_answer(drill: Drill) -> None:
    # A P/D request: its prefill worker journals the hop, its decode worker the answer.
    h = healthy()
    key = h.client[0].key
    h.served.append(Served(key, "node-us-east-1-prefill-1", True, prefill=True))
    assert key not in check(h, drill, ZONES, fault_start_s=10.02, fault_end_s=18.01).duplicated
    h.served.append(Served(key, "node-us-east-1-decode-2", True))  # answered twice: duplicated
    assert key in check(h, drill, ZONES, fault_start_s=10.02, fault_end_s=18.01).duplicated
