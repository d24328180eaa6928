"""The pull's affinity prices a request as the gateway's cache-aware pick does (issue 21:
one function in core, two shells), and every decision of the pull uses the prediction."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued
from fulcrum.core.prefill.items import EngineEntry, Offer
from fulcrum.core.prefix_cost import Coefficients, predicted_ttft_ns, predicted_ttft_one_ns

S = 1_000_000_000
MS = 1_000_000


def cost(q: int, c: int) -> int:
    """1 ms per computed token plus 1 ms fixed (ns)."""
    return MS * q + MS


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    load=st.integers(-10 * S, 10 * S), cached=st.integers(-5, 200_000),
    prompt=st.integers(0, 200_000),
)
def test_scalar_prediction_is_the_vector_one(load: int, cached: int, prompt: int) -> None:
    model = CostModel(2.0, 56_000.0, 5_000_000.0)
    one = predicted_ttft_one_ns(load, cached, prompt, model.cost_ns)
    vec = predicted_ttft_ns(np.array([load]), np.array([cached]), prompt, Coefficients.of(model))
    assert math.isclose(one, float(vec[0]), rel_tol=1e-12, abs_tol=1.0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    blocks=st.integers(1, 40), matched=st.integers(0, 40), extra=st.integers(0, 511),
    min_rank_ms=st.integers(0, 5_000), since_ms=st.integers(0, 5_000),
)
def test_pull_finish_is_the_gateways_prediction(blocks: int, matched: int, extra: int,
                                                min_rank_ms: int, since_ms: int) -> None:
    """The pull's predicted finish equals the gateway's predicted TTFT for the same load,
    cached prefix and prompt (a request reporting no global-pool hit)."""
    model = CostModel(2.0, 56_000.0, 5_000_000.0)
    aff = Affinity(PrefixIndex(block_tokens=512), model.cost_ns)
    matched = min(matched, blocks)
    total = 512 * (blocks - 1) + extra + 1
    item = Queued("r", total, 0, 0, model.cost_ns(total, 0), 0, tuple(range(blocks)))
    eng = EngineEntry("e", 1, tier=0, min_rank_ns=min_rank_ms * MS, seen_ns=0)
    now = since_ms * MS
    load = max(0, (min_rank_ms - since_ms) * MS)
    got = aff_order.finish_ns(aff, eng, item, matched, now)
    want = predicted_ttft_ns(np.array([load]), np.array([matched * 512]), total,
                             Coefficients.of(model))
    assert math.isclose(got, float(want[0]), rel_tol=1e-12, abs_tol=1.0)
    assert aff_order.matched_cost(aff, item, matched) == predicted_ttft_one_ns(
        0, matched * 512, total, model.cost_ns)


def _bal() -> PrefillBalancer:
    bal = PrefillBalancer(BalancerConfig(
        bounds=(1_000_000,), batch_cap_ns=(1000 * S, 1000 * S), backlog_rounds=1.0,
        hysteresis=0.0, max_batch_requests=1,
    ))
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=100 * S)
    bal.affinity = aff
    bal.enqueue(Queued("seed", 10, 0, 0, 1, 0))
    for e in ("a", "b"):
        aff.index.add_engine(e, 1000)
        bal.add_engine(e, 1)
    bal.remove("seed")
    return bal


def _held_request(bal: PrefillBalancer) -> Queued:
    """``r`` (350 tokens) of which ``a`` holds 200: 151 ms on ``a``, 351 ms on ``b``.
    ``a`` last pulled with 700 ms on its rank (free at 700 ms): 851 ms > 351 ms plus
    the grace (the 200 ms ``a`` saves, at most two step floors: 200 ms)."""
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    assert not bal.take("a", 0, [700 * MS], now_ns=0).items
    blocks = (7, 8, 9)
    return Queued("r", 350, 0, 0, aff.expected_cost(350, blocks), 1, blocks)


def test_pick_uses_the_predicted_finish() -> None:
    # Order level: with the prediction, b (idle) is able to take r, since a finishes it
    # later; without it, r waits for its holder whenever one exists.
    bal = _bal()
    aff = bal.affinity
    assert aff is not None
    item = _held_request(bal)
    w = aff_order.Window([item], ["a", "b"], aff.index, aff.max_wait_ns)
    assert w.held(0) == {"a": 2}
    offers = [Offer("b", 100 * S, [0])]

    def finish(e: str, it: Queued, m: int, ahead: int) -> int:
        return aff_order.finish_ns(aff, bal.engine(e), it, m, 1, ahead_ns=ahead)

    def first(o: Offer, i: int) -> tuple[int, ...]:
        return (i,)

    assert aff_order.pick(aff, offers, 1, w, lambda o, it: True, first, finish) == 0
    assert aff_order.pick(aff, offers, 1, w, lambda o, it: True, first) == -1


def test_choose_puller_and_take_agree_on_a_held_request() -> None:
    # b's own pull takes r (a is predicted later), so choosing b as the puller must agree.
    bal = _bal()
    item = _held_request(bal)
    bal.enqueue(item)
    assert bal.choose_puller(0, [Offer("b", 100 * S, [0])], now_ns=1) == 0
    assert [i.request_id for i in bal.take("b", 100 * S, [0], now_ns=1).items] == ["r"]


def test_the_pullers_own_finish_uses_its_current_rank_loads() -> None:
    # b last pulled with 1 s queued; it now reports an idle rank. Priced from its current
    # loads (351 ms) it beats the holder a (851 ms) and takes r; priced from its stale
    # drained prediction (1 s + 351 ms) it would leave r waiting.
    bal = _bal()
    item = _held_request(bal)
    assert not bal.take("b", 0, [1000 * MS], now_ns=0).items
    bal.enqueue(item)
    assert [i.request_id for i in bal.take("b", 100 * S, [0], now_ns=1).items] == ["r"]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    min_rank_ms=st.integers(0, 5_000), step_ms=st.integers(0, 5_000),
    seen_ms=st.integers(0, 5_000), now_ms=st.integers(0, 10_000), ranks=st.integers(1, 8),
    matched=st.integers(0, 3), ahead_ms=st.integers(0, 3_000), pulling=st.booleans(),
    known=st.booleans(),
)
def test_the_decisions_pricer_is_finish_ns(min_rank_ms: int, step_ms: int, seen_ms: int,
                                           now_ms: int, ranks: int, matched: int,
                                           ahead_ms: int, pulling: bool, known: bool) -> None:
    """``Pricer`` (one decision's cached form) predicts what :func:`finish_ns` does."""
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=100 * S)
    item = Queued("r", 350, 0, 0, cost(350, 0), 0, (7, 8, 9))
    eng = EngineEntry("e", ranks, tier=0, min_rank_ns=min_rank_ms * MS, seen_ns=seen_ms * MS,
                      step_ns=step_ms * MS) if known else None
    w = aff_order.Window([item], ["e"], aff.index, 100 * S)
    now = now_ms * MS
    price = aff_order.Pricer(aff, w, lambda e: eng, now, lambda e: pulling)
    for _ in range(2):  # the second call reads the cached parts
        assert price("e", item, matched, ahead_ms * MS) == aff_order.finish_ns(
            aff, eng, item, matched, now, pulling, ahead_ms * MS)
