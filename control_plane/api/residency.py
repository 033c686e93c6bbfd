"""Where the fabric can run: regions and the residency zones they belong to."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel

from control_plane.api.pagination import PageParams, page_params, paginate_items, set_next_link
from control_plane.auth import Ctx, require_scopes
from control_plane.context import AppContext
from control_plane.errors import NotFound
from control_plane.scopes import FLEET_READERS
from meridian.contracts import REGION_PATTERN, ZONE_PATTERN, RegionInfo

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes(FLEET_READERS))], tags=["residency"])
Page = Annotated[PageParams, Depends(page_params)]


class ZoneView(BaseModel):
    """A residency zone: a zoned tenant's requests and a zoned deployment's replicas stay in its regions."""

    name: str
    regions: list[str]
    providers: list[str]


def _zones(ctx: AppContext) -> dict[str, ZoneView]:
    regions: dict[str, list[RegionInfo]] = {}
    for region in ctx.regions.values():
        for zone in region.zones:
            regions.setdefault(zone, []).append(region)
    return {
        zone: ZoneView(
            name=zone,
            regions=sorted(r.name for r in members),
            providers=sorted({r.provider for r in members}),
        )
        for zone, members in regions.items()
    }


@router.get("/regions")
def list_regions(ctx: Ctx, request: Request, response: Response, page: Page) -> list[RegionInfo]:
    rows, next_cursor = paginate_items(list(ctx.regions.values()), lambda r: (r.name,), page)
    set_next_link(request, response, next_cursor)
    return rows


@router.get("/regions/{name}")
def get_region(ctx: Ctx, name: Annotated[str, Path(pattern=REGION_PATTERN)]) -> RegionInfo:
    region = ctx.regions.get(name)
    if region is None:
        raise NotFound(f"no region {name!r}")
    return region


@router.get("/zones")
def list_zones(ctx: Ctx, request: Request, response: Response, page: Page) -> list[ZoneView]:
    """Every residency zone with its regions and providers ("global", which is every region, is not listed)."""
    rows, next_cursor = paginate_items(list(_zones(ctx).values()), lambda z: (z.name,), page)
    set_next_link(request, response, next_cursor)
    return rows


@router.get("/zones/{name}")
def get_zone(ctx: Ctx, name: Annotated[str, Path(pattern=ZONE_PATTERN)]) -> ZoneView:
    zone = _zones(ctx).get(name)
    if zone is None:
        raise NotFound(f"no zone {name!r} (no region belongs to it)")
    return zone
