"""Requests an engine still holds from a daemon that is gone (a failover or a restart),
declared when it registers again, through a real channel: a retried Submit of one gets the
holding engine and is never handed out a second time; bad declarations change nothing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fulcrum.client.prefill import PrefillEngine
from fulcrum.v1 import fleet_pb2
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
    submit_request,
    until,
)

S = 1_000_000_000


def held(*ids: str, rank: int = 1, total: int = 1000) -> list[fleet_pb2.HeldPrefillRequest]:
    return [fleet_pb2.HeldPrefillRequest(request_id=i, dp_rank=rank, total_tokens=total,
                                         cached_tokens=0) for i in ids]


async def register_holding(c: object, engine: str, items: list[fleet_pb2.HeldPrefillRequest],
                           dp_ranks: int = 2) -> int:
    reply = await c.fleet.Register(fleet_pb2.RegisterRequest(  # type: ignore[attr-defined]
        member_id=engine,
        prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=dp_ranks, held=items)))
    return int(reply.incarnation)


async def test_a_retry_after_the_declaration_gets_the_holder_at_once() -> None:
    async with prefill_daemon() as (_, c, st):
        await register(c, "other", dp_ranks=2)
        await register_holding(c, "holder", held("r1", "r2"))
        placed = await c.prefill.Submit(submit_request("r1", 1000))
        assert (placed.engine_id, placed.dp_rank) == ("holder", 1)
        assert st.in_flight() == 0 and st.queue_depths() == [0] * st.n_tiers
        # other lengths under a declared id: the id is taken, as for any retained outcome
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit_request("r2", 2000))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_retry_before_the_declaration_leaves_the_queue_for_the_holder() -> None:
    async with prefill_daemon() as (_, c, st):
        await register(c, "other", dp_ranks=2)  # registered, not pulling
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        await until(lambda: st.is_queued("r1"))
        await register_holding(c, "holder", held("r1"))
        placed = await sub
        assert (placed.engine_id, placed.dp_rank) == ("holder", 1)
        assert not st.is_queued("r1") and st.in_flight() == 0


async def test_a_lease_to_another_engine_ends_and_its_ack_is_refused() -> None:
    async with prefill_daemon({"prefill": {"lease_ms": 3_600_000}}) as (_, c, st):
        inc = await register(c, "other", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        got = await c.prefill.Pull(pull_request("other", inc, 100 * S, loads=[0, 0],
                                                ack_on_reply=False))
        assert [r.request_id for r in got.requests] == ["r1"] and st.is_leased("r1")
        await register_holding(c, "holder", held("r1"))
        assert (await sub).engine_id == "holder"
        late = await c.prefill.Pull(pull_request("other", inc, 100 * S, loads=[0, 0],
                                                 wait_ms=1, ack_on_reply=False, ack=["r1"]))
        assert list(late.rejected_request_ids) == ["r1"] and not late.requests


async def test_a_leader_holding_pulls_hands_out_nothing_until_the_grace_ends() -> None:
    async with prefill_daemon() as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        st.hold(3_600_000)  # as after an election (the test ends the grace itself)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        await until(lambda: st.is_queued("r1"))
        empty = await c.prefill.Pull(pull_request("e1", inc, 100 * S, wait_ms=1))
        assert not empty.requests and st.is_queued("r1")
        await register_holding(c, "holder", held("r1"))
        assert (await sub).engine_id == "holder"
        st.hold_until_ns = 0
        sub2 = asyncio.ensure_future(c.prefill.Submit(submit_request("r2", 1000)))
        taken = await c.prefill.Pull(pull_request("e1", inc, 100 * S))
        assert [r.request_id for r in taken.requests] == ["r2"]
        assert (await sub2).engine_id == "e1"


@pytest.mark.parametrize(("items", "field"), [
    (held("r1", rank=2), "held[0].dp_rank"),
    (held("r1", "r1"), "held[1].request_id"),
    (held(""), "held[0].request_id"),
    ([fleet_pb2.HeldPrefillRequest(request_id="r1", dp_rank=0, total_tokens=5,
                                   cached_tokens=5)], "held[0]"),
])
async def test_a_bad_declaration_is_invalid_argument_and_registers_nothing(
        items: list[fleet_pb2.HeldPrefillRequest], field: str) -> None:
    async with prefill_daemon() as (_, c, st):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register_holding(c, "holder", items)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
        assert st.engines_per_tier() == [0] * st.n_tiers
        assert st.retained("r1") is None


async def test_the_engine_kit_declares_what_it_still_has_queued() -> None:
    async with prefill_daemon() as (_, c, _st):
        inc = await register(c, "e1", dp_ranks=2)
        eng = PrefillEngine(c, "e1", inc, 2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit_request("r1", 1000)))
        batch = await eng.pull(100 * S, max_wait_ms=5_000)
        assert [r.request_id for r in batch.requests] == ["r1"]
        await sub
        declared = eng.held(now_s=100.0)
        assert [(h.request_id, h.total_tokens, h.cached_tokens) for h in declared] == [
            ("r1", 1000, 0)]
        eng.step([1e15, 1e15])  # runs it to the end: still declared while remembered
        assert [h.request_id for h in eng.held(now_s=200.0)] == ["r1"]  # seen finished
        assert [h.request_id for h in eng.held(now_s=200.0 + eng.remember_s - 1)] == ["r1"]
        assert eng.held(now_s=200.0 + eng.remember_s) == []
