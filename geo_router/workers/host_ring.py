"""A ring of small records in a file every worker of a router maps: what one worker tells
its siblings at once, without a broker (geo_router.workers' prefix history and node health).

`create` (by the supervisor) writes an empty ring of `slots` fixed-size records; a worker
`append`s records under an exclusive `flock` of the file and reads its siblings' with
`read_since` (also under the lock, so no record is read half-written). `written()` is one
read of mapped memory: a worker checks it before each decision and locks only when a
sibling appended since its last look. A reader more than a ring behind (`slots` records
while it was stalled) skips what was overwritten; the users' records are hints that a later
record or the worker's own experience corrects. A record's payload is at most
`payload_bytes`; what it means is its user's.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from .mapped_file import MappedFile

_MAGIC = b"MRDRING1"
# magic, slots, payload bytes per record, records written so far (the next sequence number)
_HEADER = struct.Struct("<8sQQQ")
_WRITTEN_AT = 24
# sequence, writer (worker index), payload length
_RECORD_HEAD = struct.Struct("<QHH")


def _is_ring(mapped: mmap.mmap) -> bool:
    if len(mapped) < _HEADER.size:
        return False
    magic, slots, payload_bytes, _ = _HEADER.unpack_from(mapped, 0)
    return bool(magic == _MAGIC and len(mapped) == _HEADER.size + slots * (_RECORD_HEAD.size + payload_bytes))


class HostRing:
    """The mapped ring (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self._file = MappedFile(path, "worker ring", _is_ring)
        self._map = self._file.map
        _, self.slots, self.payload_bytes, _ = _HEADER.unpack_from(self._map, 0)
        self._record_bytes = _RECORD_HEAD.size + self.payload_bytes

    @staticmethod
    def create(path: Path, slots: int, payload_bytes: int) -> None:
        """An empty ring at `path` (private to the router's user)."""
        MappedFile.create(path, _HEADER.pack(_MAGIC, slots, payload_bytes, 0),
                          _HEADER.size + slots * (_RECORD_HEAD.size + payload_bytes))

    def written(self) -> int:
        return int.from_bytes(self._map[_WRITTEN_AT:_WRITTEN_AT + 8], "little")

    def append(self, writer: int, payloads: Iterable[bytes]) -> None:
        with self._locked():
            seq = self.written()
            for payload in payloads:
                if len(payload) > self.payload_bytes:
                    raise ValueError(f"a ring record holds {self.payload_bytes} bytes, not {len(payload)}")
                offset = self._offset(seq)
                _RECORD_HEAD.pack_into(self._map, offset, seq, writer, len(payload))
                start = offset + _RECORD_HEAD.size
                self._map[start:start + len(payload)] = payload
                seq += 1
            self._map[_WRITTEN_AT:_WRITTEN_AT + 8] = seq.to_bytes(8, "little")

    def read_since(self, seq: int) -> tuple[int, list[tuple[int, bytes]]]:
        """The records from sequence `seq` on that are still in the ring, as (writer, payload),
        and the sequence to read from next time."""
        out: list[tuple[int, bytes]] = []
        with self._locked():
            end = self.written()
            for n in range(max(seq, end - self.slots), end):
                offset = self._offset(n)
                got, writer, size = _RECORD_HEAD.unpack_from(self._map, offset)
                if got == n:
                    start = offset + _RECORD_HEAD.size
                    out.append((writer, self._map[start:start + size]))
        return end, out

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._file.lock()
        try:
            yield
        finally:
            self._file.unlock()

    def _offset(self, seq: int) -> int:
        return _HEADER.size + (seq % self.slots) * self._record_bytes


class RingReader:
    """One worker's place in a ring: its own records skipped, its siblings' handed over."""

    def __init__(self, ring: HostRing, worker: int) -> None:
        self.ring = ring
        self.worker = worker
        # A worker that replaces one that died starts from what the ring still holds.
        self._seen = 0

    def news(self) -> list[bytes]:
        """The siblings' records appended since the last call (one memory read when none)."""
        if self.ring.written() == self._seen:
            return []
        self._seen, records = self.ring.read_since(self._seen)
        return [payload for writer, payload in records if writer != self.worker]

    def tell(self, payloads: Iterable[bytes]) -> None:
        self.ring.append(self.worker, payloads)
