"""DP-rank assignment inside one pulled prefill batch: least quota load first.

Rule (SPEC section 3, level 3): the requests of a batch are taken in FIFO order; each goes
to the DP rank whose quota load is lowest, where a rank's load (ns) is the outstanding
load the engine reported for it plus the predicted cost (ns) of the requests this batch
has already given it. Ties go to the lowest rank index. Deterministic; O(B log R).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

NAME: Final = "least_loaded"


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Ranks chosen for a batch: ``ranks[i]`` is the DP rank of request ``i`` (FIFO order);
    ``loads_ns[r]`` is rank ``r``'s load (ns) after the batch."""

    ranks: tuple[int, ...]
    loads_ns: tuple[int, ...]


def assign_ranks(loads_ns: Sequence[int], costs_ns: Sequence[int]) -> RankPlan:
    """Least-loaded rank for each request of a batch.

    ``loads_ns`` has one entry per DP rank (R >= 1, each >= 0 ns): reported outstanding load;
    ``costs_ns`` has one entry per request in FIFO order (each >= 0 ns): predicted cost.
    """
    if not loads_ns:
        raise ValueError("rank_loads_ns: need at least one DP rank")
    if any(x < 0 for x in loads_ns):
        raise ValueError("rank_loads_ns: must be >= 0")
    if any(x < 0 for x in costs_ns):
        raise ValueError("costs_ns: must be >= 0")
    heap = [(int(load), r) for r, load in enumerate(loads_ns)]
    heapq.heapify(heap)
    ranks: list[int] = []
    for cost in costs_ns:
        load, r = heap[0]
        ranks.append(r)
        heapq.heapreplace(heap, (load + int(cost), r))
    loads = [0] * len(loads_ns)
    for load, r in heap:
        loads[r] = load
    return RankPlan(ranks=tuple(ranks), loads_ns=tuple(loads))
