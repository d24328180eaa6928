"""A join that only adds the new engine to one tier, and a round that keeps the split,
skip the pass over the fleet (``_quick_split``): every redistribution equals the full
split's (:func:`assign_engines` over every engine), through joins, re-joins, leaves,
rounds with and without dwell, and demand that shifts between them."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import balancer as B
from fulcrum.core.prefill.balancer import DEFAULT, BalancerConfig, PrefillBalancer, rules_by_name

S = 1_000_000_000
BOUNDS = (16_384, 65_536, 262_144)

steps = st.lists(st.tuples(
    st.sampled_from(["join", "leave", "round"]),
    st.integers(0, 20),  # engine
    st.lists(st.integers(0, 3), min_size=4, max_size=4),  # demand (s per tier)
    st.integers(0, 3),  # dwell (s)
), max_size=60)


def _run(script: list[tuple[str, int, list[int], int]], fast: bool) -> list[object]:
    out: list[object] = []
    bal = PrefillBalancer(BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S), 8.0,
                                         1.0, 256, rules_by_name(DEFAULT)))
    with mock.patch.object(B, "_quick_split", B._quick_split if fast else lambda *a: None):
        for now, (what, e, demand, dwell) in enumerate(script):
            bal.last_demand_ns = [float(d * S) for d in demand]
            if what == "join":
                r = bal.add_engine(f"e{e}", 1 + e % 2)
            elif what == "leave":
                r = bal.remove_engine(f"e{e}")
            else:
                bal.config = BalancerConfig(BOUNDS, bal.config.batch_cap_ns, 8.0, 1.0, 256,
                                            bal.config.rules, min_dwell_ns=dwell * S)
                r = bal.redistribute("round", now * S)
            out.append((r, {x: bal.engine_tier(x) for x in bal.engine_ids()}))
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(steps)
def test_a_join_without_the_pass_splits_as_the_pass_does(
        script: list[tuple[str, int, list[int], int]]) -> None:
    assert _run(script, fast=True) == _run(script, fast=False)


def test_joins_into_an_idle_fleet_skip_the_pass() -> None:
    calls = []
    real = B._split
    with mock.patch.object(B, "_split", lambda *a: calls.append(1) or real(*a)):
        bal = PrefillBalancer(BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S),
                                             8.0, 1.0, 256, rules_by_name(DEFAULT)))
        for i in range(100):
            bal.add_engine(f"e{i}", 2)
    assert bal.engines_per_tier() == [25, 25, 25, 25]
    assert len(calls) <= 1  # the first join only (nothing to add it to before)


def test_a_round_that_keeps_the_split_skips_the_pass() -> None:
    calls = []
    real = B._split
    bal = PrefillBalancer(BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S),
                                         8.0, 1.0, 256, rules_by_name(DEFAULT)))
    for i in range(8):
        bal.add_engine(f"e{i}", 2)
    with mock.patch.object(B, "_split", lambda *a: calls.append(1) or real(*a)):
        r = bal.redistribute("round", S)
    assert r.counts == (2, 2, 2, 2) and r.moved == () and not calls
