"""A file every worker of a router maps and locks: what the rate-limit table
(geo_router.workers.host_buckets) and the rings (geo_router.workers.host_ring) are made of.

The supervisor `create`s it (private to the router's user, its size fixed, a header first);
each worker maps it whole for the rest of its life (a stream ending while the app stops
still writes to it) and serialises its writes with an exclusive `flock`, two system calls
of about a microsecond, never held across an await.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable
from pathlib import Path


class MappedFile:
    """`path` mapped read-write; ValueError when `valid` says its bytes are not `what`."""

    def __init__(self, path: Path, what: str, valid: Callable[[mmap.mmap], bool]) -> None:
        self._fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(self._fd, 0)
            if not valid(self.map):
                raise ValueError(f"{path} is not a {what}")
        except BaseException:
            os.close(self._fd)
            raise

    @staticmethod
    def create(path: Path, header: bytes, size: int) -> None:
        """A new file of `size` bytes starting with `header` (it must not exist yet)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "r+b") as f:
            f.truncate(size)
            f.write(header)

    def lock(self) -> None:
        """Take the file (blocks while another worker holds it: microseconds)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
