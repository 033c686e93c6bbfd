"""Where the client is, and how far (in estimated round-trip time) each region is from it."""

from __future__ import annotations

from collections.abc import Mapping

from meridian.contracts import RegionInfo
from meridian.geo import Point, estimate_rtt_ms, parse_point


def resolve_location(text: str | None, regions: Mapping[str, RegionInfo]) -> Point | None:
    """A point for "lat,lon" or a known region name; None when `text` is neither."""
    if not text:
        return None
    text = text.strip()
    region = regions.get(text)
    if region is not None:
        return region_point(region)
    return parse_point(text)


def locate_client(
    header_value: str | None, default: str, regions: Mapping[str, RegionInfo]
) -> Point | None:
    """The client's location from the trusted edge header, else the configured default.

    None means "unknown": every region is then equally near and ordering falls to load.
    """
    return resolve_location(header_value, regions) or resolve_location(default, regions)


def region_point(region: RegionInfo) -> Point:
    return Point(region.latitude, region.longitude)


def region_rtt_ms(client: Point | None, region: RegionInfo) -> float:
    """Estimated client-to-region round trip; 0 for every region when the client is unknown."""
    if client is None:
        return 0.0
    return estimate_rtt_ms(client, region_point(region))
