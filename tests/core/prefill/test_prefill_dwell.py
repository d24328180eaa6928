"""Minimum tier dwell: an engine a round moved stays on its new tier for ``min_dwell_ns``
(issue 13: "the tier assignment must not flap"); joins and leaves are not held back."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.balancer import (
    BalancerConfig,
    PrefillBalancer,
    Queued,
    _unpinned_targets,
)

S = 1_000_000_000
BOUNDS = (16_384, 65_536, 262_144)
CAPS = (8 * S, 32 * S, 128 * S, 512 * S)


def make(engines: int, dwell_ns: int) -> PrefillBalancer:
    bal = PrefillBalancer(
        BalancerConfig(BOUNDS, CAPS, 1.0, 0.0, 256, min_dwell_ns=dwell_ns)
    )
    for i in range(engines):
        bal.add_engine(f"e{i}", 2)
    return bal


def demand(bal: PrefillBalancer, tier: int, n: int, tag: str, cost: int = 10 * S) -> None:
    """Queue ``n`` requests of ``cost`` ns on ``tier`` (the round's demand)."""
    total = (0, *BOUNDS)[tier] + 1
    for i in range(n):
        bal.enqueue(Queued(f"{tag}{i}", total, 0, tier, cost, 0))


def drain(bal: PrefillBalancer) -> None:
    for t in range(len(BOUNDS) + 1):
        for q in list(bal.queued(t)):
            bal.remove(q.request_id)


def flip(bal: PrefillBalancer, now_s: float, tier: int, tag: str) -> tuple[int, ...]:
    """A round whose demand sits on ``tier`` alone."""
    drain(bal)
    demand(bal, tier, 8, tag)
    return bal.redistribute("round", int(now_s * S)).counts


def test_without_dwell_engines_follow_the_demand_every_round() -> None:
    bal = make(4, 0)
    assert flip(bal, 1, 0, "a") == (4, 0, 0, 0)
    assert flip(bal, 2, 1, "b") == (0, 4, 0, 0)
    assert flip(bal, 3, 0, "c") == (4, 0, 0, 0)


def test_a_moved_engine_stays_for_the_dwell_time() -> None:
    bal = make(4, 5 * S)
    assert flip(bal, 1, 0, "a") == (4, 0, 0, 0)
    assert flip(bal, 20, 0, "b") == (4, 0, 0, 0)  # long after: nothing pinned, no move
    assert flip(bal, 21, 1, "c") == (0, 4, 0, 0)  # every engine free: all follow
    # Moved 1 s ago: pinned. Only the orphan gate (a tier with work and no engine) moves
    # one engine at once, as it must whatever the dwell.
    assert flip(bal, 22, 0, "d") == (1, 3, 0, 0)
    assert flip(bal, 25.9, 0, "e") == (1, 3, 0, 0)
    assert flip(bal, 26, 0, "f") == (4, 0, 0, 0)  # 5 s later they may move again
    # Reloading the dwell to zero frees them at once.
    assert flip(bal, 27, 1, "g") == (3, 1, 0, 0)
    bal.reconfigure(BalancerConfig(BOUNDS, CAPS, 1.0, 0.0, 256, min_dwell_ns=0))
    assert flip(bal, 27.5, 1, "h") == (0, 4, 0, 0)


def test_joins_and_leaves_are_not_held_back() -> None:
    bal = make(2, 60 * S)
    flip(bal, 1, 0, "a")
    drain(bal)
    demand(bal, 2, 4, "long")
    red = bal.add_engine("new", 2)  # a join redistributes regardless of the dwell
    assert sum(red.counts) == 3
    bal.remove_engine("e0")
    assert sum(bal.engines_per_tier()) == 2


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    held=st.lists(st.integers(0, 6), min_size=4, max_size=4),
)
def test_unpinned_targets_fill_exactly_the_free_engines(
    counts: list[int], held: list[int]
) -> None:
    n = sum(counts)
    assume(sum(held) <= n)
    c = np.array(counts, dtype=np.int64)
    h = np.array(held, dtype=np.int64)
    free = n - sum(held)
    want = _unpinned_targets(c, h, free)
    assert int(want.sum()) == free and (want >= 0).all()
    assert (want <= np.maximum(c - h, 0)).all()  # never more than a tier still lacks


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=20),
    dwell_s=st.integers(0, 5),
    engines=st.integers(1, 6),
)
def test_no_engine_moves_twice_within_the_dwell(
    rounds: list[tuple[int, int]], dwell_s: int, engines: int
) -> None:
    bal = make(engines, dwell_s * S)
    last_move: dict[str, int] = {}
    for i, (tier, n) in enumerate(rounds):
        now = (i + 1) * S
        drain(bal)
        demand(bal, tier, n, f"r{i}-")
        red = bal.redistribute("round", now)
        assert sum(red.counts) == engines
        assert list(red.counts) == bal.engines_per_tier()
        for engine_id, old, _new in red.moved:
            if old >= 0 and engine_id in last_move:
                assert now - last_move[engine_id] >= dwell_s * S
            last_move[engine_id] = now
