"""What the pipeline reads of a WebSocket turn or gRPC call (geo_router.ingress.arrival)."""

from __future__ import annotations

import asyncio

import pytest

from geo_router.errors import RequestTooLarge
from geo_router.ingress.arrival import CallArrival, Departure


def arrival(body: bytes = b"{}", departure: Departure | None = None) -> CallArrival:
    headers = [(b"authorization", b"Bearer sk-x"), (b"x-forwarded-for", b"10.0.0.1, 10.0.0.2")]
    return CallArrival(headers, body, "127.0.0.1", departure or Departure())


async def test_a_body_over_the_limit_is_refused_as_an_http_body_is() -> None:
    assert await arrival(b"x" * 10).body(10) == b"x" * 10
    with pytest.raises(RequestTooLarge):
        await arrival(b"x" * 11).body(10)


def test_headers_are_read_as_an_http_requests_are() -> None:
    a = arrival()
    assert a.headers.get("Authorization") == "Bearer sk-x"
    assert a.headers.getlist("x-forwarded-for") == ["10.0.0.1, 10.0.0.2"]
    a.named("req-1")
    assert a.request_id == "req-1"


async def test_the_client_leaving_cancels_the_watched_request_and_a_finished_one_is_forgotten() -> None:
    departure = Departure()

    async def waits(a: CallArrival) -> None:
        watch = a.watch()
        try:
            await asyncio.Future()
        finally:
            watch.stop()

    finished = asyncio.ensure_future(waits(arrival(departure=departure)))
    await asyncio.sleep(0)
    finished.cancel()  # the request ended on its own: its watch is taken back
    await asyncio.gather(finished, return_exceptions=True)
    assert not departure._callbacks

    waiting = asyncio.ensure_future(waits(arrival(departure=departure)))
    await asyncio.sleep(0)
    departure.left()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await arrival(departure=departure).departed()  # returns: the client has gone
