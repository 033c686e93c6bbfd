"""A node with a cluster token serves routers only; probes and scrapers stay open."""

from pathlib import Path

import pytest
from node_testkit import asgi_client, make_settings

from data_plane.server.app import create_app

TOKEN = "cluster-secret"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer mrd_tenant-key"])
async def test_generation_needs_the_cluster_token(tiny_checkpoint: Path, authorization: str | None):
    app = create_app(make_settings(tiny_checkpoint, cluster_token=TOKEN))
    headers = {"authorization": authorization} if authorization else {}
    async with asgi_client(app) as client:
        for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {**CHAT, "prompt": "hi"}),
                                   ("GET", "/v1/models", None)):
            r = await client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_router_with_the_token_is_served(tiny_checkpoint: Path):
    app = create_app(make_settings(tiny_checkpoint, cluster_token=TOKEN))
    async with asgi_client(app) as client:
        r = await client.post("/v1/chat/completions", json=CHAT,
                              headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] > 0
