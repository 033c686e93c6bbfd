"""The control plane's /metrics scraped from a real control plane (migrated database,
lifespan, leader election, reconciler and autoscaler loops) after real API calls."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from cp_harness import ControlPlane
from prometheus_client.parser import text_string_to_metric_families
from test_reconciler import INVENTORY, MODEL, apply_plan, deploy

TYPES = {
    "meridian_cp_reconciler_steps": "counter",
    "meridian_cp_reconciler_passes": "counter",
    "meridian_cp_autoscaler_decisions": "counter",
    "meridian_cp_leader": "gauge",
    "meridian_cp_plan_in_force_info": "gauge",
    "meridian_cp_routing_table_version": "gauge",
    "meridian_cp_nodes": "gauge",
}


@pytest.fixture
def settings_overrides(tmp_path: Path) -> dict[str, Any]:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    # The fleet loops run on the real clock, briskly.
    return {
        "onprem_inventory": inventory,
        "leader_check_interval_s": 0.05,
        "reconcile_interval_s": 0.05,
        "autoscale_interval_s": 0.05,
        "metrics_token": "scrape-token",
    }


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


async def scrape(cp: ControlPlane, headers: dict[str, str] | None = None) -> str:
    r = await cp.http.get("/metrics", headers=headers or cp.internal)
    assert r.status_code == 200, r.text
    return r.text


async def scrape_until(cp: ControlPlane, check: Any, timeout_s: float = 15.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = await scrape(cp)
        if check(text):
            return text
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.05)


async def test_fleet_loops_and_fleet_state_show_in_metrics(cp: ControlPlane):
    # Leadership is taken within a check or two.
    await scrape_until(cp, lambda t: sample(t, "meridian_cp_leader") == 1)
    assert (await cp.register("us-1", models=[MODEL])).status_code in (200, 201)
    assert (await cp.register("us-2", models=[MODEL])).status_code in (200, 201)
    assert (await cp.heartbeat("us-1")).status_code == 200
    await deploy(cp, replicas=1)
    plan_id = apply_plan(cp)
    text = await scrape_until(cp, lambda t: sample(
        t, "meridian_cp_reconciler_steps_total", action="create", outcome="ok") >= 1 and sample(
        t, "meridian_cp_autoscaler_decisions_total", deployment=MODEL, direction="hold") >= 1)
    assert sample(text, "meridian_cp_reconciler_passes_total", result="ok") >= 1
    assert sample(text, "meridian_cp_reconciler_passes_total", result="error") == 0
    assert sample(text, "meridian_cp_plan_in_force_info", plan_id=plan_id) == 1
    assert sample(text, "meridian_cp_nodes", region="aws:us-east-1", status="ready") == 1
    assert sample(text, "meridian_cp_nodes", region="aws:us-east-1", status="starting") == 1
    version = sample(text, "meridian_cp_routing_table_version")
    assert version == await cp.version()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: families.get(name) for name in TYPES} == TYPES
    # The loops go on passing: the pass counter only grows.
    passes = sample(text, "meridian_cp_reconciler_passes_total", result="ok")
    await scrape_until(cp, lambda t: sample(t, "meridian_cp_reconciler_passes_total", result="ok") > passes)


async def test_metrics_answer_scrape_tokens_and_fleet_readers_only(cp: ControlPlane):
    r = await cp.create_key(name="viewer", scopes=["read-only"], zone="global")
    assert r.status_code == 201, r.text
    viewer = r.json()["key"]
    r = await cp.create_key(name="app", scopes=["inference"], zone="global")
    tenant_key = r.json()["key"]
    for token in ("scrape-token", "test-cluster-token", viewer):
        await scrape(cp, {"authorization": f"Bearer {token}"})
    cp.assert_problem(await cp.http.get("/metrics"), 401)
    cp.assert_problem(await cp.http.get("/metrics", headers={"authorization": "Bearer nope"}), 401)
    # A tenant's inference key reads nothing of the fleet.
    cp.assert_problem(await cp.http.get("/metrics", headers={"authorization": f"Bearer {tenant_key}"}), 403)
    spec = (await cp.http.get("/openapi.json")).json()
    assert "/metrics" not in spec["paths"]
