"""The built-in CPU/GPU engine: the torch Llama over a paged KV cache with prefix
caching, continuous batching and chunked prefill, run by one dedicated worker thread.

The event loop never touches the model. Requests reach the worker through a
thread-safe inbox; each iteration the worker asks the scheduler for a step (decodes
plus prefill chunks within the token budget), runs it as one batched forward pass,
samples, and hands each output back to the loop with call_soon_threadsafe, where the
request's asyncio.Queue feeds its consumer. KV cache events of the step go to the
configured sink (a ZMQ publisher on nodes).

Prefill/decode disaggregation (data_plane.engine.kv_transfer): a `hold_kv` request's
blocks outlive it under a handle and a lease, until `take_kv` copies them out (one-shot)
or `release_kv` or the lease frees them; an `external_kv` request is admitted with that
KV written into its blocks, computing only its last prompt token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_plane.engine.admission import check_request
from data_plane.engine.base import (
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequestError,
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    KVEventSink,
    KVHold,
    TokenLogprob,
    served_model_name,
    warn_without_chat_template,
)
from data_plane.engine.kv_cache.manager import KVCacheManager
from data_plane.engine.kv_transfer.holds import HeldKV, Leases
from data_plane.engine.kv_transfer.payload import KVLayout, KVPayload, dtype_name
from data_plane.engine.model_runner import LoraBatchFactory, ModelRunner
from data_plane.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from data_plane.engine.sequence import SeqStatus, Sequence
from data_plane.engine.worker_inbox import Abort, Add, Client, Command, HeldKVCommand, Item, Stop
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.loader import load_model
from data_plane.model.paged_attention import PagedKVCache
from data_plane.sampling import Sampled, SamplingFailed, make_generator
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NodeCapability
from meridian.kv_events import AllBlocksCleared, KVEvent, KVEventBatch
from meridian.settings.node import NodeSettings
from meridian.stop_strings import StopStringMatcher
from meridian.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from data_plane.lora.manager import LoraManager

log = logging.getLogger(__name__)



def kv_cache_blocks(settings: NodeSettings, bytes_per_block: int) -> int:
    """Blocks of the paged KV cache: what the memory budget allows, but no more than
    every admitted sequence at full length needs (twice that, to keep a prefix cache)."""
    by_memory = settings.kv_cache_memory_bytes // bytes_per_block
    per_seq = -(-settings.max_model_len // settings.block_size)
    return max(1, min(by_memory, 2 * settings.max_num_seqs * per_seq))


class TorchEngine:
    """Engine protocol implementation over data_plane.model.llama."""

    def __init__(self, settings: NodeSettings, *, clock: Clock = SYSTEM_CLOCK) -> None:
        if settings.model_dir is None:
            raise ValueError("the torch engine needs settings.model_dir")
        self._settings = settings
        # The node's clock: the times of KV events.
        self._clock = clock
        self._model_dir = Path(settings.model_dir)
        self._model_name = served_model_name(settings)
        self._max_model_len = settings.max_model_len
        self._model: LlamaForCausalLM | None = None
        self._tokenizer: ChatTokenizer | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = False
        self._active_ids: set[str] = set()
        self._arrivals = itertools.count()
        self._sink: KVEventSink | None = None
        # Imported and built only when adapters are configured.
        self._lora: LoraManager | None = None
        self._capacity_tokens = 0
        # Worker-thread state, built once the model is loaded.
        self._scheduler: Scheduler | None = None
        self._kv: KVCacheManager | None = None
        self._runner: ModelRunner | None = None
        self._held: HeldKV | None = None
        self._leases = Leases(clock, settings.kv_lease_s, self.release_kv)
        # Counters are written by the worker (and `waiting` by the loop), read by stats().
        self._lock = threading.Lock()
        # Submitted but not yet taken from the inbox by the worker / queued in the scheduler.
        self._inbox_pending = 0
        self._sched_waiting = 0
        # Prompt tokens of those two: what a prefill pool scales on.
        self._inbox_prompt_tokens = 0
        self._sched_waiting_tokens = 0
        self._num_running = 0
        self._kv_usage = 0.0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_total = 0
        self._aborted_total = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        # Prompt tokens by source: computed, local prefix cache, another node's KV.
        self._prompt_by_source = [0, 0, 0]
        self._running_loras: tuple[str, ...] = ()
        self._waiting_loras: tuple[str, ...] = ()
        self._loaded_loras: tuple[str, ...] = ()

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
            self._inbox.put(Stop())
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None
            raise
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        self._leases.cancel_all()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._inbox.put(Stop())
        await asyncio.to_thread(thread.join, 30.0)
        if not thread.is_alive():
            # A request submitted while the worker was exiting would otherwise wait forever.
            self._abort_all()

    async def generate(
        self, request: GenerationRequest
    ) -> AsyncGenerator[GenerationOutput, None]:
        seq, client = self._submit(request)
        finished = False
        try:
            while True:
                item = await client.outbox.get()
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
        self._inbox.put(Abort(request_id))

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                running=self._num_running,
                waiting=self._inbox_pending + self._sched_waiting,
                kv_cache_usage=self._kv_usage,
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
                requests_finished_total=self._finished_total,
                requests_aborted_total=self._aborted_total,
                prefix_cache_queries_total=self._prefix_queries,
                prefix_cache_hits_total=self._prefix_hits,
                num_preemptions_total=self._preemptions,
                prompt_tokens_local_compute_total=self._prompt_by_source[0],
                prompt_tokens_local_cache_hit_total=self._prompt_by_source[1],
                prompt_tokens_external_kv_transfer_total=self._prompt_by_source[2],
                waiting_prompt_tokens=self._inbox_prompt_tokens + self._sched_waiting_tokens,
                running_loras=self._running_loras,
                waiting_loras=self._waiting_loras,
                loaded_loras=self._loaded_loras,
                max_loras=self._settings.max_loras if self._lora is not None else 0,
            )

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        self._sink = sink

    def capabilities(self) -> tuple[NodeCapability, ...]:
        # It refuses include_stop_str_in_output (it holds back only a real stop string's
        # start) and add_special_tokens on a chat: neither applies.
        return ()

    def max_num_seqs(self) -> int:
        return self._settings.max_num_seqs

    def models(self) -> list[str]:
        return [self._model_name]

    def lora_adapters(self) -> list[str]:
        return list(self._lora.names()) if self._lora is not None else []

    def get_tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise EngineNotReadyError("the engine has not loaded its tokenizer yet")
        return self._tokenizer

    # --- KV transfer (prefill/decode) ---------------------------------------------------

    def kv_layout(self) -> KVLayout:
        """What this engine's KV looks like (valid once started)."""
        if self._held is None:
            raise EngineNotReadyError("the engine has not loaded its model yet")
        return self._held.layout

    async def take_kv(self, handle: str) -> KVPayload | None:
        """A held handle's KV, copied out, and the handle released; None if unknown."""
        result = await self._held_command(handle, export=True)
        return result if isinstance(result, KVPayload) else None

    async def release_kv(self, handle: str) -> bool:
        """Free a held handle's blocks; False if it is unknown (taken, released, expired)."""
        return await self._held_command(handle, export=False) is True

    async def _held_command(self, handle: str, *, export: bool) -> KVPayload | bool | None:
        if not self._ready or self._loop is None:
            return None
        self._leases.cancel(handle)
        done: asyncio.Future[KVPayload | bool | None] = self._loop.create_future()
        self._inbox.put(HeldKVCommand(handle, export, done))
        return await done

    # --- event-loop side ---------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> tuple[Sequence, Client]:
        if not self._ready or self._tokenizer is None or self._model is None:
            raise EngineNotReadyError("the engine is not running")
        check_request(request, max_model_len=self._max_model_len, capacity_tokens=self._capacity_tokens,
                      vocab_size=self._model.config.vocab_size)
        n_prompt = len(request.prompt_token_ids)
        params = request.sampling_params
        if request.lora_name is not None and self._lora is None:
            raise EngineRequestError(f"unknown LoRA adapter {request.lora_name!r}")
        if request.request_id in self._active_ids:
            raise EngineRequestError(f"request id {request.request_id!r} is already running")
        external = request.external_kv
        if external is not None and not isinstance(external, KVPayload):
            raise EngineRequestError(f"the torch engine takes another node's KV as a KVPayload, not {type(external).__name__}")
        with self._lock:
            waiting = self._inbox_pending + self._sched_waiting
            if waiting >= self._settings.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{waiting} requests are already waiting; try again later"
                )
            self._inbox_pending += 1
            self._inbox_prompt_tokens += n_prompt
        client = Client(
            outbox=asyncio.Queue(),
            # Decoded in the prompt's context: a continued generation reads as the unbroken one.
            detokenizer=self._tokenizer.detokenizer(context=request.prompt_token_ids),
            stopper=StopStringMatcher(params.stop),
        )
        seq = Sequence(
            request=request, arrival=next(self._arrivals),
            token_ids=list(request.prompt_token_ids), sink=client, pending_kv=external,
        )
        self._active_ids.add(request.request_id)
        self._inbox.put(Add(seq))
        return seq, client

    def _deliver(self, seq: Sequence, item: Item) -> None:
        assert self._loop is not None
        client: Client = seq.sink
        # The loop may already be closed at interpreter shutdown: nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(client.outbox.put_nowait, item)

    # --- worker thread -----------------------------------------------------------------

    def _worker(self, loaded: asyncio.Future[None]) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            with contextlib.suppress(RuntimeError):  # the loop may be gone already
                loop.call_soon_threadsafe(_set_exception, loaded, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_result, loaded)
        try:
            self._serve()
        finally:
            self._abort_all()
            self._model = None

    def _load(self) -> None:
        s = self._settings
        model = load_model(self._model_dir, dtype=s.dtype, device=s.device)
        self._tokenizer = ChatTokenizer.from_dir(self._model_dir)
        warn_without_chat_template(self._tokenizer, self._model_name)
        eos = set(model.config.eos_token_ids)
        if self._tokenizer.eos_token_id is not None:
            eos.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos)
        per_block = PagedKVCache.bytes_per_block(model.config, s.block_size, model.dtype)
        num_blocks = kv_cache_blocks(s, per_block)
        cache = PagedKVCache(model.config, num_blocks, s.block_size, dtype=model.dtype,
                             device=model.device)
        self._kv = KVCacheManager(num_blocks, s.block_size, enable_caching=s.enable_prefix_caching)
        self._capacity_tokens = num_blocks * s.block_size
        lora_batch: LoraBatchFactory | None = None
        if s.lora_modules or s.lora_dir is not None:
            from data_plane.lora.batch import LoraBatch
            from data_plane.lora.manager import LoraManager

            lora_manager = LoraManager.from_settings(s, model.config, device=model.device,
                                                     dtype=model.dtype)
            self._lora = lora_manager

            def lora_batch(slots: list[int]) -> LoraBatch:
                return LoraBatch.build(lora_manager, slots, device=model.device)

        self._scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens,
                max_model_len=s.max_model_len,
                enable_chunked_prefill=s.enable_chunked_prefill,
            ),
            self._kv,
            self._lora,
        )
        self._runner = ModelRunner(model, cache, lora_batch)
        self._held = HeldKV(self._kv, cache, KVLayout(
            model=self._model_name, dtype=dtype_name(model.dtype),
            num_layers=model.config.num_hidden_layers, num_kv_heads=model.config.num_key_value_heads,
            head_dim=model.config.head_dim, block_size=s.block_size,
        ))
        self._model = model
        # A (re)started node holds nothing: consumers drop what they knew of it.
        self._publish([AllBlocksCleared()])
        log.info("loaded %s from %s: %d KV blocks of %d tokens (%.1f MiB)", self._model_name,
                 self._model_dir, num_blocks, s.block_size, num_blocks * per_block / 2**20)

    def _serve(self) -> None:
        assert self._scheduler is not None and self._runner is not None
        scheduler = self._scheduler
        while True:
            if not self._drain_inbox(block=not scheduler.has_work()):
                return
            if not scheduler.has_work():
                continue
            step = scheduler.schedule()
            if not step.chunks:
                # Everything waits on a resource (an adapter slot); wait for a command.
                if not self._drain_inbox(block=True, timeout=0.05):
                    return
                continue
            self._run_step(step)

    def _run_step(self, step: SchedulerOutput) -> None:
        assert self._runner is not None
        try:
            results = self._runner.execute(step)
        except Exception as exc:
            if len(step.chunks) > 1:
                # One sequence may have broken the batch: run each chunk on its own so that
                # only the culprit fails, never its neighbours (other tenants' included).
                # Re-running a chunk rewrites the same KV slots; nothing was sampled yet.
                log.warning("engine step of %d requests failed (%s); retrying each alone",
                            len(step.chunks), exc)
                self._run_alone(step)
                return
            log.exception("engine step failed for request %s", step.chunks[0].seq.request_id)
            self._fail(step.chunks[0].seq, exc)
            return
        self._apply(step, results)

    def _apply(self, step: SchedulerOutput, results: list[tuple[ScheduledChunk, Sampled | SamplingFailed]]) -> None:
        assert self._scheduler is not None and self._kv is not None
        self._scheduler.update(step)
        # Consumers may read stats as soon as they see this step's tokens.
        self._update_gauges()
        for chunk, sampled in results:
            if isinstance(sampled, SamplingFailed):
                self._fail(chunk.seq, EngineRequestError(f"sampling failed: {sampled.reason}"))
            else:
                self._append_token(chunk.seq, sampled)
        self._publish(self._kv.take_events())

    def _run_alone(self, step: SchedulerOutput) -> None:
        """Run a failed step's chunks one by one. A chunk that still fails while others
        succeed is its own request's doing, and fails as a request error (a 400)."""
        assert self._runner is not None
        failed: list[tuple[Sequence, Exception]] = []
        for chunk in step.chunks:
            alone = step.alone(chunk)
            try:
                results = self._runner.execute(alone)
            except Exception as exc:  # noqa: BLE001 - attributed below
                failed.append((chunk.seq, exc))
                continue
            self._apply(alone, results)
        attributable = len(failed) < len(step.chunks)
        for seq, exc in failed:
            log.warning("request %s failed its engine step alone: %s", seq.request_id, exc)
            error: Exception = exc
            if attributable:
                error = EngineRequestError(f"the engine could not run this request: {exc}")
            self._fail(seq, error)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """End one request with an error; the rest of the batch carries on."""
        assert self._scheduler is not None and self._kv is not None
        if seq.status is not SeqStatus.FINISHED:
            self._scheduler.finish(seq)
            self._deliver(seq, exc)
        self._update_gauges()
        self._publish(self._kv.take_events())

    def _append_token(self, seq: Sequence, sampled: Sampled) -> None:
        client: Client = seq.sink
        params = seq.params
        token = sampled.token_id
        seq.token_ids.append(token)
        with self._lock:
            self._generation_tokens_total += 1
            # Counted once per request, cached prefix included, as vLLM counts them (not
            # per computed chunk, which would count a preempted request's recompute again).
            if seq.num_output_tokens == 1:
                self._prompt_tokens_total += seq.num_prompt_tokens
                local, external = max(0, seq.cached_prompt_tokens), seq.external_prompt_tokens
                by_source = (seq.num_prompt_tokens - local - external, local, external)
                self._prompt_by_source = [a + b for a, b in zip(self._prompt_by_source, by_source, strict=True)]
        finish: FinishReason | None = None
        text = ""
        # The text of a token that ends the sequence is not part of the answer.
        if (token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            finish = "stop"
        else:
            text, stopped = client.stopper.feed(client.detokenizer.push(token))
            if stopped:
                finish = "stop"
        if finish is None and seq.num_output_tokens >= params.max_tokens:
            finish = "length"
        logprobs = None
        if sampled.logprob is not None:
            logprobs = [TokenLogprob(token, sampled.logprob, sampled.top)]
        if finish is None:
            self._deliver(seq, self._output(seq, [token], text, None, logprobs))
            return
        if client.stopper.matched is None:
            tail, stopped = client.stopper.feed(client.detokenizer.flush())
            text += tail if stopped else tail + client.stopper.flush()
        self._finish(seq, [token], text, finish, logprobs)

    def _output(
        self,
        seq: Sequence,
        tokens: list[int],
        text: str,
        finish: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
        kv_hold: KVHold | None = None,
    ) -> GenerationOutput:
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=text,
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            logprobs=logprobs,
            cached_tokens=max(0, seq.cached_prompt_tokens) + seq.external_prompt_tokens,
            kv_hold=kv_hold,
        )

    def _drain_inbox(self, *, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, Stop):
                return False
            if isinstance(cmd, Add):
                assert self._scheduler is not None and self._model is not None
                with self._lock:
                    self._inbox_pending -= 1
                    self._inbox_prompt_tokens -= cmd.seq.num_prompt_tokens
                lora = cmd.seq.lora_name
                # Checked here, not on the event loop: the adapter directory is listed.
                if lora is not None and (self._lora is None or lora not in self._lora):
                    cmd.seq.status = SeqStatus.FINISHED
                    self._deliver(cmd.seq, EngineRequestError(f"unknown LoRA adapter {lora!r}"))
                    continue
                cmd.seq.generator = make_generator(cmd.seq.params.seed, self._model.device)
                self._scheduler.add(cmd.seq)
                self._update_gauges()
            elif isinstance(cmd, HeldKVCommand):
                self._held_kv(cmd)
            else:
                self._abort(cmd.request_id)

    def _held_kv(self, cmd: HeldKVCommand) -> None:
        assert self._held is not None and self._loop is not None
        result: KVPayload | bool | None = None
        try:
            result = self._held.export(cmd.handle) if cmd.export else self._held.release(cmd.handle)
        except Exception:
            log.exception("exporting KV %s failed; released", cmd.handle)
        self._update_gauges()
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_set_result, cmd.done, result)

    def _abort(self, request_id: str) -> None:
        assert self._scheduler is not None
        seq = self._scheduler.find(request_id)
        if seq is not None:
            self._finish(seq, [], "", "abort")
            assert self._kv is not None
            self._publish(self._kv.take_events())

    def _finish(
        self,
        seq: Sequence,
        tokens: list[int],
        text: str,
        reason: FinishReason,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        hold = None
        if self._scheduler is not None and self._scheduler.find(seq.request_id) is seq:
            if seq.request.hold_kv and reason != "abort" and seq.status is SeqStatus.RUNNING:
                hold = self._hold(seq)
            else:
                self._scheduler.finish(seq)
        seq.status = SeqStatus.FINISHED
        # Gauges must already exclude this request when its consumer sees it finish.
        self._update_gauges()
        with self._lock:
            if reason == "abort":
                self._aborted_total += 1
            else:
                self._finished_total += 1
        self._deliver(seq, self._output(seq, tokens, text, reason, logprobs, hold))

    def _hold(self, seq: Sequence) -> KVHold:
        """Keep a finished prefill request's prompt KV for the decode node, under a lease."""
        assert self._scheduler is not None and self._held is not None and self._loop is not None
        computed = seq.num_computed_tokens
        blocks = self._scheduler.detach(seq)
        hold = self._held.hold(blocks, seq.request.prompt_token_ids, computed, seq.lora_name)
        with contextlib.suppress(RuntimeError):
            # Queued before the output that names the handle: its lease runs before anyone can take it.
            self._loop.call_soon_threadsafe(self._leases.start, hold.handle)
        return hold

    def _update_gauges(self) -> None:
        sched = self._scheduler
        if sched is None or self._kv is None:
            return
        running = tuple(sorted({s.lora_name for s in sched.running if s.lora_name}))
        waiting = tuple(sorted({s.lora_name for s in sched.waiting if s.lora_name}))
        loaded = tuple(self._lora.resident()) if self._lora is not None else ()
        with self._lock:
            self._num_running = len(sched.running)
            self._sched_waiting = len(sched.waiting)
            self._sched_waiting_tokens = sum(s.num_remaining for s in sched.waiting)
            self._kv_usage = self._kv.usage()
            self._prefix_queries = self._kv.prefix_queries
            self._prefix_hits = self._kv.prefix_hits
            self._preemptions = sched.num_preemptions
            self._running_loras = running
            self._waiting_loras = waiting
            self._loaded_loras = loaded

    def _publish(self, events: list[KVEvent]) -> None:
        sink = self._sink
        if sink is None or not events:
            return
        try:
            sink.publish(KVEventBatch(ts=self._clock.time(), events=events))
        except Exception:  # a broken publisher must not take the engine down
            log.exception("publishing KV events failed")

    def _abort_all(self) -> None:
        """Finish every known request as aborted, including those still in the inbox."""
        pending: list[Sequence] = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Add):
                pending.append(cmd.seq)
                with self._lock:
                    self._inbox_pending -= 1
                    self._inbox_prompt_tokens -= cmd.seq.num_prompt_tokens
            elif isinstance(cmd, HeldKVCommand) and self._loop is not None:
                # The blocks go with the engine; whoever asked for them gets nothing.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(_set_result, cmd.done, None)
        if self._scheduler is not None:
            pending.extend(self._scheduler.waiting)
            pending.extend(self._scheduler.running)
        for seq in pending:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, [], "", "abort")


def _set_result(fut: asyncio.Future[Any], result: Any = None) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
