"""Turns one scheduler step into one batched forward pass over the paged KV cache, and
samples the next token of every sequence whose chunk reached its end."""

from __future__ import annotations

from collections.abc import Callable

import torch

from data_plane.engine.scheduler import KVImport, ScheduledChunk, SchedulerOutput
from data_plane.model.llama import LlamaForCausalLM, LoraDelta
from data_plane.model.paged_attention import PagedAttention, PagedKVCache, PrefillSpan
from data_plane.sampling import RowSampling, Sampled, SamplingFailed, sample_batch

# Builds the step's LoRA contribution from per-token adapter slots (-1: none).
LoraBatchFactory = Callable[[list[int]], LoraDelta | None]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        lora_batch: LoraBatchFactory | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.lora_batch = lora_batch
        self.device = model.device
        self._block_offsets = torch.arange(kv.block_size, device=self.device)

    def execute(self, step: SchedulerOutput) -> list[tuple[ScheduledChunk, Sampled | SamplingFailed]]:
        """Run the step; returns the sampled token (or the row's failure) of each chunk that
        samples, in order."""
        for imp in step.imports:
            self._write_import(imp)
        # One-token chunks first: they are attended as one padded batch.
        chunks = sorted(step.chunks, key=lambda c: c.num_tokens != 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lora_slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        sampling: list[RowSampling] = []
        sampled_chunks: list[ScheduledChunk] = []
        bs = self.kv.block_size
        any_lora = False
        for chunk in chunks:
            seq = chunk.seq
            row = len(ids)
            end = chunk.start + chunk.num_tokens
            ids.extend(seq.token_ids[chunk.start:end])
            positions.extend(range(chunk.start, end))
            table = [b.block_id for b in seq.blocks]
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            lora_slots.extend([seq.lora_slot] * chunk.num_tokens)
            any_lora = any_lora or seq.lora_slot >= 0
            if chunk.num_tokens == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSpan(row, chunk.num_tokens, chunk.start,
                                            self._context_slots(table, end)))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                params = seq.params
                sampling.append(RowSampling(params.temperature, params.top_p, params.top_k,
                                            seq.generator, params.logprobs))
                sampled_chunks.append(chunk)
        decode_slots = decode_mask = None
        if decode_tables:
            decode_slots, decode_mask = self._decode_layout(decode_tables, decode_lens)
        attn = PagedAttention(
            kv=self.kv,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=len(decode_tables),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        lora = self.lora_batch(lora_slots) if (any_lora and self.lora_batch) else None
        # With only partial prefill chunks there is nothing to sample: the pass fills the cache.
        logits = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            lora=lora,
        )
        if not sample_rows:
            return []
        return list(zip(sampled_chunks, sample_batch(logits, sampling), strict=True))

    def _write_import(self, imp: KVImport) -> None:
        """Write another node's K/V of tokens [start, start + n) into the sequence's slots."""
        bs = self.kv.block_size
        end = imp.start + imp.num_tokens
        table = torch.tensor([b.block_id for b in imp.seq.blocks], device=self.device)
        slots = (table[:, None] * bs + self._block_offsets).reshape(-1)[imp.start:end]
        for cache, src in ((self.kv.keys, imp.payload.keys), (self.kv.values, imp.payload.values)):
            cache.index_copy_(1, slots, src[:, imp.start:end].to(self.device))

    def _context_slots(self, table: list[int], length: int) -> torch.Tensor:
        blocks = torch.tensor(table[: -(-length // self.kv.block_size)], device=self.device)
        return (blocks[:, None] * self.kv.block_size + self._block_offsets).reshape(-1)[:length]

    def _decode_layout(
        self, tables: list[list[int]], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.kv.block_size
        max_blocks = max(-(-n // bs) for n in lens)
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables]
        blocks = torch.tensor(padded, device=self.device)  # [B, max_blocks]
        slots = (blocks[:, :, None] * bs + self._block_offsets).reshape(len(tables), -1)
        max_len = max(lens)
        slots = slots[:, :max_len].reshape(-1)
        lengths = torch.tensor(lens, device=self.device)
        past_end = torch.arange(max_len, device=self.device)[None, :] >= lengths[:, None]
        mask = torch.zeros(past_end.shape, dtype=self.model.dtype, device=self.device)
        mask.masked_fill_(past_end, float("-inf"))
        return slots, mask[:, None, None, :]
