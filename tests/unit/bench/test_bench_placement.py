"""bench.placement's scale point, which bench.scale calls: a checked plan of the bench fleet with
its time, cost, proven bound and gap; and the fleet's quotas growing with it."""

from __future__ import annotations

import math

from bench.placement import FLEET, fleet_quotas, scale_point
from providers.catalog import load_catalog


def test_a_scale_point_is_a_checked_plan_with_its_bound_and_gap() -> None:
    point = scale_point(40, time_limit_s=30.0)
    assert point.status in ("optimal", "feasible") and point.n_deployments == 40
    assert 0 < point.seconds < 60 and point.n_regions >= 2
    assert math.isfinite(point.lower_bound) and point.lower_bound <= point.objective
    assert point.gap == (point.objective - point.lower_bound) / point.objective or point.gap == 0.0
    assert point.cost > 0 and point.method


def test_cloud_quotas_grow_with_the_fleet_and_on_prem_capacity_does_not() -> None:
    catalog = load_catalog()
    small, big = fleet_quotas(catalog, 10), fleet_quotas(catalog, 10 * FLEET)
    assert small == fleet_quotas(catalog, FLEET)  # below the size they are made for, as they are
    for key, quota in small.items():
        if catalog.gpu_capacity(*key) is None:
            assert big[key] == quota * 10
        else:
            assert big[key] == quota
