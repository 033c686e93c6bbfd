"""The workers of one router share a tenant's rate limit exactly (geo_router.workers.host_buckets):
two limiters on one bucket table, as two worker processes map it, admit what one would."""

from __future__ import annotations

from pathlib import Path

import pytest
from ratelimit_kit import admitted, tenant

from geo_router.admission.ratelimit import InProcessRateLimiter
from geo_router.errors import RateLimited
from geo_router.workers.host_buckets import BucketTable, HostRateLimiter
from meridian.clock import ManualClock


def workers(path: Path, clock: ManualClock, n: int = 2, *, slots: int = 64) -> list[HostRateLimiter]:
    BucketTable.create(path, slots)
    return [HostRateLimiter(BucketTable(path), burst_s=60.0, clock=clock) for _ in range(n)]


def test_two_workers_admit_exactly_one_limit_between_them(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "buckets", clock)
    t = tenant(rpm=10)
    # Alternating between the workers, exactly the bucket's ten requests pass, not ten each.
    outcomes = []
    for i in range(20):
        try:
            (a if i % 2 else b).admit(t, 0)
            outcomes.append(True)
        except RateLimited:
            outcomes.append(False)
    assert sum(outcomes) == 10
    assert admitted(a, t) == admitted(b, t) == 0
    # The refill is the same for both: six seconds bring one request back, to whichever asks.
    clock.advance(6.0)
    assert admitted(b, t) == 1
    assert admitted(a, t) == 0


def test_tokens_charged_and_settled_at_one_worker_count_at_the_other(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "buckets", clock)
    t = tenant(tpm=1000)
    admission = a.admit(t, 400)
    a.settle(t, admission.tokens, 900)  # the answer used more than estimated
    assert b.admit(t, 100).headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited):
        b.admit(t, 1)


def test_the_same_requests_as_one_router(tmp_path: Path) -> None:
    """Driven through the same schedule, the shared table and a lone router's buckets agree."""
    clock = ManualClock()
    shared = workers(tmp_path / "buckets", clock, n=3)
    alone = InProcessRateLimiter(burst_s=60.0, clock=clock)
    t = tenant(rpm=30, tpm=3000)
    for step in range(200):
        tokens = (step * 37) % 90
        results = []
        for limiter in (shared[step % 3], alone):
            try:
                limiter.admit(t, tokens)
                results.append("ok")
            except RateLimited as refused:
                results.append(refused.detail if hasattr(refused, "detail") else "refused")
        assert results[0] == results[1], step
        clock.advance(0.7)


def test_a_tenant_idle_past_the_horizon_frees_its_slot_and_a_full_table_falls_back(tmp_path: Path) -> None:
    clock = ManualClock()
    a, b = workers(tmp_path / "buckets", clock, slots=4)
    live = [tenant(rpm=5, name=f"t{i}") for i in range(4)]
    for t in live:
        assert admitted(a, t) == 5
    # Table full: a fifth tenant gets this worker's own buckets (its limit per worker).
    extra = tenant(rpm=5, name="t-extra")
    assert admitted(a, extra) == 5
    assert admitted(b, extra) == 5
    # Once the others idle past the horizon their slots are free, and the fifth is shared.
    clock.advance(700.0)
    assert admitted(a, extra) == 5
    assert admitted(b, extra) == 0


def test_a_file_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other"
    path.write_bytes(b"not a table" * 100)
    with pytest.raises(ValueError, match="not a rate-limit bucket table"):
        BucketTable(path)
