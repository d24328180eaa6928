"""The pure prefill balancer: queues, rounds, who pulls, batch taking, both rule sets."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.balancer import (
    DEFAULT,
    PUBLISHED,
    RULE_SETS,
    BalancerConfig,
    Offer,
    PrefillBalancer,
    Queued,
    rules_by_name,
)

S = 1_000_000_000
BOUNDS = (16_384, 65_536, 262_144)


def make(rules: str = DEFAULT, engines: int = 0, ranks: int = 2) -> PrefillBalancer:
    bal = PrefillBalancer(
        BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S), 8.0, 1.0, 256,
                       rules_by_name(rules))
    )
    for i in range(engines):
        bal.add_engine(f"e{i}", ranks)
    return bal


def item(rid: str, total: int, cost: int, t: int = 0) -> Queued:
    return Queued(rid, total, 0, make().tier_of(total), cost, t)


def test_rule_sets_and_config_checks() -> None:
    assert set(RULE_SETS) == {DEFAULT, PUBLISHED}
    assert RULE_SETS[PUBLISHED].rank_horizon_steps is None
    assert make(PUBLISHED).config.rank_horizon_ns is None
    assert make(DEFAULT).config.rank_horizon_ns == S // 10
    assert not RULE_SETS[PUBLISHED].work_conserving
    assert not RULE_SETS[PUBLISHED].urgency and RULE_SETS[DEFAULT].urgency
    with pytest.raises(ValueError, match="known"):
        rules_by_name("nope")
    with pytest.raises(ValueError, match="batch_cap_ns"):
        BalancerConfig(BOUNDS, (S,), 8.0, 1.0, 256)
    bal = make()
    with pytest.raises(ValueError, match="tier_bounds"):
        bal.reconfigure(BalancerConfig((10,), (S, S), 8.0, 1.0, 256))


def test_queue_bookkeeping_and_requeue_front() -> None:
    bal = make(engines=1)
    a, b, c = item("a", 100, 5), item("b", 100, 7), item("c", 100, 11)
    for x in (a, b, c):
        bal.enqueue(x)
    assert bal.queued_ns(0) == 23 and bal.queue_depth(0) == 3
    with pytest.raises(ValueError, match="already queued"):
        bal.enqueue(item("a", 100, 1))
    assert bal.remove("b") is b and bal.remove("b") is None
    taken = bal.take("e0", 10 * S, [0, 0])
    assert [x.request_id for x in taken.items] == ["a", "c"]
    assert taken.quota_ns == 16 and bal.queued_ns(0) == 0
    bal.requeue_front(list(taken.items))
    assert [x.request_id for x in bal.queued(0)] == ["a", "c"]
    assert bal.queued_ns(0) == 16


def test_published_most_remaining_quota_pulls() -> None:
    bal = make(PUBLISHED, engines=2)
    bal.enqueue(item("x", 1_000, S))
    # e1 has more remaining quota although its emptiest rank holds work.
    assert bal.choose_puller(0, [Offer("e0", 5 * S, [0, 0]), Offer("e1", 9 * S, [S // 10, S])]) == 1
    # Nobody can take a head above quota unless idle.
    assert bal.choose_puller(0, [Offer("e0", S // 2, [1, 0])]) == -1
    assert bal.choose_puller(0, [Offer("e0", S // 2, [0, 0])]) == 0


def test_default_binds_late_to_the_emptiest_rank() -> None:
    bal = make(DEFAULT, engines=2)
    for i in range(12):
        bal.enqueue(item(f"r{i}", 1_000, 40_000_000))
    offers = [Offer("e0", 9 * S, [S // 10, 2 * S]), Offer("e1", 5 * S, [0, 3 * S])]
    assert bal.choose_puller(0, offers) == 1
    # Late binding: the engine takes only while its least-loaded rank is below the
    # horizon of a tenth of a step budget (100 ms). Ranks alternate at 40 ms each: after
    # four both hold 80 ms (< 100 ms), so the 5th and 6th still fit; then both hold
    # 120 ms and the rest waits in the shared queue for the next step boundary.
    taken = bal.take("e0", 100 * S, [0, 0])
    assert len(taken.items) == 6
    assert taken.ranks == (0, 1) * 3
    assert not bal.take("e1", 100 * S, [S // 10, S // 10]).items  # every rank at the horizon
    assert bal.take("e1", 100 * S, [S // 10, S // 10 - 1]).ranks == (1,)
    assert bal.take("e1", 100 * S, [90_000_000, 95_000_000]).ranks == (0, 1)


def test_work_conserving_takes_only_from_shorter_tiers() -> None:
    bal = make(DEFAULT, engines=2)
    bal.last_demand_ns = [S, 0, S, 0]
    bal.redistribute("join")  # not a round: the last round's demand counts
    short_engine = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 0)
    long_engine = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 2)
    bal.enqueue(item("short", 1_000, S // 2))
    bal.enqueue(item("long", 100_000, 20 * S))
    # The short tier's work is its own; the long tier's engine helps there only when its
    # own queue is empty, and the short engine never takes long work.
    assert bal.source_tier(long_engine, [0, 0]) == 2
    assert bal.take(long_engine, 100 * S, [0, 0]).items[0].request_id == "long"
    assert bal.source_tier(long_engine, [0, 0]) == 0
    assert bal.source_tier(long_engine, [2 * S, 2 * S]) == 2  # no room: stays on its tier
    bal.remove("short")
    bal.enqueue(item("long2", 100_000, 20 * S))
    assert bal.source_tier(short_engine, [0, 0]) == 0
    pub = make(PUBLISHED, engines=1)
    pub.enqueue(item("short", 1_000, S))
    pub.last_demand_ns = [0, 0, S, 0]
    assert pub.redistribute("round").counts == (1, 0, 0, 0)  # short work still queued


def test_urgency_takes_the_tier_whose_head_waited_longest_for_its_scale() -> None:
    bal = make(DEFAULT, engines=2)
    bal.last_demand_ns = [S, S, 0, 0]
    bal.redistribute("join")
    long_engine = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 1)
    short_engine = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 0)
    # Tier scales are the batch caps: 8 s for <16K, 32 s for 16K-64K.
    bal.enqueue(item("short", 1_000, S // 10, t=0))
    bal.enqueue(item("mid", 20_000, S, t=0))  # within the short engine's 2 s bound
    # At 1 s both heads waited 1 s: 1/8 of the short tier's scale vs 1/32 of the mid's.
    assert bal.source_tier(long_engine, [0, 0], now_ns=S) == 0
    assert bal.source_tier(short_engine, [0, 0], now_ns=S) == 0
    # Without the time, the old rule: its own tier has work, so its own tier.
    assert bal.source_tier(long_engine, [0, 0]) == 1
    # No room (every rank past the horizon): its own tier, whatever waited.
    assert bal.source_tier(long_engine, [S, S], now_ns=S) == 1
    assert bal.source_tier(short_engine, [S, S], now_ns=100 * S) == 0
    # A fresh short head (waited 0) against the mid head that waited 1 s: the mid tier,
    # for both engines (the short tier's engine with room helps the longer tier too).
    bal.remove("short")
    bal.enqueue(item("short2", 1_000, S // 10, t=S))
    assert bal.source_tier(long_engine, [0, 0], now_ns=S) == 1
    assert bal.source_tier(short_engine, [0, 0], now_ns=S) == 1
    # Equal urgency: at 4 s a short head queued at 3 s waited 1/8 of its scale, the mid
    # head 4/32: each engine keeps its own tier.
    bal.remove("short2")
    bal.enqueue(item("short2", 1_000, S // 10, t=3 * S))
    assert bal.source_tier(short_engine, [0, 0], now_ns=4 * S) == 0
    assert bal.source_tier(long_engine, [0, 0], now_ns=4 * S) == 1
    # At 10 s: short waited 7/8, mid 10/32: the short tier for both.
    assert bal.source_tier(long_engine, [0, 0], now_ns=10 * S) == 0
    # take() follows the same choice when given the time.
    assert bal.take(long_engine, 100 * S, [0, 0], now_ns=10 * S).items[0].request_id == "short2"
    # The published rules keep engines to their tier.
    pub = make(PUBLISHED, engines=2)
    pub.last_demand_ns = [S, S, 0, 0]
    pub.redistribute("join")
    pub_long = next(e for e in ("e0", "e1") if pub.engine_tier(e) == 1)
    pub.enqueue(item("short", 1_000, S // 10, t=0))
    assert pub.source_tier(pub_long, [0, 0], now_ns=100 * S) == 1


def test_urgency_never_lends_a_short_engine_to_a_long_prompt() -> None:
    bal = make(DEFAULT, engines=2)
    bal.last_demand_ns = [S, 0, 0, S]
    bal.redistribute("join")
    short_engine = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 0)
    assert bal.helping_bound_ns(0) == 2 * S  # a quarter of the 8 s batch cap
    # A fresh 300K-token prompt (5 min) waited an hour: the short engine still leaves it.
    bal.enqueue(item("huge", 300_000, 300 * S, t=0))
    assert bal.source_tier(short_engine, [0, 0], now_ns=3600 * S) == 0
    assert not bal.take(short_engine, 100 * S, [0, 0], now_ns=3600 * S).items
    # A long context whose prefix is cached costs little: it may help with it, and takes
    # the FIFO prefix only up to the first request over the bound.
    bal.remove("huge")
    bal.enqueue(item("cached", 300_000, S, t=0))
    bal.enqueue(item("cached2", 300_000, S // 2, t=0))
    bal.enqueue(item("huge2", 300_000, 300 * S, t=0))
    bal.enqueue(item("cached3", 300_000, S // 2, t=0))
    assert bal.source_tier(short_engine, [0, 0], now_ns=10 * S) == 3
    got = bal.take(short_engine, 100 * S, [0, 0], now_ns=10 * S)
    assert [x.request_id for x in got.items] == ["cached", "cached2"]


def test_orphan_redistribution_and_gate() -> None:
    bal = make(DEFAULT, engines=2)
    bal.last_demand_ns = [S, 0, 0, 0]
    assert bal.redistribute("join").counts == (2, 0, 0, 0)
    red = bal.enqueue(item("long", 100_000, 20 * S))
    assert red is not None and red.reason == "orphan" and red.counts[2] == 1
    one = make(DEFAULT, engines=1)
    one.last_demand_ns = [S, 0, 0, 0]
    one.redistribute("join")
    one.enqueue(item("short", 100, S))
    # One engine cannot cover two tiers with demand: the next round decides.
    assert one.enqueue(item("long", 100_000, 20 * S)) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("sub"), st.sampled_from([500, 20_000, 100_000, 300_000]),
                      st.integers(1, 30 * S)),
            st.tuples(st.just("take"), st.integers(0, 2), st.integers(0, 40 * S),
                      st.lists(st.integers(0, 3 * S), min_size=2, max_size=2)),
            st.tuples(st.just("round")),
            st.tuples(st.just("drop"), st.integers(0, 50)),
        ),
        max_size=60,
    ),
    st.sampled_from([DEFAULT, PUBLISHED]),
)
def test_every_request_leaves_once_and_quota_stays_exact(
    ops: list[tuple[object, ...]], rules: str
) -> None:
    bal = make(rules, engines=3)
    queued: dict[str, int] = {}
    gone: set[str] = set()
    n = 0
    for op in ops:
        if op[0] == "sub":
            total, cost = int(op[1]), int(op[2])  # type: ignore[call-overload]
            rid = f"r{n}"
            n += 1
            bal.enqueue(Queued(rid, total, 0, bal.tier_of(total), cost, n))
            queued[rid] = cost
        elif op[0] == "take":
            eid = f"e{op[1]}"
            loads = list(op[3])  # type: ignore[call-overload]
            taken = bal.take(eid, int(op[2]), loads)  # type: ignore[call-overload]
            for x in taken.items:
                assert x.request_id in queued and x.request_id not in gone
                gone.add(x.request_id)
                del queued[x.request_id]
            assert len(taken.ranks) == len(taken.items)
            assert all(0 <= r < 2 for r in taken.ranks)
            if taken.items and not any(loads):
                pass  # an idle engine may take an oversize head alone
            elif taken.items:
                assert taken.quota_ns <= int(op[2])  # type: ignore[call-overload]
        elif op[0] == "round":
            red = bal.redistribute("round")
            assert sum(red.counts) == 3
        elif op[0] == "drop" and queued:
            rid = sorted(queued)[int(op[1]) % len(queued)]  # type: ignore[call-overload]
            assert bal.remove(rid) is not None
            del queued[rid]
        for t in range(bal.n_tiers):
            assert bal.queued_ns(t) == sum(x.cost_ns for x in bal.queued(t))
        assert sum(bal.queue_depth(t) for t in range(bal.n_tiers)) == len(queued)


def test_unknown_engine_and_wrong_rank_count() -> None:
    bal = make(engines=1)
    with pytest.raises(ValueError, match="unknown prefill engine"):
        bal.take("nope", S, [0, 0])
    with pytest.raises(ValueError, match="rank_loads_ns"):
        bal.take("e0", S, [0])
    assert bal.remove_engine("nope") is None
    red = bal.remove_engine("e0")
    assert red is not None and sum(red.counts) == 0
    assert dataclasses.replace(RULE_SETS[DEFAULT], name="x").name == "x"
