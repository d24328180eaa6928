"""Fair-share precedence through a real gRPC channel (issue 23): a tenant under its fair
share is pulled past an engine full of another tenant's work with ``boosted`` set, the
engine kit runs it ahead of that work and reports the half band's loads
(``BandRankLoads.boosted``); bad band loads are refused and change nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from fulcrum.core.prefill.bands import PRECEDENCE
from fulcrum.metrics import REGISTRY
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until

S = 1_000_000_000
# The heavy tenant's share is 1% of the fleet (2 ranks x the 10 s window: 0.2 s), so one
# 15,000-token prompt (about 1 s) puts it over; the light one's is 99%.
CONFIG = {"prefill": {"pull_wait_ms": 0},
          "tenants": {"classes": {"heavy": {"weight": 1.0}, "light": {"weight": 99.0}}}}


def submit(rid: str, tenant: str, total: int = 2_000) -> prefill_pb2.SubmitRequest:
    return prefill_pb2.SubmitRequest(request_id=rid, total_tokens=total, tenant=tenant,
                                     max_wait_ms=20_000)


def banded(engine_id: str, inc: int, loads: list[int],
           bands: list[tuple[int, bool, list[int]]]) -> prefill_pb2.PullRequest:
    req = pull_request(engine_id, inc, 0, loads, wait_ms=0)
    req.band_rank_loads.extend(prefill_pb2.BandRankLoads(priority=p, boosted=b, rank_loads_ns=row)
                               for p, b, row in bands)
    return req


async def _heavy_served(c: Any, st: Any, engine_id: str, inc: int) -> None:
    h0 = asyncio.ensure_future(c.prefill.Submit(submit("h0", "heavy", total=15_000)))
    await until(lambda: st.queue_depths()[0] == 1)
    got = await c.prefill.Pull(pull_request(engine_id, inc, 20 * S, [0, 0], wait_ms=0))
    assert [r.request_id for r in got.requests] == ["h0"] and not got.requests[0].boosted
    await h0


async def test_a_tenant_under_its_share_is_pulled_past_a_full_engine_with_precedence() -> None:
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        await _heavy_served(c, st, "e1", inc)
        h1 = asyncio.ensure_future(c.prefill.Submit(submit("h1", "heavy")))
        await until(lambda: st.queue_depths()[0] == 1)
        l1 = asyncio.ensure_future(c.prefill.Submit(submit("l1", "light")))
        await until(lambda: st.queue_depths()[0] == 2)
        full = [2 * S, 3 * S]  # far past the late-binding horizon, none of it boosted
        before = REGISTRY.get_sample_value("fulcrum_prefill_precedence_requests_total",
                                           {"tier": "<16K"}) or 0.0
        got = await c.prefill.Pull(banded("e1", inc, full, [(0, False, full)]))
        assert REGISTRY.get_sample_value("fulcrum_prefill_precedence_requests_total",
                                         {"tier": "<16K"}) == before + 1
        assert [(r.request_id, r.priority, r.boosted, r.dp_rank) for r in got.requests] == [
            ("l1", 0, True, 0)]
        assert (await l1).engine_id == "e1"
        assert st.queue_depths()[0] == 1  # the heavy one waits for room
        # Once the engine reports boosted work ahead on both ranks, the next light
        # request waits behind it like anyone else.
        l2 = asyncio.ensure_future(c.prefill.Submit(submit("l2", "light")))
        await until(lambda: st.queue_depths()[0] == 2)
        got = await c.prefill.Pull(banded("e1", inc, full, [(0, False, full),
                                                            (0, True, [S, S])]))
        assert list(got.requests) == []
        for f in (h1, l2):
            f.cancel()


BAD: list[tuple[list[tuple[int, bool, list[int]]], str]] = [
    ([(0, True, [0, 0]), (0, True, [0, 0])], "appears twice"),
    ([(0, True, [4 * S, 0])], "above"),
    ([(99, True, [0, 0])], "outside"),
    ([(p, b, [0, 0]) for p in range(-8, 9) for b in (False, True)] + [(0, False, [0, 0])],
     "at most 34"),
]


@pytest.mark.parametrize(("bands", "says"), BAD, ids=["twice", "above", "priority", "count"])
async def test_bad_boosted_band_loads_are_refused_and_change_nothing(
    bands: list[tuple[int, bool, list[int]]], says: str
) -> None:
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit("l1", "light")))
        await until(lambda: st.queue_depths()[0] == 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(banded("e1", inc, [2 * S, 3 * S], bands))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert "band_rank_loads" in details and says in details
        assert st.queue_depths()[0] == 1
        sub.cancel()


async def test_the_engine_kit_runs_a_boosted_request_first_and_reports_its_half_band() -> None:
    from fulcrum.client.prefill import PrefillEngine

    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "eng", dp_ranks=1)
        engine = PrefillEngine(c, "eng", inc, dp_ranks=1)
        h0 = asyncio.ensure_future(c.prefill.Submit(submit("h0", "heavy", total=15_000)))
        await until(lambda: st.queue_depths()[0] == 1)
        assert [r.request_id for r in (await engine.pull(20 * S)).requests] == ["h0"]
        await h0
        assert engine.rank_loads_ns()[0] > S  # past the horizon for the heavy tenant
        h1 = asyncio.ensure_future(c.prefill.Submit(submit("h1", "heavy")))
        l1 = asyncio.ensure_future(c.prefill.Submit(submit("l1", "light")))
        await until(lambda: st.queue_depths()[0] == 2)
        got = await engine.pull(20 * S)
        assert [(r.request_id, r.boosted) for r in got.requests] == [("l1", True)]
        await l1
        assert [t.request_id for t in engine.planner.queue(0)] == ["l1", "h0"]
        bands = engine.planner.band_loads()
        assert sorted(bands) == [0, PRECEDENCE] and bands[PRECEDENCE][0] < bands[0][0]
        plan = engine.step()
        assert plan.chunks[0][0].request_id == "l1" and plan.chunks[0][0].last
        assert st.queue_depths()[0] == 1
        h1.cancel()
