"""The admin API's interactive documentation at /docs: Swagger UI served from this package.

FastAPI's default /docs page loads Swagger UI from a CDN, which an operator's browser may not
reach (an air-gapped site) and which would run third-party code against a page that holds an
API key. Here the page and its assets (swagger-ui-dist, vendored in static/; see its README)
come from the control plane itself, under a Content-Security-Policy of their own that allows
this origin alone plus the one inline script the page needs, pinned by its hash. The
console's stricter policy (control_plane.console) is not touched. ReDoc is off: one
documentation page, one vendored bundle.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response

from control_plane.errors import NotFound

STATIC_DIR = Path(__file__).parent / "static"
DOCS_PATH = "/docs"
STATIC_PATH = f"{DOCS_PATH}/static"
OPENAPI_PATH = "/openapi.json"
_MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}
TITLE = "Meridian control plane - API docs"


def _files() -> dict[str, tuple[bytes, str, str]]:
    """Every servable asset, read once: name -> (content, media type, ETag)."""
    files = {}
    for p in sorted(STATIC_DIR.iterdir()):
        if p.is_file() and p.suffix in _MEDIA_TYPES:
            content = p.read_bytes()
            files[p.name] = (content, _MEDIA_TYPES[p.suffix], f'"{hashlib.sha256(content).hexdigest()[:32]}"')
    return files


FILES = _files()


def _page() -> str:
    response = get_swagger_ui_html(
        openapi_url=OPENAPI_PATH,
        title=TITLE,
        swagger_js_url=f"{STATIC_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{STATIC_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{STATIC_PATH}/favicon-32x32.png",
        oauth2_redirect_url=None,
        # No validator badge: it would send the spec to validator.swagger.io.
        swagger_ui_parameters={"validatorUrl": None},
    )
    return bytes(response.body).decode()


def _content_security_policy(page: str) -> str:
    # The page's inline script (SwaggerUIBundle's call) is allowed by its hash, not by
    # 'unsafe-inline'. Swagger UI draws its icons as data: SVG from its stylesheet.
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"
        for script in re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    )
    return (
        f"default-src 'self'; script-src 'self' {hashes}; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


PAGE = _page()
CONTENT_SECURITY_POLICY = _content_security_policy(PAGE)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidated each time: the ETag makes that a 304 while the vendored files are unchanged.
    "Cache-Control": "no-cache",
}
router = APIRouter(include_in_schema=False)


@router.get(DOCS_PATH)
def docs_page() -> Response:
    return Response(PAGE, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@router.get(f"{STATIC_PATH}/{{name}}")
def docs_file(name: str, request: Request) -> Response:
    found = FILES.get(name)
    if found is None:
        raise NotFound(f"no docs file {name!r}")
    content, media_type, etag = found
    headers = {**SECURITY_HEADERS, "ETag": etag}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(content, media_type=media_type, headers=headers)
