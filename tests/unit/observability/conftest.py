"""promtool (Debian's `prometheus` package) for the rules and dashboard-query checks: skipped
when missing, except where services are required (CI, MERIDIAN_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed (apt-get install prometheus)"
        if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(message)
    return path
