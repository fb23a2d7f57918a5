"""Prefix-cache block hashes: the content address of a full KV block everywhere.

The engine's block manager, the decode replica asking a prefill replica for blocks, and the
router's affinity index all compute the same chain with this module (torch-free on purpose):

    h_0 = H(seed, tokens[0:B]),   h_i = H(h_{i-1}, tokens[i*B:(i+1)*B])

so a block's hash names its whole prefix, not just its own tokens. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# The chain's root. Changing the hash function or this seed changes every address: bump it
# together with the wire protocol version.
_ROOT = b"pdserve-block-hash-v1"
NONE_HASH = int.from_bytes(hashlib.blake2b(_ROOT, digest_size=8).digest(), "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (``NONE_HASH`` for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_block_tokens(
    token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH, start_block: int = 0
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` must be the hash of block ``start_block - 1`` (``NONE_HASH`` when 0), so the
    chain can be extended incrementally as a sequence grows.
    """
    hashes = []
    h = parent_hash
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        h = hash_block(h, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(h)
    return hashes
