"""VllmEngine: the Engine protocol over a supervised `vllm serve` child.

Requests go to the child's OpenAI server on loopback as streamed /v1/completions with
the prompt as token ids. Generated token ids come from `return_token_ids` (vLLM >=
0.10.2); on an older vLLM, which ignores that field, from `logprobs` with
`return_tokens_as_token_ids` ("token_id:123" strings). Closing a request's iterator, or
abort(), closes its HTTP stream, and vLLM aborts a request whose client disconnected.

Load and counters are scraped from the child's /metrics in the background; KV cache
events are relayed from its ZMQ publisher to the node's sink (relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from data_plane.agent import advertise_url
from data_plane.engine.base import (
    EngineError,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequestError,
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    KVEventSink,
    TokenLogprob,
    warn_without_chat_template,
)
from data_plane.engine.vllm.command import (
    LOOPBACK,
    KVEventsEndpoints,
    NixlSideChannel,
    build_serve_argv,
    cpu_env,
    detect_gpu_count,
    http_env,
    load_spec,
    nixl_env,
    nixl_side_channel,
    node_lora_paths,
    tracing_env,
)
from data_plane.engine.vllm.metrics import StatsTracker, drop_metric_families, parse_vllm_metrics
from data_plane.engine.vllm.relay import KVEventRelay
from data_plane.engine.vllm.spec import DeploymentSpec, DeploymentSpecError
from data_plane.engine.vllm.supervisor import RestartPolicy, VllmSupervisor
from meridian.clock import SYSTEM_CLOCK, Clock, wait_at_most
from meridian.contracts import KVTransferInfo, NodeCapability, Route
from meridian.http_server import CLIENT_KEEPALIVE_S
from meridian.ports import free_port
from meridian.settings.node import NodeSettings
from meridian.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

_TOKEN_ID_PREFIX = "token_id:"
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# Bounded waits for the small control requests to vLLM (metrics, model list).
_CONTROL_TIMEOUT_S = 5.0


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        with contextlib.suppress(ValueError):
            return int(token[len(_TOKEN_ID_PREFIX):])
    return None


def _error_message(body: bytes) -> str:
    """The message of an OpenAI (or older vLLM) error body, else the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
    return str(data)[:500]


class StreamParser:
    """Turns the chunks of one streamed vLLM completion into GenerationOutputs.

    The output that carries the finish reason is held back until the stream ends, so
    that it can carry the usage vLLM sends last (cached prompt tokens).
    """

    def __init__(self, request: GenerationRequest, *, keep_logprobs: bool) -> None:
        self._request = request
        self._keep_logprobs = keep_logprobs
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        # A choice came without `token_ids`: this vLLM predates return_token_ids.
        self.token_ids_missing = False
        self._final: GenerationOutput | None = None

    def feed(self, chunk: dict[str, Any]) -> list[GenerationOutput]:
        if isinstance(chunk.get("error"), dict) or chunk.get("object") == "error":
            raise EngineError(f"vLLM failed the request: {_error_message(json.dumps(chunk).encode())}")
        usage = chunk.get("usage")
        usage_completion: int | None = None
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                usage_completion = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        outputs: list[GenerationOutput] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            outputs.extend(self._choice(choice, usage_completion))
        if not chunk.get("choices") and usage_completion is not None and self.token_ids_missing:
            self.completion_tokens = max(self.completion_tokens, usage_completion)
        return outputs

    def _choice(self, choice: dict[str, Any], usage_completion: int | None) -> list[GenerationOutput]:
        text = choice.get("text") or ""
        logprobs = self._logprobs(choice.get("logprobs"))
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            token_ids = [int(t) for t in ids]
        else:
            self.token_ids_missing = True
            token_ids = [lp.token_id for lp in logprobs] if logprobs else []
        if token_ids or usage_completion is None:
            self.completion_tokens += len(token_ids)
        else:
            self.completion_tokens = max(self.completion_tokens, usage_completion)
        reason = choice.get("finish_reason")
        finish: FinishReason | None = None
        if reason is not None:
            if reason == "error":
                raise EngineError("vLLM failed the request")
            finish = _FINISH_REASONS.get(str(reason), "stop")
        output = GenerationOutput(
            request_id=self._request.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs if self._keep_logprobs else None,
        )
        if finish is not None:
            self._final = output
            return []
        return [output] if token_ids or text else []

    def _logprobs(self, raw: Any) -> list[TokenLogprob] | None:
        if not isinstance(raw, dict):
            return None
        tokens = raw.get("tokens") or []
        values = raw.get("token_logprobs") or []
        tops = raw.get("top_logprobs") or []
        out: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            tid = _token_id(token)
            if tid is None:
                continue
            value = values[i] if i < len(values) and values[i] is not None else float("-inf")
            top_raw = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            top = [(t, float(v)) for k, v in top_raw.items() if (t := _token_id(k)) is not None]
            top.sort(key=lambda kv: -kv[1])
            out.append(TokenLogprob(token_id=tid, logprob=float(value), top=tuple(top)))
        return out

    def finish(self) -> GenerationOutput:
        """The last output, once the stream has ended."""
        final = self._final
        if final is None:
            raise EngineError("vLLM ended the stream without finishing the request")
        return GenerationOutput(
            request_id=final.request_id,
            token_ids=final.token_ids,
            text=final.text,
            finish_reason=final.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=max(final.completion_tokens, self.completion_tokens),
            logprobs=final.logprobs,
            cached_tokens=self.cached_tokens,
        )


@dataclass(eq=False)
class _Stream:
    request: GenerationRequest
    parser: StreamParser
    queue: asyncio.Queue[GenerationOutput | BaseException] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    # A final output or an error is queued: nothing more may follow.
    closed: bool = False

    def put(self, item: GenerationOutput | BaseException, *, last: bool = False) -> None:
        if self.closed:
            return
        self.closed = last
        self.queue.put_nowait(item)


class VllmEngine:
    """Engine protocol implementation that runs vLLM as a child process.

    `on_fatal` is called if vLLM keeps dying after the engine started and the
    supervisor gives up, so that the node can leave the fleet.
    """

    def __init__(
        self, settings: NodeSettings, *, spec: DeploymentSpec | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        if settings.model_dir is None:
            raise ValueError("the vLLM engine needs settings.model_dir (the model's local directory)")
        self._settings = settings
        # The node's clock: KV event times, the metrics scrape interval, the drain timeout,
        # and the supervisor's restart backoff, startup timeout and stop grace.
        self._clock = clock
        self.spec = spec or load_spec(settings)
        self._model_dir = Path(settings.model_dir)
        self._served = self.spec.served_name
        available = node_lora_paths(settings)
        missing = [lora.name for lora in self.spec.loras if lora.name not in available]
        if missing:
            raise DeploymentSpecError(f"LoRA adapter(s) not on this node: {', '.join(missing)}")
        self._lora_paths = {lora.name: available[lora.name] for lora in self.spec.loras}
        # A prefill/decode node's NIXL connector, its side channel on the host routers reach
        # the node at (vLLM hands that host to decode workers in kv_transfer_params).
        host = urlsplit(advertise_url(settings)).hostname or LOOPBACK
        self.kv_side_channel: NixlSideChannel | None = nixl_side_channel(settings, host)
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.supervisor: VllmSupervisor | None = None
        self.relay: KVEventRelay | None = None
        self.base_url = ""
        self._tokenizer: ChatTokenizer | None = None
        self._client: httpx.AsyncClient | None = None
        self._tracker = StatsTracker(max_loras=self.spec.max_loras if self.spec.loras else 0)
        self._sink: KVEventSink | None = None
        self._streams: dict[str, _Stream] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = False
        self._max_model_len: int | None = self.spec.max_model_len
        self._ids_via_logprobs = False
        self._scraper: asyncio.Task[None] | None = None
        self._metrics_text = ""
        self.failure: BaseException | None = None

    # --- Engine protocol -------------------------------------------------------------------

    async def start(self) -> None:
        """Start vLLM and return once it serves the model (minutes for a large one)."""
        if self._client is not None:
            return
        s = self._settings
        gpu_count = s.vllm_gpu_count if s.vllm_gpu_count is not None else await detect_gpu_count()
        port = s.vllm_port or free_port(LOOPBACK)
        events_port = s.vllm_kv_events_port or free_port(LOOPBACK)
        replay_port = s.vllm_kv_events_replay_port or free_port(LOOPBACK)
        endpoints = KVEventsEndpoints(
            endpoint=f"tcp://{LOOPBACK}:{events_port}",
            replay_endpoint=f"tcp://{LOOPBACK}:{replay_port}",
            topic=s.kv_events_topic,
        )
        argv = await asyncio.to_thread(
            build_serve_argv,
            self.spec, model_dir=self._model_dir, gpu_count=gpu_count, port=port,
            kv_events=endpoints, lora_paths=self._lora_paths,
            draft_model_dir=s.vllm_draft_model_dir, executable=s.vllm_executable, otlp_endpoint=s.otlp_endpoint,
            kv_transfer=self.kv_side_channel,
        )
        self._tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, self._model_dir)
        warn_without_chat_template(self._tokenizer, self._served)
        self.base_url = f"http://{LOOPBACK}:{port}"
        self.relay = KVEventRelay(endpoints.endpoint, topic=endpoints.topic,
                                  replay_endpoint=endpoints.replay_endpoint, clock=self._clock)
        self.relay.set_sink(self._sink)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(connect=5.0, read=s.vllm_read_timeout_s, write=30.0, pool=30.0),
            # Every in-flight request holds a connection; the engine bounds them itself.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=CLIENT_KEEPALIVE_S),
        )
        supervisor = VllmSupervisor(
            argv,
            base_url=self.base_url,
            served_model_name=self._served,
            startup_timeout_s=s.vllm_startup_timeout_s,
            probe_interval_s=s.vllm_probe_interval_s,
            stop_grace_s=s.vllm_stop_grace_s,
            policy=RestartPolicy(
                max_restarts=s.vllm_max_restarts, window_s=s.vllm_restart_window_s,
                backoff_s=s.vllm_restart_backoff_s, backoff_max_s=s.vllm_restart_backoff_max_s,
            ),
            env={**http_env(), **tracing_env(s.otlp_endpoint), **nixl_env(self.kv_side_channel),
                 **(self.spec.env if gpu_count > 0 else cpu_env(self.spec))},
            clock=self._clock,
        )
        supervisor.on_exit = self._on_child_exit
        supervisor.on_failed = self._on_failed
        self.supervisor = supervisor
        try:
            # Bound before vLLM starts: its publisher connects here, now and after restarts.
            self.relay.start()
            await supervisor.start()
            if self._max_model_len is None:
                self._max_model_len = await self._fetch_max_model_len()
        except BaseException:
            await self._release()
            raise
        self._scraper = asyncio.create_task(self._scrape_loop(), name="vllm-metrics")
        self._accepting = True

    async def stop(self) -> None:
        """Refuse new requests, let in-flight ones finish (drain_timeout_s), abort the
        rest, then stop vLLM (SIGTERM, SIGKILL after vllm_stop_grace_s)."""
        self._accepting = False
        if self._streams:
            log.info("vLLM engine draining %d in-flight requests", len(self._streams))
            await wait_at_most(self._clock, self._settings.drain_timeout_s, self._idle.wait())
        for request_id in list(self._streams):
            self.abort(request_id)
        await self._release()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        stream = self._submit(request)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._close(stream)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.closed:
            return
        if stream.task is not None:
            # Closing the connection is what makes vLLM abort the request.
            stream.task.cancel()
        p = stream.parser
        stream.put(GenerationOutput(
            request_id=request_id, token_ids=[], text="", finish_reason="abort",
            prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        ), last=True)

    def stats(self) -> EngineStats:
        return self._tracker.stats()

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        self._sink = sink
        if self.relay is not None:
            self.relay.set_sink(sink)

    def models(self) -> list[str]:
        return [self._served]

    def lora_adapters(self) -> list[str]:
        return [lora.name for lora in self.spec.loras]

    def get_tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise EngineNotReadyError("the engine has not loaded its tokenizer yet")
        return self._tokenizer

    # --- pass-through (PassthroughEngine) ---------------------------------------------------

    def upstream(self) -> httpx.AsyncClient:
        """The client for vLLM's server; EngineNotReadyError unless it serves now."""
        supervisor = self.supervisor
        if not self._accepting or self._client is None or supervisor is None:
            raise EngineNotReadyError("the vLLM engine is not running")
        if not supervisor.ready:
            raise EngineNotReadyError(f"vLLM is not serving right now ({supervisor.state})")
        return self._client

    def upstream_model(self, model: str) -> str | None:
        # vLLM names an adapter by its bare name; the fabric also as `base:adapter`.
        if model == self._served:
            return model
        base, sep, adapter = model.partition(":")
        name = adapter if sep and base == self._served else model
        return name if name in self._lora_paths else None

    def tool_call_parser(self) -> str | None:
        return self.spec.tool_call_parser

    def capabilities(self) -> tuple[NodeCapability, ...]:
        # vLLM's stream excluding stop strings holds back len(longest) - 1 characters unless
        # asked to include them; its chat takes add_special_tokens (as its Responses path).
        return (NodeCapability.STOP_STRING_IN_OUTPUT, NodeCapability.CHAT_SPECIAL_TOKENS)

    def max_num_seqs(self) -> int:
        return self.spec.max_num_seqs

    def kv_transfer(self) -> KVTransferInfo | None:
        side = self.kv_side_channel
        return side.info() if side is not None else None

    # --- metrics relay ---------------------------------------------------------------------

    async def raw_metrics(self, drop_families: Collection[str] = ()) -> str:
        """vLLM's own /metrics text (the last scrape if vLLM does not answer now),
        without `drop_families` (e.g. the families the node already exports)."""
        text = self._metrics_text
        if self._client is not None and self.supervisor is not None and self.supervisor.ready:
            with contextlib.suppress(httpx.HTTPError):
                response = await self._client.get("/metrics", timeout=_CONTROL_TIMEOUT_S)
                if response.status_code == 200:
                    text = self._metrics_text = response.text
        return drop_metric_families(text, drop_families)

    # --- requests --------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> _Stream:
        self.upstream()  # raises unless vLLM serves now
        params = request.sampling_params
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise EngineRequestError("the prompt is empty")
        if params.max_tokens < 1:
            raise EngineRequestError("max_tokens must be at least 1")
        limit = self._max_model_len
        if limit is not None and n_prompt + params.max_tokens > limit:
            raise EngineRequestError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum context length {limit}"
            )
        if request.lora_name is not None and request.lora_name not in self._lora_paths:
            raise EngineRequestError(f"unknown LoRA adapter {request.lora_name!r}")
        if request.request_id in self._streams:
            raise EngineRequestError(f"request id {request.request_id!r} is already running")
        capacity = self.spec.max_num_seqs + self._settings.max_waiting_requests
        if len(self._streams) >= capacity:
            raise EngineOverloadedError(f"{len(self._streams)} requests in flight; try again later")
        want_logprobs = params.logprobs is not None
        stream = _Stream(request, StreamParser(request, keep_logprobs=want_logprobs))
        self._streams[request.request_id] = stream
        self._idle.clear()
        stream.task = asyncio.create_task(self._run(stream, self._body(request)),
                                          name=f"vllm-request-{request.request_id}")
        return stream

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        p = request.sampling_params
        body: dict[str, Any] = {
            "model": request.lora_name or self._served,
            "prompt": list(request.prompt_token_ids),
            "stream": True,
            # Usage on every chunk: token counts even where token ids are missing.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "ignore_eos": p.ignore_eos,
            "return_token_ids": True,
        }
        if p.top_k > 0:
            body["top_k"] = p.top_k
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            body["seed"] = p.seed
        logprobs = p.logprobs
        if logprobs is None and self._ids_via_logprobs:
            logprobs = 0
        if logprobs is not None:
            body["logprobs"] = logprobs
            body["return_tokens_as_token_ids"] = True
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        return body

    async def _run(self, stream: _Stream, body: dict[str, Any]) -> None:
        """Read one streamed completion into the request's queue (its own task)."""
        assert self._client is not None
        parser = stream.parser
        headers = {"X-Request-Id": stream.request.request_id}
        try:
            async with self._client.stream("POST", Route.COMPLETIONS, json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise _status_error(r.status_code, _error_message(await r.aread()))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    for output in parser.feed(json.loads(data)):
                        stream.put(output)
            if parser.token_ids_missing and not self._ids_via_logprobs:
                log.warning("this vLLM does not return token ids; asking for logprobs instead")
                self._ids_via_logprobs = True
            stream.put(parser.finish(), last=True)
        except asyncio.CancelledError:
            raise
        except EngineError as exc:
            stream.put(exc, last=True)
        except httpx.TimeoutException:
            stream.put(EngineError(f"vLLM sent nothing for {self._settings.vllm_read_timeout_s:.0f}s"),
                       last=True)
        except (httpx.TransportError, httpx.StreamError) as exc:
            stream.put(EngineNotReadyError(f"lost the connection to vLLM: {exc!r}"), last=True)
        except ValueError as exc:
            stream.put(EngineError(f"unreadable answer from vLLM: {exc}"), last=True)

    def _close(self, stream: _Stream) -> None:
        rid = stream.request.request_id
        if self._streams.get(rid) is stream:
            del self._streams[rid]
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        stream.closed = True
        if not self._streams:
            self._idle.set()

    # --- child lifecycle -------------------------------------------------------------------

    def _on_child_exit(self, generation: int, returncode: int | None) -> None:
        self._tracker.child_exited()
        if self.relay is not None:
            self.relay.child_exited()

    def _on_failed(self, error: BaseException) -> None:
        self.failure = error
        self._accepting = False
        # A failure while starting is start()'s error; only a running engine reports here.
        if self._scraper is not None and self.on_fatal is not None:
            self.on_fatal(error)

    async def _fetch_max_model_len(self) -> int | None:
        assert self._client is not None
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            response = await self._client.get("/v1/models", timeout=_CONTROL_TIMEOUT_S)
            for card in response.json().get("data", []):
                if card.get("id") == self._served and isinstance(card.get("max_model_len"), int):
                    return int(card["max_model_len"])
        return None

    async def _scrape_loop(self) -> None:
        assert self._client is not None and self.supervisor is not None
        supervisor = self.supervisor
        while True:
            if supervisor.ready:
                generation = supervisor.generation
                try:
                    response = await self._client.get("/metrics", timeout=_CONTROL_TIMEOUT_S)
                    if response.status_code == 200:
                        self._metrics_text = response.text
                        self._tracker.update(generation, parse_vllm_metrics(response.text))
                except (httpx.HTTPError, ValueError) as exc:
                    log.debug("scraping vLLM's metrics failed: %r", exc)
            await self._clock.sleep(self._settings.vllm_probe_interval_s)

    async def _release(self) -> None:
        scraper, self._scraper = self._scraper, None
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
        if self.supervisor is not None:
            await self.supervisor.stop()
        for stream in list(self._streams.values()):
            if stream.task is not None:
                stream.task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        relay, self.relay = self.relay, None
        if relay is not None:
            await asyncio.to_thread(relay.stop)


def _status_error(status: int, message: str) -> EngineError:
    if status in (400, 404, 422):
        return EngineRequestError(message)
    if status == 429:
        return EngineOverloadedError(message)
    if status == 503:
        return EngineNotReadyError(message)
    return EngineError(f"vLLM answered {status}: {message}")
