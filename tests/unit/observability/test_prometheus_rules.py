"""The shipped Prometheus rules are valid (`promtool check rules`) and do what their unit
tests say (`promtool test rules`): each alert fires on the series it is about and stays
quiet on healthy ones; each links its runbook, a section of docs/runbooks.md. promtool: see
conftest.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[3]
RULES_DIR = ROOT / "observability" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"


def _run(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules_accepts_the_rules(promtool: str) -> None:
    result = _run(promtool, "check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_example_prometheus_config_is_valid(promtool: str) -> None:
    result = _run(promtool, "check", "config", "--syntax-only", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((RULES_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    assert {job["job_name"] for job in config["scrape_configs"]} == {
        "meridian-router", "meridian-control-plane", "meridian-node"}


def test_promtool_unit_tests_of_the_rules_pass(promtool: str) -> None:
    result = _run(promtool, "test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules_fails_when_an_alert_does_not_fire(promtool: str, tmp_path: Path) -> None:
    # The unit tests can fail: with the staleness threshold raised out of reach, the case
    # that expects the alert fails.
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(
        "(meridian_router_routing_table_age_seconds) > 120", "(meridian_router_routing_table_age_seconds) > 1200"))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "MeridianRoutingTableStale" in result.stdout + result.stderr


def _alert_names() -> set[str]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def test_every_alert_is_tested_firing_and_quiet() -> None:
    cases: list[dict[str, Any]] = [
        case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    alerts = _alert_names()
    assert len(alerts) >= 10
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"


def _anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_links_its_own_runbook_section() -> None:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}
    anchors = _anchors(RUNBOOKS.read_text())
    for name, rule in alerts.items():
        assert rule["annotations"].get("runbook_url") == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbooks.md has no section {name}"
    # And no section is left over from an alert that is gone.
    assert anchors - {"runbooks"} == {name.lower() for name in alerts}
