"""ExpertBalancerService through a real daemon on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.metrics import REGISTRY
from fulcrum.service.errors import RETRY_AFTER_KEY
from fulcrum.service.server import Daemon
from fulcrum.state.eplb import EplbState
from fulcrum.state.eplb_store import group_key
from fulcrum.testing import running_server
from fulcrum.v1 import expert_pb2 as pb

LAYERS, EXPERTS, EP = 6, 32, 4


def tensor(a: npt.NDArray[Any]) -> pb.Tensor:
    arr = np.ascontiguousarray(a)
    return pb.Tensor(dtype=arr.dtype.name, shape=list(arr.shape), data=arr.tobytes())


def array(t: pb.Tensor) -> npt.NDArray[Any]:
    return np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape))


def register_request(gid: str = "g1", **kw: Any) -> pb.RegisterGroupRequest:
    args: dict[str, Any] = {
        "group_id": gid,
        "role": pb.GROUP_ROLE_PREFILL,
        "ep_size": EP,
        "gpus_per_node": 8,
        "num_layers": LAYERS,
        "num_experts": EXPERTS,
        "window_steps": 20,
        "period_steps": 40,
        "expert_bytes": 1 << 20,
    }
    args.update(kw)
    return pb.RegisterGroupRequest(**args)


def skewed(seed: int, steps: int = 10) -> npt.NDArray[np.int64]:
    """Poisson loads (seed) of one fixed skewed popularity: successive reports are samples
    of the same routing, as in a deployment."""
    pop = np.random.default_rng(0).lognormal(0.0, 1.0, size=(LAYERS, EXPERTS))
    return np.random.default_rng(seed).poisson(pop * 50 * steps).astype(np.int64)


def report(version: int, begin: int, end: int, load: npt.NDArray[Any], gid: str = "g1") -> Any:
    return pb.ReportLoadRequest(
        group_id=gid, map_version=version, step_begin=begin, step_end=end, load=tensor(load)
    )


def check_map(m: pb.ExpertMap) -> npt.NDArray[Any]:
    phy = array(m.physical_to_logical)
    assert phy.shape[0] == LAYERS
    counts = array(m.replica_counts)
    assert (counts >= 1).all()
    gpu = phy.reshape(LAYERS, m.ep_size, m.slots_per_gpu)
    s = np.sort(gpu, axis=-1)
    if m.algorithm != "reference":
        assert not (s[..., 1:] == s[..., :-1]).any(), "co-located replicas"
    l2p = array(m.logical_to_physical)
    assert (np.sum(l2p >= 0, axis=-1) == counts).all()
    return phy


def map_file(snap: Path, gid: str = "g1") -> Path:
    return snap / (group_key(gid) + ".map.json")


def window_file(snap: Path, gid: str = "g1") -> Path:
    return snap / (group_key(gid) + ".window.npz")


async def code_of(coro: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code()


def state(daemon: Daemon) -> EplbState:
    s = daemon.app.components["eplb"]
    assert isinstance(s, EplbState)
    return s


async def test_register_sizes_the_worked_example(client: FulcrumClient) -> None:
    reply = await client.expert.RegisterGroup(
        pb.RegisterGroupRequest(
            group_id="decode-ep64",
            role=pb.GROUP_ROLE_DECODE,
            ep_size=64,
            gpus_per_node=8,
            num_layers=3,
            num_experts=384,
            expert_bytes=44 << 20,
        )
    )
    s = reply.shape
    assert (s.num_physical, s.slots_per_gpu, s.window_steps, s.period_steps) == (
        448,
        7,
        1000,
        10000,
    )
    assert reply.map_version == 1 and reply.created
    prefill = await client.expert.RegisterGroup(
        pb.RegisterGroupRequest(
            group_id="prefill-ep4",
            role=pb.GROUP_ROLE_PREFILL,
            ep_size=4,
            num_layers=3,
            num_experts=384,
            redundant_per_gpu=8,
            expert_bytes=1,
        )
    )
    assert (prefill.shape.num_physical, prefill.shape.slots_per_gpu) == (416, 104)
    assert (prefill.shape.window_steps, prefill.shape.period_steps) == (100, 1000)
    got = await client.expert.GetMap(pb.GetMapRequest(group_id="decode-ep64"))
    assert got.map.version == 1 and got.map.algorithm == "initial"
    phy = array(got.map.physical_to_logical)
    assert phy.shape == (3, 448)
    assert (array(got.map.replica_counts) >= 1).all()


async def test_register_is_idempotent_and_refuses_another_shape(client: FulcrumClient) -> None:
    first = await client.expert.RegisterGroup(register_request())
    again = await client.expert.RegisterGroup(register_request())
    assert first.created and not again.created and again.map_version == 1
    assert (
        await code_of(client.expert.RegisterGroup(register_request(ep_size=8)))
        == grpc.StatusCode.ALREADY_EXISTS
    )


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"role": pb.GROUP_ROLE_UNSPECIFIED}, "role"),
        ({"ep_size": 0}, "ep_size"),
        ({"ep_size": 12}, "ep_size"),
        ({"num_experts": 30, "num_expert_groups": 4}, "num_expert_groups"),
        ({"expert_bytes": 0}, "expert_bytes"),
        ({"group_id": ""}, "group_id"),
        ({"initial_map": pb.Tensor(dtype="int32", shape=[LAYERS, 3], data=b"\0" * 72)}, "shape"),
        ({"initial_map": pb.Tensor(dtype="uint8", shape=[1], data=b"\0")}, "dtype"),
    ],
)
async def test_register_rejects_invalid_groups(
    client: FulcrumClient, kw: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.expert.RegisterGroup(register_request(**kw))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (err.value.details() or "")


async def test_bad_reports_change_nothing(daemon: Daemon, client: FulcrumClient) -> None:
    await client.expert.RegisterGroup(register_request())
    ok = await client.expert.ReportLoad(report(1, 0, 10, skewed(1)))
    assert ok.map_version == 1 and ok.window_steps == 10 and ok.observed_moe_lb >= 1.0
    before = await client.expert.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g1"))
    bad = [
        (report(1, 10, 20, skewed(2), gid="nope"), grpc.StatusCode.NOT_FOUND),
        (report(1, 10, 20, skewed(2)[:, :-1]), grpc.StatusCode.INVALID_ARGUMENT),
        (report(2, 10, 20, skewed(2)), grpc.StatusCode.FAILED_PRECONDITION),  # unknown version
        (report(0, 10, 20, skewed(2)), grpc.StatusCode.INVALID_ARGUMENT),
        (report(1, 5, 20, skewed(2)), grpc.StatusCode.FAILED_PRECONDITION),  # goes backwards
        (report(1, 20, 20, skewed(2)), grpc.StatusCode.INVALID_ARGUMENT),  # empty range
        (report(1, 10, 20, -skewed(2)), grpc.StatusCode.INVALID_ARGUMENT),
        (report(1, 10, 20, np.full((LAYERS, EXPERTS), np.nan)), grpc.StatusCode.INVALID_ARGUMENT),
        (
            pb.ReportLoadRequest(group_id="g1", map_version=1, step_begin=10, step_end=20),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.ReportLoadRequest(
                group_id="g1",
                map_version=1,
                step_begin=10,
                step_end=20,
                load=pb.Tensor(dtype="int64", shape=[LAYERS, EXPERTS], data=b"\0" * 8),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for request, code in bad:
        assert await code_of(client.expert.ReportLoad(request)) == code, request.group_id
    after = await client.expert.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g1"))
    assert after == before
    assert state(daemon).get("g1").last_step_end == 10


async def test_packed_values_and_tensor_are_the_same_report(client: FulcrumClient) -> None:
    await client.expert.RegisterGroup(register_request("a"))
    await client.expert.RegisterGroup(register_request("b"))
    load = skewed(3)
    ra = await client.expert.ReportLoad(report(1, 0, 10, load, gid="a"))
    rb = await client.expert.ReportLoad(
        pb.ReportLoadRequest(
            group_id="b", map_version=1, step_begin=0, step_end=10, load_values=load.ravel()
        )
    )
    assert ra.observed_moe_lb == rb.observed_moe_lb


async def test_periodic_rebalance_publishes_new_versions(
    daemon: Daemon, client: FulcrumClient
) -> None:
    await client.expert.RegisterGroup(register_request())
    version, step = 1, 0
    replies = []
    for i in range(4):  # period 40 steps = 4 reports of 10
        reply = await client.expert.ReportLoad(report(version, step, step + 10, skewed(10 + i)))
        replies.append(reply)
        step += 10
    assert [r.rebalanced for r in replies] == [False, False, False, True]
    assert replies[-1].map_version == 2
    assert replies[-1].steps_to_rebalance == 40
    new = (await client.expert.GetMap(pb.GetMapRequest(group_id="g1", version=2))).map
    old = (await client.expert.GetMap(pb.GetMapRequest(group_id="g1", version=1))).map
    current = (await client.expert.GetMap(pb.GetMapRequest(group_id="g1"))).map
    assert current == new and new.algorithm == "stable"
    assert new.predicted_moe_lb < 1.2 and new.slots_changed > 0 and new.bytes_moved > 0
    check_map(new)
    check_map(old)
    # steps measured under the previous version still count, under the version in force
    late = await client.expert.ReportLoad(report(1, step, step + 10, skewed(20)))
    assert late.map_version == 2 and late.counted_map_version == 2
    step += 10
    # a version that was never in force, or older than the previous one, is refused
    future = report(3, step, step + 10, skewed(21))
    assert await code_of(client.expert.ReportLoad(future)) == grpc.StatusCode.FAILED_PRECONDITION
    ok = await client.expert.ReportLoad(report(2, step, step + 10, skewed(21)))
    assert ok.map_version == 2 and ok.counted_map_version == 2
    assert (
        await code_of(client.expert.GetMap(pb.GetMapRequest(group_id="g1", version=9)))
        == grpc.StatusCode.NOT_FOUND
    )
    rebal = REGISTRY.get_sample_value(
        "fulcrum_eplb_rebalances_total",
        {"algorithm": "stable", "trigger": "period", "outcome": "applied"},
    )
    assert rebal is not None and rebal >= 1


async def test_watch_gets_current_then_each_new_version(client: FulcrumClient) -> None:
    await client.expert.RegisterGroup(register_request())
    call = client.expert.WatchMaps(pb.WatchMapsRequest(group_id="g1"))
    first = await asyncio.wait_for(call.read(), 10)
    assert first.map.version == 1
    await client.expert.ReportLoad(report(1, 0, 10, skewed(4)))
    forced = await client.expert.Rebalance(pb.RebalanceRequest(group_id="g1"))
    assert forced.applied and forced.map.version == 2
    assert forced.predicted_moe_lb_before > forced.map.predicted_moe_lb
    second = await asyncio.wait_for(call.read(), 10)
    assert second.map == forced.map
    # a reference rebalance from the new map, then deregistration ends the stream
    ref = await client.expert.Rebalance(pb.RebalanceRequest(group_id="g1", algorithm="reference"))
    third = await asyncio.wait_for(call.read(), 10)
    assert third.map.version == ref.map.version == 3 and third.map.algorithm == "reference"
    await client.expert.DeregisterGroup(pb.DeregisterGroupRequest(group_id="g1"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call.read(), 10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_forced_rebalance_errors_and_dry_run(client: FulcrumClient) -> None:
    await client.expert.RegisterGroup(register_request())
    rebalance = client.expert.Rebalance
    assert (
        await code_of(rebalance(pb.RebalanceRequest(group_id="g1")))
        == grpc.StatusCode.FAILED_PRECONDITION
    )  # no load yet
    assert await code_of(rebalance(pb.RebalanceRequest(group_id="zz"))) == grpc.StatusCode.NOT_FOUND
    await client.expert.ReportLoad(report(1, 0, 10, skewed(5)))
    assert (
        await code_of(rebalance(pb.RebalanceRequest(group_id="g1", algorithm="magic")))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    dry = await rebalance(pb.RebalanceRequest(group_id="g1", dry_run=True))
    assert not dry.applied and dry.map.slots_changed > 0 and dry.compute_seconds > 0
    current = (await client.expert.GetMap(pb.GetMapRequest(group_id="g1"))).map
    assert current.version == 1
    real = await rebalance(pb.RebalanceRequest(group_id="g1"))
    assert real.applied and real.map.version == 2
    assert np.array_equal(array(real.map.physical_to_logical), array(dry.map.physical_to_logical))
    # same window, same loads: the stable map is a fixed point -> no new version
    again = await rebalance(pb.RebalanceRequest(group_id="g1"))
    assert not again.applied and again.map.version == 2


async def test_group_bound_and_deregistration() -> None:
    over = {"eplb": {"max_groups": 1, "retry_after_ms": 250}}
    async with running_server(over) as d, FulcrumClient(d.address) as c:
        await c.expert.RegisterGroup(register_request("one"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.expert.RegisterGroup(register_request("two"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.value.trailing_metadata() or ())
        assert trailers.get(RETRY_AFTER_KEY) == "250"
        await c.expert.DeregisterGroup(pb.DeregisterGroupRequest(group_id="one"))
        assert (
            await code_of(c.expert.GetMap(pb.GetMapRequest(group_id="one")))
            == grpc.StatusCode.NOT_FOUND
        )
        await c.expert.RegisterGroup(register_request("two"))


async def test_restart_restores_the_map_in_force(tmp_path: Path) -> None:
    snap = tmp_path / "eplb" / "maps"
    overrides = {"eplb": {"snapshot_path": str(snap)}}
    async with running_server(overrides) as d1, FulcrumClient(d1.address) as c:
        await c.expert.RegisterGroup(register_request())
        await c.expert.ReportLoad(report(1, 0, 10, skewed(6)))
        forced = await c.expert.Rebalance(pb.RebalanceRequest(group_id="g1"))
        assert forced.map.version == 2
    assert map_file(snap).exists()
    async with running_server(overrides) as d2, FulcrumClient(d2.address) as c:
        got = (await c.expert.GetMap(pb.GetMapRequest(group_id="g1"))).map
        assert got.version == 2
        assert got.physical_to_logical == forced.map.physical_to_logical
        # the engines keep reporting under version 2; no reshuffle on restart
        ok = await c.expert.ReportLoad(report(2, 10, 20, skewed(7)))
        assert ok.map_version == 2
        again = await c.expert.RegisterGroup(register_request())
        assert not again.created and again.map_version == 2


async def test_unreadable_snapshot_is_moved_aside(tmp_path: Path) -> None:
    snap = tmp_path / "maps"
    snap.write_text("{not json")  # a file where the directory should be
    async with running_server({"eplb": {"snapshot_path": str(snap)}}) as d:
        assert state(d).groups == {}
    assert (tmp_path / "maps.corrupt").exists()


async def test_full_size_decode_group_rebalances_through_the_daemon(client: FulcrumClient) -> None:
    """58 layers x 384 experts at EP64 (448 slots): the sizes of the worked example."""
    await client.expert.RegisterGroup(
        pb.RegisterGroupRequest(
            group_id="big",
            role=pb.GROUP_ROLE_DECODE,
            ep_size=64,
            num_layers=58,
            num_experts=384,
            period_steps=2000,
            expert_bytes=3 * 7168 * 2048,
        )
    )
    rng = np.random.default_rng(9)
    pop = rng.lognormal(0.0, 0.9, size=(58, 384))
    pop /= pop.sum(axis=1, keepdims=True)
    replies = []
    for i in range(2):
        load = rng.poisson(pop * 1000 * 64 * 32 * 8).astype(np.int64)
        replies.append(
            await client.expert.ReportLoad(
                pb.ReportLoadRequest(
                    group_id="big",
                    map_version=1,
                    step_begin=1000 * i,
                    step_end=1000 * (i + 1),
                    load=tensor(load),
                )
            )
        )
    assert replies[0].observed_moe_lb > 1.5  # the identity map is badly balanced
    assert replies[1].rebalanced and replies[1].map_version == 2
    new = (await client.expert.GetMap(pb.GetMapRequest(group_id="big"))).map
    assert array(new.physical_to_logical).shape == (58, 448)
    assert new.predicted_moe_lb < replies[0].observed_moe_lb
    phy = array(new.physical_to_logical).reshape(58, 64, 7)
    s = np.sort(phy, axis=-1)
    assert not (s[..., 1:] == s[..., :-1]).any()
    assert (array(new.replica_counts) >= 1).all()


async def test_restart_resumes_the_window_and_the_period(tmp_path: Path) -> None:
    """The window and the period counter survive a restart (written at drain)."""
    snap = tmp_path / "maps"
    overrides = {"eplb": {"snapshot_path": str(snap), "window_snapshot_interval_s": 0}}
    async with running_server(overrides) as d1, FulcrumClient(d1.address) as c:
        await c.expert.RegisterGroup(register_request())  # window 20 steps, period 40
        await c.expert.ReportLoad(report(1, 0, 15, skewed(6, 15)))
        before = await c.expert.ReportLoad(report(1, 15, 30, skewed(7, 15)))
        assert before.steps_to_rebalance == 10 and not before.rebalanced
        window_before = state(d1).groups["g1"].window_sum.copy()  # type: ignore[union-attr]
    assert window_file(snap).exists()
    async with running_server(overrides) as d2, FulcrumClient(d2.address) as c:
        g = state(d2).groups["g1"]
        assert g.steps_since_rebalance == 30 and g.last_step_end == 30
        assert np.array_equal(g.window_sum, window_before)  # type: ignore[arg-type]
        # step ranges still may not go backwards across the restart
        assert (
            await code_of(c.expert.ReportLoad(report(1, 20, 25, skewed(8, 5))))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        # the period continues: 10 more steps complete it (not 40)
        done = await c.expert.ReportLoad(report(1, 30, 40, skewed(8, 10)))
        assert done.rebalanced and done.map_version == 2


async def test_window_snapshot_of_another_shape_is_ignored(tmp_path: Path) -> None:
    snap = tmp_path / "maps"
    overrides = {"eplb": {"snapshot_path": str(snap), "window_snapshot_interval_s": 0}}
    async with running_server(overrides) as d1, FulcrumClient(d1.address) as c:
        await c.expert.RegisterGroup(register_request())
        await c.expert.ReportLoad(report(1, 0, 10, skewed(6)))
    # another bucket size: the maps are restored, the window is not
    other = {"eplb": {**overrides["eplb"], "window_buckets": 4}}
    async with running_server(other) as d2:
        g = state(d2).groups["g1"]
        assert g.current.version == 1 and g.window_steps == 0 and g.last_step_end == 0
    window_file(snap).write_bytes(b"not a zip")
    async with running_server(overrides) as d3:
        assert state(d3).groups["g1"].window_steps == 0
    assert window_file(snap).with_name(window_file(snap).name + ".corrupt").exists()
