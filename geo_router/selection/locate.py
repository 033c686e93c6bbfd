"""Where the client is, and how far (in estimated round-trip time) each region is from it."""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import maxminddb
from starlette.datastructures import Headers

from meridian.contracts import RegionInfo
from meridian.geo import Point, estimate_rtt_ms, region_point, resolve_location
from meridian.settings.router import RouterSettings

log = logging.getLogger(__name__)

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Distinct client addresses whose GeoIP answer is remembered (a record decode costs more than
# the rest of routing).
_GEOIP_CACHE_SIZE = 65_536
# RttEstimator: weight of a new measurement in a region's correction, the range a correction
# may take, and the shortest estimated path a measurement is learned from.
_EWMA_ALPHA = 0.2
_MIN_CORRECTION = 0.5
_MAX_CORRECTION = 4.0
_MIN_LEARN_MS = 10.0


def locate_client(
    header_value: str | None, default: str, regions: Mapping[str, RegionInfo]
) -> Point | None:
    """The client's location from the trusted edge header, else the configured default.

    None means "unknown": every region is then equally near and ordering falls to load.
    """
    return resolve_location(header_value, regions) or resolve_location(default, regions)


# --- client location -------------------------------------------------------------------------


class ClientLocator:
    """Where a client is: the trusted edge header, else a GeoIP lookup of its address (when a
    database is configured), else the configured default.

    The address is the connection's peer, except when the peer is a trusted proxy
    (`trusted_proxies`): then X-Forwarded-For is walked from the right, past further trusted
    proxies, to the first address no trusted proxy is: the one the nearest trusted proxy saw
    connect. Hops to its left were written by the client and prove nothing. Nobody else's
    X-Forwarded-For is read at all. A database that cannot be read is warned about once and
    ignored; a lookup never fails a request.
    """

    def __init__(self, settings: RouterSettings) -> None:
        self._header = settings.client_location_header
        self._default = settings.default_client_location
        self._trusted = parse_networks(settings.trusted_proxies)
        self._reader = _open_geoip(settings.geoip_database)
        self._lookup_warned = False
        self._lookup = functools.lru_cache(maxsize=_GEOIP_CACHE_SIZE)(self._lookup_uncached)

    def locate(self, headers: Headers, peer: str | None, regions: Mapping[str, RegionInfo]) -> Point | None:
        """The client's location; None ("unknown") when even the default names no place."""
        point = resolve_location(headers.get(self._header), regions)
        if point is None and self._reader is not None:
            address = self.client_address(headers, peer)
            if address is not None:
                point = self._lookup(address)
        return point or resolve_location(self._default, regions)

    def client_address(self, headers: Headers, peer: str | None) -> IpAddress | None:
        """The client's IP address as far as it can be trusted (None: the peer is no IP)."""
        address = parse_ip(peer)
        if address is None or not self._is_trusted(address):
            return address
        hops = [hop for value in headers.getlist("x-forwarded-for") for hop in value.split(",")]
        for hop in reversed(hops):
            hop_address = parse_ip(hop)
            if hop_address is None:
                # Not an address: whoever wrote it, the last trusted hop is all we know.
                return address
            address = hop_address
            if not self._is_trusted(address):
                return address
        return address

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _is_trusted(self, address: IpAddress) -> bool:
        return any(address in network for network in self._trusted)

    def _lookup_uncached(self, address: IpAddress) -> Point | None:
        reader = self._reader
        if reader is None:
            return None
        try:
            record = reader.get(address)
        # A corrupt record, IPv6 in an IPv4-only database.
        except (maxminddb.InvalidDatabaseError, ValueError, OSError) as exc:
            if not self._lookup_warned:
                log.warning("GeoIP lookup failed (%s); such clients are placed at the default location", exc)
                self._lookup_warned = True
            return None
        return _record_point(record)


def parse_networks(cidrs: list[str]) -> list[IpNetwork]:
    """The networks of `cidrs` ("10.0.0.0/8", "2001:db8::/32", a bare address); ValueError names a bad one."""
    networks: list[IpNetwork] = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"trusted_proxies: {cidr!r} is not an IP network (CIDR)") from None
    return networks


def parse_ip(text: str | None) -> IpAddress | None:
    """An address from a peer or X-Forwarded-For hop ("1.2.3.4", "1.2.3.4:80", "[::1]:80", "::1")."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # A v4 client on a dual-stack socket shows as ::ffff:a.b.c.d; networks are written in v4.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _open_geoip(path: Path | None) -> maxminddb.Reader | None:
    if path is None:
        return None
    try:
        return maxminddb.open_database(str(path))
    except (maxminddb.InvalidDatabaseError, OSError, ValueError) as exc:  # missing, unreadable, not an .mmdb
        log.warning("GeoIP database %s cannot be read (%s); clients are located without it", path, exc)
        return None


def _record_point(record: object) -> Point | None:
    """The location of a GeoIP2/GeoLite2 City record (None when it has none)."""
    if not isinstance(record, dict):
        return None
    location = record.get("location")
    if not isinstance(location, dict):
        return None
    lat, lon = location.get("latitude"), location.get("longitude")
    if not isinstance(lat, int | float) or not isinstance(lon, int | float):
        return None
    if not (-90 <= lat <= 90 and -180 <= lon <= 180):
        return None
    return Point(float(lat), float(lon))


# --- round-trip time ---------------------------------------------------------------------------


# (client, region) estimates kept at most (then the cache starts again).
_MAX_ESTIMATES = 65_536


class RttEstimator:
    """Client-to-region round trips: the great-circle estimate, corrected per region by what
    this router measured.

    Model: the estimate (meridian.geo.estimate_rtt_ms: fibre speed times a route factor plus a
    fixed cost) is off by a factor that depends mostly on the region's end of the path
    (peering, where the provider really hands traffic over). `observe` compares a round trip
    this router measured to a region (a health probe, a connection set-up) with the estimate
    from the router's own location (`router_location`), and keeps an exponentially weighted
    average of measured / estimated per region (weight 0.2 per sample, starting at 1, bounded
    to 0.5..4). Clients reach this router because they are near it, so their paths to a region
    resemble the router's: `rtt_ms` multiplies the client's estimate by that region's
    correction. Measurements over paths estimated shorter than 10 ms are not learned from:
    there the fixed costs, not the route, decide the ratio. Without a router location nothing
    is learned and estimates stay plain.
    """

    def __init__(self, router_location: str | None = None) -> None:
        self._router_location = router_location
        self._corrections: dict[str, float] = {}
        self._estimates: dict[tuple[Point, float, float], float] = {}

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> RttEstimator:
        return cls(settings.router_location)

    def observe(self, region: RegionInfo, measured_ms: float, regions: Mapping[str, RegionInfo]) -> None:
        """Learn from a round trip measured between this router and `region`."""
        router = resolve_location(self._router_location, regions)
        if router is None or not math.isfinite(measured_ms) or measured_ms <= 0:
            return
        estimated = estimate_rtt_ms(router, region_point(region))
        if estimated < _MIN_LEARN_MS:
            return
        ratio = min(_MAX_CORRECTION, max(_MIN_CORRECTION, measured_ms / estimated))
        previous = self._corrections.get(region.name, 1.0)
        self._corrections[region.name] = previous + _EWMA_ALPHA * (ratio - previous)

    def correction(self, region_name: str) -> float:
        """The factor applied to estimates for `region_name` (1 until something was measured)."""
        return self._corrections.get(region_name, 1.0)

    def rtt_ms(self, client: Point | None, region: RegionInfo) -> float:
        """Estimated client-to-region round trip; 0 for every region when the client is unknown."""
        if client is None:
            return 0.0
        # Asked for each candidate region of every request, from a few client places (the
        # default, GeoIP's cities): the great-circle trigonometry once per pair.
        key = (client, region.latitude, region.longitude)
        estimate = self._estimates.get(key)
        if estimate is None:
            if len(self._estimates) >= _MAX_ESTIMATES:
                self._estimates.clear()
            estimate = self._estimates[key] = estimate_rtt_ms(client, region_point(region))
        return estimate * self._corrections.get(region.name, 1.0)
