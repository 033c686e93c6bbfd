"""Block hashes are a wire contract between nodes and routers: pinned, so a change is seen."""

from __future__ import annotations

from meridian.block_hash import hash_block, hash_blocks


def test_block_hashes_are_pinned() -> None:
    # Changing these breaks every router and KV-event consumer matching a node's blocks.
    assert hash_blocks(list(range(8)), 4) == [4737581772631621760, 7076040508209187796]
    assert hash_blocks(list(range(8)), 4, "sql", "tenant-1") == [7614827990971779808, 14828151929988723752]


def test_the_salt_keys_the_first_block_and_the_chain_carries_it() -> None:
    salted = hash_blocks(list(range(8)), 4, None, "s")
    assert salted[0] == hash_block(None, range(4), None, "s")
    assert salted[1] == hash_block(salted[0], range(4, 8))
