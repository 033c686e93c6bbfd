"""Headless Chromium for the web console's tests (Debian's `chromium`, driven by Playwright;
no browser download), and a drill report written by chaos's own report writer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM_NAMES = ("chromium", "chromium-browser")


def _unavailable(message: str) -> NoReturn:
    if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(message)


def chromium_path() -> str:
    """Debian's chromium (`apt-get install chromium`); a failure in CI, a skip elsewhere."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    _unavailable("chromium is not installed (apt-get install chromium)")


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium, closed on exit."""
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


def write_node_crash_report(out_dir: Path) -> Path:
    """A node-crash drill report (report.json, report.md, timeline.png) as chaos writes it,
    from a recorded history of 30 s of traffic whose us-east node is killed at 10 s and whose
    traffic fails over to its sibling; returns the report's directory."""
    from chaos.checker import check
    from chaos.drill import DRILLS_DIR, load_drill
    from chaos.history import ClientOp, History, Outcome, Routed, Served
    from chaos.report import FaultEvent, RunReport, write_report

    drill = load_drill(DRILLS_DIR / "01-node-crash.yaml").short_version()
    zones = {"aws:us-east-1": ["us"], "gcp:europe-west4": ["eu"], "onprem:tokyo-1": ["apac"]}
    history = History()
    for i in range(120):
        t = i / 4
        region = "gcp:europe-west4" if 10 <= t < 18 and i % 3 else "aws:us-east-1"
        node = "node-gcp-europe-west4" if region.startswith("gcp") else "node-aws-us-east-1"
        key = f"k{i:03d}"
        history.client.append(ClientOp(key, "demo-global", "global", False, t, None, t + 0.12 + (0.2 if 10 <= t < 12 else 0),
                                       Outcome.OK, 200, region=region, node=node))
        history.routed.append(Routed(key, node, region, 1))
        history.served.append(Served(key, node, True))
    events = (FaultEvent(10.0, "inject", "SIGKILL node-aws-us-east-1"), FaultEvent(18.0, "heal", "restart node-aws-us-east-1"))
    result = check(history, drill, zones, fault_start_s=10.0, fault_end_s=18.0)
    invariants = {"no_healthy_node_flapped": True}
    report = RunReport(
        drill=drill, short=True, started_at=datetime.now(UTC), duration_s=30.0, fault_start_s=10.0, fault_end_s=18.0,
        events=events, result=result, verdict=result.verdict(drill, invariants), invariants=invariants,
    )
    out = out_dir / drill.name
    write_report(report, history, out)
    return out
