"""GET /metrics: the control plane's Prometheus page (control_plane.metrics).

It names regions and the plan in force, so it answers only a bearer of the control plane's
`metrics_token`, of the cluster token, or of an API key with a fleet-reading scope (admin,
operator, read-only): 401 otherwise. It is not in the OpenAPI document (a scrape target,
not an admin operation).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane.auth import _API_KEY, Credentials, Ctx, require_scopes
from control_plane.errors import Unauthorized
from control_plane.metrics import ControlPlaneMetrics, FleetView
from control_plane.scopes import FLEET_READERS
from meridian.security import constant_time_equals

router = APIRouter()
_fleet_reader = require_scopes(FLEET_READERS)


def _authorize(ctx: Ctx, credentials: Credentials) -> None:
    token = credentials.credentials if credentials is not None else ""
    if not token:
        raise Unauthorized("/metrics needs the metrics token, the cluster token or a read-only API key")
    settings = ctx.settings
    for secret in (settings.metrics_token, settings.cluster_token):
        if secret is not None and constant_time_equals(token, secret.get_secret_value()):
            return
    _fleet_reader(ctx, credentials)  # Unauthorized / Forbidden unless a fleet-reading key


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(
    request: Request, ctx: Ctx, credentials: Annotated[Credentials, Depends(_API_KEY)]
) -> Response:
    def render() -> bytes:
        _authorize(ctx, credentials)
        with ctx.read() as session:
            view = FleetView.read(session)
        metrics: ControlPlaneMetrics = request.app.state.metrics
        return metrics.render(view, request.app.state.elector)

    return Response(await asyncio.to_thread(render), media_type=CONTENT_TYPE_LATEST)
