"""gs:// origin against gcp-storage-emulator (GCS JSON API): media and resumable uploads,
exact ranged reads (the emulator honours Range), not-found, and no object visible
before its upload completes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from data_plane.weights.origins import (
    OriginError,
    OriginNotFound,
    OriginURI,
    open_origin,
)
from data_plane.weights.origins.gcs import GcsOrigin
from meridian.settings.node import WeightSettings

MIB = 1024 * 1024


def _settings() -> WeightSettings:
    # Resumable uploads start at the 5 MiB minimum threshold, in 5 MiB chunks.
    return WeightSettings(multipart_threshold_bytes=5 * MIB, multipart_part_bytes=5 * MIB)


@pytest.fixture
async def origin(gcs_bucket: str) -> AsyncIterator[GcsOrigin]:
    o = open_origin(f"gs://{gcs_bucket}/models/tiny", _settings())
    assert isinstance(o, GcsOrigin)
    yield o
    await o.aclose()


async def test_small_object_roundtrip_and_exact_ranges(origin: GcsOrigin) -> None:
    data = os.urandom(10_000)
    await origin.write_bytes("model.safetensors", data)
    assert await origin.size("model.safetensors") == 10_000
    assert await origin.read("model.safetensors") == data
    assert await origin.read_range("model.safetensors", 0, 4096) == data[:4096]
    assert await origin.read_range("model.safetensors", 8192, 10_000) == data[8192:]
    assert await origin.read_range("model.safetensors", 7, 7) == b""
    assert origin.region is None


async def test_ranges_beyond_the_object_are_errors(origin: GcsOrigin) -> None:
    await origin.write_bytes("small.bin", b"0123456789")
    with pytest.raises(OriginError, match="Content-Range"):
        await origin.read_range("small.bin", 5, 20)
    with pytest.raises(OriginError):
        await origin.read_range("small.bin", 50, 60)


async def test_missing_objects_and_buckets_are_not_found(origin: GcsOrigin) -> None:
    with pytest.raises(OriginNotFound, match="models/tiny/absent.bin"):
        await origin.size("absent.bin")
    with pytest.raises(OriginNotFound):
        await origin.read("absent.bin")
    with pytest.raises(OriginNotFound):
        await origin.read_range("absent.bin", 0, 10)
    no_bucket = open_origin("gs://no-such-bucket-here/x", _settings())
    try:
        with pytest.raises(OriginNotFound):
            await no_bucket.size("a.bin")
    finally:
        await no_bucket.aclose()


async def test_object_names_with_slashes_and_spaces(origin: GcsOrigin) -> None:
    name = "sub dir/w$eights+(1).bin"
    await origin.write_bytes(name, b"payload")
    assert await origin.read(name) == b"payload"
    assert await origin.size(name) == 7


async def test_resumable_upload_above_the_threshold(origin: GcsOrigin, tmp_path: Path) -> None:
    data = os.urandom(5 * MIB + 300 * 1024)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    progress: list[int] = []
    await origin.write("big.bin", source, progress.append)
    assert progress == [5 * MIB, 300 * 1024]
    assert await origin.size("big.bin") == len(data)
    assert await origin.read_range("big.bin", 5 * MIB - 3, 5 * MIB + 3) == data[5 * MIB - 3 : 5 * MIB + 3]
    assert await origin.read("big.bin") == data


async def test_an_interrupted_resumable_upload_publishes_nothing(origin: GcsOrigin, tmp_path: Path) -> None:
    await origin.write_bytes("weights.bin", b"the previous version")
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(5 * MIB + 300 * 1024))
    first_chunk_done = asyncio.Event()
    writing = asyncio.create_task(origin.write("weights.bin", source, lambda n: first_chunk_done.set()))
    await asyncio.wait_for(first_chunk_done.wait(), timeout=60)
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert await origin.read("weights.bin") == b"the previous version"
    assert await origin.size("weights.bin") == len(b"the previous version")


def test_json_api_urls_quote_the_whole_object_name() -> None:
    settings = WeightSettings(gcs_endpoint_url="https://storage.googleapis.com")
    origin = GcsOrigin(OriginURI.parse("gs://bucket/org/model"), settings)
    assert origin.object_url("a b/c.bin") == (
        "https://storage.googleapis.com/storage/v1/b/bucket/o/org%2Fmodel%2Fa%20b%2Fc.bin"
    )
