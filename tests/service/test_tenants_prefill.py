"""Prefill Submit with a class, through a real gRPC channel (issue 23): the class reaches
the core queue (bands are pulled first), a sheddable class that cannot meet its
deadline is refused at once with retry-after-ms, and the per-tenant metrics follow."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until
from tests.service.test_decode_reload import reload
from tests.service.test_server import scrape

S = 1_000_000_000
TENANTS: dict[str, Any] = {
    "tenants": {
        "classes": {"gold": {"weight": 3.0}, "batch": {"sheddable": True}},
        "sheddable_priorities": [-1],
    }
}


def submit(request_id: str, total: int = 1000, wait_ms: int = 20_000,
           **fields: Any) -> prefill_pb2.SubmitRequest:
    return prefill_pb2.SubmitRequest(request_id=request_id, total_tokens=total,
                                     max_wait_ms=wait_ms, **fields)


def sample(d: Any, name: str, **labels: str) -> float:
    return scrape(d).get((name, tuple(sorted(labels.items()))), 0.0)


async def test_higher_band_is_pulled_first() -> None:
    async with prefill_daemon(TENANTS) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=1)
        low = asyncio.ensure_future(c.prefill.Submit(submit("low", tenant="gold")))
        await until(lambda: st.queue_depths()[0] == 1)
        high = asyncio.ensure_future(c.prefill.Submit(submit("high", priority=2)))
        await until(lambda: st.queue_depths()[0] == 2)
        order = []
        for _ in range(2):
            batch = await c.prefill.Pull(pull_request("e1", inc, 100 * S, [0], max_requests=1))
            order += [r.request_id for r in batch.requests]
        assert order == ["high", "low"]
        assert (await high).engine_id == "e1" and (await low).engine_id == "e1"


@pytest.mark.parametrize("fields", [{"tenant": "batch"}, {"priority": -1}],
                         ids=["sheddable tenant", "sheddable band"])
async def test_sheddable_class_missing_its_deadline_is_refused_at_once(
    fields: dict[str, Any],
) -> None:
    async with prefill_daemon(TENANTS) as (d, c, st):
        await register(c, "e1", dp_ranks=1)
        label = "batch" if fields.get("tenant") == "batch" else "default"
        before = sample(d, "fulcrum_tenant_shed_total", balancer="prefill", tenant=label,
                        reason="deadline")
        # 1 ms cannot hold even the request's own predicted cost.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit("late", ttft_slo_ms=1, **fields))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(err.value.trailing_metadata() or ())
        assert int(trailing["retry-after-ms"]) >= 1
        assert st.queue_depths() == [0, 0, 0, 0]  # never queued
        after = sample(d, "fulcrum_tenant_shed_total", balancer="prefill", tenant=label,
                       reason="deadline")
        assert after == before + 1
        # The same deadline in a class that is not sheddable queues (the default never
        # sheds on a prediction).
        kept = asyncio.ensure_future(c.prefill.Submit(submit("kept", ttft_slo_ms=1)))
        await until(lambda: st.queue_depths()[0] == 1)
        kept.cancel()
        await until(lambda: st.queue_depths()[0] == 0)


async def test_per_tenant_metrics_follow_queue_and_delivery() -> None:
    async with prefill_daemon(TENANTS) as (d, c, st):
        inc = await register(c, "e1", dp_ranks=1)
        before = {t: sample(d, "fulcrum_tenant_prefill_compute_seconds_total", tenant=t)
                  for t in ("gold", "other")}
        misses = sample(d, "fulcrum_tenant_deadline_misses_total", balancer="prefill",
                        tenant="gold")
        waits = sample(d, "fulcrum_tenant_prefill_wait_seconds_count", tenant="other")
        gold = asyncio.ensure_future(c.prefill.Submit(submit("g", tenant="gold",
                                                             ttft_slo_ms=1)))
        anon = asyncio.ensure_future(c.prefill.Submit(submit("u", 2000, tenant="u-123")))
        await until(lambda: st.queue_depths()[0] == 2)
        assert sample(d, "fulcrum_tenant_prefill_queue_depth", tenant="gold") == 1
        assert sample(d, "fulcrum_tenant_prefill_queue_depth", tenant="other") == 1
        assert sample(d, "fulcrum_tenant_prefill_queued_compute_seconds", tenant="other") > 0
        await c.prefill.Pull(pull_request("e1", inc, 100 * S, [0]))
        g, u = await gold, await anon
        after = {t: sample(d, "fulcrum_tenant_prefill_compute_seconds_total", tenant=t)
                 for t in ("gold", "other")}
        assert after["gold"] - before["gold"] == pytest.approx(g.predicted_cost_ns / S)
        assert after["other"] - before["other"] == pytest.approx(u.predicted_cost_ns / S)
        assert sample(d, "fulcrum_tenant_prefill_queue_depth", tenant="gold") == 0
        assert sample(d, "fulcrum_tenant_prefill_queue_depth", tenant="other") == 0
        assert sample(d, "fulcrum_tenant_prefill_wait_seconds_count", tenant="other") == waits + 1
        # gold asked for 1 ms: wait + its own cost is more, a miss (it was not sheddable)
        assert sample(d, "fulcrum_tenant_deadline_misses_total", balancer="prefill",
                      tenant="gold") == misses + 1
        # the unknown tenant is never its own label
        assert not any(dict(lb).get("tenant") == "u-123" for _, lb in scrape(d))


async def test_reloaded_tenants_apply_to_the_next_submit() -> None:
    async with prefill_daemon() as (d, c, st):
        await register(c, "e1", dp_ranks=1)
        kept = asyncio.ensure_future(c.prefill.Submit(submit("k", tenant="t", ttft_slo_ms=1)))
        await until(lambda: st.queue_depths()[0] == 1)
        reload(d, {"tenants": {"classes": {"t": {"sheddable": True, "weight": 2.0}}}})
        assert st.balancer.config.tenants.classes["t"].weight == 2.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Submit(submit("s", tenant="t", ttft_slo_ms=1))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        kept.cancel()
        await until(lambda: st.queue_depths()[0] == 0)
