"""A small fixed world for the placement tests: regions of three providers in three zones, and offerings."""

from __future__ import annotations

from control_plane.placement.problem import ReplicaShape
from meridian.contracts import RegionInfo
from providers.offerings import Offering

# name, zone, latitude, longitude, price factor (GCP a little cheaper; second regions a little dearer)
_REGIONS = [
    ("aws:us-east-1", "us", 38.9, -77.4, 1.0),
    ("aws:us-east-2", "us", 40.0, -83.0, 1.05),
    ("gcp:us-east4", "us", 39.0, -77.5, 0.9),
    ("aws:us-west-2", "us", 45.8, -119.7, 1.0),
    ("gcp:us-west1", "us", 45.6, -121.2, 0.9),
    ("aws:eu-central-1", "eu", 50.1, 8.7, 1.0),
    ("gcp:europe-west4", "eu", 53.4, 6.8, 0.9),
    ("gcp:europe-west1", "eu", 50.4, 3.8, 0.95),
    ("onprem:fra-dc1", "eu", 50.11, 8.68, 0.5),
    ("aws:ap-northeast-1", "apac", 35.7, 139.7, 1.0),
]

# Replica shapes of one model: an L4 replica (1 GPU) and an H100 replica (1 GPU, 4× the tokens).
SHAPES = {"L4-24GB": ReplicaShape(1, 500.0), "H100-80GB-SXM": ReplicaShape(1, 2000.0)}


def make_regions() -> dict[str, RegionInfo]:
    out = {}
    for name, zone, lat, lon, _ in _REGIONS:
        provider, location = name.split(":")
        out[name] = RegionInfo(name=name, provider=provider, location=location, zones=[zone],  # type: ignore[arg-type]
                               latitude=lat, longitude=lon)
    return out


def make_offerings() -> list[Offering]:
    """Per region: 1-GPU L4 ($1/h × factor) and 8-GPU H100 ($40/h × factor); on-prem has H100 only.
    AWS sells spot."""
    out = []
    for name, _, _, _, factor in _REGIONS:
        provider = name.split(":")[0]
        if provider != "onprem":
            spot = 0.3 if provider == "aws" else None
            out.append(Offering(provider, name, f"{provider}-l4-1", "L4-24GB", 1, 8, 32, round(factor, 3), spot))
        out.append(Offering(provider, name, f"{provider}-h100-8", "H100-80GB-SXM", 8, 192, 2048, round(40.0 * factor, 3),
                            12.0 if provider == "aws" else None))
    return out

