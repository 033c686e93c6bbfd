"""The node cache and pull path on a file:// origin: verified publish, warm starts,
resume, corrupt chunks, budgets and eviction, and what stays invisible on failure."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from node_testkit import advance_until_done

from data_plane.weights.cache import NodeCache
from data_plane.weights.errors import CacheFullError, FetchError, WeightStoreError
from data_plane.weights.fetcher import RangeFetcher, Source
from data_plane.weights.manifest import MANIFEST_NAME, Manifest, ManifestError, build_manifest
from data_plane.weights.origins import open_origin
from data_plane.weights.pull import WeightPuller
from data_plane.weights.push import push_model
from meridian.clock import ManualClock
from meridian.settings.node import WeightSettings

CHUNK = 4096
RETRY_MAX_S = 0.01


def _settings(cache_dir: Path, **kw: object) -> WeightSettings:
    base: dict[str, object] = dict(
        cache_dir=cache_dir, manifest_chunk_bytes=CHUNK, range_bytes=2 * CHUNK, concurrency=4,
        max_attempts=2, retry_base_s=0.001, retry_max_s=RETRY_MAX_S,
    )
    base.update(kw)
    return WeightSettings(**base)  # type: ignore[arg-type]


def _model_dir(root: Path, name: str = "m", sizes: tuple[int, ...] = (50_000, 9_000, 0), seed: int = 0) -> Path:
    d = root / name
    (d / "sub").mkdir(parents=True)
    for i, size in enumerate(sizes):
        data = hashlib.shake_256(f"{seed}-{i}".encode()).digest(size) if size else b""
        target = d / ("sub" if i == 1 else "") / f"f{i}.bin"
        target.write_bytes(data)
    (d / "config.json").write_text('{"x": 1}')
    return d


async def _push(model_dir: Path, origin_dir: Path, settings: WeightSettings, **kw: object) -> str:
    await asyncio.to_thread(origin_dir.mkdir, parents=True, exist_ok=True)
    uri = f"file://{origin_dir}"
    await push_model(model_dir, uri, settings, **kw)  # type: ignore[arg-type]
    return uri


def _visible_files(cache: Path) -> list[Path]:
    """What a reader could find: blobs and model directories (not partial/ or locks/)."""
    return [p for sub in ("blobs", "models") for p in (cache / sub).rglob("*") if not p.name.startswith(".")]


def test_manifest_rejects_paths_outside_the_model() -> None:
    good = build_manifest.__module__  # the module imports; the bad one must not parse
    assert good
    raw = (
        '{"name":"m","created_at":"2026-01-01T00:00:00Z","files":[{"path":"../etc/passwd","size":1,'
        '"sha256":"' + "0" * 64 + '","chunk_size":4096,"chunks":["' + "0" * 64 + '"]}]}'
    )
    with pytest.raises(ManifestError, match="relative"):
        Manifest.parse(raw.encode())


@pytest.mark.parametrize("name", [MANIFEST_NAME, ".last-used", "sub/.hidden", "a\nb", ".tmp-x/f"])
def test_manifest_rejects_names_the_cache_keeps_for_itself(name: str) -> None:
    raw = {"name": "m", "created_at": "2026-01-01T00:00:00Z", "files": [
        {"path": name, "size": 1, "sha256": "0" * 64, "chunk_size": 4096, "chunks": ["0" * 64]}]}
    with pytest.raises(ManifestError, match="reserved|control"):
        Manifest.parse(json.dumps(raw).encode())


async def test_a_manifest_cannot_overwrite_another_models_file(tmp_path: Path) -> None:
    """Issue 18, finding 5: a manifest listing a file named `meridian-manifest.json` had
    the cache hard-link a shared blob (model A's config.json) under that name, then write
    model B's manifest over it: A's config.json became B's manifest."""
    settings = _settings(tmp_path / "cache")
    a = await WeightPuller(settings, NodeCache(settings.cache_dir)).pull(
        await _push(_model_dir(tmp_path), tmp_path / "origin-a", settings))
    config = (a.model.path / "config.json").read_bytes()
    [entry] = [f for f in a.model.manifest.files if f.path == "config.json"]
    evil = {"name": "evil", "created_at": "2026-01-01T00:00:00Z",
            "files": [entry.model_dump(mode="json") | {"path": MANIFEST_NAME}]}
    (tmp_path / "origin-b").mkdir()
    (tmp_path / "origin-b" / MANIFEST_NAME).write_text(json.dumps(evil))

    with pytest.raises(WeightStoreError, match="reserved"):
        await WeightPuller(settings, NodeCache(settings.cache_dir)).pull(f"file://{tmp_path / 'origin-b'}")
    assert (a.model.path / "config.json").read_bytes() == config
    assert (settings.cache_dir / "blobs").exists()
    assert [m.manifest.name for m in NodeCache(settings.cache_dir).models()] == ["m"]


async def test_pull_publishes_identical_files_then_starts_warm(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache")
    src = _model_dir(tmp_path)
    uri = await _push(src, tmp_path / "origin", settings)

    puller = WeightPuller(settings, NodeCache(settings.cache_dir))
    cold = await puller.pull(uri)
    assert cold.source == "origin"
    assert cold.fetched_bytes == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    for p in src.rglob("*"):
        if p.is_file():
            assert (cold.model.path / p.relative_to(src)).read_bytes() == p.read_bytes()
    assert (cold.model.path / MANIFEST_NAME).is_file()
    assert not list((settings.cache_dir / "partial").iterdir())

    warm = await WeightPuller(settings, NodeCache(settings.cache_dir)).pull(uri)
    assert warm.source == "cache" and warm.fetched_bytes == 0
    assert warm.model.digest == cold.model.digest


async def test_corrupt_chunk_at_the_origin_fails_clearly_and_publishes_nothing(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache")
    origin = tmp_path / "origin"
    uri = await _push(_model_dir(tmp_path), origin, settings)
    blob = bytearray((origin / "f0.bin").read_bytes())
    blob[CHUNK * 3 + 7] ^= 0xFF  # one bit-flipped byte in chunk 3
    (origin / "f0.bin").write_bytes(bytes(blob))

    manifest = Manifest.parse((origin / MANIFEST_NAME).read_bytes())
    cache = NodeCache(settings.cache_dir)
    clock = ManualClock()
    pulling = asyncio.create_task(WeightPuller(settings, cache, clock=clock).pull(uri))
    # The bad range is fetched again after a backoff on the puller's clock.
    assert await advance_until_done(clock, pulling, RETRY_MAX_S) >= 1
    with pytest.raises(FetchError, match=r"f0.bin .*chunk 3 .*does not match its sha256"):
        await pulling
    # No model, and no blob of the bad file (intact files that finished first may stay,
    # verified, for a retry).
    assert cache.models() == []
    assert not list((settings.cache_dir / "models").iterdir())
    assert {p.name for p in (settings.cache_dir / "blobs").iterdir()} <= {
        f.sha256 for f in manifest.files if f.path != "f0.bin"
    }


async def test_corrupt_chunk_is_fetched_again_from_another_source(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache")
    src = _model_dir(tmp_path)
    manifest = build_manifest(src, chunk_size=CHUNK)
    good = await _push(src, tmp_path / "good", settings)
    bad_dir = tmp_path / "bad"
    await _push(src, bad_dir, settings)
    data = bytearray((bad_dir / "f0.bin").read_bytes())
    data[10] ^= 1
    (bad_dir / "f0.bin").write_bytes(bytes(data))

    cache = NodeCache(settings.cache_dir)
    clock = ManualClock()
    fetcher = RangeFetcher(settings, cache, clock=clock)
    sources = [Source("bad", open_origin(f"file://{bad_dir}", settings)),
               Source("good", open_origin(good, settings))]
    f0 = next(f for f in manifest.files if f.path == "f0.bin")
    tally: Counter[str] = Counter()
    fetching = asyncio.create_task(fetcher.fetch_file(f0, sources, tally=tally))
    # Each retry backs off on the fetcher's clock.
    assert await advance_until_done(clock, fetching, RETRY_MAX_S) >= 1
    path = await fetching
    assert path.read_bytes() == (src / "f0.bin").read_bytes()
    assert fetcher.corrupt_ranges >= 1
    assert tally["good"] >= CHUNK and tally["bad"] < f0.size


async def test_download_resumes_from_verified_chunks(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache")
    src = _model_dir(tmp_path, sizes=(60_000,))
    manifest = build_manifest(src, chunk_size=CHUNK)
    f0 = next(f for f in manifest.files if f.path == "f0.bin")
    cache = NodeCache(settings.cache_dir)
    # What a killed download leaves: a partial file with some chunks and its journal.
    partial = cache.open_partial(f0)
    data = (src / "f0.bin").read_bytes()
    for i in (0, 1, 5):
        s, e = f0.chunk_span(i)
        partial.write(s, data[s:e])
    partial.mark_done([0, 1, 5, 6])  # chunk 6 claimed but never written: must be re-fetched
    cache.release_partial(partial, keep=True)

    uri = await _push(src, tmp_path / "origin", settings)
    report = await WeightPuller(settings, NodeCache(settings.cache_dir)).pull(uri)
    resumed = f0.size - 3 * CHUNK
    config = next(f for f in manifest.files if f.path == "config.json")
    assert report.fetched_bytes == resumed + config.size
    assert (report.model.path / "f0.bin").read_bytes() == data


async def test_concurrent_pulls_in_one_process_fetch_each_file_once(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache")
    uri = await _push(_model_dir(tmp_path), tmp_path / "origin", settings)
    cache = NodeCache(settings.cache_dir)
    puller = WeightPuller(settings, cache)
    reports = await asyncio.gather(*(puller.pull(uri) for _ in range(4)))
    assert sum(r.fetched_bytes for r in reports) == reports[0].model.size
    assert len({r.model.digest for r in reports}) == 1


async def test_budget_evicts_least_recently_used_unpinned_models(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "cache", cache_budget_bytes=150_000)
    uris = [await _push(_model_dir(tmp_path / f"src{i}", sizes=(60_000,), seed=i), tmp_path / f"o{i}", settings)
            for i in range(3)]
    cache = NodeCache(settings.cache_dir, budget_bytes=settings.cache_budget_bytes)
    puller = WeightPuller(settings, cache)
    a = await puller.pull(uris[0])
    cache.pin(a.model.digest)  # served by this node: never evicted
    b = await puller.pull(uris[1])
    c = await puller.pull(uris[2])  # does not fit next to a and b: b (unpinned, LRU) goes
    digests = {m.digest for m in cache.models()}
    assert digests == {a.model.digest, c.model.digest}
    assert not (cache.model_path(b.model.digest)).exists()
    assert cache.usage_bytes() <= 150_000

    cache.pin(c.model.digest)
    with pytest.raises(CacheFullError, match="cache budget"):
        await puller.pull(uris[1])
    assert {m.digest for m in cache.models()} == {a.model.digest, c.model.digest}


def test_pinned_model_is_seen_as_in_use_by_other_processes(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path)
    digest = "a" * 64
    cache.pin(digest)
    code = (
        "import sys; from data_plane.weights.cache import NodeCache;"
        f"c = NodeCache({str(tmp_path)!r}); sys.exit(0 if c.evict({digest!r}) == 0 and c._is_pinned({digest!r}) else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    cache.unpin(digest)


DISK_FULL_SCRIPT = """
import asyncio, sys
from pathlib import Path
from data_plane.weights.cache import NodeCache
from data_plane.weights.errors import CacheFullError
from data_plane.weights.pull import WeightPuller
from meridian.settings.node import WeightSettings

s = WeightSettings(cache_dir=Path(sys.argv[1]), manifest_chunk_bytes=4096, range_bytes=8192, concurrency=2)
try:
    asyncio.run(WeightPuller(s, NodeCache(s.cache_dir)).pull(sys.argv[2]))
except CacheFullError as e:
    print("CacheFullError:", e)
    sys.exit(3)
"""


def _mount_tmpfs(path: Path, size: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=30).returncode == 0


def _limit_file_size() -> None:  # runs in the child before exec
    import resource
    import signal

    # Past the limit the kernel fails the write with EFBIG, and SIGXFSZ would kill us first.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


@pytest.mark.parametrize("full", ["tmpfs", "file_size_limit"])
def test_disk_full_is_a_clear_error_and_leaves_no_partial_file(tmp_path: Path, full: str) -> None:
    """A 1 MiB filesystem (the free-space check refuses before a byte is fetched), and a
    disk that looks roomy but fails the write itself (the kernel's file-size limit)."""
    settings = _settings(tmp_path / "unused")
    uri = asyncio.run(_push(_model_dir(tmp_path, sizes=(3 * 1024 * 1024,)), tmp_path / "origin", settings))
    cache_dir = tmp_path / "small"
    cache_dir.mkdir()
    if full == "tmpfs" and not _mount_tmpfs(cache_dir, "1m"):
        pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN; the file_size_limit case covers the write path")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", DISK_FULL_SCRIPT, str(cache_dir), uri],
            env={**os.environ, "PYTHONPATH": str(Path.cwd())}, capture_output=True, text=True, timeout=120,
            preexec_fn=_limit_file_size if full == "file_size_limit" else None,
        )
        assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
        assert "CacheFullError:" in proc.stdout
        assert _visible_files(cache_dir) == []
        # The file that did not fit left nothing behind (a smaller file interrupted by the
        # failure may keep its resumable partial download, which no reader ever sees).
        big = hashlib.sha256((tmp_path / "m" / "f0.bin").read_bytes()).hexdigest()
        assert not [p for p in (cache_dir / "partial").iterdir() if p.name.startswith(big)]
    finally:
        if full == "tmpfs":
            subprocess.run(["umount", str(cache_dir)], timeout=30)
