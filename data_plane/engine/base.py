"""The Engine protocol every runtime implements (built-in torch engine, vLLM adapter),
its request/output types, and the registry engines are created from by name (`ENGINES`,
a `meridian.registry.Registry` whose built-ins load lazily)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import KVTransferInfo, NodeCapability
from meridian.registry import Registry
from meridian.settings.node import NodeSettings

if TYPE_CHECKING:
    import httpx

    from meridian.kv_events import KVEventBatch
    from meridian.tokenizer import ChatTokenizer

FinishReason = Literal["stop", "length", "abort"]
log = logging.getLogger(__name__)


class ExternalKV(Protocol):
    """Another node's prefill of a request's prompt, as an engine is given it to decode
    after (meridian.kv_transfer). Each engine has its own form of the KV itself (the torch
    engine's: data_plane.engine.kv_transfer.payload.KVPayload, its tensors on the CPU); this
    protocol names only what says which prompt it is, so the protocol imports no engine."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def tokens_sha256(self) -> str: ...


@dataclass(frozen=True, slots=True)
class KVHold:
    """What a prefill request's last output says of its held KV: the handle a decode node
    pulls it by, the blocks, and the prompt tokens whose KV they hold (the whole prompt)."""

    handle: str
    block_ids: tuple[int, ...]
    num_tokens: int


def warn_without_chat_template(tokenizer: ChatTokenizer, model: str) -> None:
    """Say when the model loads, not at the first chat, that chats will be refused: its
    tokenizer has no template to lay messages out with."""
    if tokenizer.chat_template is None:
        log.warning("%s has no chat template (no chat_template.jinja, none in tokenizer_config.json): "
                    "chat completions will answer 400; completions work", model)


class EngineError(Exception):
    """Base of the errors an engine raises to its caller."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the caller should retry elsewhere or later."""


class EngineNotReadyError(EngineError):
    """The engine has not finished loading, or has stopped."""


class EngineRequestError(EngineError, ValueError):
    """The request cannot be served as asked (too long, duplicate id...)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k filtering.
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Keep generating past the model's end-of-sequence tokens (benchmarks, tests).
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the sampled token's logprob and the N most likely.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # LoRA adapter to apply (the part after ':' in `base:adapter`); None: the base model.
    lora_name: str | None = None
    # Isolates this request's prefix-cache entries from other tenants' (vLLM's cache_salt).
    cache_salt: str | None = None
    # Prefill for another node (meridian.kv_transfer): keep the prompt's KV blocks when the
    # request finishes, under a handle its last output reports (`kv_hold`).
    hold_kv: bool = False
    # Decode after another node's prefill: the prompt's KV it computed (checked to fit);
    # those tokens are not computed again, but for the last, whose logits are sampled.
    external_kv: ExternalKV | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token and of the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One step of a request's progress: what is new since the previous output."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    # Cumulative count, including this output's tokens.
    completion_tokens: int
    # One entry per token in token_ids when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens whose KV came from the prefix cache or another node (set on the first
    # output), as vLLM's usage counts them.
    cached_tokens: int = 0
    # On the last output of a `hold_kv` request: where its prompt's KV is held.
    kv_hold: KVHold | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load and counters with vLLM's metric semantics."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_aborted_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0
    # Prompt tokens of admitted requests by where their KV came from (vLLM's
    # vllm:prompt_tokens_by_source): computed here, local prefix cache, another node.
    prompt_tokens_local_compute_total: int = 0
    prompt_tokens_local_cache_hit_total: int = 0
    prompt_tokens_external_kv_transfer_total: int = 0
    # Prompt tokens of requests waiting for their prefill (None: not measured).
    waiting_prompt_tokens: int | None = None
    # LoRA adapters of running / waiting requests, resident ones, and the resident limit.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    loaded_loras: tuple[str, ...] = ()
    max_loras: int = 0


class KVEventSink(Protocol):
    """Where an engine hands its KV cache events; must be thread-safe and never block."""

    def publish(self, batch: KVEventBatch) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """A model runtime serving generation requests for one node."""

    async def start(self) -> None:
        """Load the model; returns once requests can be served."""
        ...

    async def stop(self) -> None:
        """Abort what is still running and release the model."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        """Stream a request's outputs; the last one has a finish_reason.

        Closing the iterator early aborts the request. Raises EngineOverloadedError,
        EngineNotReadyError or EngineRequestError on the first iteration.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its state; unknown ids are ignored. Never blocks."""
        ...

    def stats(self) -> EngineStats: ...

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        """Publish KV cache events (vLLM's format) to `sink` from now on; None stops."""
        ...

    def models(self) -> list[str]:
        """Names of the models this engine serves (the base model first)."""
        ...

    def lora_adapters(self) -> list[str]:
        """Names of the LoRA adapters requests may ask for (`base:adapter`)."""
        ...

    def get_tokenizer(self) -> ChatTokenizer:
        """Tokenizer of the served model (valid once started)."""
        ...


@runtime_checkable
class PassthroughEngine(Protocol):
    """An engine with its own OpenAI/Anthropic HTTP server (vLLM), to which the node passes
    requests unchanged instead of serving them through `generate`, so that nothing the
    engine supports (tools, structured outputs, responses, messages...) is lost."""

    def upstream(self) -> httpx.AsyncClient:
        """A pooled client for the engine's server; EngineNotReadyError when it cannot serve."""
        ...

    def upstream_model(self, model: str) -> str | None:
        """The engine's name for a fabric model name (`base`, `base:adapter` or a bare
        adapter name); None when it serves no such model."""
        ...

    def tool_call_parser(self) -> str | None:
        """The parser the engine's server reads the model's tool calls with when it chooses
        them itself (vLLM's --tool-call-parser); None when it reads none. An engine that is
        not pass-through serves no tools."""
        ...


@runtime_checkable
class CapableEngine(Protocol):
    """An engine that says what it does with requests that routers shape theirs by; the node
    registers it (an engine that does not say registers none)."""

    def capabilities(self) -> tuple[NodeCapability, ...]: ...

    def max_num_seqs(self) -> int:
        """Sequences it runs at once: routers' flow control fills the node to this before it
        holds requests at the router."""
        ...


@runtime_checkable
class KVTransferEngine(Protocol):
    """An engine that hands a prompt's KV to (or takes it from) another node's, for
    prefill/decode disaggregation (meridian.kv_transfer)."""

    def kv_transfer(self) -> KVTransferInfo | None:
        """How the node's peers pull its KV (the node registers it); None when co-located."""
        ...


class EngineFactory(Protocol):
    """Makes an engine (not yet started) for a node's settings, reading time from `clock`
    (the node's one Clock)."""

    def __call__(self, settings: NodeSettings, *, clock: Clock) -> Engine: ...


# Built-in engines are imported on first use, so a CPU node never imports vLLM and a
# vLLM node never pays for what it does not run. Register more with ENGINES.register.
ENGINES: Registry[EngineFactory] = Registry(
    "engine",
    builtins={
        "torch": "data_plane.engine.torch_engine:TorchEngine",
        "vllm": "data_plane.engine.vllm.engine:VllmEngine",
    },
)


def create_engine(name: str, settings: NodeSettings, *, clock: Clock = SYSTEM_CLOCK) -> Engine:
    """Instantiate the engine registered as `name` (not yet started); UnknownName else."""
    return ENGINES.get(name)(settings, clock=clock)


def served_model_name(settings: NodeSettings) -> str:
    """The name clients use for the model: settings.model_name, else the checkpoint dir's name."""
    if settings.model_name:
        return settings.model_name
    if settings.model_dir is None:
        raise ValueError("model_dir is required")
    return settings.model_dir.resolve().name
