"""Urgent tiers through the daemon: an engine of a longer tier with room takes the
shorter tier's work when that tier's head has waited longest for its scale (its batch
cap), and the daemon counts it in ``fulcrum_prefill_helped_requests_total``."""

from __future__ import annotations

import asyncio

from fulcrum.metrics import REGISTRY
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until

S = 1_000_000_000
CONFIG = {"prefill": {"pull_wait_ms": 0, "min_tier_dwell_ms": 0}}


def _helped(tier: str, engine_tier: str) -> float:
    v = REGISTRY.get_sample_value("fulcrum_prefill_helped_requests_total",
                                  {"tier": tier, "engine_tier": engine_tier})
    return 0.0 if v is None else v


async def test_longer_tier_engine_helps_the_short_tier_whose_head_waited() -> None:
    async with prefill_daemon(CONFIG) as (d, c, state):
        now = [d.app.clock()]
        state._clock = lambda: now[0]  # the test drives the daemon's clock
        inc = {e: await register(c, e, dp_ranks=1) for e in ("a", "b")}

        def submit(rid: str, tokens: int) -> asyncio.Future[prefill_pb2.SubmitReply]:
            return asyncio.ensure_future(c.prefill.Submit(prefill_pb2.SubmitRequest(
                request_id=rid, total_tokens=tokens, max_wait_ms=60_000)))

        # Demand in both the <16K and the 16K-64K tier: a round gives one engine each.
        subs = [submit("s1", 2_000), submit("m1", 20_000)]
        await until(lambda: state.is_queued("s1") and state.is_queued("m1"))
        assert state.rebalance(now[0]) == [1, 1, 0, 0]
        long_engine = next(e for e in ("a", "b") if state.engine_tier(e) == 1)
        before = _helped("<16K", "16K-64K")

        # One second later both heads have waited 1 s: 1/8 of the short tier's batch cap
        # (8 s) against 1/32 of its own (32 s). The 16K-64K engine, idle, takes s1.
        now[0] += S
        got = await c.prefill.Pull(
            pull_request(long_engine, inc[long_engine], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["s1"] and got.tier_name == "<16K"
        assert _helped("<16K", "16K-64K") == before + 1
        # With s1 gone its own tier's head is the only one: it takes m1 next.
        got = await c.prefill.Pull(
            pull_request(long_engine, inc[long_engine], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["m1"] and got.tier_name == "16K-64K"
        assert _helped("<16K", "16K-64K") == before + 1
        for f in subs:
            assert (await f).engine_id == long_engine
