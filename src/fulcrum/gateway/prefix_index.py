"""The gateway's bounded per-engine prefix index, built from what the picker routed.

A prompt is cut into blocks and named by *chained* hashes (``h[i] = hash(h[i-1], block
i)``), so a block matches only when its whole prefix matches: an engine's cached prefix
of a request is the longest leading run of the request's blocks the engine holds, as in
vLLM's and SGLang's prefix caches. Blocks are text chunks of ``block_chars`` characters
of the prompt text (the chat messages with their roles, or the completion prompt) when no
tokenizer is configured; only whole blocks are hashed (the tail is never cached).

Layout (for a pick in O(request blocks + engines), whatever the index holds; invisible
to Python's cycle collector, so that a full collection never walks millions of entries --
64 ``OrderedDict`` LRUs of 20,000 blocks cost a 40-190 ms collection pause on the loop):

* one exact LRU per engine (:class:`_Lru`) of at most ``capacity`` blocks: a plain
  ``dict`` block hash -> entry slot, and numpy arrays per entry slot of the hash and its
  last use (a tick of the index, bumped per block recorded). Recording a request touches
  its held blocks and inserts the others as most recent, its first block last (so a
  prefix loses its tail first, as an engine's own cache does); when that goes past the
  capacity, the least recently used are evicted, with a margin of 1/64 of the capacity
  (``np.argpartition`` over the engine's ticks: O(capacity) numpy work, ~30 us at 20,000
  blocks, once per capacity/64 inserts) -- the eviction an engine's own LRU prefix
  cache does. The index never grows past the
  sum of its engines' capacities, each at most :data:`MAX_ENGINE_BLOCKS`;
* one inverted map ``hash -> bitset of the engines holding it`` (a Python int, bit
  ``e`` for engine slot ``e``), kept in step by every insert and eviction. A match walks
  the request's blocks once, intersecting bitsets, and reads every engine's leading run
  from where its bit drops out.

Plain dicts of ints hold no tracked object, so the collector untracks them; numpy arrays
are not tracked. About 150 bytes per (block, engine) entry in CPython (two dict entries,
the ints, 16 bytes of arrays). Hashes are Python's ``hash`` of (previous hash, chunk):
stable within one process, which is all an in-memory index needs. One owner (the event
loop); pure, no I/O.
"""

from __future__ import annotations

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


_SPARE_SHIFT: Final = 6
"""An evicting record frees ``capacity >> 6`` more of the oldest blocks than it needs (a
1/64 margin), so the O(capacity) selection runs once per that many inserts; an engine
holds between 63/64 of its capacity and its capacity (exactly LRU below 64 blocks)."""

_FREE: Final = np.iinfo(np.int64).max
"""Tick of a free entry slot (larger than any use, so never chosen for eviction)."""


_SPARSE_BITS: Final = 8
"""A bitset of at most this many engines is decoded bit by bit (about 1 us per engine);
a larger one is unpacked by numpy (a few us, whatever its size)."""


def _depths(depths: list[int], drops: list[int], n: int) -> IntArray:
    """``out[e] = depths[j]`` for every engine slot ``e`` in bitset ``drops[j]`` (the
    bitsets are disjoint), else 0: int64, shape ``(n,)``. A sparse bitset is walked bit
    by bit; a dense one is unpacked from its little-endian bytes, so that a match over
    thousands of engines costs a few numpy calls per depth, not a Python step per
    engine."""
    out = np.zeros(n, dtype=np.int64)
    width = (n + 7) // 8
    for d, bits in zip(depths, drops, strict=True):
        if bits.bit_count() > _SPARSE_BITS:
            raw = np.frombuffer(bits.to_bytes(width, "little"), dtype=np.uint8)
            out[np.unpackbits(raw, count=n, bitorder="little").view(np.bool_)] = d
            continue
        while bits:
            low = bits & -bits
            out[low.bit_length() - 1] = d
            bits ^= low
    return out


class _Lru:
    """One engine's blocks: ``pos`` block hash -> entry slot; per entry slot (arrays of
    the same length, grown by doubling up to ``cap``) its hash and last-use tick
    (:data:`_FREE` when free); a stack of free slots below ``used``."""

    __slots__ = ("cap", "free", "keys", "nfree", "pos", "tick", "used")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.pos: dict[int, int] = {}
        self.keys = np.zeros(0, dtype=np.int64)
        self.tick = np.zeros(0, dtype=np.int64)
        self.free = np.zeros(0, dtype=np.int64)
        self.nfree = 0
        self.used = 0

    def take(self, m: int) -> IntArray:
        """``m`` free entry slots (the caller made room: ``len(pos) + m <= cap``)."""
        k = min(m, self.nfree)
        out = self.free[self.nfree - k : self.nfree].copy()
        self.nfree -= k
        rest = m - k
        if rest:
            top = self.used + rest
            if top > self.keys.shape[0]:
                self._grow(top)
            out = np.concatenate([out, np.arange(self.used, top, dtype=np.int64)])
            self.used = top
        return out

    def give(self, slots: IntArray) -> None:
        """Entry slots back to the free stack."""
        self.tick[slots] = _FREE
        n = slots.shape[0]
        self.free[self.nfree : self.nfree + n] = slots
        self.nfree += n

    def oldest(self, n: int) -> IntArray:
        """The ``n`` least recently used held entry slots (n <= len(pos))."""
        t = self.tick[: self.used]
        if n >= t.shape[0]:
            return np.flatnonzero(t != _FREE)
        return np.argpartition(t, n - 1)[:n]

    def _grow(self, top: int) -> None:
        size = min(self.cap, max(top, 2 * self.keys.shape[0], 64))
        extra = size - self.keys.shape[0]
        self.keys = np.concatenate([self.keys, np.zeros(extra, dtype=np.int64)])
        self.tick = np.concatenate([self.tick, np.full(extra, _FREE, dtype=np.int64)])
        self.free = np.concatenate([self.free, np.zeros(extra, dtype=np.int64)])

    def compact(self) -> None:
        """Held entries to slots ``0..len(pos)-1`` and arrays of at most ``cap`` entries
        (after a capacity cut)."""
        n = len(self.pos)
        old = np.fromiter(self.pos.values(), dtype=np.int64, count=n)
        size = max(n, min(self.cap, self.keys.shape[0]))
        keys = np.zeros(size, dtype=np.int64)
        tick = np.full(size, _FREE, dtype=np.int64)
        keys[:n] = self.keys[old]
        tick[:n] = self.tick[old]
        self.keys, self.tick = keys, tick
        self.free = np.zeros(size, dtype=np.int64)
        self.nfree, self.used = 0, n
        self.pos = dict(zip(self.pos, range(n), strict=True))


class PrefixIndex:
    """Which engine slot holds which blocks (see the module docstring).

    Engines are slots ``0..n-1`` (the caller maps its engines to slots); a slot is added
    with :meth:`add` and dropped with :meth:`remove` (its blocks are forgotten).
    """

    def __init__(self) -> None:
        self._lru: list[_Lru | None] = []
        self._where: dict[int, int] = {}
        self._free: list[int] = []
        self._tick = 1
        self._size = 0

    # -- engines -----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Engine slots ever allocated (the length of :meth:`match`'s answer)."""
        return len(self._lru)

    def add(self, capacity: int) -> int:
        """A new engine slot with room for ``capacity`` blocks; returns the slot."""
        lru = _Lru(self._check(capacity))
        if self._free:
            slot = self._free.pop()
            self._lru[slot] = lru
        else:
            slot = len(self._lru)
            self._lru.append(lru)
        return slot

    def remove(self, slot: int) -> None:
        """Forget an engine slot and its blocks (the slot may be reused by :meth:`add`)."""
        if self._forget(slot):
            self._lru[slot] = None
            self._free.append(slot)

    def capacity(self, slot: int) -> int:
        lru = self._lru[slot]
        return 0 if lru is None else lru.cap

    def set_capacity(self, slot: int, capacity: int) -> None:
        """Resize an engine's index (blocks); evicts its least recently used beyond it."""
        cap = self._check(capacity)
        lru = self._lru[slot]
        if lru is None:
            return
        lru.cap = cap
        over = len(lru.pos) - cap
        if over > 0:
            self._drop(slot, lru, lru.oldest(over))
        if lru.keys.shape[0] > cap:
            lru.compact()

    def held(self, slot: int) -> int:
        """Blocks the index holds for an engine slot."""
        lru = self._lru[slot]
        return 0 if lru is None else len(lru.pos)

    def size(self) -> int:
        """Blocks held, all engines ((block, engine) entries)."""
        return self._size

    # -- queries -----------------------------------------------------------------------------

    def match(self, blocks: Sequence[int]) -> IntArray:
        """Leading blocks of ``blocks`` each engine slot holds: int64 array of shape
        ``(slots,)`` (0 for removed slots). O(len(blocks) + slots): the walk intersects
        bitsets, and the engines that drop out at each depth are spread into the answer by
        :func:`_depths` (a Python step per engine cost 4 ms at 4,096 engines)."""
        n = len(self._lru)
        if n == 0 or not blocks:
            return np.zeros(n, dtype=np.int64)
        where = self._where
        alive = (1 << n) - 1
        depths: list[int] = []
        drops: list[int] = []  # the engines whose run ends at each depth (bitsets)
        for i, h in enumerate(blocks):
            now = alive & where.get(h, 0)
            if now != alive:
                if i:  # a run of 0 blocks is the answer's default
                    depths.append(i)
                    drops.append(alive ^ now)
                alive = now
                if not alive:
                    break
        if alive:
            depths.append(len(blocks))
            drops.append(alive)
        return _depths(depths, drops, n)

    # -- updates -----------------------------------------------------------------------------

    def record(self, slot: int, blocks: Sequence[int]) -> None:
        """Engine ``slot`` was sent a request with these blocks: they become its most
        recent ones, the first block the most recent of all (a prefix loses its tail
        first, as vLLM frees a request's blocks last block first and SGLang evicts radix
        leaves); the least recently used beyond its capacity are evicted."""
        lru = self._lru[slot]
        if lru is None or lru.cap == 0 or not blocks:
            return
        if len(blocks) > lru.cap:  # a tail without its head is never a hit: keep the head
            blocks = blocks[: lru.cap]
        t0 = self._tick
        self._tick += len(blocks)
        top = t0 + len(blocks) - 1
        pos = lru.pos
        if len(set(blocks)) == len(blocks):  # the hashes chain: a repeat is a collision
            order: Sequence[int] = blocks
            ticks = np.arange(top, t0 - 1, -1, dtype=np.int64)
        else:
            first: dict[int, int] = {}
            for i, h in enumerate(blocks):
                first.setdefault(h, i)  # a repeated block is as recent as its first use
            order = list(first)
            ticks = top - np.fromiter(first.values(), dtype=np.int64, count=len(order))
        where_at = [pos.get(h, -1) for h in order]
        if min(where_at) >= 0:  # every block held (a conversation's next turn): touch
            lru.tick[where_at] = ticks
            return
        got = np.array(where_at, dtype=np.int64)
        held = got >= 0
        lru.tick[got[held]] = ticks[held]
        new = [h for h, s in zip(order, got.tolist(), strict=True) if s < 0]
        if not new:
            return
        over = len(pos) + len(new) - lru.cap
        if over > 0:  # the touched blocks are the newest: never among these
            spare = min(lru.cap >> _SPARE_SHIFT, len(pos) - (len(order) - len(new)) - over)
            self._drop(slot, lru, lru.oldest(over + max(spare, 0)))
        at = lru.take(len(new))
        lru.keys[at] = new
        lru.tick[at] = ticks[~held]
        bit = 1 << slot
        where = self._where
        for h, s in zip(new, at.tolist(), strict=True):
            pos[h] = s
            where[h] = where.get(h, 0) | bit
        self._size += len(new)

    def evict_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Exact mode: the engine says it dropped these blocks."""
        lru = self._lru[slot]
        if lru is None:
            return
        bit = 1 << slot
        gone = []
        for h in blocks:
            s = lru.pos.pop(h, None)
            if s is not None:
                gone.append(s)
                self._clear(h, bit)
        if gone:
            lru.give(np.array(gone, dtype=np.int64))
            self._size -= len(gone)

    def evict_oldest(self, slot: int, n: int) -> None:
        """Exact mode: the engine dropped ``n`` blocks (identities unknown): evict its
        ``n`` least recently used."""
        lru = self._lru[slot]
        if lru is None:
            return
        n = min(n, len(lru.pos))
        if n > 0:
            self._drop(slot, lru, lru.oldest(n))

    def clear(self, slot: int) -> None:
        """Exact mode: the engine's cache was reset: forget its blocks, keep its slot."""
        lru = self._lru[slot]
        if self._forget(slot) and lru is not None:
            self._lru[slot] = _Lru(lru.cap)

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

    def _forget(self, slot: int) -> bool:
        """Take an engine's blocks out of the inverted map (False: no such slot)."""
        lru = self._lru[slot]
        if lru is None:
            return False
        bit = 1 << slot
        for h in lru.pos:
            self._clear(h, bit)
        self._size -= len(lru.pos)
        return True

    def _drop(self, slot: int, lru: _Lru, victims: IntArray) -> None:
        """Evict these entry slots of one engine."""
        bit = 1 << slot
        pos = lru.pos
        for h in lru.keys[victims].tolist():
            del pos[h]
            self._clear(h, bit)
        lru.give(victims)
        self._size -= victims.shape[0]
