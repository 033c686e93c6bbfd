"""Iteration-level scheduling with a per-step token budget (continuous batching and
Dynamic SplitFuse chunked prefill).

Every step the scheduler decides which sequences run and how many of their tokens:

1. Running decodes first, oldest first, one token each: they are cheap and their
   inter-token latency is what users feel.
2. Then prefill work fills what is left of the budget: prompts of running sequences
   not yet fully computed and new (or preempted) ones admitted from the waiting
   queue, shortest remaining first. A short new prompt therefore gets its first token
   in the very next step even while a long one is being chunked, and a long prompt
   already under way finishes before a new long one. With chunked prefill on, a
   prompt longer than the budget is split across steps and each chunk is fused with
   the running decodes; with it off, a prompt runs whole in one step (the budget is
   raised to max_model_len, as vLLM requires).
3. A request handed another node's prompt KV (prefill/decode disaggregation) is admitted
   with blocks for that KV too: the step writes it in (`imports`) and computes only
   what is left, at least the last prompt token, whose logits are sampled, as after a
   prefix-cache hit.
4. When the KV cache has no block for a running sequence, the newest running
   sequence is preempted by recompute: its blocks are freed (full ones stay in the
   prefix cache, so recomputing is often cheap) and it goes back to the front of the
   waiting queue with its generated tokens kept. Nothing crashes and nothing is lost.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.engine.kv_cache.block_pool import Block
from data_plane.engine.kv_cache.manager import KVCacheManager
from data_plane.engine.kv_transfer.payload import KVPayload
from data_plane.engine.sequence import SeqStatus, Sequence


class LoraSlots(Protocol):
    """What the scheduler needs from the LoRA manager: bounded resident adapters."""

    def can_acquire(self, name: str) -> bool: ...

    def acquire(self, name: str) -> int: ...

    def release(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True

    @property
    def token_budget(self) -> int:
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class KVImport:
    """Another node's KV for tokens [start, start + num_tokens) of a sequence, to be
    written into its blocks before this step's forward pass."""

    seq: Sequence
    start: int
    num_tokens: int
    payload: KVPayload


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    imports: list[KVImport] = field(default_factory=list)

    def alone(self, chunk: ScheduledChunk) -> SchedulerOutput:
        """One chunk of this step as a step of its own (with its sequence's import)."""
        return SchedulerOutput(chunks=[chunk], imports=[i for i in self.imports if i.seq is chunk.seq])

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owned by the engine's worker thread."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, lora: LoraSlots | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.lora = lora
        self.waiting: deque[Sequence] = deque()
        # Sorted by arrival: the oldest are served first and preempted last.
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue management ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its blocks and adapter."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def detach(self, seq: Sequence) -> list[Block]:
        """Take a running sequence out, handing its blocks to the caller (who frees them
        later) instead of freeing them; its adapter is released."""
        blocks, seq.blocks = seq.blocks, []
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        return blocks

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq.lora_name is not None and self.lora is not None and seq.lora_slot >= 0:
            self.lora.release(seq.lora_name)
            seq.lora_slot = -1

    # --- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        scheduled: set[int] = set()

        for seq in list(self.running):
            if budget < 1:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_remaining != 1:
                continue
            if self._allocate_or_preempt(seq, 1, scheduled, out):
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
                scheduled.add(id(seq))
                budget -= 1

        candidates = [s for s in self.running if s.num_remaining > 1 and id(s) not in scheduled]
        candidates.extend(self.waiting)
        candidates.sort(key=lambda s: (s.num_remaining, s.arrival))
        for seq in candidates:
            if budget < 1:
                break
            if any(p is seq for p in out.preempted):
                continue  # do not readmit in the step that evicted it
            if seq.status is SeqStatus.RUNNING:
                n = self._chunk_size(seq.num_remaining, budget)
                if n and self._allocate_or_preempt(seq, n, scheduled, out):
                    out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    scheduled.add(id(seq))
                    budget -= n
            elif seq.status is SeqStatus.WAITING:
                n = self._admit(seq, budget, out)
                if n:
                    out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    scheduled.add(id(seq))
                    budget -= n
        return out

    def _chunk_size(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Move a waiting sequence to running with its first chunk allocated; 0 if it cannot."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        if seq.lora_name is not None:
            if self.lora is None or not self.lora.can_acquire(seq.lora_name):
                return 0
        hits = self.kv.find_cached_prefix(seq)
        hit_tokens = len(hits) * self.kv.block_size
        imported = self._importable(seq, hit_tokens)
        remaining = seq.num_remaining - hit_tokens - imported
        n = self._chunk_size(remaining, budget)
        if n == 0 or not self.kv.allocate(seq, imported + n, hits):
            return 0
        if seq.cached_prompt_tokens < 0:
            seq.cached_prompt_tokens = hit_tokens
            self.kv.record_prefix_query(seq, seq.cached_prompt_tokens)
        if seq.pending_kv is not None:
            # Counted as vLLM counts a remote prefill: every transferred prompt token past
            # the local hit, the last one included although it runs again.
            supplied = min(seq.pending_kv.num_tokens, seq.num_prompt_tokens)
            seq.external_prompt_tokens = max(0, supplied - hit_tokens)
            if imported:
                out.imports.append(KVImport(seq, seq.num_computed_tokens, imported, seq.pending_kv))
                seq.num_computed_tokens += imported
            seq.pending_kv = None
        if seq.lora_name is not None and self.lora is not None:
            seq.lora_slot = self.lora.acquire(seq.lora_name)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        keys = [s.arrival for s in self.running]
        self.running.insert(bisect.bisect(keys, seq.arrival), seq)
        return n

    @staticmethod
    def _importable(seq: Sequence, hit_tokens: int) -> int:
        """Tokens of another node's KV to write in, past the local hit, short of the last."""
        if seq.pending_kv is None:
            return 0
        return max(0, min(seq.pending_kv.num_tokens, seq.num_tokens - 1) - hit_tokens)

    def _allocate_or_preempt(
        self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Allocate n slots for a running sequence, preempting newer ones if needed.

        Returns False if the sequence itself had to be preempted (or cannot fit now).
        """
        while not self.kv.allocate(seq, n):
            victim = next(
                (s for s in reversed(self.running) if id(s) not in scheduled), None
            )
            if victim is None:
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran, and cache blocks that became full."""
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_computed_blocks(chunk.seq)
