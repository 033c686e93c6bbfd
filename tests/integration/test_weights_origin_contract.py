"""The WeightOrigin contract, the same for every built-in origin: file://, https:// (nginx),
s3:// (moto) and gs:// (GCS emulator). Read-only origins get their objects put in
place by the test (files in nginx's root)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.nginx import NginxServer
from data_plane.weights.origins import (
    OriginNotFound,
    OriginReadOnly,
    WeightOrigin,
    open_origin,
)
from meridian.settings.node import WeightSettings

ORIGINS = ["file", "https", "s3", "gs"]


@dataclass
class Case:
    origin: WeightOrigin
    # Put an object in place: through the origin when it can store, else beside it.
    put: Callable[[str, bytes], Awaitable[None]]
    writable: bool


@pytest.fixture(params=ORIGINS)
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Case]:
    kind = request.param
    if kind == "file":
        origin = open_origin(f"file://{tmp_path}/store/models/tiny", WeightSettings())
    elif kind == "https":
        root = tmp_path / "www"
        (root / "models" / "tiny").mkdir(parents=True)
        nginx: NginxServer = request.getfixturevalue("nginx_server")(root)
        origin = open_origin(f"{nginx.url}/models/tiny", WeightSettings())

        async def put_file(name: str, data: bytes) -> None:
            path = root / "models" / "tiny" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        yield Case(origin, put_file, writable=False)
        await origin.aclose()
        return
    elif kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        origin = open_origin(f"s3://{bucket}/models/tiny", WeightSettings())
    else:
        bucket = request.getfixturevalue("gcs_bucket")
        origin = open_origin(f"gs://{bucket}/models/tiny", WeightSettings())
    yield Case(origin, origin.write_bytes, writable=True)
    await origin.aclose()


async def test_sizes_and_whole_reads(case: Case) -> None:
    data = os.urandom(5000)
    await case.put("meridian-manifest.json", b'{"format": "meridian.weights/v1"}')
    await case.put("sub/model.safetensors", data)
    assert await case.origin.size("sub/model.safetensors") == 5000
    assert await case.origin.read("sub/model.safetensors") == data
    assert await case.origin.read("meridian-manifest.json") == b'{"format": "meridian.weights/v1"}'


async def test_ranges_are_exact_including_the_last_partial_one(case: Case) -> None:
    data = os.urandom(10_000)
    await case.put("model.safetensors", data)
    chunk = 4096
    pieces = [
        await case.origin.read_range("model.safetensors", s, min(s + chunk, 10_000))
        for s in range(0, 10_000, chunk)
    ]
    assert [len(p) for p in pieces] == [4096, 4096, 1808]
    assert b"".join(pieces) == data
    assert await case.origin.read_range("model.safetensors", 0, 10_000) == data
    assert await case.origin.read_range("model.safetensors", 9999, 10_000) == data[-1:]
    assert await case.origin.read_range("model.safetensors", 123, 123) == b""


async def test_missing_objects_raise_not_found_naming_the_object(case: Case) -> None:
    with pytest.raises(OriginNotFound, match="absent.bin"):
        await case.origin.size("absent.bin")
    with pytest.raises(OriginNotFound, match="absent.bin"):
        await case.origin.read("absent.bin")
    with pytest.raises(OriginNotFound, match="absent.bin"):
        await case.origin.read_range("absent.bin", 0, 100)


async def test_write_stores_a_file_and_replaces_the_old_one(case: Case, tmp_path: Path) -> None:
    source = tmp_path / "upload.bin"
    source.write_bytes(os.urandom(20_000))
    progress: list[int] = []
    if not case.writable:
        with pytest.raises(OriginReadOnly):
            await case.origin.write("upload.bin", source, progress.append)
        return
    await case.origin.write_bytes("upload.bin", b"old")
    await case.origin.write("upload.bin", source, progress.append)
    assert sum(progress) == 20_000
    assert await case.origin.size("upload.bin") == 20_000
    assert await case.origin.read("upload.bin") == source.read_bytes()
