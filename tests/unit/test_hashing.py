from __future__ import annotations

from cluster.common.hashing import NONE_HASH, hash_block, hash_block_tokens


def test_chain_names_the_whole_prefix() -> None:
    a = hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_block_tokens([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same block tokens, different prefix


def test_incremental_extension_equals_full_computation() -> None:
    toks = list(range(40))
    full = hash_block_tokens(toks, 8)
    head = hash_block_tokens(toks[:17], 8)
    tail = hash_block_tokens(toks, 8, parent_hash=head[-1], start_block=len(head))
    assert head + tail == full
    assert full[0] == hash_block(NONE_HASH, toks[:8])


def test_partial_blocks_are_not_hashed() -> None:
    assert hash_block_tokens([1, 2, 3], 4) == []
