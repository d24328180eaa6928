"""Prefix cache of KV blocks with least-recently-used eviction.

The shared KV store of SPEC section 3 holds blocks of :data:`BLOCK_TOKENS` tokens keyed by
their ``hash_id``. A request's cached prefix is its longest run of leading blocks present
in the store; after the lookup every block of the request is touched (hits) or inserted
(misses), evicting the least recently used blocks beyond ``capacity_blocks``.
``capacity_blocks = 0`` disables caching; ``None`` is unbounded.

Two cache models (``cache.mode`` of the cluster): ``global``, one store every engine
loads from (the lookup happens on arrival); ``per_engine``, one store per prefill engine
holding ``capacity_blocks / engines`` blocks (the same total), looked up when the request
reaches the engine that runs it (:func:`engine_caches`). Both count tokens
(:attr:`BlockCache.hit_ratio`) and blocks (:func:`block_hit_ratio`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fulcrum.sim.workload import BLOCK_TOKENS


class BlockCache:
    """LRU set of block ids (the simulator's only mutable cache state)."""

    __slots__ = ("_blocks", "capacity_blocks", "hit_blocks", "hit_tokens", "lookup_blocks",
                 "lookup_tokens")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks: must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.hit_blocks = 0
        self.lookup_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def lookup_and_insert(self, hash_ids: Sequence[int], input_tokens: int) -> int:
        """Cached prefix (tokens) of a request, then record its blocks as most recent.

        At most ``input_tokens - 1`` tokens are reported cached: the last token is always
        computed (it produces the first output token).
        """
        self.lookup_tokens += input_tokens
        self.lookup_blocks += len(hash_ids)
        if self.capacity_blocks == 0 or not hash_ids:
            return 0
        blocks = self._blocks
        hits = 0
        for h in hash_ids:
            if h in blocks:
                hits += 1
            else:
                break
        for h in reversed(hash_ids):  # the head most recent: the tail is evicted first
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self.hit_blocks += hits
        cap = self.capacity_blocks
        if cap is not None:
            while len(blocks) > cap:
                blocks.popitem(last=False)
        cached = min(hits * BLOCK_TOKENS, input_tokens - 1)
        self.hit_tokens += cached
        return max(0, cached)

    @property
    def hit_ratio(self) -> float:
        """Cached tokens / looked-up tokens so far (0 when nothing was looked up)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


GLOBAL = "global"
PER_ENGINE = "per_engine"
MODES = (GLOBAL, PER_ENGINE)
"""Cache models: one global pool, or one cache per prefill engine."""


def engine_caches(capacity_blocks: int | None, engines: int) -> list[BlockCache]:
    """Per-engine caches of ``capacity_blocks // engines`` blocks each (None: unbounded)."""
    per = None if capacity_blocks is None else capacity_blocks // max(1, engines)
    return [BlockCache(per) for _ in range(engines)]


def block_hit_ratio(caches: Sequence[BlockCache]) -> float:
    """Leading blocks found / blocks looked up, over ``caches`` (0 when none looked up)."""
    hit = sum(c.hit_blocks for c in caches)
    look = sum(c.lookup_blocks for c in caches)
    return hit / look if look else 0.0
