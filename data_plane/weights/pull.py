"""Fill the node cache with a model: read its manifest, check residency, take every
missing byte from same-region peers first and the origin last, publish the model."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from data_plane.weights.cache import CachedModel, NodeCache
from data_plane.weights.errors import ResidencyError, WeightStoreError, first_error
from data_plane.weights.fetcher import RangeFetcher, Source
from data_plane.weights.manifest import MANIFEST_NAME, Manifest, ManifestError
from data_plane.weights.origins import (
    OriginError,
    OriginNotFound,
    WeightOrigin,
    open_origin,
)
from data_plane.weights.origins.peer import PeerOrigin
from data_plane.weights.origins.transport import make_client
from data_plane.weights.peers import PeerDirectory
from meridian import residency
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.node import WeightSettings

log = logging.getLogger(__name__)


class PullProgress(Protocol):
    """What a progress bar needs: the total once known, then bytes as they land."""

    def begin(self, manifest: Manifest, total_bytes: int, cached_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


@dataclass
class PullReport:
    """A model in the cache, and how it got there."""

    model: CachedModel
    seconds: float
    fetched: Counter[str] = field(default_factory=Counter)

    @property
    def fetched_bytes(self) -> int:
        return sum(self.fetched.values())

    @property
    def source(self) -> str:
        """"cache" when nothing was fetched, else "peer", "origin" or "peer+origin"."""
        kinds = sorted({name.split(" ", 1)[0] for name, n in self.fetched.items() if n})
        return "+".join(kinds) if kinds else "cache"


class WeightPuller:
    """Pulls models into one NodeCache. One per node: its fetcher bounds the ranges in
    flight across everything it pulls. `clock` times the pulls and the fetcher's retries."""

    def __init__(
        self, settings: WeightSettings, cache: NodeCache, *, peers: PeerDirectory | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self.peers = peers
        self._clock = clock
        self.fetcher = RangeFetcher(settings, cache, clock=clock)
        self._peer_client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._peer_client is not None:
            await self._peer_client.aclose()
            self._peer_client = None

    async def read_manifest(self, origin: WeightOrigin) -> Manifest:
        """The manifest stored at the origin; WeightStoreError naming the URI otherwise."""
        try:
            raw = await origin.read(MANIFEST_NAME)
        except OriginNotFound:
            raise WeightStoreError(
                f"{origin.uri} has no {MANIFEST_NAME}; upload the model with `meridian model push`"
            ) from None
        try:
            return Manifest.parse(raw)
        except ManifestError as exc:
            raise WeightStoreError(f"{origin.uri}/{MANIFEST_NAME}: {exc}") from None

    async def pull(self, uri: str, *, progress: PullProgress | None = None) -> PullReport:
        """Make the model at `uri` a published model in the cache; the report says from where."""
        began = self._clock.monotonic()
        origin = open_origin(uri, self.settings)
        try:
            try:
                manifest = await self.read_manifest(origin)
            except OriginError as exc:
                cached = self._cached_for(uri)
                if cached is None:
                    raise WeightStoreError(f"cannot read the manifest at {uri}: {exc}") from exc
                # Static stability: a cached model still starts while its origin is down.
                log.warning("origin unreachable (%s); starting from the cached copy of %s", exc, uri)
                if progress is not None:
                    progress.begin(cached.manifest, cached.size, cached.size)
                return PullReport(cached, self._clock.monotonic() - began)
            report = await self._pull_manifest(manifest, origin, progress)
            await asyncio.to_thread(self.cache.write_ref, uri, manifest.digest)
            report.seconds = self._clock.monotonic() - began
            return report
        finally:
            await origin.aclose()

    def _cached_for(self, uri: str) -> CachedModel | None:
        digest = self.cache.read_ref(uri)
        return self.cache.lookup(digest) if digest else None

    async def _pull_manifest(
        self, manifest: Manifest, origin: WeightOrigin, progress: PullProgress | None
    ) -> PullReport:
        cached = self.cache.lookup(manifest.digest)
        if cached is not None:
            self.cache.touch(manifest.digest)
            if progress is not None:
                progress.begin(manifest, manifest.total_bytes, manifest.total_bytes)
            return PullReport(cached, 0.0)
        # Peers asking for these blobs before the first byte arrives wait instead of
        # hearing "not here" and going to the origin.
        self.cache.expect(manifest)
        try:
            sources = await self._sources(manifest, origin)
            needed = await asyncio.to_thread(self.cache.reserve, manifest)
            if progress is not None:
                progress.begin(manifest, manifest.total_bytes, manifest.total_bytes - needed)
            fetched: Counter[str] = Counter()
            advance = progress.advance if progress is not None else None
            async with asyncio.TaskGroup() as group:
                for f in manifest.files:
                    group.create_task(self.fetcher.fetch_file(f, sources, advance, fetched))
            path = await asyncio.to_thread(self.cache.publish_model, manifest)
        except BaseExceptionGroup as eg:
            await self._withdraw(manifest)
            raise first_error(eg) from None
        except BaseException:
            await self._withdraw(manifest)
            raise
        finally:
            self.cache.unexpect(manifest)
        model = self.cache.lookup(manifest.digest)
        if model is None:  # pragma: no cover - publish_model just made it
            raise WeightStoreError(f"{path} vanished right after it was published")
        log.info("cached %s (%s) from %s", manifest.name, manifest.digest[:12], dict(fetched) or "cache")
        return PullReport(model, 0.0, fetched)

    async def _withdraw(self, manifest: Manifest) -> None:
        if self.peers is not None:
            await self.peers.withdraw(manifest.digest)

    async def _sources(self, manifest: Manifest, origin: WeightOrigin) -> list[Source]:
        peers = []
        if self.peers is not None:
            for peer in await self.peers.sources(manifest, origin.region):
                peers.append(Source(f"peer {peer.node_id}", self._peer_origin(peer.url), by_digest=True))
        elif residency.is_bound(manifest.zone):
            log.warning(
                "%s is bound to zone %r; no control plane to check this node's zone (operator pull)",
                manifest.name, manifest.zone,
            )
        return [*peers, Source(f"origin {origin.uri}", origin)]

    def _peer_origin(self, url: str) -> PeerOrigin:
        if self._peer_client is None:
            self._peer_client = make_client(self.settings)
        return PeerOrigin.for_node(url, self.settings, client=self._peer_client)



__all__ = ["PullProgress", "PullReport", "ResidencyError", "WeightPuller"]
