"""A request whose client leaves stops costing compute (issue 18, finding 7): through the
router, four non-streamed requests abandoned by their clients used to run to max_tokens
(4,096 generated tokens for nobody); streamed ones were already aborted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from router_harness import eventually
from tenant_fabric import MODEL, Tenant, TenantFabric, tenant_fabric

from data_plane.model.make_tiny import make_tiny_checkpoint

ACME = Tenant("acme", "mrd_acme-tenant-key-1")
MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


async def abandon(fabric: TenantFabric, stream: bool) -> int:
    """Send a long request, hang up once the node generates for it, wait until it stops;
    the tokens it generated."""
    engine = fabric.node.state.runtime.engine
    before = engine.stats().generation_tokens_total
    async with fabric.client(ACME) as client:
        request = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": stream}))
        await eventually(lambda: engine.stats().generation_tokens_total >= before + 8)
        request.cancel()  # the client goes away: its connection is closed
        with pytest.raises((asyncio.CancelledError, httpx.HTTPError)):
            await request
    await eventually(lambda: engine.stats().running == 0)
    return engine.stats().generation_tokens_total - before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
# The router's own listener tells it of the hang-up; under another server it waits on receive().
@pytest.mark.parametrize("plain_listener", [False, True], ids=["meridian-listener", "plain-uvicorn"])
async def test_an_abandoned_request_stops_generating(checkpoint: Path, stream: bool, plain_listener: bool) -> None:
    async with tenant_fabric(checkpoint, [ACME], node={"max_tokens_limit": MAX_TOKENS},
                             plain_listener=plain_listener) as fabric:
        spent = [await abandon(fabric, stream) for _ in range(4)]
        # Each was aborted on the node soon after its client left, not run to max_tokens.
        stats = fabric.node.state.runtime.engine.stats()
        assert stats.requests_aborted_total == 4 and stats.requests_finished_total == 0
        assert all(tokens < MAX_TOKENS // 2 for tokens in spent), spent
        assert not fabric.node_ejected()
