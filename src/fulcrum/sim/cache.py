"""Prefix cache of KV blocks with least-recently-used eviction.

The shared KV store of SPEC section 3 holds blocks of :data:`BLOCK_TOKENS` tokens keyed by
their ``hash_id``. A request's cached prefix is its longest run of leading blocks present
in the store; after the lookup every block of the request is touched (hits) or inserted
(misses), evicting the least recently used blocks beyond ``capacity_blocks``.
``capacity_blocks = 0`` disables caching; ``None`` is unbounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fulcrum.sim.workload import BLOCK_TOKENS


class BlockCache:
    """LRU set of block ids (the simulator's only mutable cache state)."""

    __slots__ = ("_blocks", "capacity_blocks", "hit_tokens", "lookup_tokens")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks: must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0

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
        if self.capacity_blocks == 0 or not hash_ids:
            return 0
        blocks = self._blocks
        hits = 0
        for h in hash_ids:
            if h in blocks:
                hits += 1
            else:
                break
        for h in hash_ids:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
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
