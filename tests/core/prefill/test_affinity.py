"""Prefix index and prefix affinity inside the pull (issue 15)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued

S = 1_000_000_000


def cost(q: int, c: int) -> int:
    """A cost model: 1 ms per computed token plus 1 ms fixed (ns)."""
    return 1_000_000 * q + 1_000_000


# -- index ---------------------------------------------------------------------------------


def _chains(paths: list[list[int]]) -> list[tuple[int, ...]]:
    """Chained block hashes of prompts given as paths of choices: block i's hash stands
    for the whole path up to i (the same prefix, the same hash), as the protocol's
    chained hashes do."""
    ids: dict[tuple[int, ...], int] = {}
    return [tuple(ids.setdefault(tuple(p[: i + 1]), len(ids) + 1) for i in range(len(p)))
            for p in paths]


def test_match_is_the_leading_run() -> None:
    idx = PrefixIndex(block_tokens=4)
    idx.add_engine("a", 100)
    idx.record("a", [1, 2, 3])
    assert idx.match("a", [1, 2, 3, 4]) == 3
    assert idx.match("a", [1, 9, 10]) == 1  # the prompt differs after block 1
    assert idx.match("a", [9, 10, 11]) == 0  # another prompt
    assert idx.match("unknown", [1]) == 0
    assert idx.cached_tokens(3, 100) == 12
    assert idx.cached_tokens(3, 12) == 11  # the last token is always computed


@pytest.mark.parametrize(
    ("stored", "blocks", "want"),
    [
        ((1, 2, 3), (1, 2, 3, 4), 3),
        ((1, 2, 3, 4), (1, 2, 3, 4), 4),
        ((), (1, 2), 0),
        ((9,), (1, 2), 0),
        ((1,), (1, 2, 3, 4, 5, 6, 7), 1),
    ],
)
def test_match_bisects_to_the_last_block_held(
    stored: tuple[int, ...], blocks: tuple[int, ...], want: int
) -> None:
    idx = PrefixIndex(block_tokens=4)
    idx.add_engine("a", 100)
    idx.stored("a", stored)
    assert idx.match("a", blocks) == want
    assert idx.match("unknown", blocks) == 0
    assert idx.holds("a", 1) == (1 in stored) and not idx.holds("unknown", 1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), k=st.integers(0, 40), hole=st.integers(0, 40))
def test_match_is_the_held_prefix_and_a_lost_eviction_never_makes_it_fall_short(
    n: int, k: int, hole: int
) -> None:
    blocks = tuple(range(100, 100 + n))
    idx = PrefixIndex()
    idx.add_engine("a", 1000)
    idx.stored("a", (*blocks[: min(k, n)], 7, 8))  # a prefix, and blocks of other prompts
    assert idx.match("a", blocks) == min(k, n)
    if hole < min(k, n):  # an eviction report inside the prefix (its tail's were lost)
        idx.evicted("a", [blocks[hole]])
        assert hole <= idx.match("a", blocks) <= min(k, n)


def _walk(held: object, blocks: tuple[int, ...]) -> int:
    n = 0
    while n < len(blocks) and blocks[n] in held:  # type: ignore[operator]
        n += 1
    return n


@settings(max_examples=80, deadline=None)
@given(
    cap=st.integers(0, 12),
    paths=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=40),
)
def test_held_blocks_stay_prefix_closed_so_bisection_is_the_walk(
    cap: int, paths: list[list[int]]
) -> None:
    """Whatever the capacity, an engine never holds a block without its whole prefix
    (a request's head is touched last, so its tail is evicted first): the bisection
    :meth:`PrefixIndex.match` does equals the walk of the leading run."""
    chains = _chains(paths)
    parent = {c[i]: c[i - 1] for c in chains for i in range(1, len(c))}
    idx = PrefixIndex()
    idx.add_engine("a", cap)
    for blocks in chains:
        c = idx.cache("a")
        assert c is not None
        assert idx.match("a", blocks) == _walk(c.blocks, blocks)
        idx.record("a", blocks)
        assert all(parent[b] in c.blocks for b in c.blocks if b in parent)
        assert len(c.blocks) <= cap


def test_lru_bounded_by_capacity() -> None:
    idx = PrefixIndex()
    idx.add_engine("a", 3)
    idx.record("a", [1, 2])
    idx.record("a", [3])
    idx.record("a", [1])  # touch 1: 2 is now the oldest
    idx.record("a", [4])
    c = idx.cache("a")
    assert c is not None and list(c.blocks) == [3, 1, 4]
    assert idx.size() == 3


def test_zero_capacity_holds_nothing() -> None:
    idx = PrefixIndex()
    idx.add_engine("a", 0)
    assert idx.record("a", [1, 2]) == 0
    assert idx.size() == 0


def test_reregistration_drops_unless_kept() -> None:
    idx = PrefixIndex()
    idx.add_engine("a", 10)
    idx.record("a", [1, 2, 3])
    idx.add_engine("a", 10, keep=True)
    assert idx.match("a", [1, 2, 3]) == 3
    idx.add_engine("a", 2, keep=True)  # kept content trimmed to the new capacity
    assert idx.size() == 2
    idx.add_engine("a", 10)
    assert idx.match("a", [1, 2, 3]) == 0


def test_exact_mode_events() -> None:
    idx = PrefixIndex()
    idx.add_engine("a", 10)
    idx.stored("a", [5, 6])
    assert idx.match("a", [5, 6]) == 2
    idx.evicted("a", [6])
    assert idx.match("a", [5, 6]) == 1


def test_capacity_validated() -> None:
    idx = PrefixIndex()
    with pytest.raises(ValueError, match="capacity_blocks"):
        idx.add_engine("a", -1)


@settings(max_examples=60, deadline=None)
@given(
    cap=st.integers(0, 8),
    paths=st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=40),
)
def test_index_never_exceeds_capacity_and_hits_are_held(cap: int, paths: list[list[int]]) -> None:
    idx = PrefixIndex()
    idx.add_engine("a", cap)
    for blocks in _chains(paths):
        m = idx.match("a", blocks)
        c = idx.cache("a")
        assert c is not None
        assert all(b in c.blocks for b in blocks[:m])
        assert idx.record("a", blocks) == m
        assert len(c.blocks) <= cap


# -- balancer ------------------------------------------------------------------------------


def _bal(max_wait_ns: int = 10 * S, engines: tuple[str, ...] = ("a", "b")) -> PrefillBalancer:
    bal = PrefillBalancer(BalancerConfig(
        bounds=(1_000_000,), batch_cap_ns=(1000 * S, 1000 * S), backlog_rounds=1.0,
        hysteresis=0.0, max_batch_requests=1,
    ))
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=max_wait_ns)
    bal.affinity = aff
    bal.enqueue(Queued("seed", 10, 0, 0, 1, 0))  # demand in tier 0 only
    for e in engines:
        aff.index.add_engine(e, 1000)
        bal.add_engine(e, 1)
    bal.remove("seed")
    for e in engines:  # both serve tier 0 (nothing else has demand)
        assert bal.engine_tier(e) == 0
    return bal


def _item(rid: str, blocks: tuple[int, ...], t: int, bal: PrefillBalancer) -> Queued:
    total = 100 * len(blocks) + 50
    aff = bal.affinity
    assert aff is not None
    return Queued(rid, total, 0, 0, aff.expected_cost(total, blocks), t, blocks)


def test_cost_is_per_engine_miss_tokens() -> None:
    bal = _bal()
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (1, 2))
    it = _item("r", (1, 2, 3), 0, bal)
    assert bal.cost_for(it, "a") == cost(350 - 200, 200)
    assert bal.cost_for(it, "b") == cost(350, 0)
    assert it.cost_ns == cost(350 - 200, 200)  # expected cost: where affinity sends it


def test_pull_takes_the_longest_held_prefix_first() -> None:
    bal = _bal()
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    bal.enqueue(_item("r0", (1,), 0, bal))
    bal.enqueue(_item("r1", (7, 8, 9), 1, bal))
    taken = bal.take("a", 100 * S, [0], now_ns=2)
    assert [i.request_id for i in taken.items] == ["r1"]
    assert aff.hits == 1
    assert aff.index.match("a", (7, 8, 9)) == 3  # recorded as held
    # Without a clock the pull is FIFO (the published behaviour).
    bal.enqueue(_item("r2", (7, 8, 9), 3, bal))
    assert [i.request_id for i in bal.take("a", 100 * S, [0]).items] == ["r0"]


def test_request_waits_for_its_holder_until_the_fairness_bound() -> None:
    bal = _bal(max_wait_ns=5 * S)
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    bal.enqueue(_item("r", (7, 8, 9), 0, bal))
    # b pulls while a holds the prefix: r waits for a.
    assert not bal.take("b", 100 * S, [0], now_ns=1 * S).items
    assert not bal.can_take(0, _offer("b"), now_ns=1 * S)
    assert bal.choose_puller(0, [_offer("b"), _offer("a")], now_ns=1 * S) == 1
    # Past the bound, FIFO wins: b takes it.
    assert bal.can_take(0, _offer("b"), now_ns=5 * S)
    taken = bal.take("b", 100 * S, [0], now_ns=5 * S)
    assert [i.request_id for i in taken.items] == ["r"]
    assert aff.overrides == 1
    assert taken.quota_ns == cost(350, 0)  # charged at b's own cost


def _offer(e: str):  # type: ignore[no-untyped-def]
    from fulcrum.core.prefill.balancer import Offer

    return Offer(e, 100 * S, (0,))


def test_choose_puller_prefers_the_holder() -> None:
    bal = _bal()
    aff = bal.affinity
    assert aff is not None
    aff.index.record("b", (4,))
    bal.enqueue(_item("r", (4, 5), 0, bal))
    assert bal.choose_puller(0, [_offer("a"), _offer("b")], now_ns=1) == 1
    assert bal.choose_puller(0, [_offer("a"), _offer("b")]) in (0, 1)


@settings(max_examples=40, deadline=None)
@given(
    seq=st.lists(
        st.tuples(st.sampled_from(["a", "b", "sub"]), st.lists(st.integers(0, 5), max_size=4)),
        max_size=40,
    )
)
def test_affinity_keeps_queue_accounting_and_fairness(seq: list[tuple[str, list[int]]]) -> None:
    """Every submitted request is taken at most once; queued quota stays exact; no pull
    leaves a request queued past the bound while taking a younger one."""
    bal = _bal(max_wait_ns=3)
    now = 0
    seen: set[str] = set()
    n = 0
    for op, blocks in seq:
        now += 1
        if op == "sub":
            bal.enqueue(_item(f"r{n}", tuple(blocks), now, bal))
            n += 1
            continue
        head = bal.head(0)
        taken = bal.take(op, 100 * S, [0], now_ns=now)
        for it in taken.items:
            assert it.request_id not in seen
            seen.add(it.request_id)
        if head is not None and now - head.enqueued_ns >= 3 and taken.items:
            assert taken.items[0] is head
        assert bal.queued_ns(0) == sum(i.cost_ns for i in bal.queued(0))


def test_grown_turn_joins_its_holders_shorter_tier_when_it_fits() -> None:
    bal = PrefillBalancer(BalancerConfig(
        bounds=(1_000,), batch_cap_ns=(1000 * S, 1000 * S), backlog_rounds=1.0,
        hysteresis=0.0, max_batch_requests=4,
    ))
    aff = Affinity(PrefixIndex(block_tokens=100), cost)
    bal.affinity = aff
    bal.enqueue(Queued("s0", 10, 0, 0, 1, 0))
    bal.enqueue(Queued("s1", 2_000, 0, 1, 1, 0))
    for e in ("a", "b"):
        aff.index.add_engine(e, 1_000)
        bal.add_engine(e, 1)
    short = next(e for e in ("a", "b") if bal.engine_tier(e) == 0)
    long_ = next(e for e in ("a", "b") if bal.engine_tier(e) == 1)
    blocks = tuple(range(10))
    assert bal.tier_for(1_050, blocks) == 1  # nobody holds it: by length
    aff.index.record(long_, blocks[:9])
    assert bal.tier_for(1_050, blocks) == 1  # the holder serves the long tier already
    aff.index.record(short, blocks[:9])
    assert bal.tier_for(1_050, blocks) == 0  # cost(150, 900) fits tier 0
    assert bal.tier_for(1_050, ()) == 1
    # A turn whose miss on the holder costs more than a fresh 1,000-token prompt stays.
    assert bal.tier_for(2_500, (*blocks, *range(100, 115))) == 1


def test_memoised_match_follows_every_change() -> None:
    idx = PrefixIndex()
    idx.add_engine("a", 3)
    memo: dict[str, tuple[int, int, int]] = {}
    assert idx.match_memo("a", [1, 2], memo) == 0
    idx.record("a", [1, 2])
    assert idx.match_memo("a", [1, 2], memo) == 2
    idx.evicted("a", [2])
    assert idx.match_memo("a", [1, 2], memo) == 1
    idx.record("a", [3, 4, 5])  # evicts 1
    assert idx.match_memo("a", [1, 2], memo) == 0
    idx.stored("a", [1])
    idx.add_engine("a", 3)  # re-registered: a new, empty cache
    assert idx.match_memo("a", [1, 2], memo) == 0


def test_late_binding_applies_to_held_requests_too() -> None:
    # Default rules: late binding at a tenth of the 1 s step budget. Engine "a" holds
    # the prefix of "held", but every rank of "a" already has 0.5 s of work, past the
    # horizon: "a" binds nothing early (issue 21: early binding piled held work on busy
    # ranks while other engines idled). An idle "b" is predicted to finish it sooner
    # than "a" (0.5 s busy + 1 block to compute vs 4 blocks now), so "b" takes it.
    bal = _bal(max_wait_ns=10 * S)
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (1, 2, 3))
    bal.enqueue(_item("held", (1, 2, 3, 4), 0, bal))
    busy = [S // 2]
    assert not bal.take("a", 100 * S, busy, now_ns=1).items
    assert bal.take("b", 100 * S, [0], now_ns=1).items[0].request_id == "held"


def test_request_waits_only_while_its_holder_is_predicted_sooner() -> None:
    # cost(q, c) = 1 ms per computed token + 1 ms. "a" holds 300 of r's 350 tokens.
    bal = _bal(max_wait_ns=100 * S)
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    # "a" pulls with 40 ms on its only rank: free at t = 40 ms + 1 ns.
    assert not bal.take("a", 100 * S, [40_000_000], now_ns=1).items
    bal.enqueue(_item("r", (7, 8, 9), 0, bal))
    # b now: 351 ms from scratch; a: 40 ms left + 51 ms -> r waits for a.
    assert not bal.take("b", 100 * S, [0], now_ns=1).items
    # "a" pulls again, now with 700 ms queued on its rank: 700 + 51 > 351 + the grace
    # (the recompute a saves, 300 ms, capped at two step floors, 200 ms): b takes r.
    assert not bal.take("a", 0, [700_000_000], now_ns=2).items
    taken = bal.take("b", 100 * S, [0], now_ns=3)
    assert [i.request_id for i in taken.items] == ["r"]
    assert taken.quota_ns == cost(350, 0)  # charged at b's own cost
    assert aff.overrides == 0  # not a fairness override: a prediction


def test_a_holders_predicted_load_drains_with_time() -> None:
    bal = _bal(max_wait_ns=100 * S, engines=("a", "b", "c"))
    aff = bal.affinity
    assert aff is not None
    aff.index.record("a", (7, 8))
    assert not bal.take("a", 0, [700_000_000], now_ns=0).items
    bal.enqueue(_item("r", (7, 8, 9), 0, bal))
    assert bal.take("c", 100 * S, [0], now_ns=1).items  # a busy for 700 ms: c takes it
    bal.enqueue(_item("r2", (7, 8, 10), 650_000_000, bal))
    # 650 ms later a has 50 ms left: 50 + 51 < 351, so b leaves r2 to a holder.
    assert not bal.take("b", 100 * S, [0], now_ns=650_000_000).items
    taken = bal.take("a", 100 * S, [0], now_ns=650_000_001)
    assert [i.request_id for i in taken.items] == ["r2"]


def test_urgency_is_on_under_prefix_affinity() -> None:
    # Two tiers; "b" serves the longer one. The shorter tier's head has waited far longer
    # for its scale: "b" helps it, with or without per-engine caches (issue 21: the
    # predicted-finish rule keeps a helper from taking what a holder finishes sooner).
    bal = PrefillBalancer(BalancerConfig(
        bounds=(1_000,), batch_cap_ns=(8 * S, 32 * S), backlog_rounds=1.0,
        hysteresis=0.0, max_batch_requests=4,
    ))
    bal.affinity = Affinity(PrefixIndex(block_tokens=100), cost)
    bal.last_demand_ns = [float(S), float(S)]
    for e in ("a", "b"):
        bal.affinity.index.add_engine(e, 1000)
        bal.add_engine(e, 1)
    long_engine = next(e for e in ("a", "b") if bal.engine_tier(e) == 1)
    bal.enqueue(Queued("short", 10, 0, 0, S // 10, 0))
    bal.enqueue(Queued("long", 2_000, 0, 1, S // 10, 9 * S))
    assert bal.source_tier(long_engine, [0], now_ns=10 * S) == 0
    bal.affinity = None
    assert bal.source_tier(long_engine, [0], now_ns=10 * S) == 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(
    st.sampled_from(["record", "stored", "evicted", "add", "keep", "remove", "ask"]),
    st.integers(0, 2), st.lists(st.integers(0, 9), max_size=5), st.integers(0, 6)),
    max_size=60))
def test_holders_counts_the_engines_holding_each_block(
    ops: list[tuple[str, int, list[int], int]]
) -> None:
    """:meth:`PrefixIndex.holders` and the tracked holders of first blocks (kept in step
    by every insert, eviction, report, re-registration and removal) equal a count over
    the engines' caches; :meth:`PrefixIndex.starts` answers as a pass over every cache
    would (asked of a copy: asking tracks, and what is untracked must stay so here)."""
    idx = PrefixIndex()
    names = ["a", "b", "c"]
    for e in names:
        idx.add_engine(e, 4)
    for op, k, blocks, cap in ops:
        e = names[k]
        if op == "record":
            idx.record(e, blocks)
        elif op == "stored":
            idx.stored(e, blocks)
        elif op == "evicted":
            idx.evicted(e, blocks)
        elif op in ("add", "keep"):
            idx.add_engine(e, cap, keep=op == "keep")
        elif op == "remove":
            idx.remove_engine(e)
        else:
            idx.starts(names, frozenset(blocks))  # asked: tracked from now on
        want = {b: [x for x in names if idx.holds(x, b)] for b in range(10)}
        for b in range(10):
            assert idx.holders(b) == len(want[b])
        assert idx.size() == sum(len(want[b]) for b in range(10))
        for first in range(10):  # the longest run held of blocks first, first + 1, ...
            run = [first, *((first + 1 + i) % 10 for i in range(4))]
            assert copy.deepcopy(idx).best_match(run) == max(
                (idx.match(x, run) for x in names), default=0)
        for b, holders in idx._where.items():
            assert holders and sorted(holders) == want[b]
        assert copy.deepcopy(idx).starts(names[::-1], range(10)) == {
            b: es[::-1] for b, es in want.items() if es}
