"""The admin API's documentation: /docs works offline, and the OpenAPI document tells the truth.

The /docs page and its Swagger UI assets come from the control plane itself (no CDN) under a
policy of their own; every operation is tagged; every error is documented as the problem+json
body the API really sends, which a real bad request's body is checked against.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from cp_harness import ADMIN_KEY, ControlPlane

from control_plane.apidocs import FILES, STATIC_DIR
from meridian.admin_api import PROBLEM_MEDIA_TYPE

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """The documentation does not depend on the database: SQLite only."""
    return f"sqlite:///{tmp_path / 'control-plane.db'}"


@pytest.fixture
async def spec(cp: ControlPlane) -> dict[str, Any]:
    r = await cp.http.get("/openapi.json")
    assert r.status_code == 200
    document: dict[str, Any] = r.json()
    return document


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()]


def _validate_problem(spec: dict[str, Any], response: httpx.Response, status: int) -> dict[str, Any]:
    """The response is a problem+json body valid against the document's Problem schema."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body: dict[str, Any] = response.json()
    jsonschema.Draft202012Validator({**PROBLEM_REF, "components": spec["components"]}).validate(body)
    return body


async def test_docs_page_loads_swagger_ui_from_this_origin_only(cp: ControlPlane) -> None:
    page = await cp.http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = re.findall(r'(?:src|href|url)\s*[=:]\s*["\']([^"\']+)["\']', page.text)
    assert {"/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css", "/openapi.json"} <= set(urls)
    assert all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    assert "cdn" not in page.text and "http" not in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    # ReDoc (another CDN page) is off, and so is FastAPI's OAuth2 redirect page.
    for path in ("/redoc", "/docs/oauth2-redirect"):
        assert (await cp.http.get(path)).status_code == 404, path


async def test_swagger_ui_assets_are_served_with_their_types_and_revalidated(cp: ControlPlane) -> None:
    assert set(ASSETS) <= set(FILES)
    for name, media_type in ASSETS.items():
        r = await cp.http.get(f"/docs/static/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"].startswith(media_type), name
        assert r.content == (STATIC_DIR / name).read_bytes()
        assert r.headers["x-content-type-options"] == "nosniff"
        again = await cp.http.get(f"/docs/static/{name}", headers={"if-none-match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
    assert b"SwaggerUIBundle" in (await cp.http.get("/docs/static/swagger-ui-bundle.js")).content
    # The licence and README ship beside the assets but are not served; nothing else is either.
    for name in ("README.md", "LICENSE", "..%2F__init__.py", "nope.js"):
        cp.assert_problem(await cp.http.get(f"/docs/static/{name}"), 404)


async def test_every_operation_is_tagged_with_a_described_tag(spec: dict[str, Any]) -> None:
    described = {tag["name"]: tag["description"] for tag in spec["tags"]}
    assert all(described.values())
    operations = _operations(spec)
    assert len(operations) >= 50
    used = set()
    for path, method, op in operations:
        assert len(op.get("tags", [])) == 1, (method, path)
        assert op["tags"][0] in described, (method, path, op["tags"])
        used.add(op["tags"][0])
    assert used == set(described), "a declared tag has no operation"
    by_path = {(m, p): op["tags"][0] for p, m, op in operations}
    assert by_path[("post", "/v1/nodes/register")] == "nodes"
    assert by_path[("get", "/v1/api-keys")] == "keys"
    assert by_path[("get", "/health")] == "health"


async def test_errors_are_documented_as_problem_json_only(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert set(schemas["Problem"]["required"]) == {"title", "status"}
    assert schemas["FieldError"]["required"] == ["loc", "msg", "type"]
    for path, method, op in _operations(spec):
        responses = op["responses"]
        assert "HTTPValidationError" not in str(responses), (method, path)
        for status, response in responses.items():
            if status == "default" or int(status) >= 400:
                assert response["content"] == {PROBLEM_MEDIA_TYPE: {"schema": PROBLEM_REF}}, (method, path, status)
        assert "default" in responses, (method, path)
        if op.get("requestBody") or op.get("parameters"):
            assert "422" in responses, (method, path)
        if op.get("security"):
            assert "401" in responses, (method, path)
    ops = {(m, p): op["responses"] for p, m, op in _operations(spec)}
    # Scoped keys can be refused (403); the cluster token cannot.
    assert "403" in ops[("get", "/v1/nodes")] and "403" not in ops[("post", "/v1/nodes/register")]
    assert "404" in ops[("get", "/v1/tenants/{name}")] and "404" not in ops[("get", "/v1/tenants")]
    assert "409" in ops[("post", "/v1/tenants")] and "409" in ops[("delete", "/v1/models/{name}")]
    assert "412" in ops[("put", "/v1/capacity/{region}/{sku}")]
    assert "401" not in ops[("get", "/health")]


async def test_real_error_bodies_match_the_documented_problem_schema(cp: ControlPlane, spec: dict[str, Any]) -> None:
    bad = await cp.http.post("/v1/tenants", headers=ADMIN, json={"name": "", "zone": 7, "unknown": True})
    body = _validate_problem(spec, bad, 422)
    assert body["errors"] and all(e["loc"][0] == "body" for e in body["errors"])
    _validate_problem(spec, await cp.http.get("/v1/tenants/nobody", headers=ADMIN), 404)
    _validate_problem(spec, await cp.http.get("/v1/tenants"), 401)
    await cp.http.post("/v1/tenants", headers=ADMIN, json={"name": "acme"})
    _validate_problem(spec, await cp.http.post("/v1/tenants", headers=ADMIN, json={"name": "acme"}), 409)
    # A query parameter out of range: the field is named by where it is.
    r = await cp.http.get("/v1/tenants", headers=ADMIN, params={"limit": "-1"})
    assert _validate_problem(spec, r, 422)["errors"][0]["loc"] == ["query", "limit"]


def test_the_vendored_files_ship_in_the_package() -> None:
    """pyproject's package-data names every file in static/ (an installed /docs has its assets)."""
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["control_plane.apidocs"]
    for path in STATIC_DIR.iterdir():
        assert any(fnmatch.fnmatch(f"static/{path.name}", p) for p in patterns), path.name
    assert {"LICENSE", "README.md", *ASSETS} <= {p.name for p in STATIC_DIR.iterdir()}
