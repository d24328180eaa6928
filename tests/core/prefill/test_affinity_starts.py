"""A window matches only the engines holding a request's first block (issue 21): one
pass over the serving engines per window finds them (``PrefixIndex.starts``), and the
matches are those of every serving engine, in the same order, holes included. An
engine without a prompt's first block reuses none of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.items import Queued
from fulcrum.core.prefill.order import window


def cost(q: int, c: int) -> int:
    return 1_000 * q + 1_000


@pytest.mark.parametrize(
    ("held", "blocks", "want"),
    [
        ((1, 2, 3), (1, 2, 3, 4), 3),
        ((1, 2, 3, 4), (1, 2, 3, 4), 4),
        ((2, 3, 4), (1, 2, 3, 4), 0),  # a hole at the start: no prefix at all
        ((1, 3, 4), (1, 2, 3, 4), 1),  # a hole inside (a lost event): bisection finds it here
        ((), (1, 2), 0),
        ((1,), (), 0),
    ],
)
def test_match_needs_the_first_block(held: tuple[int, ...], blocks: tuple[int, ...],
                                     want: int) -> None:
    idx = PrefixIndex()
    idx.add_engine("e", 100)
    idx.stored("e", range(1, 5))
    idx.evicted("e", [b for b in range(1, 5) if b not in held])  # holes as reported
    assert idx.match("e", blocks) == want


def test_starts_lists_the_holders_of_each_first_block_in_order() -> None:
    idx = PrefixIndex()
    for e in ("a", "b", "c", "d"):
        idx.add_engine(e, 100)
    idx.stored("c", (10, 11))
    idx.stored("a", (10,))
    idx.stored("b", (20, 21))
    got = idx.starts(["a", "b", "c", "d", "unknown"], frozenset({10, 20, 30}))
    assert got == {10: ["a", "c"], 20: ["b"]}
    assert idx.starts(["a", "b"], frozenset()) == {}


holdings = st.lists(  # per engine: per request, the blocks it was told it holds
    st.lists(st.lists(st.integers(0, 7), max_size=8), min_size=6, max_size=6),
    min_size=1, max_size=6)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(holdings)
def test_window_matches_are_those_of_every_serving_engine(
        held: list[list[list[int]]]) -> None:
    aff = Affinity(PrefixIndex(block_tokens=16), cost, max_wait_ns=10**12)
    engines = [f"e{i}" for i in range(len(held))]
    reqs = [Queued(f"r{j}", 16 * 8, 0, 0, 1, 0, tuple(range(j * 100, j * 100 + 8)))
            for j in range(6)]
    for e, per_req in zip(engines, held, strict=True):
        aff.index.add_engine(e, 1_000)
        for r, picks in zip(reqs, per_req, strict=True):  # any subset: holes too
            aff.index.stored(e, r.blocks)
            aff.index.evicted(e, [b for k, b in enumerate(r.blocks) if k not in picks])
    w = window(aff, reqs, engines, 1)
    assert w is not None
    for i, r in enumerate(reqs):
        brute = {e: m for e in engines if (m := aff.index.match(e, r.blocks))}
        assert w.held(i) == brute
        assert list(w.held(i)) == list(brute)  # the serving order, kept


def test_starts_takes_engines_as_positions_too() -> None:
    idx = PrefixIndex()
    for e in ("a", "b", "c"):
        idx.add_engine(e, 100)
        idx.stored(e, (10,))
    assert idx.starts({"c": 0, "a": 1}, frozenset({10})) == {10: ["c", "a"]}
    assert idx.starts(["b"], [10, 10]) == {10: ["b"]}


def test_a_request_s_first_block_is_tracked_from_its_first_record() -> None:
    idx = PrefixIndex()
    for e in ("a", "b"):
        idx.add_engine(e, 100)
    idx.record("a", (1, 2, 3))
    assert dict(idx._where) == {1: {"a": None}}  # its first block only, no pass needed
    idx.record("b", (1, 2))
    assert list(idx._where[1]) == ["a", "b"]
    idx.remove_engine("a")
    idx.remove_engine("b")
    assert idx._where == {}  # bounded: nobody holds it
