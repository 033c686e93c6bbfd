"""Open-loop load generator for chaos drills: it sends a drill's `Load` at the geo router.

Arrivals are a seeded Poisson process; each request is sent at its time as its own task and
never waits for earlier answers, so a slow or broken fabric meets the full load instead of a
load that politely backs off (coordinated omission). Every request becomes two `ClientOp`
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

import httpx

from chaos.drill import Load
from chaos.history import ClientOp, HistoryWriter, Outcome, StreamDetail
from chaos.streams import (
    LongRequest,
    StreamReading,
    StreamTracker,
    long_stream_body,
    read_events,
    split_tenants,
    sse_payloads,
)
from meridian.contracts import HEADER_NODE, HEADER_REGION, HEADER_REQUEST_ID

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
HEADER_IDEMPOTENCY_KEY = "idempotency-key"
# The router refuses any other request id, so keys are checked before a single one is sent.
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CONVERSATIONS_PER_TENANT = 4
MAX_PROMPT_CHARS = 1500
CONNECT_TIMEOUT_S = 5.0
_ASSISTANT_ACK = "Noted."

_WORDS = (
    "region", "replica", "latency", "throughput", "cache", "prefix", "token", "stream", "router",
    "tenant", "zone", "failover", "quorum", "lease", "snapshot", "weights", "digest", "shard",
    "budget", "deadline", "retry", "backoff", "probe", "drain", "eject", "heal", "burst", "queue",
    "batch", "kernel", "memory", "bandwidth", "packet", "window", "sample", "model", "prompt",
    "answer", "summary", "incident", "runbook", "capacity", "forecast", "residency", "audit",
)


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where the load goes: routers (round-robin), each tenant's API key, and the model name."""

    router_urls: tuple[str, ...]
    api_keys: Mapping[str, str]  # drill tenant name -> API key
    model: str


@dataclass(frozen=True, slots=True)
class Arrival:
    """One scheduled request; `conversation` is None without a shared prefix."""

    at_s: float
    tenant: str
    stream: bool
    conversation: int | None
    turn: int
    long: bool = False  # one of load.long_streams (chaos.streams)


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


@dataclass(frozen=True, slots=True)
class _End:
    outcome: Outcome
    error_code: str | None = None
    retry_after: bool = False
    stream_error_event: bool = False


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
        self._timeout = httpx.Timeout(
            connect=min(CONNECT_TIMEOUT_S, load.request_timeout_s),
            read=load.request_timeout_s,
            write=load.request_timeout_s,
            pool=load.request_timeout_s,
        )
        # An explicit schedule (a burst) replaces the load's Poisson arrivals.
        self._schedule = list(schedule) if schedule is not None else _make_schedule(load, seed)
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
                         error_code="generator_overloaded")
            )
            self.stats.record_end(now_s, Outcome.FAIL)
            return
        # Recorded before the task runs, so the history never shows a request the router
        # handled before the client invoked it.
        # A long stream is marked as one from the start (an empty detail), so that one that
        # never ends still counts among the long streams.
        self._writer.append(ClientOp(key, arrival.tenant, zone, arrival.stream, now_s,
                                     detail=StreamDetail() if arrival.long else None))
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
                end = _End(Outcome.INDETERMINATE, "timeout")
            except httpx.TimeoutException as e:
                end = _timeout_end(e)
            except httpx.ConnectError:
                end = _End(Outcome.FAIL, "connect_error")
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError):
                end = _End(Outcome.INDETERMINATE, "stream_cut" if seen.first_byte_s is not None else "connection_lost")
            except Exception:
                # A generator bug or an httpx error nobody expected: the request may have
                # left, so claim nothing about it, but never leave it without an end.
                log.exception("request %s failed in the load generator", key)
                end = _End(Outcome.INDETERMINATE, "client_error")
        except asyncio.CancelledError:
            # Cancelled from outside (the runner gave up on the run): without an end a
            # non-streaming request would count as lost, which it is not.
            self._finish(key, arrival, zone, invoke_s, start, seen, _End(Outcome.INDETERMINATE, "cancelled"))
            raise
        if arrival.long:
            self.tracker.end(key)
        self._finish(key, arrival, zone, invoke_s, start, seen, end)

    def _finish(
        self, key: str, arrival: Arrival, zone: str, invoke_s: float, start: float, seen: _Seen, end: _End
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
            )
        )

    async def _send(
        self, n: int, key: str, arrival: Arrival, start: float, client: httpx.AsyncClient, seen: _Seen
    ) -> _End:
        body = self._body(n, arrival)
        headers = {
            "authorization": f"Bearer {self.target.api_keys[arrival.tenant]}",
            HEADER_REQUEST_ID: key,
            HEADER_IDEMPOTENCY_KEY: key,
            "accept": "text/event-stream" if arrival.stream else "application/json",
        }
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
                return _End(outcome, code, stream_error_event=seen.reading.error_code is not None)
            if arrival.stream and resp.status_code == 200:
                return await _read_stream(resp, start, seen)
            raw = await resp.aread()
            return _judge_body(resp, raw)

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
                    {"role": "user", "content": _fresh_prompt(rng)}]
        if arrival.conversation is None:
            return [{"role": "user", "content": _fresh_prompt(random.Random(f"{self._seed}:{n}"))}]
        return conversation_messages(self._seed, arrival.tenant, arrival.conversation, arrival.turn)


# --- judging answers ------------------------------------------------------------------


def _timeout_end(e: httpx.TimeoutException) -> _End:
    if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
        # No connection, so the request never left: a definite failure.
        return _End(Outcome.FAIL, "connect_error")
    return _End(Outcome.INDETERMINATE, "timeout")


def _openai_error_code(raw: bytes) -> str | None:
    """The OpenAI error JSON's `code` (its `type` when the code is null); None for any other body."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return _error_code(data.get("error")) if isinstance(data, dict) else None


def _error_code(error: object) -> str | None:
    if not isinstance(error, dict):
        return None
    for name in ("code", "type"):
        value = error.get(name)
        if value is not None:
            return str(value)
    return None


def _judge_body(resp: httpx.Response, raw: bytes) -> _End:
    """A whole (non-streaming, or refused streaming) answer."""
    if resp.status_code >= 400:
        return _End(Outcome.FAIL, _openai_error_code(raw), retry_after="retry-after" in resp.headers)
    if resp.status_code == 200:
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("choices"), list):
            return _End(Outcome.OK)
    return _End(Outcome.FAIL, "bad_response")


async def _read_stream(resp: httpx.Response, start: float, seen: _Seen) -> _End:
    """Read SSE events to `[DONE]`, an error event, or the end of the body."""
    async for payload in sse_payloads(resp.aiter_lines()):
        end = _on_event(payload, start, seen)
        if end is not None:
            return end
    if seen.first_byte_s is None:
        # The router answered 200 and closed cleanly without a single event.
        return _End(Outcome.FAIL, "bad_response")
    # Ended without [DONE] or an error event: the answer may be whole or not.
    return _End(Outcome.INDETERMINATE, "stream_cut")


def _on_event(payload: str, start: float, seen: _Seen) -> _End | None:
    """One SSE data event; the request's end when the event ends it."""
    if seen.first_byte_s is None:
        seen.first_byte_s = time.monotonic() - start
    if payload.strip() == "[DONE]":
        return _End(Outcome.OK)
    try:
        event = json.loads(payload)
    except ValueError:
        return _End(Outcome.FAIL, "bad_response")
    if isinstance(event, dict) and event.get("error") is not None:
        return _End(Outcome.FAIL, _error_code(event["error"]) or "stream_error", stream_error_event=True)
    return None


# --- schedule and prompts -------------------------------------------------------------


def _make_schedule(load: Load, seed: int) -> list[Arrival]:
    """The Poisson arrivals and the long-stream burst (if any), in time order."""
    out = _poisson_schedule(load, seed)
    ls = load.long_streams
    if ls is not None:
        weights = {t.name: t.weight for t in load.tenants}
        names = ls.tenants or list(weights)
        rng = random.Random(f"long:{seed}")
        tenants = split_tenants([(n, weights[n]) for n in names], ls.count)
        out += [Arrival(ls.at_s + rng.uniform(0, ls.spread_s), t, True, None, 0, long=True) for t in tenants]
    return sorted(out, key=lambda a: a.at_s)


def _poisson_schedule(load: Load, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    names = [t.name for t in load.tenants]
    weights = [t.weight for t in load.tenants]
    turns: dict[tuple[str, int], int] = {}
    out: list[Arrival] = []
    t = rng.expovariate(load.arrivals_per_s)
    while t < load.duration_s:
        tenant = rng.choices(names, weights)[0]
        stream = rng.random() < load.streaming_fraction
        conversation: int | None = None
        turn = 0
        if load.shared_prefix:
            conversation = rng.randrange(CONVERSATIONS_PER_TENANT)
            turn = turns.get((tenant, conversation), 0)
            turns[tenant, conversation] = turn + 1
        out.append(Arrival(t, tenant, stream, conversation, turn))
        t += rng.expovariate(load.arrivals_per_s)
    return out


def burst_schedule(load: Load, count: int, at_s: float, seed: int, spread_s: float = 0.5) -> list[Arrival]:
    """`count` arrivals within `spread_s` seconds of `at_s`: tenants by weight, streams by
    the load's fraction, fresh prompts (a burst of new users, not ongoing conversations)."""
    rng = random.Random(seed)
    names = [t.name for t in load.tenants]
    weights = [t.weight for t in load.tenants]
    times = sorted(at_s + rng.uniform(0, spread_s) for _ in range(count))
    return [Arrival(t, rng.choices(names, weights)[0], rng.random() < load.streaming_fraction, None, 0)
            for t in times]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def _fresh_prompt(rng: random.Random) -> str:
    return f"In one sentence, explain {_words(rng, rng.randint(4, 10))}."


def system_prompt(tenant: str) -> str:
    """The long system prompt every conversation of a tenant shares (about 500 characters)."""
    rng = random.Random(f"system:{tenant}")
    sentences = [f"You are the operations assistant of {tenant}."]
    while sum(len(s) + 1 for s in sentences) < 500:
        sentences.append(f"Always consider {_words(rng, 6)} before answering.")
    return " ".join(sentences)


def _user_turn(seed: int, tenant: str, conversation: int, turn: int) -> str:
    rng = random.Random(f"turn:{seed}:{tenant}:{conversation}:{turn}")
    return f"Question {turn + 1}: what should we do about {_words(rng, rng.randint(5, 9))}?"


def conversation_messages(seed: int, tenant: str, conversation: int, turn: int) -> list[dict[str, str]]:
    """Turn `turn` of a conversation: the shared system prompt and the latest user turns.

    The generator never waits for answers, so earlier turns are followed by a fixed
    acknowledgement (chat templates want user and assistant to alternate). The oldest turns
    are dropped to keep the prompt under MAX_PROMPT_CHARS; the system prompt always stays.
    """
    system = system_prompt(tenant)
    budget = MAX_PROMPT_CHARS - len(system)
    latest = _user_turn(seed, tenant, conversation, turn)
    budget -= len(latest)
    kept: list[str] = []
    for earlier in range(turn - 1, -1, -1):
        text = _user_turn(seed, tenant, conversation, earlier)
        if len(text) + len(_ASSISTANT_ACK) > budget:
            break
        budget -= len(text) + len(_ASSISTANT_ACK)
        kept.append(text)
    messages = [{"role": "system", "content": system}]
    for text in reversed(kept):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": _ASSISTANT_ACK}]
    messages.append({"role": "user", "content": latest})
    return messages


__all__ = [
    "Arrival",
    "LoadGenerator",
    "LoadStats",
    "LoadTarget",
    "conversation_messages",
    "system_prompt",
]


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
