"""Weight origins: where model files live, behind one small protocol, opened by URI
scheme (file://, http(s)://, s3://, gs://, peer://)."""

from __future__ import annotations

from data_plane.weights.origins.base import (
    OriginDenied,
    OriginError,
    OriginFactory,
    OriginNotFound,
    OriginReadOnly,
    OriginUnavailable,
    OriginURI,
    Progress,
    WeightOrigin,
    open_origin,
    origin_schemes,
    register_origin,
)
from data_plane.weights.origins.file import FileOrigin
from data_plane.weights.origins.gcs import GcsOrigin
from data_plane.weights.origins.http import HttpOrigin
from data_plane.weights.origins.peer import PeerOrigin
from data_plane.weights.origins.s3 import S3Origin

register_origin("file", FileOrigin)
register_origin("http", HttpOrigin)
register_origin("https", HttpOrigin)
register_origin("s3", S3Origin)
register_origin("gs", GcsOrigin)
# Another node's cache in the same region (served by its node agent, cluster token).
register_origin("peer", PeerOrigin)

__all__ = [
    "FileOrigin",
    "GcsOrigin",
    "HttpOrigin",
    "OriginDenied",
    "OriginError",
    "OriginFactory",
    "OriginNotFound",
    "OriginReadOnly",
    "OriginURI",
    "OriginUnavailable",
    "PeerOrigin",
    "Progress",
    "S3Origin",
    "WeightOrigin",
    "open_origin",
    "origin_schemes",
    "register_origin",
]
