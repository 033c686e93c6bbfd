"""Fixtures of the placement tests: the fixed world of placement_world."""

from __future__ import annotations

import pytest
from placement_world import make_offerings, make_regions

from meridian.contracts import RegionInfo
from providers.offerings import Offering


@pytest.fixture
def regions() -> dict[str, RegionInfo]:
    return make_regions()


@pytest.fixture
def offerings() -> list[Offering]:
    return make_offerings()
