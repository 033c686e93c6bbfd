"""The web console's shell: static files shipped in this package, served at /console.

The control plane's root (`/`) redirects here, so its bare URL opens the console. The shell
holds no data and needs no key: the page asks the operator for an API key and
calls the admin API with it (control_plane.api.console and the fleet reads), so what a key
may see is decided where it always is. Only the files in static/ are served, by an exact
name from that listing, under a Content-Security-Policy that allows this origin alone: no
inline script or style, no CDN, no framing, so a value shown on the page (a node id, a
drill's text) cannot run as code.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from control_plane.errors import NotFound

STATIC_DIR = Path(__file__).parent / "static"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# blob: images are the drill timelines, fetched with the key and shown from memory.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The shell is small and changes with the control plane's version: always revalidate.
    "Cache-Control": "no-cache",
}


def _files() -> dict[str, tuple[bytes, str]]:
    """Every servable file, read once: name -> (content, media type)."""
    return {
        p.name: (p.read_bytes(), _MEDIA_TYPES[p.suffix])
        for p in sorted(STATIC_DIR.iterdir())
        if p.is_file() and p.suffix in _MEDIA_TYPES
    }


FILES = _files()
router = APIRouter(include_in_schema=False)


def _serve(name: str) -> Response:
    found = FILES.get(name)
    if found is None:
        raise NotFound(f"no console file {name!r}")
    content, media_type = found
    return Response(content, media_type=media_type, headers=SECURITY_HEADERS)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/console", status_code=307, headers=SECURITY_HEADERS)


@router.get("/console")
@router.get("/console/")
def console_page() -> Response:
    return _serve("index.html")


@router.get("/console/static/{name}")
def console_file(name: str) -> Response:
    return _serve(name)
