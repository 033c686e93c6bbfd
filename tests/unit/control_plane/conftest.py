"""A real control plane (migrated database, lifespan, reaper) behind an in-process client.

Every test here runs once on SQLite and once on Postgres. The app runs on the real clock;
a module (or a test, by parametrizing `clock_kind` with "manual") that waits for a timeout,
a backoff or a window gets a ManualClock instead and moves time itself (`clock` fixture).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN, ControlPlane
from pydantic import SecretStr

from control_plane.app import create_app
from meridian.clock import SYSTEM_CLOCK, Clock, ManualClock
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'control-plane.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Override in a test module to change the control plane's settings."""
    return {}


@pytest.fixture
def settings(database_url: str, settings_overrides: dict[str, Any]) -> ControlPlaneSettings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "cluster_token": SecretStr(CLUSTER_TOKEN),
        "bootstrap_admin_key": SecretStr(ADMIN_KEY),
        "max_long_poll_s": 5.0,
        # Builds spaced in time wait on the app's clock, which a ManualClock test would have to
        # advance for every table it reads; test_table_stream covers the spacing itself.
        "routing_build_min_interval_s": 0.0,
        "routing_build_max_cpu_share": 1.0,
        **settings_overrides,
    }
    return ControlPlaneSettings(**values)


@pytest.fixture
def provider_settings() -> ProviderSettings:
    """The providers whose drivers the control plane runs, and so plans for: on-prem's alone, as
    by default; override in a test module (or parametrize a test) to enable others."""
    return ProviderSettings(enabled=["onprem"])


@pytest.fixture
def clock_kind() -> str:
    """Which clock the app runs on, "system" or "manual": override or parametrize it."""
    return "system"


@pytest.fixture
def clock(clock_kind: str) -> Clock:
    return ManualClock() if clock_kind == "manual" else SYSTEM_CLOCK


@pytest.fixture
async def cp(settings: ControlPlaneSettings, clock: Clock, provider_settings: ProviderSettings) -> AsyncIterator[ControlPlane]:
    app = create_app(settings, clock=clock, providers=provider_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlane(app=app, http=http, settings=settings)
