"""The gateway's bounded per-engine prefix index, built from what the picker routed.

A prompt is cut into blocks and named by *chained* hashes (``h[i] = hash(h[i-1], block
i)``), so a block matches only when its whole prefix matches: an engine's cached prefix
of a request is the longest leading run of the request's blocks the engine holds, as in
vLLM's and SGLang's prefix caches. Blocks are text chunks of ``block_chars`` characters
of the prompt text (the chat messages with their roles, or the completion prompt) when no
tokenizer is configured; only whole blocks are hashed (the tail is never cached).

Layout (for a pick in O(request blocks + engines), whatever the index holds):

* one LRU per engine (an ``OrderedDict`` of block hashes, oldest first) of at most
  ``capacity`` blocks: recording a request touches its blocks and inserts the others as
  most recent, then evicts the least recently used beyond the capacity -- the same
  eviction an engine's own LRU prefix cache does. The index never grows past the sum of
  its engines' capacities, each at most :data:`MAX_ENGINE_BLOCKS`;
* one inverted map ``hash -> bitset of the engines holding it`` (a Python int, bit
  ``e`` for engine slot ``e``), kept in step by every insert and eviction. A match walks
  the request's blocks once, intersecting bitsets, and reads every engine's leading run
  from where its bit drops out.

About 200 bytes per (block, engine) entry in CPython (LRU slot, map entry, the ints).
Hashes are Python's ``hash`` of (previous hash, chunk): stable within one process, which
is all an in-memory index needs. One owner (the event loop); pure, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

MAX_ENGINE_BLOCKS: Final = 1 << 22
"""Largest capacity of one engine's index (blocks)."""

MAX_REQUEST_BLOCKS: Final = 1 << 14
"""Most blocks hashed for one request (longer prompts: their first blocks only)."""

IntArray = npt.NDArray[np.int64]


def text_blocks(text: str, block_chars: int, limit: int = MAX_REQUEST_BLOCKS) -> list[int]:
    """Chained hashes of the whole ``block_chars``-character chunks of ``text`` (at most
    ``limit``); ``[]`` for a text shorter than one block."""
    if block_chars < 1:
        raise ValueError("block_chars: must be >= 1")
    n = min(len(text) // block_chars, limit)
    out: list[int] = []
    h = 0
    for i in range(n):
        h = hash((h, text[i * block_chars : (i + 1) * block_chars]))
        out.append(h)
    return out


def token_blocks(
    ids: Sequence[int], block_tokens: int, limit: int = MAX_REQUEST_BLOCKS
) -> list[int]:
    """Chained hashes of the whole ``block_tokens``-token blocks of ``ids`` (at most ``limit``)."""
    if block_tokens < 1:
        raise ValueError("block_tokens: must be >= 1")
    n = min(len(ids) // block_tokens, limit)
    out: list[int] = []
    h = 0
    for i in range(n):
        h = hash((h, tuple(ids[i * block_tokens : (i + 1) * block_tokens])))
        out.append(h)
    return out


class PrefixIndex:
    """Which engine slot holds which blocks (see the module docstring).

    Engines are slots ``0..n-1`` (the caller maps its engines to slots); a slot is added
    with :meth:`add` and dropped with :meth:`remove` (its blocks are forgotten).
    """

    def __init__(self) -> None:
        self._lru: list[OrderedDict[int, None] | None] = []
        self._cap: list[int] = []
        self._where: dict[int, int] = {}
        self._free: list[int] = []

    # -- engines -----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Engine slots ever allocated (the length of :meth:`match`'s answer)."""
        return len(self._lru)

    def add(self, capacity: int) -> int:
        """A new engine slot with room for ``capacity`` blocks; returns the slot."""
        cap = self._check(capacity)
        lru: OrderedDict[int, None] = OrderedDict()
        if self._free:
            slot = self._free.pop()
            self._lru[slot] = lru
            self._cap[slot] = cap
        else:
            slot = len(self._lru)
            self._lru.append(lru)
            self._cap.append(cap)
        return slot

    def remove(self, slot: int) -> None:
        """Forget an engine slot and its blocks (the slot may be reused by :meth:`add`)."""
        lru = self._lru[slot]
        if lru is None:
            return
        bit = 1 << slot
        for h in lru:
            self._clear(h, bit)
        self._lru[slot] = None
        self._cap[slot] = 0
        self._free.append(slot)

    def capacity(self, slot: int) -> int:
        return self._cap[slot]

    def set_capacity(self, slot: int, capacity: int) -> None:
        """Resize an engine's index (blocks); evicts its least recently used beyond it."""
        self._cap[slot] = self._check(capacity)
        self._evict(slot)

    def held(self, slot: int) -> int:
        """Blocks the index holds for an engine slot."""
        lru = self._lru[slot]
        return 0 if lru is None else len(lru)

    def size(self) -> int:
        """Blocks held, all engines ((block, engine) entries)."""
        return sum(len(x) for x in self._lru if x is not None)

    # -- queries -----------------------------------------------------------------------------

    def match(self, blocks: Sequence[int]) -> IntArray:
        """Leading blocks of ``blocks`` each engine slot holds: int64 array of shape
        ``(slots,)`` (0 for removed slots). O(len(blocks) + slots)."""
        n = len(self._lru)
        out = np.zeros(n, dtype=np.int64)
        if n == 0 or not blocks:
            return out
        where = self._where
        alive = (1 << n) - 1
        for i, h in enumerate(blocks):
            now = alive & where.get(h, 0)
            gone = alive ^ now
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = i
                gone ^= low
            alive = now
            if not alive:
                return out
        full = len(blocks)
        while alive:
            low = alive & -alive
            out[low.bit_length() - 1] = full
            alive ^= low
        return out

    # -- updates -----------------------------------------------------------------------------

    def record(self, slot: int, blocks: Sequence[int]) -> None:
        """Engine ``slot`` was sent a request with these blocks: they become its most
        recent ones; the least recently used beyond its capacity are evicted."""
        lru = self._lru[slot]
        if lru is None or self._cap[slot] == 0:
            return
        bit = 1 << slot
        where = self._where
        for h in blocks:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                where[h] = where.get(h, 0) | bit
        self._evict(slot)

    def evict_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Exact mode: the engine says it dropped these blocks."""
        lru = self._lru[slot]
        if lru is None:
            return
        bit = 1 << slot
        for h in blocks:
            if h in lru:
                del lru[h]
                self._clear(h, bit)

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _check(capacity: int) -> int:
        if not 0 <= capacity <= MAX_ENGINE_BLOCKS:
            raise ValueError(f"capacity: must be in [0, {MAX_ENGINE_BLOCKS}], got {capacity}")
        return int(capacity)

    def _clear(self, h: int, bit: int) -> None:
        where = self._where
        left = where.get(h, 0) & ~bit
        if left:
            where[h] = left
        else:
            where.pop(h, None)

    def _evict(self, slot: int) -> None:
        lru = self._lru[slot]
        if lru is None:
            return
        cap = self._cap[slot]
        bit = 1 << slot
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._clear(h, bit)
