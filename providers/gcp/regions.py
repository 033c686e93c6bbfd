"""GCP regions Meridian can place replicas in: location and residency zones."""

from meridian.contracts import RegionInfo

# (location, latitude, longitude, zones) — coordinates of the data centre's metro area. Zone "eu"
# is EU member states only: London is "uk", Zurich "ch", Tel Aviv "il", Dammam "me".
_REGIONS = [
    ("us-central1", 41.3, -95.9, ["us"]),
    ("us-east1", 33.2, -80.0, ["us"]),
    ("us-east4", 39.0, -77.5, ["us"]),
    ("us-east5", 40.0, -83.0, ["us"]),
    ("us-south1", 32.8, -96.8, ["us"]),
    ("us-west1", 45.6, -121.2, ["us"]),
    ("us-west2", 34.1, -118.2, ["us"]),
    ("us-west3", 40.8, -111.9, ["us"]),
    ("us-west4", 36.2, -115.1, ["us"]),
    ("northamerica-northeast1", 45.5, -73.6, ["ca"]),
    ("northamerica-northeast2", 43.7, -79.4, ["ca"]),
    ("southamerica-east1", -23.5, -46.6, ["sa"]),
    ("europe-west1", 50.4, 3.8, ["eu"]),
    ("europe-west4", 53.4, 6.8, ["eu"]),
    ("europe-west3", 50.1, 8.7, ["eu"]),
    ("europe-central2", 52.2, 21.0, ["eu"]),
    ("europe-north1", 60.6, 27.2, ["eu"]),
    ("europe-west2", 51.5, -0.1, ["uk"]),
    ("europe-west6", 47.4, 8.5, ["ch"]),
    ("me-central2", 26.4, 50.1, ["me"]),
    ("me-west1", 32.1, 34.8, ["il"]),
    ("asia-east1", 24.1, 120.5, ["apac"]),
    ("asia-east2", 22.3, 114.2, ["apac"]),
    ("asia-northeast1", 35.7, 139.7, ["apac"]),
    ("asia-northeast3", 37.6, 127.0, ["apac"]),
    ("asia-south1", 19.1, 72.9, ["apac"]),
    ("asia-south2", 28.6, 77.2, ["apac"]),
    ("asia-southeast1", 1.3, 103.8, ["apac"]),
    ("asia-southeast2", -6.2, 106.8, ["apac"]),
    ("australia-southeast1", -33.9, 151.2, ["apac"]),
]


def regions() -> list[RegionInfo]:
    """GCP regions as `gcp:<region>` with their metro's coordinates and residency zones."""
    return [
        RegionInfo(name=f"gcp:{loc}", provider="gcp", location=loc, zones=zones, latitude=lat, longitude=lon)
        for loc, lat, lon, zones in _REGIONS
    ]
