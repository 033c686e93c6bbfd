"""The admin API's /docs page in headless Chromium, served by a real control plane process.

An operator (or an air-gapped site) opens /docs: Swagger UI renders the operations grouped by
tag, every request the page makes goes to the control plane itself (no CDN, no validator
badge), and the page's own Content-Security-Policy blocks nothing Swagger UI needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from console_kit import chromium
from cp_harness import spawn_control_plane, stop_process, wait_until_up

from meridian.ports import free_port

pytestmark = pytest.mark.e2e

SHOW_MS = 30_000


@pytest.fixture(scope="module")
def control_plane_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    database = tmp_path_factory.mktemp("cp") / "cp.db"
    proc = spawn_control_plane(port, f"sqlite:///{Path(database)}")
    try:
        wait_until_up(proc, port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_docs_render_the_tagged_operations_without_another_origin(control_plane_url: str) -> None:
    origin = urlsplit(control_plane_url).netloc
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        requested: list[str] = []
        page.on("request", lambda r: requested.append(r.url))
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{control_plane_url}/docs")
        page.wait_for_selector(".opblock-tag-section", timeout=SHOW_MS)
        tags = page.locator(".opblock-tag-section .opblock-tag").all_inner_texts()
        assert {"nodes", "tenants", "keys", "placement", "health"} <= {t.split("\n")[0].strip() for t in tags}, tags
        assert page.locator(".opblock").count() >= 50
        # Open one operation: its 422 is documented as a problem, not FastAPI's HTTPValidationError.
        page.locator("#operations-tenants-create_tenant_v1_tenants_post").click()
        responses = page.locator("#operations-tenants-create_tenant_v1_tenants_post .responses-table")
        responses.first.wait_for(timeout=SHOW_MS)
        text = responses.first.inner_text()
        assert "application/problem+json" in text and "HTTPValidationError" not in text
        page.wait_for_load_state("networkidle", timeout=SHOW_MS)
    foreign = [u for u in requested if urlsplit(u).scheme in ("http", "https") and urlsplit(u).netloc != origin]
    assert foreign == [], foreign
    assert any(u.endswith("/docs/static/swagger-ui-bundle.js") for u in requested)
    assert any(u.endswith("/openapi.json") for u in requested)
    assert problems == [], problems
