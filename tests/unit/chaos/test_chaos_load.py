"""The open-loop load generator against a scripted router on loopback.

The stand-in router is a Starlette app under uvicorn in a background thread. The API key a
request carries is its script (ok, stream error event, cut stream, 503, slow, ...), so a
tenant's key picks how the "router" answers it. Every test reads back the client history
the generator wrote, as the checker would.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from router_harness import reserve_port, url_of
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from chaos.arrivals import MAX_PROMPT_CHARS, conversation_messages, system_prompt
from chaos.checker import check
from chaos.drill import DRILLS_DIR, Load, load_drill
from chaos.history import ClientOp, History, HistoryWriter, Outcome, Served, read_records
from chaos.load import LoadGenerator, LoadStats, LoadTarget
from meridian.contracts import HEADER_NODE, HEADER_REGION

REGION = "test:r1"
MODEL = "tiny-test"


# --- the scripted router --------------------------------------------------------------


@dataclass
class Seen:
    """One request as the stand-in router received it."""

    request_id: str
    idempotency_key: str
    port: int
    script: str
    body: dict[str, Any]


@dataclass
class ScriptedRouter:
    """ASGI endpoint answering per the Bearer key; records every request it receives."""

    seen: list[Seen] = field(default_factory=list)
    # Notified on every request received, so a test can wait for the load to reach the
    # router instead of sleeping for as long as it hopes that takes.
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for_requests(self, count: int, timeout_s: float = 5.0) -> bool:
        """Block until `count` requests have been received (True), or the timeout (False)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.seen) >= count, timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        script = headers["authorization"].removeprefix("Bearer ")
        port = scope["server"][1]
        with self.arrived:
            self.seen.append(Seen(headers["x-request-id"], headers["idempotency-key"], port, script, body))
            self.arrived.notify_all()
        await _SCRIPTS[script](body["stream"], port, receive, send)


def _headers(port: int, content_type: str, extra: Mapping[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    out = {"content-type": content_type, HEADER_REGION: REGION, HEADER_NODE: f"node-{port}", **(extra or {})}
    return [(k.encode(), v.encode()) for k, v in out.items()]


async def _json(send: Send, port: int, status: int, data: object, extra: Mapping[str, str] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _headers(port, "application/json", extra)})
    await send({"type": "http.response.body", "body": json.dumps(data).encode()})


def _chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


async def _sse_start(send: Send, port: int) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _headers(port, "text/event-stream")})


async def _more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _ok(stream: bool, port: int, receive: Receive, send: Send) -> None:
    if not stream:
        await _json(send, port, 200, {"id": "c1", "choices": [{"index": 0, "message": {"content": "hi"}}]})
        return
    await _sse_start(send, port)
    await _more(send, _chunk("hel"))
    await asyncio.sleep(0.05)  # so the first byte comes measurably before the end
    await _more(send, _chunk("lo") + b'data: {"choices": [], "usage": {"total_tokens": 3}}\n\n')
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _delay(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await asyncio.sleep(0.3)
    await _ok(stream, port, receive, send)


async def _error_event(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await _sse_start(send, port)
    await _more(send, _chunk("hel"))
    error = {"error": {"message": "node died", "type": "server_error", "code": "upstream_failed"}}
    await _more(send, b"data: " + json.dumps(error).encode() + b"\n\n")
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _cut(stream: bool, port: int, receive: Receive, send: Send) -> None:
    # Returning with the response unfinished makes uvicorn close the connection: the
    # client sees a chunked body that never ends.
    await _sse_start(send, port)
    await _more(send, _chunk("hel") if stream else b'{"choices": [')


async def _no_done(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await _sse_start(send, port)
    await send({"type": "http.response.body", "body": _chunk("hel")})


async def _empty_stream(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await _sse_start(send, port)
    await send({"type": "http.response.body", "body": b": keep-alive\n\n"})


async def _busy(stream: bool, port: int, receive: Receive, send: Send) -> None:
    error = {"message": "scaling", "type": "overloaded", "param": None, "code": "model_scaling_from_zero"}
    await _json(send, port, 503, {"error": error}, {"retry-after": "1"})


async def _zone_down(stream: bool, port: int, receive: Receive, send: Send) -> None:
    error = {"message": "no replica", "type": "unavailable", "param": None, "code": "no_replica_in_zone"}
    await _json(send, port, 503, {"error": error})


async def _null_code(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await _json(send, port, 500, {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}})


async def _plain_502(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 502, "headers": _headers(port, "text/plain")})
    await send({"type": "http.response.body", "body": b"Bad Gateway"})


async def _no_choices(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await _json(send, port, 200, {"id": "c1"})


async def _garbage(stream: bool, port: int, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _headers(port, "application/json")})
    await send({"type": "http.response.body", "body": b"<html>oops</html>"})


async def _slow(stream: bool, port: int, receive: Receive, send: Send) -> None:
    if stream:
        await _sse_start(send, port)
        await _more(send, _chunk("hel"))
    while (await receive())["type"] != "http.disconnect":  # hold it until the client gives up
        pass


_SCRIPTS = {
    "ok": _ok, "delay": _delay, "error-event": _error_event, "cut": _cut, "no-done": _no_done,
    "empty-stream": _empty_stream, "busy": _busy, "zone-down": _zone_down, "null-code": _null_code,
    "plain-502": _plain_502, "no-choices": _no_choices, "garbage": _garbage, "slow": _slow,
}


class _ThreadServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = threading.Event()  # set once startup ended, whether or not it started

    def install_signal_handlers(self) -> None:  # not the main thread
        pass

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.startup_done.set()


@dataclass
class Router:
    """The running stand-in: two listening URLs on one app, and a URL that refuses connections."""

    urls: tuple[str, str]
    refused_url: str
    app: ScriptedRouter

    def by_key(self) -> dict[str, Seen]:
        return {s.request_id: s for s in self.app.seen}


@pytest.fixture(scope="module")
def _running_router() -> Iterator[Router]:
    app = ScriptedRouter()
    starlette = Starlette(routes=[Route("/v1/chat/completions", app, methods=["POST"])])
    socks = [reserve_port(), reserve_port()]
    refused = reserve_port()  # bound, never listening: connecting is refused
    server = _ThreadServer(uvicorn.Config(starlette, log_level="critical", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True)
    thread.start()
    assert server.startup_done.wait(10) and server.started, "uvicorn did not start"
    try:
        yield Router((url_of(socks[0]), url_of(socks[1])), url_of(refused), app)
    finally:
        server.should_exit = True
        thread.join(5)
        for s in [*socks, refused]:
            s.close()


@pytest.fixture
def router(_running_router: Router) -> Router:
    """The module's stand-in router, with no requests remembered from earlier tests."""
    _running_router.app.seen.clear()
    return _running_router


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[HistoryWriter]:
    with HistoryWriter(tmp_path / "client.jsonl") as w:
        yield w


# --- helpers ----------------------------------------------------------------------------


def make_load(scripts: Mapping[str, str] | None = None, **overrides: Any) -> Load:
    """A load of one tenant per script (tenant name = script), 40 arrivals/s for 0.15 s."""
    scripts = scripts or {"t-ok": "ok"}
    values: dict[str, Any] = {
        "arrivals_per_s": 40, "duration_s": 0.15, "streaming_fraction": 0.5, "request_timeout_s": 2,
        "tenants": [{"name": t, "zone": "global", "weight": 1} for t in scripts],
    }
    values.update(overrides)
    return Load.model_validate(values)


def generator(load: Load, writer: HistoryWriter, urls: tuple[str, ...], keys: Mapping[str, str] | None = None,
              **kwargs: Any) -> LoadGenerator:
    keys = keys or {t.name: t.name.removeprefix("t-") for t in load.tenants}
    return LoadGenerator(load, LoadTarget(urls, keys, MODEL), writer, **kwargs)


async def drive(gen: LoadGenerator, writer: HistoryWriter, limit_s: float = 10) -> dict[str, ClientOp]:
    """Run the load to the end; returns each key's final record, checking there is exactly one."""
    assert gen.schedule(), "the test's load must have at least one arrival"
    await asyncio.wait_for(gen.run(time.monotonic()), limit_s)
    return final_records(writer)


def final_records(writer: HistoryWriter) -> dict[str, ClientOp]:
    ops = [r for r in read_records(writer.path) if isinstance(r, ClientOp)]
    finals = [op for op in ops if op.outcome is not None]
    counts = Counter(op.key for op in finals)
    assert all(n == 1 for n in counts.values()), f"keys with two final records: {counts.most_common(3)}"
    assert {op.key for op in ops} == set(counts), "a request was invoked and never ended"
    return {op.key: op for op in finals}


# --- the schedule -----------------------------------------------------------------------


def test_schedule_is_a_seeded_poisson_process_over_the_tenants_weights(tmp_path: Path) -> None:
    load = Load.model_validate({
        "arrivals_per_s": 50, "duration_s": 20, "streaming_fraction": 0.3,
        "tenants": [{"name": "a", "zone": "global", "weight": 3}, {"name": "b", "zone": "eu", "weight": 1}],
    })
    target = LoadTarget(("http://127.0.0.1:9",), {"a": "k", "b": "k"}, MODEL)
    with HistoryWriter(tmp_path / "unused.jsonl") as w:
        runs = [LoadGenerator(load, target, w, seed=s).schedule() for s in range(10)]
        assert LoadGenerator(load, target, w, seed=3).schedule() == runs[3]
    assert runs[0] != runs[1]

    counts = [len(r) for r in runs]
    assert statistics.mean(counts) == pytest.approx(1000, rel=0.03)
    for arrivals in runs:
        times = [a.at_s for a in arrivals]
        assert times == sorted(times) and 0 <= times[0] and times[-1] < 20
    gaps = [b.at_s - a.at_s for r in runs for a, b in zip(r, r[1:], strict=False)]
    # Exponential gaps: mean 1/rate and a standard deviation equal to the mean.
    assert statistics.mean(gaps) == pytest.approx(0.02, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.02, rel=0.05)
    every = [a for r in runs for a in r]
    assert sum(a.tenant == "a" for a in every) / len(every) == pytest.approx(0.75, abs=0.02)
    assert sum(a.stream for a in every) / len(every) == pytest.approx(0.3, abs=0.02)
    assert all(a.conversation is None and a.turn == 0 for a in every)


def test_shared_prefix_conversations_share_a_system_prompt_and_stay_bounded(tmp_path: Path) -> None:
    load = make_load({"t-a": "ok", "t-b": "ok"}, arrivals_per_s=200, duration_s=2, shared_prefix=True)
    with HistoryWriter(tmp_path / "unused.jsonl") as w:
        arrivals = generator(load, w, ("http://127.0.0.1:9",)).schedule()
    turns: dict[tuple[str, int | None], list[int]] = {}
    for a in arrivals:
        turns.setdefault((a.tenant, a.conversation), []).append(a.turn)
    assert {c for _, c in turns} == {0, 1, 2, 3}
    assert all(t == list(range(len(t))) for t in turns.values())

    system = system_prompt("t-a")
    assert 300 <= len(system) < 1000 and system != system_prompt("t-b")
    prompts = [conversation_messages(0, "t-a", 1, turn) for turn in range(60)]
    assert all(p[0] == {"role": "system", "content": system} for p in prompts)
    sizes = [sum(len(m["content"]) for m in p) for p in prompts]
    assert max(sizes) <= MAX_PROMPT_CHARS
    assert len(prompts[5]) == 1 + 2 * 5 + 1  # system, five earlier turns, the new one
    # Old turns are dropped, not kept forever; the newest one always stays.
    assert prompts[59][-1]["content"].startswith("Question 60:")
    assert not any(m["content"].startswith("Question 1:") for m in prompts[59])
    # Each turn extends its conversation: the previous turn's question is still in it.
    assert prompts[6][-3] == prompts[5][-1]
    assert [m["role"] for m in prompts[3]] == ["system", "user", "assistant", "user", "assistant", "user",
                                               "assistant", "user"]


# --- outcomes, as the checker reads them -------------------------------------------------


async def test_ok_answers_are_recorded_with_their_headers_and_the_request_is_well_formed(
    router: Router, writer: HistoryWriter
) -> None:
    load = make_load(arrivals_per_s=60, duration_s=0.5, max_tokens=24, shared_prefix=True)
    gen = generator(load, writer, router.urls[:1], key_prefix="okrun")
    ops = await drive(gen, writer)
    schedule = gen.schedule()

    assert set(ops) == {gen.key(n) for n in range(len(schedule))}
    assert {op.stream for op in ops.values()} == {True, False}
    # A stream's first byte is its first event, not its end: the script waits 50 ms between
    # them. Judged on the median, because a client loop starved past those 50 ms on a
    # loaded box reads both chunks at once; recorded at the end, every gap would be ~0.
    gaps = [op.end_s - op.first_byte_s for op in ops.values() if op.stream and op.end_s and op.first_byte_s]
    assert statistics.median(gaps) >= 0.03
    for n, arrival in enumerate(schedule):
        op = ops[gen.key(n)]
        assert (op.outcome, op.status, op.error_code) == (Outcome.OK, 200, None)
        assert (op.region, op.node) == (REGION, f"node-{router.urls[0].rsplit(':', 1)[1]}")
        assert op.end_s is not None and op.first_byte_s is not None
        assert arrival.at_s <= op.invoke_s < op.first_byte_s <= op.end_s
        if not op.stream:
            assert op.first_byte_s == op.end_s

        seen = router.by_key()[op.key]
        assert seen.idempotency_key == op.key
        assert seen.body["model"] == MODEL and seen.body["max_tokens"] == 24 and seen.body["temperature"] == 0
        assert seen.body["stream"] is arrival.stream
        assert ("stream_options" in seen.body) is arrival.stream
        assert seen.body["messages"] == conversation_messages(0, "t-ok", arrival.conversation or 0, arrival.turn)
    assert (gen.stats.sent, gen.stats.ok, gen.stats.in_flight) == (len(schedule), len(schedule), 0)


@pytest.mark.parametrize(
    ("script", "stream", "outcome", "status", "code", "first_byte", "extra"),
    [
        ("error-event", True, Outcome.FAIL, 200, "upstream_failed", True, {"stream_error_event": True}),
        ("cut", True, Outcome.INDETERMINATE, 200, "stream_cut", True, {}),
        ("no-done", True, Outcome.INDETERMINATE, 200, "stream_cut", True, {}),
        ("empty-stream", True, Outcome.FAIL, 200, "bad_response", False, {}),
        ("cut", False, Outcome.INDETERMINATE, 200, "connection_lost", False, {}),
        ("busy", False, Outcome.FAIL, 503, "model_scaling_from_zero", False, {"retry_after": True}),
        ("busy", True, Outcome.FAIL, 503, "model_scaling_from_zero", False, {"retry_after": True}),
        ("null-code", False, Outcome.FAIL, 500, "server_error", False, {}),
        ("plain-502", False, Outcome.FAIL, 502, None, False, {}),
        ("no-choices", False, Outcome.FAIL, 200, "bad_response", False, {}),
        ("garbage", False, Outcome.FAIL, 200, "bad_response", False, {}),
        ("slow", False, Outcome.INDETERMINATE, None, "timeout", False, {}),
        ("slow", True, Outcome.INDETERMINATE, 200, "timeout", True, {}),
    ],
)
async def test_each_kind_of_answer_gets_the_outcome_the_checker_relies_on(
    router: Router, writer: HistoryWriter, script: str, stream: bool, outcome: Outcome, status: int | None,
    code: str | None, first_byte: bool, extra: dict[str, bool],
) -> None:
    # Only the held request needs a short timeout; the others get one a stalled CI loop cannot
    # reach, or a loaded machine turns their definite answer into a timeout.
    timeout = 0.4 if script == "slow" else 30.0
    load = make_load({f"t-{script}": script}, streaming_fraction=1.0 if stream else 0.0, request_timeout_s=timeout)
    started = time.monotonic()
    ops = await drive(generator(load, writer, router.urls[:1]), writer)

    for op in ops.values():
        assert (op.outcome, op.error_code, op.stream) == (outcome, code, stream)
        assert op.status == status  # None: a non-streaming timeout never saw the answer's head
        assert op.region == (REGION if status is not None else None)
        assert (op.first_byte_s is not None) == first_byte
        assert op.retry_after is extra.get("retry_after", False)
        assert op.stream_error_event is extra.get("stream_error_event", False)
        assert op.end_s is not None
        if code == "timeout":
            # The server holds the request forever: the client's timeout ended it (the upper
            # bound is loose, as a shared CI machine can stall the loop for a second or two).
            assert timeout - 0.05 <= op.end_s - op.invoke_s < timeout + 5
    assert time.monotonic() - started < min(timeout, 0.4) + 10


async def test_a_refused_connection_is_a_definite_failure_and_urls_take_turns(
    router: Router, writer: HistoryWriter
) -> None:
    gen = generator(make_load(arrivals_per_s=80), writer, (router.urls[0], router.refused_url, router.urls[1]))
    ops = await drive(gen, writer)
    seen = router.by_key()
    ports = [int(u.rsplit(":", 1)[1]) for u in router.urls]

    for n in range(len(gen.schedule())):
        op = ops[gen.key(n)]
        if n % 3 == 1:
            assert (op.outcome, op.status, op.error_code, op.region) == (Outcome.FAIL, None, "connect_error", None)
            assert op.key not in seen  # it never left
        else:
            assert op.outcome is Outcome.OK
            assert seen[op.key].port == ports[n % 3 // 2]
    assert len(ops) >= 6  # every URL had its turn at least twice


async def test_stop_ends_sending_and_lets_requests_in_flight_finish(router: Router, writer: HistoryWriter) -> None:
    load = make_load({"t-delay": "delay"}, arrivals_per_s=40, duration_s=5)
    gen = generator(load, writer, router.urls)
    start = time.monotonic()
    run = asyncio.create_task(gen.run(start))
    # Stop once the router holds six requests, each answered 0.3 s after it arrived.
    assert await asyncio.to_thread(router.app.wait_for_requests, 6)
    in_flight = gen.stats.in_flight
    gen.stop()
    stopped_s = time.monotonic() - start
    await asyncio.wait_for(run, 1.5)

    ops = final_records(writer)
    assert in_flight > 0 and 5 < len(ops) < len(gen.schedule()) / 4
    assert all(op.outcome is Outcome.OK for op in ops.values())  # in flight at stop, still answered
    assert max(op.invoke_s for op in ops.values()) <= stopped_s
    assert max(op.end_s or 0 for op in ops.values()) > stopped_s
    assert gen.stats.sent == gen.stats.ok == len(ops) and gen.stats.in_flight == 0


async def test_arrivals_beyond_max_in_flight_are_recorded_as_overload_not_dropped(
    router: Router, writer: HistoryWriter
) -> None:
    load = make_load({"t-slow": "slow"}, arrivals_per_s=80, streaming_fraction=0, request_timeout_s=0.4)
    gen = generator(load, writer, router.urls, max_in_flight=2)
    ops = await drive(gen, writer)

    codes = Counter(op.error_code for op in ops.values())
    assert codes == {"timeout": 2, "generator_overloaded": len(ops) - 2}
    assert len(ops) == len(gen.schedule()) > 4
    for op in ops.values():
        if op.error_code == "generator_overloaded":
            assert (op.outcome, op.status, op.end_s) == (Outcome.FAIL, None, op.invoke_s)
    assert len(router.by_key().keys() & ops.keys()) == 2
    assert gen.stats.overloaded == len(ops) - 2 and gen.stats.failed == len(ops) - 2


async def test_a_cancelled_run_still_ends_every_request_it_sent(router: Router, writer: HistoryWriter) -> None:
    load = make_load({"t-slow": "slow"}, arrivals_per_s=40, duration_s=5, streaming_fraction=0)
    gen = generator(load, writer, router.urls)
    run = asyncio.create_task(gen.run(time.monotonic()))
    # Cancel once the router holds a request (it never answers one: the script is slow).
    assert await asyncio.to_thread(router.app.wait_for_requests, 1)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 2)

    # A non-streaming request without an end would count as lost; these may have run.
    ops = final_records(writer)
    assert ops and {(op.outcome, op.error_code) for op in ops.values()} == {(Outcome.INDETERMINATE, "cancelled")}
    assert gen.stats.in_flight == 0 and gen.stats.indeterminate == len(ops)


def test_recent_error_rate_counts_requests_that_ended_in_the_window() -> None:
    stats = LoadStats()
    assert stats.recent_error_rate(5, 10) is None
    for end_s, outcome in [(1, Outcome.OK), (2, Outcome.FAIL), (6, Outcome.OK), (7, Outcome.INDETERMINATE),
                           (8, Outcome.OK), (9, Outcome.OK)]:
        stats.record_end(end_s, outcome)
    assert stats.recent_error_rate(5, 9) == pytest.approx(1 / 4)  # ends in (4, 9]
    assert stats.recent_error_rate(100, 9) == pytest.approx(2 / 6)
    assert stats.recent_error_rate(1.5, 2) == pytest.approx(1 / 2)
    assert stats.recent_error_rate(1, 5) is None
    assert (stats.ok, stats.failed, stats.indeterminate) == (4, 1, 1)


async def test_the_checker_judges_a_generated_history(router: Router, writer: HistoryWriter) -> None:
    drill = load_drill(DRILLS_DIR / "03-region-outage.yaml")
    load = drill.load.model_copy(update={"arrivals_per_s": 150, "duration_s": 0.4, "streaming_fraction": 1.0})
    scripts = {"acme-global": "ok", "acme-eu": "zone-down", "acme-us": "error-event", "acme-apac": "cut"}
    gen = generator(load, writer, router.urls, keys=scripts, seed=5)
    ops = await drive(gen, writer)
    # The stand-in router stands in for the nodes too: it completed every request it answered ok.
    history = History(client=list(ops.values()),
                      served=[Served(k, op.node or "", True) for k, op in ops.items() if op.outcome is Outcome.OK])

    result = check(history, drill, {REGION: ["us", "eu", "apac"]})
    by_tenant: dict[str, set[str]] = {t: set() for t in scripts}
    for op in ops.values():
        by_tenant[op.tenant].add(op.key)
    assert all(by_tenant.values()), "every tenant needs a request in this run"

    assert result.attempts == len(ops) and result.lost == ()
    assert set(result.clean_errors) == by_tenant["acme-eu"] | by_tenant["acme-us"]  # allowed 503, error event
    assert result.unclean_errors == () and result.residency_violations == ()
    assert result.acknowledged == len(by_tenant["acme-global"])
    assert set(result.indeterminate) == set(result.streams_without_error_event) == by_tenant["acme-apac"]
    # Without the cut streams the history would pass those criteria; with them it must not.
    failed = {c.name for c in result.verdict(drill).failures()}
    assert "streams_without_error_event" in failed and "lost" not in failed and "unclean_errors" not in failed
