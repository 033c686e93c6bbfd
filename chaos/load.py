"""Open-loop load generator for chaos drills: it sends a drill's `Load` at the geo router.

Arrivals are a seeded Poisson process (chaos.arrivals); each request is sent at its time
as its own task and never waits for earlier answers, so a slow or broken fabric meets the
full load instead of a load that politely backs off (coordinated omission). Every request becomes two `ClientOp`
records in the client history: one with no outcome when it is sent and one when it ends,
with the outcome judged so that `chaos.checker` draws the right conclusions:

- `ok`: a complete answer (a 200 JSON body with `choices`; a stream that ended with
  `data: [DONE]` and no error event).
- `fail`: a definite failure: an HTTP error status (with the OpenAI error `code`, or `type`
  when the code is null, and whether Retry-After was present), a stream that carried an SSE
  error event, a malformed answer (`bad_response`), a connection that could not be opened
  (`connect_error`: the request never left), or an arrival the generator itself could not
  send (`generator_overloaded`, see `LoadGenerator`).
- `indeterminate`: the request left but its end is unknown: the per-request deadline
  passed (`timeout`), the connection was lost before the answer (`connection_lost`), or a
  stream broke after its first event without an error event or `[DONE]` (`stream_cut`).

Times are seconds since the load's start, on the `time.monotonic()` clock.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from chaos.arrivals import Arrival, conversation_messages, fresh_prompt, make_schedule, system_prompt
from chaos.drill import Load
from chaos.history import ClientOp, HistoryWriter, Outcome, StreamDetail
from chaos.protocols import (
    Ended,
    body_error_code,
    error_code,
    infer_request,
    prompt_of,
    send_grpc,
    send_websocket,
)
from chaos.streams import (
    LongRequest,
    StreamReading,
    StreamTracker,
    long_stream_body,
    read_events,
    sse_payloads,
)
from meridian.contracts import HEADER_NODE, HEADER_REGION, HEADER_REQUEST_ID

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
HEADER_IDEMPOTENCY_KEY = "idempotency-key"
# The router refuses any other request id, so keys are checked before a single one is sent.
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where the load goes: routers (round-robin), each tenant's API key, and the model name."""

    router_urls: tuple[str, ...]
    api_keys: Mapping[str, str]  # drill tenant name -> API key
    model: str
    # Each router's gRPC listener (host:port), in router_urls' order; needed when the load
    # sends over gRPC (Load.protocols).
    grpc_targets: tuple[str, ...] = ()


@dataclass
class LoadStats:
    """Live counters for the runner's abort conditions and progress.

    `sent` counts every arrival the generator dispatched, overloaded ones included, so
    `sent == ok + failed + indeterminate + in_flight` at all times.
    """

    sent: int = 0
    ok: int = 0
    failed: int = 0
    indeterminate: int = 0
    in_flight: int = 0
    overloaded: int = 0  # arrivals recorded as generator_overloaded (also counted in failed)
    # End times in the order requests ended (non-decreasing: one clock, one event loop) and a
    # running count of the non-ok ones, so a window's error rate is two bisections.
    _ends: list[float] = field(default_factory=list, init=False, repr=False)
    _bad_before: list[int] = field(default_factory=lambda: [0], init=False, repr=False)

    def record_end(self, end_s: float, outcome: Outcome) -> None:
        """Count one request that ended at `end_s` (the generator calls this)."""
        if outcome is Outcome.OK:
            self.ok += 1
        elif outcome is Outcome.FAIL:
            self.failed += 1
        else:
            self.indeterminate += 1
        if self._ends and end_s < self._ends[-1]:
            end_s = self._ends[-1]  # keep the list sorted for bisection
        self._ends.append(end_s)
        self._bad_before.append(self._bad_before[-1] + (outcome is not Outcome.OK))

    def recent_error_rate(self, window_s: float, now_s: float) -> float | None:
        """Share of requests that ended in (now_s - window_s, now_s] and were not OK; None if none ended."""
        lo = bisect.bisect_right(self._ends, now_s - window_s)
        hi = bisect.bisect_right(self._ends, now_s)
        if hi <= lo:
            return None
        return (self._bad_before[hi] - self._bad_before[lo]) / (hi - lo)


@dataclass(slots=True)
class _Seen:
    """What one request has observed so far; a timeout keeps whatever had arrived."""

    status: int | None = None
    region: str | None = None
    node: str | None = None
    first_byte_s: float | None = None
    reading: StreamReading | None = None  # a long stream's events so far


class LoadGenerator:
    """Sends one drill's open-loop schedule and records every request in the client history.

    When `max_in_flight` requests are already outstanding, a new arrival is not sent but
    recorded at once as `fail` / `generator_overloaded`. Dropping it silently would make the
    fabric meet less load than the drill declares and look healthier than it is; sending it
    anyway would let a wedged fabric exhaust the generator's sockets and memory. Recording it
    keeps the history honest: the drill fails as unclean errors, and the code says whose fault.
    """

    def __init__(
        self,
        load: Load,
        target: LoadTarget,
        writer: HistoryWriter,
        *,
        seed: int = 0,
        key_prefix: str = "req",
        max_in_flight: int = 2000,
        http: httpx.AsyncClient | None = None,
        schedule: Sequence[Arrival] | None = None,
    ) -> None:
        if not target.router_urls:
            raise ValueError("LoadTarget.router_urls is empty")
        missing = sorted(t.name for t in load.tenants if t.name not in target.api_keys)
        if missing:
            raise ValueError(f"no API key for tenants {missing}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if "grpc" in load.protocols and len(target.grpc_targets) != len(target.router_urls):
            raise ValueError("the load sends over gRPC: LoadTarget.grpc_targets must name each router's listener")
        if not _KEY_PATTERN.match(f"{key_prefix}-000000"):
            raise ValueError(f"key_prefix {key_prefix!r} does not make valid request ids ({_KEY_PATTERN.pattern})")
        self.load = load
        self.target = target
        self.stats = LoadStats()
        self._writer = writer
        self._seed = seed
        self._key_prefix = key_prefix
        self._max_in_flight = max_in_flight
        self._http = http
        self._zones = {t.name: t.zone for t in load.tenants}
        self._urls = tuple(u.rstrip("/") + CHAT_PATH for u in target.router_urls)
        self._ws_urls = tuple(u.rstrip("/").replace("http", "ws", 1) + "/v1/responses" for u in target.router_urls)
        self._channels: list[grpc.aio.Channel] = []
        self._timeout = httpx.Timeout(
            connect=min(CONNECT_TIMEOUT_S, load.request_timeout_s),
            read=load.request_timeout_s,
            write=load.request_timeout_s,
            pool=load.request_timeout_s,
        )
        # An explicit schedule (a burst) replaces the load's Poisson arrivals.
        self._schedule = list(schedule) if schedule is not None else make_schedule(load, seed)
        # The injectors of mid-stream faults watch the long streams' progress here.
        self.tracker = StreamTracker(expected=sum(a.long for a in self._schedule))
        self._stop = asyncio.Event()
        self._started = False

    def schedule(self) -> list[Arrival]:
        """The whole open-loop schedule, in time order; the same for the same load and seed."""
        return list(self._schedule)

    def long_requests(self) -> list[LongRequest]:
        """The long streams of the schedule: key, tenant and the exact body each will send."""
        return [LongRequest(self.key(n), a.tenant, self._body(n, a))
                for n, a in enumerate(self._schedule) if a.long]

    def key(self, n: int) -> str:
        """The idempotency key of the schedule's n-th arrival."""
        return f"{self._key_prefix}-{n:06d}"

    def stop(self) -> None:
        """Stop sending new requests (abort); in-flight ones still end and are recorded."""
        self._stop.set()

    async def run(self, start: float) -> None:
        """Send the whole open-loop schedule (start = time.monotonic() of second 0), then wait for every request to end."""
        if self._started:
            raise RuntimeError("a LoadGenerator runs once")
        self._started = True
        client = self._http or httpx.AsyncClient(
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=self._max_in_flight, max_keepalive_connections=self._max_in_flight),
        )
        tasks: set[asyncio.Task[None]] = set()
        if "grpc" in self.load.protocols:
            self._channels = [grpc.aio.insecure_channel(t) for t in self.target.grpc_targets]
        try:
            for n, arrival in enumerate(self._schedule):
                delay = start + arrival.at_s - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stop.wait()
                if self._stop.is_set():
                    break
                self._dispatch(n, arrival, start, client, tasks)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            # Only on the way out of a cancelled or failed run: end the requests still in
            # flight (each records itself as cancelled) before their client is closed.
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self._http is None:
                await client.aclose()
            for channel in self._channels:
                await channel.close()

    # --- one request ------------------------------------------------------------------

    def _dispatch(
        self, n: int, arrival: Arrival, start: float, client: httpx.AsyncClient, tasks: set[asyncio.Task[None]]
    ) -> None:
        key = self.key(n)
        zone = self._zones[arrival.tenant]
        now_s = time.monotonic() - start
        self.stats.sent += 1
        if self.stats.in_flight >= self._max_in_flight:
            self.stats.overloaded += 1
            self._writer.append(
                ClientOp(key, arrival.tenant, zone, arrival.stream, now_s, None, now_s, Outcome.FAIL,
                         error_code="generator_overloaded", protocol=arrival.protocol)
            )
            self.stats.record_end(now_s, Outcome.FAIL)
            return
        # Recorded before the task runs, so the history never shows a request the router
        # handled before the client invoked it.
        # A long stream is marked as one from the start (an empty detail), so that one that
        # never ends still counts among the long streams.
        self._writer.append(ClientOp(key, arrival.tenant, zone, arrival.stream, now_s,
                                     detail=StreamDetail() if arrival.long else None, protocol=arrival.protocol))
        self.stats.in_flight += 1
        task = asyncio.create_task(self._request(n, key, arrival, zone, now_s, start, client), name=key)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _request(
        self, n: int, key: str, arrival: Arrival, zone: str, invoke_s: float, start: float, client: httpx.AsyncClient
    ) -> None:
        seen = _Seen()
        try:
            try:
                async with asyncio.timeout(self._deadline_s(arrival)):
                    end = await self._send(n, key, arrival, start, client, seen)
            except TimeoutError:  # the overall deadline (asyncio) or one of httpx's
                end = Ended(Outcome.INDETERMINATE, "timeout")
            except httpx.TimeoutException as e:
                end = _timeout_end(e)
            except httpx.ConnectError:
                end = Ended(Outcome.FAIL, "connect_error")
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError):
                end = Ended(Outcome.INDETERMINATE, "stream_cut" if seen.first_byte_s is not None else "connection_lost")
            except Exception:
                # A generator bug or an httpx error nobody expected: the request may have
                # left, so claim nothing about it, but never leave it without an end.
                log.exception("request %s failed in the load generator", key)
                end = Ended(Outcome.INDETERMINATE, "client_error")
        except asyncio.CancelledError:
            # Cancelled from outside (the runner gave up on the run): without an end a
            # non-streaming request would count as lost, which it is not.
            self._finish(key, arrival, zone, invoke_s, start, seen, Ended(Outcome.INDETERMINATE, "cancelled"))
            raise
        if arrival.long:
            self.tracker.end(key)
        self._finish(key, arrival, zone, invoke_s, start, seen, end)

    def _finish(
        self, key: str, arrival: Arrival, zone: str, invoke_s: float, start: float, seen: _Seen, end: Ended
    ) -> None:
        end_s = time.monotonic() - start
        self.stats.in_flight -= 1
        self.stats.record_end(end_s, end.outcome)
        first_byte = seen.first_byte_s
        if seen.reading is not None:
            first_byte = seen.reading.first_byte_s
        if not arrival.stream and end.outcome is Outcome.OK:
            first_byte = end_s  # a JSON answer is usable only once it is whole
        self._writer.append(
            ClientOp(
                key, arrival.tenant, zone, arrival.stream, invoke_s,
                first_byte_s=first_byte, end_s=end_s, outcome=end.outcome, status=seen.status,
                error_code=end.error_code, retry_after=end.retry_after, region=seen.region, node=seen.node,
                stream_error_event=end.stream_error_event,
                detail=seen.reading.detail() if seen.reading is not None else StreamDetail() if arrival.long else None,
                protocol=arrival.protocol,
            )
        )

    async def _send(
        self, n: int, key: str, arrival: Arrival, start: float, client: httpx.AsyncClient, seen: _Seen
    ) -> Ended:
        body = self._body(n, arrival)
        headers = {
            "authorization": f"Bearer {self.target.api_keys[arrival.tenant]}",
            HEADER_REQUEST_ID: key,
            HEADER_IDEMPOTENCY_KEY: key,
            "accept": "text/event-stream" if arrival.stream else "application/json",
        }
        if arrival.protocol != "http" and not arrival.long:
            return await self._send_other(n, key, arrival, start, seen, headers)
        url = self._urls[n % len(self._urls)]
        async with client.stream("POST", url, json=body, headers=headers, timeout=self._timeout) as resp:
            seen.status = resp.status_code
            seen.region = resp.headers.get(HEADER_REGION)
            seen.node = resp.headers.get(HEADER_NODE)
            if arrival.long and resp.status_code == 200:
                entry = self.tracker.start(key)
                entry.node = seen.node
                seen.reading = StreamReading(start, entry)
                await read_events(resp, seen.reading)
                outcome, code = seen.reading.outcome()
                return Ended(outcome, code, stream_error_event=seen.reading.error_code is not None)
            if arrival.stream and resp.status_code == 200:
                return await _read_stream(resp, start, seen)
            raw = await resp.aread()
            return _judge_body(resp, raw)

    async def _send_other(self, n: int, key: str, arrival: Arrival, start: float, seen: _Seen,
                          headers: dict[str, str]) -> Ended:
        """The request over the Responses WebSocket or KServe gRPC (chaos.protocols)."""
        messages = self._messages(n, arrival)
        if arrival.protocol == "websocket":
            ended = await send_websocket(self._ws_urls[n % len(self._ws_urls)], headers, self.target.model,
                                         messages, self.load.max_tokens, start)
        else:
            sampling = {"max_tokens": self.load.max_tokens, "temperature": 0}
            request = infer_request(self.target.model, prompt_of(messages), sampling, stream=arrival.stream,
                                    request_id=key)
            metadata = tuple((k, v) for k, v in headers.items() if k != "accept")
            ended = await send_grpc(self._channels[n % len(self._channels)], metadata, request, arrival.stream,
                                    self._deadline_s(arrival), start)
        seen.status, seen.first_byte_s = ended.status, ended.first_byte_s
        return ended

    def _deadline_s(self, arrival: Arrival) -> float:
        ls = self.load.long_streams
        return ls.request_timeout_s if arrival.long and ls is not None else self.load.request_timeout_s

    def _body(self, n: int, arrival: Arrival) -> dict[str, Any]:
        if arrival.long:
            assert self.load.long_streams is not None
            return long_stream_body(self.target.model, self._messages(n, arrival), self.load.long_streams)
        body: dict[str, Any] = {
            "model": self.target.model,
            "messages": self._messages(n, arrival),
            "max_tokens": self.load.max_tokens,
            "temperature": 0,
            "stream": arrival.stream,
        }
        if arrival.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _messages(self, n: int, arrival: Arrival) -> list[dict[str, str]]:
        if arrival.long:
            # A tenant's long system prompt and a question of its own: prompts differ per
            # request, so a resumed stream continuing another's tokens would show.
            rng = random.Random(f"{self._seed}:{n}")
            return [{"role": "system", "content": system_prompt(arrival.tenant)},
                    {"role": "user", "content": fresh_prompt(rng)}]
        if arrival.conversation is None:
            return [{"role": "user", "content": fresh_prompt(random.Random(f"{self._seed}:{n}"))}]
        return conversation_messages(self._seed, arrival.tenant, arrival.conversation, arrival.turn)


# --- judging answers ------------------------------------------------------------------


def _timeout_end(e: httpx.TimeoutException) -> Ended:
    if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
        # No connection, so the request never left: a definite failure.
        return Ended(Outcome.FAIL, "connect_error")
    return Ended(Outcome.INDETERMINATE, "timeout")


def _judge_body(resp: httpx.Response, raw: bytes) -> Ended:
    """A whole (non-streaming, or refused streaming) answer."""
    if resp.status_code >= 400:
        return Ended(Outcome.FAIL, body_error_code(raw), retry_after="retry-after" in resp.headers)
    if resp.status_code == 200:
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("choices"), list):
            return Ended(Outcome.OK)
    return Ended(Outcome.FAIL, "bad_response")


async def _read_stream(resp: httpx.Response, start: float, seen: _Seen) -> Ended:
    """Read SSE events to `[DONE]`, an error event, or the end of the body."""
    async for payload in sse_payloads(resp.aiter_lines()):
        end = _on_event(payload, start, seen)
        if end is not None:
            return end
    if seen.first_byte_s is None:
        # The router answered 200 and closed cleanly without a single event.
        return Ended(Outcome.FAIL, "bad_response")
    # Ended without [DONE] or an error event: the answer may be whole or not.
    return Ended(Outcome.INDETERMINATE, "stream_cut")


def _on_event(payload: str, start: float, seen: _Seen) -> Ended | None:
    """One SSE data event; the request's end when the event ends it."""
    if seen.first_byte_s is None:
        seen.first_byte_s = time.monotonic() - start
    if payload.strip() == "[DONE]":
        return Ended(Outcome.OK)
    try:
        event = json.loads(payload)
    except ValueError:
        return Ended(Outcome.FAIL, "bad_response")
    if isinstance(event, dict) and event.get("error") is not None:
        return Ended(Outcome.FAIL, error_code(event["error"]) or "stream_error", stream_error_event=True)
    return None




# How long a fabric may take to serve every drill tenant with its new keys.
WARM_UP_TIMEOUT_S = 120.0


async def warm_up(target: LoadTarget, timeout_s: float = WARM_UP_TIMEOUT_S,
                  on_step: Callable[[str], None] | None = None) -> None:
    """Until every router answers every tenant: new keys reach routers with the next routing
    table, and a node's first generation is slower than the rest. FabricNotReady at the deadline."""
    if on_step is not None:
        on_step("warming up: every router answers every tenant")
    body = {"model": target.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=30.0) as http:
        for url in target.router_urls:
            for tenant, key in target.api_keys.items():
                last = "no answer"
                while True:
                    try:
                        r = await http.post(f"{url}/v1/chat/completions", json=body,
                                            headers={"authorization": f"Bearer {key}"})
                        if r.status_code == 200:
                            break
                        last = f"{r.status_code} {r.text[:200]}"
                    except httpx.HTTPError as exc:
                        last = f"{type(exc).__name__}: {exc}"
                    if loop.time() > deadline:
                        raise FabricNotReady(f"router {url} did not serve tenant {tenant} within "
                                             f"{timeout_s:g}s (last answer: {last})")
                    await asyncio.sleep(0.3)


class FabricNotReady(RuntimeError):
    """The fabric under test did not serve the drill's tenants in time."""
