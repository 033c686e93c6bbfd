"""Draw docs/console.png: the web console over a demo fabric with every panel in use.

    PYTHONPATH=$PWD:tests/e2e python tests/e2e/console_screenshot.py docs/console.png [--reports DIR]

The demo's three regions serve steady traffic from tenants of every zone; the model has a
deployment, so the autoscaler decides; a plan is applied and a wider one previewed, so the
placement panel has a plan in force and a diff; drill reports come from DIR (`meridian chaos
run … --out DIR`), or one is written from a recorded history when no DIR is given.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
from pathlib import Path

import httpx
from console_kit import chromium, write_node_crash_report

from localfabric import DEMO_MODEL, DEMO_REGIONS, FabricSpec, LocalFabric
from meridian.admin_api import ApiKeyCreate, DeploymentUpsert, ModelUpsert, PlanRequest, Scope
from meridian.admin_client import AdminClient
from meridian.contracts import PlacementSpec

TINY = ModelUpsert(params_b=0.001, layers=2, kv_heads=2, head_dim=16, max_context=512)


def _traffic(fabric: LocalFabric, stop: threading.Event) -> None:
    assert fabric.info is not None
    keys = itertools.cycle(["us", "eu", "apac", "global", "eu", "apac"])
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            http.post(f"{fabric.info.router_url}/v1/chat/completions",
                      headers={"authorization": f"Bearer {fabric.info.keys[next(keys)]}"},
                      json={"model": DEMO_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
            stop.wait(0.1)


def _plans(fabric: LocalFabric) -> None:
    assert fabric.info is not None
    info = fabric.info
    httpx.put(f"{info.control_plane_url}/v1/models/{DEMO_MODEL}", json=TINY.model_dump(mode="json"),
              headers={"authorization": f"Bearer {info.admin_key}"}, timeout=30).raise_for_status()
    with AdminClient(info.control_plane_url, info.admin_key, 60.0) as admin:
        # The demo runs on-prem's driver alone, so plans are on its two sites.
        admin.put_deployment(DEMO_MODEL, DeploymentUpsert(min_replicas=2, max_replicas=3,
                                                          placement=PlacementSpec(min_regions=2)))
        admin.apply_plan(admin.preview_plan(PlanRequest()).id)
        admin.put_deployment(DEMO_MODEL, DeploymentUpsert(min_replicas=2, max_replicas=3, placement=PlacementSpec(
            min_regions=2, replicas={"onprem:tokyo-1": 8, "onprem:fra-dc1": 1})))
        admin.preview_plan(PlanRequest())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--reports", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reports = args.reports or Path(tmp) / "drills"
        if args.reports is None:
            write_node_crash_report(reports)
        fabric = LocalFabric(FabricSpec(
            work_dir=Path(tmp) / "fabric",
            control_plane_env={"MERIDIAN_CP_DRILL_REPORTS_DIR": str(reports.resolve())}))
        with fabric as info:
            stop = threading.Event()
            traffic = threading.Thread(target=_traffic, args=(fabric, stop), daemon=True)
            traffic.start()
            try:
                _plans(fabric)
                with AdminClient(info.control_plane_url, info.admin_key, 10.0) as admin:
                    key = admin.create_key(ApiKeyCreate(name="ops-console", tenant="ops", zone="global",
                                                        scopes=[Scope.OPERATOR], create_tenant=True)).key
                _shoot(info.control_plane_url, key, args.out)
            finally:
                stop.set()
                traffic.join(timeout=60)


def _shoot(url: str, key: str, out: Path) -> None:
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
        page.goto(f"{url}/console?poll_ms=2000")
        page.fill("#api-key", key)
        page.click("#login-button")
        for region in DEMO_REGIONS:
            page.wait_for_function(
                f"() => Number(document.querySelector('#regions tr[data-region=\"{region}\"] td[data-rate]')"
                "?.dataset.rate || 0) > 0", timeout=120_000)
        page.wait_for_selector("#decisions tr[data-decision]", timeout=120_000)
        page.wait_for_selector("#plan-diff tr[data-diff]", timeout=60_000)
        page.wait_for_selector('#plan-state[data-state="in_force"]', timeout=60_000)
        page.wait_for_selector("#events tr[data-event]", timeout=60_000)
        page.wait_for_selector("#drill-detail svg.timeline", timeout=60_000)
        time.sleep(20)  # a sparkline's worth of polls
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)


if __name__ == "__main__":
    main()
