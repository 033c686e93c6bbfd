"""The backlog report's shape: the pools with the most waiting first, never more than the
control plane takes, and a router's default name the control plane accepts. (The reporter
against a real control plane: tests/unit/control_plane/test_cp_router_backlog.py.)"""

from __future__ import annotations

import re

from pydantic import SecretStr

from geo_router.admission.flow_report import backlog_report, default_router_id
from meridian.contracts import MAX_BACKLOG_POOLS, ROUTER_ID_PATTERN, RouterBacklog
from meridian.settings.router import RouterSettings


def test_a_report_names_the_biggest_pools_first_within_the_bound() -> None:
    held = {("eu", f"m{i}"): i + 1 for i in range(MAX_BACKLOG_POOLS + 5)}
    report = backlog_report(held)
    assert len(report.pools) == MAX_BACKLOG_POOLS
    waiting = [p.waiting for p in report.pools]
    assert waiting == sorted(waiting, reverse=True) and waiting[0] == MAX_BACKLOG_POOLS + 5
    assert min(waiting) == 6  # the five smallest are left out
    RouterBacklog.model_validate_json(report.model_dump_json())  # what the control plane parses
    assert backlog_report({}).pools == []


def test_a_router_is_named_by_its_setting_else_host_port_and_process() -> None:
    named = RouterSettings(cluster_token=SecretStr("t"), router_id="edge-eu-1")
    assert default_router_id(named) == "edge-eu-1"
    default = default_router_id(RouterSettings(cluster_token=SecretStr("t"), port=8443))
    assert re.match(ROUTER_ID_PATTERN, default), default
    assert re.search(r":8443:\d+$", default)
