"""Fixtures shared by the integration tests that use Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    p = f"meridian-test:{uuid.uuid4().hex}:"
    yield p
    client = Redis.from_url(redis_url, socket_timeout=3, socket_connect_timeout=3)
    try:
        keys = [k async for k in client.scan_iter(match=p + "*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
