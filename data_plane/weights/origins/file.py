"""file:///abs/dir: a local or mounted directory as a weight origin (the embedded default)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
from pathlib import Path, PurePosixPath

from data_plane.weights.origins.base import (
    OriginError,
    OriginNotFound,
    OriginURI,
    Progress,
)
from data_plane.weights.origins.transport import check_span
from meridian.settings.node import WeightSettings

_COPY_BYTES = 8 * 1024 * 1024


class FileOrigin:
    """Objects are files under one absolute directory; writes are atomic renames."""

    def __init__(self, uri: OriginURI, settings: WeightSettings) -> None:
        if uri.authority not in ("", "localhost"):
            raise OriginError(f"{uri}: file URIs name an absolute local path, as file:///abs/dir")
        self.uri = uri
        self.root = Path("/" + uri.prefix)

    @property
    def region(self) -> str | None:
        return None

    def path(self, name: str) -> Path:
        """The local path of object `name`; OriginError if it would leave the root."""
        p = PurePosixPath(name)
        if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
            raise OriginError(f"{name!r} is not a relative object name under {self.uri}")
        return self.root / p

    async def size(self, name: str) -> int:
        """Size in bytes of an object; OriginNotFound if it does not exist."""
        path = self.path(name)
        try:
            st = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError as e:
            raise OriginNotFound(f"{name!r} not found at {self.uri}") from e
        except OSError as e:
            raise OriginError(f"stat {name!r} at {self.uri} failed: {e}") from e
        if not stat.S_ISREG(st.st_mode):
            raise OriginNotFound(f"{name!r} at {self.uri} is not a file")
        return st.st_size

    async def read(self, name: str) -> bytes:
        """A whole (small) object."""
        path = self.path(name)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise OriginNotFound(f"{name!r} not found at {self.uri}") from e
        except OSError as e:
            raise OriginError(f"read {name!r} at {self.uri} failed: {e}") from e

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object."""
        check_span(start, end)
        path = self.path(name)
        try:
            data = await asyncio.to_thread(_pread, path, start, end - start)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise OriginNotFound(f"{name!r} not found at {self.uri}") from e
        except OSError as e:
            raise OriginError(f"read bytes [{start}, {end}) of {name!r} at {self.uri} failed: {e}") from e
        if len(data) != end - start:
            raise OriginError(
                f"bytes [{start}, {end}) of {name!r} at {self.uri}: the file ends after {start + len(data)} bytes"
            )
        return data

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        """Store a local file as `name`, replacing it; readers never see a partial object."""
        path = self.path(name)
        loop = asyncio.get_running_loop()

        def report(n: int) -> None:
            if progress is not None:
                loop.call_soon_threadsafe(progress, n)

        try:
            await asyncio.to_thread(_atomic_copy, source, path, report)
        except OSError as e:
            raise OriginError(f"write {name!r} to {self.uri} failed: {e}") from e

    async def write_bytes(self, name: str, data: bytes) -> None:
        """Store a small object."""
        path = self.path(name)
        try:
            await asyncio.to_thread(_atomic_write, path, data)
        except OSError as e:
            raise OriginError(f"write {name!r} to {self.uri} failed: {e}") from e

    async def aclose(self) -> None:
        """Nothing pooled to release."""


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        parts: list[bytes] = []
        got = 0
        # pread may return fewer bytes than asked (large reads, signals): loop to EOF.
        while got < length:
            chunk = os.pread(fd, length - got, offset + got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    # Same directory as the target so os.replace is a rename on one filesystem.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


def _publish(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    # The rename is only durable once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _atomic_copy(source: Path, path: Path, report: Progress) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        with open(source, "rb") as src, open(tmp, "xb") as dst:
            while chunk := src.read(_COPY_BYTES):
                dst.write(chunk)
                report(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        _publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        with open(tmp, "xb") as dst:
            dst.write(data)
            dst.flush()
            os.fsync(dst.fileno())
        _publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
