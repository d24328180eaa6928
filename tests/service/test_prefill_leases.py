"""Acknowledged delivery through a real channel: leases, Ack, ack on the next Pull,
reassignment after a lease runs out or an engine leaves, late acknowledgements,
idempotent submit, zero quota, parked pulls keeping their engine alive, rank imbalance."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fulcrum.metrics import prefill as m
from fulcrum.v1 import fleet_pb2, prefill_pb2
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
    submit_request,
    until,
)

S = 1_000_000_000


def leased(engine: str, inc: int, wait_ms: int = 5_000, ack: list[str] | None = None,
           loads: list[int] | None = None, remaining: int = 100 * S,
           ) -> prefill_pb2.PullRequest:
    return pull_request(engine, inc, remaining, loads=loads or [0, 0], wait_ms=wait_ms,
                        ack_on_reply=False, ack=ack)


async def test_submit_resolves_on_the_acknowledgement() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        reply = await c.prefill.Pull(leased("e1", inc))
        assert [r.request_id for r in reply.requests] == ["r1"]
        assert reply.lease_ms == st.settings.lease_ms
        assert st.is_leased("r1") and not sub.done()
        await asyncio.sleep(0.05)  # (not a synchronisation: only shows it still waits)
        assert not sub.done()
        ack = await c.prefill.Ack(
            prefill_pb2.AckRequest(engine_id="e1", incarnation=inc, request_ids=["r1"])
        )
        assert (ack.accepted, list(ack.rejected_request_ids)) == (1, [])
        placed = await sub
        assert (placed.engine_id, placed.dp_rank) == ("e1", reply.requests[0].dp_rank)
        assert not st.is_leased("r1") and st.in_flight() == 0


async def test_ack_on_the_next_pull() -> None:
    async with prefill_daemon() as (_, c, _st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        first = await c.prefill.Pull(leased("e1", inc))
        nxt = await c.prefill.Pull(leased("e1", inc, wait_ms=1, ack=["r1"]))
        assert list(nxt.rejected_request_ids) == [] and not nxt.requests
        assert (await sub).dp_rank == first.requests[0].dp_rank


async def test_expired_lease_goes_to_the_head_and_elsewhere_late_ack_refused() -> None:
    # A lease of an hour that the test ends itself (as its timer would), once r2 is queued:
    # a real 100 ms lease raced the Submit round trip of r2 on a slow machine.
    async with prefill_daemon({"prefill": {"lease_ms": 3_600_000}}) as (_, c, st):
        inc1 = await register(c, "e1", dp_ranks=2)
        inc2 = await register(c, "e2", dp_ranks=2)
        tier0 = [e for e in ("e1", "e2") if st.engine_tier(e) == 0]
        assert tier0, st.engines_per_tier()
        # One at a time, so the queue's order is certain (two calls in flight at once may
        # reach the daemon in either order).
        subs = []
        for i in range(2):
            subs.append(asyncio.ensure_future(c.prefill.Submit(submit_request(f"r{i}", 1000))))
            await until(lambda i=i: st.queue_depths()[0] == i + 1)
        # The frozen engine pulls both, then says nothing.
        frozen = tier0[0]
        other = "e2" if frozen == "e1" else "e1"
        incs = {"e1": inc1, "e2": inc2}
        got = await c.prefill.Pull(leased(frozen, incs[frozen]))
        assert [r.request_id for r in got.requests] == ["r0", "r1"]
        late = asyncio.ensure_future(c.prefill.Submit(submit_request("r2", 1000)))
        await until(lambda: st.queue_depths()[0] == 1)
        # Its lease runs out (the timer the pull set, fired now): both back at the head,
        # before r2.
        leases = [st.leases.get("r0"), st.leases.get("r1")]
        assert all(x is not None for x in leases)
        st._lease_timer([x for x in leases if x is not None])
        assert st.queue_depths()[0] == 3
        assert [q.request_id for q in st.balancer.queued(0)] == ["r0", "r1", "r2"]
        assert st.leases.leased_ns == [0] * st.n_tiers
        # Another engine (work-conserving or moved) takes them.
        st.last_demand_ns = [1.0, 0.0, 0.0, 0.0]
        st.rebalance(0, reason="join")
        taken: list[str] = []
        for _ in range(10):  # bounded: three requests come in at most a few pulls
            if len(taken) >= 3:
                break
            reply = await c.prefill.Pull(leased(other, incs[other], wait_ms=1_000))
            ids = [r.request_id for r in reply.requests]
            taken += ids
            ack = await c.prefill.Ack(prefill_pb2.AckRequest(
                engine_id=other, incarnation=incs[other], request_ids=ids))
            assert ack.accepted == len(ids)
        assert taken == ["r0", "r1", "r2"]
        # The frozen engine thaws and acknowledges late: refused, it must not run them.
        ack = await c.prefill.Ack(prefill_pb2.AckRequest(
            engine_id=frozen, incarnation=incs[frozen], request_ids=["r0", "r1"]))
        assert (ack.accepted, sorted(ack.rejected_request_ids)) == (0, ["r0", "r1"])
        for sub in [*subs, late]:
            assert (await sub).engine_id == other
        # A retried acknowledgement (its reply lost) by the engine that runs it is fine.
        again = await c.prefill.Ack(prefill_pb2.AckRequest(
            engine_id=other, incarnation=incs[other], request_ids=["r0"]))
        assert list(again.rejected_request_ids) == []


async def test_engine_leaving_with_a_lease_hands_it_on() -> None:
    async with prefill_daemon() as (_, c, st):
        inc1 = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        got = await c.prefill.Pull(leased("e1", inc1))
        assert got.requests
        await c.fleet.Deregister(fleet_pb2.DeregisterRequest(member_id="e1", incarnation=inc1))
        assert st.is_queued("r1") and not st.is_leased("r1")
        inc2 = await register(c, "e2", dp_ranks=2)
        reply = await c.prefill.Pull(leased("e2", inc2))
        assert [r.request_id for r in reply.requests] == ["r1"]
        await c.prefill.Pull(leased("e2", inc2, wait_ms=1, ack=["r1"]))
        assert (await sub).engine_id == "e2"


async def test_idempotent_submit() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        first = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000, 10)))
        await until(lambda: st.is_queued("r1"))
        # The same request again while in flight joins it; another one is refused.
        again = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000, 10)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("r1", 1000, 20))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "cached_tokens" in (err.value.details() or "")
        await asyncio.sleep(0)
        reply = await c.prefill.Pull(leased("e1", inc))
        assert [r.request_id for r in reply.requests] == ["r1"]
        await c.prefill.Ack(prefill_pb2.AckRequest(engine_id="e1", incarnation=inc,
                                                   request_ids=["r1"]))
        a, b = await first, await again
        assert a == b and a.engine_id == "e1"
        # After the acknowledgement: the same outcome, no second delivery.
        third = await c.prefill.Submit(submit_request("r1", 1000, 10))
        assert third == a
        empty = await c.prefill.Pull(leased("e1", inc, wait_ms=1))
        assert not empty.requests and st.in_flight() == 0


async def test_retention_is_bounded() -> None:
    # Issue 22 row 7: outcomes are never evicted before retention_ms; past the bound a
    # NEW submit is refused RESOURCE_EXHAUSTED with retry-after-ms (was: oldest evicted,
    # so its retry was delivered twice).
    async with prefill_daemon({"prefill": {"max_retained": 2}}) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        for i in range(2):
            sub = asyncio.ensure_future(c.prefill.Submit(submit_request(f"r{i}", 1000)))
            reply = await c.prefill.Pull(leased("e1", inc))
            await c.prefill.Ack(prefill_pb2.AckRequest(
                engine_id="e1", incarnation=inc,
                request_ids=[r.request_id for r in reply.requests]))
            await sub
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("r2", 1000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.value.trailing_metadata() or ()).get("retry-after-ms", "0")) > 0
        assert len(st._done) == 2 and st.retained("r0") is not None
        assert st.retained("r1") is not None and not st.is_queued("r2")
        # the retries of the retained ones still get their outcome
        assert (await c.prefill.Submit(submit_request("r0", 1000))).engine_id == "e1"


async def test_zero_quota_gets_no_work() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        await until(lambda: st.is_queued("r1"))
        reply = await c.prefill.Pull(leased("e1", inc, wait_ms=1, remaining=0))
        assert not reply.requests and st.is_queued("r1")
        reply = await c.prefill.Pull(pull_request("e1", inc, S))
        assert reply.requests and (await sub).engine_id == "e1"


async def test_parked_pull_keeps_its_engine_alive() -> None:
    # 500 ms: room for the Register -> Pull round trip on a loaded machine.
    over = {"fleet": {"heartbeat_timeout_ms": 500, "sweep_interval_ms": 20}}
    async with prefill_daemon(over) as (d, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        # Parked 4 heartbeat timeouts with no heartbeat: still the same live engine.
        reply = await c.prefill.Pull(leased("e1", inc, wait_ms=2_000))
        assert not reply.requests
        member = d.app.fleet.get_live("e1", inc, d.app.clock())
        assert member.incarnation == inc and st.engine_tier("e1") >= 0


async def test_rank_imbalance_is_observed_per_tier() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        tier = st.labels[st.engine_tier("e1")]
        child = m.RANK_IMBALANCE.labels(tier)
        before = child._sum.get()  # the histogram's running sum
        await c.prefill.Pull(leased("e1", inc, wait_ms=1, loads=[3 * S, S]))
        assert child._sum.get() - before == pytest.approx(1.5)  # max/mean = 3/2
        await c.prefill.Pull(leased("e1", inc, wait_ms=1, loads=[0, 0]))  # idle: not observed
        assert child._sum.get() - before == pytest.approx(1.5)


async def test_register_heartbeat_and_pull_replies_carry_the_assignment() -> None:
    async with prefill_daemon() as (_, c, st):
        reg = await c.fleet.Register(fleet_pb2.RegisterRequest(
            member_id="e1",
            prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=2, step_quota_ns=S // 2)))
        a = reg.prefill
        assert (a.tier, a.tier_name) == (0, "<16K")
        assert (a.tier_horizon_ns, a.step_quota_ns) == (2 * S, S // 2)
        hb = await c.fleet.Heartbeat(
            fleet_pb2.HeartbeatRequest(member_id="e1", incarnation=reg.incarnation))
        assert hb.prefill == a
        reply = await c.prefill.Pull(leased("e1", reg.incarnation, wait_ms=1))
        assert reply.assignment == a
        # The documented quota: an idle engine offers ranks x horizon, and takes a fresh
        # 16K-token prompt (more than one 1 s step budget) with it.
        quota = sum(max(0, a.tier_horizon_ns - load) for load in (0, 0))
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("big", 16_000)))
        await until(lambda: st.is_queued("big"))
        got = await c.prefill.Pull(
            leased("e1", reg.incarnation, wait_ms=1, remaining=quota, loads=[0, 0]))
        assert [r.request_id for r in got.requests] == ["big"]
        assert got.requests[0].predicted_cost_ns > S
        await c.prefill.Ack(prefill_pb2.AckRequest(
            engine_id="e1", incarnation=reg.incarnation, request_ids=["big"]))
        assert (await sub).engine_id == "e1"


async def test_leased_pull_without_rank_loads_is_refused() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        await until(lambda: st.is_queued("r1"))
        bad = pull_request("e1", inc, 100 * S, loads=[], wait_ms=1, ack_on_reply=False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("rank_loads_ns: required")
        assert st.is_queued("r1")  # nothing changed
        sub.cancel()
