"""Four nodes of one region cold-start the same model at once, each with its own cache:
the origin's access log shows every byte fetched from it once; the others came from
the first node (a peer) while it was still downloading. Residency holds for peers."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bench.nginx import NginxServer
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from data_plane.weights.push import push_model
from meridian.ports import free_port
from meridian.settings.node import WeightSettings

MiB = 1024 * 1024
REGION = "aws:us-east-1"
TOKEN = secrets.token_urlsafe(16)
ADMIN = "mk-" + secrets.token_urlsafe(24)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cli", *args], env={**os.environ, **env}, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )


def _wait(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is not None:
                raise AssertionError(f"{log.name} exited {p.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy within {timeout_s}s")


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "cp.log"
    p = _spawn(
        ["control-plane", "serve", "--port", str(port), "--database-url", f"sqlite:///{tmp_path / 'cp.db'}"],
        {"MERIDIAN_CLUSTER_TOKEN": TOKEN, "MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY": ADMIN,
         "MERIDIAN_CP_HEARTBEAT_INTERVAL_S": "0.5"},
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{url}/health", [p], [log])
        yield url
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = TinyArch(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=704)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "peer-llama", arch=arch)


def _node(i: int, uri: str, cp: str, work: Path, region: str = REGION) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = work / f"node-{i}.log"
    env = {
        "MERIDIAN_CLUSTER_TOKEN": TOKEN,
        "MERIDIAN_WEIGHTS_CACHE_DIR": str(work / f"cache-{i}"),
        "MERIDIAN_WEIGHTS_CONCURRENCY": "4",
        "MERIDIAN_WEIGHTS_RANGE_BYTES": str(MiB),
        "MERIDIAN_NODE_KV_CACHE_MEMORY_BYTES": str(4 * MiB),
    }
    args = ["node", "run", "--model-uri", uri, "--region", region, "--node-id", f"node-{i}",
            "--port", str(port), "--control-plane-url", cp]
    return _spawn(args, env, log), f"http://127.0.0.1:{port}", log


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def test_four_cold_nodes_fetch_each_origin_byte_once(
    model_dir: Path, control_plane: str, nginx_server: Callable[..., NginxServer], tmp_path: Path
) -> None:
    origin_root = tmp_path / "origin"
    (origin_root / "peer-llama").mkdir(parents=True)
    manifest = asyncio.run(push_model(model_dir, f"file://{origin_root / 'peer-llama'}",
                                      WeightSettings(manifest_chunk_bytes=MiB)))
    # Throttled like S3, so the first node is still downloading when the others ask.
    nginx = nginx_server(origin_root, limit_rate=2 * MiB)
    uri = f"{nginx.url}/peer-llama"

    started = [_node(i, uri, control_plane, tmp_path) for i in range(4)]
    procs = [p for p, _, _ in started]
    try:
        for _, url, _ in started:
            _wait(f"{url}/health", procs, [lg for _, _, lg in started])

        served: dict[str, list[tuple[int, int]]] = {}
        for rec in nginx.access_records():
            name = rec.path.removeprefix("/peer-llama/")
            if rec.status in (200, 206) and rec.method == "GET" and name != "meridian-manifest.json":
                start = rec.range_start or 0
                served.setdefault(name, []).append((start, start + rec.body_bytes_sent))
        for f in manifest.files:
            spans = sorted(served.get(f.path, []))
            assert sum(e - s for s, e in spans) == f.size, f"{f.path}: origin served {spans} for {f.size} bytes"
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), f"{f.path} overlaps"

        admin = httpx.get(f"{control_plane}/v1/nodes", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        nodes = {n["node_id"]: n for n in admin.json()}
        sources = sorted(nodes[f"node-{i}"]["cold_start"]["weights_source"] for i in range(4))
        assert sources.count("origin") == 1 and sources.count("peer") == 3, sources
        assert all(manifest.digest in n["weights"] for n in nodes.values())
        for _, url, _ in started:
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                           json={"model": "peer-llama", "prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        _stop(procs)


def test_a_zoned_model_is_not_fetched_outside_its_zone(
    model_dir: Path, control_plane: str, tmp_path: Path
) -> None:
    origin = tmp_path / "origin-eu"
    origin.mkdir()
    asyncio.run(push_model(model_dir, f"file://{origin}", WeightSettings(manifest_chunk_bytes=MiB), zone="eu"))
    proc, url, log = _node(9, f"file://{origin}", control_plane, tmp_path, region="aws:us-east-1")
    try:
        assert proc.wait(120) != 0
        text = log.read_text()
        assert "bound to zone 'eu'" in text, text[-3000:]
        assert not list((tmp_path / "cache-9" / "blobs").iterdir())
    finally:
        _stop([proc])
