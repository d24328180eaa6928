"""The SDK's load reporters through a real daemon on loopback (public API only)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.client.reporters import (
    DecodeLoadReporter,
    ExpertLoadReporter,
    ExpertMapArrays,
    VisionLoadReporter,
    from_tensor,
    to_tensor,
)
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import expert_pb2, fleet_pb2, vision_pb2

LAYERS, EXPERTS, EP = 6, 32, 4
#: Bound on any wait for an asynchronous event (a condition, not a sleep).
WAIT_S = 10.0


def group_request(gid: str = "g1") -> expert_pb2.RegisterGroupRequest:
    return expert_pb2.RegisterGroupRequest(
        group_id=gid,
        role=expert_pb2.GROUP_ROLE_PREFILL,
        ep_size=EP,
        gpus_per_node=8,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        window_steps=20,
        period_steps=40,
        expert_bytes=1 << 20,
    )


def skewed_steps(seed: int, steps: int) -> list[npt.NDArray[np.int64]]:
    """Per-step tokens per expert with a fixed popularity skew (seeded)."""
    rng = np.random.default_rng(seed)
    pop = rng.lognormal(0.0, 1.0, size=(LAYERS, EXPERTS))
    return [rng.poisson(pop * 50).astype(np.int64) for _ in range(steps)]


def test_tensor_round_trip_is_little_endian_bytes() -> None:
    a = np.arange(12, dtype=">i4").reshape(3, 4)  # big-endian input
    t = to_tensor(a)
    assert t.dtype == "int32" and list(t.shape) == [3, 4]
    assert t.data == np.arange(12, dtype="<i4").tobytes()
    assert (from_tensor(t) == a).all()


# -- decode and vision ---------------------------------------------------------------------


async def test_decode_reporter_registers_and_heartbeats_load(
    daemon: Daemon, client: FulcrumClient
) -> None:
    rep = DecodeLoadReporter(client, "d1", [(8, 10_000), (8, 10_000)])
    await rep.start()
    try:
        listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        assert [(m.member_id, m.gpus) for m in listed.members] == [("d1", 2)]
        rep.set_load(0, 3, 3_000)
        rep.set_load(1, 1, 500)
        await rep.report_now()
        state = daemon.app.components["decode"]
        assert state.gpu_load("d1", 0) == (3, 3_000)
        assert state.gpu_load("d1", 1) == (1, 500)
        with pytest.raises(IndexError):
            rep.set_load(2, 0, 0)
    finally:
        await rep.stop()
    listed = await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
    assert list(listed.members) == []  # stop() deregisters


async def test_decode_reporter_registers_again_when_forgotten(
    daemon: Daemon, client: FulcrumClient
) -> None:
    rep = DecodeLoadReporter(client, "d1", [(8, 10_000)])
    await rep.start()
    first = rep.incarnation
    await client.fleet.Deregister(
        fleet_pb2.DeregisterRequest(member_id="d1", incarnation=first)
    )
    rep.set_load(0, 2, 200)
    await rep.report_now()  # NOT_FOUND -> registers again
    assert rep.registrations == 2 and rep.incarnation > first
    await rep.report_now()
    assert daemon.app.components["decode"].gpu_load("d1", 0) == (2, 200)
    await rep.stop()


async def test_decode_reporter_refused_load_raises(client: FulcrumClient) -> None:
    rep = DecodeLoadReporter(client, "d1", [(8, 10_000)])
    await rep.start()
    rep.set_load(0, 10**9, 0)  # beyond the daemon's bound on a GPU's concurrency
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rep.report_now()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "concurrency" in (err.value.details() or "")
    await rep.stop()


async def test_vision_reporter_heartbeats_patches(client: FulcrumClient) -> None:
    rep = VisionLoadReporter(client, "ve1", gpus=2, max_patches_in_flight=4096)
    await rep.start()
    rep.set_load(0, 300)
    rep.set_load(1, 700)
    await rep.report_now()
    got = await client.vision.GetMachineLoad(vision_pb2.GetMachineLoadRequest(machine_id="ve1"))
    assert list(got.patches_in_flight) == [300, 700]
    assert got.max_patches_in_flight == 4096
    await rep.stop()


# -- EP groups -----------------------------------------------------------------------------


async def test_expert_reporter_accumulates_reports_and_follows_the_map(
    client: FulcrumClient,
) -> None:
    seen: list[int] = []

    def on_map(m: ExpertMapArrays) -> None:
        assert m.physical_to_logical.shape[0] == LAYERS
        assert (m.replica_counts >= 1).all()
        seen.append(m.version)

    rep = ExpertLoadReporter(client, group_request(), report_every_steps=10, on_map=on_map)
    await rep.start()
    try:
        await asyncio.wait_for(rep.wait_for_version(1), WAIT_S)
        steps = skewed_steps(1, 40)
        replies: list[Any] = []
        for load in steps:
            reply = await rep.record(load)
            if reply is not None:
                replies.append(reply)
        assert [r.rebalanced for r in replies] == [False, False, False, True]
        assert rep.reports == 4 and rep.pending_steps == 0
        m2 = await asyncio.wait_for(rep.wait_for_version(2), WAIT_S)
        assert rep.map_version == 2 and seen == [1, 2]
        assert m2.algorithm != "initial"
        # The window holds the sum of the steps (the tensor carried every token).
        status = await client.expert.GetGroupStatus(
            expert_pb2.GetGroupStatusRequest(group_id="g1")
        )
        assert status.last_step_end == 40 and status.map_version == 2
        for load in skewed_steps(2, 10):
            await rep.record(load)
        status = await client.expert.GetGroupStatus(
            expert_pb2.GetGroupStatusRequest(group_id="g1")
        )
        assert status.last_step_end == 50 and rep.dropped_steps == 0
    finally:
        await rep.stop()


async def test_expert_reporter_reports_steps_of_the_previous_map(client: FulcrumClient) -> None:
    rep = ExpertLoadReporter(client, group_request(), report_every_steps=10)
    await rep.register()  # no watch: the reporter learns of v2 only from the reply
    for load in skewed_steps(3, 10):
        await rep.record(load)
    forced = await client.expert.Rebalance(expert_pb2.RebalanceRequest(group_id="g1"))
    assert forced.applied and forced.map.version == 2
    results = [await rep.record(load) for load in skewed_steps(4, 10)]
    # Measured under v1 while v2 was being loaded: counted, under v2, and v2 adopted.
    last = results[-1]
    assert last is not None and last.counted_map_version == 2
    assert rep.dropped_steps == 0 and rep.map_version == 2
    results = [await rep.record(load) for load in skewed_steps(5, 10)]
    assert results[-1] is not None and results[-1].map_version == 2
    status = await client.expert.GetGroupStatus(expert_pb2.GetGroupStatusRequest(group_id="g1"))
    assert status.last_step_end == 30


async def test_expert_reporter_keeps_steps_across_a_map_change(client: FulcrumClient) -> None:
    rep = ExpertLoadReporter(client, group_request(), report_every_steps=10)
    await rep.start()
    for load in skewed_steps(6, 13):
        await rep.record(load)
    assert rep.pending_steps == 3
    await client.expert.Rebalance(expert_pb2.RebalanceRequest(group_id="g1"))
    await asyncio.wait_for(rep.wait_for_version(2), WAIT_S)
    assert rep.dropped_steps == 0 and rep.pending_steps == 3
    for load in skewed_steps(7, 7):
        await rep.record(load)
    assert rep.reports == 2 and rep.pending_steps == 0 and rep.dropped_steps == 0
    status = await client.expert.GetGroupStatus(expert_pb2.GetGroupStatusRequest(group_id="g1"))
    assert status.last_step_end == 20 and status.map_version == 2
    await rep.stop()


# -- daemon restart ------------------------------------------------------------------------


async def test_reporters_carry_on_after_a_daemon_restart() -> None:
    async with running_server() as first:
        address = first.address
        port = int(address.rsplit(":", 1)[1])
        client = FulcrumClient(address, timeout_s=10.0)
        decode = DecodeLoadReporter(client, "d1", [(8, 10_000)])
        await decode.start()
        experts = ExpertLoadReporter(client, group_request(), report_every_steps=10)
        await experts.register()
        for load in skewed_steps(7, 10):
            await experts.record(load)
        await client.expert.Rebalance(expert_pb2.RebalanceRequest(group_id="g1"))
        for load in skewed_steps(8, 10):
            await experts.record(load)  # measured under v1 while v2 loads: counted
        assert experts.map_version == 2
        engine_map = experts.current_map
        assert engine_map is not None
    # The daemon is down: the reporter keeps the window (steps 20-30) and counts the miss.
    for load in skewed_steps(10, 10):
        assert await experts.record(load) is None
    assert experts.failed_reports == 1 and experts.pending_steps == 10
    # Same port, fresh daemon: it knows neither the instance nor the group.
    async with running_server({"server": {"port": port}}) as second:
        decode.set_load(0, 4, 4_000)
        await decode.report_now()
        assert decode.registrations == 2
        assert second.app.components["decode"].gpu_load("d1", 0) == (4, 4_000)
        # The next step reports the whole window: steps 20-31 in one report.
        assert await experts.record(skewed_steps(9, 1)[0]) is not None
        assert experts.registrations == 2 and experts.reports == 3
        assert experts.dropped_steps == 0 and experts.pending_steps == 0
        status = await client.expert.GetGroupStatus(
            expert_pb2.GetGroupStatusRequest(group_id="g1")
        )
        assert status.last_step_end == 31 and status.window_steps == 11
        got = await client.expert.GetMap(expert_pb2.GetMapRequest(group_id="g1"))
        # Registered again with the map the engines run, not the identity map.
        assert (from_tensor(got.map.physical_to_logical) == engine_map.physical_to_logical).all()
        await decode.stop()
        await client.close()


# -- the runnable example ------------------------------------------------------------------


async def test_example_decode_instance_runs_against_a_daemon(daemon: Daemon) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "decode_instance.py"
    spec = importlib.util.spec_from_file_location("example_decode_instance", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules[spec.name]
    lines: list[str] = []
    args = example.parse_args(
        ["--target", daemon.address, "--steps", "80", "--step-ms", "1", "--rate", "2000",
         "--report-every", "10", "--period-steps", "40", "--gpus", "2",
         "--max-concurrency", "128"]
    )
    counts = await example.run(args, log=lines.append)
    assert counts["placed"] == counts["ours"] >= 100 and counts["refused"] == 0
    assert counts["reports"] == 8 and counts["maps"] >= 1
    assert any("registered 2 decode GPUs" in line for line in lines)
    # It cleaned up: nothing registered any more.
    assert daemon.app.fleet.members() == []
