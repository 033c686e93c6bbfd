"""The web console in headless Chromium against the three-region local fabric.

An operator opens the control plane's root and lands on /console, is refused with a clear
message for a wrong key, logs in with a read-only key, sees the three demo regions on the map and
their nodes (with no write control), sees traffic counted per region and the requests routers
report holding, and watches a node that is
killed (SIGKILL) turn lost and its region go down, without reloading the page. The control plane
expires nodes fast here (a 3 s TTL, no start-up grace) so the loss shows within seconds. Then an
operator is offered Apply for the newest of two previews only, applies it, sees it called in force
once the reconciler holds its hosts and the change in the event feed, and sees why when the
reconciler cannot follow (more replicas than the on-prem sites have hosts).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from console_kit import chromium, write_node_crash_report
from e2e_fabric import e2e_spec, running

from localfabric import DEMO_MODEL, DEMO_REGIONS, LocalFabric
from meridian.admin_api import ApiKeyCreate, DeploymentUpsert, ModelUpsert, PlanRequest, Scope
from meridian.admin_client import AdminClient
from meridian.contracts import PlacementSpec, PoolBacklog, RouterBacklog

pytestmark = pytest.mark.e2e

# Waits are for the page to show what the fabric did: generous for a loaded CI machine.
SHOW_MS = 30_000
KILLED = "gcp:europe-west4"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("drills")
    write_node_crash_report(base)
    return base


@pytest.fixture(scope="module")
def console_fabric(tmp_path_factory: pytest.TempPathFactory, reports: Path) -> Iterator[LocalFabric]:
    spec = e2e_spec(
        tmp_path_factory.mktemp("fabric"), heartbeat_interval_s=0.5, node_ttl_s=3.0,
        control_plane_env={"MERIDIAN_CP_REAPER_GRACE_S": "0", "MERIDIAN_CP_DRILL_REPORTS_DIR": str(reports)},
    )
    yield from running(spec)


def _key(fabric: LocalFabric, scope: Scope) -> str:
    assert fabric.info is not None
    with AdminClient(fabric.info.control_plane_url, fabric.info.admin_key, 10.0) as admin:
        return admin.create_key(ApiKeyCreate(name=f"console-{scope}", tenant="ops", zone="global", scopes=[scope],
                                             create_tenant=True)).key


def _deploy(fabric: LocalFabric, replicas: int) -> None:
    """The demo model deployed in two regions (the on-prem sites: only on-prem's driver runs here)."""
    assert fabric.info is not None
    with AdminClient(fabric.info.control_plane_url, fabric.info.admin_key, 30.0) as admin:
        admin.put_model(DEMO_MODEL, ModelUpsert(params_b=0.001, layers=2, kv_heads=2, head_dim=16, max_context=512))
        admin.put_deployment(DEMO_MODEL, DeploymentUpsert(min_replicas=replicas, max_replicas=replicas,
                                                          placement=PlacementSpec(min_regions=2)))


def _preview(fabric: LocalFabric) -> str:
    assert fabric.info is not None
    with AdminClient(fabric.info.control_plane_url, fabric.info.admin_key, 60.0) as admin:
        plan = admin.preview_plan(PlanRequest())
    assert plan.status == "preview", plan.explanation
    return plan.id


def _node_id(region: str) -> str:
    return "node-" + region.replace(":", "-")


def _send_traffic(fabric: LocalFabric, requests: int) -> None:
    assert fabric.info is not None
    with httpx.Client(timeout=60) as http:
        for _ in range(requests):
            r = http.post(f"{fabric.info.router_url}/v1/chat/completions",
                          headers={"authorization": f"Bearer {fabric.info.keys['global']}"},
                          json={"model": DEMO_MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "Hello"}]})
            assert r.status_code == 200, r.text


def _report_backlog(fabric: LocalFabric, pools: list[PoolBacklog]) -> None:
    """PUT a backlog report as a router does (playwright's sync API owns this thread's loop)."""
    assert fabric.info is not None
    r = httpx.put(f"{fabric.info.control_plane_url}/v1/routers/console-test:1:1/backlog", timeout=10,
                  content=RouterBacklog(pools=pools).model_dump_json(),
                  headers={"authorization": f"Bearer {fabric.info.cluster_token}", "content-type": "application/json"})
    assert r.status_code == 204, r.text


def test_console_shows_the_fleet_to_a_read_only_key_and_a_killed_node_going_lost(
    console_fabric: LocalFabric, tmp_path: Path
) -> None:
    fabric = console_fabric
    assert fabric.info is not None
    viewer_key = _key(fabric, Scope.READ_ONLY)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        policy_violations: list[str] = []
        page.on("console", lambda m: policy_violations.append(m.text)
                if m.type == "error" and "Content Security Policy" in m.text else None)
        page.goto(f"{fabric.info.control_plane_url}/")
        assert page.url == f"{fabric.info.control_plane_url}/console"
        page.goto(f"{fabric.info.control_plane_url}/console?poll_ms=1000")

        # A wrong key is refused in words, and the console stays closed.
        page.fill("#api-key", "mrd_not-a-real-key")
        page.click("#login-button")
        error = page.locator("#login-error")
        error.wait_for(state="visible", timeout=SHOW_MS)
        assert "refused" in error.inner_text() and "revoked" in error.inner_text()
        assert page.locator("#console").is_hidden()

        page.fill("#api-key", viewer_key)
        page.click("#login-button")
        for region in DEMO_REGIONS:
            page.wait_for_selector(f'#map g.region[data-region="{region}"][data-health="ok"]', timeout=SHOW_MS)
            page.wait_for_selector(f'#nodes tr[data-node="{_node_id(region)}"][data-status="ready"]', timeout=SHOW_MS)
        assert "read-only" in page.inner_text("#viewer")
        assert page.inner_text("#routing-version").startswith("routing v")
        # Read-only: every panel, no control that writes.
        page.wait_for_selector("#plan-current h3", timeout=SHOW_MS)
        assert page.locator("button.write").count() == 0
        page.wait_for_selector('#drill-detail [data-drill="node-crash"] svg.timeline', timeout=SHOW_MS)

        # Requests through the router show up as a request rate of their region.
        _send_traffic(fabric, 6)
        page.wait_for_function(
            "() => Number(document.querySelector('#regions tr[data-region=\"aws:us-east-1\"] td[data-rate]')"
            "?.dataset.rate || 0) > 0", timeout=SHOW_MS)

        # What a router's flow control holds shows beside the regions (a report as routers send
        # it), and goes when the router says nothing waits.
        assert page.inner_text("#held tbody") == "Nothing waits at the routers."
        _report_backlog(fabric, [PoolBacklog(zone="eu", model=DEMO_MODEL, waiting=7)])
        page.wait_for_selector('#held tr[data-zone="eu"]', timeout=SHOW_MS)
        assert page.locator('#held tr[data-zone="eu"] td').all_inner_texts() == ["eu", DEMO_MODEL, "7", "1"]
        _report_backlog(fabric, [])
        page.wait_for_selector('#held tr[data-zone="eu"]', state="detached", timeout=SHOW_MS)

        fabric.kill_node(KILLED, signal.SIGKILL)
        page.wait_for_selector(f'#nodes tr[data-node="{_node_id(KILLED)}"][data-status="lost"]', timeout=SHOW_MS)
        page.wait_for_selector(f'#map g.region[data-region="{KILLED}"][data-health="down"]', timeout=SHOW_MS)
        # The others are untouched.
        for region in DEMO_REGIONS:
            if region != KILLED:
                assert page.get_attribute(f'#map g.region[data-region="{region}"]', "data-health") == "ok"
        assert page.inner_text("#updated").startswith("updated")
        page.screenshot(path=str(tmp_path / "console.png"), full_page=True)
        assert not policy_violations, policy_violations

        # An operator key gets the plan controls the read-only key did not.
        page.click("#logout")
        page.fill("#api-key", _key(fabric, Scope.OPERATOR))
        page.click("#login-button")
        page.wait_for_selector("#plan-preview-button", timeout=SHOW_MS)
        assert "operator" in page.inner_text("#viewer")

        # Two previews: Apply is offered for the newest alone.
        _deploy(fabric, replicas=2)
        _preview(fabric)
        newest = _preview(fabric)
        page.wait_for_selector(f'#plan-apply-button[data-plan="{newest}"]', timeout=SHOW_MS)
        assert page.locator("#plan-apply-button").count() == 1
        # Applied, it is in force once the reconciler holds its hosts; nothing is left to apply.
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#plan-apply-button")
        page.wait_for_selector('#plan-state[data-state="in_force"]', timeout=SHOW_MS)
        assert page.locator("#plan-apply-button").count() == 0
        page.wait_for_selector('#events tr[data-action="apply"][data-resource="placement_plan"]', timeout=SHOW_MS)
        page.wait_for_selector('#events tr[data-action="scale_up"][data-resource="node_group"]', timeout=SHOW_MS)

        # More replicas than the sites have hosts: no longer in force, and the console says why.
        _deploy(fabric, replicas=100)
        state = page.wait_for_selector('#plan-state[data-state="failing"]', timeout=SHOW_MS)
        assert state is not None and "CapacityError" in state.inner_text()
        page.wait_for_selector("#events tr.event-error", timeout=SHOW_MS)
        page.screenshot(path=str(tmp_path / "console-operator.png"), full_page=True)
        assert not policy_violations, policy_violations
