"""A holder's predicted finish counts the window's earlier requests that wait for it
(issue 21): two requests held by one engine do not both wait for it when the second
would then finish sooner on an idle engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.items import EngineEntry, Queued

MS = 1_000_000


def cost(q: int, c: int) -> int:
    """1 ms per computed token plus 1 ms fixed (ns)."""
    return MS * q + MS


def _aff() -> Affinity:
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=100_000 * MS)
    for e in ("holder", "idle"):
        aff.index.add_engine(e, 1000)
    return aff


def _item(rid: str, blocks: int) -> Queued:
    hashes = tuple(range(1000 * int(rid[1:]), 1000 * int(rid[1:]) + blocks))
    total = 100 * blocks
    return Queued(rid, total, 0, 0, cost(total, 0), 0, hashes)


@pytest.mark.parametrize(
    ("holder_ranks", "holder_load_ms", "sizes", "want_idle"),
    [
        # Each request: 1,000 tokens, the holder has 900 of them (101 ms there), the idle
        # engine none (1,001 ms there).
        # r1 finishes on the holder at 100 + 101 ms: it waits.
        (1, 100, [10], []),
        # r2 after r1 on the holder: 100 + 101 + 101 ms, still sooner: both wait.
        (1, 100, [10, 10], []),
        # r1 at 800 + 101 ms waits; r2 at 800 + 101 + 101 = 1,002 ms is later than the
        # idle engine's 1,001 ms: the idle engine takes it.
        (1, 800, [10, 10], ["r2"]),
        # With two ranks r2 starts beside r1 (half of r1's work ahead): 951.5 ms, waits.
        (2, 800, [10, 10], []),
        # Three on one rank: r3 at 700 + 3 x 101 = 1,003 ms goes to the idle engine.
        (1, 700, [10, 10, 10], ["r3"]),
    ],
)
def test_the_idle_engine_takes_what_the_busy_holder_would_finish_later(
        holder_ranks: int, holder_load_ms: int, sizes: list[int],
        want_idle: list[str]) -> None:
    aff = _aff()
    items = [_item(f"r{i + 1}", n) for i, n in enumerate(sizes)]
    for it in items:  # the holder has every block but the last of each request
        aff.index.record("holder", it.blocks[:-1])
    engines = {
        "holder": EngineEntry("holder", holder_ranks, tier=0,
                              min_rank_ns=holder_load_ms * MS, seen_ns=0),
        "idle": EngineEntry("idle", 1, tier=0, min_rank_ns=0, seen_ns=0),
    }
    w = aff_order.window(aff, items, ["holder", "idle"], 0)
    assert w is not None

    def finish(e: str, it: Queued, m: int, ahead: int) -> int:
        return aff_order.finish_ns(aff, engines[e], it, m, 0, e == "idle", ahead)

    got = [it.request_id for it in aff_order.order_for(aff, "idle", 0, w, finish)]
    assert got == want_idle


@settings(max_examples=300, deadline=None, derandomize=True)
@given(load_ms=st.integers(0, 3_000), ranks=st.integers(1, 8),
       ahead_ms=st.lists(st.integers(0, 2_000), min_size=2, max_size=2))
def test_more_work_ahead_never_makes_a_holder_sooner(load_ms: int, ranks: int,
                                                     ahead_ms: list[int]) -> None:
    aff = _aff()
    it = _item("r1", 5)
    eng = EngineEntry("holder", ranks, tier=0, min_rank_ns=load_ms * MS, seen_ns=0)
    lo, hi = sorted(a * MS for a in ahead_ms)
    assert (aff_order.finish_ns(aff, eng, it, 4, 0, ahead_ns=lo)
            <= aff_order.finish_ns(aff, eng, it, 4, 0, ahead_ns=hi))
    assert aff_order.finish_ns(aff, eng, it, 4, 0, ahead_ns=0) == aff_order.finish_ns(
        aff, eng, it, 4, 0)
