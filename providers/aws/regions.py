"""AWS regions Meridian can place replicas in: location and residency zones."""

from meridian.contracts import RegionInfo

# (location, latitude, longitude, zones) — coordinates of the region's metro area. Zone "eu"
# is EU member states only: London is "uk" (outside EU law since 2020).
_REGIONS = [
    ("us-east-1", 38.9, -77.4, ["us"]),
    ("us-east-2", 40.0, -83.0, ["us"]),
    ("us-west-1", 37.4, -121.9, ["us"]),
    ("us-west-2", 45.8, -119.7, ["us"]),
    ("ca-central-1", 45.5, -73.6, ["ca"]),
    ("eu-west-1", 53.3, -6.3, ["eu"]),
    ("eu-west-2", 51.5, -0.1, ["uk"]),
    ("eu-central-1", 50.1, 8.7, ["eu"]),
    ("eu-north-1", 59.3, 18.1, ["eu"]),
    ("ap-northeast-1", 35.7, 139.7, ["apac"]),
    ("ap-northeast-2", 37.6, 127.0, ["apac"]),
    ("ap-southeast-1", 1.3, 103.8, ["apac"]),
    ("ap-southeast-2", -33.9, 151.2, ["apac"]),
    ("ap-southeast-3", -6.2, 106.8, ["apac"]),
    ("ap-south-1", 19.1, 72.9, ["apac"]),
    ("sa-east-1", -23.5, -46.6, ["sa"]),
]


def regions() -> list[RegionInfo]:
    """AWS regions as `aws:<region>` with their metro's coordinates and residency zones."""
    return [
        RegionInfo(name=f"aws:{loc}", provider="aws", location=loc, zones=zones, latitude=lat, longitude=lon)
        for loc, lat, lon, zones in _REGIONS
    ]
