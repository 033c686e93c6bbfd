"""The short chaos suite: every drill the local runner can run, against a real local fabric,
judged by the checker from the joined client, router and node histories.

Each drill's short form runs at most 60 s of load (plus the fabric's start and stop).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from chaos.drill import Drill, load_drills
from chaos.runner import RunOptions, RunOutcome, run_drill, runnable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

DRILLS = load_drills()


def _explain(outcome: RunOutcome) -> str:
    report = outcome.report
    lines = [f"{c.name}: measured {c.measured} bound {c.bound} {c.detail}" for c in report.verdict.failures()]
    if report.aborted:
        lines.append(f"aborted: {report.aborted}")
    lines += [f"{e.at_s:7.2f}s {e.action}: {e.detail}" for e in report.events]
    return f"{report.drill.name} failed (report {outcome.files.report_md}):\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint and its origin, made by the first drill and copied by the rest."""
    return tmp_path_factory.mktemp("chaos") / "model-cache"


def _run(drill: Drill, tmp_path: Path, model_cache: Path, **options: Any) -> RunOutcome:
    return run_drill(drill, RunOptions(out_dir=tmp_path / drill.name, short=True, model_cache_dir=model_cache,
                                       **options))


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_short_drill_passes(drill: Drill, tmp_path: Path, model_cache: Path, request: pytest.FixtureRequest) -> None:
    why = runnable(drill)
    if why is not None:
        # What this machine lacks (root for a mount, nftables); in CI every drill must run.
        if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{drill.name} cannot run: {why} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(why)
    # Drills whose routers share state need the test Redis (and fail, never skip, in CI).
    options = {"redis_url": request.getfixturevalue("redis_url")} if drill.topology.redis else {}
    outcome = _run(drill, tmp_path, model_cache, **options)
    assert outcome.passed, _explain(outcome)
    # The run leaves a report a person can read and a machine can parse.
    report = json.loads(outcome.files.report_json.read_text())
    assert report["passed"] is True
    assert outcome.report.result.attempts >= drill.short_version().load.arrivals_per_s * 10
    assert outcome.files.timeline_png is not None and outcome.files.timeline_png.stat().st_size > 10_000


def test_gray_failure_fails_with_outlier_detection_and_health_checks_disabled(tmp_path: Path,
                                                                              model_cache: Path) -> None:
    """A deliberately broken build: the router neither probes nodes nor ejects one after
    failures, so the hung node keeps its share of requests and the drill must say so.

    Not a crash with retries off: when a node dies, the router's KV-event subscriber sees its
    socket close and routes new requests elsewhere before any fails, so only a request in
    flight at that instant (often none) shows the missing retry. A stopped process keeps its
    sockets open; nothing but outlier detection takes it out.
    """
    drill = next(d for d in DRILLS if d.name == "gray-failure")
    outcome = _run(drill, tmp_path, model_cache, router_env={
        "MERIDIAN_ROUTER_PROBE_ENABLED": "false", "MERIDIAN_ROUTER_CONSECUTIVE_FAILURES_TO_EJECT": "1000000",
    })
    assert not outcome.passed
    failed = {c.name for c in outcome.report.verdict.failures()}
    assert "invariant:outlier_ejected" in failed, failed


def test_mid_stream_crash_fails_with_stream_migration_disabled(tmp_path: Path, model_cache: Path) -> None:
    """A deliberately broken build: the router does not resume streams, so the streams on
    the killed nodes end with error events and the drill must say so, by its stream criteria."""
    drill = next(d for d in DRILLS if d.name == "mid-stream-crash")
    outcome = _run(drill, tmp_path, model_cache, router_env={"MERIDIAN_ROUTER_MIGRATION_ENABLED": "false"})
    assert not outcome.passed
    failed = {c.name for c in outcome.report.verdict.failures()}
    assert {"broken_streams", "migrated_streams"} <= failed, failed
    streams = outcome.report.result.streams
    assert streams is not None and streams.token_mismatches == () and streams.residency_violations == ()
