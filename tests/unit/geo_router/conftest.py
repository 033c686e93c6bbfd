"""A real router under uvicorn in front of three stand-in nodes (us, eu, apac)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from router_harness import (
    Fabric,
    NodeBehaviour,
    ServerGroup,
    make_table,
    node,
    node_app,
    router_settings,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource


@pytest.fixture
async def fabric() -> AsyncIterator[Fabric]:
    servers = ServerGroup()
    behaviours = {name: NodeBehaviour(name) for name in ("us", "eu", "apac")}
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        source = StaticTableSource(make_table([node(n, u) for n, u in urls.items()]))
        app = create_app(router_settings(), table_source=source)
        f = Fabric(await servers.start(app), behaviours, urls, source, app)
        yield f
        for c in f.clients:
            await c.aclose()
    finally:
        for b in behaviours.values():
            b.release.set()  # a hung or slow node lets go
        await servers.stop()
