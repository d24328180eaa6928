"""FulcrumClient and MemberSession over several targets, through real channels: a fake
standby (tests/client/standby.py) that refuses with the leader trailer, real in-process
daemons as leaders, and ports where nothing listens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.client import FulcrumClient, MemberSession
from fulcrum.client.failover import MAX_LEARNED_TARGETS, FailoverPolicy, Targets, leader_hint
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2, diagnostics_pb2, fleet_pb2, prefill_pb2
from tests.client.standby import FakeStandby, free_port
from tests.polling import FakeClock, until

PING = "/fulcrum.v1.DiagnosticsService/Ping"
PLACE = "/fulcrum.v1.DecodeBalancerService/PlaceDecode"
FAST = FailoverPolicy(max_attempts=6, first_backoff_s=0.001, max_backoff_s=0.01,
                      rng=random.Random(7))


def decode_instance(member_id: str) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=member_id,
        decode_instance=fleet_pb2.DecodeInstanceShape(
            gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=1 << 20)]
        ),
    )


@pytest.fixture
async def leader() -> AsyncIterator[Daemon]:
    async with running_server() as d:
        yield d


async def test_a_standby_refusal_is_followed_to_the_leader_it_names(leader: Daemon) -> None:
    async with FakeStandby(leader.address) as standby, FulcrumClient(
        [standby.address, leader.address], failover=FAST
    ) as c:
        reply = await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"x"))
        assert reply.payload == b"x"
        assert c.leader == leader.address and c.failovers == 1
        assert standby.calls == {PING: 1}
        # the calls that follow go to the leader at once
        for _ in range(3):
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        assert standby.refused == 1


async def test_a_placement_refused_by_a_standby_reaches_the_leader(leader: Daemon) -> None:
    """A standby refuses before any handler runs: even a placement (never repeated after
    an ambiguous UNAVAILABLE) goes to the leader, once."""
    async with FakeStandby(leader.address) as standby, FulcrumClient(
        [standby.address, leader.address], failover=FAST
    ) as c:
        await c.fleet.Register(decode_instance("dec-0"))  # standby -> leader
        assert c.leader == leader.address
        c._targets.current = standby.address  # as if the client had just started again
        placed = await c.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="r1", kv_tokens=10)
        )
        assert placed.instance_id == "dec-0"
        assert standby.calls[PLACE] == 1
        assert leader.app.components["decode"].gpu_load("dec-0", 0)[0] == 1


async def test_a_standby_that_knows_no_leader_sends_the_call_to_the_next_target(
    leader: Daemon,
) -> None:
    async with FakeStandby("") as standby, FulcrumClient(
        [standby.address, leader.address], failover=FAST
    ) as c:
        await c.fleet.Register(decode_instance("dec-0"))
        placed = await c.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="r1", kv_tokens=10)
        )
        assert placed.instance_id == "dec-0" and c.leader == leader.address
        assert standby.refused == 1


async def test_a_lost_target_repeats_idempotent_calls_only(leader: Daemon) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with FulcrumClient([dead, leader.address], failover=FAST) as c:
        reg = await c.fleet.Register(decode_instance("dec-0"))  # idempotent: repeated
        assert reg.incarnation > 0 and c.leader == leader.address
        c._targets.current = dead
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a placement: not repeated
            await c.decode.PlaceDecode(
                decode_pb2.PlaceDecodeRequest(request_id="r1", kv_tokens=10)
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert leader.app.components["decode"].gpu_load("dec-0", 0)[0] == 0
        # ... but the client moved on: the caller's own retry reaches the leader
        assert c.leader == leader.address
        placed = await c.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="r1", kv_tokens=10)
        )
        assert placed.instance_id == "dec-0"


async def test_the_leaders_own_unavailable_is_returned_unchanged(leader: Daemon) -> None:
    """Submit with no live engine: UNAVAILABLE with retry-after-ms from the leader. The
    client neither fails over nor repeats it (the trailer says when to retry)."""
    async with FakeStandby(leader.address) as standby, FulcrumClient(
        [leader.address, standby.address], failover=FAST
    ) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(prefill_pb2.SubmitRequest(request_id="q", total_tokens=100))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert int(dict(err.value.trailing_metadata() or ())["retry-after-ms"]) > 0
        assert c.leader == leader.address and c.failovers == 0 and standby.refused == 0


async def test_two_standbys_naming_each_other_end_after_max_attempts() -> None:
    async with FakeStandby(None) as a, FakeStandby(None) as b:
        a.leader, b.leader = b.address, a.address
        async with FulcrumClient([a.address, b.address], failover=FAST) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert a.refused + b.refused == FAST.max_attempts
        assert a.refused == b.refused == FAST.max_attempts // 2


async def test_the_deadline_bounds_all_attempts() -> None:
    """A backoff longer than what is left of the deadline is not slept: the call ends."""
    slow = FailoverPolicy(max_attempts=10, first_backoff_s=30.0, max_backoff_s=30.0)
    async with FakeStandby("") as a, FakeStandby("") as b:
        async with FulcrumClient([a.address, b.address], timeout_s=5.0, failover=slow) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert a.refused == 1 and b.refused == 0


async def test_a_single_target_standby_is_followed_too(leader: Daemon) -> None:
    async with FakeStandby(leader.address) as standby, FulcrumClient(standby.address) as c:
        reply = await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"y"))
        assert reply.payload == b"y" and c.leader == leader.address
        assert c.targets == (standby.address, leader.address)
        # gRPC's own retry policy (one target) tried the standby first, within its bound
        assert 1 <= standby.refused <= 4


async def test_a_stream_refused_by_a_standby_moves_the_next_calls(leader: Daemon) -> None:
    """Streams are not repeated, but how one ended sends the next ones to the leader."""
    async with FakeStandby(leader.address) as standby, FulcrumClient(
        [standby.address, leader.address], failover=FAST
    ) as c:

        async def one() -> AsyncIterator[diagnostics_pb2.PingStreamRequest]:
            yield diagnostics_pb2.PingStreamRequest(payload=b"s")

        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in c.diagnostics.PingStream(one())]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert leader_hint(err.value.trailing_metadata()) == leader.address
        await until(lambda: c.leader == leader.address, "the client follows the stream's trailer")
        got = [r.payload async for r in c.diagnostics.PingStream(one())]
        assert got == [b"s"] and standby.refused == 1


async def test_member_session_registers_again_after_a_failover() -> None:
    """As after a restart: the heartbeat reaches the new leader, which answers NOT_FOUND,
    and the session registers there (one Register) and resends its load."""

    def load(request: fleet_pb2.HeartbeatRequest) -> None:
        request.decode_instance.gpus.add(concurrency=3, kv_tokens=300)

    async with running_server() as second:
        first = running_server()
        old = await first.__aenter__()
        port = int(old.address.rsplit(":", 1)[1])
        session = MemberSession([old.address, second.address], decode_instance("dec-0"), load)
        try:
            await session.register()
            await session.heartbeat()
            assert old.app.components["decode"].gpu_load("dec-0", 0) == (3, 300)
            await first.__aexit__(None, None, None)  # the leader goes away
            standby = FakeStandby(second.address)
            await standby.start(port)  # ... and comes back as a standby
            try:
                await asyncio.wait_for(session.client.channel.channel_ready(), 10.0)
                await session.heartbeat()
                assert standby.calls == {"/fulcrum.v1.FleetService/Heartbeat": 1}
            finally:
                await standby.stop()
            assert session.registrations == 2 and session.client.leader == second.address
            listed = await session.client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
            assert [m.incarnation for m in listed.members] == [session.incarnation]
            assert second.app.components["decode"].gpu_load("dec-0", 0) == (3, 300)
        finally:
            await session.stop()


async def test_member_session_on_a_lost_leader_heartbeats_the_next_target() -> None:
    async with running_server() as second:
        first = running_server()
        old = await first.__aenter__()
        async with FulcrumClient([old.address, second.address], failover=FAST) as c:
            session = MemberSession(c, decode_instance("dec-1"))
            await session.register()
            await first.__aexit__(None, None, None)  # killed: nothing answers there now
            await session.heartbeat()  # idempotent: repeated on the next target
            assert session.registrations == 2 and c.leader == second.address
            assert [m.member_id for m in (await c.fleet.ListMembers(
                fleet_pb2.ListMembersRequest())).members] == ["dec-1"]
            await session.stop()


async def test_the_single_target_signature_still_works(leader: Daemon) -> None:
    async with FulcrumClient(leader.address, timeout_s=3.0) as c:
        assert c.targets == (leader.address,) and c.leader == leader.address
        assert (await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"z"))).payload
        session = MemberSession(c, decode_instance("dec-2"))
        assert await session.register() > 0
        await session.stop()


def test_targets_need_one_and_policy_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Targets([], lambda t: t)
    with pytest.raises(ValueError, match="max_attempts"):
        FailoverPolicy(max_attempts=0)
    p = FailoverPolicy(first_backoff_s=0.1, max_backoff_s=0.4, rng=random.Random(1))
    pauses = [p.backoff_s(n) for n in range(2, 8)]
    assert all(0.05 <= x <= 0.4 for x in pauses) and max(pauses) > 0.2


_OPS = st.lists(
    st.tuples(st.sampled_from(["follow", "lost", "refused", "tick"]), st.integers(0, 30),
              st.integers(0, 30)),
    max_size=60,
)


@given(n=st.integers(1, 4), ops=_OPS)
def test_targets_stay_bounded_and_current_is_always_a_target(
    n: int, ops: list[tuple[str, int, int]]
) -> None:
    """Whatever trailers say, the rotation holds the configured targets plus at most
    MAX_LEARNED_TARGETS learned ones, and the current target is one of them."""
    configured = [f"h{i}:1" for i in range(n)]
    clock = FakeClock()
    t = Targets(configured, lambda target: target, lost_s=1.0, clock=clock)
    for op, a, b in ops:
        failed = t.targets[a % len(t.targets)]
        if op == "follow":
            was = t.current
            followed = t.follow(failed, f"h{b}:1")
            if followed and was == failed:
                assert t.current == f"h{b}:1" and not t.is_lost(t.current)
        elif op == "lost":
            t.lost(failed)
            if len(t.targets) > 1:
                assert t.current != failed
        elif op == "refused":
            t.refused(failed)
        else:
            clock.advance(b / 10)
        assert t.current in t.targets
        assert t.targets[:n] == configured
        assert len(t.targets) <= n + MAX_LEARNED_TARGETS
        assert len(set(t.targets)) == len(t.targets)
    assert t.channel() == t.current


async def test_a_standby_naming_a_lost_leader_keeps_the_calls_until_it_leads() -> None:
    """The leader died; until its lease ends the standby still names it. The client does
    not bounce between them: it stays on the standby (backing off) and gets the answer
    once the standby leads."""
    dead = f"127.0.0.1:{free_port()}"
    async with FakeStandby(dead) as standby, FulcrumClient(
        [dead, standby.address], failover=FAST
    ) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # dead once, then the standby on every attempt left (its hint is not followed)
        assert standby.refused == FAST.max_attempts - 1
        assert c.leader == standby.address and c.failovers == 1


def test_malformed_leader_trailers_count_as_no_leader() -> None:
    assert leader_hint(()) is None
    assert leader_hint((("x-fulcrum-leader", "10.0.0.1:50051"),)) == "10.0.0.1:50051"
    assert leader_hint((("x-fulcrum-leader", b"[::1]:7"),)) == "[::1]:7"
    for bad in ("", "no-port", ":50051", "a b:1", "h:" + "9" * 300, "0.0.0.0:50051",
                "[::]:50051"):
        assert leader_hint((("x-fulcrum-leader", bad),)) == ""


async def test_concurrent_failures_move_the_client_once(leader: Daemon) -> None:
    async with FakeStandby(leader.address) as standby, FulcrumClient(
        [standby.address, leader.address], failover=FAST
    ) as c:
        replies = await asyncio.gather(
            *(c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"%d" % i))
              for i in range(20))
        )
        assert [r.payload for r in replies] == [b"%d" % i for i in range(20)]
        assert c.failovers == 1 and 1 <= standby.refused <= 20
