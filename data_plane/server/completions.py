"""Serving /v1/chat/completions and /v1/completions: OpenAI request in, engine request
out, and the engine's outputs back as an OpenAI response or SSE stream.

With `return_token_ids` a stream has one chunk per engine output, as vLLM's has, each
carrying the ids generated in it even when their text is held back (a stop string that
may be starting, half a UTF-8 character): every generated id, the one that completed a
stop string and an end-of-sequence id included, is in exactly one chunk. The router's
ledger of a stream is those ids; it resumes a broken stream from them on another node.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from data_plane.engine.base import (
    EngineError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    KVHold,
    SamplingParams,
    TokenLogprob,
)
from data_plane.engine.tracing import traced
from data_plane.runtime import NodeRuntime
from data_plane.server.body import parse_body
from data_plane.server.client_watch import unless_disconnected
from data_plane.server.errors import (
    BadRequestError,
    ClientClosedError,
    ContextLengthError,
    ModelNotFoundError,
    UnavailableError,
)
from data_plane.server.kv_pull import KVPuller
from data_plane.server.kv_transfer import KVSide, kv_side, prefill_answer
from data_plane.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from data_plane.server.metrics import NodeMetrics
from data_plane.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerationParams,
    PromptTokensDetails,
    UsageInfo,
)
from meridian.contracts import HEADER_REQUEST_ID, ModelCard, ModelList, openai_error
from meridian.request_journal import RequestJournal
from meridian.tracing import Tracing

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
OpenAIFinish = Literal["stop", "length"]
SSE_DONE = b"data: [DONE]\n\n"


def _sse(payload: BaseModel | dict[str, object]) -> bytes:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + body.encode("utf-8") + b"\n\n"


def _openai_finish(reason: FinishReason | None) -> OpenAIFinish | None:
    """OpenAI has no "abort": an aborted stream ends with an error event instead."""
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return None


class _ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always runs its cleanup, even if the client went away
    before the body was ever iterated."""

    def __init__(
        self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


@dataclass
class _Exchange:
    """One request in flight: ids, timing and what has been produced so far."""

    kind: Kind
    id: str
    created: int
    model: str
    prompt_tokens: int
    arrival: float
    include_usage: bool
    # Alternatives per token the client asked for; None: no logprobs.
    logprobs: int | None = None
    # Set when logprobs were asked for.
    token_texts: TokenTexts | None = None
    tokens_as_ids: bool = False
    # return_token_ids: the prompt's ids, reported once (None: not asked for).
    prompt_ids: list[int] | None = None
    completion_tokens: int = 0
    # From the engine's first output: what the prefix cache supplied.
    cached_tokens: int | None = None
    finish_reason: FinishReason | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Characters of completion text streamed so far (completions' text_offset).
    streamed_chars: int = 0
    # The router's request id (the client's idempotency key): the journal's key.
    key: str | None = None
    journalled: bool = False
    # A prefill request's held KV (its last output says where).
    kv_hold: KVHold | None = None

    def usage(self) -> UsageInfo:
        details = PromptTokensDetails(cached_tokens=self.cached_tokens) if self.cached_tokens else None
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=details,
        )


class CompletionService:
    """The two generation endpoints of a node."""

    def __init__(self, runtime: NodeRuntime, metrics: NodeMetrics, journal: RequestJournal | None = None,
                 tracing: Tracing | None = None, kv_puller: KVPuller | None = None) -> None:
        self._runtime = runtime
        self._tracing = tracing or Tracing.off()
        self._journal = journal or RequestJournal(None)
        self._settings = runtime.settings
        self._engine = runtime.engine
        self._metrics = metrics
        self._token_texts: TokenTexts | None = None
        # Set on a node that takes part in prefill/decode hand-offs.
        self._kv_puller = kv_puller

    async def chat(self, request: Request) -> Response:
        params = await parse_body(
            request, ChatCompletionRequest, limit=self._settings.max_request_bytes,
            context={"max_tokens_limit": self._settings.max_tokens_limit}, strict=True,
        )
        lora = await self.resolve_model(params.model)
        tokenizer = self._engine.get_tokenizer()
        messages = [m.for_template() for m in params.messages]
        # Templating and tokenising a prompt of up to max_request_bytes is CPU work: keep it
        # off the event loop so other requests' streams keep flowing.
        prompt_ids = await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, add_generation_prompt=True)
        return await self._generate(request, "chat", params, prompt_ids, "messages", lora)

    async def completion(self, request: Request) -> Response:
        params = await parse_body(
            request, CompletionRequest, limit=self._settings.max_request_bytes,
            context={"max_tokens_limit": self._settings.max_tokens_limit}, strict=True,
        )
        lora = await self.resolve_model(params.model)
        tokenizer = self._engine.get_tokenizer()
        prompt = params.prompt_text_or_ids()
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens=True)
        else:
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
                raise BadRequestError("prompt contains token ids outside the vocabulary",
                                      param="prompt")
            prompt_ids = prompt
        return await self._generate(request, "completion", params, prompt_ids, "prompt", lora)

    # --- shared -----------------------------------------------------------------------

    async def model_list(self, created: int) -> ModelList:
        """/v1/models: the base model, then each LoRA adapter as `base:adapter`."""
        bases = self._engine.models()
        cards = [ModelCard(id=m, created=created, root=m) for m in bases]
        if bases:
            # An adapter directory is listed on disk: not on the event loop.
            adapters = await asyncio.to_thread(self._engine.lora_adapters)
            base = bases[0]
            cards += [ModelCard(id=f"{base}:{a}", created=created, root=base, parent=base)
                      for a in adapters]
        return ModelList(data=cards)

    async def resolve_model(self, model: str) -> str | None:
        """The LoRA adapter `model` asks for (None: the base model); 404 if there is none.

        Adapters are named `base:adapter`, or by their bare name as vLLM serves them.
        """
        bases = self._engine.models()
        if model in bases:
            return None
        adapter = model
        for base in bases:
            if model.startswith(base + ":"):
                adapter = model[len(base) + 1:]
                break
        if adapter and adapter in await asyncio.to_thread(self._engine.lora_adapters):
            return adapter
        raise ModelNotFoundError(model)

    def _texts(self) -> TokenTexts:
        """Token texts for logprobs, cached for as long as the engine keeps its tokenizer."""
        tokenizer = self._engine.get_tokenizer()
        if self._token_texts is None or self._token_texts.tokenizer is not tokenizer:
            self._token_texts = TokenTexts(tokenizer)
        return self._token_texts

    def _sampling(self, params: GenerationParams, prompt_len: int, param: str) -> SamplingParams:
        max_len = self._settings.max_model_len
        room = max_len - prompt_len
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(self._settings.max_tokens_limit, room)
        if room < 1 or max_tokens > room:
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the "
                f"{param}, {max(max_tokens, 1)} in the completion). Please reduce the length "
                f"of the {param} or completion.",
                param=param,
            )
        return SamplingParams(
            temperature=1.0 if params.temperature is None else params.temperature,
            top_p=1.0 if params.top_p is None else params.top_p,
            top_k=params.engine_top_k(),
            max_tokens=max_tokens,
            stop=params.stop_list(),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            logprobs=params.engine_logprobs(),
        )

    async def _generate(
        self,
        request: Request,
        kind: Kind,
        params: GenerationParams,
        prompt_ids: list[int],
        param: str,
        lora: str | None,
    ) -> Response:
        side = kv_side(params.kv_transfer_params, enabled=self._kv_puller is not None, stream=params.stream)
        sampling = self._sampling(params, len(prompt_ids), param)
        ex = self._exchange(request, kind, params, prompt_ids, sampling)
        external = None
        if side is KVSide.DECODE and self._kv_puller is not None and params.kv_transfer_params:
            external = await self._kv_puller.pull(params.kv_transfer_params, prompt_ids, lora)
        generation = GenerationRequest(ex.id, prompt_ids, sampling, lora_name=lora, cache_salt=params.cache_salt,
                                       hold_kv=side is KVSide.PREFILL, external_kv=external)
        first, outputs = await self._start(ex, generation)
        if params.stream:
            return _ClosingStreamingResponse(
                self._stream(ex, first, outputs),
                on_close=lambda: self._close(ex, outputs),
            )
        return await self._answer_whole(request, ex, first, outputs)

    def _exchange(self, request: Request, kind: Kind, params: GenerationParams, prompt_ids: list[int],
                  sampling: SamplingParams) -> _Exchange:
        return _Exchange(
            kind=kind,
            id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
            created=int(self._runtime.clock.time()),
            # The name the client used (an adapter's included), as OpenAI and vLLM echo it.
            model=params.model,
            prompt_tokens=len(prompt_ids),
            arrival=time.perf_counter(),
            include_usage=params.include_usage,
            logprobs=sampling.logprobs,
            token_texts=self._texts() if sampling.logprobs is not None else None,
            tokens_as_ids=bool(params.return_tokens_as_token_ids),
            prompt_ids=list(prompt_ids) if params.return_token_ids else None,
            key=request.headers.get(HEADER_REQUEST_ID),
        )

    async def _start(
        self, ex: _Exchange, generation: GenerationRequest
    ) -> tuple[GenerationOutput, AsyncGenerator[GenerationOutput, None]]:
        """The generation's first output and the rest; the request counts as in flight."""
        lifecycle = self._runtime.lifecycle
        # No await between this check and request_started(): a drain that begins
        # afterwards is guaranteed to wait for this request.
        if not lifecycle.accepting:
            code = "draining" if self._runtime.draining else "not_ready"
            raise UnavailableError(f"this node is {lifecycle.phase}; retry on another node",
                                   code=code)
        lifecycle.request_started()
        outputs = self._engine.generate(generation)
        if self._tracing.enabled:
            outputs = traced(outputs, self._tracing.tracer("meridian.engine"), generation, self._settings.engine)
        try:
            # Wait for the first token before answering, so that an overloaded or
            # failing engine still gets a proper status the router can fail over on.
            first = await anext(outputs)
        except BaseException:
            self._journal_end(ex, completed=False)
            lifecycle.request_finished()
            await outputs.aclose()
            raise
        return first, outputs

    async def _answer_whole(
        self, request: Request, ex: _Exchange, first: GenerationOutput,
        outputs: AsyncGenerator[GenerationOutput, None],
    ) -> Response:
        try:
            texts, logprobs, token_ids = await self._collect_unless_disconnected(request, ex, first, outputs)
            if ex.finish_reason == "abort":
                raise UnavailableError("the request was aborted before it finished", code="aborted")
            # A router that gave up on this node (its read timeout, while the node was paused
            # or slow) has retried elsewhere: an answer nobody reads must not count as served.
            await asyncio.sleep(0)
            if await request.is_disconnected():
                raise ClientClosedError()
            response = self._full_response(ex, "".join(texts), logprobs, token_ids)
            # Journalled before the answer's bytes go out: a client that got the answer then
            # always finds it served, even if the node dies right after sending it.
            self._journal_end(ex, completed=True)
        except BaseException:
            self._journal_end(ex, completed=False)
            raise
        finally:
            await self._close(ex, outputs)
        body = response.model_dump(mode="json")
        if ex.kv_hold is not None:
            body["kv_transfer_params"] = prefill_answer(self._settings, ex.kv_hold)
        return JSONResponse(body)

    def _journal_end(self, ex: _Exchange, *, completed: bool) -> None:
        if ex.key is not None and not ex.journalled:
            ex.journalled = True
            self._journal.served(ex.key, self._settings.node_id, completed, prefill=ex.kv_hold is not None)

    def _observe(self, ex: _Exchange, out: GenerationOutput) -> None:
        ex.completion_tokens = out.completion_tokens
        if ex.cached_tokens is None:
            ex.cached_tokens = out.cached_tokens
        if out.token_ids:
            now = time.perf_counter()
            if ex.first_token_at is None:
                ex.first_token_at = now
                self._metrics.time_to_first_token.observe(now - ex.arrival)
            elif ex.last_token_at is not None:
                # One output can carry several tokens; spread the gap over them.
                gap = (now - ex.last_token_at) / len(out.token_ids)
                for _ in out.token_ids:
                    self._metrics.inter_token_latency.observe(gap)
            ex.last_token_at = now
        if out.finish_reason is not None:
            ex.finish_reason = out.finish_reason
        if out.kv_hold is not None:
            ex.kv_hold = out.kv_hold

    async def _close(
        self, ex: _Exchange, outputs: AsyncGenerator[GenerationOutput, None]
    ) -> None:
        """Release the request: abort it in the engine if unfinished, record the outcome."""
        reason = ex.finish_reason or "abort"
        # A stream whose client went away mid-way ends here without reaching [DONE].
        self._journal_end(ex, completed=False)
        self._metrics.request_finished(reason)
        if reason != "abort":
            self._metrics.request_completed(time.perf_counter() - ex.arrival)
        self._runtime.lifecycle.request_finished()
        await outputs.aclose()

    async def _collect_unless_disconnected(
        self,
        request: Request,
        ex: _Exchange,
        first: GenerationOutput,
        outputs: AsyncGenerator[GenerationOutput, None],
    ) -> tuple[list[str], list[TokenLogprob], list[int]]:
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        token_ids: list[int] = []

        async def collect() -> None:
            out: GenerationOutput | None = first
            while out is not None:
                self._observe(ex, out)
                texts.append(out.text)
                token_ids.extend(out.token_ids)
                if out.logprobs:
                    logprobs.extend(out.logprobs)
                if out.finish_reason is not None:
                    return
                out = await anext(outputs, None)

        try:
            await unless_disconnected(request, collect())
        except ClientClosedError:
            # Nobody will read the answer: its generation was stopped.
            ex.finish_reason = None
            raise
        return texts, logprobs, token_ids

    def _chat_logprobs(self, ex: _Exchange, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if ex.logprobs is None or ex.token_texts is None:
            return None
        return ChatLogprobs(content=chat_logprobs(
            entries, ex.logprobs, ex.token_texts, as_ids=ex.tokens_as_ids))

    def _full_response(
        self, ex: _Exchange, text: str, logprobs: list[TokenLogprob], token_ids: list[int]
    ) -> BaseModel:
        finish: OpenAIFinish = "length" if ex.finish_reason == "length" else "stop"
        ids = token_ids if ex.prompt_ids is not None else None
        if ex.kind == "chat":
            choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish,
                                logprobs=self._chat_logprobs(ex, logprobs), token_ids=ids)
            return ChatCompletionResponse(
                id=ex.id, created=ex.created, model=ex.model, choices=[choice], usage=ex.usage(),
                prompt_token_ids=ex.prompt_ids,
            )
        lp = None
        if ex.token_texts is not None:
            lp = completion_logprobs(logprobs, ex.token_texts, as_ids=ex.tokens_as_ids)
        return CompletionResponse(
            id=ex.id, created=ex.created, model=ex.model,
            choices=[CompletionChoice(text=text, finish_reason=finish, logprobs=lp,
                                      prompt_token_ids=ex.prompt_ids, token_ids=ids)],
            usage=ex.usage(),
        )

    def _chunk(
        self,
        ex: _Exchange,
        text: str | None,
        finish: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """One SSE chunk; `token_ids` (with return_token_ids) are the ids generated in it."""
        fr = _openai_finish(finish)
        if ex.kind == "chat":
            delta: dict[str, str] = {}
            if text is not None:
                delta["content"] = text
            chat_lp = self._chat_logprobs(ex, logprobs) if logprobs else None
            chunk: BaseModel = ChatCompletionChunk(
                id=ex.id, created=ex.created, model=ex.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=fr, logprobs=chat_lp,
                                         token_ids=token_ids)],
            )
        else:
            lp = None
            if logprobs and ex.token_texts is not None:
                # Offsets continue from the text already streamed, as vLLM's do.
                lp = completion_logprobs(logprobs, ex.token_texts, ex.streamed_chars,
                                         as_ids=ex.tokens_as_ids)
            ex.streamed_chars += len(text or "")
            # The prompt's ids ride on the first chunk only, as vLLM sends them.
            prompt_ids, ex.prompt_ids = ex.prompt_ids, None
            chunk = CompletionResponse(
                id=ex.id, created=ex.created, model=ex.model,
                choices=[CompletionChoice(text=text or "", finish_reason=fr, logprobs=lp,
                                          prompt_token_ids=prompt_ids, token_ids=token_ids)],
            )
        # With include_usage every chunk carries "usage": null, as OpenAI's do.
        return _sse(chunk.model_dump(mode="json", exclude=None if ex.include_usage else {"usage"}))

    async def _stream(
        self,
        ex: _Exchange,
        first: GenerationOutput,
        outputs: AsyncGenerator[GenerationOutput, None],
    ) -> AsyncIterator[bytes]:
        if ex.kind == "chat":
            yield self._role_chunk(ex)
        try:
            async for chunk in self._stream_outputs(ex, first, outputs):
                yield chunk
        except EngineError as exc:
            # Headers are gone already; the error travels as an event, as vLLM sends it.
            yield _sse(openai_error(str(exc), type_="server_error"))
        except Exception:
            log.exception("request %s failed while streaming", ex.id)
            yield _sse(openai_error("The server had an internal error.", type_="server_error"))
        finished = ex.finish_reason in ("stop", "length")
        if ex.include_usage and finished:
            yield self._usage_chunk(ex)
        # Before [DONE], the bytes that make the stream complete for its client.
        self._journal_end(ex, completed=finished)
        yield SSE_DONE

    def _role_chunk(self, ex: _Exchange) -> bytes:
        # vLLM's role chunk: the prompt's ids at the top level, no token_ids in the choice.
        role = ChatCompletionChunk(
            id=ex.id, created=ex.created, model=ex.model,
            choices=[ChatChunkChoice(delta={"role": "assistant", "content": ""})],
            prompt_token_ids=ex.prompt_ids,
        )
        return _sse(role.model_dump(mode="json", exclude=None if ex.include_usage else {"usage"}))

    async def _stream_outputs(
        self, ex: _Exchange, first: GenerationOutput, outputs: AsyncGenerator[GenerationOutput, None],
    ) -> AsyncIterator[bytes]:
        """The chunks of the engine's outputs, up to the one that finishes the generation."""
        with_ids = ex.prompt_ids is not None
        out: GenerationOutput | None = first
        while out is not None:
            self._observe(ex, out)
            if out.finish_reason == "abort":
                yield _sse(openai_error("the request was aborted before it finished",
                                        type_="service_unavailable", code="aborted"))
                return
            if with_ids:
                # One chunk per output, as vLLM's: its ids, its text (maybe none yet, or
                # none ever: a stop string's), its logprobs and its finish together.
                yield self._chunk(ex, out.text, out.finish_reason, out.logprobs, list(out.token_ids))
            else:
                # Every token's logprobs go out once: with its text, or on their own when
                # the token has none yet (half a character), or with the finish chunk.
                pending = out.logprobs if ex.logprobs is not None else None
                if out.text or (pending and out.finish_reason is None):
                    yield self._chunk(ex, out.text, None, pending)
                    pending = None
                if out.finish_reason is not None:
                    yield self._chunk(ex, None if ex.kind == "chat" else "", out.finish_reason, pending)
            if out.finish_reason is not None:
                return
            out = await anext(outputs, None)

    def _usage_chunk(self, ex: _Exchange) -> bytes:
        usage_chunk: BaseModel
        if ex.kind == "chat":
            usage_chunk = ChatCompletionChunk(id=ex.id, created=ex.created, model=ex.model, choices=[],
                                              usage=ex.usage())
        else:
            usage_chunk = CompletionResponse(id=ex.id, created=ex.created, model=ex.model, choices=[],
                                             usage=ex.usage())
        return _sse(usage_chunk)
