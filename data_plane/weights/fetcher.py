"""Parallel ranged fetch into the node cache: many byte ranges in flight per file and
across files, each verified against the manifest's chunk digests before it is written,
retried with backoff and jitter (waited out on the node's `Clock`), and taken from the
next source when one fails."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from data_plane.weights.cache import NodeCache, PartialBlob
from data_plane.weights.errors import CacheFullError, FetchError, IntegrityError, first_error
from data_plane.weights.manifest import ManifestFile
from data_plane.weights.origins.base import (
    OriginDenied,
    OriginError,
    OriginNotFound,
    OriginUnavailable,
    WeightOrigin,
)
from meridian.backoff import Backoff
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.node import WeightSettings

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
# A source that returned corrupt bytes this many times in a row is given up for the range.
_CORRUPT_LIMIT = 2


@dataclass(frozen=True)
class Source:
    """Where a file's bytes can come from: an origin (by path) or a peer (by sha256)."""

    name: str
    origin: WeightOrigin
    by_digest: bool = False

    def key(self, file: ManifestFile) -> str:
        return f"blobs/{file.sha256}" if self.by_digest else file.path


class RangeFetcher:
    """Downloads manifest files into a NodeCache; one instance per node (its semaphore
    bounds the ranges in flight across every file and model)."""

    def __init__(self, settings: WeightSettings, cache: NodeCache, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.cache = cache
        self._clock = clock
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._backoff = Backoff(settings.retry_base_s, settings.retry_max_s, full=True)
        # Ranges that failed verification (corrupt at a source or in transit).
        self.corrupt_ranges = 0

    def ranges(self, file: ManifestFile, missing: list[int]) -> list[list[int]]:
        """Group missing chunks into runs of consecutive chunks, at most range_bytes each."""
        per_range = max(1, self.settings.range_bytes // file.chunk_size)
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1 and len(runs[-1]) < per_range:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    async def fetch_file(
        self,
        file: ManifestFile,
        sources: list[Source],
        progress: Progress | None = None,
        tally: Counter[str] | None = None,
    ) -> Path:
        """Make the file a published blob (downloading what is missing); its path.
        Bytes written are added to `tally` by source name."""
        if self.cache.has_blob(file):
            return self.cache.blob_path(file.sha256)
        if not sources:
            raise FetchError(f"{file.path} is not cached and there is no source to fetch it from")
        async with self.cache.blob_lock(file.sha256):
            if self.cache.has_blob(file):
                # Another task or process fetched it while this one waited.
                if progress is not None:
                    progress(file.size)
                return self.cache.blob_path(file.sha256)
            partial = await asyncio.to_thread(self.cache.open_partial, file)
            keep = True
            try:
                if progress is not None:
                    progress(sum(e - s for s, e in map(file.chunk_span, partial.done)))
                async with asyncio.TaskGroup() as group:
                    for run in self.ranges(file, partial.missing):
                        group.create_task(self._fetch_range(partial, run, sources, progress, tally))
                partial.save_journal(force=True)
                return await asyncio.to_thread(self.cache.publish_blob, partial)
            except BaseExceptionGroup as eg:
                # TaskGroup wraps: surface the first real failure (a clear message) instead.
                first = first_error(eg)
                keep = not isinstance(first, CacheFullError)
                raise first from None
            except CacheFullError:
                keep = False
                raise
            finally:
                if self.cache.download_in_progress(file.sha256) is partial:
                    self.cache.release_partial(partial, keep=keep)

    async def _fetch_range(
        self,
        partial: PartialBlob,
        run: list[int],
        sources: list[Source],
        progress: Progress | None,
        tally: Counter[str] | None,
    ) -> None:
        file = partial.file
        start, end = file.chunk_span(run[0])[0], file.chunk_span(run[-1])[1]
        failures: list[str] = []
        attempt = 0
        for source in sources:
            corrupt = 0
            for _ in range(self.settings.max_attempts):
                attempt += 1
                try:
                    async with self._slots:
                        data = await source.origin.read_range(source.key(file), start, end)
                    await asyncio.to_thread(self._verify_and_write, partial, run, start, end, data)
                except (OriginNotFound, OriginDenied) as exc:
                    failures.append(f"{source.name}: {exc}")
                    break  # permanent for this source: try the next one
                except IntegrityError as exc:
                    self.corrupt_ranges += 1
                    corrupt += 1
                    failures.append(f"{source.name}: {exc}")
                    log.warning("%s from %s: %s", file.path, source.name, exc)
                    if corrupt >= _CORRUPT_LIMIT:
                        break
                except (OriginUnavailable, OriginError) as exc:
                    failures.append(f"{source.name}: {exc}")
                else:
                    partial.mark_done(run)
                    partial.save_journal()
                    if tally is not None:
                        tally[source.name] += end - start
                    if progress is not None:
                        progress(end - start)
                    return
                await self._clock.sleep(self._backoff.delay(attempt))
        detail = "; ".join(failures[-4:])
        raise FetchError(f"{file.path} bytes {start}-{end}: no source served verified bytes ({detail})")

    @staticmethod
    def _verify_and_write(partial: PartialBlob, run: list[int], start: int, end: int, data: bytes) -> None:
        file = partial.file
        if len(data) != end - start:
            raise OriginUnavailable(f"short read: {len(data)} of {end - start} bytes")
        view = memoryview(data)
        for i in run:
            s, e = file.chunk_span(i)
            if hashlib.sha256(view[s - start : e - start]).hexdigest() != file.chunks[i]:
                raise IntegrityError(f"chunk {i} (bytes {s}-{e}) does not match its sha256")
        partial.write(start, view)

