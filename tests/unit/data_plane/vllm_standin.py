"""A stand-in for `vllm serve`, for tests on machines without vLLM or a GPU.

Run as `python vllm_standin.py serve MODEL_DIR [vLLM flags]`. It parses the flags the
vLLM adapter emits strictly (an unknown flag exits with code 2, like vLLM's parser),
serves /health, /v1/models, streamed /v1/completions (SSE chunks shaped like vLLM's,
with `token_ids`, `logprobs`, usage), /metrics under vLLM's metric names, and publishes
KV cache events on the --kv-events-config endpoint with vLLM's ZMQ framing and msgpack
schema (defined below, copied from vllm/distributed/kv_events.py, not imported from
Meridian). Generation is deterministic: token i of a completion is prompt[-1] + 1 + i.

Behaviour knobs (environment):
  MERIDIAN_STANDIN_STATE_DIR        where starts are counted (`starts`), and the argv
                                    (`argv-N.json`), pid (`pid-N`) and worker pid of each
                                    start and the completion requests (`requests.jsonl`)
                                    are written
  MERIDIAN_STANDIN_WAIT_FILE        "load the model" until this file exists
  MERIDIAN_STANDIN_HANG_FILE        once this file exists, the first start's /health never answers
  MERIDIAN_STANDIN_FAIL_STARTS      the first N starts exit with code 1 (needs STATE_DIR)
  MERIDIAN_STANDIN_FAIL_FROM        start N and every later one exit with code 1
  MERIDIAN_STANDIN_STARTUP_DELAY_S  seconds of "loading" before the server listens
  MERIDIAN_STANDIN_TOKEN_DELAY_S    seconds between streamed tokens
  MERIDIAN_STANDIN_CRASH_AFTER      the N-th completion of the first start kills the
                                    process after its first token (exit code 3)
  MERIDIAN_STANDIN_IGNORE_SIGTERM   1: ignore SIGTERM (only SIGKILL stops it)
  MERIDIAN_STANDIN_SPAWN_WORKER     1: start a worker process in the same process group,
                                    like vLLM's engine core (pid in STATE_DIR/worker-N.pid)
  MERIDIAN_STANDIN_KV_ENCODING      "array" (vLLM before #42892) or "map" (after)
  MERIDIAN_STANDIN_DROP_SEQ         this sequence number goes to the replay buffer only
  MERIDIAN_STANDIN_NO_TOKEN_IDS     1: ignore return_token_ids, like vLLM before 0.10.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

# --- vLLM's KV event schema (vllm/distributed/kv_events.py) -------------------------------
# Positional ("array") layout, as published before vllm-project/vllm#42892.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# Map layout: events keyed by field name, tag under "type" (vllm-project/vllm#42892).


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"MERIDIAN_STANDIN_{name}", default)


def _flag_file(name: str) -> bool:
    path = _env(name)
    return bool(path) and Path(path).exists()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--served-model-name", nargs="+")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    s.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    s.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    s.add_argument("--load-format", default="auto")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    s.add_argument("--block-size", type=int, choices=[1, 8, 16, 32, 64, 128, 256])
    s.add_argument("--quantization", "-q")
    s.add_argument("--kv-cache-dtype", default="auto")
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--enable-prompt-tokens-details", action="store_true")
    s.add_argument("--disable-uvicorn-access-log", action="store_true")
    s.add_argument("--kv-events-config", type=json.loads)
    s.add_argument("--enable-lora", action="store_true")
    s.add_argument("--max-loras", type=int, default=1)
    s.add_argument("--max-lora-rank", type=int, default=16)
    s.add_argument("--max-cpu-loras", type=int)
    s.add_argument("--lora-modules", nargs="+", default=[])
    s.add_argument("--speculative-config", type=json.loads)
    s.add_argument("--otlp-traces-endpoint")
    return parser.parse_args(argv)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    modules: dict[str, str] = {}
    for item in items:
        if "=" in item and "," not in item:
            name, path = item.split("=")
        else:
            data = json.loads(item)
            name, path = data["name"], data["path"]
        modules[name] = path
    return modules


class KVPublisher:
    """vLLM's ZmqEventPublisher: PUB [topic, seq, payload] plus a ROUTER replay buffer."""

    def __init__(self, config: dict[str, Any] | None) -> None:
        self.enabled = bool(config and config.get("enable_kv_cache_events"))
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self._drop = int(_env("DROP_SEQ", "-1"))
        self._map = _env("KV_ENCODING", "array") == "map"
        if not self.enabled:
            return
        assert config is not None
        self._ctx = zmq.Context.instance()
        self._topic = str(config.get("topic", "")).encode()
        self._pub = self._ctx.socket(zmq.PUB)
        endpoint = str(config.get("endpoint", "tcp://*:5557"))
        # vLLM binds wildcard endpoints and connects to concrete ones.
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        replay = config.get("replay_endpoint")
        if replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
            threading.Thread(target=self._serve_replay, daemon=True).start()

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
               lora: str | None) -> None:
        cls = MapBlockStored if self._map else BlockStored
        event = cls(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                    lora_id=None, medium="GPU", lora_name=lora, extra_keys=[None] * len(hashes), group_idx=0)
        self._publish(EventBatch(ts=time.time(), events=[event], data_parallel_rank=0))

    def _publish(self, batch: EventBatch) -> None:
        if not self.enabled:
            return
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        if seq != self._drop:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while True:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                buffered = [(s, p) for s, p in self._buffer if s >= first]
            for seq, payload in buffered:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))


class StandIn:
    def __init__(self, args: argparse.Namespace, start_index: int) -> None:
        self.args = args
        self.start_index = start_index
        self.state_dir = Path(_env("STATE_DIR")) if _env("STATE_DIR") else None
        self.served = (args.served_model_name or [args.model])[0]
        self.loras = parse_lora_modules(args.lora_modules)
        self.max_model_len = args.max_model_len or 4096
        self.block_size = args.block_size or 16
        self.kv = KVPublisher(args.kv_events_config)
        self.stored: set[int] = set()
        self.active: dict[str, str | None] = {}
        self.counters = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0}
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.completions = 0
        self.token_delay = float(_env("TOKEN_DELAY_S", "0"))
        crash_after = int(_env("CRASH_AFTER", "0"))
        self.crash_after = crash_after if start_index == 1 else 0

    # --- HTTP ---------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = h.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/health":
                    if self.start_index == 1 and _flag_file("HANG_FILE"):
                        await asyncio.Event().wait()  # never answers
                    await self.send(writer, 200, b"", "application/json")
                elif method == "GET" and path == "/v1/models":
                    await self.send_json(writer, 200, self.model_list())
                elif method == "GET" and path == "/metrics":
                    await self.send(writer, 200, self.metrics().encode(), "text/plain; version=0.0.4")
                elif method == "POST" and path == "/v1/completions":
                    await self.completion(reader, writer, json.loads(body), headers)
                else:
                    await self.send_json(writer, 404, {"detail": "Not Found"})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def send(self, writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str) -> None:
        head = (f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                "connection: keep-alive\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()

    async def send_json(self, writer: asyncio.StreamWriter, status: int, data: Any) -> None:
        await self.send(writer, status, json.dumps(data).encode(), "application/json")

    def model_list(self) -> dict[str, Any]:
        cards = [{"id": self.served, "object": "model", "created": 0, "owned_by": "vllm",
                  "root": self.args.model, "parent": None, "max_model_len": self.max_model_len}]
        cards += [{"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path,
                   "parent": self.served} for name, path in self.loras.items()]
        return {"object": "list", "data": cards}

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.served}"'
        running = list(self.active.values())
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(len(running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {min(1.0, len(self.stored) * self.block_size / 4096)}",
        ]
        for name, key in (("prompt_tokens", "prompt"), ("generation_tokens", "generation"),
                          ("prefix_cache_queries", "queries"), ("prefix_cache_hits", "hits")):
            lines += [f"# HELP vllm:{name}_total {name}.", f"# TYPE vllm:{name}_total counter",
                      f"vllm:{name}_total{{{labels}}} {float(self.counters[key])}"]
        lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {float(n)}'
                  for r, n in self.finished.items()]
        # A family only vLLM exports: the node must relay it.
        lines += ["# HELP vllm:engine_sleep_state Engine sleep state.",
                  "# TYPE vllm:engine_sleep_state gauge",
                  f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}} 1.0']
        if self.args.enable_lora:
            adapters = ",".join(sorted({a for a in running if a}))
            lines += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
                      "# TYPE vllm:lora_requests_info gauge",
                      f'vllm:lora_requests_info{{max_lora="{self.args.max_loras}",'
                      f'running_lora_adapters="{adapters}",waiting_lora_adapters=""}} {time.time()}']
        return "\n".join(lines) + "\n"

    # --- completions ---------------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}

    def cache_prompt(self, prompt: list[int], lora: str | None) -> int:
        """Store the prompt's full blocks, publish the new ones; the cached token count."""
        parent: int | None = None
        cached = 0
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        new_parent: int | None = None
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            block = prompt[start:start + self.block_size]
            digest = hashlib.sha256(repr((parent, block, lora)).encode()).digest()
            h = int.from_bytes(digest[:8], "big")
            if h in self.stored and not new_hashes:
                cached += self.block_size
            else:
                if not new_hashes:
                    new_parent = parent
                new_hashes.append(h)
                new_tokens += block
                self.stored.add(h)
            parent = h
        if new_hashes:
            self.kv.stored(new_hashes, new_parent, new_tokens, self.block_size, lora)
        return cached

    async def completion(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         req: dict[str, Any], headers: dict[str, str]) -> None:
        model = req.get("model")
        if model != self.served and model not in self.loras:
            await self.send_json(writer, 404, self.error(404, f"The model `{model}` does not exist.",
                                                         "NotFoundError"))
            return
        prompt = req.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            await self.send_json(writer, 400, self.error(400, "prompt must be token ids", "BadRequestError"))
            return
        max_tokens = int(req.get("max_tokens") or 16)
        if len(prompt) + max_tokens > self.max_model_len:
            await self.send_json(writer, 400, self.error(
                400, f"This model's maximum context length is {self.max_model_len} tokens.",
                "BadRequestError"))
            return
        lora = model if model in self.loras else None
        rid = headers.get("x-request-id", f"r{self.completions}")
        if self.state_dir is not None:
            with (self.state_dir / "requests.jsonl").open("a") as f:
                f.write(json.dumps({"request_id": rid, "body": req, "traceparent": headers.get("traceparent"),
                                    "otlp_protocol": os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")}) + "\n")
        self.completions += 1
        crash = self.crash_after and self.completions == self.crash_after
        cached = self.cache_prompt(prompt, lora)
        self.counters["prompt"] += len(prompt)
        self.counters["queries"] += len(prompt)
        self.counters["hits"] += cached
        stop_ids = set(req.get("stop_token_ids") or [])
        stops = set(req.get("stop") or [])
        if not req.get("stream"):
            await self.whole_completion(reader, writer, req, rid, prompt, max_tokens, cached)
            return
        want_ids = bool(req.get("return_token_ids")) and _env("NO_TOKEN_IDS") != "1"
        logprobs = req.get("logprobs")
        as_ids = bool(req.get("return_tokens_as_token_ids"))
        options = req.get("stream_options") or {}
        continuous = bool(options.get("continuous_usage_stats"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        self.active[rid] = lora
        finish = None
        produced = 0
        try:
            for i in range(max_tokens):
                if reader.at_eof():
                    finish = "abort"
                    break
                token = (prompt[-1] + 1 + i) % 100_000
                produced += 1
                self.counters["generation"] += 1
                text = f" w{token}"
                if token in stop_ids:
                    finish, text = "stop", ""
                elif f"w{token}" in stops:
                    finish, text = "stop", ""
                elif i == max_tokens - 1:
                    finish = "length"
                choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": finish, "stop_reason": None}
                if want_ids:
                    choice["token_ids"] = [token]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                if logprobs is not None:
                    top = {token_name(token, as_ids): -0.25}
                    for k in range(1, int(logprobs) + 1):
                        top[token_name(token + k, as_ids)] = -0.25 - k
                    choice["logprobs"] = {"text_offset": [0], "token_logprobs": [-0.25],
                                          "tokens": [token_name(token, as_ids)], "top_logprobs": [top]}
                chunk: dict[str, Any] = {"id": f"cmpl-{rid}", "object": "text_completion",
                                         "created": int(time.time()), "model": model, "choices": [choice]}
                if continuous:
                    chunk["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": produced,
                                      "total_tokens": len(prompt) + produced}
                await self.event(writer, chunk)
                if crash:
                    os._exit(3)
                if finish is not None:
                    break
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            if finish != "abort":
                if options.get("include_usage"):
                    usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": produced,
                                             "total_tokens": len(prompt) + produced}
                    if self.args.enable_prompt_tokens_details:
                        usage["prompt_tokens_details"] = {"cached_tokens": cached}
                    await self.event(writer, {"id": f"cmpl-{rid}", "object": "text_completion",
                                              "created": int(time.time()), "model": model,
                                              "choices": [], "usage": usage})
                await self.raw(writer, b"data: [DONE]\n\n")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except ConnectionError:
            finish = "abort"
        finally:
            self.active.pop(rid, None)
            self.finished[finish or "abort"] += 1
        if finish == "abort":
            raise ConnectionResetError

    async def whole_completion(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               req: dict[str, Any], rid: str,
                               prompt: list[int], max_tokens: int, cached: int) -> None:
        """A non-streamed completion, shaped like vLLM's (same tokens as a stream)."""
        stop_ids = set(req.get("stop_token_ids") or [])
        tokens: list[int] = []
        finish = "length"
        self.active[rid] = None
        try:
            for i in range(max_tokens):
                token = (prompt[-1] + 1 + i) % 100_000
                if token in stop_ids:
                    finish = "stop"
                    break
                tokens.append(token)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                    if reader.at_eof():  # the client left: vLLM aborts such a request
                        self.finished["abort"] += 1
                        raise ConnectionResetError
        finally:
            self.active.pop(rid, None)
        self.counters["generation"] += len(tokens)
        self.finished[finish] += 1
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                                 "total_tokens": len(prompt) + len(tokens)}
        if self.args.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        choice = {"index": 0, "text": "".join(f" w{t}" for t in tokens), "logprobs": None,
                  "finish_reason": finish, "stop_reason": None}
        await self.send_json(writer, 200, {"id": f"cmpl-{rid}", "object": "text_completion",
                                           "created": int(time.time()), "model": req.get("model"),
                                           "choices": [choice], "usage": usage})

    async def event(self, writer: asyncio.StreamWriter, data: dict[str, Any]) -> None:
        await self.raw(writer, f"data: {json.dumps(data)}\n\n".encode())

    async def raw(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()


def token_name(token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else f"w{token}"


def count_start(state_dir: Path | None, argv: list[str]) -> int:
    if state_dir is None:
        return 1
    state_dir.mkdir(parents=True, exist_ok=True)
    counter = state_dir / "starts"
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    # Renamed into place: a test polling the count never reads a half-written file.
    tmp = counter.with_name(f".starts-{os.getpid()}")
    tmp.write_text(str(n))
    os.replace(tmp, counter)
    (state_dir / f"argv-{n}.json").write_text(json.dumps(argv))
    (state_dir / f"pid-{n}").write_text(str(os.getpid()))
    return n


async def serve(args: argparse.Namespace, start_index: int) -> None:
    standin = StandIn(args, start_index)
    server = await asyncio.start_server(standin.handle, args.host or "0.0.0.0", args.port)
    print(f"INFO:     Uvicorn running on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    if _env("IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()
    print("INFO:     Shutting down", flush=True)
    # Like vLLM: leave without waiting for open connections.
    os._exit(0)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    state = _env("STATE_DIR")
    state_dir = Path(state) if state else None
    n = count_start(state_dir, argv)
    print(f"INFO stand-in vllm start {n}: serving {args.model} on port {args.port}", flush=True)
    if n <= int(_env("FAIL_STARTS", "0")) or n >= int(_env("FAIL_FROM", "0") or 0) > 0:
        print(f"ERROR stand-in start {n} fails on purpose", file=sys.stderr, flush=True)
        sys.exit(1)
    if _env("SPAWN_WORKER") == "1" and state_dir is not None:
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (state_dir / f"worker-{n}.pid").write_text(str(worker.pid))
    time.sleep(float(_env("STARTUP_DELAY_S", "0")))
    wait_file = _env("WAIT_FILE")
    while wait_file and not Path(wait_file).exists():
        time.sleep(0.02)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args, n))


if __name__ == "__main__":
    main()
