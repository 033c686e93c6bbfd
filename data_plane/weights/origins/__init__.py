"""Weight origins: where model files live, behind one small protocol, opened by URI
scheme (file://, http(s)://, s3://, gs://, peer://) through the `ORIGINS` registry.

The origin classes live in their own modules (`.file`, `.http`, `.s3`, `.gcs`, `.peer`)
and are imported only when a URI of their scheme is opened; importing this package
registers nothing and loads no client.
"""

from __future__ import annotations

from data_plane.weights.origins.base import (
    ORIGINS,
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
)

__all__ = [
    "ORIGINS",
    "OriginDenied",
    "OriginError",
    "OriginFactory",
    "OriginNotFound",
    "OriginReadOnly",
    "OriginURI",
    "OriginUnavailable",
    "Progress",
    "WeightOrigin",
    "open_origin",
]
