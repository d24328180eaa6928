"""A holder of another tier (issue 21): an engine with room goes first to a tier whose
window has a request it alone holds the longest prefix of, instead of the tier its source
rule picks; such a request waits for it, and it would come to that tier only when the
source rule sent it there. Table-driven over who holds the prefix, the bands and the
helping bound; the published rules (engines keep to their tier) never do it."""

from __future__ import annotations

import pytest

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import (
    DEFAULT,
    PUBLISHED,
    BalancerConfig,
    PrefillBalancer,
    Queued,
    _affinity_window,
    rules_by_name,
)
from fulcrum.core.tenants import RequestClass

S = 1_000_000_000
MS = 1_000_000
BOUNDS = (16_384, 65_536, 262_144)
BLOCK = 1_000  # tokens per block


def cost(q: int, c: int) -> int:
    """50 us per computed token plus 10 ms fixed (ns): 16K tokens cost 0.83 s."""
    return 50_000 * q + 10 * MS


def _fleet(rules: str = DEFAULT) -> tuple[PrefillBalancer, Affinity, str, str]:
    """Two engines, one per tier of the two with demand: (balancer, affinity, the
    short tier's engine, the long tier's engine)."""
    bal = PrefillBalancer(BalancerConfig(BOUNDS, (8 * S, 32 * S, 128 * S, 512 * S), 8.0,
                                         1.0, 256, rules_by_name(rules)))
    aff = Affinity(PrefixIndex(block_tokens=BLOCK), cost, max_wait_ns=10 * S)
    bal.affinity = aff
    for e in ("e0", "e1"):
        bal.add_engine(e, 2)
        aff.index.add_engine(e, 1_000)
    bal.last_demand_ns = [S, S, 0, 0]
    bal.redistribute("join")
    short = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 0)
    long = next(e for e in ("e0", "e1") if bal.engine_tier(e) == 1)
    return bal, aff, short, long


def _req(bal: PrefillBalancer, rid: str, blocks: int, first: int, t_ns: int,
         priority: int = 0) -> Queued:
    """``blocks`` blocks of hashes from ``first``, queued at ``t_ns`` (its tier by size)."""
    aff = bal.affinity
    assert aff is not None
    total = BLOCK * blocks
    hashes = tuple(range(first, first + blocks))
    return Queued(rid, total, 0, bal.tier_of(total), aff.expected_cost(total, hashes), t_ns,
                  hashes, cls=RequestClass(priority=priority))


@pytest.mark.parametrize(
    ("holders", "turn_priority", "mid_priority", "want"),
    [
        # The long tier's engine alone holds the conversation's last turn: it goes to the
        # short tier first, though the source rule picks its own (its head waited 1 s,
        # the short head none).
        ({"long": 9}, 0, 0, 0),
        # It holds less than the short engine: that one is the holder, not it.
        ({"long": 4, "short": 9}, 0, 0, 1),
        # Both hold as much: no one engine holds it best.
        ({"long": 9, "short": 9}, 0, 0, 1),
        # Nobody holds it.
        ({}, 0, 0, 1),
        # Held, but a lower band than the head of the tier the rule picked.
        ({"long": 9}, 0, 1, 1),
        # A higher band than that head: fine.
        ({"long": 9}, 1, 0, 0),
    ],
)
def test_a_holder_of_another_tier_goes_to_its_request(
    holders: dict[str, int], turn_priority: int, mid_priority: int, want: int
) -> None:
    bal, aff, short, long = _fleet()
    ids = {"short": short, "long": long}
    for who, n in holders.items():
        aff.index.record(ids[who], tuple(range(100, 100 + n)))
    bal.enqueue(_req(bal, "mid", 20, 5_000, 0, mid_priority))
    bal.enqueue(_req(bal, "turn", 10, 100, S, turn_priority))
    assert bal.source_tier(long, [0, 0], now_ns=S) == want
    assert aff.holder_tiers == 0  # choosing counts nothing: a take does
    taken = bal.take(long, 100 * S, [0, 0], now_ns=S)
    assert [i.request_id for i in taken.items] == ["turn" if want == 0 else "mid"]
    # Counted only where the source rule alone would have picked the long tier.
    assert aff.holder_tiers == (1 if want == 0 and turn_priority <= mid_priority else 0)


def test_no_room_or_no_time_keeps_the_rule_s_choice() -> None:
    bal, aff, _, long = _fleet()
    aff.index.record(long, tuple(range(100, 109)))
    bal.enqueue(_req(bal, "mid", 20, 5_000, 0))
    bal.enqueue(_req(bal, "turn", 10, 100, S))
    assert bal.source_tier(long, [100 * S, 100 * S], now_ns=S) == 1  # no room
    assert bal.source_tier(long, [0, 0]) == 1  # no clock: its own tier has work


def test_the_published_rules_keep_engines_to_their_tier() -> None:
    bal, aff, _, long = _fleet(PUBLISHED)
    aff.index.record(long, tuple(range(100, 109)))
    bal.enqueue(_req(bal, "mid", 20, 5_000, 0))
    bal.enqueue(_req(bal, "turn", 10, 100, S))
    assert bal.source_tier(long, [0, 0], now_ns=S) == 1


@pytest.mark.parametrize(("held", "want"), [(40, 1), (2, 0)])
def test_a_short_engine_helps_a_longer_tier_only_within_the_helping_bound(
    held: int, want: int
) -> None:
    """The short engine alone holds 40 of a 50-block (50K-token) request: 0.5 s there,
    within the 2 s helping bound; holding 2 blocks it would cost 2.4 s there."""
    bal, aff, short, _ = _fleet()
    aff.index.record(short, tuple(range(100, 100 + held)))
    bal.enqueue(_req(bal, "own", 2, 9_000, 0))
    bal.enqueue(_req(bal, "long", 50, 100, S))
    assert bal.helping_bound_ns(0) == 2 * S
    assert bal.source_tier(short, [0, 0], now_ns=S) == want


def test_a_tiers_grace_ends_at_the_unloaded_cost_of_its_largest_prompt() -> None:
    """The grace's tail (``Window.tail_ns``) is a prompt at the tier's upper bound with
    nothing cached (16K tokens: 0.83 s here); the last tier has no upper bound, no tail."""
    bal, _, _, _ = _fleet()
    bal.enqueue(_req(bal, "chat", 2, 100, 0))
    bal.enqueue(_req(bal, "book", 300, 1_000, 0))
    tails = {}
    for tier in (0, 3):
        w = _affinity_window(bal, tier, S)
        assert w is not None and len(w.items) == 1
        tails[tier] = w.tail_ns
    assert tails == {0: cost(BOUNDS[0], 0), 3: None}
