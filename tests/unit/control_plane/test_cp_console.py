"""The web console as the control plane serves it: a public shell under a strict policy, the
overview a read-only key polls, and drill reports read from a directory no URL can leave."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from admin_harness import bearer, scoped_key
from cp_harness import ControlPlane

from control_plane.console import FILES

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    base = tmp_path / "reports"
    for name, started, passed in (("01-node-crash", "2026-11-26T10:00:00Z", True),
                                  ("03-region-outage", "2026-11-26T11:00:00Z", False)):
        (base / name).mkdir(parents=True)
        (base / name / "report.json").write_text(json.dumps({
            "drill": name, "started_at": started, "passed": passed, "duration_s": 42.5,
            "fault": {"kind": "kill-node", "start_s": 10, "end_s": 20}, "recovery_s": 3.2,
            "timeline": {"bucket_s": 1, "starts_s": [0, 1], "requests_per_s": {"aws:us-east-1": [5, 6]}},
        }))
    (base / "01-node-crash" / "timeline.png").write_bytes(PNG)
    (base / "not-a-report").mkdir()
    (base / "broken").mkdir()
    (base / "broken" / "report.json").write_text("{not json")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "report.json").write_text(json.dumps({"drill": "secret"}))
    (secret / "timeline.png").write_bytes(PNG)
    (base / "escape").symlink_to(secret, target_is_directory=True)
    return base


@pytest.fixture
def settings_overrides(reports: Path) -> dict[str, Any]:
    return {"drill_reports_dir": reports}


async def test_shell_is_public_self_contained_and_under_a_strict_policy(cp: ControlPlane) -> None:
    page = await cp.http.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # Every asset the page names is served, from this origin, with the same headers.
    assets = re.findall(r'(?:src|href)="(/console/static/[^"]+)"', page.text)
    assert {"/console/static/app.js", "/console/static/style.css"} <= set(assets)
    for name, (content, _) in FILES.items():
        r = await cp.http.get(f"/console/static/{name}")
        assert r.status_code == 200 and r.content == content
        assert r.headers["content-security-policy"] == csp
        # No CDN, font service or other origin anywhere in the shell.
        assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", content), name
    for path in ("/console/static/../__init__.py", "/console/static/__init__.py", "/console/static/nope.js",
                 "/console/static/make_world_map.py"):
        r = await cp.http.get(path)
        assert r.status_code == 404, path


async def test_the_control_planes_root_opens_the_console(cp: ControlPlane) -> None:
    r = await cp.http.get("/")
    assert r.status_code == 307 and r.headers["location"] == "/console"
    r = await cp.http.get("/", follow_redirects=True)
    assert r.status_code == 200 and r.content == FILES["index.html"][0]


async def test_overview_shows_a_read_only_key_the_fleet_and_its_own_scopes(cp: ControlPlane) -> None:
    assert (await cp.register("node-a", "aws:us-east-1")).status_code == 200
    assert (await cp.register("node-b", "gcp:europe-west4")).status_code == 200
    load = {"running": 2, "waiting": 1, "kv_cache_usage": 0.5, "requests_completed": 40, "latency_s_sum": 12.5}
    assert (await cp.heartbeat("node-a", load=load)).status_code == 200
    # A node that predates the request counters sends none: still accepted, shown without.
    assert (await cp.heartbeat("node-b", load={"running": 0})).status_code == 200
    headers, _ = await scoped_key(cp, "read-only", name="viewer")

    r = await cp.http.get("/v1/console/overview", headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["viewer"] == {"name": "viewer", "tenant": "ops", "scopes": ["read-only"]}
    assert body["routing_version"] == await cp.version()
    assert body["heartbeat_interval_s"] == cp.settings.heartbeat_interval_s
    assert {"aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1"} <= {g["name"] for g in body["regions"]}
    nodes = {n["node_id"]: n for n in body["nodes"]}
    assert nodes["node-a"]["load"] == {**load, "lora_adapters": []}
    assert "requests_completed" not in nodes["node-b"]["load"]


async def test_overview_refuses_missing_inference_and_unknown_keys(cp: ControlPlane) -> None:
    cp.assert_problem(await cp.http.get("/v1/console/overview"), 401)
    cp.assert_problem(await cp.http.get("/v1/console/overview", headers=bearer("mrd_nope")), 401)
    headers, _ = await scoped_key(cp, "inference")
    cp.assert_problem(await cp.http.get("/v1/console/overview", headers=headers), 403)


async def test_drill_reports_are_listed_newest_first_and_served(cp: ControlPlane) -> None:
    headers, _ = await scoped_key(cp, "read-only")
    r = await cp.http.get("/v1/console/drills", headers=headers)
    assert r.status_code == 200, r.text
    listed = r.json()
    # The symbolic link out of the directory, the empty and the broken directories are not reports.
    assert [d["name"] for d in listed] == ["03-region-outage", "01-node-crash"]
    assert listed[1] == {"name": "01-node-crash", "drill": "01-node-crash", "started_at": "2026-11-26T10:00:00Z",
                         "duration_s": 42.5, "passed": True, "fault": "kill-node", "recovery_s": 3.2,
                         "timeline_png": True}

    report = await cp.http.get("/v1/console/drills/01-node-crash/report.json", headers=headers)
    assert report.status_code == 200 and report.json()["timeline"]["requests_per_s"] == {"aws:us-east-1": [5, 6]}
    png = await cp.http.get("/v1/console/drills/01-node-crash/timeline.png", headers=headers)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png" and png.content == PNG
    cp.assert_problem(await cp.http.get("/v1/console/drills/03-region-outage/timeline.png", headers=headers), 404)


@pytest.mark.parametrize("name", [
    "escape", "..", "%2e%2e", "..%2Fsecret", "%2E%2E%2Fsecret", "%2Fetc", ".hidden", "broken", "not-a-report",
    "a%00b",
])
async def test_no_report_name_reads_outside_the_reports_directory(cp: ControlPlane, name: str) -> None:
    headers, _ = await scoped_key(cp, "read-only")
    for leaf in ("report.json", "timeline.png"):
        r = await cp.http.get(f"/v1/console/drills/{name}/{leaf}", headers=headers)
        assert r.status_code in (404, 422), (name, leaf, r.status_code)
        assert b"secret" not in r.content and PNG not in r.content


async def test_without_a_reports_directory_the_list_is_empty(cp: ControlPlane) -> None:
    cp.settings.drill_reports_dir = None
    headers, _ = await scoped_key(cp, "read-only")
    r = await cp.http.get("/v1/console/drills", headers=headers)
    assert r.status_code == 200 and r.json() == []
    cp.assert_problem(await cp.http.get("/v1/console/drills/01-node-crash/report.json", headers=headers), 404)
