"""The shared retry schedule: doubling, capped, jittered within its bounds."""

import pytest

from meridian.backoff import Backoff


def test_delays_double_up_to_the_cap() -> None:
    b = Backoff(0.5, 4.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_proportional_jitter_stays_within_its_band() -> None:
    b = Backoff(1.0, 60.0, jitter=0.2)
    assert b.delay(3, rand=lambda: 0.0) == pytest.approx(4.0 * 0.8)
    assert b.delay(3, rand=lambda: 1.0) == pytest.approx(4.0 * 1.2)


def test_full_jitter_draws_from_zero_to_the_capped_delay() -> None:
    b = Backoff(1.0, 5.0, full=True)
    assert b.delay(10, rand=lambda: 0.0) == 0.0
    assert b.delay(10, rand=lambda: 1.0) == 5.0
    assert 0.0 <= b.delay(2) <= 2.0
