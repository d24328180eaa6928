"""Prefill service: clear answers to bad calls, and reloads that apply for real."""

from __future__ import annotations

import re

import grpc
import pytest

from fulcrum.v1 import fleet_pb2, prefill_pb2
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
)

S = 1_000_000_000


async def test_unknown_engine_is_named_engine_id() -> None:
    async with prefill_daemon() as (_, c, _st):
        calls = [
            c.prefill.Pull(pull_request("ghost", 0, S, wait_ms=0)),
            c.prefill.ReportStepTimes(
                prefill_pb2.ReportStepTimesRequest(
                    engine_id="ghost", samples=[prefill_pb2.StepSample(q=1, c=0, measured_ns=1)]
                )
            ),
            c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest(engine_id="ghost")),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            details = err.value.details() or ""
            assert details.startswith("engine_id:") and "member_id" not in details


async def test_refused_pull_is_not_a_heartbeat() -> None:
    async with prefill_daemon() as (d, c, _st):
        reply = await c.fleet.Register(
            fleet_pb2.RegisterRequest(
                member_id="dec-1",
                decode_instance=fleet_pb2.DecodeInstanceShape(
                    gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=1000)]
                ),
            )
        )
        entry = d.app.fleet._members["dec-1"]
        seen = d.app.clock() - 1_000_000_000  # as if last heard of a second ago
        entry.last_seen_ns = seen
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("dec-1", reply.incarnation, S, wait_ms=0))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "not a registered prefill engine" in (err.value.details() or "")
        assert d.app.fleet._members["dec-1"].last_seen_ns == seen


async def test_step_samples_bounded_before_conversion() -> None:
    async with prefill_daemon({"prefill": {"refit": {"max_samples_per_report": 4}}}) as (
        _, c, st
    ):
        inc = await register(c, "e1")
        sample = prefill_pb2.StepSample(q=10, c=0, measured_ns=1_000)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.ReportStepTimes(
                prefill_pb2.ReportStepTimesRequest(engine_id="e1", samples=[sample] * 5)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "samples: must have at most 4 entries" in (err.value.details() or "")
        ok = await c.prefill.ReportStepTimes(
            prefill_pb2.ReportStepTimesRequest(engine_id="e1", samples=[sample] * 4)
        )
        assert ok.accepted == 4
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(pull_request("e1", inc, S, loads=[0] * 100_000, wait_ms=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rank_loads_ns" in (err.value.details() or "")
        del st


async def test_reload_shortens_the_submit_wait_and_the_chunk_size() -> None:
    async with prefill_daemon({"prefill": {"submit_wait_ms": 30_000}}) as (d, c, st):
        await register(c, "e1")  # an engine that never pulls: submits wait their whole time
        new = d.app.settings.prefill.model_copy(
            update={"submit_wait_ms": 50, "max_chunk_tokens": 4_096}
        )
        for hook in d.app.reload_hooks:
            hook(d.app.settings.model_copy(update={"prefill": new}))
        assert st.settings.submit_wait_ms == 50
        call = c.prefill.Submit(
            prefill_pb2.SubmitRequest(request_id="r1", total_tokens=1_000)  # default wait
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = err.value.details() or ""
        match = re.search(r"no engine took the request in (\d+) ms", details)
        assert match is not None, details
        assert int(match.group(1)) < 30_000  # the new 50 ms wait, not the old 30 s
        assert not st.is_queued("r1")
        cm = await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        assert cm.max_chunk_tokens == 4_096
