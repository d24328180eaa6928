"""One take order walked per window for the engines holding none of what they read
(issue 21, aim 5: an idle fleet pulling on a cold queue walks the window once, not once
per engine), and never given to an engine it does not hold for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import Queued
from fulcrum.core.prefill.items import EngineEntry

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
            shared: bool) -> dict[str, list[str]]:
    """Every engine's take order at 1 ms, all offering: one window and pricer for all of
    them (``shared``, as a decision does), or a fresh one for each (no order kept)."""
    got: dict[str, list[str]] = {}
    w = p = None
    for e in ENGINES:
        if w is None or not shared:
            w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
            p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
        order = aff_order.order_for(aff, e, MS, w, p, 200 * MS)
        got[e] = [it.request_id for it in order]
    return got


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    paths=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1,
                   max_size=12),
    holds=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11)), max_size=8),
    loads_ms=st.lists(st.sampled_from([0, 0, 0, 5, 400]), min_size=6, max_size=6),
)
def test_a_kept_order_is_the_order_the_engine_would_walk(
    paths: list[list[int]], holds: list[tuple[int, int]], loads_ms: list[int]
) -> None:
    aff, items, engines = _setup(paths, holds, loads_ms)
    assert _orders(aff, items, engines, shared=True) == _orders(aff, items, engines,
                                                                 shared=False)


def test_idle_engines_holding_nothing_share_one_walk_and_a_holder_walks_its_own() -> None:
    # e0 holds r0's prompt and is busy for 2 s: the idle engines take r0 (sooner than
    # waiting) and r1; e0's own order starts with what it holds.
    aff, items, engines = _setup([[0, 1, 2], [1, 1]], [(0, 0)], [2_000, 0, 0, 0, 0, 0])
    w = aff_order.Window(items, ENGINES, aff.index, aff.max_wait_ns)
    p = aff_order.Pricer(aff, w, engines.get, MS, lambda _: True)
    first = aff_order.order_for(aff, "e1", MS, w, p, 0)
    assert [it.request_id for it in first] == ["r0", "r1"]
    key = (p.load_ns("e1"), MS, 0)
    assert w.order(key, "e2") == first  # kept: e2 holds nothing it read
    assert w.order(key, "e0") is None  # e0 holds r0: never handed e1's order
    assert [it.request_id for it in aff_order.order_for(aff, "e0", MS, w, p, 0)] == [
        "r0", "r1"]
    assert p.load_ns("e0") == 2 * S - MS and p.load_ns("e1") == 0  # drained 1 ms
