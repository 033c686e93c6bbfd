"""The routing-table snapshot routers and nodes poll (ETag, If-None-Match, long-poll), and
its deltas (control_plane.table_stream has the why).

- `If-None-Match: "V"` with `?wait=S`: held until the version moves from V (at most
  `max_long_poll_s`), then 304 when it did not.
- 200: the full table, `ETag` its version. A snapshot is never labelled newer than its
  content (build_routing_table reads the version first).
- 226 IM Used (`IM: meridian-delta`): a RoutingTableDelta, for a request that sends
  `A-IM: meridian-delta` and the build of its version V in `X-Meridian-Table-Build`, when this
  process still holds that build. Otherwise 200: a router never needs to know why.
- Both name their build in `X-Meridian-Table-Build`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Response

from control_plane.api.etags import etag, etag_version, if_none_match_matches
from control_plane.auth import Ctx, require_cluster_token
from meridian.contracts import HEADER_TABLE_BUILD, TABLE_DELTA_IM

router = APIRouter(prefix="/v1", tags=["routing"])


@router.get("/routing-table", dependencies=[Depends(require_cluster_token)])
async def get_routing_table(
    ctx: Ctx,
    wait: Annotated[float | None, Query(ge=0, description="long-poll seconds")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
    a_im: Annotated[str | None, Header(description="`meridian-delta`: a delta is welcome")] = None,
    x_meridian_table_build: Annotated[
        str | None, Header(description="the build of the version in If-None-Match, for a delta")
    ] = None,
) -> Response:
    version = await ctx.watch.current()
    if wait and if_none_match_matches(if_none_match, version):
        # Longer waits are clamped, not refused: a router may be configured more patiently.
        version = await ctx.watch.wait_for_change(version, min(wait, ctx.settings.max_long_poll_s))
    if if_none_match_matches(if_none_match, version):
        return Response(status_code=304, headers={"ETag": etag(version)})
    # One build for every router asking now; its version may be newer than `version` above.
    published = await ctx.tables.newest_at_least(version)
    if published.table.version > version and await ctx.watch.current() < published.table.version:
        # The database's version went back (restored from a backup, say): what this process
        # built is of another history. Without this a router would be sent it again and again.
        ctx.tables.forget()
        published = await ctx.tables.newest_at_least(version)
    headers = {
        "ETag": etag(published.table.version),
        "Cache-Control": "no-cache",
        HEADER_TABLE_BUILD: published.table.build,
    }
    base_version = etag_version(if_none_match)
    if _wants_delta(a_im) and base_version is not None and x_meridian_table_build:
        delta = ctx.tables.delta(base_version, x_meridian_table_build, published)
        if delta is not None:
            return Response(
                content=delta, status_code=226, media_type="application/json",
                headers={**headers, "IM": TABLE_DELTA_IM},
            )
    return Response(content=published.body, media_type="application/json", headers=headers)


def _wants_delta(a_im: str | None) -> bool:
    return a_im is not None and TABLE_DELTA_IM in (m.strip() for m in a_im.split(","))
