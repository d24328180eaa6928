"""End to end: two ``fulcrum serve`` daemons electing on a real etcd, a prefill engine
loop, a decode member and a submitter on one multi-target client; the leader is killed
(SIGKILL) under load and the client keeps working on the new leader."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import grpc

from fulcrum.client import FulcrumClient, MemberSession
from fulcrum.client.planner import StepPlan
from fulcrum.client.prefill import PrefillEngineLoop, PrefillPlacement, submit_prefill
from fulcrum.ha.harness import DaemonProcess
from fulcrum.v1 import decode_pb2, fleet_pb2
from tests.ha.helpers import pair
from tests.polling import until


class Submitter:
    """Submits by id and retries only what the daemon says to retry later (UNAVAILABLE
    with retry-after-ms: no live engine yet on a new leader); counts any other
    UNAVAILABLE, which the client should have hidden."""

    def __init__(self, client: FulcrumClient) -> None:
        self.client = client
        self.unhidden = 0
        self.told_to_wait = 0

    async def submit(self, rid: str) -> PrefillPlacement:
        for _ in range(200):
            try:
                return await submit_prefill(self.client, rid, 2_000, timeout_s=20.0)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                hint = dict(err.trailing_metadata() or ()).get("retry-after-ms")
                if hint is None:
                    self.unhidden += 1
                    raise
                self.told_to_wait += 1
                await asyncio.sleep(min(int(hint), 200) / 1000)  # the daemon's own hint
        raise AssertionError(f"{rid}: never placed")


def _decode(member_id: str) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=member_id,
        decode_instance=fleet_pb2.DecodeInstanceShape(
            gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=64, max_kv_tokens=1 << 22)]
        ),
    )


async def test_the_client_keeps_working_when_the_leader_is_killed(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    completed: Counter[str] = Counter()

    async def run_step(plan: StepPlan) -> float:
        for chunks in plan.chunks:
            completed.update(c.request_id for c in chunks if c.last)
        return 1e6  # 1 ms

    # the standby first: the first calls follow its trailer to the leader
    client = FulcrumClient([standby.address, leader.address], timeout_s=20.0)
    loop = PrefillEngineLoop(client, "pf-0", 1, run_step, max_wait_ms=500)
    session = MemberSession(client, _decode("dec-0"))
    submitter = Submitter(client)
    stop = asyncio.Event()
    engine = asyncio.ensure_future(loop.run(stop))
    try:
        await session.start()
        assert client.leader == leader.address and client.failovers == 1
        before = await asyncio.gather(*(submitter.submit(f"a{i}") for i in range(20)))
        assert {p.engine_id for p in before} == {"pf-0"}
        placed = await client.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="d-a", kv_tokens=100)
        )
        assert placed.instance_id == "dec-0"

        # kill -9 the leader while submits are in flight
        during = [asyncio.ensure_future(submitter.submit(f"b{i}")) for i in range(20)]
        leader.p.kill()
        leader.p.wait()
        after = await asyncio.gather(*during)
        after += await asyncio.gather(*(submitter.submit(f"c{i}") for i in range(20)))

        assert {p.engine_id for p in after} == {"pf-0"}
        assert client.leader == standby.address
        assert submitter.unhidden == 0
        # members registered again on the new leader, as after a restart
        assert loop.counts["registrations"] == 2
        await until(lambda: session.registrations == 2, "the decode member re-registered")
        listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        assert {m.member_id for m in listed.members} == {"pf-0", "dec-0"}
        placed = await client.decode.PlaceDecode(
            decode_pb2.PlaceDecodeRequest(request_id="d-c", kv_tokens=100)
        )
        assert placed.instance_id == "dec-0" and placed.incarnation == session.incarnation
        # every acknowledged submit ran; none of those acknowledged before the kill twice
        ids = [f"{p}{i}" for p in "abc" for i in range(20)]
        await until(lambda: set(completed) >= set(ids), "every placed request ran")
        assert all(completed[f"a{i}"] == 1 for i in range(20))
        assert all(completed[f"c{i}"] == 1 for i in range(20))
        # no bouncing between the dead leader (named by the standby until its lease ended)
        # and the standby: a few moves, not one per attempt of every call (120+ before)
        assert client.failovers < 20, client.failovers
    finally:
        stop.set()
        await asyncio.wait_for(engine, 10.0)
        await session.stop()
        await loop.close()
        await client.close()
