"""Prefix affinity through the daemon (issue 15): a conversation's later turns go to the
engine holding its prefix while it has quota, to the other engine past the fairness bound."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fulcrum.client.prefix import block_hashes
from fulcrum.metrics import REGISTRY
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until

S = 1_000_000_000
WAIT_MS = 5_000

CONFIG = {"prefill": {"cache_model": "per_engine", "affinity_max_wait_ms": WAIT_MS,
                      "engine_cache_blocks": 1_000, "pull_wait_ms": 0}}


def _metric(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _submit(rid: str, tokens: list[int]) -> prefill_pb2.SubmitRequest:
    return prefill_pb2.SubmitRequest(
        request_id=rid, total_tokens=len(tokens), max_wait_ms=20_000,
        block_hashes=block_hashes(tokens),
    )


async def test_later_turns_follow_the_prefix_until_the_fairness_bound() -> None:
    async with prefill_daemon(CONFIG) as (d, c, state):
        now = [d.app.clock()]
        state._clock = lambda: now[0]  # the test drives the daemon's clock
        inc = {e: await register(c, e, dp_ranks=1) for e in ("a", "b")}
        state.rebalance(now[0])
        hits0 = _metric("fulcrum_prefill_affinity_decisions_total", decision="affinity_hit")
        over0 = _metric("fulcrum_prefill_affinity_decisions_total",
                        decision="fairness_override")
        # The counters are the process's: other tests may have counted an engine "a".
        hit_a0 = _metric("fulcrum_prefill_prefix_engine_hit_blocks_total", engine="a")
        look_a0 = _metric("fulcrum_prefill_prefix_engine_lookup_blocks_total", engine="a")

        conv = list(range(2_100))  # the shared prefix: 4 full blocks of 512 tokens
        turn1 = asyncio.ensure_future(c.prefill.Submit(_submit("t1", conv)))
        await until(lambda: state.is_queued("t1"))
        got = await c.prefill.Pull(pull_request("a", inc["a"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["t1"]
        assert (await turn1).engine_id == "a"

        # Turn 2 shares the prefix. Once a is predicted to have finished t1, b (idle)
        # pulls first and gets nothing: a finishes it sooner. a takes it.
        now[0] += state.model_cost_ns(2_100, 0)
        turn2 = asyncio.ensure_future(c.prefill.Submit(_submit("t2", conv + [7] * 600)))
        await until(lambda: state.is_queued("t2"))
        got = await c.prefill.Pull(pull_request("b", inc["b"], 100 * S, [0], wait_ms=0))
        assert not got.requests
        got = await c.prefill.Pull(pull_request("a", inc["a"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["t2"]
        reply = await turn2
        assert reply.engine_id == "a"
        # Charged at a's own cost: the 4 held blocks are not recomputed.
        assert reply.predicted_cost_ns == state.model_cost_ns(2_700 - 2_048, 2_048)

        # Turn 3: a is busy (does not pull). b waits for a until the bound, then takes it.
        turn3 = asyncio.ensure_future(c.prefill.Submit(_submit("t3", conv + [7] * 900)))
        await until(lambda: state.is_queued("t3"))
        now[0] += WAIT_MS * 1_000_000 - 1
        got = await c.prefill.Pull(pull_request("b", inc["b"], 100 * S, [0], wait_ms=0))
        assert not got.requests
        now[0] += 1
        got = await c.prefill.Pull(pull_request("b", inc["b"], 100 * S, [0], wait_ms=0))
        assert [r.request_id for r in got.requests] == ["t3"]
        assert (await turn3).engine_id == "b"

        assert _metric("fulcrum_prefill_affinity_decisions_total",
                       decision="affinity_hit") == hits0 + 1
        assert _metric("fulcrum_prefill_affinity_decisions_total",
                       decision="fairness_override") == over0 + 1
        assert _metric("fulcrum_prefill_prefix_engine_hit_blocks_total",
                       engine="a") == hit_a0 + 4
        assert _metric("fulcrum_prefill_prefix_engine_lookup_blocks_total",
                       engine="a") == look_a0 + 9
        # a holds t2's 5 full blocks (t1's 4 among them), b t3's 5 (the same 5 hashes).
        assert _metric("fulcrum_prefill_prefix_index_blocks") == 5 + 5


async def test_too_many_block_hashes_is_invalid_argument() -> None:
    config = {"prefill": {**CONFIG["prefill"], "max_block_hashes": 4}}
    async with prefill_daemon(config) as (_, c, state):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(_submit("x", list(range(512 * 5))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_hashes" in (err.value.details() or "")
        assert not state.is_queued("x")


def test_block_hashes_are_chained_and_stable() -> None:
    a = block_hashes(list(range(1_100)))
    b = block_hashes(list(range(1_024)) + [5] * 600)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    assert block_hashes([1] * 512)[0] != block_hashes([2] * 512)[0]
    # Stable across processes: a fixed value, not Python's salted hash().
    assert block_hashes([0] * 512) == [9124900054286956167]
    two = block_hashes([2, 3], block_tokens=2)
    assert block_hashes(list(range(4)), block_tokens=2)[1] != two[0]  # chained


def test_reload_switches_the_cache_model_and_reregistration_drops_the_cache() -> None:
    from fulcrum.config.prefill import PrefillSettings
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import MemberKind, PrefillEngineShape
    from fulcrum.state.fleet import Fleet
    from fulcrum.state.prefill import PrefillState

    now = [1]
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = PrefillState(PrefillSettings(round_period_ms=3_600_000), fleet, lambda: now[0])
    fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    fleet.register("a", PrefillEngineShape(dp_ranks=1), now[0])
    assert state.balancer.affinity is None
    per = PrefillSettings(round_period_ms=3_600_000, cache_model="per_engine",
                          engine_cache_blocks=3, affinity_max_wait_ms=7)
    assert state.apply_settings(per)
    aff = state.balancer.affinity
    assert aff is not None and aff.max_wait_ns == 7_000_000
    cache = aff.index.cache("a")
    assert cache is not None and cache.capacity_blocks == 3
    aff.index.record("a", [1, 2, 3, 4])
    assert aff.index.size() == 3  # bounded by the engine's capacity
    fleet.register("a", PrefillEngineShape(dp_ranks=1), now[0])  # re-registration
    assert aff.index.match("a", [2, 3, 4]) == 0
    assert state.apply_settings(PrefillSettings(round_period_ms=3_600_000))
    assert state.balancer.affinity is None


async def test_registered_cache_capacity_and_survival() -> None:
    from fulcrum.v1 import fleet_pb2

    def reg(blocks: int, survived: bool = False) -> fleet_pb2.RegisterRequest:
        return fleet_pb2.RegisterRequest(
            member_id="e", prefill_engine=fleet_pb2.PrefillEngineShape(
                dp_ranks=1, prefix_cache_blocks=blocks, prefix_cache_survived=survived))

    async with prefill_daemon(CONFIG) as (_, c, state):
        await c.fleet.Register(reg(2))
        aff = state.balancer.affinity
        assert aff is not None
        cache = aff.index.cache("e")
        assert cache is not None and cache.capacity_blocks == 2  # registered, not default
        aff.index.record("e", [1, 2])
        await c.fleet.Register(reg(2, survived=True))
        assert aff.index.match("e", [1, 2]) == 2  # the engine says its cache survived
        await c.fleet.Register(reg(0))
        assert aff.index.match("e", [1, 2]) == 0  # dropped by default
        cache = aff.index.cache("e")
        assert cache is not None and cache.capacity_blocks == 1_000  # the configured default
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.fleet.Register(reg(1 << 25))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prefix_cache_blocks" in (err.value.details() or "")


async def test_simulator_and_daemon_make_the_same_affinity_decisions() -> None:
    """The simulator's per-engine run, replayed through the daemon's prefill state with
    the same block hashes on a fake clock, takes the same requests onto the same ranks."""
    from fulcrum.config.prefill import PrefillSettings
    from fulcrum.config.server import FleetSettings
    from fulcrum.core.types import MemberKind, PrefillEngineShape
    from fulcrum.sim.cluster import Cluster
    from fulcrum.sim.engine import simulate
    from fulcrum.sim.policies import get_policy_set
    from fulcrum.state.fleet import Fleet
    from fulcrum.state.prefill import PrefillState
    from tests.sim.test_sim_prefix import conversations

    cluster = Cluster().with_overrides(
        prefill={"engines": 4, "ranks_per_engine": 2},
        decode={"instances": 1, "gpus_per_instance": 4},
        vision={"machines": 1, "gpus_per_machine": 2},
        cache={"mode": "per_engine", "capacity_blocks": 400},
    )
    reqs = sorted(conversations(5, n_conv=16, turns=6), key=lambda r: (r.arrival_ns, r.rid))
    events: list[tuple[object, ...]] = []
    res = simulate(cluster, get_policy_set("default"), reqs, seed=0, trace=events.append)
    assert res.block_hit_ratio > 0.3

    now = [0]
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = PrefillState(
        PrefillSettings(round_period_ms=3_600_000, max_queued_per_tier=100_000,
                        cache_model="per_engine", engine_cache_blocks=100,
                        affinity_max_wait_ms=2_000),
        fleet, lambda: now[0])
    fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    tasks: dict[str, asyncio.Task[object]] = {}
    batches = 0
    try:
        for ev in events:
            kind, now[0] = str(ev[0]), int(ev[1])
            if kind == "join":
                fleet.register(str(ev[2]), PrefillEngineShape(dp_ranks=int(ev[3])),
                               now[0])
            elif kind == "submit":
                rid, total, cached = str(ev[2]), int(ev[3]), int(ev[4])
                tasks[rid] = asyncio.ensure_future(state.submit(
                    rid, total, cached, 3600 * S, reqs[int(rid)].hash_ids))
                await asyncio.sleep(0)
                assert tuple(state.engines_per_tier()) == ev[5], ev
            elif kind == "pull":
                _, _, eid, remaining, loads, ids, ranks, bands, _ = ev
                batch = await state.pull(str(eid), 0, int(remaining),
                                         list(loads), 0, 0, band_loads=bands)
                assert tuple(it.request_id for it in batch.items) == ids, ev
                assert tuple(it.dp_rank for it in batch.items) == ranks, ev
                batches += bool(ids)
            elif kind == "round":
                state.tick(now[0])
                assert tuple(state.engines_per_tier()) == ev[2], ev
        aff = state.balancer.affinity
        assert aff is not None and aff.hits > 0
        assert batches >= 20
    finally:
        for task in tasks.values():
            task.cancel()


async def test_a_holder_of_the_longer_tier_comes_back_for_the_next_turn() -> None:
    """Issue 21: the long tier's engine took a conversation's first turn while helping the
    short tier; its next turn waits for that engine, which goes to the short tier for it
    even though its own tier's head waited longer for its tier's scale."""
    async with prefill_daemon(CONFIG) as (d, c, state):
        now = [d.app.clock()]
        state._clock = lambda: now[0]
        inc = {e: await register(c, e, dp_ranks=1) for e in ("a", "b")}
        state.last_demand_ns = [1.0, 1.0, 0.0, 0.0]
        state.rebalance(now[0], reason="join")
        tiers = {e: state.engine_tier(e) for e in ("a", "b")}
        assert sorted(tiers.values()) == [0, 1], tiers
        long = next(e for e, t in tiers.items() if t == 1)

        def pull(engine: str) -> prefill_pb2.PullRequest:
            return pull_request(engine, inc[engine], 100 * S, [0], wait_ms=0)

        conv = list(range(2_100))
        turn1 = asyncio.ensure_future(c.prefill.Submit(_submit("t1", conv)))
        await until(lambda: state.is_queued("t1"))
        got = await c.prefill.Pull(pull(long))  # its own tier is empty: it helps
        assert [r.request_id for r in got.requests] == ["t1"]
        assert (await turn1).engine_id == long
        now[0] += state.model_cost_ns(2_100, 0)
        # A long prompt of its own tier, then the conversation's next turn 990 ms later:
        # at the pull the long head waited 1 s of its 32 s scale, the turn 10 ms of 8 s.
        mid = asyncio.ensure_future(c.prefill.Submit(_submit("mid", [9] * 20_000)))
        await until(lambda: state.is_queued("mid"))
        now[0] += 990_000_000
        turn2 = asyncio.ensure_future(c.prefill.Submit(_submit("t2", conv + [7] * 600)))
        await until(lambda: state.is_queued("t2"))
        now[0] += 10_000_000
        moved0 = _metric("fulcrum_prefill_affinity_decisions_total", decision="holder_tier")
        got = await c.prefill.Pull(pull(long))
        assert [r.request_id for r in got.requests] == ["t2"]
        await until(lambda: _metric("fulcrum_prefill_affinity_decisions_total",
                                    decision="holder_tier") == moved0 + 1)
        reply = await turn2
        assert reply.predicted_cost_ns == state.model_cost_ns(2_700 - 2_048, 2_048)
        got = await c.prefill.Pull(pull(long))
        assert [r.request_id for r in got.requests] == ["mid"]
        assert (await mid).engine_id == long
