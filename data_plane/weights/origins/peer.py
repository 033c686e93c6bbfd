"""peer://host:port[/<manifest digest>] — another node's cache, served by its node agent
under /v1/weights (data_plane.weights.peer_server) to nodes holding the cluster token."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from data_plane.weights.origins.base import (
    OriginDenied,
    OriginError,
    OriginNotFound,
    OriginReadOnly,
    OriginUnavailable,
    OriginURI,
    Progress,
)
from meridian.settings import WeightSettings

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class PeerOrigin:
    """Reads blobs (`blobs/<sha256>`) and model files (`<path>` under the URI's digest)."""

    def __init__(
        self, uri: OriginURI, settings: WeightSettings, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self.uri = uri
        self.base_url = f"http://{uri.authority}"
        token = settings.cluster_token.get_secret_value() if settings.cluster_token else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency),
        )

    @classmethod
    def for_node(cls, url: str, settings: WeightSettings, client: httpx.AsyncClient | None = None) -> PeerOrigin:
        """The peer origin of a node reachable at `url` (http://host:port)."""
        return cls(OriginURI("peer", url.split("://", 1)[-1].rstrip("/"), ""), settings, client=client)

    @property
    def region(self) -> str | None:
        return None

    def _url(self, name: str) -> str:
        if name.startswith("blobs/"):
            return f"{self.base_url}/v1/weights/{name}"
        if not self.uri.prefix:
            raise OriginError(f"{self.uri}: name a model as peer://host:port/<manifest digest>")
        return f"{self.base_url}/v1/weights/models/{self.uri.prefix}/{name}"

    async def _get(self, name: str, headers: dict[str, str], method: str = "GET") -> httpx.Response:
        url = self._url(name)
        try:
            resp = await self._client.request(method, url, headers={**self._headers, **headers})
        except httpx.HTTPError as exc:
            raise OriginUnavailable(f"peer {self.uri.authority}: {name}: {exc!r}") from exc
        if resp.status_code in (200, 206):
            return resp
        message = f"peer {self.uri.authority}: {name}: HTTP {resp.status_code}"
        if resp.status_code == 404:
            raise OriginNotFound(message)
        if resp.status_code in (401, 403):
            raise OriginDenied(message)
        if resp.status_code in (408, 429) or resp.status_code >= 500:
            raise OriginUnavailable(message)
        raise OriginError(message)

    async def size(self, name: str) -> int:
        resp = await self._get(name, {}, method="HEAD")
        return int(resp.headers.get("content-length", "0"))

    async def read(self, name: str) -> bytes:
        return (await self._get(name, {})).content

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        resp = await self._get(name, {"Range": f"bytes={start}-{end - 1}"})
        match = _CONTENT_RANGE.match(resp.headers.get("content-range", ""))
        if resp.status_code != 206 or not match or (int(match[1]), int(match[2])) != (start, end - 1):
            raise OriginUnavailable(f"peer {self.uri.authority}: {name}: answered a different range")
        return resp.content

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        raise OriginReadOnly("peers are read-only: push to the model's origin")

    async def write_bytes(self, name: str, data: bytes) -> None:
        raise OriginReadOnly("peers are read-only: push to the model's origin")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
