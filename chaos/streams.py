"""Long greedy streams for mid-stream drills: their requests, what the client reads of them,
their live progress, and the reference run they are compared with.

A drill's `load.long_streams` adds a burst of long streams to the load (chaos.load sends
them). Each is a chat stream with temperature 0, ignore_eos and `max_tokens`: the tiny
model's greedy decode yields the same tokens on every healthy replica, so a stream that a
router migrated mid-generation must deliver exactly the text the same request yields
unbroken. `reference_run` asks a healthy fabric for that text outside the measured window
and records it as `reference` records; chaos.checker compares, token for token.

`StreamReading` reads one stream's SSE events into a StreamDetail (text, token ids, the
response ids seen, finish_reason, usage, the router's `meridian` field, the longest gap
between events). `StreamTracker` is the live view a fault injector waits on: which node
(x-meridian-node) serves each long stream and how many events it has received, so that
nodes are killed mid-generation, not before or after.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from chaos.drill import LongStreams
from chaos.history import HistoryWriter, Outcome, Reference, StreamDetail

# The error code a router sends in a stream's error event when it could not resume it.
UPSTREAM_DISCONNECTED = "upstream_disconnected"


def long_stream_body(model: str, messages: list[dict[str, str]], spec: LongStreams) -> dict[str, Any]:
    """The chat request of one long stream: greedy, ignore_eos, exactly max_tokens tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.return_token_ids:
        body["return_token_ids"] = True
    return body


def split_tenants(tenants: Sequence[tuple[str, float]], count: int) -> list[str]:
    """`count` tenant names in proportion to their weights (largest remainder), interleaved
    so that every part of the burst has each tenant."""
    total = sum(w for _, w in tenants)
    exact = [(name, count * w / total) for name, w in tenants]
    shares = {name: int(x) for name, x in exact}
    left = count - sum(shares.values())
    for name, _ in sorted(exact, key=lambda e: e[1] - int(e[1]), reverse=True)[:left]:
        shares[name] += 1
    out: list[str] = []
    while len(out) < count:
        for name, _ in tenants:
            if shares[name] > 0:
                shares[name] -= 1
                out.append(name)
    return out


@dataclass
class TrackedStream:
    """A long stream as it runs: the node that answered it first and its events so far."""

    on_change: Callable[[], None]
    node: str | None = None
    events: int = 0
    ended: bool = False


@dataclass
class StreamTracker:
    """Live progress of the long streams by key (the load generator writes, injectors read)."""

    expected: int = 0
    streams: dict[str, TrackedStream] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def start(self, key: str) -> TrackedStream:
        """A stream got its answer's headers (or ended without one): track it from now on."""
        entry = self.streams[key] = TrackedStream(self._changed.set)
        self._changed.set()
        return entry

    def end(self, key: str) -> None:
        """The stream ended, however it did."""
        (self.streams.get(key) or self.start(key)).ended = True
        self._changed.set()

    async def wait_under_way(self, min_events: int, timeout_s: float) -> bool:
        """Until all_under_way(min_events), False when `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.all_under_way(min_events):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

    def all_under_way(self, min_events: int) -> bool:
        """Every expected stream was sent and has ended or received `min_events` events."""
        return len(self.streams) >= self.expected and all(
            s.ended or s.events >= min_events for s in self.streams.values())

    def in_flight_by_node(self) -> Counter[str]:
        """How many long streams still running each node answered first."""
        return Counter(s.node for s in self.streams.values() if not s.ended and s.node is not None)


@dataclass
class StreamReading:
    """Accumulates one stream's events; `detail()` is what the history records."""

    start: float  # clock() of the load's second 0
    entry: TrackedStream | None = None
    clock: Callable[[], float] = time.monotonic
    text: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    ids: list[str] = field(default_factory=list)
    events: int = 0
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    meridian: Mapping[str, Any] | None = None
    done: bool = False
    error_code: str | None = None
    bad: bool = False  # an event that is not JSON
    first_byte_s: float | None = None
    last_event_s: float | None = None
    longest_gap_s: float | None = None
    longest_gap_end_s: float | None = None

    def on_event(self, payload: str) -> bool:
        """One SSE data payload; True when it ends the stream ([DONE], an error, garbage)."""
        now = self.clock() - self.start
        if self.first_byte_s is None:
            self.first_byte_s = now
        elif self.last_event_s is not None and (self.longest_gap_s is None or now - self.last_event_s > self.longest_gap_s):
            self.longest_gap_s, self.longest_gap_end_s = now - self.last_event_s, now
        self.last_event_s = now
        if payload.strip() == "[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(payload)
        except ValueError:
            self.bad = True
            return True
        if not isinstance(event, dict):
            self.bad = True
            return True
        if event.get("error") is not None:
            err = event["error"]
            self.error_code = str(err.get("code") or err.get("type") or "stream_error") if isinstance(err, dict) else "stream_error"
            return True
        self._on_chunk(event)
        return False

    def _on_chunk(self, event: dict[str, Any]) -> None:
        if isinstance(event.get("id"), str) and event["id"] not in self.ids:
            self.ids.append(event["id"])
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if isinstance(event.get("meridian"), dict):
            self.meridian = event["meridian"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            self.events += 1
            if self.entry is not None:
                self.entry.events = self.events
                self.entry.on_change()
            delta = choice.get("delta") or {}
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            if isinstance(choice.get("token_ids"), list):
                self.token_ids = [*(self.token_ids or []), *choice["token_ids"]]
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])

    def outcome(self) -> tuple[Outcome, str | None]:
        """The stream's end as chaos.load judges any stream's: (outcome, error code)."""
        if self.error_code is not None:
            return Outcome.FAIL, self.error_code
        if self.bad or (self.first_byte_s is None and not self.done):
            return Outcome.FAIL, "bad_response"
        return (Outcome.OK, None) if self.done else (Outcome.INDETERMINATE, "stream_cut")

    def detail(self) -> StreamDetail:
        usage, m = self.usage or {}, self.meridian or {}
        return StreamDetail(
            text="".join(self.text),
            token_ids=None if self.token_ids is None else tuple(self.token_ids),
            ids=tuple(self.ids), events=self.events, finish_reason=self.finish_reason,
            prompt_tokens=_int(usage.get("prompt_tokens")), completion_tokens=_int(usage.get("completion_tokens")),
            done=self.done, error_code=self.error_code,
            migrations=_int(m.get("migrations")) or 0,
            final_node=m.get("node") if isinstance(m.get("node"), str) else None,
            final_region=m.get("region") if isinstance(m.get("region"), str) else None,
            longest_gap_s=self.longest_gap_s, longest_gap_end_s=self.longest_gap_end_s,
        )


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


async def read_events(resp: httpx.Response, reading: StreamReading) -> None:
    """Feed the response's SSE data events to `reading` until one ends it or the body ends."""
    async for payload in sse_payloads(resp.aiter_lines()):
        if reading.on_event(payload):
            return


async def sse_payloads(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data payloads of an SSE body (multi-line data joined; other fields ignored).
    A last event without its blank line was still sent whole (a cut raises instead)."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


class ReferenceFailed(RuntimeError):
    """The healthy fabric answered none of the long streams' requests whole."""


@dataclass(frozen=True, slots=True)
class LongRequest:
    """One long stream of the schedule: its key, tenant and chat body."""

    key: str
    tenant: str
    body: dict[str, Any]


async def reference_run(router_url: str, api_keys: Mapping[str, str], requests: Sequence[LongRequest],
                        writer: HistoryWriter, timeout_s: float) -> None:
    """Ask a healthy fabric every long stream's request (all at once, as the drill will) and
    record each answer as a `reference`; then time one prefill of the longest prompt alone.

    The requests carry no idempotency key and ids of their own, so the drill's keys stay
    the drill's; the caller empties the journals afterwards. A reference that does not end
    with [DONE] is not recorded: its stream then counts as a token mismatch ("no reference").
    """
    url = router_url.rstrip("/") + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=timeout_s) as http:

        failures: list[str] = []

        async def one(r: LongRequest) -> tuple[LongRequest, StreamReading]:
            reading = StreamReading(time.monotonic())
            headers = {"authorization": f"Bearer {api_keys[r.tenant]}", "x-request-id": f"{r.key}.ref"}
            try:
                async with http.stream("POST", url, json=r.body, headers=headers) as resp:
                    if resp.status_code == 200:
                        await read_events(resp, reading)
                    else:
                        failures.append(f"{resp.status_code} {(await resp.aread())[:300]!r}")
            except httpx.HTTPError as e:
                failures.append(f"{type(e).__name__}: {e}")
            return r, reading

        answers = await asyncio.gather(*(one(r) for r in requests))
        if requests and not any(a.done and a.error_code is None for _, a in answers):
            # Nothing to compare with: the drill would only say "no reference" 50 times.
            raise ReferenceFailed(f"no long stream's reference came back whole (first failure: "
                                  f"{failures[0] if failures else 'error events'})")
        prefill = await _prefill_s(http, url, api_keys, requests)
        longest = max(requests, key=lambda r: len(json.dumps(r.body["messages"])), default=None)
        for r, reading in answers:
            if not reading.done or reading.error_code is not None:
                continue
            d = reading.detail()
            writer.append(Reference(r.key, d.text, d.completion_tokens, d.finish_reason, d.token_ids,
                                    prompt_tokens=d.prompt_tokens,
                                    prefill_s=prefill if longest is not None and r.key == longest.key else None))


async def _prefill_s(http: httpx.AsyncClient, url: str, api_keys: Mapping[str, str],
                     requests: Sequence[LongRequest], tries: int = 3) -> float | None:
    """The fastest of `tries` one-token answers to the longest prompt (a prefill, alone)."""
    if not requests:
        return None
    r = max(requests, key=lambda r: len(json.dumps(r.body["messages"])))
    body = {**r.body, "max_tokens": 1, "stream": False}
    body.pop("stream_options", None)
    best: float | None = None
    for n in range(tries):
        t0 = time.monotonic()
        resp = await http.post(url, json=body, headers={"authorization": f"Bearer {api_keys[r.tenant]}",
                                                         "x-request-id": f"{r.key}.prefill{n}"})
        took = time.monotonic() - t0
        if resp.status_code == 200 and (best is None or took < best):
            best = took
    return best
