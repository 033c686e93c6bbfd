"""The migration budget and the seam's arithmetic: pure parts of stream migration."""

from __future__ import annotations

import asyncio

from geo_router.forwarding.migration.budget import MigrationBudget
from geo_router.forwarding.migration.ledger import unsent_tail
from meridian.clock import ManualClock


def budget(clock: ManualClock, **kw: float) -> MigrationBudget:
    values = {"percent": 0.0, "min_concurrency": 1, "tokens_per_s": 100.0, "burst_tokens": 1000,
              "queue_timeout_s": 5.0, **kw}
    return MigrationBudget(clock, **values)  # type: ignore[arg-type]


def test_re_prefilled_tokens_come_from_a_bucket_that_refills_with_time() -> None:
    clock = ManualClock()
    b = budget(clock, min_concurrency=10)
    assert b.try_acquire(800)
    assert not b.try_acquire(300)  # 200 left
    clock.advance(1.0)  # +100 tokens
    assert b.try_acquire(300)
    assert b.tokens() == 0


def test_migrations_in_flight_are_a_share_of_the_streams_with_a_floor() -> None:
    b = budget(ManualClock(), percent=50.0, min_concurrency=2)
    for _ in range(10):
        b.begin_stream()
    assert b.limit() == 5
    for _ in range(8):
        b.end_stream()
    assert b.limit() == 2


async def test_a_migration_over_the_budget_waits_its_turn_instead_of_failing() -> None:
    clock = ManualClock()
    b = budget(clock)
    assert await b.acquire(10)
    second = asyncio.create_task(b.acquire(10))
    third = asyncio.create_task(b.acquire(10))
    await clock.settled(2)  # both wait on the router's clock, which has not moved
    assert not second.done() and not third.done()
    b.release()
    assert await asyncio.wait_for(second, 1.0) is True
    assert not third.done()  # in line behind the second, which holds the one slot
    b.release()
    assert await asyncio.wait_for(third, 1.0) is True


async def test_a_migration_that_waits_past_the_queue_timeout_is_refused() -> None:
    clock = ManualClock()
    b = budget(clock, queue_timeout_s=0.05)
    assert await b.acquire(10)
    waiting = asyncio.create_task(b.acquire(10))
    await clock.settled()
    await clock.advance_async(0.04)
    assert not waiting.done()
    await clock.advance_async(0.01)
    assert await waiting is False
    assert await b.acquire(5000) is False  # more than the bucket ever holds: no waiting


async def test_a_migration_short_of_tokens_goes_when_the_bucket_has_refilled_for_it() -> None:
    clock = ManualClock()
    b = budget(clock, min_concurrency=10, tokens_per_s=100.0, burst_tokens=1000)
    assert await b.acquire(900)  # 100 left
    waiting = asyncio.create_task(b.acquire(300))  # 200 more: two seconds of refill
    await clock.settled()
    await clock.advance_async(1.9)
    assert not waiting.done()
    await clock.advance_async(0.1)
    assert await waiting is True
    assert b.active_migrations == 2


def test_the_unsent_tail_is_what_the_node_held_back() -> None:
    assert unsent_tail("hello wor", "hello ") == "wor"
    assert unsent_tail("hello", "hello") == ""
    # A decoder that tidied a space earlier: the seam is found from the text's end.
    sent = "Hello , world and then some more words to anchor the seam"
    assert unsent_tail(sent.replace(" ,", ",") + " ST", sent) == " ST"
    assert unsent_tail("something else entirely", "not a prefix of it at all, not at all!!") is None
