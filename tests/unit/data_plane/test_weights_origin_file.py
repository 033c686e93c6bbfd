"""file:// origin: sizes, exact ranges, atomic replacement, and names that stay under the root."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from data_plane.weights.origins import (
    OriginError,
    OriginNotFound,
    OriginURI,
    open_origin,
)
from data_plane.weights.origins.file import FileOrigin
from meridian.registry import UnknownName
from meridian.settings.node import WeightSettings


@pytest.fixture
def origin(tmp_path: Path) -> FileOrigin:
    o = open_origin(f"file://{tmp_path}/store", WeightSettings())
    assert isinstance(o, FileOrigin)
    return o


def test_an_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(UnknownName) as err:
        open_origin("ftp://host/models/tiny", WeightSettings())
    assert err.value.name == "ftp"
    assert {"file", "gs", "http", "https", "peer", "s3"} <= set(err.value.known)
    assert "known: file, gs, http, https, peer, s3" in str(err.value)


def _visible_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_write_then_read_back_whole_and_in_ranges(origin: FileOrigin, tmp_path: Path) -> None:
    data = os.urandom(10_000)
    source = tmp_path / "src.bin"
    source.write_bytes(data)
    seen: list[int] = []
    await origin.write("model/weights.bin", source, seen.append)
    assert sum(seen) == len(data)
    assert await origin.size("model/weights.bin") == len(data)
    assert await origin.read("model/weights.bin") == data
    assert await origin.read_range("model/weights.bin", 0, 4096) == data[:4096]
    assert await origin.read_range("model/weights.bin", 8192, 10_000) == data[8192:]
    assert await origin.read_range("model/weights.bin", 5, 5) == b""
    assert origin.region is None
    # Only the object itself is left in the store: no temporary files.
    assert _visible_files(tmp_path / "store") == ["model/weights.bin"]


async def test_write_bytes_replaces_an_object(origin: FileOrigin) -> None:
    await origin.write_bytes("meridian-manifest.json", b'{"v": 1}')
    await origin.write_bytes("meridian-manifest.json", b'{"v": 2, "longer": true}')
    assert await origin.read("meridian-manifest.json") == b'{"v": 2, "longer": true}'


async def test_missing_objects_are_not_found(origin: FileOrigin) -> None:
    with pytest.raises(OriginNotFound, match="absent.bin"):
        await origin.size("absent.bin")
    with pytest.raises(OriginNotFound):
        await origin.read("absent.bin")
    with pytest.raises(OriginNotFound):
        await origin.read_range("absent.bin", 0, 10)


async def test_a_range_past_the_end_is_an_error_not_a_short_read(origin: FileOrigin) -> None:
    await origin.write_bytes("small.bin", b"0123456789")
    with pytest.raises(OriginError, match="ends after 10 bytes"):
        await origin.read_range("small.bin", 5, 20)


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "a/../../b", ""])
async def test_names_cannot_leave_the_root(origin: FileOrigin, name: str) -> None:
    with pytest.raises(OriginError):
        await origin.read(name)


def test_only_absolute_local_paths() -> None:
    with pytest.raises(OriginError, match="absolute"):
        FileOrigin(OriginURI.parse("file://somehost/dir"), WeightSettings())
    assert FileOrigin(OriginURI.parse("file:///srv/models"), WeightSettings()).root == Path("/srv/models")


@contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG, as they would on a full disk."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


async def test_a_write_that_fails_midway_leaves_the_old_object_and_no_partial_file(
    origin: FileOrigin, tmp_path: Path
) -> None:
    await origin.write_bytes("weights.bin", b"old contents")
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 * 1024 * 1024))
    with _file_size_limit(1024 * 1024), pytest.raises(OriginError, match="weights.bin"):
        await origin.write("weights.bin", source)
    assert await origin.read("weights.bin") == b"old contents"
    assert _visible_files(tmp_path / "store") == ["weights.bin"]
