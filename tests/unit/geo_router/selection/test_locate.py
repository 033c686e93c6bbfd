"""Client location (edge header, GeoIP of a trustworthy address, default) and measured-RTT refinement."""

from __future__ import annotations

import ipaddress
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
from router_harness import REGIONS, router_settings
from starlette.datastructures import Headers

from geo_router.selection.locate import ClientLocator, RttEstimator, parse_ip
from meridian.contracts import RegionInfo
from meridian.geo import Point, estimate_rtt_ms, region_point

REGIONS_BY_NAME = {r.name: r for r in REGIONS.values()}
US, EU, APAC = REGIONS["us"], REGIONS["eu"], REGIONS["apac"]
DEFAULT = region_point(US)  # router_settings() puts unknown clients in aws:us-east-1
AMSTERDAM = Point(52.37, 4.89)
SYDNEY = Point(-33.87, 151.21)
SAO_PAULO = Point(-23.55, -46.63)

NETWORKS = {
    "81.0.0.0/8": AMSTERDAM,
    "203.0.113.0/24": SYDNEY,
    "2a00::/16": SAO_PAULO,
}


# --- a MaxMind DB writer, for a handful of networks ----------------------------------------------
# The format (https://maxmind.github.io/MaxMind-DB/): a binary search tree over the address bits,
# 16 zero bytes, a data section, "\xab\xcd\xefMaxMind.com" and a metadata map. IPv4 networks sit
# under ::/96 of an IPv6 tree, where readers look IPv4 addresses up.


class U16(int):
    pass


class U64(int):
    pass


def _control(type_: int, size: int) -> bytes:
    if size < 29:
        head, extra = size, b""
    elif size < 285:
        head, extra = 29, bytes([size - 29])
    else:
        head, extra = 30, (size - 285).to_bytes(2, "big")
    if type_ <= 7:
        return bytes([type_ << 5 | head]) + extra
    return bytes([head, type_ - 7]) + extra  # extended type: its number - 7 in the next byte


def encode(value: Any) -> bytes:
    if isinstance(value, str):
        raw = value.encode()
        return _control(2, len(raw)) + raw
    if isinstance(value, float):
        return _control(3, 8) + struct.pack(">d", value)
    if isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
        type_ = 5 if isinstance(value, U16) else 9 if isinstance(value, U64) else 6
        return _control(type_, len(raw)) + raw
    if isinstance(value, dict):
        return _control(7, len(value)) + b"".join(encode(k) + encode(v) for k, v in value.items())
    if isinstance(value, list):
        return _control(11, len(value)) + b"".join(encode(v) for v in value)
    raise TypeError(value)


def write_mmdb(path: Path, records: dict[str, dict[str, Any]], ip_version: int = 6) -> Path:
    width = 128 if ip_version == 6 else 32
    data = bytearray()
    tree: list[list[tuple[str, int] | None]] = [[None, None]]
    for cidr, record in records.items():
        network = ipaddress.ip_network(cidr)
        bits = int(network.network_address)
        prefix = network.prefixlen + (width - network.max_prefixlen)
        offset = len(data)
        data += encode(record)
        node = 0
        for i in range(prefix):
            bit = bits >> (width - 1 - i) & 1
            if i == prefix - 1:
                tree[node][bit] = ("data", offset)
                break
            child = tree[node][bit]
            if child is None:
                tree.append([None, None])
                child = tree[node][bit] = ("node", len(tree) - 1)
            node = child[1]
    count = len(tree)

    def pointer(entry: tuple[str, int] | None) -> bytes:
        value = count if entry is None else entry[1] if entry[0] == "node" else count + 16 + entry[1]
        return value.to_bytes(3, "big")

    search_tree = b"".join(pointer(left) + pointer(right) for left, right in tree)
    metadata = encode({
        "node_count": count, "record_size": U16(24), "ip_version": U16(ip_version),
        "database_type": "Meridian-Test-City", "languages": ["en"],
        "binary_format_major_version": U16(2), "binary_format_minor_version": U16(0),
        "build_epoch": U64(1_700_000_000), "description": {"en": "test networks"},
    })
    path.write_bytes(search_tree + bytes(16) + bytes(data) + b"\xab\xcd\xefMaxMind.com" + metadata)
    return path


def city(point: Point) -> dict[str, Any]:
    return {"city": {"names": {"en": "somewhere"}},
            "location": {"latitude": point.latitude, "longitude": point.longitude, "accuracy_radius": 20}}


@pytest.fixture
def geoip_db(tmp_path: Path) -> Path:
    return write_mmdb(tmp_path / "city.mmdb", {cidr: city(p) for cidr, p in NETWORKS.items()})


def locator(**overrides: Any) -> ClientLocator:
    return ClientLocator(router_settings(**overrides))


def locate(loc: ClientLocator, peer: str | None, *headers: tuple[str, str]) -> Point | None:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers]
    return loc.locate(Headers(raw=raw), peer, REGIONS_BY_NAME)


# --- where the client is ------------------------------------------------------------------------


def test_the_edge_header_wins_over_geoip(geoip_db: Path):
    loc = locator(geoip_database=geoip_db)
    assert locate(loc, "81.1.2.3", ("x-meridian-client-location", "-33.9,151.2")) == Point(-33.9, 151.2)
    assert locate(loc, "81.1.2.3", ("x-meridian-client-location", "onprem:tokyo-1")) == region_point(APAC)
    # A header that names no place is no location: the lookup decides.
    assert locate(loc, "81.1.2.3", ("x-meridian-client-location", "atlantis")) == AMSTERDAM


def test_geoip_locates_the_peer_address(geoip_db: Path):
    loc = locator(geoip_database=geoip_db)
    assert locate(loc, "81.200.0.1") == AMSTERDAM
    assert locate(loc, "203.0.113.77") == SYDNEY
    assert locate(loc, "2a00:1450:4001::1") == SAO_PAULO
    assert locate(loc, "::ffff:81.0.0.9") == AMSTERDAM  # a v4 client on a dual-stack socket
    # Not in the database, no address at all: the default.
    assert locate(loc, "10.1.2.3") == DEFAULT
    assert locate(loc, "2001:db8::1") == DEFAULT
    assert locate(loc, None) == DEFAULT
    assert locate(loc, "testclient") == DEFAULT


def test_without_a_database_clients_are_at_the_default():
    loc = locator()
    assert locate(loc, "81.200.0.1") == DEFAULT
    assert locate(locator(default_client_location="nowhere"), "81.200.0.1") is None


def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(geoip_db: Path):
    loc = locator(geoip_database=geoip_db)  # no trusted proxies at all
    assert locate(loc, "81.0.0.1", ("x-forwarded-for", "203.0.113.5")) == AMSTERDAM
    loc = locator(geoip_database=geoip_db, trusted_proxies=["10.0.0.0/8"])
    assert locate(loc, "81.0.0.1", ("x-forwarded-for", "203.0.113.5")) == AMSTERDAM


def test_behind_trusted_proxies_the_first_untrusted_hop_from_the_right_is_the_client(geoip_db: Path):
    loc = locator(geoip_database=geoip_db, trusted_proxies=["10.0.0.0/8", "fd00::/8"])
    assert locate(loc, "10.0.0.2", ("x-forwarded-for", "203.0.113.5")) == SYDNEY
    # The client wrote "81.0.0.1" itself; the edge proxy (10.0.0.1) saw 203.0.113.5 connect.
    forwarded = ("x-forwarded-for", "81.0.0.1, 203.0.113.5, 10.0.0.1")
    assert locate(loc, "10.0.0.2", forwarded) == SYDNEY
    # Several header lines are one list, in order.
    assert locate(loc, "fd00::2", ("x-forwarded-for", "81.0.0.1"), ("x-forwarded-for", "203.0.113.5:4711")) == SYDNEY
    assert locate(loc, "10.0.0.2", ("x-forwarded-for", "[2a00:1450::1]:443")) == SAO_PAULO
    # Only trusted hops: the farthest of them; no header: the proxy itself (not in the database).
    assert locate(loc, "10.0.0.2", ("x-forwarded-for", "10.9.9.9, 10.0.0.1")) == DEFAULT
    assert locate(loc, "10.0.0.2") == DEFAULT
    # Garbage where an address should be: nothing behind it is believed.
    assert locate(loc, "10.0.0.2", ("x-forwarded-for", "203.0.113.5, unknown")) == DEFAULT


def test_client_address_walks_only_past_trusted_proxies():
    loc = locator(trusted_proxies=["10.0.0.0/8", "192.0.2.7"])
    headers = Headers(raw=[(b"x-forwarded-for", b"1.1.1.1, 8.8.8.8, 192.0.2.7, 10.1.1.1")])
    assert loc.client_address(headers, "10.0.0.2") == ipaddress.ip_address("8.8.8.8")
    assert loc.client_address(headers, "9.9.9.9") == ipaddress.ip_address("9.9.9.9")
    assert loc.client_address(headers, None) is None


def test_parse_ip_takes_the_forms_proxies_write():
    assert parse_ip(" 1.2.3.4 ") == ipaddress.ip_address("1.2.3.4")
    assert parse_ip("1.2.3.4:8080") == ipaddress.ip_address("1.2.3.4")
    assert parse_ip("[2001:db8::1]:443") == ipaddress.ip_address("2001:db8::1")
    assert parse_ip("2001:db8::1") == ipaddress.ip_address("2001:db8::1")
    assert parse_ip("::ffff:1.2.3.4") == ipaddress.ip_address("1.2.3.4")
    for garbage in ("", None, "unknown", "_hidden", "[2001:db8::1", "1.2.3.4.5", "300.1.1.1"):
        assert parse_ip(garbage) is None


def test_an_unreadable_database_is_warned_about_once_and_never_fails_a_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="geo_router.selection.locate")
    broken = tmp_path / "broken.mmdb"
    broken.write_bytes(b"this is not a MaxMind database" * 100)
    for path in (broken, tmp_path / "missing.mmdb"):
        loc = locator(geoip_database=path)
        for _ in range(3):
            assert locate(loc, "81.0.0.1") == DEFAULT
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("cannot be read" in w for w in warnings)


def test_an_ipv4_only_database_places_ipv6_clients_at_the_default(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="geo_router.selection.locate")
    db = write_mmdb(tmp_path / "v4.mmdb", {"81.0.0.0/8": city(AMSTERDAM)}, ip_version=4)
    loc = locator(geoip_database=db)
    assert locate(loc, "81.0.0.1") == AMSTERDAM
    assert locate(loc, "2a00::1") == DEFAULT  # the reader refuses v6 lookups here
    assert locate(loc, "2a00::2") == DEFAULT
    assert [r.getMessage().startswith("GeoIP lookup failed") for r in caplog.records] == [True]


def test_a_bad_trusted_proxy_network_is_refused_at_start():
    with pytest.raises(ValueError, match="not-a-network"):
        locator(trusted_proxies=["10.0.0.0/8", "not-a-network"])


# --- how far each region is ------------------------------------------------------------------------


def region_at(name: str, point: Point) -> RegionInfo:
    return RegionInfo(name=name, provider="aws", location=name, zones=["us"],
                      latitude=point.latitude, longitude=point.longitude)


def test_rtt_is_the_great_circle_estimate_until_something_is_measured():
    rtt = RttEstimator("aws:us-east-1")
    assert rtt.rtt_ms(AMSTERDAM, EU) == pytest.approx(estimate_rtt_ms(AMSTERDAM, region_point(EU)))
    assert rtt.rtt_ms(None, EU) == 0.0  # unknown client: every region equally near


def test_measured_round_trips_correct_the_estimates_of_that_region():
    rtt = RttEstimator("aws:us-east-1")
    from_router = estimate_rtt_ms(region_point(US), region_point(EU))
    for _ in range(40):
        rtt.observe(EU, 2 * from_router, REGIONS_BY_NAME)  # the path to EU is twice as slow
    assert rtt.correction(EU.name) == pytest.approx(2.0, rel=0.01)
    plain = estimate_rtt_ms(AMSTERDAM, region_point(EU))
    assert rtt.rtt_ms(AMSTERDAM, EU) == pytest.approx(2 * plain, rel=0.01)
    # Other regions are untouched.
    assert rtt.rtt_ms(AMSTERDAM, APAC) == pytest.approx(estimate_rtt_ms(AMSTERDAM, region_point(APAC)))


def test_the_correction_moves_gradually_and_within_bounds():
    rtt = RttEstimator("38.9,-77.4")  # a point works as well as a region name
    from_router = estimate_rtt_ms(region_point(US), region_point(APAC))
    rtt.observe(APAC, 3 * from_router, REGIONS_BY_NAME)
    assert rtt.correction(APAC.name) == pytest.approx(1.4)  # one sample moves it a fifth of the way
    for _ in range(100):
        rtt.observe(APAC, 1000 * from_router, REGIONS_BY_NAME)
    assert rtt.correction(APAC.name) == pytest.approx(4.0)
    for _ in range(100):
        rtt.observe(APAC, from_router / 1000, REGIONS_BY_NAME)
    assert rtt.correction(APAC.name) == pytest.approx(0.5)


def test_measurements_that_say_nothing_about_the_route_are_not_learned():
    rtt = RttEstimator("aws:us-east-1")
    nearby = region_at("aws:us-east-2", Point(39.96, -83.0))  # ~500 km: estimate under 10 ms
    assert estimate_rtt_ms(region_point(US), region_point(nearby)) < 10
    for measured in (0.3, 50.0):
        rtt.observe(nearby, measured, REGIONS_BY_NAME)
    for measured in (0.0, -1.0, float("nan"), float("inf")):
        rtt.observe(EU, measured, REGIONS_BY_NAME)
    assert rtt.correction(nearby.name) == 1.0 and rtt.correction(EU.name) == 1.0
    # Without knowing where the router is, nothing can be compared.
    blind = RttEstimator(None)
    blind.observe(EU, 500.0, REGIONS_BY_NAME)
    assert blind.correction(EU.name) == 1.0
