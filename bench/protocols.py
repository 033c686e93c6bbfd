"""The router's three protocols: its added latency on each at a fixed open-loop rate, and the
time to first token of a streamed request over SSE, WebSocket and gRPC, one run.

    python -m bench.protocols [--rate 500] [--seconds 3] [--rounds 3] [--requests 50]
                              [--max-tokens 16] [--no-ws-deflate] [--only added|ttft]

The geo router serves the OpenAI API over HTTP/1.1 + SSE, the Responses API's WebSocket mode
(GET /v1/responses upgraded, geo_router/websocket) and KServe's Open Inference Protocol v2
over gRPC (geo_router/kserve). The other two make each request an HTTP request of the same
pipeline (geo_router/ingress/internal_call.py), so what a protocol costs is its transport and its
translation: what this measures, so that a client can choose by numbers.

Added latency (bench `protocols`, figures `<protocol>_p50_ms`, `<protocol>_p99_ms`): a real
`meridian router serve` process (bench/router.py's, from a snapshot, with its gRPC listener
on) in front of nginx answering from memory (bench/router.py says why nginx), open loop at
`--rate` req/s (default 500) for `--seconds` after a warm-up, arrivals on schedule whether
or not earlier requests were answered, each timed from when it was due (bench/http_load.py,
and bench/protocol_load.py for gRPC and WebSocket). Per protocol, through the router:
  http  a non-streamed POST /v1/completions (raw keep-alive HTTP/1.1 connections);
  grpc  ModelInfer (unary, one HTTP/2 channel, at most 64 calls in flight, raw grpc.aio with
        our stubs); the router makes it a non-streamed POST /v1/completions to the node;
  ws    one `response.create` turn (store false, on an already-open connection, one turn at
        a time per connection, up to 128 connections; permessage-deflate as OpenAI's client
        offers it unless --no-ws-deflate) until `response.completed`; the router serves it as
        a streamed chat completion from the node (geo_router/forwarding/migration/responses.py) and
        writes the Responses events from the chunks.
Each against the same node request sent straight to nginx over HTTP (its baseline, the
node's cost): a non-streamed POST /v1/completions for http and grpc, the streamed POST
/v1/chat/completions the router sends for ws. ours = through the router, baseline = direct,
so added = ours - baseline; figures are medians over `--rounds` rounds, the paths taking
turns in an order that rotates each round, the router idle again between phases. Raw
figures, the router's CPU per request and the load generator's go to stderr as `#` lines.
`grpc_cpu_vs_http` and `ws_cpu_vs_http`: the router's CPU per call or turn against its CPU
per HTTP request of the same work in the same run (goal: at most 1.5x): a call against the
POST /v1/completions it becomes (`http`), a turn against the same Responses request streamed
over SSE (`sse`, a path of its own: the router makes it the same streamed chat).
`grpc_bare_cpu_vs_http`: a bare grpc.aio server's CPU per call (bench/grpc_bare.py: its
ModelInfer answers at once), the floor under the router's gRPC path, against the router's
HTTP request.
The router is one process on one event loop: a protocol whose CPU per request times the rate
exceeds what it gets of a core saturates it, and its latency is then its queue's. So each
figure's goal says how busy the router was (and "saturated" from 90% of a core), and
`--grpc-rate` / `--ws-rate` measure a protocol at a rate of its own (on a 2 vCPU box 500 req/s
saturates it with WebSocket turns and nearly with gRPC calls: BENCHMARKS.md).

TTFT (figures `ttft_ws_ms`, `ttft_grpc_ms`): a local fabric (localfabric) with one torch
node serving the tiny generated checkpoint, its router with the gRPC listener on. Streamed
requests, the same prompt, `--max-tokens` at temperature 0, one at a time, the protocols
taking turns in a rotating order so that the node's and the machine's noise hit all alike:
  ws             a response.create turn: time to the first `response.output_text.delta`;
  sse responses  the same Responses request as an HTTP stream (POST /v1/responses): its
                 first output_text.delta event; the baseline of ws (the same pipeline,
                 the same node request; only the transport differs);
  grpc           ModelStreamInfer, one request on a stream: its first response with
                 non-empty text_output;
  sse completions  the streamed POST /v1/completions the router makes of it, sent over HTTP:
                 its first chunk with text; the baseline of grpc.
Figures are medians, each ours against its SSE twin (ratio ours/baseline); the texts of
twins must be equal (temperature 0). Streams finish in tens of milliseconds on the tiny
model, so connection set-up is left out: each client keeps its connection open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop

from bench.common import Figure, median, percentile
from bench.grpc_bare import bare_server
from bench.http_load import (
    DRAIN_S,
    MAX_IN_FLIGHT,
    LatencyRun,
    Target,
    _group_cpu_s,
    open_loop,
    post_target,
    wait_idle,
)
from bench.nginx import NginxServer, nginx_available
from bench.protocol_load import (
    CallErrors,
    KServeClient,
    ResponsesSockets,
    open_loop_calls,
    sse_ttft,
)
from bench.router import IDLE_NODE_METRICS, MODEL, TENANT_KEY, _NginxConf, router_process
from chaos.protocols import infer_request
from localfabric import DEMO_MODEL, FabricSpec, local_fabric
from meridian.ports import free_port

BENCH = "protocols"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "Say ok."
COMPLETION_BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
STREAM_CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}
WS_TURN = {"type": "response.create", "model": MODEL, "input": PROMPT, "store": False, "max_output_tokens": 1,
           "temperature": 0}
SAMPLING = {"max_tokens": 1, "temperature": 0}
COMPLETION_ANSWER = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 1700000000, "model": MODEL,
    "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}, separators=(",", ":"))
TTFT_PROMPT = "the sea is"
RESPONSES = "/v1/responses"
SSE_RESPONSES_BODY = {k: v for k, v in WS_TURN.items() if k != "type"} | {"stream": True}


# --- the node -------------------------------------------------------------------------------


def chat_stream_answer() -> str:
    """A streamed chat completion of " ok" as vLLM sends it with return_token_ids and
    include_usage: the role chunk (with the prompt's ids), the text, the finish, the usage."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL}
    events = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], "prompt_token_ids": [100, 101, 102, 103, 104]},
        {**head, "choices": [{"index": 0, "delta": {"content": " ok"}, "logprobs": None, "finish_reason": None,
                              "token_ids": [1000]}]},
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                              "token_ids": []}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
    ]
    return "".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n" for e in events) + "data: [DONE]\n\n"


def protocol_node(work_dir: Path) -> NginxServer:
    """nginx answering POST /v1/completions with COMPLETION_ANSWER from memory, POST
    /v1/chat/completions with chat_stream_answer() from a file (a POST to a static file is a
    405, sent as 200 with the file, as in bench/stream_relay.py), and the load probe."""
    root = work_dir / "www"
    answer = root / CHAT.lstrip("/")
    answer.parent.mkdir(parents=True, exist_ok=True)
    answer.write_text(chat_stream_answer())
    return _NginxConf(work_dir, f"""    server {{
        listen 127.0.0.1:{{port}};
        root {root};
        location = {COMPLETIONS} {{
            default_type application/json;
            return 200 '{COMPLETION_ANSWER}';
        }}
        location = {CHAT} {{
            default_type text/event-stream;
            error_page 405 =200 $uri;
        }}
        location = /metrics {{
            default_type text/plain;
            return 200 '{IDLE_NODE_METRICS}';
        }}
    }}""")


def http_target(name: str, port: int, route: str, body: dict[str, object], api_key: str,
                pgid: int | None = None) -> Target:
    return post_target(name, port, route, json.dumps(body, separators=(",", ":")).encode(), api_key, pgid)


# --- added latency ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    rate: float = 500.0
    seconds: float = 3.0
    warmup_s: float = 0.5
    rounds: int = 3
    # Another open-loop rate for one protocol (None: `rate`), for when `rate` saturates the router.
    grpc_rate: float | None = None
    ws_rate: float | None = None
    requests: int = 50  # TTFT: measured requests per protocol
    max_tokens: int = 16  # TTFT
    ws_deflate: bool = True
    parts: tuple[str, ...] = ("added", "ttft")

    def rate_of(self, protocol: str) -> float:
        own = {"grpc": self.grpc_rate, "ws": self.ws_rate}.get(protocol)
        return own if own is not None else self.rate


PROTOCOLS = ("http", "grpc", "ws")
# gRPC calls in flight at most: under the router's 100 streams per HTTP/2 connection
# (grpc_max_streams_per_connection), which it refuses beyond (RST_STREAM REFUSED_STREAM),
# and under which its own count of streams still closing stays when it is saturated.
GRPC_IN_FLIGHT = 64
# The router (one process, one event loop) is saturated from this share of a core on: its
# latency is then its queue's, growing with the run's length.
SATURATED = 0.9


@dataclass
class PathFigures:
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    router_busy: list[float] = field(default_factory=list)  # the router's CPU over the phase, in cores
    client_cpu_us: list[float] = field(default_factory=list)  # this process's CPU per request
    router_cpu_us: list[float] = field(default_factory=list)  # the router's CPU per request
    errors: int = 0
    unanswered: int = 0
    sent: int = 0


@dataclass(frozen=True)
class PathUnderTest:
    """One path under test: its protocol, how to run an open-loop phase on it (rate, seconds,
    warm-up), and the router's process group (None: straight to the node)."""

    name: str
    protocol: str
    phase: Callable[[float, float, float], Awaitable[LatencyRun]]
    pgid: int | None


async def _phase(path: PathUnderTest, s: Settings, figs: PathFigures, r: int) -> None:
    rate = s.rate_of(path.protocol)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    router0 = _group_cpu_s(path.pgid) if path.pgid else 0.0
    run = await path.phase(rate, s.seconds, s.warmup_s)
    total = run.sent + int(rate * s.warmup_s)
    figs.client_cpu_us.append((time.process_time() - cpu0) / total * 1e6)
    if path.pgid:
        router_s = _group_cpu_s(path.pgid) - router0
        figs.router_cpu_us.append(router_s / total * 1e6)
        figs.router_busy.append(router_s / (time.perf_counter() - wall0))
    figs.errors, figs.unanswered, figs.sent = figs.errors + run.errors, figs.unanswered + run.unanswered, \
        figs.sent + run.sent
    if run.latencies_ms:
        figs.p50_ms.append(percentile(run.latencies_ms, 0.50))
        figs.p99_ms.append(percentile(run.latencies_ms, 0.99))
    router = (f"  router CPU {figs.router_cpu_us[-1]:5.0f} us/req ({figs.router_busy[-1]:4.0%} of a core)"
              if path.pgid else "")
    print(f"# round {r + 1} {path.name:11s} {rate:5g} req/s  p50 {figs.p50_ms[-1] if figs.p50_ms else float('nan'):8.3f}"
          f" ms  p99 {figs.p99_ms[-1] if figs.p99_ms else float('nan'):8.3f} ms{router}"
          f"  client CPU {figs.client_cpu_us[-1]:4.0f} us/req  errors {run.errors}"
          f"  unanswered after {DRAIN_S:g} s {run.unanswered}", file=sys.stderr, flush=True)
    await wait_idle(Target(path.name, 0, b"", path.pgid))


async def _added(node_port: int, router_port: int, grpc_ports: tuple[int, int], pgids: tuple[int, int],
                 s: Settings) -> dict[str, PathFigures]:
    (grpc_port, bare_port), (pgid, bare_pgid) = grpc_ports, pgids
    grpc, bare = KServeClient(grpc_port, TENANT_KEY), KServeClient(bare_port, TENANT_KEY)
    sockets = ResponsesSockets(router_port, TENANT_KEY, deflate=s.ws_deflate)
    errors = {"grpc": CallErrors(), "grpc bare": CallErrors(), "ws": CallErrors()}
    infer = infer_request(MODEL, PROMPT, SAMPLING, stream=False)
    turn = json.dumps(WS_TURN, separators=(",", ":"))

    async def grpc_call() -> None:
        if await grpc.infer(infer) != " ok":
            raise RuntimeError("ModelInfer answered another text")

    def http(name: str, protocol: str, target: Target) -> PathUnderTest:
        return PathUnderTest(name, protocol, lambda rate, sec, warm: open_loop(target, rate, sec, warm), target.pgid)

    async def bare_call() -> None:
        await bare.infer(infer)

    def calls(name: str, call: Callable[[], Awaitable[None]], in_flight: int, protocol: str = "",
              group: int = pgid) -> PathUnderTest:
        return PathUnderTest(name, protocol or name, lambda rate, sec, warm: open_loop_calls(
            call, rate, sec, warm, max_in_flight=in_flight, errors=errors[name]), group)

    # Each protocol's baseline at that protocol's rate: the node's request, straight to it.
    paths = [
        http("http direct", "http", http_target("http direct", node_port, COMPLETIONS, COMPLETION_BODY, "none")),
        http("http", "http", http_target("http", router_port, COMPLETIONS, COMPLETION_BODY, TENANT_KEY, pgid)),
        http("grpc direct", "grpc", http_target("grpc direct", node_port, COMPLETIONS, COMPLETION_BODY, "none")),
        calls("grpc", grpc_call, GRPC_IN_FLIGHT),
        # grpc.aio alone (bench/grpc_bare.py): the floor under the router's gRPC path.
        calls("grpc bare", bare_call, GRPC_IN_FLIGHT, "grpc", bare_pgid),
        http("ws direct", "ws", http_target("ws direct", node_port, CHAT, STREAM_CHAT_BODY, "none")),
        calls("ws", lambda: sockets.turn(turn), MAX_IN_FLIGHT),
        # The WebSocket turn's HTTP equivalent: the same Responses request streamed over SSE.
        http("sse", "ws", http_target("sse", router_port, RESPONSES, SSE_RESPONSES_BODY, TENANT_KEY, pgid)),
    ]
    out = {p.name: PathFigures() for p in paths}
    try:
        await _check(grpc, sockets, turn, infer)
        await sockets.fill(16)
        for r in range(s.rounds):
            for p in paths[r % len(paths):] + paths[: r % len(paths)]:
                await _phase(p, s, out[p.name], r)
    finally:
        await grpc.close()
        await bare.close()
        await sockets.close()
    for name, e in errors.items():
        if e.count:
            print(f"# {name}: {e.count} failed, the first: {e.first}", file=sys.stderr, flush=True)
    return out


async def _check(grpc: KServeClient, sockets: ResponsesSockets, turn: str, infer: object) -> None:
    """One request on each protocol: the answer is the node's text."""
    if (text := await grpc.infer(infer)) != " ok":  # type: ignore[arg-type]
        raise RuntimeError(f"gRPC ModelInfer answered {text!r}")
    _, _, text = await sockets.turn_ttft(turn)
    if text != " ok":
        raise RuntimeError(f"the WebSocket turn answered {text!r}")


def _http_check(url: str, route: str, body: dict[str, object], key: str) -> None:
    with httpx.Client(timeout=30.0, trust_env=False) as http:
        r = http.post(url + route, json=body, headers={"authorization": f"Bearer {key}"})
    ok = r.text.rstrip().endswith("data: [DONE]") if body.get("stream") else \
        r.json().get("choices", [{}])[0].get("text") == " ok"
    if r.status_code != 200 or not ok:
        raise RuntimeError(f"{url}{route} answered {r.status_code}: {r.text[:300]}")


def run_added(s: Settings) -> list[Figure]:
    if not nginx_available():
        raise RuntimeError("nginx is needed for the stand-in node (apt-get install nginx)")
    with tempfile.TemporaryDirectory(prefix="bench-protocols-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(protocol_node(work / "node"))
        grpc_port = free_port()
        router = stack.enter_context(router_process(work / "router", node.url,
                                                    {"MERIDIAN_ROUTER_GRPC_PORT": str(grpc_port)}))
        router_port = int(router.url.rsplit(":", 1)[1])
        _http_check(node.url, COMPLETIONS, COMPLETION_BODY, "none")
        _http_check(node.url, CHAT, STREAM_CHAT_BODY, "none")
        _http_check(router.url, COMPLETIONS, COMPLETION_BODY, TENANT_KEY)
        bare_port, bare_pgid = stack.enter_context(bare_server())
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            figs = runner.run(_added(node.port, router_port, (grpc_port, bare_port), (router.pid, bare_pgid), s))
    return _added_figures(figs, s)


def _added_figures(figs: dict[str, PathFigures], s: Settings) -> list[Figure]:
    out: list[Figure] = []
    failed = []
    for name, direct, what in (("http", "http", "non-streamed POST /v1/completions"),
                               ("grpc", "grpc", "non-streamed POST /v1/completions"),
                               ("ws", "ws", "streamed POST /v1/chat/completions"),
                               ("sse", "ws", "streamed POST /v1/chat/completions")):
        f, base, rate = figs[name], figs[f"{direct} direct"], s.rate_of(direct)
        if f.errors or not f.p50_ms:
            failed.append(f"{name}: {f.errors} of {f.sent} requests failed through the router")
            continue
        added = [a - b for a, b in zip(f.p50_ms, base.p50_ms, strict=True)]
        added99 = [a - b for a, b in zip(f.p99_ms, base.p99_ms, strict=True)]
        busy = median(f.router_busy)
        print(f"# {name:5s} {rate:g} req/s  added p50 {median(added):7.3f} ms  p99 {median(added99):7.3f} ms  "
              f"router CPU {median(f.router_cpu_us):5.0f} us/req ({busy:.0%} of a core)  client CPU "
              f"{median(f.client_cpu_us):4.0f} us/req (its baseline's {median(base.client_cpu_us):4.0f})"
              f"  unanswered {f.unanswered}/{f.sent}", file=sys.stderr, flush=True)
        load = f"at {rate:g} req/s, the router {busy:.0%} busy (one core)"
        if f.unanswered:
            load += (f", saturated: a lower bound ({f.unanswered} of {f.sent} unanswered {DRAIN_S:g} s after"
                     " the last request)")
        elif busy >= SATURATED:
            load += ", saturated: its queue, not its cost (lower the rate: --grpc-rate, --ws-rate)"
        for q, ours, theirs in (("p50", f.p50_ms, base.p50_ms), ("p99", f.p99_ms, base.p99_ms)):
            out.append(Figure(BENCH, f"{name}_{q}_ms", median(ours), median(theirs),
                              f"the node direct over HTTP: {what}, at {rate:g} req/s",
                              f"added (ours - baseline) reported; {load}", "ms"))
    if failed:
        raise AssertionError("; ".join(failed))
    # What each protocol costs the router against the HTTP request of the same work, same run
    # (issue 35's goal: at most 1.5x): a ModelInfer call against the POST /v1/completions the
    # router makes of it, a WebSocket turn against the same Responses request over SSE.
    for name, http_name, what, goal in (
        ("grpc", "http", "a ModelInfer call; baseline: per POST /v1/completions", "ratio <= 1.5"),
        ("grpc bare", "http", "a call to a bare grpc.aio server; baseline: per POST /v1/completions through the router",
         "reported (grpc.aio's own floor)"),
        ("ws", "sse", "a WebSocket turn; baseline: per streamed POST /v1/responses", "ratio <= 1.5"),
    ):
        out.append(Figure(BENCH, f"{name.replace(' ', '_')}_cpu_vs_http", median(figs[name].router_cpu_us),
                          median(figs[http_name].router_cpu_us), f"the router's CPU, same run; ours: per {what}",
                          goal, "us"))
    return out


# --- TTFT on a real node ----------------------------------------------------------------------


TTFT_KINDS = ("ws", "sse responses", "grpc", "sse completions")
TTFT_WARMUP = 3


@dataclass
class Timings:
    ttft_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    text: str | None = None


async def _ttft(router_url: str, grpc_port: int, key: str, s: Settings) -> dict[str, Timings]:
    router_port = int(router_url.rsplit(":", 1)[1])
    headers = {"authorization": f"Bearer {key}"}
    sampling = {"max_tokens": s.max_tokens, "temperature": 0}
    responses_body = {"model": DEMO_MODEL, "input": TTFT_PROMPT, "store": False, "stream": True,
                      "max_output_tokens": s.max_tokens, "temperature": 0}
    turn = json.dumps({"type": "response.create", **{k: v for k, v in responses_body.items() if k != "stream"}})
    completions_body = {"model": DEMO_MODEL, "prompt": TTFT_PROMPT, "stream": True, **sampling}
    infer = infer_request(DEMO_MODEL, TTFT_PROMPT, sampling, stream=True, request_id="ttft")
    grpc = KServeClient(grpc_port, key)
    sockets = ResponsesSockets(router_port, key, deflate=s.ws_deflate)
    out = {k: Timings() for k in TTFT_KINDS}
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:
        steps: dict[str, Callable[[], Awaitable[tuple[float, float, str]]]] = {
            "ws": lambda: sockets.turn_ttft(turn),
            "sse responses": lambda: sse_ttft(http, router_url + "/v1/responses", responses_body, headers,
                                              "responses"),
            "grpc": lambda: grpc.stream_ttft(infer),
            "sse completions": lambda: sse_ttft(http, router_url + COMPLETIONS, completions_body, headers, "chunks"),
        }
        try:
            await sockets.fill(1)
            for i in range(TTFT_WARMUP + s.requests):
                for kind in TTFT_KINDS[i % 4:] + TTFT_KINDS[: i % 4]:  # rotate who goes first
                    first, total, text = await steps[kind]()
                    t = out[kind]
                    if not first:
                        raise RuntimeError(f"{kind}: the stream carried no text")
                    if t.text is not None and text != t.text:
                        raise AssertionError(f"{kind}: {text!r} after {t.text!r} (temperature 0)")
                    t.text = text
                    if i >= TTFT_WARMUP:
                        t.ttft_ms.append(first * 1000)
                        t.total_ms.append(total * 1000)
        finally:
            await grpc.close()
            await sockets.close()
    for ours, base in (("ws", "sse responses"), ("grpc", "sse completions")):
        if out[ours].text != out[base].text:
            raise AssertionError(f"{ours} answered {out[ours].text!r}, {base} {out[base].text!r}")
    return out


def run_ttft(s: Settings) -> list[Figure]:
    grpc_port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-protocols-ttft-") as tmp, local_fabric(
        FabricSpec(work_dir=Path(tmp), regions=("aws:us-east-1",),
                   router_env={"MERIDIAN_ROUTER_GRPC_PORT": str(grpc_port)})
    ) as fabric:
        assert fabric.info is not None
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            got = runner.run(_ttft(fabric.info.router_url, grpc_port, fabric.info.keys["global"], s))
    for kind, t in got.items():
        print(f"# ttft {kind:15s} median {median(t.ttft_ms):7.2f} ms  p90 {percentile(t.ttft_ms, 0.9):7.2f} ms"
              f"  whole stream median {median(t.total_ms):7.2f} ms  ({len(t.ttft_ms)} requests,"
              f" {s.max_tokens} tokens at most)", file=sys.stderr, flush=True)
    where = f"on one torch node (tiny checkpoint), {s.max_tokens} tokens at most, temperature 0"
    return [
        Figure(BENCH, "ttft_ws_ms", median(got["ws"].ttft_ms), median(got["sse responses"].ttft_ms),
               f"the same Responses request over HTTP SSE (POST /v1/responses), {where}", "reported", "ms"),
        Figure(BENCH, "ttft_grpc_ms", median(got["grpc"].ttft_ms), median(got["sse completions"].ttft_ms),
               f"the same completion over HTTP SSE (POST /v1/completions), {where}", "reported", "ms"),
    ]


# --- the run ----------------------------------------------------------------------------------


def run(settings: Settings | None = None) -> list[Figure]:
    s = settings or Settings()
    return (run_added(s) if "added" in s.parts else []) + (run_ttft(s) if "ttft" in s.parts else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop request rate (req/s), every protocol")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per path and round")
    ap.add_argument("--rounds", type=int, default=3, help="latency rounds (each path once per round)")
    ap.add_argument("--grpc-rate", type=float, help="gRPC's own open-loop rate (default: --rate)")
    ap.add_argument("--ws-rate", type=float, help="the WebSocket's own open-loop rate (default: --rate)")
    ap.add_argument("--requests", type=int, default=50, help="TTFT: measured streamed requests per protocol")
    ap.add_argument("--max-tokens", type=int, default=16, help="TTFT: tokens a stream asks for")
    ap.add_argument("--no-ws-deflate", action="store_true", help="WebSocket client without permessage-deflate")
    ap.add_argument("--only", choices=("added", "ttft"), help="one part only")
    args = ap.parse_args()
    s = Settings(rate=args.rate, seconds=args.seconds, rounds=args.rounds, grpc_rate=args.grpc_rate,
                 ws_rate=args.ws_rate, requests=args.requests,
                 max_tokens=args.max_tokens, ws_deflate=not args.no_ws_deflate,
                 parts=(args.only,) if args.only else ("added", "ttft"))
    for fig in run(s):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
