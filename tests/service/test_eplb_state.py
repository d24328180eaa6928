"""EplbState directly: window buckets, write-ahead per-group snapshot, settings reload, drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.client import FulcrumClient
from fulcrum.config.eplb import EplbSettings
from fulcrum.core.eplb import rebalance
from fulcrum.errors import FailedPrecondition, InvalidArgument, Unavailable
from fulcrum.state.eplb import EplbState, GroupSpec
from fulcrum.state.eplb_store import group_key
from fulcrum.testing import running_server
from fulcrum.v1 import expert_pb2 as pb

LAYERS, EXPERTS = 2, 8


def spec(gid: str = "g", window: int = 20, period: int = 1000) -> GroupSpec:
    return GroupSpec(
        group_id=gid,
        role="prefill",
        ep_size=2,
        gpus_per_node=8,
        n_layers=LAYERS,
        n_logical=EXPERTS,
        n_groups=1,
        redundant_per_gpu=1,
        window_steps=window,
        period_steps=period,
        expert_bytes=1024,
    )


def load(value: float) -> np.ndarray:
    return np.full((LAYERS, EXPERTS), value)


async def test_window_keeps_the_last_n_steps_in_buckets() -> None:
    state = EplbState(EplbSettings(window_buckets=4))  # 20 steps -> 4 buckets of 5
    await state.register(spec(), None)
    for i in range(10):
        out = state.report("g", 1, 5 * i, 5 * i + 5, load(float(i)))
        assert out.window_steps == min(5 * (i + 1), 20)
    group = state.get("g")
    assert group.window_sum is not None
    assert np.allclose(group.window_sum, load(6.0 + 7.0 + 8.0 + 9.0))
    # observed load covers every report since the map took effect
    assert group.observed_sum is not None and np.allclose(group.observed_sum, load(45.0))


async def test_period_counts_reported_steps() -> None:
    state = EplbState(EplbSettings())
    await state.register(spec(period=30), None)
    assert not state.report("g", 1, 0, 20, load(1.0)).due
    out = state.report("g", 1, 25, 35, load(1.0))  # gaps allowed; 30 steps reported
    assert out.due and out.steps_to_rebalance == 0
    job = state.prepare("g", None, "period")
    assert job.algorithm == "stable" and job.loads.shape == (LAYERS, EXPERTS)
    state.report("g", 1, 35, 40, load(1.0))  # reported while the rebalance computes
    result = rebalance(job.algorithm, job.layout, job.loads, job.previous.placement, job.params)
    await state.commit(job, result)
    assert state.get("g").steps_to_rebalance == 25  # the 5 late steps count toward the next


async def test_failed_snapshot_write_changes_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    state = EplbState(EplbSettings(snapshot_path=str(blocker / "maps")))
    with pytest.raises(Unavailable, match="snapshot"):
        await state.register(spec(), None)
    assert state.groups == {}
    # a writable snapshot, then a failing one at commit time: the version stays
    good = EplbState(EplbSettings(snapshot_path=str(tmp_path / "maps")))
    await good.register(spec(), None)
    good.report("g", 1, 0, 10, np.arange(LAYERS * EXPERTS, dtype=float).reshape(LAYERS, -1))
    job = good.prepare("g", None, "admin")
    result = rebalance(job.algorithm, job.layout, job.loads, job.previous.placement, job.params)
    good.settings = good.settings.model_copy(update={"snapshot_path": str(blocker / "x")})
    with pytest.raises(Unavailable):
        await good.commit(job, result)
    assert good.get("g").current.version == 1
    good.settings = good.settings.model_copy(update={"snapshot_path": str(tmp_path / "m")})
    out = await good.commit(job, result)
    assert out.outcome == "applied" and out.version.version == 2


async def test_reload_changes_the_algorithm_not_the_snapshot_path(tmp_path: Path) -> None:
    state = EplbState(EplbSettings(snapshot_path=str(tmp_path / "a")))
    state.apply_settings(EplbSettings(algorithm="reference", snapshot_path="/elsewhere"))
    assert state.settings.algorithm == "reference"
    assert state.settings.snapshot_path == str(tmp_path / "a")
    await state.register(spec(), None)
    with pytest.raises(FailedPrecondition, match="no load"):
        state.prepare("g", None, "admin")


async def test_drain_closes_watch_streams() -> None:
    async with running_server() as d, FulcrumClient(d.address) as c:
        await c.expert.RegisterGroup(
            pb.RegisterGroupRequest(
                group_id="g",
                role=pb.GROUP_ROLE_DECODE,
                ep_size=2,
                num_layers=LAYERS,
                num_experts=EXPERTS,
                expert_bytes=1,
            )
        )
        call = c.expert.WatchMaps(pb.WatchMapsRequest(group_id="g"))
        first = await asyncio.wait_for(call.read(), 10)
        assert first.map.version == 1
        stopping = asyncio.ensure_future(d.drain_and_stop())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await stopping


def _fingerprint(state: EplbState) -> tuple[object, ...]:
    g = state.get("g")
    ws = None if g.window_sum is None else g.window_sum.tobytes()
    obs = None if g.observed_sum is None else g.observed_sum.tobytes()
    return (
        g.current.version,
        g.last_step_end,
        g.steps_since_rebalance,
        ws,
        obs,
        tuple(sorted(g.bucket_step_counts.items())),
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 4),  # what to break: 0 = nothing
            st.integers(0, 30),  # step gap
            st.integers(1, 12),  # steps in the report
        ),
        min_size=1,
        max_size=25,
    )
)
def test_rejected_reports_change_nothing(ops: list[tuple[int, int, int]]) -> None:
    state = EplbState(EplbSettings(window_buckets=3))
    asyncio.run(state.register(spec(window=20, period=10_000), None))
    end = 0
    accepted: list[tuple[int, np.ndarray]] = []
    for breakage, gap, steps in ops:
        begin = end + gap
        values = load(float(steps))
        version, b, e = 1, begin, begin + steps
        if breakage == 1:
            values = values[:, :-1]
        elif breakage == 2:
            version = 3  # neither the version in force (1) nor the one before it
        elif breakage == 3 and end > 0:
            b = end - 1
        elif breakage == 4:
            values = -values
        before = _fingerprint(state)
        try:
            state.report("g", version, b, e, values)
        except (InvalidArgument, FailedPrecondition):
            assert breakage != 0
            assert _fingerprint(state) == before
            continue
        end = e
        accepted.append((e, values))
    g = state.get("g")
    assert g.last_step_end == end
    if accepted:
        # the window holds exactly the reports of the kept buckets
        kept = set(g.buckets)
        expect = sum(v for e, v in accepted if (e - 1) // g.bucket_steps in kept)
        assert g.window_sum is not None and np.allclose(g.window_sum, expect)
        assert max(kept) - min(kept) < g.window_buckets


async def test_window_snapshot_round_trip_and_failed_write(tmp_path: Path) -> None:
    snap = tmp_path / "maps"
    s = EplbSettings(snapshot_path=str(snap), window_buckets=4)
    state = EplbState(s)
    assert await state.save_window() == 0  # nothing changed yet
    await state.register(spec(), None)
    state.report("g", 1, 0, 5, load(1.0))
    state.report("g", 1, 5, 12, load(2.0))
    assert await state.save_window() == 1
    assert await state.save_window() == 0  # clean again: no rewrite
    again = EplbState(s).get("g")
    g = state.get("g")
    assert again.buckets.keys() == g.buckets.keys()
    assert again.bucket_step_counts == g.bucket_step_counts
    assert np.array_equal(again.window_sum, g.window_sum)  # type: ignore[arg-type]
    assert np.array_equal(again.observed_sum, g.observed_sum)  # type: ignore[arg-type]
    assert again.observed_moe_lb == g.observed_moe_lb
    assert (again.last_step_end, again.steps_since_rebalance) == (12, 12)
    # a failed write keeps the group dirty and changes nothing on disk
    wfile = snap / (group_key("g") + ".window.npz")
    before = wfile.read_bytes()
    state.report("g", 1, 12, 13, load(3.0))
    wfile.unlink()
    wfile.mkdir()  # os.replace onto a directory fails
    assert await state.save_window() == 0
    wfile.rmdir()
    assert await state.save_window() == 1
    assert wfile.read_bytes() != before


_LOAD_VALUES = st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 1.0, 7.0, 1e12, 2.0**53])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(_LOAD_VALUES, min_size=LAYERS * EXPERTS, max_size=LAYERS * EXPERTS),
            st.sampled_from(["stable", "reference"]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_commit_path_never_puts_an_invalid_map_in_force(
    rounds: list[tuple[list[float], str]],
) -> None:
    """Arbitrary finite, huge, tiny and degenerate loads through the whole commit path
    (report -> prepare -> worker computation -> commit): the map in force stays valid."""
    from fulcrum.core.eplb.validate import map_problems
    from fulcrum.service.eplb import _compute

    async def scenario() -> None:
        state = EplbState(EplbSettings(window_buckets=4))
        await state.register(spec(window=20, period=10_000), None)
        step = 0
        for values, alg in rounds:
            g = state.get("g")
            state.report("g", g.current.version, step, step + 5, np.reshape(values, (LAYERS, -1)))
            step += 5
            job = state.prepare("g", alg, "admin")
            out = await state.commit(job, _compute(job, False))
            assert out.outcome in ("applied", "unchanged")
            g = state.get("g")
            assert map_problems(g.layout, g.current.placement, no_colocation=False) == []
            if g.current.algorithm == "stable":
                assert g.current.placement.colocated() == 0

    asyncio.run(scenario())
