"""Who may call a node's OpenAI routes: routers, holding the cluster token.

Tenants never talk to nodes directly; their keys and residency are checked by the
router. A node without a cluster token (standalone development) serves anyone, and
says so in its log at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import Request

from data_plane.server.errors import AuthenticationError
from meridian.security import bearer_token, constant_time_equals
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)


def internal_auth(settings: NodeSettings) -> Callable[[Request], None]:
    """A FastAPI dependency that admits only requests bearing the cluster token."""
    if settings.cluster_token is None:
        log.warning("no cluster token configured: this node's API is open to anyone who can reach it")

        def open_access(request: Request) -> None:
            return None

        return open_access
    expected = settings.cluster_token.get_secret_value()

    def check(request: Request) -> None:
        token = bearer_token(request.headers.get("authorization"))
        if token is None or not constant_time_equals(token, expected):
            raise AuthenticationError("This node accepts requests from Meridian routers only.")

    return check
