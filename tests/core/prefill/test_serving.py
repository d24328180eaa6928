"""The engines that may serve each tier (``balancer.serving``) are kept across windows and
dispatches, not rebuilt per window (issue 21, a dispatch over a large fleet): they must
follow every join, leave, move and change of rules."""

from __future__ import annotations

from fulcrum.core.prefill.balancer import (
    DEFAULT,
    PUBLISHED,
    BalancerConfig,
    PrefillBalancer,
    rules_by_name,
    serving,
)

S = 1_000_000_000
BOUNDS = (16_384, 65_536, 262_144)
CAPS = (8 * S, 32 * S, 128 * S, 512 * S)


def _config(rules: str) -> BalancerConfig:
    return BalancerConfig(BOUNDS, CAPS, 8.0, 1.0, 256, rules_by_name(rules))


def _check(bal: PrefillBalancer) -> None:
    src = bal.config.rules.source
    ids = bal.engine_ids()
    for t in range(bal.n_tiers):
        want = {e: ids.index(e) for e in ids if src.serves(bal.engine_tier(e), t)}
        got = serving(bal, t)
        assert dict(got) == want
        assert list(got) == list(want)  # join order


def test_the_engines_serving_a_tier_follow_joins_moves_leaves_and_rules() -> None:
    bal = PrefillBalancer(_config(PUBLISHED))
    for e in ("a", "b", "c", "d", "e"):
        bal.add_engine(e, 1)
        _check(bal)
    before = [bal.engine_tier(e) for e in bal.engine_ids()]
    bal.last_demand_ns = [0.0, 0.0, 0.0, 5.0 * S]  # all the demand in the longest tier
    bal.redistribute("join")
    assert [bal.engine_tier(e) for e in bal.engine_ids()] != before  # engines moved
    _check(bal)
    bal.remove_engine("b")
    _check(bal)
    bal.add_engine("a", 2)  # re-joins: last in join order now
    _check(bal)
    bal.reconfigure(_config(DEFAULT))  # urgency: every engine serves every tier
    assert all(len(serving(bal, t)) == 4 for t in range(bal.n_tiers))
    _check(bal)
