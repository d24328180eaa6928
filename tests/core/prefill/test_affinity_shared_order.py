"""One take order walked per window for the engines holding none of what they read
(issue 21, aim 5: an idle fleet pulling on a cold queue walks the window once, not once
per engine); a holder resumes it at its first held request, and a dispatch's walk for an
engine's first request ends early: each the order the engine would walk alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import Queued
from fulcrum.core.prefill.items import EngineEntry, Offer

S = 1_000_000_000
MS = 1_000_000
ENGINES = [f"e{i}" for i in range(6)]


def cost(q: int, c: int) -> int:
    """1 us per computed token plus 1 ms fixed (ns)."""
    return 1_000 * q + MS


def _setup(paths: list[list[int]], holds: list[tuple[int, int]], loads_ms: list[int],
           ) -> tuple[Affinity, list[Queued], dict[str, EngineEntry]]:
    ids: dict[tuple[int, ...], int] = {}
    chains = [tuple(ids.setdefault(tuple(p[: i + 1]), len(ids) + 1) for i in range(len(p)))
              for p in paths]
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=100 * S)
    for e in ENGINES:
        aff.index.add_engine(e, 10_000)
    for e, i in holds:  # engine e holds request i's prompt
        aff.index.record(ENGINES[e], chains[i % len(chains)])
    items = [Queued(f"r{i}", 100 * len(b) + 50, 0, 0, cost(100 * len(b) + 50, 0), i, b)
             for i, b in enumerate(chains)]
    engines = {e: EngineEntry(e, 2, tier=0, min_rank_ns=loads_ms[k] * MS, seen_ns=0)
               for k, e in enumerate(ENGINES)}
    return aff, items, engines


def _orders(aff: Affinity, items: list[Queued], engines: dict[str, EngineEntry],
            shared: bool, first: bool = False) -> dict[str, list[str]]:
    """Every engine's take order at 1 ms, all offering: one window and pricer for all of
    them (``shared``, as a decision does: walks shared by load part and resumed), or
    each engine's whole walk alone (a fresh window, the pricer behind a plain function:
    nothing shared). ``first``: the first request only, as :func:`pick` asks."""
    got: dict[str, list[str]] = {}
    w = p = None
    for e in ENGINES:
        if w is None or not shared:
            w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
            p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
        assert p is not None
        finish = p if shared else (lambda *a, p=p: p(*a))  # type: ignore[misc]
        order = aff_order.order_for(aff, e, MS, w, finish, 200 * MS, first=first)
        got[e] = [it.request_id for it in order][: 1 if first else None]
    return got


#: Request prompts as block paths (shared paths share leading blocks), who holds which
#: request's prompt, and each engine's load (ms).
PATHS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1,
                 max_size=12)
HOLDS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11)), max_size=8)
LOADS = st.lists(st.sampled_from([0, 0, 0, 5, 400]), min_size=6, max_size=6)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    paths=PATHS, holds=HOLDS, loads_ms=LOADS,
    scan=st.sampled_from([2, 3, 16]),
)
def test_a_shared_walk_resumed_is_the_walk_the_engine_would_make_alone(
    paths: list[list[int]], holds: list[tuple[int, int]], loads_ms: list[int], scan: int
) -> None:
    aff, items, engines = _setup(paths, holds, loads_ms)
    aff.scan = scan
    alone = _orders(aff, items, engines, shared=False)
    assert _orders(aff, items, engines, shared=True) == alone
    # The first request, as a dispatch asks it (the walk ends early), is the order's.
    firsts = {e: o[:1] for e, o in alone.items()}
    assert _orders(aff, items, engines, shared=True, first=True) == firsts
    assert _orders(aff, items, engines, shared=False, first=True) == firsts


def test_idle_engines_holding_nothing_share_one_walk_and_a_holder_walks_its_own() -> None:
    # e0 holds r0's prompt and is busy for 2 s: the idle engines take r0 (sooner than
    # waiting) and r1; e0's own order starts with what it holds.
    aff, items, engines = _setup([[0, 1, 2], [1, 1]], [(0, 0)], [2_000, 0, 0, 0, 0, 0])
    w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
    p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
    first = aff_order.order_for(aff, "e1", MS, w, p, 0)
    assert [it.request_id for it in first] == ["r0", "r1"]
    shared = w.shared((p.load_ns("e1"), MS, 0), "e2")
    assert shared.done and shared.rep == "e1"  # walked once, for e1; e2 reuses it
    assert aff_order.order_for(aff, "e2", MS, w, p, 0) == first
    assert w.mine("e0") == [0] and w.mine("e2") == []
    assert [it.request_id for it in aff_order.order_for(aff, "e0", MS, w, p, 0)] == [
        "r0", "r1"]
    assert p.load_ns("e0") == 2 * S - MS and p.load_ns("e1") == 0  # drained 1 ms


def test_a_holder_resumes_the_shared_walk_at_its_first_held_request() -> None:
    # e1 holds r2 only; the idle engines' walk reads r0, r1 before it. e1's order is the
    # shared walk's state before r2 (r0, r1 ranked) walked on from r2 by e1: r2 first.
    aff, items, engines = _setup([[0], [1], [2], [0, 0]], [(1, 2)], [0] * 6)
    w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
    p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
    assert [it.request_id for it in aff_order.order_for(aff, "e0", MS, w, p, 0)] == [
        "r0", "r1", "r3"]  # r2 waits for e1, idle and holding it
    assert w.mine("e1") == [2]
    got = aff_order.order_for(aff, "e1", MS, w, p, 0)
    assert [it.request_id for it in got] == ["r2", "r0", "r1", "r3"]
    assert [it.request_id for it in aff_order.order_for(aff, "e1", MS, w, p, 0,
                                                        first=True)] == ["r2", "r0", "r1"]


#: Puller orders: offer order, reversed, by quota then reversed (ties broken as rules do).
KEYS = (
    lambda o, i: (i,),
    lambda o, i: (-i,),
    lambda o, i: (-o.remaining_ns, -i),
)


def _able_alone(aff: Affinity, items: list[Queued], engines: dict[str, EngineEntry],
                offers: list[Offer], can_take) -> list[int]:  # type: ignore[no-untyped-def]
    """The engines :func:`pick` chooses among, as its docstring says, each engine's whole
    walk alone: every offer
    asked, then narrowed to those holding the longest prefix of their first request."""
    held = {}
    for i, o in enumerate(offers):
        w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
        p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
        order = aff_order.order_for(aff, o.engine_id, MS, w, lambda *a, p=p: p(*a),
                                    200 * MS)
        if order and can_take(o, order[0]):
            held[i] = aff.index.match(o.engine_id, order[0].blocks)
    top = max(held.values(), default=0)
    return [i for i in held if held[i] == top] if top > 0 else list(held)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    paths=PATHS, holds=HOLDS, loads_ms=LOADS,
    quota_ms=st.lists(st.sampled_from([0, 1, 3, 100]), min_size=6, max_size=6),
)
def test_a_dispatch_asks_the_holders_first_and_finds_whom_asking_all_finds(
    paths: list[list[int]], holds: list[tuple[int, int]], loads_ms: list[int],
    quota_ms: list[int],
) -> None:
    aff, items, engines = _setup(paths, holds, loads_ms)
    offers = [Offer(e, quota_ms[k] * MS, (0, 0)) for k, e in enumerate(ENGINES)]

    def can_take(o: Offer, it: Queued) -> bool:  # the quota must cover its cost
        return o.remaining_ns >= it.cost_ns // 2

    able = _able_alone(aff, items, engines, offers, can_take)
    for key in KEYS:  # whatever the puller rule's order
        w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
        p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
        got = aff_order.pick(aff, offers, MS, w, can_take, key, p, 200 * MS)
        assert got == min(able, key=lambda i: key(offers[i], i), default=-1)


@pytest.mark.parametrize(
    ("first", "want"),
    [
        ([0], 0),
        ([2, 1], 1),  # e2 (no quota) is not able: the holder e1 next in the rule's order
        ([2, 5], 5),  # an engine holding nothing, next in the rule's order
        ([2], 0),  # then offer order
    ],
)
def test_when_no_able_engine_holds_its_first_request_the_rule_s_first_able_one_takes(
        first: list[int], want: int) -> None:
    # e1 holds r0's first block, e2 all of r0; e2 is idle (r0 waits for it at e1) but has
    # no quota left: nobody able holds a prefix of its first request, so the holder e1
    # and the engines holding nothing are all able (not e2), asked in the rule's order.
    aff, items, engines = _setup([[0, 1, 2], [1]], [(2, 0)], [0] * 6)
    aff.index.record("e1", items[0].blocks[:1])
    offers = [Offer(e, 0 if e == "e2" else 100 * MS, (0, 0)) for e in ENGINES]
    w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
    p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
    assert w.mine("e1") == [0] and w.mine("e2") == [0]

    def key(o: Offer, i: int) -> tuple[int, ...]:  # ``first`` in that order, then the rest
        return (first.index(i) if i in first else len(first), i)

    got = aff_order.pick(aff, offers, MS, w, lambda o, it: o.remaining_ns > 0, key, p,
                         200 * MS)
    assert got == want


def test_a_window_prices_a_request_on_an_engine_as_the_balancer_does() -> None:
    # e0 holds 2 of r0's 3 blocks, e1 one, e2 none; r1 has no blocks: its own cost.
    aff, items, _ = _setup([[0, 1, 2], [1]], [], [0] * 6)
    aff.index.record("e0", items[0].blocks[:2])
    aff.index.record("e1", items[0].blocks[:1])
    items.append(Queued("bare", 550, 0, 0, 7 * MS, 9))
    w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
    for e, m in (("e0", 2), ("e1", 1), ("e2", 0)):
        assert w.cost_for(aff, items[0], e) == aff_order.matched_cost(aff, items[0], m)
    assert w.cost_for(aff, items[0], "e0") < w.cost_for(aff, items[0], "e1") \
        < w.cost_for(aff, items[0], "e2")
    assert w.cost_for(aff, items[2], "e0") == 7 * MS


@settings(max_examples=200, deadline=None, derandomize=True)
@given(depths=st.lists(st.integers(0, 6), min_size=1, max_size=40), mine=st.integers(0, 6))
def test_who_a_request_may_wait_for_is_its_deeper_holders_in_order(
        depths: list[int], mine: int) -> None:
    # Engine k holds ``depths[k]`` leading blocks of one request; past 16 holders the
    # window lists only those holding more than ``mine`` (sooner_holder skips the rest).
    idx = PrefixIndex(block_tokens=1)
    names = [f"e{k:02d}" for k in range(len(depths))]
    blocks = tuple(range(100, 106))
    for e, d in zip(names, depths, strict=True):
        idx.add_engine(e, 64)
        idx.stored(e, blocks[:d])
    item = Queued("r", 6, 0, 0, cost(6, 0), 0, blocks)
    w = aff_order.Window([item], names, idx, 10**12)
    held = w.held(0)
    assert list(held.items()) == [(e, d) for e, d in zip(names, depths, strict=True) if d]
    deeper = [(e, m) for e, m in held.items() if m > mine]
    got = w.above(0, mine)
    assert list(got.items()) == (list(held.items()) if len(held) <= 16 else deeper)
