"""Prefix-affinity take order over a tier queue (with :mod:`fulcrum.core.prefill.affinity`).

Within the fairness bound (the tier's head waited less than the tier's bound: the
shell's ``affinity.max_wait_ns`` for the shortest tier, scaled by each tier's batch cap),
a pull looks at the tier's live requests from the head (the *window*) and, for each, the
leading blocks every engine that may serve the tier holds. An engine's take order: a
request another engine holds a longer prefix of waits for it only while that holder is
predicted to finish it sooner (its least-loaded rank's remaining work, and no sooner than
the end of the step it is running, plus the window's earlier requests that wait for it
or that it alone holds most of, spread over its ranks, plus its cost there, against this
engine's; issue 21), and never past the bound. A holder nobody else waits for may also
be later by the recompute it saves, capped at :data:`GRACE_FLOORS` step floors, a cap
that shrinks to none as the request's wait grows from one cap to two (the *grace*: an
engine's own finish is not the fleet's; the recompute is GPU time every later request
waits for), and only while the request's predicted first token there (its wait so far
plus that holder's finish) stays within the unloaded cost of its tier's largest prompt
(:attr:`Window.tail_ns`): a grace trades the request's own latency for the fleet's GPU
time, and must not make it one of its tier's slowest requests. The rest go longest
held prefix first, FIFO among equals; the order ends at ``affinity.scan`` requests, not
counting those left to a holder (so the window runs to at most :data:`SCAN_CAP` x
``scan`` requests, matched only as far as the order reads). Past the bound, pulls are
FIFO (a fairness override). Pure functions over queued records.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.chunks import busy_budget
from fulcrum.core.prefill.items import EngineEntry, Offer, Queued
from fulcrum.core.prefix_cost import predicted_ttft_one_ns

#: The window runs up to this many times ``affinity.scan`` requests: an engine's take
#: order skips those waiting for another engine and stops at ``scan`` others. 2 is the
#: largest multiple that keeps one decision under 3 ms in ``benchmarks/bench_prefix.py``'s
#: worst cases (3: 3.4 ms); 4 made the same decisions on every simulator trace tried
#: (BENCHMARKS.md, "Prefix affinity ... stop 36").
SCAN_CAP = 2

#: The grace a request may wait for a holder predicted later than the puller (the
#: recompute the holder saves, :func:`sooner_holder`) is at most this many step floors;
#: it shrinks to none as the request's wait goes from that to twice that.
GRACE_FLOORS = 2


def grace_ns(step_floor_ns: int) -> int:
    """The grace's cap (ns) for a balancer whose step floor is ``step_floor_ns``."""
    return GRACE_FLOORS * max(0, step_floor_ns)


@dataclass(frozen=True, slots=True)
class Window:
    """The window's requests (head first) and, per request, engine -> held blocks
    (:meth:`held`, matched on first use: a take order that ends early never matches the
    requests past its end)."""

    items: list[Queued]
    #: The engines that may serve the tier (the only ones matched), in the order
    #: :meth:`held` lists them (or each to its position in that order).
    serving: Sequence[str] | Mapping[str, int]
    index: PrefixIndex
    #: The tier's fairness bound (ns): a request waits for a holder at most this long.
    bound_ns: int
    #: The unloaded cost (ns) of the tier's largest prompt (None: no upper bound): a
    #: request waits on a grace only while its predicted first token stays within it.
    tail_ns: int | None = None
    _held: list[dict[str, int]] = field(default_factory=list)
    _first: list[dict[int, list[str]]] = field(default_factory=list)
    _costs: dict[tuple[int, int], int] = field(default_factory=dict)
    _tops: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    #: The shared walk per (load part, now, grace) (:func:`order_for`).
    _walks: dict[tuple[int, int, int], _Walk] = field(default_factory=dict)
    #: Engine -> positions of the requests it holds a prefix of (:meth:`mine`; built once).
    _mine: list[dict[str, list[int]]] = field(default_factory=list)
    #: Per request: its holders as (-blocks, position in :meth:`held`, engine), sorted.
    _deep: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    _above: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)

    def held(self, i: int) -> dict[str, int]:
        """Engine -> leading blocks held of ``items[i]`` (engines holding none left out,
        the rest in :attr:`serving`'s order). Only the engines holding its first block
        are matched (:meth:`PrefixIndex.starts`, once per window: the holders of each
        first block, not every serving engine)."""
        got = self._held
        while len(got) <= i:
            it = self.items[len(got)]
            got.append({e: m for e in self._starts().get(it.blocks[0], ())
                        if (m := self.index.match_memo(e, it.blocks, it.held))}
                       if it.blocks else {})
        return got[i]

    def above(self, i: int, mine: int) -> dict[str, int]:
        """:meth:`held` of ``items[i]``, but, when more than 16 engines hold some of it,
        only those holding more than ``mine`` blocks, in the same order: who a request
        may wait for (:func:`sooner_holder`, which skips the others itself). It costs
        those engines (after one sort per request), not every holder: when every engine
        holds a shared prompt, a few."""
        h = self.held(i)
        if len(h) <= 16:
            return h  # few holders: sooner_holder skips those holding no more itself
        key = (i, mine)
        got = self._above.get(key)
        if got is None:
            deep = self._deep.get(i)
            if deep is None:
                deep = self._deep[i] = sorted((-m, k, e) for k, (e, m) in enumerate(h.items()))
            cut = bisect.bisect_left(deep, (-mine, -1, ""))
            got = self._above[key] = {e: -m for m, _, e in sorted(deep[:cut],
                                                                  key=lambda x: x[1])}
        return got

    def _starts(self) -> dict[int, list[str]]:
        """First block of a window request -> the serving engines holding it."""
        if not self._first:
            firsts = frozenset(it.blocks[0] for it in self.items if it.blocks)
            self._first.append(self.index.starts(self.serving, firsts))
        return self._first[0]

    def cost(self, aff: Affinity, item: Queued, matched: int) -> int:
        """:func:`matched_cost` of ``item`` at ``matched`` blocks, computed once per
        window (it does not depend on the engine that asks)."""
        key = (id(item), matched)
        got = self._costs.get(key)
        if got is None:
            got = self._costs[key] = matched_cost(aff, item, matched)
        return got

    def cost_for(self, aff: Affinity, item: Queued, engine_id: str) -> int:
        """:meth:`PrefillBalancer.cost_for` (quota, ns) of ``item`` on ``engine_id``: its
        :meth:`cost` at the blocks that engine holds of it (one look-up when it holds
        none), computed once per window and depth, not once per engine."""
        if not item.blocks:
            return item.cost_ns
        return self.cost(aff, item, self.index.match(engine_id, item.blocks))

    def shared(self, key: tuple[int, int, int], engine_id: str) -> _Walk:
        """The walk of an engine holding none of the window's requests whose load part,
        decision time and grace are ``key`` (started for ``engine_id``, one of them, on
        first use): every engine with that key walks the same way up to the first
        request it holds (:func:`order_for`)."""
        got = self._walks.get(key)
        if got is None:
            got = self._walks[key] = _Walk(rep=engine_id, adds=[])
        return got

    def mine(self, engine_id: str) -> list[int]:
        """Positions in :attr:`items` of the requests ``engine_id`` holds a prefix of
        (ascending): those whose first block it holds (:meth:`PrefixIndex.match`), so
        nothing is matched."""
        return self.holding().get(engine_id, [])

    def holding(self) -> dict[str, list[int]]:
        """:meth:`mine` of every engine holding a prefix of any request (built once)."""
        if not self._mine:
            got: dict[str, list[int]] = {}
            starts = self._starts()
            for i, it in enumerate(self.items):
                for e in starts.get(it.blocks[0], ()) if it.blocks else ():
                    got.setdefault(e, []).append(i)
            self._mine.append(got)
        return self._mine[0]

    def top(self, i: int) -> tuple[int, str | None]:
        """The longest prefix any engine holds of ``items[i]`` (blocks) and the one engine
        holding it (None: nobody, or a tie)."""
        got = self._tops.get(i)
        if got is None:
            h = self.held(i)
            m = max(h.values(), default=0)
            tops = [e for e, x in h.items() if x == m]
            got = self._tops[i] = (m, tops[0] if m > 0 and len(tops) == 1 else None)
        return got


def window(
    aff: Affinity, queue: Iterable[Queued], serving: Sequence[str] | Mapping[str, int],
    now_ns: int,
    alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
    bound_ns: int | None = None, tail_ns: int | None = None,
) -> Window | None:
    """The affinity window of a tier (``queue`` head first; ``serving``: engines that may
    serve it); None when affinity does not apply (nothing queued, or the head waited past
    the fairness bound: FIFO). Dead requests met (``alive`` false) go to ``dead``.
    ``tail_ns``: :attr:`Window.tail_ns` (None: the tier has no upper bound)."""
    items: list[Queued] = []
    for item in queue:
        if alive is not None and not alive(item):
            if dead is not None:
                dead.append(item)
            continue
        items.append(item)
        if len(items) >= aff.scan * SCAN_CAP:
            break
    bound = aff.max_wait_ns if bound_ns is None else bound_ns
    if not items or now_ns - items[0].enqueued_ns >= bound:
        return None
    return Window(items, serving, aff.index, bound, tail_ns)


#: Predicted finish (ns from now) of a request on an engine holding ``matched`` of its
#: leading blocks, after ``ahead`` ns of other waiting work that engine takes first:
#: ``finish(engine_id, item, matched, ahead)``.
Finish = Callable[[str, Queued, int, int], int]


def sooner_holder(finish: Finish, engine_id: str | None, item: Queued,
                  held: dict[str, int], mine: int, ahead: dict[str, int] | None = None,
                  cost: Callable[[int], int] | None = None, grace_ns: int = 0,
                  until_ns: int | None = None, at_ns: int | None = None) -> str | None:
    """The engine holding more of ``item``'s prefix than ``engine_id`` (``mine`` blocks;
    ``held``: engine -> leading blocks held) predicted to finish it first, after
    ``ahead[e]`` ns of earlier requests waiting for it; None when ``engine_id`` is
    predicted no later than every such holder. With ``cost`` (matched blocks -> ns) and
    ``grace_ns``, a holder with nothing ``ahead`` counts as sooner while it is predicted
    later by less than the recompute it saves (``cost(mine) - cost(its blocks)``), at
    most ``grace_ns`` (one request at a time waits on a grace: no pile-up on a holder),
    and only when that holder's finish is at most ``until_ns`` (ns from now; None: no
    limit). ``at_ns``: ``engine_id``'s own finish when the caller has it (None:
    ``finish``; an ``engine_id`` of None, an engine holding none of it, must give it).
    O(holders), no index look-up."""
    if at_ns is not None:
        at = at_ns
    else:
        assert engine_id is not None
        at = finish(engine_id, item, mine, 0)
    best, bt = None, None
    for e, m in held.items():
        if m > mine and e != engine_id:
            before = 0 if ahead is None else ahead.get(e, 0)
            t = finish(e, item, m, before)
            g = 0 if cost is None or grace_ns <= 0 or before > 0 \
                or (until_ns is not None and t > until_ns) \
                else max(0, min(cost(mine) - cost(m), grace_ns))
            if t < at + g and (bt is None or t < bt):
                best, bt = e, t
    return best


def order_for(aff: Affinity, engine_id: str, now_ns: int, w: Window,
              finish: Finish | None = None, grace_ns: int = 0,
              first: bool = False) -> list[Queued]:
    """``engine_id``'s take order over the window ``w`` (see the module docstring). With
    ``finish``, a request waits for a holder of a longer prefix only while that holder is
    predicted to finish it sooner (or later by less than the recompute it saves, at most
    ``grace_ns`` while the request waited less than ``grace_ns``, shrinking to none at
    twice that: :func:`sooner_holder`), after the window's earlier requests that wait for
    it or that it alone holds the longest prefix of (it takes those first; issue 21);
    without, whenever one exists. It ends once it holds ``aff.scan`` requests: the ones
    waiting for another engine do not count (the window runs up to ``SCAN_CAP`` times
    ``aff.scan``). With ``first``, only its first request is exact (what :func:`pick`
    reads): the walk ends once it has one and has passed every request the engine holds.

    With a :class:`Pricer`, engines with the same load part (:meth:`Pricer.load_ns`) walk
    alike up to the first request they hold: that part is walked once per window
    (:meth:`Window.shared`), and each engine walks on from there (an idle fleet pulling
    on a cold queue walks the window once, not once per engine; a holder walks only from
    its first held request)."""
    mine = w.mine(engine_id)
    stop = (mine[-1] + 1 if mine else 0) if first else len(w.items)
    if not isinstance(finish, Pricer):
        st = _Walk()
    else:
        shared = w.shared((finish.load_ns(engine_id), now_ns, grace_ns), engine_id)
        p = mine[0] if mine else len(w.items)
        _advance(aff, None, now_ns, w, finish, grace_ns, shared, p)
        if shared.done and shared.at <= p:  # complete before the first request it holds
            return shared.order()
        st = shared.before(p)
    _advance(aff, engine_id, now_ns, w, finish, grace_ns, st, stop, first)
    return st.order()


@dataclass(slots=True)
class _Walk:
    """A take order being walked over a window (:func:`order_for`): the requests ranked
    so far as (-blocks held, position, request); ns of the window's earlier requests each
    holder takes first (``ahead``); the next position to read (``at``); whether the order
    is complete (``done``: ``scan`` ranked, or the window read to its end). A shared walk
    (for engines holding none of what it reads, priced as ``rep``) keeps each addition to
    ``ahead`` as (position, engine, ns) in ``adds``: it can be resumed from any position
    it has read (:meth:`before`)."""

    rep: str = ""
    adds: list[tuple[int, str, int]] | None = None
    ranked: list[tuple[int, int, Queued]] = field(default_factory=list)
    ahead: dict[str, int] = field(default_factory=dict)
    at: int = 0
    done: bool = False
    sorted: list[Queued] | None = None

    def order(self) -> list[Queued]:
        """The take order: most blocks held first, then window order (a new list; sorted
        once when the walk is complete)."""
        if self.done and self.sorted is not None:
            return list(self.sorted)
        got = [x[2] for x in sorted(self.ranked, key=lambda x: (x[0], x[1]))]
        if self.done:
            self.sorted = got
        return list(got)

    def add(self, pos: int, engine_id: str, ns: int) -> None:
        """``engine_id`` takes ``ns`` more of the window's work first (read at ``pos``)."""
        self.ahead[engine_id] = self.ahead.get(engine_id, 0) + ns
        if self.adds is not None:
            self.adds.append((pos, engine_id, ns))

    def before(self, p: int) -> _Walk:
        """A walk of its own from this shared walk's state before position ``p`` (read)."""
        ahead: dict[str, int] = {}
        for i, e, ns in self.adds or ():
            if i >= p:
                break
            ahead[e] = ahead.get(e, 0) + ns
        return _Walk(ranked=[x for x in self.ranked if x[1] < p], ahead=ahead, at=p)


def _advance(aff: Affinity, engine_id: str | None, now_ns: int, w: Window,
             finish: Finish | None, grace_ns: int, st: _Walk, to: int,
             one: bool = False) -> None:
    """Walk ``st`` on for ``engine_id`` (None: the shared walk, priced as ``st.rep``, what
    it holds ignored) up to position ``to`` (exclusive; with ``one``, on until a request
    is ranked), or until the order is complete."""
    items, bound, scan, cost = w.items, w.bound_ns, aff.scan, w.cost
    ranked, ahead = st.ranked, st.ahead
    i = st.at
    while not st.done and i < len(items) and (i < to or (one and not ranked)):
        item, pos = items[i], i
        i += 1
        h = w.held(pos)
        mine = 0 if engine_id is None else h.get(engine_id, 0)
        top_m, top = w.top(pos)
        e = None
        age = now_ns - item.enqueued_ns
        if age < bound and top_m > mine:
            if finish is None:
                continue  # it waits for its holder
            e = sooner_holder(finish, engine_id, item, w.above(pos, mine), mine, ahead,
                              functools.partial(cost, aff, item),
                              max(0, min(grace_ns, 2 * grace_ns - age)),
                              None if w.tail_ns is None else w.tail_ns - age,
                              None if engine_id is not None else finish(st.rep, item, 0, 0))
            if e is not None:  # its holder is predicted to finish it sooner
                st.add(pos, e, cost(aff, item, h[e]))
        # Held longest by one other engine alone: it takes this one before later ones.
        if top is not None and top != engine_id and top != e and age < bound:
            st.add(pos, top, cost(aff, item, top_m))
        if e is not None:
            continue
        ranked.append((-mine, pos, item))
        if len(ranked) >= scan:  # requests waiting for another engine do not count
            st.done = True
    st.at = i
    if i >= len(items):
        st.done = True


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
              now_ns: int, pulling: bool = False, ahead_ns: int = 0,
              cost_ns: int | None = None) -> int:
    """Predicted finish (ns from now) of ``item`` on engine ``eng`` holding ``matched`` of
    its leading blocks (:func:`fulcrum.core.prefix_cost.predicted_ttft_one_ns`): that
    engine's least-loaded rank's load after its latest pull, drained by the time since
    (1 ns per ns), but no sooner than the end of the step that pull started (an engine
    mid-step pulls at its step boundary; ``pulling``: the engine is at one now), plus
    ``ahead_ns`` of other requests' work it takes first, spread over its DP ranks, plus
    the request's cost there (:func:`matched_cost`; ``cost_ns`` when the caller has it)."""
    cost = matched_cost(aff, item, matched) if cost_ns is None else cost_ns
    load, ranks = _base(eng, now_ns, pulling)
    return load + ahead_ns // ranks + cost


class Pricer:
    """:func:`finish_ns` over the window ``w`` for one decision at ``now_ns`` (``engine``:
    engine id -> its entry; ``pulling``: the engines at a step boundary now), with each
    engine's load part computed once and each request's cost once per window: the take
    orders of every offering engine price the same engines and requests again. A
    :data:`Finish`; :meth:`load_ns` is the part that depends on the engine alone."""

    __slots__ = ("_aff", "_bases", "_engine", "_now", "_pulling", "_w")

    def __init__(self, aff: Affinity, w: Window, engine: Callable[[str], EngineEntry | None],
                 now_ns: int, pulling: Callable[[str], bool]) -> None:
        self._aff, self._w, self._engine = aff, w, engine
        self._now, self._pulling = now_ns, pulling
        self._bases: dict[str, tuple[int, int]] = {}

    def _base(self, e: str) -> tuple[int, int]:
        b = self._bases.get(e)
        if b is None:
            b = self._bases[e] = _base(self._engine(e), self._now, self._pulling(e))
        return b

    def load_ns(self, e: str) -> int:
        """Engine ``e``'s load part (ns): when it could start a request with nothing ahead."""
        return self._base(e)[0]

    def __call__(self, e: str, it: Queued, m: int, ahead: int) -> int:
        load, ranks = self._base(e)
        return load + ahead // ranks + self._w.cost(self._aff, it, m)


def _base(eng: EngineEntry | None, now_ns: int, pulling: bool) -> tuple[int, int]:
    """(load part of :func:`finish_ns` in ns, the ranks its ``ahead_ns`` is spread over)."""
    if eng is None:
        return 0, 1
    since = max(0, now_ns - eng.seen_ns)
    load = max(0, eng.min_rank_ns - since)
    if not pulling:
        load = max(load, eng.step_ns - since)
    return load, max(1, eng.dp_ranks)


#: An offer as a dispatch ranks it: (the puller rule's key, the offer's place in the
#: shell's deterministic order, the offer). One dispatch's places are unique and sort in
#: that order, so these tuples sort by key, then place, and never compare offers.
Ranked = tuple[tuple[int, ...], Any, Offer]


def pick(aff: Affinity, offers: Sequence[Offer], now_ns: int, w: Window,
         can_take: Callable[[Offer, Queued], bool], key: Callable[[Offer, int], tuple[int, ...]],
         finish: Finish | None = None, grace_ns: int = 0) -> int:
    """Index in ``offers`` of the engine that takes work over ``w``, -1 when none
    (:func:`pick_ranked` over ``offers``, each at its index, ranked by ``key``)."""
    ranked = [(key(o, i), i, o) for i, o in enumerate(offers)]
    got = pick_ranked(aff, now_ns, w, can_take, ranked, sorted(ranked), finish, grace_ns)
    return -1 if got is None else int(got[1])


def pick_ranked(aff: Affinity, now_ns: int, w: Window, can_take: Callable[[Offer, Queued], bool],
                near: Iterable[Ranked], ordered: Iterable[Ranked],
                finish: Finish | None = None, grace_ns: int = 0,
                plain: Sequence[Plain] = ()) -> Ranked | None:
    """The offer that takes work over ``w``, None when none: among the offers able
    (``can_take``) to take the first request of their take order (:func:`order_for`, with
    ``finish`` as the pull's own order uses it), narrowed to those holding the longest
    prefix of it (when any holds one), the first in ``ordered`` (every offer, by the
    puller rule's key: :meth:`PullerRule.key`). ``near``: the offers that may hold a
    prefix of the window (every one of :meth:`Window.holding`'s engines among them; any
    others are skipped). ``plain``: more able offers, of engines holding none of the
    window, in groups that answer alike (:class:`Plain`; ``finish`` a :class:`Pricer`);
    ``ordered`` need not list them.

    It costs the holders, not every engine. The engines holding a prefix of any of the
    window's requests (:meth:`Window.mine`) are asked first: when one of them is able and
    holds a prefix of its first request, the others (who hold none) cannot be chosen,
    and are not asked. Otherwise the others are asked in order until one is able
    (usually one question; ``ordered`` may be lazy). Engines holding none of the window
    are answered once per load part (:meth:`Pricer.load_ns`) and offer (rank loads,
    remaining quota, band loads): they walk the window alike, and ``can_take`` must read
    an engine only through its offer and the window's price of the request at the prefix
    it holds (none), as :meth:`PrefillBalancer.choose_puller`'s does."""
    pos = {id(it): j for j, it in enumerate(w.items)}
    held: dict[Any, tuple[int, Ranked]] = {}  # able holder's place -> (first's blocks, it)
    holding = w.holding()
    for r in near:
        o = r[2]
        if o.engine_id in holding:
            order = order_for(aff, o.engine_id, now_ns, w, finish, grace_ns, first=True)
            if order and can_take(o, order[0]):
                held[r[1]] = w.held(pos[id(order[0])]).get(o.engine_id, 0), r
    top = max((m for m, _ in held.values()), default=0)
    if top > 0:
        return min(r for m, r in held.values() if m == top)
    alike: dict[tuple[object, ...], bool] = {}

    def ok(r: Ranked) -> bool:  # an offer of an engine holding none of the window
        o = r[2]
        k = _alike(o, finish)
        got = alike.get(k) if k is not None else None
        if got is None:
            order = order_for(aff, o.engine_id, now_ns, w, finish, grace_ns, first=True)
            got = bool(order) and can_take(o, order[0])
            if k is not None:
                alike[k] = got
        return got

    assert not plain or isinstance(finish, Pricer), "plain groups answer alike by its prices"
    return first_able(ordered, plain, ok,
                      lambda r: r[1] in held if r[2].engine_id in holding else ok(r))


def first_able(ordered: Iterable[Ranked], plain: Sequence[Plain],
               plain_ok: Callable[[Ranked], bool],
               ok: Callable[[Ranked], bool]) -> Ranked | None:
    """The first offer in key order that is able: of ``ordered`` (in key order, each
    asked ``ok``, read only up to the best of the groups) and of the ``plain`` groups
    (each asked for its first ``plain_ok`` offer); None when none is."""
    best = min((c for g in plain if (c := g.first(plain_ok)) is not None), default=None)
    for r in ordered:
        if best is not None and r > best:
            break
        if ok(r):
            return r
    return best


class Plain(Protocol):
    """Able offers, in key order, of engines holding none of what a dispatch reads (a
    waiting set's group, :class:`~fulcrum.core.prefill.waiting.Waiting`): one offer key
    (:func:`offer_key`), so those whose engine's load part is 0 (:meth:`Pricer.load_ns`)
    answer alike."""

    def first(self, ok: Callable[[Ranked], bool]) -> Ranked | None:
        """The first of them ``ok`` is true of (None: none), asking as few as it may."""
        ...


def _alike(o: Offer, finish: Finish | None) -> tuple[object, ...] | None:
    """What :func:`pick` reads of an engine holding none of the window (None: nothing
    shared without a :class:`Pricer`)."""
    if not isinstance(finish, Pricer):
        return None
    return finish.load_ns(o.engine_id), *offer_key(o)


def offer_key(o: Offer) -> tuple[object, ...]:
    """An offer's rank loads, remaining quota and band loads, hashable (two engines
    holding nothing of what they are asked about, with equal keys, answer alike)."""
    bands = None if o.band_loads is None else tuple(
        (b, tuple(v)) for b, v in sorted(o.band_loads.items()))
    return tuple(o.rank_loads_ns), o.remaining_ns, bands


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
