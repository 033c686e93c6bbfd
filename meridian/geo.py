"""Geography: great-circle distance and a round-trip-time estimate between points, and
between a client and a region (its point, or a place named by text)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from meridian.contracts import RegionInfo

EARTH_RADIUS_KM = 6371.0
# Light in fibre covers about 200 km per millisecond; real routes are longer than the
# great circle, so a route factor inflates the distance.
FIBRE_KM_PER_MS = 200.0
ROUTE_FACTOR = 1.5
# Fixed per-request cost (last mile, TLS, queueing) that even a same-city hop pays.
BASE_RTT_MS = 2.0


@dataclass(frozen=True, slots=True)
class Point:
    latitude: float
    longitude: float


def haversine_km(a: Point, b: Point) -> float:
    """Great-circle distance in kilometres."""
    lat1, lon1, lat2, lon2 = map(math.radians, (a.latitude, a.longitude, b.latitude, b.longitude))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def estimate_rtt_ms(a: Point, b: Point) -> float:
    """Estimated network round trip between two points, in milliseconds."""
    return BASE_RTT_MS + 2 * haversine_km(a, b) * ROUTE_FACTOR / FIBRE_KM_PER_MS


def parse_point(text: str) -> Point | None:
    """Parse "lat,lon"; None when it is not a valid coordinate pair."""
    parts = text.split(",")
    if len(parts) != 2:
        return None
    try:
        lat, lon = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    if not (-90 <= lat <= 90 and -180 <= lon <= 180) or math.isnan(lat) or math.isnan(lon):
        return None
    return Point(lat, lon)


def resolve_location(text: str | None, regions: Mapping[str, RegionInfo]) -> Point | None:
    """A point for "lat,lon" or a known region name; None when `text` is neither."""
    if not text:
        return None
    text = text.strip()
    region = regions.get(text)
    if region is not None:
        return region_point(region)
    return parse_point(text)


def region_point(region: RegionInfo) -> Point:
    return Point(region.latitude, region.longitude)


def region_rtt_ms(client: Point | None, region: RegionInfo) -> float:
    """Estimated client-to-region round trip; 0 for every region when the client is unknown."""
    if client is None:
        return 0.0
    return estimate_rtt_ms(client, region_point(region))
