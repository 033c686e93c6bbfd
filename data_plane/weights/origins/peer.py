"""peer://host:port[/<manifest digest>] — another node's cache, served by its node agent
under /v1/weights (data_plane.weights.peer_server) to nodes holding the cluster token."""

from __future__ import annotations

from pathlib import Path

import httpx

from data_plane.weights.origins.base import (
    OriginError,
    OriginReadOnly,
    OriginURI,
    Progress,
)
from data_plane.weights.origins.transport import (
    check_span,
    make_client,
    raise_for_status,
    range_header,
    ranged_body,
    transport_errors,
)
from meridian.settings.node import WeightSettings


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
        self._client = client or make_client(settings)

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
        with transport_errors(method, self.uri, name):
            resp = await self._client.request(method, self._url(name), headers={**self._headers, **headers})
        raise_for_status(resp, method, self.uri, name)
        return resp

    async def size(self, name: str) -> int:
        resp = await self._get(name, {}, method="HEAD")
        return int(resp.headers.get("content-length", "0"))

    async def read(self, name: str) -> bytes:
        return (await self._get(name, {})).content

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        check_span(start, end)
        if end == start:
            return b""
        resp = await self._get(name, range_header(start, end))
        return ranged_body(resp, start, end, self.uri, name)

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        raise OriginReadOnly("peers are read-only: push to the model's origin")

    async def write_bytes(self, name: str, data: bytes) -> None:
        raise OriginReadOnly("peers are read-only: push to the model's origin")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
