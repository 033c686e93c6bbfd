"""The weights code's waits, on a ManualClock the tests move: an origin's retries of
transient failures, and a peer's wait for a blob this node is still downloading."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from node_testkit import advance_until_done, eventually

from data_plane.weights.cache import NodeCache
from data_plane.weights.manifest import Manifest, ManifestFile, build_manifest
from data_plane.weights.origins import OriginUnavailable
from data_plane.weights.origins.transport import retry_transient
from data_plane.weights.peer_server import weights_router
from meridian.clock import ManualClock
from meridian.settings.node import WeightSettings

CHUNK = 4096
WAIT_S = 5.0


# --- an origin's retries ------------------------------------------------------------------


async def test_transient_failures_are_retried_after_a_backoff_on_the_clock() -> None:
    clock = ManualClock()
    settings = WeightSettings(max_attempts=3, retry_base_s=1.0, retry_max_s=4.0)
    tried_at: list[float] = []

    async def flaky() -> str:
        tried_at.append(clock.monotonic())
        if len(tried_at) < 3:
            raise OriginUnavailable("HTTP 503")
        return "stored"

    retrying = asyncio.create_task(retry_transient(settings, clock, flaky))
    assert await advance_until_done(clock, retrying, settings.retry_max_s) == 2
    assert retrying.result() == "stored"
    # No attempt before its backoff has passed on the clock.
    assert len(tried_at) == 3 and tried_at[0] < tried_at[1] < tried_at[2]


async def test_retries_give_up_after_max_attempts() -> None:
    clock = ManualClock()
    settings = WeightSettings(max_attempts=3, retry_base_s=1.0, retry_max_s=4.0)
    attempts = 0

    async def down() -> None:
        nonlocal attempts
        attempts += 1
        raise OriginUnavailable("HTTP 503")

    retrying = asyncio.create_task(retry_transient(settings, clock, down))
    assert await advance_until_done(clock, retrying, settings.retry_max_s) == 2
    with pytest.raises(OriginUnavailable):
        await retrying
    assert attempts == 3


# --- a peer waiting for this node's download ----------------------------------------------


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(bytes(range(256)) * 64)  # four chunks
    return build_manifest(model, chunk_size=CHUNK)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[NodeCache, ManualClock, httpx.AsyncClient]]:
    clock = ManualClock()
    cache = NodeCache(tmp_path / "cache", clock=clock)
    app = FastAPI()
    app.include_router(weights_router(cache, max_range_bytes=1 << 20, wait_s=WAIT_S))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        yield cache, clock, client


def _blob(manifest: Manifest) -> ManifestFile:
    return next(f for f in manifest.files if f.path == "w.bin")


async def test_a_peer_waits_for_a_download_that_has_not_started_then_hears_503(
    node: tuple[NodeCache, ManualClock, httpx.AsyncClient], manifest: Manifest
) -> None:
    cache, clock, client = node
    cache.expect(manifest)
    asking = asyncio.create_task(client.get(f"/v1/weights/blobs/{_blob(manifest).sha256}"))
    # It polls on the node's clock until wait_s has passed on it.
    assert await advance_until_done(clock, asking, WAIT_S) == 1
    answer = asking.result()
    assert answer.status_code == 503 and "not started that download yet" in answer.text


async def test_a_peer_waits_for_chunks_in_flight_then_gets_them_or_503(
    node: tuple[NodeCache, ManualClock, httpx.AsyncClient], manifest: Manifest, tmp_path: Path
) -> None:
    cache, clock, client = node
    blob = _blob(manifest)
    data = (tmp_path / "model" / "w.bin").read_bytes()
    partial = cache.open_partial(blob)
    url = f"/v1/weights/blobs/{blob.sha256}"
    try:
        # Chunk 0 lands while the peer waits: it gets the bytes, and the clock never moved.
        asking = asyncio.create_task(client.get(url, headers={"Range": f"bytes=0-{CHUNK - 1}"}))
        await eventually(lambda: clock.sleepers > 0)  # waiting, on the node's clock
        assert not asking.done()
        partial.write(0, data[:CHUNK])
        partial.mark_done([0])
        answer = await asking
        assert answer.status_code == 206 and answer.content == data[:CHUNK]
        # Chunk 1 never lands: after wait_s on the node's clock the peer hears 503.
        asking = asyncio.create_task(client.get(url, headers={"Range": f"bytes={CHUNK}-{2 * CHUNK - 1}"}))
        assert await advance_until_done(clock, asking, WAIT_S) == 1
        answer = asking.result()
        assert answer.status_code == 503 and "not arrived here yet" in answer.text
    finally:
        cache.release_partial(partial, keep=False)
