"""The unchanged heartbeat, answered before FastAPI.

At fleet scale nearly every request a control plane takes is a node heartbeat that changes
nothing routers see, and the database side of it is one SQL statement (control_plane.node_lease).
Through FastAPI's stack (seven middlewares, matching against ~100 routes, dependency solving,
response validation) that request still cost ~1.5-2 ms of CPU, most of it framework: at 10,000
simulated nodes on a 2-core box this was what the control plane could not keep up with
(issue 34), as every heartbeat took a share of the one event loop.

`HeartbeatFastPath` (ASGI middleware, outermost) answers such a heartbeat itself with the same
parts as the endpoint: the cluster token compared in constant time, the body validated by the
same model (NodeHeartbeat), the same renewal on the lease bulkhead, the same ack. Anything else
goes on to the app unchanged, its body replayed: a missing or wrong token, a body over the
limit or one that does not validate, and a heartbeat that renew cannot take (a change, an
unknown or lost node: control_plane.api.nodes runs the full path). So every error is still
answered by the app's one error mapping, and the full path stays the only path for changes.
"""

from __future__ import annotations

import asyncio
import re

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane import node_lease
from control_plane.auth import is_cluster_token
from control_plane.body_limit import read_or_refuse, replaying
from control_plane.context import AppContext
from meridian.contracts import NODE_ID_PATTERN, HeartbeatAck, NodeHeartbeat

_PATH = re.compile(r"^/v1/nodes/(" + NODE_ID_PATTERN.strip("^$") + r")/heartbeat$")
_JSON = [(b"content-type", b"application/json")]


def renew(ctx: AppContext, node_id: str, body: NodeHeartbeat) -> int | None:
    """The heartbeat as one statement when nothing routers see changed (node_lease.renew);
    None otherwise. Runs on the lease bulkhead (AppContext.lease_threads)."""
    ctx.pacer.refresh(ctx.read_sessions)
    return node_lease.renew(ctx.leases, node_id, body)


class HeartbeatFastPath:
    """POST /v1/nodes/{id}/heartbeat that renew takes: answered here (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        ctx: AppContext | None = getattr(scope["app"].state, "ctx", None) if match else None
        if match is None or ctx is None or not _authorized(scope, ctx):
            await self.app(scope, receive, send)
            return
        # Read whole here, as BodyLimitMiddleware downstream reads every body (refused here
        # as it would be there), and replayed to the app when the renewal does not take it.
        body = await read_or_refuse(scope, receive, send, ctx.settings.max_request_bytes)
        if body is None:
            return
        version = await _renewed(ctx, match.group(1), body)
        if version is None:
            await self.app(scope, replaying(body, receive), send)
            return
        ack = HeartbeatAck(routing_version=version, heartbeat_interval_s=ctx.pacer.interval_s())
        payload = ack.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_JSON, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _authorized(scope: Scope, ctx: AppContext) -> bool:
    """The cluster token, on a JSON body (the app answers 415 to any other)."""
    headers = dict(scope["headers"])
    if headers.get(b"content-type", b"").split(b";")[0].strip().lower() != b"application/json":
        return False
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and is_cluster_token(ctx, token.strip())


async def _renewed(ctx: AppContext, node_id: str, raw: bytes) -> int | None:
    if len(raw) > ctx.settings.max_request_bytes:
        return None
    try:
        body = NodeHeartbeat.model_validate_json(raw)
    except ValidationError:
        return None
    try:
        return await asyncio.get_running_loop().run_in_executor(ctx.lease_threads, renew, ctx, node_id, body)
    except SQLAlchemyError:
        return None  # the app's path meets it again and answers it (503 and Retry-After)
