"""Authentication of the control plane's callers: cluster token and scoped API keys."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from control_plane.audit import Actor
from control_plane.context import AppContext
from control_plane.errors import Forbidden, Unauthorized
from control_plane.keystore import find_active_key
from control_plane.scopes import FLEET_READERS, Scope
from meridian.security import constant_time_equals

_KNOWN_SCOPES = frozenset(s.value for s in Scope)


async def get_ctx(request: Request) -> AppContext:
    # async: FastAPI runs a sync dependency in its thread pool, a hop that cost every request
    # (a node's heartbeat most of all) more CPU than reading this attribute ever could.
    ctx: AppContext = request.app.state.ctx
    return ctx


Ctx = Annotated[AppContext, Depends(get_ctx)]


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller behind an API key."""

    key_id: str
    name: str
    tenant: str
    scopes: frozenset[Scope]


# Published in the OpenAPI document as two security schemes, so clients (and the fuzz test) see
# which operations take which credential. Neither answers on its own: a missing or malformed
# header reaches the dependencies below as None, which answer 401 with a problem body.
_CLUSTER_TOKEN = HTTPBearer(
    scheme_name="clusterToken", description="The cluster token nodes and routers share", auto_error=False
)
_API_KEY = HTTPBearer(
    scheme_name="apiKey", description="A scoped API key (admin, operator, read-only)", auto_error=False
)
Credentials = HTTPAuthorizationCredentials | None


def _token(credentials: Credentials) -> str | None:
    return credentials.credentials if credentials is not None and credentials.credentials else None


def is_cluster_token(ctx: AppContext, token: str | None) -> bool:
    """Whether `token` is the shared cluster token (compared in constant time)."""
    return token is not None and constant_time_equals(token, ctx.settings.cluster_token.get_secret_value())


async def require_cluster_token(ctx: Ctx, credentials: Annotated[Credentials, Depends(_CLUSTER_TOKEN)]) -> None:
    """Nodes and routers present the shared cluster token."""
    if not is_cluster_token(ctx, _token(credentials)):
        raise Unauthorized("a valid cluster token is required")


def require_scraper(ctx: Ctx, credentials: Annotated[Credentials, Depends(_API_KEY)]) -> None:
    """GET /metrics: a bearer of the metrics token, the cluster token, or an API key that may
    read the fleet (admin, operator, read-only); 401/403 otherwise."""
    token = _token(credentials)
    if token is None:
        raise Unauthorized("/metrics needs the metrics token, the cluster token or a read-only API key")
    for secret in (ctx.settings.metrics_token, ctx.settings.cluster_token):
        if secret is not None and constant_time_equals(token, secret.get_secret_value()):
            return
    require_scopes(FLEET_READERS)(ctx, credentials)


def require_scopes(allowed: Iterable[Scope]) -> Callable[..., Principal]:
    """Dependency: an unrevoked API key holding at least one of `allowed`."""
    wanted = frozenset(allowed)

    def dependency(ctx: Ctx, credentials: Annotated[Credentials, Depends(_API_KEY)]) -> Principal:
        token = _token(credentials)
        if token is None:
            raise Unauthorized("an API key is required (Authorization: Bearer <key>)")
        with ctx.read() as session:
            row = find_active_key(session, token)
            if row is None:
                raise Unauthorized("unknown or revoked API key")
            principal = Principal(
                key_id=row.id,
                name=row.name,
                tenant=row.tenant,
                scopes=frozenset(Scope(s) for s in row.scopes if s in _KNOWN_SCOPES),
            )
        if not principal.scopes & wanted:
            needed = ", ".join(sorted(s.value for s in wanted))
            raise Forbidden(f"this key lacks a required scope (one of: {needed})")
        return principal

    return dependency


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id(x_request_id: Annotated[str | None, Header()] = None) -> str:
    """The caller's X-Request-Id when it is a sane token, else a new one (for the audit log)."""
    if x_request_id is not None and _REQUEST_ID.match(x_request_id):
        return x_request_id
    return uuid.uuid4().hex


def require_actor(allowed: Iterable[Scope]) -> Callable[..., Actor]:
    """Dependency: like require_scopes, returning who acts (for the audit log)."""
    principal_of = require_scopes(allowed)

    # Defaults, not Annotated: the annotations are strings (PEP 563) that FastAPI resolves
    # in the module's namespace, where the closure's `principal_of` is not.
    def dependency(principal: Principal = Depends(principal_of), rid: str = Depends(request_id)) -> Actor:  # noqa: B008
        return Actor(id=principal.key_id, name=principal.name, request_id=rid)

    return dependency
