"""`meridian model pull` as real processes against an nginx origin: a pull killed with
SIGKILL mid-download resumes with only the missing ranges; concurrent pulls into one
cache fetch each byte once (file-lock single flight); a cached model still starts
when the origin is down."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.nginx import NginxServer
from data_plane.weights.manifest import MANIFEST_NAME, Manifest
from data_plane.weights.push import push_model
from meridian.settings.node import WeightSettings

MiB = 1024 * 1024
CHUNK = 256 * 1024


@pytest.fixture
def origin(tmp_path: Path) -> tuple[Path, Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(2 * MiB))
    (src / "config.json").write_text("{}")
    root = tmp_path / "origin"
    (root / "m").mkdir(parents=True)
    manifest = asyncio.run(push_model(src, f"file://{root / 'm'}", WeightSettings(manifest_chunk_bytes=CHUNK)))
    return root, manifest


def _pull(uri: str, cache: Path, concurrency: int = 4) -> subprocess.Popen[str]:
    env = {**os.environ, "MERIDIAN_WEIGHTS_CACHE_DIR": str(cache), "MERIDIAN_WEIGHTS_RANGE_BYTES": str(CHUNK),
           "MERIDIAN_WEIGHTS_CONCURRENCY": str(concurrency), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "cli", "model", "pull", uri], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _origin_bytes(nginx: NginxServer, name: str) -> list[tuple[int, int]]:
    spans = []
    for rec in nginx.access_records():
        if rec.path == f"/m/{name}" and rec.method == "GET" and rec.status in (200, 206):
            start = rec.range_start or 0
            spans.append((start, start + rec.body_bytes_sent))
    return sorted(spans)


def test_killed_pull_resumes_with_only_the_missing_ranges(
    origin: tuple[Path, Manifest], nginx_server: Callable[..., NginxServer], tmp_path: Path
) -> None:
    root, manifest = origin
    big = next(f for f in manifest.files if f.path == "weights.bin")
    # nginx sends the first limit_rate bytes of a response at once: a rate well under the
    # range size keeps each range in flight for seconds (~3 s per 256 KiB range here).
    nginx = nginx_server(root, limit_rate=64 * 1024)
    cache = tmp_path / "cache"
    first = _pull(f"{nginx.url}/m", cache)
    journal = cache / "partial" / f"{big.sha256}.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not journal.exists():
        time.sleep(0.05)
    assert journal.exists(), "no chunk landed before the deadline"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    assert not (cache / "blobs" / big.sha256).exists()  # never visible half-written
    nginx.stop()  # its log is complete once it has stopped
    before = sum(e - s for s, e in _origin_bytes(nginx, "weights.bin"))
    assert 0 < before < big.size

    # The resumed pull goes to an unthrottled origin over the same files (another URI:
    # downloads resume by content, not by where they came from).
    fast = nginx_server(root)
    second = _pull(f"{fast.url}/m", cache)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    assert (cache / "blobs" / big.sha256).read_bytes() == (root / "m" / "weights.bin").read_bytes()
    fetched_again = sum(e - s for s, e in _origin_bytes(fast, "weights.bin"))
    # Only what the killed pull had not verified is fetched again (a chunk in flight at
    # the kill may be fetched twice, never the whole file).
    assert fetched_again < big.size
    assert fetched_again <= big.size - before + 4 * CHUNK


def test_concurrent_pulls_into_one_cache_fetch_each_byte_once(
    origin: tuple[Path, Manifest], nginx_server: Callable[..., NginxServer], tmp_path: Path
) -> None:
    root, manifest = origin
    nginx = nginx_server(root, limit_rate=2 * MiB)
    cache = tmp_path / "shared-cache"
    procs = [_pull(f"{nginx.url}/m", cache) for _ in range(3)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    for f in manifest.files:
        spans = _origin_bytes(nginx, f.path)
        assert sum(e - s for s, e in spans) == f.size, (f.path, spans)
    assert len(list((cache / "models").iterdir())) == 1


def test_cached_model_starts_while_the_origin_is_down(
    origin: tuple[Path, Manifest], nginx_server: Callable[..., NginxServer], tmp_path: Path
) -> None:
    root, manifest = origin
    nginx = nginx_server(root)
    cache = tmp_path / "cache"
    out, _ = _pull(f"{nginx.url}/m", cache).communicate(timeout=120)
    nginx.stop()
    p = _pull(f"{nginx.url}/m", cache)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    # The line is as long as the cache's path (a worker's tmp path is longer) and may wrap.
    assert manifest.digest[:12] in out and "0 B fetched from cache" in " ".join(out.split())
    assert (cache / "models" / manifest.digest / MANIFEST_NAME).is_file()
