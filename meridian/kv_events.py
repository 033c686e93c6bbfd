"""KV cache events on the wire, in vLLM's format (`vllm.distributed.kv_events`).

Nodes publish these on a ZMQ PUB socket as multipart messages
``[topic, sequence (8-byte big-endian), msgpack(KVEventBatch)]``, exactly as vLLM's
``--kv-events-config`` publisher does, so a consumer written for vLLM (routers,
llm-d's KV indexer, Dynamo) decodes a torch-engine node's stream unchanged and ours
decodes vLLM's. The struct layout (array_like, tagged unions, field order) is the wire
format: never reorder or rename fields here.

Block hashes are chained: a block's hash covers its parent's hash, the block's token
ids and the extra keys (LoRA adapter, cache salt), so equal hashes mean equal prefixes.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash is `bytes | int`; we publish 64-bit unsigned ints.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# One bit per storage medium, so that whoever tracks blocks forgets one only once no medium
# holds it. No medium means the GPU (as in vLLM); tiers other than GPU and CPU (disk,
# remote stores) share a bit.
_MEDIUM_BITS: dict[str | None, int] = {None: 1, MEDIUM_GPU: 1, MEDIUM_CPU: 2}
_OTHER_MEDIUM_BIT = 4


def medium_bit(medium: str | None) -> int:
    """The bit of a storage medium in a mask of the media holding a block."""
    return _MEDIUM_BITS.get(medium, _OTHER_MEDIUM_BIT)

# Sequence frame of the replay socket's end-of-replay marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    # vLLM keeps lora_id for older consumers; lora_name is what the hash covers.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # vLLM's per-block extra hash keys, untagged: the LoRA name (when lora_name is set),
    # multimodal (identifier, offset) pairs, the cache salt, prompt-embedding digests.
    # Meridian's own hashes fold the adapter and salt in already and never send them.
    extra_keys: list[Any] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one message payload; raises msgspec.DecodeError on malformed input."""
    return _DECODER.decode(payload)


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
