"""Prefill reliability rows of issue 22, through a real gRPC channel: an id reused by a
different request keeps the acknowledged outcome (row 8), a cache-model reload cannot
break a pull (row 6), block hashes are bounded by the prompt (row 9)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fulcrum.config import with_overrides
from fulcrum.metrics import REGISTRY
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
    submit_request,
    until,
)

S = 1_000_000_000
AFFINITY = {"prefill": {"cache_model": "per_engine", "engine_cache_blocks": 1_000,
                        "pull_wait_ms": 0}}


def _metric(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def _run_once(c, state, inc: int, req: prefill_pb2.SubmitRequest):  # type: ignore[no-untyped-def]
    """Submit ``req`` and let engine "a" pull it; returns (reply, ids pulled)."""
    call = asyncio.ensure_future(c.prefill.Submit(req))
    await until(lambda: state.is_queued(req.request_id) or call.done())
    pulled: list[str] = []
    if not call.done():
        got = await c.prefill.Pull(pull_request("a", inc, 100 * S, [0], wait_ms=0))
        pulled = [r.request_id for r in got.requests]
    return await call, pulled


async def test_reused_id_keeps_the_retained_outcome_and_never_runs_twice() -> None:
    async with prefill_daemon({"prefill": {"pull_wait_ms": 0}}) as (_, c, state):
        inc = await register(c, "a", dp_ranks=1)
        first, pulled = await _run_once(c, state, inc, submit_request("z1", 1_000))
        assert pulled == ["z1"]
        # A different request reusing the id within the retention: ALREADY_EXISTS.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("z1", 3_000))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "z1" in (err.value.details() or "")
        assert not state.is_queued("z1")
        # The original's retry still gets the original outcome: not delivered again.
        again, pulled = await _run_once(c, state, inc, submit_request("z1", 1_000))
        assert pulled == []
        assert (again.engine_id, again.predicted_cost_ns) == (
            first.engine_id, first.predicted_cost_ns)


async def test_cache_model_reload_is_restart_only_and_pulls_keep_working() -> None:
    async with prefill_daemon(AFFINITY) as (d, c, state):
        inc = await register(c, "a", dp_ranks=1)
        hits0 = _metric("fulcrum_prefill_prefix_engine_hit_blocks_total", engine="a")
        req = prefill_pb2.SubmitRequest(request_id="p0", total_tokens=1_500,
                                        max_wait_ms=20_000, block_hashes=[1, 2, 3])
        _, pulled = await _run_once(c, state, inc, req)
        assert pulled == ["p0"]
        outcomes = []
        for model in ("global", "per_engine", "global", "per_engine"):
            new = with_overrides(d.app.settings, {"prefill": {"cache_model": model}})
            outcomes.append(d.reload(new))
        assert outcomes[0] == "restart_required"
        assert state.settings.cache_model == "per_engine"
        for i in range(1, 4):  # every later pull that takes work succeeds
            req = prefill_pb2.SubmitRequest(request_id=f"p{i}", total_tokens=1_500,
                                            max_wait_ms=20_000, block_hashes=[1, 2, i + 10])
            reply, pulled = await _run_once(c, state, inc, req)
            assert pulled == [f"p{i}"]
            assert reply.engine_id == "a"
        hits = _metric("fulcrum_prefill_prefix_engine_hit_blocks_total", engine="a")
        assert hits == hits0 + 2 * 3


def test_a_new_affinity_restarts_the_metric_deltas() -> None:
    """Row 6's root cause, at the wiring: a fresh affinity counts from zero, so the deltas
    it feeds the counters never go negative (the reload path that used to raise)."""
    from fulcrum.config import parse_settings
    from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer
    from fulcrum.state.prefix import PrefixWiring

    s = parse_settings({"prefill": {"cache_model": "per_engine"}}).prefill
    bal = PrefillBalancer(BalancerConfig(bounds=(10**9,), batch_cap_ns=(S, S), backlog_rounds=1.0,
                                         hysteresis=0.0, max_batch_requests=4))
    wiring = PrefixWiring(bal, s, lambda q, c: q + 1, ["<1G", ">=1G"])
    aff = wiring.affinity
    assert aff is not None
    aff.tier_blocks[0] = [5, 9]
    wiring.after_take("a")
    wiring.apply(parse_settings({"prefill": {"cache_model": "global"}}).prefill)
    wiring.apply(s)
    aff2 = wiring.affinity
    assert aff2 is not None and aff2 is not aff
    aff2.tier_blocks[0] = [1, 2]
    wiring.after_take("a")  # raised ValueError (negative increment) before the fix
    assert _metric("fulcrum_prefill_prefix_tier_hit_blocks_total", tier="<1G") >= 6


@pytest.mark.parametrize(("total", "hashes", "ok"), [
    (1_000, 2, True),    # ceil(1000 / 512) = 2
    (1_024, 2, True),
    (1_025, 3, True),
    (1_000, 3, False),
    (1, 2, False),
])
async def test_block_hashes_are_bounded_by_the_prompt(total: int, hashes: int, ok: bool) -> None:
    async with prefill_daemon(AFFINITY) as (_, c, state):
        await register(c, "a", dp_ranks=1)
        req = prefill_pb2.SubmitRequest(request_id="h", total_tokens=total, max_wait_ms=1,
                                        block_hashes=list(range(hashes)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(req)
        if ok:  # accepted: it is queued and times out unpulled
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "block_hashes" in (err.value.details() or "")
            assert f"{-(-total // 512)} entries" in (err.value.details() or "")
        assert not state.is_queued("h")


async def test_block_hashes_in_flight_count_against_a_global_bound() -> None:
    config = {"prefill": {**AFFINITY["prefill"], "max_block_hashes_in_flight": 10}}
    async with prefill_daemon(config) as (_, c, state):
        await register(c, "a", dp_ranks=1)

        def req(rid: str, n: int) -> prefill_pb2.SubmitRequest:
            return prefill_pb2.SubmitRequest(request_id=rid, total_tokens=512 * n,
                                             max_wait_ms=20_000, block_hashes=list(range(n)))

        held = asyncio.ensure_future(c.prefill.Submit(req("q1", 8)))
        await until(lambda: state.is_queued("q1"))
        assert _metric("fulcrum_prefill_block_hashes_held") == 8
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(req("q2", 3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_block_hashes_in_flight" in (err.value.details() or "")
        assert dict(err.value.trailing_metadata() or ()).get("retry-after-ms")
        assert not state.is_queued("q2")
        held.cancel()  # the caller leaves: its hashes are released
        await until(lambda: not state.is_queued("q1"))
        assert _metric("fulcrum_prefill_block_hashes_held") == 0
        late = asyncio.ensure_future(c.prefill.Submit(req("q3", 3)))
        await until(lambda: state.is_queued("q3"))
        late.cancel()


async def test_one_clients_flood_cannot_evict_another_clients_outcome() -> None:
    """Row 7: retention is bounded per submitter and never evicts early."""
    config = {"prefill": {"pull_wait_ms": 0, "max_retained": 10,
                          "max_retained_per_submitter": 4}}
    victim = (("authorization", "Bearer victim"),)
    flooder = (("authorization", "Bearer flooder"),)
    async with prefill_daemon(config) as (_, c, state):
        inc = await register(c, "a", dp_ranks=1)

        async def run(rid: str, md: tuple[tuple[str, str], ...]):  # type: ignore[no-untyped-def]
            call = asyncio.ensure_future(c.prefill.Submit(submit_request(rid, 1_000),
                                                          metadata=md))
            await until(lambda: state.is_queued(rid) or call.done())
            pulled: list[str] = []
            if not call.done():
                got = await c.prefill.Pull(pull_request("a", inc, 100 * S, [0], wait_ms=0))
                pulled = [r.request_id for r in got.requests]
            return await call, pulled

        first, _ = await run("v0", victim)
        for i in range(4):
            await run(f"f{i}", flooder)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run("f4", flooder)  # its own share is full: refused, nobody evicted
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_retained_per_submitter" in (err.value.details() or "")
        assert int(dict(err.value.trailing_metadata() or ()).get("retry-after-ms", "0")) > 0
        assert _metric("fulcrum_prefill_retained_outcomes") == 5
        again, pulled = await run("v0", victim)  # the victim's retry: not run twice
        assert pulled == [] and again.engine_id == first.engine_id
        _, pulled = await run("v1", victim)  # and its own share still has room
        assert pulled == ["v1"]
