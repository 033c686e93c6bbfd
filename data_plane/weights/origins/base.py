"""The one small protocol every weight origin implements, its errors, and the registry
that opens an origin from a URI by scheme (`ORIGINS`, a `meridian.registry.Registry`
whose built-ins load lazily)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from meridian.registry import Registry
from meridian.settings.node import WeightSettings

# Called with the number of bytes just transferred (progress bars).
Progress = Callable[[int], None]


class OriginError(Exception):
    """An origin could not serve or store an object; the message names it."""


class OriginNotFound(OriginError):
    """The object does not exist at the origin."""


class OriginUnavailable(OriginError):
    """A transient failure (connection, timeout, 5xx, throttling): worth retrying."""


class OriginReadOnly(OriginError):
    """The origin cannot store objects (https://, peer://)."""


class OriginDenied(OriginError):
    """The origin refused the credentials (401/403)."""


@dataclass(frozen=True)
class OriginURI:
    """A parsed weight URI: scheme://authority/prefix (prefix without slashes at the ends)."""

    scheme: str
    authority: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> OriginURI:
        parts = urlsplit(uri)
        if not parts.scheme:
            raise OriginError(f"{uri!r} is not a URI (expected s3://, gs://, https://, file://, peer://)")
        return cls(parts.scheme.lower(), parts.netloc, parts.path.strip("/"))

    def key(self, name: str) -> str:
        """The object key of `name` under this URI's prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}/{self.prefix}".rstrip("/")


class WeightOrigin(Protocol):
    """Where model files live. Keys are paths relative to the origin URI's prefix."""

    uri: OriginURI

    @property
    def region(self) -> str | None:
        """Meridian region the bytes are stored in ("aws:eu-west-1"), when known."""
        ...

    async def size(self, name: str) -> int:
        """Size in bytes of an object; OriginNotFound if it does not exist."""
        ...

    async def read(self, name: str) -> bytes:
        """A whole (small) object, such as the manifest."""
        ...

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET)."""
        ...

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        """Store a local file as `name`, replacing it; readers never see a partial object."""
        ...

    async def write_bytes(self, name: str, data: bytes) -> None:
        """Store a small object (the manifest)."""
        ...

    async def aclose(self) -> None:
        """Release pooled connections."""
        ...


OriginFactory = Callable[[OriginURI, WeightSettings], WeightOrigin]

# Origins by URI scheme. Built-ins are imported on first use, so a node reading file://
# weights never loads the S3 or GCS clients; anything may register more schemes.
ORIGINS: Registry[OriginFactory] = Registry(
    "weight URI scheme",
    builtins={
        "file": "data_plane.weights.origins.file:FileOrigin",
        "http": "data_plane.weights.origins.http:HttpOrigin",
        "https": "data_plane.weights.origins.http:HttpOrigin",
        "s3": "data_plane.weights.origins.s3:S3Origin",
        "gs": "data_plane.weights.origins.gcs:GcsOrigin",
        # Another node's cache in the same region (served by its node agent, cluster token).
        "peer": "data_plane.weights.origins.peer:PeerOrigin",
    },
)


def open_origin(uri: str | OriginURI, settings: WeightSettings) -> WeightOrigin:
    """Open the origin a URI names; UnknownName for a scheme no origin is registered under."""
    parsed = uri if isinstance(uri, OriginURI) else OriginURI.parse(uri)
    return ORIGINS.get(parsed.scheme)(parsed, settings)
