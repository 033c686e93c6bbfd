"""The routing-table snapshot routers and nodes poll (ETag, If-None-Match, long-poll)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Response

from control_plane.api.etags import etag, if_none_match_matches
from control_plane.auth import Ctx, require_cluster_token
from control_plane.routing_table import build_routing_table
from meridian.contracts import RoutingTable

router = APIRouter(prefix="/v1", tags=["routing"])


@router.get("/routing-table", dependencies=[Depends(require_cluster_token)])
async def get_routing_table(
    ctx: Ctx,
    wait: Annotated[float | None, Query(ge=0, description="long-poll seconds")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    version = await ctx.watch.current()
    if wait and if_none_match_matches(if_none_match, version):
        # Longer waits are clamped, not refused: a router may be configured more patiently.
        version = await ctx.watch.wait_for_change(version, min(wait, ctx.settings.max_long_poll_s))
    if if_none_match_matches(if_none_match, version):
        return Response(status_code=304, headers={"ETag": etag(version)})

    def build() -> RoutingTable:
        with ctx.read() as session:
            return build_routing_table(session, ctx.regions, ctx.clock.now())

    table = await asyncio.to_thread(build)
    # The snapshot's own version is the ETag: it may be newer than `version` above.
    return Response(
        content=table.model_dump_json(),
        media_type="application/json",
        headers={"ETag": etag(table.version), "Cache-Control": "no-cache"},
    )
