"""Priority bands on the engines' ranks through a real gRPC channel (issue 23): an engine
whose ranks are full of priority-0 work still takes a priority-1 request when its pull
says nothing of band 1 runs ahead (``band_rank_loads``); the kit's engine reports those
loads and runs the higher band first; bad band loads get INVALID_ARGUMENT naming the
field and change nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from fulcrum.metrics import REGISTRY
from fulcrum.v1 import prefill_pb2
from tests.service.prefill_helpers import prefill_daemon, pull_request, register, until

S = 1_000_000_000
CONFIG = {"prefill": {"pull_wait_ms": 0}}


def submit(rid: str, priority: int = 0, total: int = 2_000) -> prefill_pb2.SubmitRequest:
    return prefill_pb2.SubmitRequest(request_id=rid, total_tokens=total, priority=priority,
                                     max_wait_ms=20_000)


def banded(engine_id: str, inc: int, loads: list[int],
           bands: dict[int, list[int]]) -> prefill_pb2.PullRequest:
    req = pull_request(engine_id, inc, 0, loads, wait_ms=0)
    req.band_rank_loads.extend(prefill_pb2.BandRankLoads(priority=p, rank_loads_ns=row)
                               for p, row in bands.items())
    return req


@pytest.mark.parametrize(("bands", "taken"), [({}, []), ({0: [2 * S, 3 * S]}, ["hi"])],
                         ids=["no band loads", "band 0 only"])
async def test_a_full_engine_takes_a_higher_band_by_the_work_ahead_of_it(
    bands: dict[int, list[int]], taken: list[str]
) -> None:
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        subs = [asyncio.ensure_future(c.prefill.Submit(submit("lo"))),
                asyncio.ensure_future(c.prefill.Submit(submit("hi", priority=1)))]
        await until(lambda: st.queue_depths()[0] == 2)
        before = REGISTRY.get_sample_value("fulcrum_prefill_overtaking_requests_total",
                                           {"tier": "<16K"}) or 0.0
        got = await c.prefill.Pull(banded("e1", inc, [2 * S, 3 * S], bands))
        assert [r.request_id for r in got.requests] == taken
        assert REGISTRY.get_sample_value("fulcrum_prefill_overtaking_requests_total",
                                         {"tier": "<16K"}) == before + len(taken)
        assert [r.priority for r in got.requests] == [1] * len(taken)
        assert [r.dp_rank for r in got.requests] == [0] * len(taken)
        assert st.queue_depths()[0] == 2 - len(taken)  # band 0 still waits for room
        if taken:
            assert (await subs[1]).engine_id == "e1"
        for f in subs:
            f.cancel()


BAD: list[tuple[dict[int, list[int]], str]] = [
    ({0: [S]}, "2 entries"),
    ({99: [0, 0]}, "outside"),
    ({0: [4 * S, 0]}, "above"),
]


@pytest.mark.parametrize(("bands", "says"), BAD, ids=["ranks", "priority", "above"])
async def test_bad_band_loads_are_refused_and_change_nothing(
    bands: dict[int, list[int]], says: str
) -> None:
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=2)
        sub = asyncio.ensure_future(c.prefill.Submit(submit("hi", priority=1)))
        await until(lambda: st.queue_depths()[0] == 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(banded("e1", inc, [2 * S, 3 * S], bands))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "band_rank_loads" in (err.value.details() or "") and says in (
            err.value.details() or "")
        assert st.queue_depths()[0] == 1
        sub.cancel()


async def test_a_priority_appearing_twice_is_refused() -> None:
    async with prefill_daemon(CONFIG) as (_, c, _st):
        inc = await register(c, "e1", dp_ranks=1)
        req = pull_request("e1", inc, 0, [S], wait_ms=0)
        req.band_rank_loads.extend([prefill_pb2.BandRankLoads(priority=0, rank_loads_ns=[S]),
                                    prefill_pb2.BandRankLoads(priority=0, rank_loads_ns=[S])])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill.Pull(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "twice" in (err.value.details() or "")


async def test_the_engine_kit_reports_bands_and_runs_the_higher_band_first() -> None:
    from fulcrum.client.prefill import PrefillEngine

    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "eng", dp_ranks=1)
        engine = PrefillEngine(c, "eng", inc, dp_ranks=1)
        lo: Any = asyncio.ensure_future(c.prefill.Submit(submit("lo", total=16_000)))
        await until(lambda: st.queue_depths()[0] == 1)
        first = await engine.pull(20 * S)
        assert [r.request_id for r in first.requests] == ["lo"]
        await lo
        # The rank now holds ~1.2 s of band 0: past the horizon for band 0 ...
        assert engine.rank_loads_ns()[0] > S
        lo2 = asyncio.ensure_future(c.prefill.Submit(submit("lo2")))
        hi = asyncio.ensure_future(c.prefill.Submit(submit("hi", priority=1)))
        await until(lambda: st.queue_depths()[0] == 2)
        # ... but nothing of band 1 runs ahead, and the pull says so
        assert engine.planner.band_loads() == {0: engine.rank_loads_ns()}
        second = await engine.pull(20 * S)
        assert [r.request_id for r in second.requests] == ["hi"]
        await hi
        assert [t.request_id for t in engine.planner.queue(0)] == ["hi", "lo"]
        plan = engine.step()
        assert plan.chunks[0][0].request_id == "hi" and plan.chunks[0][0].last
        assert st.queue_depths()[0] == 1
        lo2.cancel()


async def test_a_parked_full_engine_is_woken_for_a_higher_band_only() -> None:
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=1)
        req = banded("e1", inc, [2 * S], {0: [2 * S]})
        req.max_wait_ms = 20_000
        parked = asyncio.ensure_future(c.prefill.Pull(req))
        await until(lambda: st.waiting_pulls(0) == 1)
        lo = asyncio.ensure_future(c.prefill.Submit(submit("lo")))
        await until(lambda: st.queue_depths()[0] == 1)
        assert not parked.done() and st.waiting_pulls(0) == 1  # band 0: no room
        hi = asyncio.ensure_future(c.prefill.Submit(submit("hi", priority=1)))
        got = await parked
        assert [r.request_id for r in got.requests] == ["hi"]
        assert (await hi).engine_id == "e1"
        assert st.queue_depths()[0] == 1
        lo.cancel()


async def test_an_engine_offering_no_quota_takes_only_what_its_band_loads_leave_room_for(
) -> None:
    # remaining_quota_ns = 0 still means "nothing" for work of the band it holds: the
    # band loads only open room for a higher band than the work ahead.
    async with prefill_daemon(CONFIG) as (_, c, st):
        inc = await register(c, "e1", dp_ranks=1)
        lo = asyncio.ensure_future(c.prefill.Submit(submit("lo")))
        await until(lambda: st.queue_depths()[0] == 1)
        for loads, bands in (([0], {0: [0]}), ([2 * S], {0: [2 * S]})):
            got = await c.prefill.Pull(banded("e1", inc, loads, bands))
            assert list(got.requests) == []
        assert st.queue_depths()[0] == 1
        lo.cancel()
