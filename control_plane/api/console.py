"""The web console's reads: one overview per poll, and the chaos drill reports.

Every route takes an API key of a fleet reader (admin, operator, read-only), as the rest of
the admin API's reads do; the console's HTML shell itself (control_plane.console) is public
and holds no data. The overview gathers what the console's map and tables need in one
request, so a poll is one consistent snapshot (and one key check), and it carries what the
routing table's version (cluster-token only) and the key's own scopes would otherwise hide
from a read-only key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Response
from sqlalchemy import select

from control_plane import drill_reports, node_registry, router_backlog
from control_plane.auth import Ctx, Principal, require_scopes
from control_plane.db.clock import db_now
from control_plane.db.models import Node
from control_plane.errors import NotFound
from control_plane.routing_table import current_version
from control_plane.scopes import FLEET_READERS
from meridian.admin_api import ConsoleOverview, ConsoleViewer, DrillReportSummary, PoolHeldView

router = APIRouter(prefix="/v1/console", tags=["console"])
Reader = Annotated[Principal, Depends(require_scopes(FLEET_READERS))]
readers = [Depends(require_scopes(FLEET_READERS))]
ReportName = Annotated[str, Path(pattern=drill_reports.NAME_PATTERN)]
# A fleet bigger than this is shown in part (the console is for people, not exports).
MAX_NODES = 2000


@router.get("/overview")
def overview(ctx: Ctx, viewer: Reader) -> ConsoleOverview:
    """Regions, nodes (with load and cumulative request counts), requests held at the routers,
    the routing version and who is looking."""
    with ctx.read() as session:
        rows = session.scalars(select(Node).order_by(Node.region, Node.node_id).limit(MAX_NODES)).all()
        nodes = [node_registry.view(session, n) for n in rows]
        version = current_version(session)
        # The clock heartbeats are stamped with, so the page's heartbeat ages are right on
        # every replica (control_plane.db.clock).
        now = db_now(session)
        held = router_backlog.held(session, now, ctx.settings.router_backlog_ttl_s)
    return ConsoleOverview(
        generated_at=now,
        viewer=ConsoleViewer(name=viewer.name, tenant=viewer.tenant, scopes=sorted(viewer.scopes)),
        routing_version=version,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        node_ttl_s=ctx.settings.node_ttl_s,
        regions=sorted(ctx.regions.values(), key=lambda r: r.name),
        nodes=nodes,
        router_backlog=[PoolHeldView(zone=p.zone, model=p.model, waiting=p.waiting, routers=p.routers) for p in held],
    )


@router.get("/drills", dependencies=readers)
async def list_drills(ctx: Ctx) -> list[DrillReportSummary]:
    """Drill reports in the reports directory (MERIDIAN_CP_DRILL_REPORTS_DIR), newest first."""
    return await asyncio.to_thread(drill_reports.list_reports, ctx.settings.drill_reports_dir)


def _reports_dir(ctx: Ctx) -> FsPath:
    base = ctx.settings.drill_reports_dir
    if base is None:
        raise NotFound("this control plane has no drill reports directory (MERIDIAN_CP_DRILL_REPORTS_DIR)")
    return base


@router.get("/drills/{name}/report.json", dependencies=readers)
async def drill_report(ctx: Ctx, name: ReportName) -> dict[str, Any]:
    """A drill's report.json as chaos wrote it (its schema is chaos.report.json_model's)."""
    base = _reports_dir(ctx)
    try:
        return await asyncio.to_thread(drill_reports.read_report, base, name)
    except drill_reports.ReportNotFound as e:
        raise NotFound(f"no drill report {name!r}") from e


@router.get(
    "/drills/{name}/timeline.png", dependencies=readers, response_class=Response,
    responses={200: {"content": {"image/png": {}}, "description": "The drill's timeline"}},
)
async def drill_timeline(ctx: Ctx, name: ReportName) -> Response:
    base = _reports_dir(ctx)
    try:
        png = await asyncio.to_thread(drill_reports.read_timeline_png, base, name)
    except drill_reports.ReportNotFound as e:
        raise NotFound(f"no timeline for drill report {name!r}") from e
    return Response(png, media_type="image/png", headers={"Cache-Control": "no-cache"})
