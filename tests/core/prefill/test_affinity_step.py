"""The pull's affinity predicts when a holder can start (issue 21): an engine mid-step
pulls only at its step boundary, and the fairness bound scales with the tier's time
scale (its batch cap), so a long tier's requests are not handed to an engine without
their prefix after the short tier's 2 s."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued
from fulcrum.core.prefill.items import EngineEntry, Offer

S = 1_000_000_000
MS = 1_000_000


def cost(q: int, c: int) -> int:
    """1 ms per computed token plus 1 ms fixed (ns)."""
    return MS * q + MS


@pytest.mark.parametrize(
    ("loads_ms", "floor_ms", "limit_ms", "want_ms"),
    [
        ([], 100, 1000, 0),  # no rank
        ([0, 0], 100, 1000, 0),  # idle: it waits for work and pulls at once
        ([50, 0], 100, 1000, 50),  # the floor is a budget: the work ends the step first
        ([300, 800], 100, 1000, 300),  # the lightest busy rank ends it
        ([50, 800], 100, 1000, 100),  # ... but not before the floor
        ([3000, 5000], 100, 1000, 1000),  # the step limit
        ([300], 2000, 1000, 300),  # a floor above the limit is the limit
        ([0, 700, 0, 400], 100, 1000, 400),  # idle ranks do not end a step
    ],
)
def test_step_ns_table(loads_ms: list[int], floor_ms: int, limit_ms: int,
                       want_ms: int) -> None:
    loads = [x * MS for x in loads_ms]
    assert aff_order.step_ns(loads, limit_ms * MS, floor_ms * MS) == want_ms * MS


def test_a_holder_mid_step_finishes_no_sooner_than_its_step_ends() -> None:
    aff = Affinity(PrefixIndex(block_tokens=100), cost)
    item = Queued("r", 350, 0, 0, cost(350, 0), 0, (7, 8, 9))
    eng = EngineEntry("a", 2, tier=0, min_rank_ns=0, seen_ns=0, step_ns=400 * MS)
    here = aff_order.matched_cost(aff, item, 2)  # 151 ms with 200 tokens held
    assert aff_order.finish_ns(aff, eng, item, 2, 100 * MS) == 300 * MS + here
    assert aff_order.finish_ns(aff, eng, item, 2, 100 * MS, pulling=True) == here
    assert aff_order.finish_ns(aff, eng, item, 2, 500 * MS) == here


def _two_engines(bounds: tuple[int, ...], caps: tuple[int, ...], tier: int,
                 max_wait_ns: int, ranks: int = 1, a_step_ns: int = 0) -> PrefillBalancer:
    """Engines ``a`` (its own step budget ``a_step_ns``; 0: the configured 1 s) and
    ``b`` (``ranks`` each), both on ``tier``."""
    bal = PrefillBalancer(BalancerConfig(
        bounds=bounds, batch_cap_ns=caps, backlog_rounds=1.0, hysteresis=0.0,
        max_batch_requests=1,
    ))
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=max_wait_ns)
    bal.affinity = aff
    bal.enqueue(Queued("seed", 10, 0, tier, 1, 0))  # both engines join its tier
    for e in ("a", "b"):
        aff.index.add_engine(e, 1000)
        bal.add_engine(e, ranks, a_step_ns if e == "a" else 0)
    bal.remove("seed")
    return bal


def test_an_idle_rank_of_a_holder_mid_step_does_not_make_it_sooner() -> None:
    # a holds 200 of r's 350 tokens (151 ms there, 351 ms on b). a's latest pull left
    # one rank with 700 ms and one idle: its idle rank waits for the 700 ms step to end,
    # so a finishes r at 851 ms, past b's 351 ms plus the grace (200 ms), and the idle b
    # takes it. Priced from a's idle rank alone (151 ms), r would wait for a.
    bal = _two_engines((1_000_000,), (1000 * S, 1000 * S), 0, 100 * S, ranks=2)
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    assert not bal.take("a", 0, [700 * MS, 0], now_ns=0).items
    blocks = (7, 8, 9)
    bal.enqueue(Queued("r", 350, 0, 0, aff.expected_cost(350, blocks), 1, blocks))
    assert bal.choose_puller(0, [Offer("b", 100 * S, [0, 0])], now_ns=1) == 0
    assert [i.request_id for i in bal.take("b", 100 * S, [0, 0], now_ns=1).items] == ["r"]


def test_an_engines_own_step_budget_sets_its_predicted_step() -> None:
    # As above, but a registered with a 100 ms step budget: its step after the pull
    # lasts 100 ms, so it finishes r at 250 ms, sooner than b (351 ms): r waits for a.
    bal = _two_engines((1_000_000,), (1000 * S, 1000 * S), 0, 100 * S, ranks=2,
                       a_step_ns=100 * MS)
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    assert not bal.take("a", 0, [400 * MS, 0], now_ns=0).items
    a = bal.engine("a")
    assert a is not None and a.step_ns == 100 * MS
    blocks = (7, 8, 9)
    bal.enqueue(Queued("r", 350, 0, 0, aff.expected_cost(350, blocks), 1, blocks))
    assert not bal.take("b", 100 * S, [0, 0], now_ns=1).items


def _wait_for_a(bal: PrefillBalancer, tier: int) -> None:
    """Queue ``r`` (2,000 tokens, 1,900 held by ``a``: 101 ms there, 2 s on ``b``) in
    ``tier`` at t = 0, with ``a`` busy for 1.5 s: ``a`` is predicted sooner."""
    aff = bal.affinity
    assert aff is not None
    blocks = tuple(range(20))
    aff.index.record("a", blocks[:19])
    assert not bal.take("a", 0, [1500 * MS], now_ns=0).items
    bal.enqueue(Queued("r", 2_000, 0, tier, aff.expected_cost(2_000, blocks), 0, blocks))


def test_the_fairness_bound_scales_with_the_tiers_batch_cap() -> None:
    # Tier 1 (from 1,000 tokens) has 4x tier 0's batch cap, so its bound is 4 x 2 s. r
    # (2,000 tokens, 1,900 held by a: 101 ms there, 2 s on b) waits for a, predicted
    # sooner (1.5 s queued): past 2 s it still waits, past 8 s b takes it (FIFO).
    bal = _two_engines((1_000,), (8 * S, 32 * S), 1, 2 * S)
    assert bal.engine_tier("a") == bal.engine_tier("b") == 1
    _wait_for_a(bal, tier=1)
    for now in (1 * S, 3 * S, 7 * S):
        assert not bal.take("b", 100 * S, [0], now_ns=now).items, now
    assert [i.request_id for i in bal.take("b", 100 * S, [0], now_ns=8 * S).items] == ["r"]


def test_the_shortest_tier_keeps_the_configured_bound() -> None:
    # The same in tier 0: past the configured 2 s, b takes r.
    bal = _two_engines((1_000_000,), (8 * S, 32 * S), 0, 2 * S)
    _wait_for_a(bal, tier=0)
    assert not bal.take("b", 100 * S, [0], now_ns=1 * S).items
    assert [i.request_id for i in bal.take("b", 100 * S, [0], now_ns=2 * S).items] == ["r"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    loads=st.lists(st.integers(0, 5 * S), min_size=1, max_size=8),
    floor_ms=st.integers(0, 2_000), limit_ms=st.integers(1, 2_000),
)
def test_a_step_is_never_longer_than_its_work_nor_its_limit(
    loads: list[int], floor_ms: int, limit_ms: int
) -> None:
    got = aff_order.step_ns(loads, limit_ms * MS, floor_ms * MS)
    busy = [x for x in loads if x > 0]
    if not busy:
        assert got == 0
        return
    assert 0 < got <= min(limit_ms * MS, max(busy))
    # it lasts at least until the lightest busy rank is done (or the limit comes first)
    assert got >= min(min(busy), limit_ms * MS)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    min_rank_ms=st.integers(0, 3_000), step_ms=st.integers(0, 3_000),
    since_ms=st.integers(0, 5_000), matched=st.integers(0, 3),
)
def test_an_engine_mid_step_is_never_predicted_sooner_than_at_its_boundary(
    min_rank_ms: int, step_ms: int, since_ms: int, matched: int
) -> None:
    aff = Affinity(PrefixIndex(block_tokens=100), cost)
    item = Queued("r", 350, 0, 0, cost(350, 0), 0, (7, 8, 9))
    eng = EngineEntry("a", 2, tier=0, min_rank_ns=min_rank_ms * MS, seen_ns=0,
                      step_ns=step_ms * MS)
    now = since_ms * MS
    mid = aff_order.finish_ns(aff, eng, item, matched, now)
    at_boundary = aff_order.finish_ns(aff, eng, item, matched, now, pulling=True)
    here = aff_order.matched_cost(aff, item, matched)
    assert mid >= at_boundary >= here
    assert mid - here == max(0, (min_rank_ms - since_ms) * MS, (step_ms - since_ms) * MS)
