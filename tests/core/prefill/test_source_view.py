"""One dispatch reads the queue once (issue 21): every waiting engine's source tier is
read through one :class:`SourceView`, and the answers are the ones each engine gets
alone (engines holding none of what it reads share one answer per tier and room). The
C-level "holds none of the first blocks" check only skips what the per-request loop of
``_held_tier`` would skip (checked with it forced off)."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import (
    DEFAULT,
    BalancerConfig,
    Offer,
    PrefillBalancer,
    Queued,
    rules_by_name,
    source_tiers,
)
from fulcrum.core.prefill.dispatch import pick_puller
from fulcrum.core.tenants import RequestClass

S = 1_000_000_000
MS = 1_000_000
BOUNDS = (16_384, 65_536, 262_144)
BLOCK = 1_000  # tokens per block
SIZES = (4, 30, 100, 300)  # blocks of a request in each tier (1,000 tokens each)


def cost(q: int, c: int) -> int:
    """50 us per computed token plus 10 ms fixed (ns)."""
    return 50_000 * q + 10 * MS


def _fleet(engines: int, demand: list[int]) -> tuple[PrefillBalancer, list[str]]:
    """``engines`` engines of 2 ranks over the four tiers by ``demand`` (ns per tier)."""
    bal = PrefillBalancer(BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S), 8.0,
                                         1.0, 256, rules_by_name(DEFAULT)))
    bal.affinity = Affinity(PrefixIndex(block_tokens=BLOCK), cost, max_wait_ns=10 * S)
    ids = [f"e{i}" for i in range(engines)]
    for e in ids:
        bal.add_engine(e, 2)
        bal.affinity.index.add_engine(e, 100_000)
    bal.last_demand_ns = [float(x) for x in demand]
    bal.redistribute("join")
    return bal, ids


def _queue(bal: PrefillBalancer, ids: list[str],
           reqs: list[tuple[int, int, int, int, int]]) -> None:
    """Queue ``(tier, enqueued ms, priority, holder index, held blocks)`` requests; the
    holder (index into ``ids``, or past its end: nobody) holds that many leading blocks."""
    aff = bal.affinity
    assert aff is not None
    for i, (tier, at_ms, prio, holder, held) in enumerate(reqs):
        n = SIZES[tier]
        hashes = tuple(range(i * 1_000, i * 1_000 + n))
        if holder < len(ids):
            aff.index.stored(ids[holder], hashes[: min(held, n)])
        total = BLOCK * n
        bal.enqueue(Queued(f"r{i}", total, 0, bal.tier_of(total),
                           aff.expected_cost(total, hashes), at_ms * MS, hashes,
                           cls=RequestClass(priority=prio)))


fleets = st.tuples(
    st.integers(2, 10),
    st.lists(st.integers(0, 4), min_size=4, max_size=4).map(lambda d: [x * S for x in d]),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3_000), st.integers(0, 1),
                       st.integers(0, 12), st.integers(1, 300)), max_size=40),
    st.lists(st.sampled_from([0, 5, 400, 3_000, 9_000]), min_size=24, max_size=24),
    st.integers(0, 12_000),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(fleets)
def test_one_view_per_dispatch_answers_as_each_engine_alone(
    case: tuple[int, list[int], list[tuple[int, int, int, int, int]], list[int], int],
) -> None:
    engines, demand, reqs, loads_ms, now_ms = case
    bal, ids = _fleet(engines, demand)
    _queue(bal, ids, reqs)
    now = now_ms * MS
    # Both ranks loaded past the binding horizon: no room (then its own tier).
    loads = {e: [loads_ms[i] * MS, loads_ms[12 + i] * MS] for i, e in enumerate(ids)}
    shared = source_tiers(bal, [Offer(e, 10**12, loads[e]) for e in ids], now)
    alone = [bal.source_tier(e, loads[e], now) for e in ids]
    assert shared == alone
    with mock.patch.object(PrefixIndex, "holds_any", lambda self, e, blocks: True):
        # the per-request loop of every tier, always
        looped = [bal.source_tier(e, loads[e], now) for e in ids]
    assert shared == looped
    for tier in range(bal.n_tiers):  # the dispatch picks among those answers
        offers = [Offer(e, 10**12, tuple(loads[e])) for e in ids]
        got = pick_puller(bal, tier, offers, now)
        able = [i for i, t in enumerate(alone) if t == tier]
        j = bal.choose_puller(tier, [offers[i] for i in able], now_ns=now)
        assert got == (-1 if j < 0 else able[j])


def test_a_dispatch_reads_each_tier_s_queue_once(monkeypatch: pytest.MonkeyPatch) -> None:
    bal, ids = _fleet(64, [S, S, S, S])
    _queue(bal, ids, [(t, 10 * i, 0, (7 * i) % 64, 3) for i in range(40) for t in (i % 4,)])
    calls = []
    real = PrefillBalancer.queued

    def counted(self: PrefillBalancer, tier: int, now_ns: int | None = None):  # type: ignore[no-untyped-def]
        calls.append(tier)
        return real(self, tier, now_ns)

    monkeypatch.setattr(PrefillBalancer, "queued", counted)
    tiers = source_tiers(bal, [Offer(e, 10**12, [0, 0]) for e in ids], 500 * MS)
    assert set(tiers) <= {0, 1, 2, 3}
    # A head and a window per tier at most, for 64 engines (one per engine each, before).
    assert len(calls) <= 2 * bal.n_tiers


@pytest.mark.parametrize(
    ("held", "asked", "want"),
    [
        ((), {1, 2}, False),  # holds nothing
        ((1, 2, 3), set(), False),  # asked nothing
        ((1, 2, 3), {3}, True),
        ((1, 2, 3), {4, 5}, False),
        (tuple(range(1_000)), {999, 10_000}, True),  # the larger side is the cache
    ],
)
def test_holds_any(held: tuple[int, ...], asked: set[int], want: bool) -> None:
    idx = PrefixIndex()
    idx.add_engine("e", 10_000)
    idx.stored("e", held)
    assert idx.holds_any("e", frozenset(asked)) is want
    assert idx.holds_any("unknown", frozenset(asked)) is False


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_longer_tier_s_head_is_priced_per_engine_in_one_view(
        order: tuple[int, int]) -> None:
    # Two engines of the short tier, one of the third; the third tier's head (100K
    # tokens, 5 s unheld) is beyond the short tier's helping bound (2 s) except on the
    # engine holding 90 of its 100 blocks (0.5 s there): that one helps, the other not,
    # whichever the view asks first.
    bal, ids = _fleet(3, [2 * S, 0, S, 0])
    short = [e for e in ids if bal.engine_tier(e) == 0]
    assert len(short) == 2
    _queue(bal, ids, [(2, 0, 0, ids.index(short[0]), 90)])
    asked = [short[i] for i in order]
    got = dict(zip(asked, source_tiers(bal, [Offer(e, 10**12, [0, 0]) for e in asked],
                                       100 * MS), strict=True))
    assert got == {short[0]: 2, short[1]: 0}
