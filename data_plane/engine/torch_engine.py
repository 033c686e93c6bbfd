"""The built-in CPU/GPU engine: the torch Llama run by one dedicated worker thread.

The event loop never touches the model. Requests reach the worker through a
thread-safe inbox; the worker advances every running sequence by one step per
iteration (round robin) and hands each output back to the loop with
call_soon_threadsafe, where the request's asyncio.Queue feeds its consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_plane.engine.base import (
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequestError,
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    served_model_name,
)
from data_plane.engine.stop_strings import StopStringMatcher
from data_plane.model.llama import KVCache, LlamaForCausalLM
from data_plane.model.loader import load_model
from data_plane.sampling import make_generator, sample_next
from data_plane.tokenizer import ChatTokenizer, IncrementalDetokenizer
from meridian.settings import NodeSettings

log = logging.getLogger(__name__)

_Item = GenerationOutput | BaseException


@dataclass(eq=False)
class _Sequence:
    """A request's state; owned by the worker thread once submitted."""

    request: GenerationRequest
    outbox: asyncio.Queue[_Item]
    detokenizer: IncrementalDetokenizer
    stopper: StopStringMatcher
    generator: torch.Generator | None = None
    cache: KVCache | None = None
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Add:
    seq: _Sequence


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class TorchEngine:
    """Engine protocol implementation over data_plane.model.llama."""

    def __init__(self, settings: NodeSettings) -> None:
        if settings.model_dir is None:
            raise ValueError("the torch engine needs settings.model_dir")
        self._settings = settings
        self._model_dir = Path(settings.model_dir)
        self._model_name = served_model_name(settings)
        self._max_model_len = settings.max_model_len
        self._model: LlamaForCausalLM | None = None
        self._tokenizer: ChatTokenizer | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ready = False
        self._active_ids: set[str] = set()
        # Worker-thread state.
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[str, _Sequence] = {}
        # Counters are written by the worker (and `waiting` by the loop), read by stats().
        self._lock = threading.Lock()
        self._num_waiting = 0
        self._num_running = 0
        self._kv_tokens = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_total = 0
        self._aborted_total = 0

    # --- Engine protocol -------------------------------------------------------------

    async def start(self) -> None:
        """Load model and tokenizer on the worker thread and start its loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        loaded: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._worker, args=(loaded,), name=f"torch-engine-{self._model_name}",
            daemon=True,
        )
        self._thread.start()
        try:
            await loaded
        except BaseException:
            self._inbox.put(_Stop())
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None
            raise
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(thread.join, 30.0)
        if not thread.is_alive():
            # A request submitted while the worker was exiting would otherwise wait forever.
            self._abort_all()

    async def generate(
        self, request: GenerationRequest
    ) -> AsyncGenerator[GenerationOutput, None]:
        seq = self._submit(request)
        finished = False
        try:
            while True:
                item = await seq.outbox.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._active_ids.discard(request.request_id)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        budget = self._settings.max_num_seqs * self._max_model_len
        with self._lock:
            return EngineStats(
                running=self._num_running,
                waiting=self._num_waiting,
                kv_cache_usage=min(1.0, self._kv_tokens / budget),
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
                requests_finished_total=self._finished_total,
                requests_aborted_total=self._aborted_total,
            )

    def models(self) -> list[str]:
        return [self._model_name]

    def get_tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise EngineNotReadyError("the engine has not loaded its tokenizer yet")
        return self._tokenizer

    # --- event-loop side ---------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> _Sequence:
        if not self._ready or self._tokenizer is None:
            raise EngineNotReadyError("the engine is not running")
        params = request.sampling_params
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise EngineRequestError("the prompt is empty")
        if params.max_tokens < 1:
            raise EngineRequestError("max_tokens must be at least 1")
        if n_prompt + params.max_tokens > self._max_model_len:
            raise EngineRequestError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum context length {self._max_model_len}"
            )
        if request.request_id in self._active_ids:
            raise EngineRequestError(f"request id {request.request_id!r} is already running")
        with self._lock:
            if self._num_waiting >= self._settings.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self._num_waiting} requests are already waiting; try again later"
                )
            self._num_waiting += 1
        seq = _Sequence(
            request=request,
            outbox=asyncio.Queue(),
            detokenizer=self._tokenizer.detokenizer(),
            stopper=StopStringMatcher(params.stop),
        )
        self._active_ids.add(request.request_id)
        self._inbox.put(_Add(seq))
        return seq

    def _deliver(self, seq: _Sequence, item: _Item) -> None:
        assert self._loop is not None
        # The loop may already be closed at interpreter shutdown: nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(seq.outbox.put_nowait, item)

    # --- worker thread -----------------------------------------------------------------

    def _worker(self, loaded: asyncio.Future[None]) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            self._model = load_model(
                self._model_dir, dtype=self._settings.dtype, device=self._settings.device
            )
            self._tokenizer = ChatTokenizer.from_dir(self._model_dir)
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            with contextlib.suppress(RuntimeError):  # the loop may be gone already
                loop.call_soon_threadsafe(_set_exception, loaded, exc)
            return
        eos = set(self._model.config.eos_token_ids)
        if self._tokenizer.eos_token_id is not None:
            eos.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_result, loaded)
        log.info("loaded %s from %s", self._model_name, self._model_dir)
        try:
            self._serve()
        finally:
            self._abort_all()
            self._model = None

    def _serve(self) -> None:
        while True:
            idle = not self._waiting and not self._running
            if not self._drain_inbox(block=idle):
                return
            while self._waiting and len(self._running) < self._settings.max_num_seqs:
                seq = self._waiting.popleft()
                self._running[seq.request.request_id] = seq
                with self._lock:
                    self._num_waiting -= 1
            self._update_gauges()
            for seq in list(self._running.values()):
                self._step(seq)
            self._update_gauges()

    def _drain_inbox(self, *, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._waiting.append(cmd.seq)
            else:
                self._abort(cmd.request_id)

    def _abort(self, request_id: str) -> None:
        seq = self._running.get(request_id)
        if seq is None:
            seq = next((s for s in self._waiting if s.request.request_id == request_id), None)
            if seq is None:
                return
        self._finish(seq, [], "", "abort")

    def _step(self, seq: _Sequence) -> None:
        assert self._model is not None
        model = self._model
        params = seq.request.sampling_params
        try:
            if seq.cache is None:
                prompt = seq.request.prompt_token_ids
                seq.cache = model.new_cache(len(prompt) + params.max_tokens)
                seq.generator = make_generator(params.seed, model.device)
                ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
                positions = torch.arange(len(prompt), device=model.device)
                with self._lock:
                    self._prompt_tokens_total += len(prompt)
            else:
                ids = torch.tensor(seq.output_ids[-1:], dtype=torch.long, device=model.device)
                positions = torch.tensor([seq.cache.length], device=model.device)
            logits = model(ids, positions, seq.cache)
            assert seq.generator is not None
            token = sample_next(
                logits, temperature=params.temperature, top_p=params.top_p,
                generator=seq.generator,
            )
        except Exception as exc:
            log.exception("request %s failed", seq.request.request_id)
            self._remove(seq)
            self._deliver(seq, exc)
            return

        seq.output_ids.append(token)
        with self._lock:
            self._generation_tokens_total += 1
        finish: FinishReason | None = None
        text = ""
        # The text of a token that ends the sequence is not part of the answer.
        if (token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            finish = "stop"
        else:
            text, stopped = seq.stopper.feed(seq.detokenizer.push(token))
            if stopped:
                finish = "stop"
        if finish is None and len(seq.output_ids) >= params.max_tokens:
            finish = "length"
        if finish is None:
            self._deliver(seq, self._output(seq, [token], text, None))
            return
        if seq.stopper.matched is None:
            tail, stopped = seq.stopper.feed(seq.detokenizer.flush())
            text += tail if stopped else tail + seq.stopper.flush()
        self._finish(seq, [token], text, finish)

    def _output(
        self, seq: _Sequence, tokens: list[int], text: str, finish: FinishReason | None
    ) -> GenerationOutput:
        return GenerationOutput(
            request_id=seq.request.request_id,
            token_ids=tokens,
            text=text,
            finish_reason=finish,
            prompt_tokens=len(seq.request.prompt_token_ids),
            completion_tokens=len(seq.output_ids),
        )

    def _finish(
        self, seq: _Sequence, tokens: list[int], text: str, reason: FinishReason
    ) -> None:
        self._remove(seq)
        # Gauges must already exclude this request when its consumer sees it finish,
        # not only at the end of the step.
        self._update_gauges()
        with self._lock:
            if reason == "abort":
                self._aborted_total += 1
            else:
                self._finished_total += 1
        self._deliver(seq, self._output(seq, tokens, text, reason))

    def _remove(self, seq: _Sequence) -> None:
        rid = seq.request.request_id
        if self._running.get(rid) is seq:
            del self._running[rid]
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
                with self._lock:
                    self._num_waiting -= 1
        seq.cache = None  # frees the KV memory now, not when the consumer lets go

    def _update_gauges(self) -> None:
        kv = sum(s.cache.length for s in self._running.values() if s.cache is not None)
        with self._lock:
            self._num_running = len(self._running)
            self._kv_tokens = kv

    def _abort_all(self) -> None:
        """Finish every known request as aborted, including those still in the inbox."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._waiting.append(cmd.seq)
        for seq in [*self._waiting, *self._running.values()]:
            self._finish(seq, [], "", "abort")


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
