"""Which same-region nodes can serve a model's bytes: asked of the control plane, which
also checks residency against the node's region and records the node as fetching."""

from __future__ import annotations

import logging
from typing import Protocol

import httpx

from data_plane.weights.errors import ResidencyError
from data_plane.weights.manifest import Manifest
from meridian import residency
from meridian.contracts import WeightPeer, WeightSources, WeightSourcesRequest

log = logging.getLogger(__name__)


class PeerDirectory(Protocol):
    """Where peers are found and told about (the control plane, in a fabric)."""

    region: str

    async def sources(self, manifest: Manifest, origin_region: str | None) -> list[WeightPeer]:
        """Peers to fetch from, best first; ResidencyError if this node may not hold the model."""
        ...

    async def withdraw(self, digest: str) -> None:
        """This node stopped fetching (failed) or evicted the model."""
        ...


class ControlPlanePeers:
    """PeerDirectory over the control plane's /v1/weights API (cluster token)."""

    def __init__(self, client: httpx.AsyncClient, *, node_id: str, region: str) -> None:
        self._client = client
        self.node_id = node_id
        self.region = region

    async def sources(self, manifest: Manifest, origin_region: str | None) -> list[WeightPeer]:
        body = WeightSourcesRequest(node_id=self.node_id, zone=manifest.zone, origin_region=origin_region)
        try:
            resp = await self._client.post(
                f"/v1/weights/{manifest.digest}/sources", json=body.model_dump(mode="json")
            )
        except httpx.HTTPError as exc:
            return self._unreachable(manifest, exc)
        if resp.status_code == 403:
            raise ResidencyError(_detail(resp))
        if resp.status_code != 200:
            return self._unreachable(manifest, RuntimeError(f"HTTP {resp.status_code}: {_detail(resp)}"))
        answer = WeightSources.model_validate_json(resp.content)
        if not residency.admits(answer.node_zones, manifest.zone):
            raise ResidencyError(
                f"{manifest.name} is bound to zone {manifest.zone!r}; region {self.region} is in "
                f"{answer.node_zones}"
            )
        return [p for p in answer.peers if p.node_id != self.node_id]

    def _unreachable(self, manifest: Manifest, exc: Exception) -> list[WeightPeer]:
        if residency.is_bound(manifest.zone):
            # Without the control plane this node cannot tell which zones its region is in.
            raise ResidencyError(
                f"{manifest.name} is bound to zone {manifest.zone!r} and the control plane, which "
                f"knows this region's zones, is unreachable ({exc}); not fetching it"
            )
        log.warning("control plane unreachable, fetching %s without peers: %s", manifest.name, exc)
        return []

    async def withdraw(self, digest: str) -> None:
        try:
            await self._client.delete(f"/v1/weights/{digest}/nodes/{self.node_id}")
        except httpx.HTTPError as exc:
            log.debug("could not withdraw %s: %s", digest[:12], exc)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    return str(body.get("detail") or body.get("title") or body)[:300] if isinstance(body, dict) else str(body)[:300]
