"""Chained block hashes: moved to meridian.block_hash, which routers share; re-exported here."""

from __future__ import annotations

from meridian.block_hash import hash_block, hash_blocks

__all__ = ["hash_block", "hash_blocks"]
