"""Routers report what their flow control holds (cluster token), for the autoscaler and the
console (control_plane.router_backlog)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from control_plane import router_backlog
from control_plane.auth import Ctx, require_cluster_token
from control_plane.db.clock import db_now
from meridian.contracts import ROUTER_ID_PATTERN, RouterBacklog

router = APIRouter(prefix="/v1", tags=["routers"], dependencies=[Depends(require_cluster_token)])
RouterIdParam = Annotated[str, Path(pattern=ROUTER_ID_PATTERN)]


@router.put("/routers/{router_id}/backlog", status_code=204)
def put_backlog(ctx: Ctx, router_id: RouterIdParam, body: RouterBacklog) -> Response:
    """Replace this router's report of the requests it holds per (zone, model) pool."""
    with ctx.write() as session:
        router_backlog.record(session, router_id, body, db_now(session), ctx.settings.router_backlog_ttl_s)
    return Response(status_code=204)
