"""HTTP/2 on the router's public port, next to HTTP/1.1: h2c by prior knowledge and h2 by
ALPN over TLS, through the production listener, with httpx's HTTP/2 client."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from router_harness import (
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    make_table,
    node,
    node_app,
    router_settings,
    self_signed_cert,
    serve_router,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
AUTH = {"authorization": f"Bearer {GLOBAL_KEY}"}


async def _router(servers: ServerGroup, behaviour: NodeBehaviour, **settings: object) -> str:
    node_url = await servers.start(node_app(behaviour))
    config = router_settings(**settings)
    app = create_app(config, table_source=StaticTableSource(make_table([node("us", node_url)])))
    return await serve_router(servers, app, config)


@pytest.fixture
async def servers() -> AsyncIterator[ServerGroup]:
    group = ServerGroup()
    try:
        yield group
    finally:
        await group.stop()


async def test_h2c_by_prior_knowledge_and_http1_share_the_port(servers: ServerGroup) -> None:
    behaviour = NodeBehaviour("us")
    url = await _router(servers, behaviour)
    async with httpx.AsyncClient(http1=False, http2=True, base_url=url, headers=AUTH, timeout=10) as h2:
        answers = await asyncio.gather(*(h2.post("/v1/chat/completions", json=CHAT) for _ in range(8)))
        assert {(a.status_code, a.http_version) for a in answers} == {(200, "HTTP/2")}
        async with h2.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as streamed:
            lines = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
        assert streamed.http_version == "HTTP/2" and lines[-1] == "data: [DONE]"
        bad = await h2.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and json.loads(bad.content)["error"]["type"] == "invalid_request_error"
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10) as h1:
        answer = await h1.post("/v1/chat/completions", json=CHAT)
    assert (answer.status_code, answer.http_version) == (200, "HTTP/1.1")
    assert behaviour.hits == 10


async def test_h2_by_alpn_over_tls(servers: ServerGroup, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    url = (await _router(servers, NodeBehaviour("us"), tls_cert_file=cert, tls_key_file=key)).replace(
        "http://", "https://")
    verify = ssl.create_default_context(cafile=str(cert))
    async with httpx.AsyncClient(http2=True, verify=verify, base_url=url, headers=AUTH, timeout=10) as h2:
        answer = await h2.post("/v1/chat/completions", json=CHAT)
    assert (answer.status_code, answer.http_version) == (200, "HTTP/2")
    async with httpx.AsyncClient(verify=verify, base_url=url, headers=AUTH, timeout=10) as h1:
        assert (await h1.get("/health")).http_version == "HTTP/1.1"


async def test_http2_can_be_turned_off(servers: ServerGroup) -> None:
    url = await _router(servers, NodeBehaviour("us"), http2_enabled=False)
    async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=5) as h2:
        with pytest.raises(httpx.HTTPError):
            await h2.get("/health")
