"""Read safetensors files ourselves: strict header checks, zero-copy mmap on CPU, and a staged
path to an accelerator that reads into reused (pinned) buffers while earlier ones are copying.

File layout (https://github.com/huggingface/safetensors#format): an 8-byte little-endian u64 N,
N bytes of UTF-8 JSON mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the data section that follows the header) plus an optional
"__metadata__" object of strings, then the data section, which the tensors tile exactly.

`stream_tensors(files, device, dtype)` takes files from an iterable that may block between
items (shards still downloading): a file is opened only when the iterable hands it over, and
every tensor of it is yielded before the next file is asked for. `dtype` converts
floating-point tensors (a copy); integer and bool tensors keep theirs. `on_header` sees each
file's validated header before any of its data is read, so a caller can refuse a checkpoint
early.

CPU (the default off-staging path): tensors view a private (MAP_PRIVATE) mapping of the file.
Nothing is copied, pages are read on first touch, and the mapping lives as long as any tensor
does. A write to such a tensor copies the touched page into memory private to this process; it
never reaches the cache file and no other process sees it. The file may be unlinked while
mapped (the pages stay valid) but must not be truncated or rewritten in place: a node cache
replaces files by rename. Another device without staging gets the mapped tensors `.to(device)`.

Staged (the default for any device but the CPU): `buffers` reused buffers of up to
`buffer_bytes`, pinned when the device is CUDA. `read_threads` parallel preads fill one buffer
while the copies out of the others run on a side CUDA stream (non_blocking, one event per
buffer: a buffer is refilled only once its copies are done). A tensor larger than a buffer is
split across several; small tensors share one. Without CUDA the same pipeline runs with plain
buffers and synchronous copies, which is how it is tested on CPU-only machines.
"""

from __future__ import annotations

import bisect
import json
import math
import mmap
import os
import struct
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from meridian.cpus import usable_cpus

# Same bound as the reference implementation: a header is metadata, never weights.
MAX_HEADER_BYTES = 100_000_000
DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_BUFFERS = 3
# Below this a read is not worth handing to another thread.
MIN_READ_BYTES = 1024 * 1024
MAX_READ_THREADS = 16

_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
# The safetensors dtypes this torch build can hold (older builds lack the F8 and U16+ types).
SAFETENSORS_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType({
    name: dt for name, attr in _TORCH_NAMES.items()
    if isinstance(dt := getattr(torch, attr, None), torch.dtype)
})

OnHeader = Callable[["SafetensorsHeader"], None]


class SafetensorsError(ValueError):
    """A safetensors file is malformed, truncated or unreadable."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor's entry in the header; start/end are offsets into the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated header: tensors in file order, and where the data section lies."""

    path: Path
    data_start: int  # absolute file offset of the data section (8 + header length)
    data_size: int
    tensors: tuple[TensorSpec, ...]  # sorted by start
    metadata: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of one safetensors file."""
    fd = _open(path)
    try:
        return _read_header_fd(Path(path), fd)
    finally:
        os.close(fd)


def load_file(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of one file; on CPU they view a private mapping of it (see module doc)."""
    return dict(stream_tensors([path], device, dtype))


def stream_tensors(
    files: Iterable[str | os.PathLike[str]],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    staged: bool | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    buffers: int = DEFAULT_BUFFERS,
    read_threads: int | None = None,
    on_header: OnHeader | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) on `device` for every tensor of `files`, each as soon as it is ready."""
    target = torch.device(device)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type, not {dtype}")
    if buffer_bytes < 1 or buffers < 1:
        raise ValueError("buffer_bytes and buffers must be positive")
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors data is little-endian; big-endian hosts are not supported")
    if staged if staged is not None else target.type != "cpu":
        threads = read_threads or min(MAX_READ_THREADS, usable_cpus())
        return _StagedLoad(target, dtype, buffer_bytes, buffers, threads, on_header).run(files)
    return _mapped(files, target, dtype, on_header)


# --- header -----------------------------------------------------------------------------


def _open(path: str | os.PathLike[str]) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SafetensorsError(path, "no such file") from None
    except OSError as e:
        raise SafetensorsError(path, f"cannot open: {e.strerror}") from e


def _pread_exact(fd: int, size: int, offset: int, path: Path, what: str) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise SafetensorsError(path, f"file ends inside the {what} (truncated?)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_header_fd(path: Path, fd: int) -> SafetensorsHeader:
    file_size = os.fstat(fd).st_size
    if file_size < 8:
        raise SafetensorsError(path, f"file is {file_size} bytes, too short for the 8-byte header length")
    (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path, "header length"))
    if length > MAX_HEADER_BYTES:
        raise SafetensorsError(path, f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if length > file_size - 8:
        raise SafetensorsError(
            path, f"header length {length} runs past the end of the {file_size}-byte file (truncated?)")
    if length < 2:
        raise SafetensorsError(path, f"header length {length} is too short for a JSON object")
    raw = _pread_exact(fd, length, 8, path, "header")
    return parse_header(path, raw, data_start=8 + length, data_size=file_size - 8 - length)


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_uint(x: object) -> bool:
    # JSON has no integer bound and bool is an int in Python: refuse both.
    return type(x) is int and 0 <= x < 2**64


def parse_header(path: Path, raw: bytes, *, data_start: int, data_size: int) -> SafetensorsHeader:
    """Validate header bytes against a data section of `data_size` bytes at `data_start`."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise SafetensorsError(path, "header is not valid UTF-8") from None
    except _DuplicateKeyError as e:
        raise SafetensorsError(path, f"header has a {e}") from None
    except json.JSONDecodeError as e:
        raise SafetensorsError(path, f"header is not valid JSON ({e.msg} at byte {e.pos})") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(path, f"header is a JSON {type(obj).__name__}, not an object")
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsError(path, "__metadata__ must be an object of strings")

    specs: list[TensorSpec] = []
    for name, entry in obj.items():
        specs.append(_tensor_spec(path, name, entry, data_size))
    specs.sort(key=lambda s: (s.start, s.end))

    # Like the reference implementation: the tensors tile the data section exactly, so no
    # byte belongs to two tensors and none is unaccounted for.
    pos, prev = 0, None
    for spec in specs:
        if spec.start < pos:
            raise SafetensorsError(
                path, f"tensor {spec.name!r} data_offsets [{spec.start}, {spec.end}] overlap "
                      f"tensor {prev!r}, which ends at {pos}")
        if spec.start > pos:
            raise SafetensorsError(
                path, f"data section has a gap of {spec.start - pos} bytes before tensor {spec.name!r}")
        pos, prev = spec.end, spec.name
    if pos != data_size:
        raise SafetensorsError(
            path, f"tensors cover {pos} bytes but the data section has {data_size} (trailing bytes)")
    return SafetensorsHeader(path, data_start, data_size, tuple(specs), dict(metadata))


def _tensor_spec(path: Path, name: str, entry: object, data_size: int) -> TensorSpec:
    if not isinstance(entry, dict):
        raise SafetensorsError(path, f"tensor {name!r}: entry is not an object")
    st_dtype = entry.get("dtype")
    dtype = SAFETENSORS_DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
    if dtype is None:
        raise SafetensorsError(
            path, f"tensor {name!r}: unknown or unsupported dtype {st_dtype!r} "
                  f"(known: {', '.join(SAFETENSORS_DTYPES)})")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(_is_uint(d) for d in shape)):
        raise SafetensorsError(path, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise SafetensorsError(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    start, end = offsets
    if start > end:
        raise SafetensorsError(path, f"tensor {name!r}: data_offsets [{start}, {end}] end before they begin")
    if end > data_size:
        raise SafetensorsError(
            path, f"tensor {name!r}: data_offsets [{start}, {end}] run past the {data_size}-byte data "
                  "section (truncated?)")
    needed = math.prod(shape) * dtype.itemsize
    if needed != end - start:
        raise SafetensorsError(
            path, f"tensor {name!r}: shape {shape} of {st_dtype} needs {needed} bytes but "
                  f"data_offsets span {end - start}")
    return TensorSpec(name, dtype, tuple(shape), start, end)


def _convert(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or tensor.dtype == dtype or not tensor.dtype.is_floating_point:
        return tensor
    return tensor.to(dtype)


# --- CPU: zero-copy mapping -------------------------------------------------------------


def _mapped(
    files: Iterable[str | os.PathLike[str]], target: torch.device, dtype: torch.dtype | None,
    on_header: OnHeader | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        header, mapping = _map(Path(file))
        if on_header is not None:
            on_header(header)
        for spec in header.tensors:
            if spec.nbytes == 0 or mapping is None:
                tensor = torch.empty(spec.shape, dtype=spec.dtype)
            else:
                # frombuffer keeps a reference to the mapping in the tensor's storage, so it is
                # unmapped only when the last tensor viewing it is gone.
                tensor = torch.frombuffer(
                    mapping, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize,
                    offset=header.data_start + spec.start,
                ).view(spec.shape)
            if target.type != "cpu":
                tensor = tensor.to(target)
            yield spec.name, _convert(tensor, dtype)


def _map(path: Path) -> tuple[SafetensorsHeader, mmap.mmap | None]:
    fd = _open(path)
    try:
        header = _read_header_fd(path, fd)
        if header.data_size == 0:
            return header, None
        # ACCESS_COPY = MAP_PRIVATE: writable tensors whose writes never reach the file.
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the mapping holds its own reference to the file
    # No madvise(WILLNEED): for a file in the page cache (a node's cache after download) it
    # costs ~4% of reading the tensors once, and a cold file gets the kernel's readahead anyway.
    return header, mapping


# --- staged: reused buffers, parallel reads, overlapped copies ---------------------------


@dataclass(slots=True)
class _OpenFile:
    header: SafetensorsHeader
    fd: int
    starts: list[int]  # start of each non-empty tensor, for bisect
    specs: list[TensorSpec]  # the non-empty tensors, in file order
    dests: dict[int, torch.Tensor] = field(default_factory=dict)  # byte tensors being filled
    missing: dict[int, int] = field(default_factory=dict)  # bytes still to copy per tensor
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


@dataclass(frozen=True, slots=True)
class _Chunk:
    file: _OpenFile
    start: int  # in the data section
    size: int
    first: bool
    last: bool


@dataclass(slots=True)
class _InFlight:
    chunk: _Chunk
    slot: int
    reads: list[Future[None]]


class _StagedLoad:
    """One pass of the staged pipeline: buffer i is read into while buffer i-1 is copied out."""

    def __init__(self, target: torch.device, dtype: torch.dtype | None, buffer_bytes: int,
                 buffers: int, read_threads: int, on_header: OnHeader | None) -> None:
        self.target = target
        self.dtype = dtype
        self.buffer_bytes = buffer_bytes
        self.read_threads = read_threads
        self.on_header = on_header
        self.cuda = target.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(target) if self.cuda else None
        self.opened: list[_OpenFile] = []
        # Allocated on first use, no bigger than the data needs: a small checkpoint should
        # not pin buffer_bytes * buffers of memory.
        self.bufs: list[torch.Tensor | None] = [None] * buffers
        self.views: list[memoryview | None] = [None] * buffers
        # events[i] marks the end of the last copy out of buffer i; it must pass before a read
        # overwrites the buffer.
        self.events: list[torch.cuda.Event | None] = [None] * buffers

    def run(self, files: Iterable[str | os.PathLike[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        n_buffers = len(self.bufs)
        pending: deque[_InFlight] = deque()
        with ThreadPoolExecutor(self.read_threads, thread_name_prefix="safetensors-read") as pool:
            try:
                for i, chunk in enumerate(self._chunks(files)):
                    slot = i % n_buffers
                    if len(pending) == n_buffers:
                        yield from self._finish(pending.popleft())
                    if (event := self.events[slot]) is not None:
                        event.synchronize()
                    reads = self._submit(pool, chunk, self._buffer(slot, chunk.size))
                    pending.append(_InFlight(chunk, slot, reads))
                    if chunk.last:
                        # Drain before asking `files` for the next one, which may block for a
                        # download: the caller gets every tensor of this file meanwhile.
                        while pending:
                            yield from self._finish(pending.popleft())
                while pending:
                    yield from self._finish(pending.popleft())
            finally:
                # Reads still running write into the buffers: wait for them before letting go.
                pool.shutdown(wait=True, cancel_futures=True)
                for f in self.opened:
                    f.close()
                if self.stream is not None:
                    # The buffers go back to the allocator; their copies must be over by then.
                    self.stream.synchronize()

    def _buffer(self, slot: int, size: int) -> memoryview:
        """A view of buffer `slot`, (re)allocated to hold `size` bytes; its last copy is over."""
        view = self.views[slot]
        if view is None or len(view) < size:
            # Pinned memory comes from torch's caching host allocator, so a later load in the
            # same process gets these pages back instead of pinning new ones.
            grown = 2 * len(view) if view is not None else 0
            buf = torch.empty(min(self.buffer_bytes, max(size, grown)), dtype=torch.uint8,
                              pin_memory=self.cuda)
            self.bufs[slot], self.views[slot] = buf, view = buf, memoryview(buf.numpy())
        return view

    def _chunks(self, files: Iterable[str | os.PathLike[str]]) -> Iterator[_Chunk]:
        for file in files:
            path = Path(file)
            fd = _open(path)
            try:
                header = _read_header_fd(path, fd)
            except BaseException:
                os.close(fd)
                raise
            specs = [s for s in header.tensors if s.nbytes]
            opened = _OpenFile(header, fd, [s.start for s in specs], specs)
            self.opened.append(opened)
            if self.on_header is not None:
                self.on_header(header)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, header.data_start, header.data_size, os.POSIX_FADV_SEQUENTIAL)
            size, step = header.data_size, self.buffer_bytes
            if size == 0:
                yield _Chunk(opened, 0, 0, True, True)
            for start in range(0, size, step):
                yield _Chunk(opened, start, min(step, size - start), start == 0, start + step >= size)

    def _submit(self, pool: ThreadPoolExecutor, chunk: _Chunk, view: memoryview) -> list[Future[None]]:
        if chunk.size == 0:
            return []
        parts = max(1, min(self.read_threads, chunk.size // MIN_READ_BYTES))
        step = -(-chunk.size // parts)
        base = chunk.file.header.data_start + chunk.start
        return [pool.submit(_read_into, chunk.file.fd, view[lo:min(lo + step, chunk.size)], base + lo,
                            chunk.file.header.path)
                for lo in range(0, chunk.size, step)]

    def _finish(self, inflight: _InFlight) -> Iterator[tuple[str, torch.Tensor]]:
        for read in inflight.reads:
            read.result()
        chunk, file = inflight.chunk, inflight.chunk.file
        if chunk.last:
            file.close()
        ready: list[tuple[str, torch.Tensor]] = []
        if chunk.first:
            ready += [(s.name, _convert(torch.empty(s.shape, dtype=s.dtype, device=self.target), self.dtype))
                      for s in file.header.tensors if not s.nbytes]
        pieces = self._pieces(chunk)
        if pieces:
            self._copy(pieces, inflight.slot)
        for idx in self._completed(chunk):
            spec = file.specs[idx]
            raw = file.dests.pop(idx)
            ready.append((spec.name, _convert(raw.view(spec.dtype).view(spec.shape), self.dtype)))
        yield from ready

    def _copy(self, pieces: list[tuple[torch.Tensor, int, int]], slot: int) -> None:
        buf, stream = self.bufs[slot], self.stream
        assert buf is not None
        if stream is None:
            for dest, lo, length in pieces:
                dest.copy_(buf[lo:lo + length])
            return
        consumer = torch.cuda.current_stream(self.target)
        # Destinations were allocated on the consumer's stream, maybe in blocks that its queued
        # work still reads: the copies wait for that work.
        stream.wait_stream(consumer)
        with torch.cuda.stream(stream):
            for dest, lo, length in pieces:
                dest.copy_(buf[lo:lo + length], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        self.events[slot] = event
        # Work the consumer queues after this sees the copied bytes.
        consumer.wait_event(event)

    def _pieces(self, chunk: _Chunk) -> list[tuple[torch.Tensor, int, int]]:
        """(destination byte slice, offset in the buffer, length) of every tensor part in `chunk`."""
        file, lo, hi = chunk.file, chunk.start, chunk.start + chunk.size
        pieces: list[tuple[torch.Tensor, int, int]] = []
        idx = max(0, bisect.bisect_right(file.starts, lo) - 1)
        while idx < len(file.specs) and file.specs[idx].start < hi:
            spec = file.specs[idx]
            a, b = max(spec.start, lo), min(spec.end, hi)
            if a < b:
                dest = file.dests.get(idx)
                if dest is None:
                    dest = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.target)
                    file.dests[idx] = dest
                    file.missing[idx] = spec.nbytes
                pieces.append((dest[a - spec.start:b - spec.start], a - lo, b - a))
                file.missing[idx] -= b - a
            idx += 1
        return pieces

    def _completed(self, chunk: _Chunk) -> Sequence[int]:
        done = [idx for idx, left in chunk.file.missing.items() if left == 0]
        for idx in done:
            del chunk.file.missing[idx]
        return done


def _read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    while view:
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:
            raise SafetensorsError(path, f"read at byte {offset} failed: {e.strerror}") from e
        if n == 0:
            raise SafetensorsError(path, f"file ends at byte {offset}, inside the data section (truncated?)")
        view, offset = view[n:], offset + n
