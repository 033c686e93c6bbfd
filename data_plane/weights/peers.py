"""Which same-region nodes can serve a model's bytes: asked of the control plane, which
also checks residency against the node's region and records the node as fetching."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Protocol

from data_plane.weights.errors import ResidencyError
from data_plane.weights.manifest import Manifest
from meridian import residency
from meridian.cluster_client import ClusterAPIError, ClusterClient
from meridian.contracts import WeightPeer, WeightSourcesRequest

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

    def __init__(self, client: ClusterClient, *, node_id: str, region: str) -> None:
        self._client = client
        self.node_id = node_id
        self.region = region

    async def sources(self, manifest: Manifest, origin_region: str | None) -> list[WeightPeer]:
        body = WeightSourcesRequest(node_id=self.node_id, zone=manifest.zone, origin_region=origin_region)
        try:
            answer = await self._client.weight_sources(manifest.digest, body)
        except ClusterAPIError as exc:
            if exc.status == HTTPStatus.FORBIDDEN:
                raise ResidencyError(exc.detail) from exc
            return self._unreachable(manifest, exc)
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
            await self._client.withdraw_weights(digest, self.node_id)
        except ClusterAPIError as exc:
            log.debug("could not withdraw %s: %s", digest[:12], exc)

