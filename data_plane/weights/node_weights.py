"""A node's weights: pull its model into the cache (peers first), keep it pinned while
served, point the engine at it, and share the cache with same-region peers."""

from __future__ import annotations

import asyncio
from pathlib import Path, PurePosixPath

from fastapi import APIRouter

from data_plane.agent import cluster_endpoint
from data_plane.weights.cache import NodeCache, ref_path
from data_plane.weights.peer_server import weights_router
from data_plane.weights.peers import ControlPlanePeers
from data_plane.weights.pull import PullProgress, PullReport, WeightPuller
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.cluster_client import ClusterClient
from meridian.settings.node import NodeSettings


def model_link(settings: NodeSettings) -> Path:
    """A stable path for the node's model_uri that engines (and vLLM) are given before the
    pull: the cache's ref of the URI, pointed at the cached model once it is there."""
    if settings.model_uri is None:
        raise ValueError("model_uri is not set")
    return ref_path(Path(settings.weights.cache_dir), settings.model_uri)


def name_from_uri(uri: str) -> str:
    """The default served name of a model pulled from `uri`: its last path segment."""
    path = PurePosixPath(uri.split("://", 1)[-1])
    return path.name or "model"


def with_model_uri(settings: NodeSettings) -> NodeSettings:
    """Settings whose model_dir/model_name follow model_uri (unchanged without one)."""
    if settings.model_uri is None:
        return settings
    return settings.model_copy(
        update={
            "model_dir": model_link(settings),
            "model_name": settings.model_name or name_from_uri(settings.model_uri),
        }
    )


class NodeWeights:
    """The weight cache of one node process and what it pulls, pins and shares, on the
    node's `clock` (retry backoffs, lock polls, a peer's wait, pull timings)."""

    def __init__(self, settings: NodeSettings, *, node_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        w = settings.weights
        self.cache = NodeCache(Path(w.cache_dir), budget_bytes=w.cache_budget_bytes, clock=clock)
        self._cp: ClusterClient | None = None
        peers = None
        if settings.control_plane_url and settings.region and w.peer_fetch:
            self._cp = ClusterClient(cluster_endpoint(settings))
            peers = ControlPlanePeers(self._cp, node_id=node_id, region=settings.region)
        self.puller = WeightPuller(w, self.cache, peers=peers, clock=clock)
        self.digests: list[str] = []
        self.report: PullReport | None = None

    def router(self) -> APIRouter:
        w = self.settings.weights
        # Answer a waiting peer before its read timeout, so it can try another source.
        return weights_router(self.cache, max_range_bytes=w.peer_max_range_bytes, wait_s=w.read_timeout_s / 2)

    async def scan(self) -> None:
        """Learn what the cache already holds (to advertise it to peers)."""
        models = await asyncio.to_thread(self.cache.models)
        self.digests = [m.digest for m in models]

    async def prepare(self, progress: PullProgress | None = None) -> PullReport:
        """Pull the node's model (which points its ref, the model link, at it) and pin it."""
        assert self.settings.model_uri is not None
        report = await self.puller.pull(self.settings.model_uri, progress=progress)
        digest = report.model.digest
        await asyncio.to_thread(self.cache.pin, digest)
        if digest not in self.digests:
            self.digests.append(digest)
        self.report = report
        return report

    async def aclose(self) -> None:
        if self.report is not None:
            self.cache.unpin(self.report.model.digest)
        await self.puller.aclose()
        if self._cp is not None:
            await self._cp.aclose()

