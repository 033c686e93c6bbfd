"""Meridian's geo router: the global OpenAI-compatible endpoint.

It authenticates the tenant, applies residency as a hard filter, orders replicas by
estimated round-trip time and fails over before the first byte. It talks to the control
plane and to nodes over HTTP only.

`create_app` and `serve` load the app on first use, so that the CLI can mount the router's
commands (geo_router.cli) without importing the server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "serve":
        from .listener import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
