"""Operator logs through real gRPC calls (structlog output captured): refusals summarised
at info, one line per membership change, unchanged periodic EPLB rebalances logged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from fulcrum.client import FulcrumClient
from fulcrum.logs import RefusalSummary
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import expert_pb2 as epb
from fulcrum.v1 import fleet_pb2 as pb

INFO: dict[str, Any] = {"logging": {"level": "info", "refusal_summary_interval_s": 3600.0}}


@pytest.fixture
async def info_daemon() -> AsyncIterator[Daemon]:
    """A daemon logging at info (the default level) with a long summary interval: the
    test decides when the summary is written."""
    async with running_server(INFO) as d:
        yield d


@pytest.fixture
async def info_client(info_daemon: Daemon) -> AsyncIterator[FulcrumClient]:
    async with FulcrumClient(info_daemon.address, timeout_s=10.0) as c:
        yield c


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def refused(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def decode_instance(member_id: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        member_id=member_id,
        decode_instance=pb.DecodeInstanceShape(
            gpus=[pb.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=1_000)]
        ),
    )


# -- refusals ----------------------------------------------------------------------------


async def test_refusals_are_summarised_at_info_by_method_and_code(
    info_daemon: Daemon, info_client: FulcrumClient
) -> None:
    summary = info_daemon.app.components["refusals"]
    assert isinstance(summary, RefusalSummary)
    loop = asyncio.get_running_loop()
    with capture_logs() as logs:
        for _ in range(3):
            code = await refused(
                info_client.fleet.Heartbeat(pb.HeartbeatRequest(member_id="ghost", incarnation=1))
            )
            assert code == grpc.StatusCode.NOT_FOUND
        code = await refused(info_client.fleet.ListMembers(pb.ListMembersRequest(page_size=5000)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        await info_client.fleet.ListMembers(pb.ListMembersRequest())  # OK: not counted
        # nothing yet: the line is due one interval after the first refusal
        assert events(logs, "calls_refused") == []
        assert summary.due_at is not None and summary.due_at >= loop.time() + 3000
        summary.flush()  # what the timer does when the interval has passed
        summary.flush()  # nothing refused since: no line
    [line] = events(logs, "calls_refused")
    assert line["log_level"] == "info"
    assert line["total"] == 4
    assert line["by_method"] == {
        "FleetService/Heartbeat": {"NOT_FOUND": 3},
        "FleetService/ListMembers": {"INVALID_ARGUMENT": 1},
    }
    assert line["interval_s"] == 3600.0
    assert summary.due_at is None  # nothing pending until the next refusal


async def test_the_summary_timer_writes_the_line_by_itself() -> None:
    async with (
        running_server({"logging": {"level": "info", "refusal_summary_interval_s": 0.1}}) as d,
        FulcrumClient(d.address, timeout_s=10.0) as c,
    ):
        loop = asyncio.get_running_loop()
        with capture_logs() as logs:
            for _ in range(5):
                await refused(c.fleet.Heartbeat(pb.HeartbeatRequest(member_id="x")))
            deadline = loop.time() + 10
            # bounded poll, no fixed sleep: the timer may fire between two refusals, so
            # the five can come in more than one line
            while sum(e["total"] for e in events(logs, "calls_refused")) < 5:
                assert loop.time() < deadline, "no summary line for all five refusals"
                await asyncio.sleep(0.01)
        lines = events(logs, "calls_refused")
        assert sum(e["total"] for e in lines) == 5
        assert all(e["by_method"].keys() == {"FleetService/Heartbeat"} for e in lines)


async def test_no_summary_at_warning_level(daemon: Daemon, client: FulcrumClient) -> None:
    with capture_logs() as logs:
        await refused(client.fleet.Heartbeat(pb.HeartbeatRequest(member_id="x")))
        daemon.app.components["refusals"].flush()
    assert events(logs, "calls_refused") == []  # the test daemon logs at warning


# -- membership: one line per change -----------------------------------------------------


async def test_each_join_and_leave_is_logged_once(
    info_daemon: Daemon, info_client: FulcrumClient
) -> None:
    c = info_client
    with capture_logs() as logs:
        dec = await c.fleet.Register(decode_instance("dec-0"))
        ve = await c.fleet.Register(
            pb.RegisterRequest(member_id="ve-0", vision_machine=pb.VisionMachineShape(gpus=1))
        )
        pf = await c.fleet.Register(
            pb.RegisterRequest(member_id="pf-0", prefill_engine=pb.PrefillEngineShape(dp_ranks=1))
        )
        for mid, reply in (("dec-0", dec), ("ve-0", ve), ("pf-0", pf)):
            await c.fleet.Deregister(
                pb.DeregisterRequest(member_id=mid, incarnation=reply.incarnation)
            )
    member_lines = [
        (e["event"], e.get("instance_id") or e.get("machine_id") or e.get("engine_id"))
        for e in logs
        if e["event"].endswith(("_joined", "_left", "_rejoined", "_lapsed"))
    ]
    assert member_lines == [
        ("decode_instance_joined", "dec-0"),
        ("vision_machine_joined", "ve-0"),
        ("prefill_engine_joined", "pf-0"),
        ("decode_instance_left", "dec-0"),
        ("vision_machine_left", "ve-0"),
        ("prefill_engine_left", "pf-0"),
    ]
    assert all(e["log_level"] == "info" for e in logs if e["event"].endswith(("_joined", "_left")))
    left = {e["event"]: e["reason"] for e in logs if e["event"].endswith("_left")}
    assert set(left.values()) == {"deregistered"}


async def test_a_lapse_is_logged_once_with_its_reason(info_daemon: Daemon) -> None:
    now = [10**12]
    info_daemon.app.clock = lambda: now[0]
    async with FulcrumClient(info_daemon.address, timeout_s=10.0) as c:
        with capture_logs() as logs:
            await c.fleet.Register(decode_instance("dec-0"))
            now[0] += 6_000_000_000  # past the 5 s timeout
            # found lapsed on access (before any sweep), then swept: one line in all
            await refused(c.fleet.Heartbeat(pb.HeartbeatRequest(member_id="dec-0", incarnation=1)))
            info_daemon.app.fleet.expire(now[0])
    left = [e for e in logs if e["event"].endswith(("_left", "_lapsed"))]
    assert [(e["event"], e["reason"]) for e in left] == [("decode_instance_left", "lapsed")]


# -- EPLB: an unchanged periodic rebalance is logged -----------------------------------------


LAYERS, EXPERTS, EP = 4, 16, 4


def _tensor(a: np.ndarray) -> epb.Tensor:
    return epb.Tensor(dtype=a.dtype.name, shape=list(a.shape), data=a.tobytes())


async def test_unchanged_periodic_rebalance_is_logged_once_at_info(
    info_client: FulcrumClient,
) -> None:
    c = info_client
    await c.expert.RegisterGroup(
        epb.RegisterGroupRequest(
            group_id="g1", role=epb.GROUP_ROLE_PREFILL, ep_size=EP, gpus_per_node=8,
            num_layers=LAYERS, num_experts=EXPERTS, window_steps=20, period_steps=20,
            expert_bytes=1 << 20,
        )
    )
    pop = np.random.default_rng(0).lognormal(0.0, 1.0, size=(LAYERS, EXPERTS))
    load = np.rint(pop * 500).astype(np.int64)  # the same routing every 10 steps

    def report(version: int, begin: int) -> epb.ReportLoadRequest:
        return epb.ReportLoadRequest(
            group_id="g1", map_version=version, step_begin=begin, step_end=begin + 10,
            load=_tensor(load),
        )

    await c.expert.ReportLoad(report(1, 0))
    applied = await c.expert.Rebalance(epb.RebalanceRequest(group_id="g1"))
    assert applied.applied and applied.map.version == 2
    with capture_logs() as logs:
        replies = [await c.expert.ReportLoad(report(2, step)) for step in (10, 20)]
    # the period (20 steps) came due: the stable map is a fixed point of the same loads
    assert [r.rebalanced for r in replies] == [False, False]
    assert replies[-1].map_version == 2
    [line] = events(logs, "eplb_map_unchanged")
    assert line["log_level"] == "info" and line["trigger"] == "period"
    assert line["group"] == "g1" and line["version"] == 2
    assert line["moe_lb_predicted"] >= 1.0 and line["moe_lb_current"] >= 1.0
    assert events(logs, "eplb_map_changed") == []


async def test_a_periodic_rebalance_failing_the_same_way_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, info_client: FulcrumClient
) -> None:
    from fulcrum.service import eplb as service_eplb

    c = info_client
    await c.expert.RegisterGroup(
        epb.RegisterGroupRequest(
            group_id="g1", role=epb.GROUP_ROLE_PREFILL, ep_size=EP, gpus_per_node=8,
            num_layers=LAYERS, num_experts=EXPERTS, window_steps=20, period_steps=20,
            expert_bytes=1 << 20,
        )
    )
    load = np.rint(np.random.default_rng(1).lognormal(0, 1, (LAYERS, EXPERTS)) * 500)
    tensor = _tensor(load.astype(np.int64))
    calls = 0

    def broken(job: Any, dry_run: bool) -> Any:
        nonlocal calls
        calls += 1
        raise ValueError("solver diverged")

    monkeypatch.setattr(service_eplb, "_compute", broken)
    with capture_logs() as logs:
        for step in range(0, 50, 10):  # due from the 2nd report on; it stays due
            reply = await c.expert.ReportLoad(
                epb.ReportLoadRequest(
                    group_id="g1", map_version=1, step_begin=step, step_end=step + 10,
                    load=tensor,
                )
            )
            assert not reply.rebalanced
    assert calls == 4  # every due report tried again ...
    [line] = events(logs, "eplb_periodic_rebalance_skipped")  # ... and it was logged once
    assert "solver diverged" in line["error"] and line["group"] == "g1"
    assert events(logs, "eplb_rebalance_failed") == []
