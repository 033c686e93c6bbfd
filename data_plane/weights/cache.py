"""The node cache: model files content-addressed by sha256 on local disk.

Layout under the cache root:

    blobs/<sha256>             published files, read-only; never partial
    partial/<sha256>.part      a download in progress (preallocated), with
    partial/<sha256>.json      the chunks of it already verified (resume hint)
    models/<manifest digest>/  a model as its files' paths (hard links to blobs) plus
                               meridian-manifest.json; what engines and vLLM are pointed at
    refs/<sha256 of URI>       symlink to the model directory a URI last resolved to:
                               the path engines load from, and a warm start while the
                               origin is unreachable
    locks/                     flock files: one per blob (single-flight across processes),
                               one per model (held shared while a node serves it)

A file becomes visible only by an atomic rename after its every byte was verified,
so a crash, a kill or a full disk never leaves a half file where a reader looks.

Time is the cache's `Clock` (meridian.clock; the node's): the lock poll, the journal's
write interval and a peer's wait for chunks, so tests move it instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path

from data_plane.weights.errors import CacheFullError, IntegrityError
from data_plane.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile
from meridian.clock import SYSTEM_CLOCK, Clock, wait_at_most

log = logging.getLogger(__name__)

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_LOCK_POLL_S = 0.05
_HASH_BLOCK = 8 * 1024 * 1024
# The journal is rewritten at most this often while chunks arrive (and once at the end).
_JOURNAL_INTERVAL_S = 0.5
LAST_USED = ".last-used"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def ref_path(root: Path, uri: str) -> Path:
    """Where the cache records the model a URI last resolved to: a symlink to its model
    directory, which engines (and vLLM) are given as the model's path."""
    return Path(root).absolute() / "refs" / hashlib.sha256(uri.encode()).hexdigest()


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in _DISK_FULL


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _disk_full_as(message: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise CacheFullError(f"{message}: {exc.strerror or exc}") from exc
        raise


class FileLock:
    """An exclusive or shared flock on a lock file: held across threads and processes,
    released by the kernel if the holder dies."""

    def __init__(self, path: Path, *, shared: bool = False, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = path
        self._shared = shared
        self._clock = clock
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self._shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    async def acquire(self) -> None:
        # Polled, not a blocking flock in a thread: a cancelled waiter must not leave a
        # thread behind that takes the lock later.
        while not self.try_acquire():  # noqa: ASYNC110 - another process holds it: nothing to wait on
            await self._clock.sleep(_LOCK_POLL_S)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@dataclass
class PartialBlob:
    """A file being downloaded: a preallocated temporary file and its verified chunks."""

    file: ManifestFile
    path: Path
    journal: Path
    fd: int
    done: set[int] = field(default_factory=set)
    clock: Clock = SYSTEM_CLOCK
    _journal_saved_at: float = 0.0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.file.chunk_count) if i not in self.done]

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write at offset (blocking; call from a worker thread)."""
        with _disk_full_as(f"disk full while writing {self.file.path}"):
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n

    def mark_done(self, indices: list[int]) -> None:
        self.done.update(indices)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_chunks(self, indices: list[int], timeout_s: float) -> bool:
        """Wait until every chunk in `indices` is verified (peers serve them then), for at
        most `timeout_s` of the clock's time; TimeoutError after that."""
        if self.done.issuperset(indices):
            return True
        if not await wait_at_most(self.clock, timeout_s, self._verified(indices)):
            raise TimeoutError(f"chunks of {self.file.path} not verified within {timeout_s:.1f}s")
        return True

    async def _verified(self, indices: list[int]) -> None:
        while not self.done.issuperset(indices):
            await self._changed.wait()

    def save_journal(self, *, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not force and now - self._journal_saved_at < _JOURNAL_INTERVAL_S:
            return
        self._journal_saved_at = now
        body = json.dumps({"size": self.file.size, "chunk_size": self.file.chunk_size, "done": sorted(self.done)})
        tmp = self.journal.with_suffix(".json.tmp")
        with _disk_full_as(f"disk full while saving progress of {self.file.path}"):
            tmp.write_text(body)
            os.replace(tmp, self.journal)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


@dataclass(frozen=True)
class CachedModel:
    """A model published in the cache."""

    digest: str
    manifest: Manifest
    path: Path
    last_used: float
    pinned: bool

    @property
    def size(self) -> int:
        return self.manifest.total_bytes


class NodeCache:
    """Content-addressed model cache under a disk budget (see the module docstring)."""

    def __init__(self, root: Path, *, budget_bytes: int | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.clock = clock
        for sub in ("blobs", "partial", "models", "refs", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # Downloads of this process, by sha256: peers are served from them as chunks land.
        self._downloads: dict[str, PartialBlob] = {}
        self._expected: Counter[str] = Counter()
        self._blob_locks: dict[str, asyncio.Lock] = {}
        self._pins: dict[str, FileLock] = {}

    # --- paths -------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def model_path(self, digest: str) -> Path:
        return self.root / "models" / digest

    def _partial_paths(self, sha256: str) -> tuple[Path, Path]:
        base = self.root / "partial" / sha256
        return base.with_suffix(".part"), base.with_suffix(".json")

    # --- blobs -------------------------------------------------------------------------

    def has_blob(self, file: ManifestFile) -> bool:
        try:
            return self.blob_path(file.sha256).stat().st_size == file.size
        except FileNotFoundError:
            return False

    def download_in_progress(self, sha256: str) -> PartialBlob | None:
        return self._downloads.get(sha256)

    def expect(self, manifest: Manifest) -> None:
        """Announce that this process is about to download these blobs."""
        for f in manifest.files:
            self._expected[f.sha256] += 1

    def unexpect(self, manifest: Manifest) -> None:
        for f in manifest.files:
            self._expected[f.sha256] -= 1
            if self._expected[f.sha256] <= 0:
                del self._expected[f.sha256]

    def expecting(self, sha256: str) -> bool:
        """Whether this process is pulling a model with this blob (maybe not started yet)."""
        return sha256 in self._expected or sha256 in self._downloads

    @contextlib.asynccontextmanager
    async def blob_lock(self, sha256: str) -> AsyncIterator[None]:
        """Single flight for one blob: one downloader per process (asyncio lock) and per
        machine (flock); the others wait, then find the blob published."""
        lock = self._blob_locks.setdefault(sha256, asyncio.Lock())
        async with lock:
            flock = FileLock(self.root / "locks" / f"{sha256}.lock", clock=self.clock)
            await flock.acquire()
            try:
                yield
            finally:
                flock.release()

    def open_partial(self, file: ManifestFile) -> PartialBlob:
        """Open (or resume) the temporary file of a download; call under blob_lock.

        Chunks the journal lists as done are verified again before they are trusted:
        the journal may be ahead of what reached the disk when a machine lost power.
        """
        path, journal = self._partial_paths(file.sha256)
        done: set[int] = set()
        resumable = path.exists() and path.stat().st_size == file.size
        if resumable and journal.exists():
            try:
                raw = json.loads(journal.read_text())
                if raw.get("size") == file.size and raw.get("chunk_size") == file.chunk_size:
                    done = {int(i) for i in raw.get("done", []) if 0 <= int(i) < file.chunk_count}
            except (ValueError, TypeError, OSError):
                log.warning("ignoring unreadable progress journal %s", journal)
        with _disk_full_as(f"no disk space for {file.path} ({file.size} bytes) in {self.root}"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if resumable else os.O_TRUNC), 0o644)
            try:
                if file.size and not resumable:
                    # Reserve the space now: a full disk fails before any byte is fetched.
                    os.posix_fallocate(fd, 0, file.size)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                raise
        partial = PartialBlob(file=file, path=path, journal=journal, fd=fd, clock=self.clock)
        partial.done = {i for i in done if self._chunk_ok(fd, file, i)}
        if done:
            log.info("resuming %s: %d of %d chunks already verified", file.path, len(partial.done), file.chunk_count)
        self._downloads[file.sha256] = partial
        return partial

    @staticmethod
    def _chunk_ok(fd: int, file: ManifestFile, index: int) -> bool:
        start, end = file.chunk_span(index)
        return hashlib.sha256(os.pread(fd, end - start, start)).hexdigest() == file.chunks[index]

    def publish_blob(self, partial: PartialBlob) -> Path:
        """Verify the whole file against its sha256, then make it visible atomically
        (blocking; call from a worker thread)."""
        file = partial.file
        digest = hashlib.sha256()
        offset = 0
        while offset < file.size:
            block = os.pread(partial.fd, min(_HASH_BLOCK, file.size - offset), offset)
            if not block:
                break
            digest.update(block)
            offset += len(block)
        if offset != file.size or digest.hexdigest() != file.sha256:
            self.discard_partial(partial)
            raise IntegrityError(
                f"{file.path}: downloaded file does not match its sha256 {file.sha256[:12]}… "
                "although every chunk did; the manifest is inconsistent"
            )
        os.fsync(partial.fd)
        os.fchmod(partial.fd, 0o444)
        target = self.blob_path(file.sha256)
        os.replace(partial.path, target)
        _fsync_dir(target.parent)
        partial.close()
        with contextlib.suppress(FileNotFoundError):
            partial.journal.unlink()
        self._downloads.pop(file.sha256, None)
        return target

    def release_partial(self, partial: PartialBlob, *, keep: bool) -> None:
        """Stop a download: keep its temp file to resume later, or delete it."""
        with contextlib.suppress(OSError):
            if keep:
                partial.save_journal(force=True)
        partial.close()
        self._downloads.pop(partial.file.sha256, None)
        if not keep:
            self.discard_partial(partial)

    def discard_partial(self, partial: PartialBlob) -> None:
        partial.close()
        self._downloads.pop(partial.file.sha256, None)
        for p in (partial.path, partial.journal):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    # --- models ------------------------------------------------------------------------

    def publish_model(self, manifest: Manifest) -> Path:
        """Make a model directory of hard links to its blobs, atomically (blocking)."""
        digest = manifest.digest
        target = self.model_path(digest)
        if (target / MANIFEST_NAME).exists():
            self.touch(digest)
            return target
        tmp = self.root / "models" / f".tmp-{digest}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            with _disk_full_as(f"disk full while publishing {manifest.name}"):
                tmp.mkdir()
                for f in manifest.files:
                    dest = tmp / f.path
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.link(self.blob_path(f.sha256), dest)
                # Written beside and renamed over: never through a link into a shared blob.
                (tmp / ".manifest.tmp").write_bytes(manifest.canonical_json())
                os.replace(tmp / ".manifest.tmp", tmp / MANIFEST_NAME)
                (tmp / LAST_USED).touch()
            try:
                os.rename(tmp, target)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Another process published the same model first: theirs is identical.
            _fsync_dir(target.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def lookup(self, digest: str) -> CachedModel | None:
        """The published model with this manifest digest, if any."""
        path = self.model_path(digest)
        try:
            manifest = Manifest.parse((path / MANIFEST_NAME).read_bytes())
        except FileNotFoundError:
            return None
        if manifest.digest != digest:
            return None
        return CachedModel(digest, manifest, path, self._last_used(path), self._is_pinned(digest))

    def models(self) -> list[CachedModel]:
        """Every published model, least recently used first."""
        found = []
        for path in (self.root / "models").iterdir():
            if path.name.startswith("."):
                continue
            model = self.lookup(path.name)
            if model is not None:
                found.append(model)
        return sorted(found, key=lambda m: m.last_used)

    def touch(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.model_path(digest) / LAST_USED)

    @staticmethod
    def _last_used(path: Path) -> float:
        try:
            return (path / LAST_USED).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def pin(self, digest: str) -> None:
        """Mark a model in use by this process (a shared flock): never evicted while held."""
        if digest in self._pins:
            return
        lock = FileLock(self.root / "locks" / f"model-{digest}.lock", shared=True)
        if not lock.try_acquire():
            # Only an eviction holds it exclusively, and only for a moment. A blocking
            # pause (pin runs in a worker thread), so on real time, not the clock.
            time.sleep(_LOCK_POLL_S)
            if not lock.try_acquire():
                raise CacheFullError(f"model {digest[:12]}… is being evicted; try again")
        self._pins[digest] = lock
        self.touch(digest)

    def unpin(self, digest: str) -> None:
        lock = self._pins.pop(digest, None)
        if lock is not None:
            lock.release()

    def _is_pinned(self, digest: str) -> bool:
        if digest in self._pins:
            return True
        probe = FileLock(self.root / "locks" / f"model-{digest}.lock")
        if probe.try_acquire():
            probe.release()
            return False
        return True

    # --- budget ------------------------------------------------------------------------

    def usage_bytes(self) -> int:
        """Bytes the cache holds: published blobs and downloads in progress."""
        total = 0
        for sub in ("blobs", "partial"):
            for p in (self.root / sub).iterdir():
                with contextlib.suppress(FileNotFoundError):
                    total += p.stat().st_size
        return total

    def reserve(self, manifest: Manifest) -> int:
        """Make room for what `manifest` still needs, evicting least recently used models
        that no process serves; returns the bytes to download. CacheFullError when even
        that cannot make room, before a byte is written."""
        missing = [f for f in manifest.files if not self.has_blob(f)]
        needed = sum(f.size for f in missing)
        in_progress = 0
        for f in missing:
            part, _ = self._partial_paths(f.sha256)
            with contextlib.suppress(FileNotFoundError):
                in_progress += part.stat().st_size
        needed_new = max(0, needed - in_progress)
        keep = {f.sha256 for f in manifest.files}
        if self.budget_bytes is not None:
            excess = self.usage_bytes() + needed_new - self.budget_bytes
            if excess > 0:
                excess -= self._evict(excess, keep=keep, exclude=manifest.digest)
            if excess > 0:
                raise CacheFullError(
                    f"{manifest.name} needs {needed_new} more bytes but the cache budget is "
                    f"{self.budget_bytes} bytes and models in use hold {self.usage_bytes()}; "
                    "raise MERIDIAN_WEIGHTS_CACHE_BUDGET_BYTES or stop a deployment on this node"
                )
        free = shutil.disk_usage(self.root).free
        if needed_new > free:
            free += self._evict(needed_new - free, keep=keep, exclude=manifest.digest)
            if needed_new > free:
                raise CacheFullError(
                    f"{manifest.name} needs {needed_new} bytes but {self.root} has {free} free"
                )
        return needed

    def _evict(self, want: int, *, keep: set[str], exclude: str) -> int:
        """Evict unpinned models, least recently used first, until `want` bytes are freed."""
        freed = 0
        for model in self.models():
            if freed >= want:
                break
            if model.digest == exclude:
                continue
            freed += self.evict(model.digest, keep=keep)
        return freed

    def evict(self, digest: str, *, keep: Set[str] = frozenset()) -> int:
        """Remove a model no process serves, and its blobs no other model links;
        returns bytes freed (0 if it is in use)."""
        lock = FileLock(self.root / "locks" / f"model-{digest}.lock")
        if digest in self._pins or not lock.try_acquire():
            return 0
        try:
            model = self.lookup(digest)
            path = self.model_path(digest)
            # Rename first: a reader never sees a half-deleted model directory.
            graveyard = self.root / "models" / f".evicting-{digest}-{time.monotonic_ns()}"
            try:
                os.rename(path, graveyard)
            except FileNotFoundError:
                return 0
            shutil.rmtree(graveyard, ignore_errors=True)
            freed = 0
            for f in model.manifest.files if model else []:
                blob = self.blob_path(f.sha256)
                if f.sha256 in keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = blob.stat()
                    if st.st_nlink == 1:  # no other model directory links it
                        blob.unlink()
                        freed += st.st_size
            log.info("evicted %s (%s), %d bytes freed", model.manifest.name if model else digest, digest[:12], freed)
            return freed
        finally:
            lock.release()

    # --- refs --------------------------------------------------------------------------

    def write_ref(self, uri: str, digest: str) -> None:
        """Point the URI's ref at the model directory, atomically (relative, so the cache
        directory can move)."""
        path = ref_path(self.root, uri)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        os.symlink(Path("..") / "models" / digest, tmp)
        os.replace(tmp, path)

    def read_ref(self, uri: str) -> str | None:
        """The manifest digest the URI last resolved to, if recorded."""
        try:
            digest = os.readlink(ref_path(self.root, uri)).rsplit("/", 1)[-1]
        except (FileNotFoundError, OSError):
            return None
        return digest if _SHA256.match(digest) else None
