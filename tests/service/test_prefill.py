"""Prefill balancer through the real daemon: contract, errors, worked example, refit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.client.planner import ChunkPlanner, CostModel, PrefillTask
from fulcrum.core.cost import DEFAULT_COST_MODEL
from fulcrum.v1 import fleet_pb2, prefill_pb2
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
    submit_request,
    until,
)

S = 1_000_000_000


async def test_submit_validation_errors() -> None:
    async with prefill_daemon({"prefill": {"max_total_tokens": 1_000_000}}) as (_, c, _st):
        cases = [
            (submit_request("r1", 100, 100), "cached_tokens"),
            (submit_request("r1", 100, 200), "cached_tokens"),
            (submit_request("r1", 0, 0), "total_tokens"),
            (submit_request("r1", 1_000_001, 0), "total_tokens"),
            (submit_request("", 100, 0), "request_id"),
            (submit_request("has space", 100, 0), "request_id"),
        ]
        for req, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill.Submit(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (err.value.details() or "")


async def test_deadline_duplicate_and_queue_bound() -> None:
    async with prefill_daemon({"prefill": {"max_queued_per_tier": 2}}) as (_, c, st):
        # No engine at all: the submit fails fast (issue 13), with a retry hint.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("late", 1000, wait_ms=50_000))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        trailing = dict(err.value.trailing_metadata() or ())
        assert trailing.get("retry-after-ms") == "1000"
        assert st.queue_depths() == [0, 0, 0, 0]
        # An engine that never pulls: the submit waits its max_wait and fails.
        inc0 = await register(c, "e0")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("late", 1000, wait_ms=50))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert st.queue_depths() == [0, 0, 0, 0]
        await c.fleet.Deregister(fleet_pb2.DeregisterRequest(member_id="e0", incarnation=inc0))
        await register(c, "e0")  # a fresh engine with no demand history

        first = asyncio.ensure_future(c.prefill.Submit(submit_request("dup", 1000)))
        await until(lambda: st.queue_depths()[0] == 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("dup", 2000))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS

        second = asyncio.ensure_future(c.prefill.Submit(submit_request("two", 1000)))
        await until(lambda: st.queue_depths()[0] == 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("three", 1000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another tier has its own bound.
        third = asyncio.ensure_future(c.prefill.Submit(submit_request("long", 20_000)))
        await until(lambda: st.queue_depths()[1] == 1)

        # Cancelling a queued submit removes it from the queue.
        first.cancel()
        await until(lambda: st.queue_depths()[0] == 1)
        incs = {e: await register(c, e) for e in ("e1", "e2")}
        counts = st.engines_per_tier()
        assert counts[0] >= 1 and counts[1] >= 1  # every tier with demand has an engine
        got = 0
        for engine, inc in incs.items():
            reply = await c.prefill.Pull(pull_request(engine, inc, 100 * S, wait_ms=1))
            assert not reply.requests or reply.tier <= st.engine_tier(engine)  # never longer
            got += len(reply.requests)
        if got < 2:  # e0 holds one of the tiers
            e0 = st._engines["e0"].incarnation
            reply = await c.prefill.Pull(pull_request("e0", e0, 100 * S, wait_ms=1))
            got += len(reply.requests)
        assert got == 2
        assert (await second).tier == 0
        assert (await third).tier == 1
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_pull_errors() -> None:
    async with prefill_daemon() as (_, c, _st):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("ghost", 0, S))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        inc = await register(c, "e1", dp_ranks=4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("e1", inc, S, loads=[1, 2]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rank_loads_ns" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("e1", inc + 1, S))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Empty long poll returns an empty batch with the engine's tier.
        reply = await c.prefill.Pull(pull_request("e1", inc, S, wait_ms=10))
        assert list(reply.requests) == [] and reply.tier_name
        # A waiting pull of an engine that leaves ends with NOT_FOUND.
        waiting = asyncio.ensure_future(c.prefill.Pull(pull_request("e1", inc, S, wait_ms=20_000)))
        st = _st
        await until(lambda: sum(st.waiting_pulls(t) for t in range(st.n_tiers)) == 1)
        await c.fleet.Deregister(fleet_pb2.DeregisterRequest(member_id="e1", incarnation=inc))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await waiting
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("e1", inc, S))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_worked_example_default_rules_bind_late_to_the_emptiest_rank() -> None:
    """The same request under the default rules (late binding): the engine whose
    least-loaded rank is emptiest takes it (engine-a, idle), not the one with the most
    remaining quota (engine-b, whose emptiest rank still holds 0.1 s of work)."""
    async with prefill_daemon() as (_, c, st):
        inc_a = await register(c, "engine-a")
        inc_b = await register(c, "engine-b")
        pull_a = asyncio.ensure_future(
            c.prefill.Pull(pull_request("engine-a", inc_a, 6 * S, [0, 0, 0, 0], 20_000))
        )
        pull_b = asyncio.ensure_future(
            c.prefill.Pull(
                pull_request("engine-b", inc_b, 9 * S, [3 * S // 10, S // 2, S // 10, S], 20_000)
            )
        )
        await until(lambda: sum(st.waiting_pulls(t) for t in range(st.n_tiers)) == 2)
        reply = await c.prefill.Submit(submit_request("agent-turn-3", 100_000, 96_896))
        assert (reply.engine_id, reply.dp_rank) == ("engine-a", 0)
        batch = await pull_a
        assert [(r.request_id, r.dp_rank) for r in batch.requests] == [("agent-turn-3", 0)]
        pull_b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull_b


async def test_worked_example() -> None:
    """SPEC section 8 under the published rules: 100,000 total, 96,896 cached -> tier
    64K-256K, most-quota engine, least-loaded rank, one chunk of 3,104, or two steps when
    the rank's budget is used."""
    async with prefill_daemon({"prefill": {"rules": "published"}}) as (_, c, st):
        inc_a = await register(c, "engine-a")
        inc_b = await register(c, "engine-b")
        # Both engines wait; engine-b has more remaining quota, its rank 2 is least loaded.
        pull_a = asyncio.ensure_future(
            c.prefill.Pull(pull_request("engine-a", inc_a, 6 * S, [0, 0, 0, 0], 20_000))
        )
        pull_b = asyncio.ensure_future(
            c.prefill.Pull(
                pull_request("engine-b", inc_b, 9 * S, [3 * S // 10, S // 2, S // 10, S], 20_000)
            )
        )
        await until(lambda: sum(st.waiting_pulls(t) for t in range(st.n_tiers)) == 2)

        reply = await c.prefill.Submit(submit_request("agent-turn-3", 100_000, 96_896))
        assert (reply.tier, reply.tier_name) == (2, "64K-256K")
        assert reply.engine_id == "engine-b"
        assert reply.dp_rank == 2
        assert reply.predicted_cost_ns == DEFAULT_COST_MODEL.cost_ns(3104, 96_896)
        batch = await pull_b
        assert batch.tier_name == "64K-256K"
        assert [(r.request_id, r.dp_rank) for r in batch.requests] == [("agent-turn-3", 2)]
        assert batch.batch_quota_ns == reply.predicted_cost_ns
        # The tier had work and no engine: both engines were moved there at once.
        assert st.engines_per_tier() == [0, 0, 2, 0]
        pull_a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull_a

        # Far larger than a fresh 3,000-token request (a short-tier request of that size).
        fresh_task = asyncio.ensure_future(c.prefill.Submit(submit_request("fresh-3k", 3000)))
        await until(lambda: st.queue_depths()[0] == 1)
        await until(lambda: st.engines_per_tier()[0] == 1)  # orphan tier got an engine
        engine = next(e for e in ("engine-a", "engine-b") if st.engine_tier(e) == 0)
        await c.prefill.Pull(
            pull_request(engine, inc_a if engine == "engine-a" else inc_b, 9 * S)
        )
        fresh = await fresh_task
        assert fresh.tier_name == "<16K"
        assert reply.predicted_cost_ns > 4 * fresh.predicted_cost_ns

        # Engine side: plan chunks with the daemon's cost model.
        cm = await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        model = CostModel(cm.a, cm.b, cm.k)
        budget = cm.step_quota_ns
        (pulled,) = batch.requests
        task = PrefillTask(pulled.request_id, pulled.cached_tokens, pulled.total_tokens)
        planner = ChunkPlanner(4, model, cap=cm.max_chunk_tokens)
        planner.add(pulled.dp_rank, task)
        plan = planner.step([budget] * 4)
        assert [(ch.tokens, ch.last) for ch in plan.chunks[2]] == [(3104, True)]
        # Same request behind a fresh 8K request on the same rank: two steps.
        planner = ChunkPlanner(4, model, cap=cm.max_chunk_tokens)
        planner.add(2, PrefillTask("other", 0, 8192))
        planner.add(2, task)
        first = planner.step([budget] * 4)
        second = planner.step([budget] * 4)
        split = [ch.tokens for ch in first.chunks[2] if ch.request_id == "agent-turn-3"]
        rest = [ch.tokens for ch in second.chunks[2]]
        assert 0 < split[0] < 3104 and split[0] + rest[0] == 3104


async def test_oversize_request_is_served_alone_to_idle_engine() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        st.rebalance(0, reason="round")
        # One at a time: two calls in flight at once may reach the daemon in either order.
        big = asyncio.ensure_future(c.prefill.Submit(submit_request("huge", 2_000_000)))
        await until(lambda: st.queue_depths()[3] == 1)
        small = asyncio.ensure_future(c.prefill.Submit(submit_request("after", 300_000)))
        await until(lambda: st.queue_depths()[3] == 2)
        await until(lambda: st.engine_tier("e1") == 3)
        # Busy engine with little quota: nothing fits, it waits.
        reply = await c.prefill.Pull(pull_request("e1", inc, S, [S, 0], wait_ms=20))
        assert list(reply.requests) == []
        # Idle engine: the oversize head is served alone, FIFO holds.
        reply = await c.prefill.Pull(pull_request("e1", inc, S, [0, 0], wait_ms=20))
        assert [r.request_id for r in reply.requests] == ["huge"]
        assert (await big).engine_id == "e1"
        reply = await c.prefill.Pull(pull_request("e1", inc, S, [0, 0], wait_ms=20))
        assert [r.request_id for r in reply.requests] == ["after"]
        await small


async def test_batch_within_quota_and_cap_fifo_ranks() -> None:
    caps = {"prefill": {"tier_batch_cap_ns": [S, 8 * S, 16 * S, 64 * S]}}
    async with prefill_daemon(caps) as (_, c, st):
        # 8 ranks: late binding (a rank below a tenth of a step budget) takes one
        # 0.25 s request per idle rank, so the quota, cap and request limits bind first.
        inc = await register(c, "e1", dp_ranks=8)
        # One at a time, so that the queue's FIFO order is r0..r7 (concurrent submits
        # may reach the daemon in any order).
        def queued(n: int) -> Callable[[], bool]:
            return lambda: st.queue_depths()[0] == n

        tasks = []
        for i in range(8):
            tasks.append(asyncio.ensure_future(c.prefill.Submit(submit_request(f"r{i}", 4096))))
            await until(queued(i + 1))
        cost = DEFAULT_COST_MODEL.cost_ns(4096, 0)
        reply = await c.prefill.Pull(pull_request("e1", inc, 100 * S, [0] * 8))
        n = S // cost  # the tier cap binds
        assert [r.request_id for r in reply.requests] == [f"r{i}" for i in range(n)]
        assert [r.dp_rank for r in reply.requests] == list(range(n))
        assert reply.batch_quota_ns == n * cost <= S
        reply = await c.prefill.Pull(pull_request("e1", inc, cost, [0] * 8, max_requests=3))
        assert [r.request_id for r in reply.requests] == [f"r{n}"]  # quota binds
        reply = await c.prefill.Pull(pull_request("e1", inc, 100 * S, [0] * 8, max_requests=2))
        assert len(reply.requests) == 2  # max_requests binds
        rest = 8 - n - 3
        reply = await c.prefill.Pull(pull_request("e1", inc, 100 * S, [0] * 8))
        assert len(reply.requests) == rest
        results = await asyncio.gather(*tasks)
        assert {r.engine_id for r in results} == {"e1"}
        assert st.queue_depths() == [0, 0, 0, 0]


async def test_cost_model_report_and_refit() -> None:
    settings = {"prefill": {"refit": {"min_samples": 16, "adopt_margin": 0.1}}}
    async with prefill_daemon(settings) as (_, c, st):
        await register(c, "e1")
        cm = await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        assert (cm.a, cm.b, cm.k, cm.version) == (2.0, 56_000.0, 5_000_000.0, 1)
        assert cm.max_chunk_tokens == 32_768 and cm.step_quota_ns == S
        truth = CostModel(3.0, 40_000.0, 2_000_000.0)
        samples = [
            prefill_pb2.StepSample(q=q, c=c0, measured_ns=truth.cost_ns(q, c0))
            for q in (512, 2048, 8192, 16384)
            for c0 in (0, 10_000, 50_000, 120_000, 250_000)
        ]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.ReportStepTimes(
                prefill_pb2.ReportStepTimesRequest(engine_id="ghost", samples=samples)
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        bad = [prefill_pb2.StepSample(q=0, c=0, measured_ns=5)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.ReportStepTimes(
                prefill_pb2.ReportStepTimesRequest(engine_id="e1", samples=bad)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reply = await c.prefill.ReportStepTimes(
            prefill_pb2.ReportStepTimesRequest(engine_id="e1", samples=samples)
        )
        assert reply.accepted == len(samples)
        assert st.refit(0) is True
        cm = await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        assert cm.version == 2
        assert cm.a == pytest.approx(3.0, rel=1e-3)
        assert cm.b == pytest.approx(40_000.0, rel=1e-3)
        assert st.refit(0) is False  # no better by the margin: kept
        # New submits are priced with the adopted model.
        assert st.predict_ns(100_000, 96_896) == truth.cost_ns(3104, 96_896)


async def test_lapsed_engine_gets_not_found_and_loses_its_share() -> None:
    fleet = {"fleet": {"heartbeat_timeout_ms": 300, "sweep_interval_ms": 20}}
    async with prefill_daemon(fleet) as (_, c, st):
        inc1 = await register(c, "e1")
        inc2 = await register(c, "e2")
        assert sorted(st.engines_per_tier()) == [0, 0, 1, 1]
        stop = asyncio.Event()

        async def keep_pulling() -> None:  # pulls count as heartbeats
            while not stop.is_set():
                await c.prefill.Pull(pull_request("e1", inc1, S, wait_ms=30))

        alive = asyncio.ensure_future(keep_pulling())
        try:
            await until(lambda: st.engine_tier("e2") == -1)
            assert sum(st.engines_per_tier()) == 1 and st.engine_tier("e1") >= 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill.Pull(pull_request("e2", inc2, S))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # Work for a tier without engines moves the survivor there at once.
            waiting = asyncio.ensure_future(c.prefill.Submit(submit_request("x", 40_000)))
            reply = await waiting
            assert (reply.engine_id, reply.tier) == ("e1", 1)
        finally:
            stop.set()
            await alive


async def test_reload_applies_caps_and_cost_model() -> None:
    from fulcrum.config.prefill import PrefillSettings

    async with prefill_daemon() as (d, c, st):
        new = d.app.settings.prefill.model_copy(
            update={"cost_model": st.settings.cost_model.model_copy(update={"a": 3.0})}
        )
        for hook in d.app.reload_hooks:
            hook(d.app.settings.model_copy(update={"prefill": new}))
        cm = await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        assert (cm.a, cm.version) == (3.0, 2)
        moved = PrefillSettings(tier_bounds=[1000], tier_batch_cap_ns=[S, S])
        assert st.apply_settings(moved) is False


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"tier_bounds": [100, 50]}, "tier_bounds"),
        ({"tier_batch_cap_ns": [1, 2]}, "tier_batch_cap_ns"),
        ({"submit_wait_ms": 60_000, "max_submit_wait_ms": 1_000}, "submit_wait_ms"),
        ({"refit": {"min_samples": 100, "window_samples": 50}}, "min_samples"),
        ({"cost_model": {"a": -1}}, "cost_model.a"),
        ({"tier_policy": "x"}, "unknown key"),
    ],
)
def test_settings_are_validated(section: dict[str, object], match: str) -> None:
    from fulcrum.config import ConfigError, parse_settings

    with pytest.raises(ConfigError, match=match):
        parse_settings({"prefill": section})


async def test_engine_and_entrypoint_helpers() -> None:
    from fulcrum.client.prefill import PrefillEngine, submit_prefill

    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "eng", dp_ranks=4)
        engine = PrefillEngine(c, "eng", inc, dp_ranks=4)
        pulled = asyncio.ensure_future(engine.pull(20 * S, max_wait_ms=20_000))
        await until(lambda: sum(st.waiting_pulls(t) for t in range(st.n_tiers)) == 1)
        placement = await submit_prefill(c, "agent-turn-3", 100_000, 96_896)
        batch = await pulled
        assert (placement.engine_id, placement.tier_name) == ("eng", "64K-256K")
        assert [r.request_id for r in batch.requests] == ["agent-turn-3"]
        assert engine.rank_loads_ns()[placement.dp_rank] == placement.predicted_cost_ns
        plan = engine.step()
        (chunk,) = plan.chunks[placement.dp_rank]
        assert (chunk.start, chunk.tokens, chunk.last) == (96_896, 3104, True)
        assert engine.rank_loads_ns() == [0, 0, 0, 0]
        assert await engine.report([(chunk.tokens, chunk.start, int(plan.step_ns))]) == 1


async def test_cost_model_carries_the_engines_own_step_budget(client: FulcrumClient) -> None:
    async def register(member_id: str, quota_ns: int) -> None:
        await client.fleet.Register(
            fleet_pb2.RegisterRequest(
                member_id=member_id,
                prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=4, step_quota_ns=quota_ns),
            )
        )

    await register("own-budget", 250_000_000)
    await register("default-budget", 0)
    default = await client.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
    own = await client.prefill.GetCostModel(
        prefill_pb2.GetCostModelRequest(engine_id="own-budget")
    )
    plain = await client.prefill.GetCostModel(
        prefill_pb2.GetCostModelRequest(engine_id="default-budget")
    )
    assert own.step_quota_ns == 250_000_000
    assert plain.step_quota_ns == default.step_quota_ns == 1_000_000_000
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.prefill.GetCostModel(prefill_pb2.GetCostModelRequest(engine_id="nobody"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.prefill.GetCostModel(prefill_pb2.GetCostModelRequest(engine_id="bad id"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
