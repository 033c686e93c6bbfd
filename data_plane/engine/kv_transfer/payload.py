"""The torch engine's KV transfer format: one prompt's keys and values, every layer, as a
prefill node exports them (GET /v1/kv/{handle}) and a decode node imports them.

    b"MKV1" | u32 LE header length | JSON header | keys bytes | values bytes

The header names the model, dtype, layer shape, token count, a digest of the token ids
the KV was computed for, and the LoRA adapter; keys and values are each one contiguous
[layers, tokens, kv_heads, head_dim] tensor in the header's dtype, little-endian. Raw
tensor bytes and a JSON header, never pickle: a payload is data from another process.
KV is per token, not per block, so the two nodes' block sizes need not match (the header
still says the prefill node's, for diagnosis).

A decode node accepts a payload only when `mismatch` finds nothing: the KV must come from
the same model, in the same dtype and shape, for the same prompt (its first tokens) and
adapter; anything else is recomputed locally, never attended to.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "meridian-kv/1"
MAGIC = b"MKV1"
MAX_HEADER_BYTES = 64 * 1024
_PREFIX = struct.Struct("<4sI")
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


class KVPayloadError(ValueError):
    """Bytes that are not a KV payload of this format."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tokens_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    """sha256 of the token ids as little-endian int64: what the KV was computed for."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a node's KV looks like: a payload fits a node whose layout it matches."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def tensor_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, num_tokens, self.num_kv_heads, self.head_dim)

    def payload_bytes(self, num_tokens: int) -> int:
        """The largest encoded payload of `num_tokens` tokens in this layout."""
        elem = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        per_tensor = self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * elem
        return _PREFIX.size + MAX_HEADER_BYTES + 2 * per_tensor


@dataclass(frozen=True, slots=True)
class KVPayload:
    """One prompt's KV: keys and values [layers, tokens, kv_heads, head_dim] on the CPU."""

    layout: KVLayout
    num_tokens: int
    tokens_sha256: str
    lora: str | None
    keys: torch.Tensor
    values: torch.Tensor


def encode(payload: KVPayload) -> bytes:
    layout = payload.layout
    header = {
        "format": FORMAT, "byteorder": "little", "model": layout.model, "dtype": layout.dtype,
        "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim, "block_size": layout.block_size,
        "num_tokens": payload.num_tokens, "tokens_sha256": payload.tokens_sha256,
        "lora": payload.lora,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_PREFIX.pack(MAGIC, len(head)), head]
    for tensor in (payload.keys, payload.values):
        parts.append(_raw(tensor))
    return b"".join(parts)


def _raw(tensor: torch.Tensor) -> bytes:
    data: bytes = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    if sys.byteorder != "little" and tensor.element_size() > 1:
        raise KVPayloadError("KV export needs a little-endian host")
    return data


def decode(data: bytes | bytearray) -> KVPayload:
    """The payload in `data`; KVPayloadError when it is not one, or is inconsistent."""
    if len(data) < _PREFIX.size:
        raise KVPayloadError("truncated KV payload")
    magic, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise KVPayloadError("not a Meridian KV payload")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(data):
        raise KVPayloadError("KV payload header too large or truncated")
    try:
        header = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + head_len]))
        layout, num_tokens = _layout(header)
    except (ValueError, KeyError, TypeError) as exc:
        raise KVPayloadError(f"bad KV payload header: {exc}") from None
    dtype = _DTYPES[layout.dtype]
    shape = layout.tensor_shape(num_tokens)
    elem = torch.empty((), dtype=dtype).element_size()
    size = shape[0] * shape[1] * shape[2] * shape[3] * elem
    start = _PREFIX.size + head_len
    if len(data) != start + 2 * size:
        raise KVPayloadError(f"KV payload has {len(data) - start} tensor bytes, expected {2 * size}")
    body = data if isinstance(data, bytearray) else bytearray(data)
    keys = torch.frombuffer(body, dtype=torch.uint8, count=size, offset=start)
    values = torch.frombuffer(body, dtype=torch.uint8, count=size, offset=start + size)
    return KVPayload(
        layout=layout, num_tokens=num_tokens, tokens_sha256=str(header["tokens_sha256"]),
        lora=header.get("lora"), keys=keys.view(dtype).view(shape), values=values.view(dtype).view(shape),
    )


def _layout(header: Any) -> tuple[KVLayout, int]:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format is not {FORMAT}")
    if header.get("byteorder") != "little":
        raise ValueError("byteorder must be little")
    if header.get("dtype") not in _DTYPES:
        raise ValueError(f"unsupported dtype {header.get('dtype')!r}")
    ints = {k: header[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_tokens")}
    if any(type(v) is not int or v < 1 for v in ints.values()):
        raise ValueError("shape fields must be positive integers")
    if not isinstance(header.get("model"), str) or not isinstance(header.get("tokens_sha256"), str):
        raise ValueError("model and tokens_sha256 must be strings")
    if header.get("lora") is not None and not isinstance(header["lora"], str):
        raise ValueError("lora must be a string or null")
    layout = KVLayout(model=header["model"], dtype=header["dtype"], num_layers=ints["num_layers"],
                      num_kv_heads=ints["num_kv_heads"], head_dim=ints["head_dim"],
                      block_size=ints["block_size"])
    return layout, ints["num_tokens"]


def mismatch(payload: KVPayload, local: KVLayout, prompt_ids: list[int], lora: str | None) -> str | None:
    """Why `payload` cannot stand for the first tokens of `prompt_ids` on a node of layout
    `local` serving adapter `lora`; None when it can."""
    theirs = payload.layout
    for field in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(theirs, field) != getattr(local, field):
            return f"{field} {getattr(theirs, field)!r} != local {getattr(local, field)!r}"
    if payload.lora != lora:
        return f"LoRA adapter {payload.lora!r} != request's {lora!r}"
    if payload.num_tokens > len(prompt_ids):
        return f"{payload.num_tokens} tokens of KV for a prompt of {len(prompt_ids)}"
    if payload.tokens_sha256 != tokens_digest(prompt_ids[:payload.num_tokens]):
        return "the KV was computed for other tokens than this prompt's"
    return None
