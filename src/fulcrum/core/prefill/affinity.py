"""Prefix affinity: which engine holds which KV blocks, and what a request costs each engine.

Most deployments have no global KV pool: each prefill engine keeps its own prefix cache
in GPU memory, so a request's cost depends on the engine that runs it. A request names
its prefix as *chained block hashes* (``blocks[i]`` = hash of (``blocks[i-1]``, token ids
of block ``i``), ``block_tokens`` tokens per block, default 512 as Mooncake's traces;
:mod:`fulcrum.client.prefix` computes them). Because the hashes are chained, a block
matches only when its whole prefix matches, so an engine's cached prefix of a request
is the longest leading run of the request's blocks that the engine holds.

:class:`PrefixIndex` is the balancer's belief of each engine's cache:

* **approximate** (default): the blocks of every request the balancer handed an engine
  (:meth:`PrefixIndex.record`), as an LRU bounded by the engine's registered cache
  capacity (blocks) -- the same eviction an engine's own prefix cache does: a request's
  blocks are touched last block first, so its head is the most recent and a prefix
  loses its tail first (vLLM frees a request's blocks in reverse order for that reason;
  SGLang's radix tree evicts leaves);
* **exact** (optional): blocks an engine reports stored / evicted
  (:meth:`PrefixIndex.stored`, :meth:`PrefixIndex.evicted`, as vLLM's and SGLang's KV
  events do).

Held blocks are therefore *prefix-closed*: a block is held only with its whole prefix
(its parent is touched after it on every insert, and evicted after it), and the engines'
own evictions keep that too. So the leading run of a request's blocks an engine holds is
found by bisection (:meth:`PrefixIndex.match`, O(log blocks) look-ups), not a walk.

Memory is bounded: at most ``capacity_blocks`` entries per engine (``MAX_CAPACITY_BLOCKS``
at most), one ``OrderedDict`` entry of a 64-bit hash each, about 100 bytes per block and
engine in CPython (dict slot, ordering link, the int) -- 20,000 blocks x 8 engines is
about 16 MB; plus one count per distinct block held anywhere (how many engines hold it,
:meth:`PrefixIndex.holders`), at most as many entries again; and for the requests' first
blocks it tracks (:meth:`PrefixIndex.starts`), the engines holding each, one entry per
engine and such block, dropped when nobody holds it. An engine that re-registers
starts empty unless it says its cache survived (``keep=True`` in
:meth:`PrefixIndex.add_engine`); forgetting an engine's blocks walks them once (2.8 ms
at 20,000 blocks, the default capacity).

:class:`Affinity` turns the index into per-engine costs for the balancer
(:meth:`fulcrum.core.prefill.balancer.PrefillBalancer.cost_for`): the request's miss
tokens on that engine priced by the cost model the shell passes in, and the
``max_wait_ns`` fairness bound after which a pull takes FIFO again.

Pure: no clock, no I/O; every time is passed in (ns).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from fulcrum.core.prefix_cost import predicted_ttft_one_ns

DEFAULT_BLOCK_TOKENS: Final = 512
"""Tokens per KV block of the prefix identity (Mooncake's traces use 512)."""

MAX_CAPACITY_BLOCKS: Final = 1 << 24
"""Largest cache capacity an engine may register (blocks; 8G tokens at 512 per block)."""

MAX_REQUEST_BLOCKS: Final = 1 << 16
"""Most block hashes one request may carry (32M tokens at 512 per block)."""

DEFAULT_MAX_WAIT_NS: Final = 2_000_000_000
"""Default fairness bound (ns): once a tier's head waited this long, pulls take FIFO."""

DEFAULT_SCAN: Final = 32
"""Queued requests a pull looks at for affinity (bounds the work of one pull)."""


@dataclass(slots=True)
class EngineCache:
    """One engine's believed cache: an LRU of block hashes (oldest first) and counters
    of the blocks looked up and found by :meth:`PrefixIndex.record` (its hit ratio)."""

    capacity_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    hit_blocks: int = 0
    lookup_blocks: int = 0
    #: Bumped on every change of ``blocks``: a match memoised at this version still holds.
    version: int = 0
    #: Unique per cache object of an index (a re-registered engine gets a new one).
    uid: int = 0
    #: The index's count of engines holding each block (shared by its caches).
    counts: dict[int, int] = field(default_factory=dict)
    #: The index's engines holding each block it tracks (shared; :meth:`PrefixIndex.starts`).
    where: dict[int, dict[str, None]] = field(default_factory=dict)
    #: The engine this cache is (its key in ``where``).
    engine_id: str = ""
    #: The index's count of blocks held, all engines (shared; :meth:`PrefixIndex.size`).
    tally: list[int] = field(default_factory=lambda: [0])

    def evict_to(self, cap: int) -> None:
        """Drop least recently used blocks until at most ``cap`` remain."""
        b = self.blocks
        while len(b) > cap:
            self.drop(b.popitem(last=False)[0])
            self.version += 1

    def drop(self, block: int) -> None:
        """Count ``block`` as no longer held here (it left :attr:`blocks`)."""
        n = self.counts[block] - 1
        self.tally[0] -= 1
        if n:
            self.counts[block] = n
            w = self.where.get(block)
            if w is not None:
                del w[self.engine_id]
        else:
            del self.counts[block]
            self.where.pop(block, None)  # nobody holds it: no longer tracked

    def add(self, block: int, first: bool) -> None:
        """Count ``block`` as held here (it joined :attr:`blocks`); a request's ``first``
        block that nobody held is tracked from now on (who holds it is known: only this)."""
        n = self.counts.get(block, 0)
        self.counts[block] = n + 1
        self.tally[0] += 1
        w = self.where.get(block)
        if w is not None:
            w[self.engine_id] = None
        elif first and not n:
            self.where[block] = {self.engine_id: None}


class PrefixIndex:
    """Which engine holds which blocks (see module docstring). One owner, not thread-safe."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens: must be >= 1")
        self.block_tokens = block_tokens
        self._engines: dict[str, EngineCache] = {}
        #: Block -> engines holding it (for :meth:`holders`; one entry per distinct block).
        self._counts: dict[int, int] = {}
        #: Block -> the engines holding it, for the blocks tracked (requests' first blocks
        #: asked for by :meth:`starts`, or recorded when nobody held them), while held.
        self._where: dict[int, dict[str, None]] = {}
        self._tally = [0]  # blocks held, all engines (:meth:`size`)
        self._uids = 0

    # -- engines --------------------------------------------------------------------------

    def add_engine(self, engine_id: str, capacity_blocks: int, *, keep: bool = False) -> None:
        """An engine (re-)registered with a cache of ``capacity_blocks`` blocks. Its
        believed content is dropped unless ``keep`` (the engine says its cache survived);
        kept content is trimmed to the new capacity."""
        if not 0 <= capacity_blocks <= MAX_CAPACITY_BLOCKS:
            raise ValueError(f"capacity_blocks: must be in [0, {MAX_CAPACITY_BLOCKS}]")
        old = self._engines.get(engine_id)
        if keep and old is not None:
            old.capacity_blocks = capacity_blocks
            old.evict_to(capacity_blocks)
            return
        self.remove_engine(engine_id)
        self._uids += 1
        self._engines[engine_id] = EngineCache(capacity_blocks, uid=self._uids,
                                               counts=self._counts, where=self._where,
                                               engine_id=engine_id, tally=self._tally)

    def remove_engine(self, engine_id: str) -> None:
        """Forget an engine (it left)."""
        c = self._engines.pop(engine_id, None)
        if c is not None:
            for h in c.blocks:
                c.drop(h)

    def engine_ids(self) -> list[str]:
        """Engines known to the index."""
        return list(self._engines)

    def cache(self, engine_id: str) -> EngineCache | None:
        """An engine's believed cache, or None (read-only use)."""
        return self._engines.get(engine_id)

    def size(self) -> int:
        """Blocks held in the index, all engines (kept as blocks come and go)."""
        return self._tally[0]

    # -- queries --------------------------------------------------------------------------

    def match(self, engine_id: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` that ``engine_id`` holds (0 for an unknown engine),
        by bisection on the last one it holds: O(log len(blocks)) look-ups, since held
        blocks are prefix-closed (module docstring). 0 whenever the first block is not
        held (an engine reuses no prefix without it); only where an engine's eviction
        report left a hole inside a prefix (a lost event) can it exceed the leading run."""
        c = self._engines.get(engine_id)
        if c is None or not blocks or blocks[0] not in c.blocks:
            return 0
        held, lo, hi = c.blocks, 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def holders(self, block: int) -> int:
        """How many engines hold ``block`` (one look-up)."""
        return self._counts.get(block, 0)

    def starts(self, engines: Sequence[str] | Mapping[str, int],
               firsts: Iterable[int]) -> dict[int, list[str]]:
        """Block of ``firsts`` -> the ``engines`` holding it, in ``engines``' order (a
        sequence, or engine -> position: what a caller keeps across calls). Only these
        engines can hold a prefix starting with that block (:meth:`match`). It costs the
        holders, not every engine: a block nobody holds is one count look-up; the engines
        holding a block are tracked once it has been asked for (one pass over the engines
        then) or recorded as a request's first block while nobody held it, until nobody
        holds it. A dispatch's or a window's first blocks, a few hundred at most."""
        out: dict[int, list[str]] = {}
        order = engines if isinstance(engines, Mapping) else {
            e: i for i, e in enumerate(engines)}
        for h in firsts:
            got = [e for e in self.holding(h) if e in order]
            if len(got) > 1:
                got.sort(key=order.__getitem__)
            if got:
                out[h] = got
        return out

    def holding(self, block: int) -> Collection[str]:
        """The engines holding ``block`` (any order; the tracked set, see :meth:`starts`:
        do not change it). A block nobody holds is one count look-up."""
        if not self._counts.get(block, 0):
            return ()
        w = self._where.get(block)
        if w is None:
            w = self._where[block] = {
                e: None for e, c in self._engines.items() if block in c.blocks}
        return w.keys()

    def holds_any(self, engine_id: str, blocks: frozenset[int]) -> bool:
        """True when ``engine_id`` holds any of ``blocks`` (one C-level pass over the
        smaller of the two sets)."""
        c = self._engines.get(engine_id)
        return c is not None and not c.blocks.keys().isdisjoint(blocks)

    def holds(self, engine_id: str, block: int) -> bool:
        """True when ``engine_id`` holds the block ``block`` (one look-up)."""
        c = self._engines.get(engine_id)
        return c is not None and block in c.blocks

    def best_match(self, blocks: Sequence[int], engines: Iterable[str] | None = None) -> int:
        """Longest leading run of ``blocks`` any of ``engines`` (default: all) holds. Only
        the engines holding its first block can hold any (:meth:`holding`): by default
        it costs those, not every engine."""
        if not blocks:
            return 0
        ids = self.holding(blocks[0]) if engines is None else engines
        return max((self.match(e, blocks) for e in ids), default=0)

    def cached_tokens(self, matched_blocks: int, total_tokens: int) -> int:
        """Tokens a match of ``matched_blocks`` saves on a ``total_tokens`` request: at
        most ``total_tokens - 1`` (the last token is always computed)."""
        return max(0, min(matched_blocks * self.block_tokens, total_tokens - 1))

    # -- updates --------------------------------------------------------------------------

    def record(self, engine_id: str, blocks: Sequence[int]) -> int:
        """``engine_id`` was handed a request with these blocks (approximate mode): count
        its hit blocks, touch its held blocks and insert the rest as most recent, evicting
        the least recently used beyond the capacity. Returns the matched leading blocks."""
        c = self._engines.get(engine_id)
        if c is None:
            return 0
        hit = self.match(engine_id, blocks)
        c.hit_blocks += hit
        c.lookup_blocks += len(blocks)
        if c.capacity_blocks == 0:
            return hit
        self._insert(c, blocks, first=True)
        return hit

    def stored(self, engine_id: str, blocks: Iterable[int]) -> None:
        """Exact mode: the engine reports these blocks stored (most recent)."""
        c = self._engines.get(engine_id)
        if c is not None and c.capacity_blocks:
            self._insert(c, blocks)

    def evicted(self, engine_id: str, blocks: Iterable[int]) -> None:
        """Exact mode: the engine reports these blocks evicted."""
        c = self._engines.get(engine_id)
        if c is not None:
            for h in blocks:
                if h in c.blocks:
                    del c.blocks[h]
                    c.drop(h)
            c.version += 1

    def match_memo(self, engine_id: str, blocks: Sequence[int],
                   memo: dict[str, tuple[int, int, int]]) -> int:
        """:meth:`match`, memoised in ``memo`` (engine id -> (cache identity, version,
        match)): recomputed only when that engine's cache changed since."""
        c = self._engines.get(engine_id)
        if c is None:
            return 0
        hit = memo.get(engine_id)
        if hit is not None and hit[0] == c.uid and hit[1] == c.version:
            return hit[2]
        m = self.match(engine_id, blocks)
        memo[engine_id] = (c.uid, c.version, m)
        return m

    @staticmethod
    def _insert(c: EngineCache, blocks: Iterable[int], first: bool = False) -> None:
        """``first``: ``blocks`` are a request's, ``blocks[0]`` its first block."""
        c.version += 1
        held = c.blocks
        got = tuple(blocks)
        for h in reversed(got):  # the head most recent: the tail goes first
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                c.add(h, first and h == got[0])
        c.evict_to(c.capacity_blocks)


@dataclass(slots=True)
class Affinity:
    """Per-engine costs for the balancer: ``cost_ns(q, c)`` is the shell's cost model
    (ns, with the fixed step cost, for ``q`` tokens after ``c`` cached); ``max_wait_ns``
    the fairness bound; ``scan`` how many queued requests a pull considers;
    ``approximate``: record what the balancer hands each engine as held (False: exact
    mode, the engines' KV events alone update the index).
    ``hits`` counts requests taken under affinity by an engine holding part of their
    prefix; ``overrides`` pulls that went FIFO because the head waited past the bound;
    ``holder_tiers`` pulls that went to another tier than the source rule's for a request
    the engine alone holds best (``balancer._held_tier``);
    ``tier_blocks[t]`` = [hit blocks, looked-up blocks] of the requests taken from tier
    ``t`` (the block hit ratio per tier; per engine: ``index.cache(e)``)."""

    index: PrefixIndex
    cost_ns: Callable[[int, int], int]
    max_wait_ns: int = DEFAULT_MAX_WAIT_NS
    scan: int = DEFAULT_SCAN
    approximate: bool = True
    hits: int = 0
    overrides: int = 0
    holder_tiers: int = 0
    tier_blocks: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_wait_ns < 0:
            raise ValueError("max_wait_ns: must be >= 0")
        if self.scan < 1:
            raise ValueError("scan: must be >= 1")

    def taken(self, engine_id: str, tier: int, blocks: Sequence[int]) -> int:
        """``engine_id`` took a request of ``tier`` with ``blocks``: count its hits per
        engine and tier, and (approximate mode) record its blocks as held. Returns the
        matched leading blocks."""
        idx = self.index
        if self.approximate:
            hit = idx.record(engine_id, blocks)
        else:
            hit = idx.match(engine_id, blocks)
            c = idx.cache(engine_id)
            if c is not None:
                c.hit_blocks += hit
                c.lookup_blocks += len(blocks)
        tb = self.tier_blocks.setdefault(tier, [0, 0])
        tb[0] += hit
        tb[1] += len(blocks)
        return hit

    def cost_on(self, engine_id: str, total: int, blocks: Sequence[int]) -> int:
        """Predicted cost (ns) of a ``total``-token request with ``blocks`` on ``engine_id``."""
        held = self.index.match(engine_id, blocks) * self.index.block_tokens
        return predicted_ttft_one_ns(0, held, total, self.cost_ns)

    def expected_cost(self, total: int, blocks: Sequence[int], cached: int = 0,
                      engines: Iterable[str] | None = None) -> int:
        """The cost (ns) a request is expected to have where affinity sends it: at the
        longest prefix any engine holds (at least ``cached`` tokens). The tier split
        counts demand at this cost."""
        held = self.index.best_match(blocks, engines) * self.index.block_tokens
        return predicted_ttft_one_ns(0, max(held, cached), total, self.cost_ns)
