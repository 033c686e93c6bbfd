"""A node started from a model URI: pulls into its cache, serves from it, reports its
cold start, and shares its cache with peers that hold the cluster token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from node_testkit import CHAT_REQUEST, MODEL_NAME, asgi_client, make_settings
from pydantic import SecretStr

from data_plane.server.app import create_app
from data_plane.weights.manifest import MANIFEST_NAME, Manifest
from data_plane.weights.push import push_model
from meridian.settings.node import WeightSettings

TOKEN = "cluster-secret"


@pytest.fixture(scope="module")
def origin_uri(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    origin = tmp_path_factory.mktemp("origin") / MODEL_NAME
    origin.mkdir()
    uri = f"file://{origin}"
    asyncio.run(push_model(tiny_checkpoint, uri, WeightSettings(manifest_chunk_bytes=64 * 1024)))
    return uri


def _node(origin_uri: str, cache: Path, **kw: object):  # type: ignore[no-untyped-def]
    settings = make_settings(
        Path("unused"), model_dir=None, model_uri=origin_uri, cluster_token=SecretStr(TOKEN),
        weights=WeightSettings(cache_dir=cache, range_bytes=64 * 1024), **kw,
    )
    return create_app(settings)


async def test_node_pulls_its_model_then_serves_and_reports_the_cold_start(origin_uri: str, tmp_path: Path) -> None:
    app = _node(origin_uri, tmp_path / "cache")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with asgi_client(app) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT_REQUEST, "max_tokens": 4}, headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL_NAME  # named after the URI's last segment
        metrics = (await client.get("/metrics")).text
        assert 'meridian_node_cold_start_seconds{step="weights_cached"}' in metrics
        assert 'meridian_node_cold_start_seconds{step="ready"}' in metrics
        assert 'meridian_node_weights_fetched_bytes_total{source="origin"}' in metrics
        timeline = app.state.runtime.cold_start
        assert timeline.weights_source == "origin" and timeline.fetched_bytes > 0
        assert 0 <= timeline.weights_cached_s <= timeline.loaded_s <= timeline.ready_s

    # Started again on the same cache: nothing is fetched.
    warm = _node(origin_uri, tmp_path / "cache")
    async with asgi_client(warm):
        assert warm.state.runtime.cold_start.weights_source == "cache"
        assert warm.state.runtime.cold_start.fetched_bytes == 0


async def test_peers_read_cached_blobs_by_range_with_the_cluster_token(origin_uri: str, tmp_path: Path) -> None:
    app = _node(origin_uri, tmp_path / "cache")
    manifest = Manifest.parse((Path(origin_uri.removeprefix("file://")) / MANIFEST_NAME).read_bytes())
    big = max(manifest.files, key=lambda f: f.size)
    data = (Path(origin_uri.removeprefix("file://")) / big.path).read_bytes()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with asgi_client(app) as client:
        url = f"/v1/weights/blobs/{big.sha256}"
        assert (await client.get(url, headers={"Range": "bytes=0-99"})).status_code == 401
        r = await client.get(url, headers={**auth, "Range": "bytes=100-1123"})
        assert r.status_code == 206
        assert r.headers["content-range"] == f"bytes 100-1123/{big.size}"
        assert r.content == data[100:1124]
        head = await client.head(url, headers=auth)
        assert int(head.headers["content-length"]) == big.size
        assert (await client.get(f"/v1/weights/blobs/{'0' * 64}", headers=auth)).status_code == 404
        bad = await client.get(url, headers={**auth, "Range": f"bytes={big.size}-"})
        assert bad.status_code == 416
        served = await client.get(f"/v1/weights/models/{manifest.digest}/{MANIFEST_NAME}", headers=auth)
        assert Manifest.parse(served.content).digest == manifest.digest
        escape = await client.get(f"/v1/weights/models/{manifest.digest}/..%2F..%2Fblobs", headers=auth)
        assert escape.status_code == 404
