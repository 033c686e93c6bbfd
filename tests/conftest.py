"""Fixtures shared by every test folder: external services, skipped when absent.

Postgres and Redis tests skip when the server is unreachable, unless
MERIDIAN_REQUIRE_SERVICES=1 (as in CI), where they fail instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import NoReturn

import pytest
from sqlalchemy.engine import make_url

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SERVICE_TIMEOUT_S = 3


def _unavailable(service: str, url: str, error: Exception) -> NoReturn:
    message = f"{service} at {url} is unreachable: {error}"
    if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(message)


def _libpq_url(url: str, database: str) -> str:
    """The same server as `url` with another database, in the form libpq accepts."""
    return make_url(url).set(drivername="postgresql", database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """URL of the test Postgres server (MERIDIAN_TEST_POSTGRES_URL); checked once."""
    import psycopg

    url = os.environ.get("MERIDIAN_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    try:
        with psycopg.connect(_libpq_url(url, "postgres"), connect_timeout=SERVICE_TIMEOUT_S):
            pass
    except psycopg.Error as e:
        _unavailable("Postgres", url, e)
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """URL of a fresh, empty database of its own, dropped after the test."""
    import psycopg
    from psycopg import sql

    name = f"meridian_test_{uuid.uuid4().hex[:16]}"
    maintenance = _libpq_url(postgres_server_url, "postgres")
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=SERVICE_TIMEOUT_S) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(postgres_server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=SERVICE_TIMEOUT_S) as conn:
            # FORCE: a test that failed may have left a connection open.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the test Redis server (MERIDIAN_TEST_REDIS_URL)."""
    import redis

    url = os.environ.get("MERIDIAN_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=SERVICE_TIMEOUT_S, socket_timeout=SERVICE_TIMEOUT_S
        )
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as e:
        _unavailable("Redis", url, e)
    return url
