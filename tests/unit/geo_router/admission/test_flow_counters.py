"""A router's pending changes to a shared work counter fold into one map of the shared value
(`Pending`: charges before a floor, the floor, charges after), whatever run of charges and
lifts made them, so the one script that applies them in Redis does what the router did."""

from __future__ import annotations

import random

import pytest

from geo_router.admission.flow_counters import Pending

Op = tuple[str, float]


def _run(value: float, ops: list[Op]) -> float:
    """The ops one at a time, as the router's local counter sees them."""
    for kind, amount in ops:
        value = value + amount if kind == "charge" else max(value, amount)
    return value


def _fold(ops: list[Op]) -> Pending:
    pending = Pending()
    for kind, amount in ops:
        pending = pending.charged(amount) if kind == "charge" else pending.lifted(amount)
    return pending


def _ops(rng: random.Random) -> list[Op]:
    return [(rng.choice(("charge", "lift")), rng.uniform(-200, 2000)) for _ in range(rng.randint(0, 8))]


@pytest.mark.parametrize("seed", range(100))
def test_a_folded_run_of_charges_and_lifts_does_what_the_run_did(seed: int) -> None:
    rng = random.Random(seed)
    first, second = _ops(rng), _ops(rng)
    for start in (0.0, rng.uniform(0, 3000)):
        assert _fold(first).apply(start) == pytest.approx(_run(start, first))
        # A batch that failed to publish goes back in front of what came since.
        assert _fold(first).then(_fold(second)).apply(start) == pytest.approx(_run(start, first + second))


def test_charges_alone_carry_no_floor() -> None:
    assert _fold([("charge", 100), ("charge", 50)]) == Pending(0.0, None, 150.0)
