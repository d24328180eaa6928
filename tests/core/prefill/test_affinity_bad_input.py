"""Prefix affinity on hashes nobody holds (issue 21, bad input): full price everywhere."""

from __future__ import annotations

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued

S = 1_000_000_000


def cost(q: int, c: int) -> int:
    """1 ms per computed token, 0.1 ms per cached token attended, 1 ms fixed (ns)."""
    return 1_000_000 * q + 100_000 * c + 1_000_000


def test_unknown_block_hashes_cost_the_full_prompt_on_every_engine() -> None:
    bal = PrefillBalancer(BalancerConfig(
        bounds=(1_000_000,), batch_cap_ns=(1000 * S, 1000 * S), backlog_rounds=1.0,
        hysteresis=0.0, max_batch_requests=4,
    ))
    aff = Affinity(PrefixIndex(block_tokens=100), cost)
    bal.affinity = aff
    for e in ("a", "b", "c"):
        aff.index.add_engine(e, 1000)
        bal.add_engine(e, 1)
    aff.index.record("a", (1, 2, 3))  # a holds another conversation
    blocks = (900, 901, 902, 903)  # nobody has seen these
    total = 350
    item = Queued("r", total, 0, 0, aff.expected_cost(total, blocks), 0, blocks)
    assert item.cost_ns == cost(total, 0)
    assert [bal.cost_for(item, e) for e in ("a", "b", "c")] == [cost(total, 0)] * 3
    bal.enqueue(item)
    # nobody holds a prefix, so nobody waits: the first puller takes it at full price
    taken = bal.take("b", 100 * S, [0], now_ns=1)
    assert [i.request_id for i in taken.items] == ["r"]
    assert taken.quota_ns == cost(total, 0)
