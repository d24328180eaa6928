"""The simulator and the daemon make the same prefill decisions for the same inputs.

Both shells drive one :class:`fulcrum.core.prefill.balancer.PrefillBalancer`. The
simulator records every call it makes on it (engine joins, submits, pulls with the
engine's remaining quota and rank loads, round closings) with what came out; the same
sequence is then fed, on a fake clock, through the daemon's
:class:`fulcrum.state.prefill.PrefillState` (``submit``, ``pull`` with no wait,
``tick``) and every decision must match: which requests each pull took, on which DP
ranks, and the engines per tier after every submit and round.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from fulcrum.config.prefill import PrefillSettings
from fulcrum.config.server import FleetSettings
from fulcrum.core.prefill.bands import split_band
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass, TenantTable
from fulcrum.core.types import MemberKind, PrefillEngineShape
from fulcrum.sim.cluster import Cluster
from fulcrum.sim.engine import simulate
from fulcrum.sim.policies import get_policy_set
from fulcrum.sim.workload import Request
from fulcrum.state.fleet import Fleet
from fulcrum.state.prefill import Delivery, PrefillState

S = 1_000_000_000

CLUSTER = Cluster().with_overrides(
    prefill={"engines": 4, "ranks_per_engine": 2},
    decode={"instances": 1, "gpus_per_instance": 4},
    vision={"machines": 1, "gpus_per_machine": 2},
    cache={"capacity_blocks": 0},
)


def workload(seed: int, n: int = 160) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.05 * S, n)).astype(np.int64)
    out = []
    for i in range(n):
        long = rng.random() < 0.12
        inp = int(rng.integers(20_000, 140_000)) if long else int(rng.integers(200, 12_000))
        out.append(Request(i, int(t[i]), inp, int(rng.integers(1, 20))))
    return out


def record(policy: str, reqs: list[Request]) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    simulate(CLUSTER, get_policy_set(policy), reqs, seed=0, trace=events.append)
    return events


async def replay(events: list[tuple[Any, ...]], rules: str | list[str],
                 tenants: TenantTable | None = None,
                 classes: dict[str, RequestClass] | None = None) -> dict[str, int]:
    """Replay ``events`` through the daemon's shell (``tenants``, ``classes``: the tenant
    table and each request's class, issue 23)."""
    now = [0]
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = PrefillState(
        PrefillSettings(round_period_ms=3_600_000, max_queued_per_tier=100_000, rules=rules),
        fleet,
        lambda: now[0],
        tenants,
    )
    fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    tasks: dict[str, asyncio.Task[Delivery]] = {}
    seen = {"pull": 0, "batch": 0, "round": 0, "boosted": 0}
    try:
        for ev in events:
            kind, now[0] = ev[0], int(ev[1])
            if kind == "join":
                fleet.register(ev[2], PrefillEngineShape(dp_ranks=ev[3]), now[0])
            elif kind == "submit":
                _, _, rid, total, cached, counts = ev
                cls = (classes or {}).get(rid, DEFAULT_CLASS)
                tasks[rid] = asyncio.ensure_future(
                    state.submit(rid, total, cached, 3600 * S, cls=cls))
                await asyncio.sleep(0)
                assert state.is_queued(rid)
                assert tuple(state.engines_per_tier()) == counts, ev
            elif kind == "pull":
                _, _, eid, remaining, loads, ids, ranks, bands, rank_bands = ev
                batch = await state.pull(eid, 0, remaining, list(loads), 0, 0,
                                         band_loads=bands)
                assert tuple(it.request_id for it in batch.items) == ids, ev
                assert tuple(it.dp_rank for it in batch.items) == ranks, ev
                # fair-share precedence: the same requests boosted (the kit's band)
                assert tuple(it.boosted for it in batch.items) == tuple(
                    split_band(b)[1] for b in rank_bands), ev
                seen["boosted"] += sum(it.boosted for it in batch.items)
                seen["pull"] += 1
                seen["batch"] += bool(ids)
            elif kind == "round":
                state.tick(now[0])
                assert tuple(state.engines_per_tier()) == ev[2], ev
                seen["round"] += 1
            else:  # pragma: no cover - a new event kind must be replayed too
                raise AssertionError(f"unknown event {kind!r}")
        for _ in range(3):  # a submit awaits its (shielded, shareable) outcome: two hops
            await asyncio.sleep(0)
        for rid, task in tasks.items():
            assert task.done(), rid  # every request the simulator ran was delivered
            assert task.result().engine_id
    finally:
        for task in tasks.values():
            task.cancel()
    seen["moves"] = state.moves_total
    return seen


@pytest.mark.parametrize("policy", ["default", "published"])
@pytest.mark.parametrize("seed", [1, 2])
async def test_simulator_and_daemon_decide_alike(policy: str, seed: int) -> None:
    events = record(policy, workload(seed))
    seen = await replay(events, get_policy_set(policy).rules)
    # The scenario is not trivial: many pulls and batches, rounds that moved engines.
    assert seen["batch"] >= 20 and seen["pull"] > seen["batch"]
    assert seen["round"] >= 3 and seen["moves"] >= 1
