"""Node lifecycle (cluster token) and the fleet views of the admin API (API key)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from control_plane import node_registry
from control_plane.api.pagination import PageParams, page_params, paginate, set_next_link
from control_plane.auth import Ctx, require_cluster_token, require_scopes
from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import Node
from control_plane.errors import Conflict
from control_plane.heartbeat_fast_path import renew
from control_plane.scopes import FLEET_READERS
from meridian.contracts import (
    NODE_ID_PATTERN,
    HeartbeatAck,
    NodeHeartbeat,
    NodeRegistered,
    NodeRegistration,
    NodeView,
)

router = APIRouter(prefix="/v1", tags=["nodes"])
internal = [Depends(require_cluster_token)]
fleet_readers = [Depends(require_scopes(FLEET_READERS))]
NodeIdParam = Annotated[str, Path(pattern=NODE_ID_PATTERN)]


@router.post("/nodes/register", dependencies=internal,
             responses={429: {"description": "Too many registrations in flight; retry after Retry-After seconds"}})
async def register_node(ctx: Ctx, body: NodeRegistration) -> NodeRegistered:
    # Admitted by control_plane.registration_gate (middleware) before the body was even read.
    await run_in_threadpool(_register, ctx, body)
    # The configured interval, not the fleet's: a node of an older release follows this one
    # for good (it never reads the ack's), and the reaper never holds nodes to less. A current
    # node learns the fleet's interval from its first heartbeat's ack.
    return NodeRegistered(
        node_id=body.node_id,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        ttl_s=ctx.settings.node_ttl_s,
    )


@router.post("/nodes/{node_id}/heartbeat", dependencies=internal)
async def node_heartbeat(ctx: Ctx, node_id: NodeIdParam, body: NodeHeartbeat) -> HeartbeatAck:
    # async, with the database work in one hop to a thread: a sync endpoint costs two (FastAPI
    # validates its return value in the pool too), and every node sends this. The renewal runs
    # on the lease bulkhead (AppContext.lease_engine): writes queued on the routing version's
    # lock never hold up a heartbeat that changes nothing.
    # (Most heartbeats never get here: control_plane.heartbeat_fast_path answers those renew
    # takes. This is the path for the rest, and for errors.)
    loop = asyncio.get_running_loop()
    version = await loop.run_in_executor(ctx.lease_threads, renew, ctx, node_id, body)
    if version is None:
        # A change, or an unknown or lost node: the full path, which bumps the routing version
        # at once or answers 404.
        version = await run_in_threadpool(_full_heartbeat, ctx, node_id, body)
    return HeartbeatAck(routing_version=version, heartbeat_interval_s=ctx.pacer.interval_s())


def _register(ctx: AppContext, body: NodeRegistration) -> None:
    try:
        with ctx.write() as session:
            node_registry.register(session, body, ctx.regions, db_now(session))
    except IntegrityError as e:
        # Two first registrations of one id raced; the node's retry will update the row.
        raise Conflict(f"node {body.node_id!r} was registered concurrently; retry") from e


def _full_heartbeat(ctx: AppContext, node_id: str, body: NodeHeartbeat) -> int:
    with ctx.write() as session:
        version = node_registry.heartbeat(session, node_id, body, db_now(session))
    # A change: the write has waited for the bump that covers it, so the newest is at least that.
    return version if version is not None else ctx.versions.version


@router.delete("/nodes/{node_id}", dependencies=internal, status_code=204)
def deregister_node(ctx: Ctx, node_id: NodeIdParam) -> Response:
    with ctx.write() as session:
        node_registry.deregister(session, node_id)
    return Response(status_code=204)


@router.get("/nodes", dependencies=fleet_readers)
def list_nodes(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[NodeView]:
    """Every node (lost ones too, until the reaper forgets them), by region and id."""
    with ctx.read() as session:
        rows, next_cursor = paginate(session, select(Node), [Node.region, Node.node_id], page)
        views = [node_registry.view(session, n) for n in rows]
    set_next_link(request, response, next_cursor)
    return views


@router.get("/nodes/{node_id}", dependencies=fleet_readers)
def get_node(ctx: Ctx, node_id: NodeIdParam) -> NodeView:
    with ctx.read() as session:
        return node_registry.get(session, node_id)
