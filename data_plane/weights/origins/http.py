"""https:// (and http://): any web server that honours Range requests, read-only."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from data_plane.weights.origins.base import (
    OriginError,
    OriginReadOnly,
    OriginURI,
    Progress,
)
from data_plane.weights.origins.transport import (
    check_span,
    content_range_total,
    describe,
    make_client,
    raise_for_status,
    range_header,
    ranged_body,
    transport_errors,
)
from meridian.settings import WeightSettings

# Statuses of a server that does not allow HEAD; the size is then asked with a GET.
_HEAD_REFUSED = frozenset({405, 501})


class HttpOrigin:
    """Objects are URLs under the origin URI; size by HEAD, bytes by ranged GET."""

    def __init__(self, uri: OriginURI, settings: WeightSettings) -> None:
        if uri.scheme not in ("http", "https") or not uri.authority:
            raise OriginError(f"{uri}: expected an http(s)://host/path URI")
        self.uri = uri
        # Model hubs redirect file URLs to their CDN.
        self._client = make_client(settings, follow_redirects=True)

    @property
    def region(self) -> str | None:
        return None

    def url(self, name: str) -> str:
        """The URL of object `name`."""
        # The prefix is already a URL path as the user wrote it; names are raw.
        base = f"{self.uri.scheme}://{self.uri.authority}"
        path = quote(name, safe="/")
        return f"{base}/{self.uri.prefix}/{path}" if self.uri.prefix else f"{base}/{path}"

    async def size(self, name: str) -> int:
        """Size in bytes from HEAD, or from a one-byte ranged GET when HEAD is refused."""
        with transport_errors("HEAD", self.uri, name):
            response = await self._client.head(self.url(name))
        if response.status_code not in _HEAD_REFUSED:
            raise_for_status(response, "HEAD", self.uri, name)
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                return int(length)
        return await self._size_by_get(name)

    async def _size_by_get(self, name: str) -> int:
        with transport_errors("GET", self.uri, name):
            async with self._client.stream("GET", self.url(name), headers=range_header(0, 1)) as response:
                # An empty object cannot satisfy bytes=0-0: 416 with "bytes */0".
                if response.status_code in (206, 416):
                    total = content_range_total(response)
                    if total is not None:
                        return total
                raise_for_status(response, "GET", self.uri, name)
                length = response.headers.get("Content-Length")
                if response.status_code == 200 and length is not None and length.isdigit():
                    # Range ignored: the headers are enough, the body is not read.
                    return int(length)
        raise OriginError(f"size of {describe(self.uri, name)}: the server states no length")

    async def read(self, name: str) -> bytes:
        """A whole (small) object."""
        with transport_errors("GET", self.uri, name):
            response = await self._client.get(self.url(name))
        raise_for_status(response, "GET", self.uri, name)
        return response.content

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET, answered 206 exactly)."""
        check_span(start, end)
        if start == end:
            return b""
        with transport_errors("GET", self.uri, name):
            response = await self._client.get(self.url(name), headers=range_header(start, end))
        raise_for_status(response, "GET", self.uri, name, f"bytes [{start}, {end})")
        return ranged_body(response, start, end, self.uri, name)

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        """Refused: plain web servers are read-only origins."""
        raise OriginReadOnly(
            f"cannot store {describe(self.uri, name)}: {self.uri.scheme}:// origins are read-only"
        )

    async def write_bytes(self, name: str, data: bytes) -> None:
        """Refused: plain web servers are read-only origins."""
        raise OriginReadOnly(
            f"cannot store {describe(self.uri, name)}: {self.uri.scheme}:// origins are read-only"
        )

    async def aclose(self) -> None:
        """Release pooled connections."""
        await self._client.aclose()
