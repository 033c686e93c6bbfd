"""Fixtures shared by the integration tests: Redis key prefixes, a Redis client, the router
mirrors a test made, AWS credentials for moto."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aws_moto import KEYS
from redis.asyncio import Redis
from redis_sharing import Mirrors


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


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client of the test Redis, for a test to look at (or plant) what routers share."""
    client = Redis.from_url(redis_url, socket_timeout=3, socket_connect_timeout=3)
    yield client
    await client.aclose()


@pytest.fixture
async def mirrors() -> AsyncIterator[Mirrors]:
    """The routers' Redis mirrors this test makes, stopped when it ends."""
    made = Mirrors()
    yield made
    await made.stop_all()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """boto3's credential chain sees moto's fake keys and nothing of this machine's."""
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEYS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEYS["aws_secret_access_key"])
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


