"""Prefix-affinity take order over a tier queue (with :mod:`fulcrum.core.prefill.affinity`).

Within the fairness bound (the tier's head waited less than the tier's bound: the
shell's ``affinity.max_wait_ns`` for the shortest tier, scaled by each tier's batch cap),
a pull looks at the tier's first ``affinity.scan`` live requests (the *window*) and, for
each, the leading blocks every engine that may serve the tier holds. An engine's take
order: a request another engine holds a longer prefix of waits for it only while that
holder is predicted to finish it sooner (its least-loaded rank's remaining work, and no
sooner than the end of the step it is running, plus the window's earlier requests that
wait for it spread over its ranks, plus its cost there, against this engine's; issue 21),
and never past the bound; the rest go longest held prefix first, FIFO among equals.
Past the bound, pulls are FIFO (a fairness override). Pure functions over queued
records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fulcrum.core.prefill.affinity import Affinity
from fulcrum.core.prefill.chunks import busy_budget
from fulcrum.core.prefill.items import EngineEntry, Offer, Queued
from fulcrum.core.prefix_cost import predicted_ttft_one_ns


@dataclass(frozen=True, slots=True)
class Window:
    """The window's requests (head first) and, per request, engine -> held blocks."""

    items: list[Queued]
    held: list[dict[str, int]]
    #: The tier's fairness bound (ns): a request waits for a holder at most this long.
    bound_ns: int


def window(
    aff: Affinity, queue: Iterable[Queued], serving: list[str], now_ns: int,
    alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
    bound_ns: int | None = None,
) -> Window | None:
    """The affinity window of a tier (``queue`` head first; ``serving``: engines that may
    serve it); None when affinity does not apply (nothing queued, or the head waited past
    the fairness bound: FIFO). Dead requests met (``alive`` false) go to ``dead``."""
    items: list[Queued] = []
    for item in queue:
        if alive is not None and not alive(item):
            if dead is not None:
                dead.append(item)
            continue
        items.append(item)
        if len(items) >= aff.scan:
            break
    bound = aff.max_wait_ns if bound_ns is None else bound_ns
    if not items or now_ns - items[0].enqueued_ns >= bound:
        return None
    idx = aff.index
    held = [
        {e: m for e in serving if (m := idx.match_memo(e, it.blocks, it.held))}
        if it.blocks else {}
        for it in items
    ]
    return Window(items, held, bound)


#: Predicted finish (ns from now) of a request on an engine holding ``matched`` of its
#: leading blocks, after ``ahead`` ns of other waiting work that engine takes first:
#: ``finish(engine_id, item, matched, ahead)``.
Finish = Callable[[str, Queued, int, int], int]


def sooner_holder(finish: Finish, engine_id: str, item: Queued, held: dict[str, int],
                  mine: int, ahead: dict[str, int] | None = None) -> str | None:
    """The engine holding more of ``item``'s prefix than ``engine_id`` (``mine`` blocks;
    ``held``: engine -> leading blocks held) predicted to finish it first, after
    ``ahead[e]`` ns of earlier requests waiting for it; None when ``engine_id`` is
    predicted no later than every such holder. O(holders), no index look-up."""
    at = finish(engine_id, item, mine, 0)
    best = None
    for e, m in held.items():
        if m > mine and e != engine_id:
            t = finish(e, item, m, 0 if ahead is None else ahead.get(e, 0))
            if t < at:
                best, at = e, t
    return best


def order_for(aff: Affinity, engine_id: str, now_ns: int, w: Window,
              finish: Finish | None = None) -> list[Queued]:
    """``engine_id``'s take order over the window ``w`` (see the module docstring). With
    ``finish``, a request waits for a holder of a longer prefix only while that holder is
    predicted to finish it sooner, after the window's earlier requests that wait for it
    (issue 21); without, whenever one exists."""
    ranked: list[tuple[int, int, Queued]] = []
    ahead: dict[str, int] = {}
    for i, (item, h) in enumerate(zip(w.items, w.held, strict=True)):
        mine = h.get(engine_id, 0)
        if h and now_ns - item.enqueued_ns < w.bound_ns and max(h.values()) > mine:
            if finish is None:
                continue  # it waits for its holder
            e = sooner_holder(finish, engine_id, item, h, mine, ahead)
            if e is not None:  # its holder is predicted to finish it sooner
                ahead[e] = ahead.get(e, 0) + matched_cost(aff, item, h[e])
                continue
        ranked.append((-mine, i, item))
    ranked.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in ranked]


def seen(eng: EngineEntry, loads: Sequence[int], ranks: Sequence[int],
         costs: Sequence[int], now_ns: int | None,
         step: Callable[[Sequence[int]], int] | None = None) -> None:
    """Remember ``eng``'s least-loaded rank load (ns) after a pull at ``now_ns``: its
    rank loads plus each taken request's cost on the rank it went to; with ``step`` (the
    predicted length of the step those loads start, ns), when it pulls next. Without it
    the engine is at a step boundary (pulling now)."""
    if now_ns is None:
        return
    after = list(loads)
    for r, cost in zip(ranks, costs, strict=True):
        after[r] += cost
    eng.min_rank_ns, eng.seen_ns = min(after, default=0), now_ns
    eng.step_ns = 0 if step is None else step(after)


def step_ns(loads: Sequence[int], limit_ns: int, floor_ns: int) -> int:
    """Predicted length (ns) of the step an engine starts with these rank loads (ns):
    its budget is the lightest busy rank's work within ``[floor_ns, limit_ns]`` (the MIN
    of :func:`fulcrum.core.prefill.chunks.rank_budget` over its ranks), and it lasts
    that long or until its busiest rank is done, whichever comes first; 0 when every
    rank is idle (the engine waits for work, it pulls at once)."""
    busy = [x for x in loads if x > 0]
    if not busy:
        return 0
    return int(min(busy_budget(min(busy), limit_ns, floor_ns), max(busy)))


def matched_cost(aff: Affinity, item: Queued, matched: int) -> int:
    """Quota (ns) ``item`` costs an engine holding ``matched`` of its leading blocks: its
    miss tokens priced by the cost model (:func:`fulcrum.core.prefix_cost.predicted_ttft_one_ns`
    at no load, the gateway's pricing), never above what a global pool's ``cached``
    would give."""
    return min(_pool_cost(aff, item), predicted_ttft_one_ns(
        0, matched * aff.index.block_tokens, item.total, aff.cost_ns))


def _pool_cost(aff: Affinity, item: Queued) -> int:
    """``item``'s cost (ns) with a global pool's ``cached`` (its ``cost_ns``), or its
    full prompt's when none is reported: the most any engine is charged."""
    return item.cost_ns if item.cached else predicted_ttft_one_ns(
        0, 0, item.total, aff.cost_ns)


def finish_ns(aff: Affinity, eng: EngineEntry | None, item: Queued, matched: int,
              now_ns: int, pulling: bool = False, ahead_ns: int = 0) -> int:
    """Predicted finish (ns from now) of ``item`` on engine ``eng`` holding ``matched`` of
    its leading blocks (:func:`fulcrum.core.prefix_cost.predicted_ttft_one_ns`): that
    engine's least-loaded rank's load after its latest pull, drained by the time since
    (1 ns per ns), but no sooner than the end of the step that pull started (an engine
    mid-step pulls at its step boundary; ``pulling``: the engine is at one now), plus
    ``ahead_ns`` of other requests' work it takes first, spread over its DP ranks, plus
    the request's cost there (:func:`matched_cost`)."""
    if eng is None:
        return ahead_ns + matched_cost(aff, item, matched)
    since = max(0, now_ns - eng.seen_ns)
    load = max(0, eng.min_rank_ns - since)
    if not pulling:
        load = max(load, eng.step_ns - since)
    return load + ahead_ns // max(1, eng.dp_ranks) + matched_cost(aff, item, matched)


def able(aff: Affinity, offers: Sequence[Offer], now_ns: int, w: Window,
         can_take: Callable[[Offer, Queued], bool],
         finish: Finish | None = None) -> list[int]:
    """Indices of the ``offers`` able (``can_take``) to take the first request of their
    take order over ``w`` (:func:`order_for`, with ``finish`` as the pull's own order
    uses it), narrowed to those holding the longest prefix of it (when any holds one)."""
    firsts: dict[int, Queued] = {}
    for i, o in enumerate(offers):
        order = order_for(aff, o.engine_id, now_ns, w, finish)
        if order and can_take(o, order[0]):
            firsts[i] = order[0]
    found = list(firsts)
    pos = {id(it): j for j, it in enumerate(w.items)}
    held = {i: w.held[pos[id(firsts[i])]].get(offers[i].engine_id, 0) for i in found}
    top = max(held.values(), default=0)
    if top > 0:
        found = [i for i in found if held[i] == top]
    return found


def holder_tier(aff: Affinity, engines: Iterable[EngineEntry], bounds: Sequence[int],
                tier: int, total_tokens: int, blocks: Sequence[int]) -> int:
    """The tier of a request of ``total_tokens`` (tokens; by context: ``tier``) with these
    block hashes: a conversation's later turn that has grown past its tier's bound joins
    the shorter tier of the engine holding its longest prefix when its cost on that engine
    is no more than a fresh prompt at that tier's upper bound costs."""
    best: EngineEntry | None = None
    held = 0
    for e in engines:
        if 0 <= e.tier < tier:
            m = aff.index.match(e.engine_id, blocks)
            if m > held or (m == held and best is not None and e.tier < best.tier):
                best, held = e, m
    if best is None or held == 0:
        return tier
    bound = bounds[best.tier]
    if aff.cost_on(best.engine_id, total_tokens, blocks) <= aff.cost_ns(bound, 0):
        return best.tier
    return tier
