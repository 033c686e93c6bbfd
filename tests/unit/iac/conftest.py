"""Fixtures of the iac tests: the three-cloud plan (see iac_plans)."""

from __future__ import annotations

import pytest
from iac_plans import PLAN

from meridian.infra_plan import InfraPlan


@pytest.fixture(scope="session")
def plan() -> InfraPlan:
    return InfraPlan.model_validate(PLAN)
