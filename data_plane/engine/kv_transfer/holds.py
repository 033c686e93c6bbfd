"""A prefill node's held KV: the blocks of finished prefill requests, kept (instead of
freed) under a handle until the decode node pulls them, the router releases them, or
their lease runs out.

`HeldKV` lives on the engine's worker thread, which alone touches the block pool and the
KV tensors: holding, exporting (a copy of the blocks' K/V, then release: one-shot, as
NIXL's read notification frees the prefill side's blocks) and releasing are worker
commands. `Leases` lives on the event loop: one timer per handle on the node's clock,
whose expiry asks the worker to release; an export or release cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from data_plane.engine.base import KVHold
from data_plane.engine.kv_cache.block_pool import Block
from data_plane.engine.kv_cache.manager import KVCacheManager, cdiv
from data_plane.engine.kv_transfer.payload import KVLayout, KVPayload, tokens_digest
from data_plane.model.paged_attention import PagedKVCache
from meridian.clock import Clock

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Held:
    blocks: list[Block]
    token_ids: list[int]
    lora: str | None


def new_handle() -> str:
    """An unguessable handle: a peer names only the KV it was told of."""
    return "kv-" + uuid.uuid4().hex


class HeldKV:
    """Held blocks by handle; worker thread only."""

    def __init__(self, kv: KVCacheManager, cache: PagedKVCache, layout: KVLayout) -> None:
        self._kv = kv
        self._cache = cache
        self.layout = layout
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, blocks: list[Block], token_ids: list[int], num_computed: int,
             lora: str | None) -> KVHold:
        """Keep the blocks holding the first `num_computed` of `token_ids` (a finished
        request's, detached from it) and free the rest."""
        n = min(num_computed, len(token_ids))
        keep = cdiv(n, self._kv.block_size)
        self._kv.pool.free(reversed(blocks[keep:]))
        held = _Held(blocks[:keep], list(token_ids[:n]), lora)
        handle = new_handle()
        self._held[handle] = held
        return KVHold(handle, tuple(b.block_id for b in held.blocks), n)

    def export(self, handle: str) -> KVPayload | None:
        """A copy of the handle's K/V, every layer, and release it; None if unknown."""
        held = self._held.pop(handle, None)
        if held is None:
            return None
        try:
            n = len(held.token_ids)
            bs = self._kv.block_size
            table = torch.tensor([b.block_id for b in held.blocks], device=self._cache.keys.device)
            offsets = torch.arange(bs, device=table.device)
            slots = (table[:, None] * bs + offsets).reshape(-1)[:n]
            keys = self._cache.keys.index_select(1, slots).to("cpu")
            values = self._cache.values.index_select(1, slots).to("cpu")
        finally:
            self._free(held)
        return KVPayload(self.layout, n, tokens_digest(held.token_ids), held.lora, keys, values)

    def release(self, handle: str) -> bool:
        held = self._held.pop(handle, None)
        if held is not None:
            self._free(held)
        return held is not None

    def release_all(self) -> None:
        for handle in list(self._held):
            self.release(handle)

    def _free(self, held: _Held) -> None:
        self._kv.pool.free(reversed(held.blocks))


class Leases:
    """One timer per held handle on the node's clock; event loop only."""

    def __init__(self, clock: Clock, lease_s: float,
                 expire: Callable[[str], Awaitable[object]]) -> None:
        self._clock = clock
        self._lease_s = lease_s
        self._expire = expire
        self._timers: dict[str, asyncio.Task[None]] = {}

    def start(self, handle: str) -> None:
        self._timers[handle] = asyncio.ensure_future(self._run(handle))

    def cancel(self, handle: str) -> None:
        timer = self._timers.pop(handle, None)
        if timer is not None:
            timer.cancel()

    def cancel_all(self) -> None:
        for handle in list(self._timers):
            self.cancel(handle)

    async def _run(self, handle: str) -> None:
        await self._clock.sleep(self._lease_s)
        self._timers.pop(handle, None)
        with contextlib.suppress(Exception):
            if await self._expire(handle):
                log.info("KV %s expired after its %.0fs lease: released", handle, self._lease_s)
