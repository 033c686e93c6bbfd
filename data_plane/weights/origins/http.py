"""https:// (and http://): any web server that honours Range requests, read-only."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

import httpx

from data_plane.weights.origins.base import (
    OriginError,
    OriginReadOnly,
    OriginUnavailable,
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
from meridian.settings.node import WeightSettings

# Statuses of a server that does not allow HEAD; the size is then asked with a GET.
_HEAD_REFUSED = frozenset({405, 501})
# Hub -> CDN is one hop, sometimes two; a chain longer than this is not a download.
_MAX_REDIRECTS = 5


class RedirectRefused(OriginError):
    """The origin redirected somewhere a node must not follow it."""


def redirect_refusal(origin: httpx.URL, target: httpx.URL, addresses: Iterable[str]) -> str | None:
    """Why a redirect from `origin` to `target` (whose host resolves to `addresses`) must not
    be followed, or None when it may.

    Model hubs redirect file URLs to their CDN, so redirects are followed, but only where a
    node should go: never from https down to http (the manifest comes this way too), and to
    another host only over https and only when every address of that host is public: a
    redirect must not make a node fetch from its own network (cloud metadata at
    169.254.169.254, a control plane, a peer) on an origin's say-so.
    """
    if origin.scheme == "https" and target.scheme != "https":
        return f"it leaves https for {target.scheme}"
    if target.host == origin.host and target.port == origin.port:
        return None
    if target.scheme != "https":
        return f"it leaves {origin.host} for another host over {target.scheme}"
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not ip.is_global or ip.is_multicast:
            return f"{target.host} is a non-public address ({ip})"
    return None


async def _addresses(host: str, port: int) -> list[str]:
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class HttpOrigin:
    """Objects are URLs under the origin URI; size by HEAD, bytes by ranged GET."""

    def __init__(self, uri: OriginURI, settings: WeightSettings) -> None:
        if uri.scheme not in ("http", "https") or not uri.authority:
            raise OriginError(f"{uri}: expected an http(s)://host/path URI")
        self.uri = uri
        origin = httpx.URL(f"{uri.scheme}://{uri.authority}/")

        async def check_redirect(response: httpx.Response) -> None:
            # Called for every answer: a redirect is vetted before httpx follows it.
            if not response.has_redirect_location:
                return
            target = response.request.url.join(response.headers["location"])
            addresses: list[str] = []
            # Only another host reached over https is judged by its addresses (the rest is
            # refused or allowed on its URL alone).
            if target.host != origin.host and target.scheme == "https":
                try:
                    addresses = await _addresses(target.host, target.port or 443)
                except OSError as exc:
                    raise OriginUnavailable(f"{uri}: redirected to {target.host}, which does not resolve: {exc}") from None
            why = redirect_refusal(origin, target, addresses)
            if why is not None:
                raise RedirectRefused(f"{uri}: not following the redirect to {target}: {why}")

        # Model hubs redirect file URLs to their CDN (vetted by check_redirect).
        self._client = make_client(settings, follow_redirects=True, max_redirects=_MAX_REDIRECTS,
                                   on_response=check_redirect)

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
