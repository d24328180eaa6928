"""Chained block hashes: a request's prefix identity for per-engine prefix caches.

A prefill pool whose engines each keep their own prefix cache (``prefill.cache_model:
per_engine``) routes a request to the engine holding the longest prefix of it. The
entrypoint names the prefix in ``SubmitRequest.block_hashes``: the prompt's token ids cut
into blocks of ``block_tokens`` tokens (the daemon's ``prefill.block_tokens``, default
512 as in Mooncake's traces), and for each *full* block

    hash[i] = blake2b(digest_size=8)(hash[i-1] as 8 bytes big-endian ||
                                      token ids of block i as 4-byte little-endian)

read as an unsigned 64-bit big-endian integer, with ``hash[-1] = 0`` -- or, with a
per-tenant ``salt``, ``hash[-1] = blake2b-64(salt)`` (see "Salting" below). Chaining makes a
block's hash name its whole prefix, so equal hashes at position ``i`` mean equal first
``(i+1) x block_tokens`` tokens. The hash is stable across processes and machines (no
salted ``hash()``); any client in any language computes the same values from the same
token ids. The trailing partial block is not hashed (no engine caches it either).

Usage::

    hashes = block_hashes(token_ids)                 # list[int], one per full block
    await submit_prefill(..., block_hashes=hashes)   # or SubmitRequest(block_hashes=...)

Salting: where tenants must not learn about or steer each other's prefixes, the
entrypoint salts every tenant's chain with a secret of that tenant
(``block_hashes(ids, salt=tenant_secret)``). Unsalted, a client that sends another
tenant's hashes can steer its own requests onto the engine holding that tenant's prompt
and time its answers (a faster time to first token says "this prefix is cached": a
timing side channel). With distinct salts two tenants' chains never share a hash, so
neither can match, steer toward, or probe the other's prefixes; a tenant's own requests
still share their prefixes. See docs/prefix-hashes.md.
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


def block_hashes(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 salt: bytes = b"") -> list[int]:
    """Chained hashes of the full ``block_tokens``-token blocks of ``token_ids``; a
    non-empty ``salt`` (a per-tenant secret) seeds the chain, so differently salted
    chains never share a hash."""
    if block_tokens < 1:
        raise ValueError("block_tokens: must be >= 1")
    out: list[int] = []
    parent = int.from_bytes(hashlib.blake2b(salt, digest_size=8).digest(), "big") if salt else 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, token_ids[start:start + block_tokens])
        out.append(parent)
    return out
