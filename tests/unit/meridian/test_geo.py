import pytest

from meridian.geo import Point, estimate_rtt_ms, haversine_km, parse_point

NEW_YORK = Point(40.71, -74.01)
LONDON = Point(51.51, -0.13)
TOKYO = Point(35.68, 139.69)


def test_haversine_matches_known_distance():
    # New York to London is about 5,570 km along the great circle.
    assert haversine_km(NEW_YORK, LONDON) == pytest.approx(5570, rel=0.01)
    assert haversine_km(LONDON, LONDON) == 0


def test_rtt_orders_regions_by_distance():
    assert estimate_rtt_ms(NEW_YORK, LONDON) < estimate_rtt_ms(NEW_YORK, TOKYO)
    # A transatlantic round trip is tens of milliseconds, not single digits or seconds.
    assert 50 < estimate_rtt_ms(NEW_YORK, LONDON) < 120


@pytest.mark.parametrize("text", ["", "1", "a,b", "91,0", "0,181", "nan,0", "1,2,3"])
def test_parse_point_rejects_garbage(text):
    assert parse_point(text) is None


def test_parse_point_accepts_coordinates():
    assert parse_point(" 52.5, 13.4") == Point(52.5, 13.4)
