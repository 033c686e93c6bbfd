"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash, its token ids and the extra keys that
change what its KV holds (the LoRA adapter) or who may reuse it (the cache salt). Two
blocks with the same hash therefore hold the KV of the same prefix, which is what
lets requests share them and lets routers match a prompt against a node's blocks
from its KV events alone.

This is a wire contract (DESIGN.md: "Block hashes are chained"): nodes publish these hashes
in BlockStored events and routers compute them from a request's prompt, so the two must
stay byte-identical. It lives here, outside data_plane, so the router can share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_ENCODER = msgspec.msgpack.Encoder()


def hash_block(
    parent: int | None,
    token_ids: Sequence[int],
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> int:
    """The 64-bit hash of one full block: sha256 over (parent, tokens, adapter, salt)."""
    payload = _ENCODER.encode((parent, list(token_ids), lora_name, cache_salt))
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    *,
    start: list[int] | None = None,
) -> list[int]:
    """Hashes of every full block of `token_ids`, extending the chain `start` if given."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        # The salt keys only the first block: every later hash inherits it via the parent.
        hashes.append(
            hash_block(
                parent,
                token_ids[i * block_size:(i + 1) * block_size],
                lora_name,
                cache_salt if i == 0 else None,
            )
        )
    return hashes
