"""Chained block hashes: a request's prefix identity for per-engine prefix caches.

A prefill pool whose engines each keep their own prefix cache (``prefill.cache_model:
per_engine``) routes a request to the engine holding the longest prefix of it. The
entrypoint names the prefix in ``SubmitRequest.block_hashes``: the prompt's token ids cut
into blocks of ``block_tokens`` tokens (the daemon's ``prefill.block_tokens``, default
512 as in Mooncake's traces), and for each *full* block

    hash[i] = blake2b(digest_size=8)(hash[i-1] as 8 bytes big-endian ||
                                      token ids of block i as 4-byte little-endian)

read as an unsigned 64-bit big-endian integer, with ``hash[-1] = 0``. Chaining makes a
block's hash name its whole prefix, so equal hashes at position ``i`` mean equal first
``(i+1) x block_tokens`` tokens. The hash is stable across processes and machines (no
salted ``hash()``); any client in any language computes the same values from the same
token ids. The trailing partial block is not hashed (no engine caches it either).

Usage::

    hashes = block_hashes(token_ids)                 # list[int], one per full block
    await submit_prefill(..., block_hashes=hashes)   # or SubmitRequest(block_hashes=...)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from fulcrum.core.prefill.affinity import DEFAULT_BLOCK_TOKENS

__all__ = ["block_hashes", "chain_hash"]


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The 64-bit hash of one block: blake2b-64 of ``parent`` (8 bytes, big-endian) and
    the block's token ids (each 4 bytes, little-endian, ids in [0, 2^32))."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(">Q", parent))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


def block_hashes(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the full ``block_tokens``-token blocks of ``token_ids``."""
    if block_tokens < 1:
        raise ValueError("block_tokens: must be >= 1")
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, token_ids[start:start + block_tokens])
        out.append(parent)
    return out
