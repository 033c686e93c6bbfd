"""GCP regions Meridian can place replicas in: location and residency zones."""

from meridian.contracts import RegionInfo

_REGIONS = [
    ("us-central1", 41.3, -95.9, ["us"]),
    ("us-east4", 39.0, -77.5, ["us"]),
    ("us-west1", 45.6, -121.2, ["us"]),
    ("europe-west1", 50.4, 3.8, ["eu"]),
    ("europe-west4", 53.4, 6.8, ["eu"]),
    ("europe-west3", 50.1, 8.7, ["eu"]),
    ("asia-northeast1", 35.7, 139.7, ["apac"]),
    ("asia-southeast1", 1.3, 103.8, ["apac"]),
    ("australia-southeast1", -33.9, 151.2, ["apac"]),
]


def regions() -> list[RegionInfo]:
    return [
        RegionInfo(name=f"gcp:{loc}", provider="gcp", location=loc, zones=zones, latitude=lat, longitude=lon)
        for loc, lat, lon, zones in _REGIONS
    ]
