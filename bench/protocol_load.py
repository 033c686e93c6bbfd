"""The protocols bench's clients (bench/protocols.py): a KServe v2 gRPC call, a Responses
WebSocket turn and a streamed HTTP request, each as lean as its protocol allows, and an
open-loop driver for any awaitable call.

Why lean: on two shared cores the client's own CPU lands in the latency it measures, so
gRPC is raw `grpc.aio` with the router's own stubs and a request built once (not
tritonclient, which converts numpy arrays on every call), a WebSocket turn reads the type
of each event from the front of its JSON text (the router writes `{"type":"…",…}` compactly)
instead of parsing every event, and a WebSocket connection is opened once and reused for
turn after turn, as the Responses WebSocket mode intends.

`open_loop_calls` is bench/http_load.py's `open_loop` for a call that is not a raw HTTP/1.1
request: calls start on schedule at a fixed rate whether or not earlier ones have ended,
each timed from when it was due, at most `max_in_flight` at once (more wait, still timed
from when due); calls still running `drain_s` after the last one count with the time
waited so far (their percentiles are then lower bounds).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import websockets
from websockets.asyncio.client import ClientConnection

from bench.http_load import DRAIN_S, MAX_IN_FLIGHT, LatencyRun, Saturation, cpu_over_window
from geo_router.ingress.kserve import kserve_v2_pb2 as pb
from geo_router.ingress.kserve import kserve_v2_pb2_grpc as pb_grpc

FINAL_WS = ("response.completed", "response.incomplete", "response.failed", "error")
_TYPE_AT = len('{"type":"')


# --- open loop over any call --------------------------------------------------------------


@dataclass
class CallErrors:
    count: int = 0
    first: str = ""  # the first failure, for stderr


async def saturate_calls(call: Callable[[], Awaitable[None]], pgid: int, concurrency: int, seconds: float,
                         warmup_s: float) -> Saturation:
    """`call` back to back from `concurrency` callers for warmup_s + seconds: the calls a
    second answered after the warm-up, and the CPU the process group `pgid` spent per call
    over that window (bench.http_load.saturate, for calls of any protocol)."""
    begin = time.perf_counter() + warmup_s
    end = begin + seconds
    done = errors = 0

    async def caller() -> None:
        nonlocal done, errors
        while (now := time.perf_counter()) < end:
            try:
                await call()
            except Exception:  # noqa: BLE001 - any failure of the protocol is an error answer
                errors += 1
                continue
            done += now >= begin

    cpu_s, *_ = await asyncio.gather(cpu_over_window(pgid, warmup_s, seconds), *(caller() for _ in range(concurrency)))
    return Saturation(done / seconds, errors, cpu_s / done * 1000 if done else None)


async def open_loop_calls(call: Callable[[], Awaitable[None]], rate: float, seconds: float, warmup_s: float,
                          max_in_flight: int = MAX_IN_FLIGHT, drain_s: float = DRAIN_S,
                          errors: CallErrors | None = None) -> LatencyRun:
    """Start `call` at `rate` per second for warmup_s + seconds; latencies of those after the
    warm-up. A call that raises is an error (counted in `errors`, with the first message)."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(max_in_flight)
    failed = errors if errors is not None else CallErrors()
    n_warm = int(rate * warmup_s)
    n = n_warm + int(rate * seconds)
    latencies: list[float] = []
    waiting: dict[int, float] = {}
    before = failed.count

    async def one(i: int, t0: float) -> None:
        try:
            async with slots:
                await call()
        except Exception as exc:  # noqa: BLE001 - any failure of the protocol is an error answer
            failed.count += 1
            failed.first = failed.first or f"{type(exc).__name__}: {exc}"[:300]
            return
        finally:
            waiting.pop(i, None)
        if i >= n_warm:
            latencies.append((time.perf_counter() - t0) * 1000.0)

    tasks: list[asyncio.Task[None]] = []
    start = loop.time() + 0.005
    for i in range(n):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()  # timed from when it is due, so any wait for a slot counts
        if i >= n_warm:
            waiting[i] = t0
        tasks.append(loop.create_task(one(i, t0)))
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    cutoff = time.perf_counter()
    latencies += [(cutoff - t0) * 1000.0 for t0 in waiting.values()]
    unanswered = len(waiting)
    for t in pending:
        t.cancel()
    return LatencyRun(latencies, failed.count - before, unanswered, n - n_warm)


# --- KServe v2 over gRPC ------------------------------------------------------------------


def text_output(response: pb.ModelInferResponse) -> str:
    """The `text_output` element of a response ("" when it has none, as a final empty one)."""
    for i, tensor in enumerate(response.outputs):
        if tensor.name == "text_output":
            if i < len(response.raw_output_contents):
                return response.raw_output_contents[i][4:].decode()
            return b"".join(tensor.contents.bytes_contents).decode()
    return ""


class KServeClient:
    """One gRPC channel (HTTP/2, calls multiplexed) to the router's KServe v2 service."""

    def __init__(self, port: int, api_key: str) -> None:
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),)

    async def infer(self, request: pb.ModelInferRequest, timeout_s: float = 30.0) -> str:
        response = await self._stub.ModelInfer(request, metadata=self.metadata, timeout=timeout_s)
        return text_output(response)

    async def stream_ttft(self, request: pb.ModelInferRequest, timeout_s: float = 60.0) -> tuple[float, float, str]:
        """One streamed request on a ModelStreamInfer stream of its own: seconds to the first
        response with text, seconds to the final response, and the whole text."""
        t0 = time.perf_counter()
        first, last, text = 0.0, 0.0, []
        # The request stream ends after this one request, so the call ends after its answer.
        async for item in self._stub.ModelStreamInfer(iter([request]), metadata=self.metadata, timeout=timeout_s):
            if item.error_message:
                raise RuntimeError(f"ModelStreamInfer: {item.error_message}")
            piece = text_output(item.infer_response)
            if piece and not first:
                first = time.perf_counter() - t0
            text.append(piece)
            if item.infer_response.parameters["triton_final_response"].bool_param:
                last = time.perf_counter() - t0
        if not last:
            raise RuntimeError("ModelStreamInfer ended without a final response")
        return first, last, "".join(text)

    async def close(self) -> None:
        await self._channel.close()


# --- the Responses API's WebSocket mode ---------------------------------------------------


def _event_type(message: str | bytes) -> str:
    text = message if isinstance(message, str) else message.decode()
    if text.startswith('{"type":"'):
        return text[_TYPE_AT:text.index('"', _TYPE_AT)]
    return str(json.loads(text).get("type"))  # not the router's compact form: parse it


class ResponsesSockets:
    """Open WebSocket connections to /v1/responses, each carrying one turn at a time; a turn
    takes an idle one (or opens one: the handshake then counts in its time)."""

    def __init__(self, port: int, api_key: str, *, deflate: bool = True) -> None:
        self._url = f"ws://127.0.0.1:{port}/v1/responses"
        self._headers = {"authorization": f"Bearer {api_key}"}
        self._deflate = deflate
        self._idle: list[ClientConnection] = []
        self._all: set[ClientConnection] = set()

    async def _connect(self) -> ClientConnection:
        conn = await websockets.connect(self._url, additional_headers=self._headers, max_size=None,
                                        compression="deflate" if self._deflate else None)
        self._all.add(conn)
        return conn

    async def fill(self, n: int) -> None:
        self._idle += await asyncio.gather(*(self._connect() for _ in range(n)))

    async def turn(self, message: str) -> None:
        """Send one `response.create` (its JSON text) and read its events up to
        response.completed; anything else that ends it is an error."""
        conn = self._idle.pop() if self._idle else await self._connect()
        ok = False
        try:
            await conn.send(message)
            while (kind := _event_type(await conn.recv())) not in FINAL_WS:
                pass
            ok = True
        finally:
            if ok:
                self._idle.append(conn)
            else:  # a connection that broke mid-turn (or with a turn unread) is not reused
                self._all.discard(conn)
                await conn.close()
        if kind != "response.completed":
            raise RuntimeError(f"the turn ended with {kind}")

    async def turn_ttft(self, message: str) -> tuple[float, float, str]:
        """One turn: seconds to the first output_text.delta, seconds to its end, the text."""
        conn = self._idle.pop() if self._idle else await self._connect()
        t0 = time.perf_counter()
        await conn.send(message)
        first, text = 0.0, []
        while True:
            event = json.loads(await conn.recv())
            kind = event.get("type")
            if kind == "response.output_text.delta":
                first = first or time.perf_counter() - t0
                text.append(event["delta"])
            elif kind in FINAL_WS:
                break
        self._idle.append(conn)
        if kind != "response.completed" and kind != "response.incomplete":
            raise RuntimeError(f"the turn ended with {kind}: {json.dumps(event)[:300]}")
        return first, time.perf_counter() - t0, "".join(text)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._all), return_exceptions=True)
        self._all.clear()
        self._idle.clear()


# --- HTTP + SSE ---------------------------------------------------------------------------


def _sse_text(data: bytes, kind: str) -> str:
    """The text an SSE `data:` payload carries: a completion or chat chunk's, or a Responses
    output_text.delta's."""
    if data == b"[DONE]":
        return ""
    event = json.loads(data)
    if kind == "responses":
        return str(event.get("delta") or "") if event.get("type") == "response.output_text.delta" else ""
    choices = event.get("choices") or [{}]
    delta = choices[0].get("delta")
    return str((delta or {}).get("content") or "") if delta is not None else str(choices[0].get("text") or "")


async def sse_ttft(http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                   kind: str) -> tuple[float, float, str]:
    """One streamed POST: seconds to the first event with text, seconds to the end, the text.
    `kind`: "responses" (Responses events) or "chunks" (completion or chat chunks)."""
    t0 = time.perf_counter()
    first, text, buffer = 0.0, [], b""
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for chunk in r.aiter_raw():
            buffer += chunk.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for block in events:
                for line in block.split(b"\n"):
                    if line.startswith(b"data:") and (piece := _sse_text(line[5:].strip(), kind)):
                        first = first or time.perf_counter() - t0
                        text.append(piece)
    return first, time.perf_counter() - t0, "".join(text)
