"""Priority bands on an engine's DP ranks (issue 23): who runs first on a rank, and how
much work is ahead of a request of a given band.

Without bands a rank's queue is FIFO and a pulled request of priority 1 waits behind the
priority-0 work its rank already holds (whole prompts of up to the tier's batch cap).
Its wait for an engine was worse: late binding lets an engine take work only while its
least-loaded rank holds less than the horizon, and under a priority-0 flood every rank
holds more, so a priority-1 request waited in the daemon's queue until some rank drained.

The rule (pure; the engine kit, the daemon and the simulator share it):

* **On the rank** (:func:`enqueue_task`): a task goes behind the last task of its band or
  a higher one, ahead of lower-band tasks (a lower-band task split mid-prompt pauses at
  its chunk boundary; its computed prefix stays). Within a band: FIFO. A lower-band task
  lets at most ``max_overtaken_tokens`` tokens of later higher-band work pass it
  (:data:`DEFAULT_MAX_OVERTAKEN_TOKENS`); past that it keeps its place, so no task on a
  rank waits forever (the engine-side counterpart of ``tenants.starvation_bound_ms``).
* **Work ahead** (:func:`band_loads`): for each band ``p`` an engine holds, per rank,
  the predicted cost (ns) of its tasks of priority ``p`` or higher. The engine sends
  them with its pull (``PullRequest.band_rank_loads``); the balancer binds and places a
  request of band ``p`` by these loads (:func:`loads_for`) instead of the rank's whole
  load, since that is what runs before it.

With one band everywhere nothing changes: FIFO queues, whole loads.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.items import Offer, Queued, Taken

if TYPE_CHECKING:  # chunks and the balancer import this module
    from collections.abc import Callable

    from fulcrum.core.prefill.balancer import PrefillBalancer
    from fulcrum.core.prefill.chunks import PrefillTask
    from fulcrum.core.prefill.items import EngineEntry

DEFAULT_MAX_OVERTAKEN_TOKENS: Final = 65_536
"""Most tokens of later, higher-band work that may pass a task on its rank (our
decision: two of the largest chunks, about 4 s of compute at the default cost model)."""


def enqueue_task(queue: deque[PrefillTask], task: PrefillTask,
                 max_overtaken_tokens: int = DEFAULT_MAX_OVERTAKEN_TOKENS) -> int:
    """Put ``task`` on a rank's queue (head first): behind every task of its band or a
    higher one, ahead of the lower-band tasks at the tail that may still be passed (each
    passed task's ``overtaken`` grows by ``task.need`` tokens and may not pass
    ``max_overtaken_tokens``). Returns how many tasks it passed. O(tasks passed)."""
    if not queue or queue[-1].priority >= task.priority:
        queue.append(task)
        return 0
    passed = 0
    n = len(queue)
    while passed < n:
        prev = queue[n - 1 - passed]
        if prev.priority >= task.priority or prev.overtaken + task.need > max_overtaken_tokens:
            break
        passed += 1
    if passed == 0:
        queue.append(task)
        return 0
    tail = [queue.pop() for _ in range(passed)]
    queue.append(task)
    for t in reversed(tail):
        queue.append(dataclasses.replace(t, overtaken=t.overtaken + task.need))
    return passed


def band_loads(queues: Sequence[Iterable[PrefillTask]], model: CostModel,
               max_overtaken_tokens: int = DEFAULT_MAX_OVERTAKEN_TOKENS) -> dict[int, list[int]]:
    """Per band ``p`` present on the engine, per rank: the predicted cost (ns) of what runs
    before a new request of band ``p`` there -- its tasks of priority ``p`` or higher, and
    every task up to the last lower-band one that may no longer be passed (``overtaken``
    at ``max_overtaken_tokens``). ``queues[r]``: rank r's queue, head first; the lowest
    band's loads are the whole loads. Empty when the engine holds nothing. O(tasks x
    bands)."""
    ranks = [[(t.priority, t.overtaken >= max_overtaken_tokens,
               int(model.cost_ns(t.need, t.computed))) for t in q] for q in queues]
    bands = sorted({prio for rank in ranks for prio, _, _ in rank})
    out: dict[int, list[int]] = {}
    for p in bands:
        row = []
        for rank in ranks:
            stuck = max((i for i, (prio, full, _) in enumerate(rank) if prio < p and full),
                        default=-1)
            row.append(sum(ns for i, (prio, _, ns) in enumerate(rank)
                           if i <= stuck or prio >= p))
        out[p] = row
    return out


def loads_for(priority: int, rank_loads_ns: Sequence[int],
              bands: Mapping[int, Sequence[int]] | None) -> Sequence[int]:
    """The rank loads (ns) that run before a request of ``priority``: those of the lowest
    reported band at or above it (zero when the engine holds nothing of its band or
    higher); the whole ``rank_loads_ns`` when the engine reports no bands."""
    if not bands:
        return rank_loads_ns
    above = [p for p in bands if p >= priority]
    if not above:
        return [0] * len(rank_loads_ns)
    return bands[min(above)]


def _freed(whole: Sequence[int], ahead: Sequence[int]) -> int:
    return sum(max(0, int(a) - int(b)) for a, b in zip(whole, ahead, strict=True))


def offer_for(offer: Offer, priority: int) -> tuple[Sequence[int], int]:
    """An offer's rank loads and remaining quota (ns) as a request of ``priority`` sees
    them: the work ahead of its band, and the quota that work leaves free."""
    whole = offer.rank_loads_ns
    ahead = loads_for(priority, whole, offer.band_loads)
    if ahead is whole or len(ahead) != len(whole):
        return whole, offer.remaining_ns
    return ahead, offer.remaining_ns + _freed(whole, ahead)


def band_pass(bal: PrefillBalancer, eng: EngineEntry, tier: int, remaining_ns: int,
              loads: list[int], bands: Mapping[int, Sequence[int]] | None,
              limit: int | None, alive: Callable[[Queued], bool] | None,
              now_ns: int | None) -> Taken | None:
    """The band pass of :meth:`PrefillBalancer.take`: when ``tier``'s first request in
    take order is of a band with less work ahead on the engine (``bands``) than the whole
    rank ``loads``, take the requests of that band or higher by that work (the quota it
    leaves free added to ``remaining_ns``); None when there is nothing to do so."""
    if not bands:
        return None
    head = next(iter(bal.queued(tier, now_ns)), None)
    if head is None:
        return None
    band = head.cls.priority
    ahead = [max(0, int(x)) for x in loads_for(band, loads, bands)]
    if len(ahead) != len(loads) or sum(ahead) >= sum(loads):
        return None
    pull = bal._start_pull(eng, tier, ahead, remaining_ns + _freed(loads, ahead), limit,
                           alive, now_ns)
    pull.band = band
    pull.run(bal.queued(tier, now_ns), alive, bal.cost_for)
    taken = pull.commit(tier, ahead, bal.remove, now_ns)
    bal._charge(taken, pull.costs, now_ns)
    return taken if taken.items or taken.dead else None


def after_pass(first: Taken | None, loads: Sequence[int], remaining_ns: int,
               limit: int | None) -> tuple[list[int], int, int | None]:
    """Rank loads, remaining quota (ns) and request limit left for the usual pass after
    the band pass ``first`` (unchanged when there was none)."""
    after = list(loads)
    if first is None:
        return after, remaining_ns, limit
    for r, c in zip(first.ranks, first.costs_ns, strict=True):
        after[r] += c
    if limit is not None and limit > 0:
        limit = max(1, limit - len(first.items))
    return after, remaining_ns - first.quota_ns, limit
