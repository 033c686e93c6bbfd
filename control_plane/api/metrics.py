"""GET /metrics: the control plane's Prometheus page (control_plane.metrics).

It names regions and the plan in force, so it answers only a bearer of the control plane's
`metrics_token`, of the cluster token, or of an API key with a fleet-reading scope (admin,
operator, read-only): 401/403 otherwise (control_plane.auth.require_scraper). It is not in
the OpenAPI document: a scrape target, not an admin operation.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane.auth import Ctx, require_scraper
from control_plane.metrics import ControlPlaneMetrics, FleetView

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(require_scraper)])
async def prometheus_metrics(request: Request, ctx: Ctx) -> Response:
    metrics: ControlPlaneMetrics = request.app.state.metrics
    elector = request.app.state.elector

    def render() -> bytes:
        with ctx.read() as session:
            view = FleetView.read(session)
        return metrics.render(view, elector)

    return Response(await asyncio.to_thread(render), media_type=CONTENT_TYPE_LATEST)
