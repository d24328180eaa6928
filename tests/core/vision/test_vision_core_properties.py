"""Hypothesis invariants of the VE policies.

- place then release (in any order) restores the fleet exactly;
- the same seed gives the same decisions;
- no placement ever breaks a capacity, or lands on a GPU that is not live;
- the chosen GPU is the least loaded eligible GPU of its machine (global for
  ``least_patches``); a placement fails exactly when no GPU is eligible;
- selection never mutates the fleet.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vision_fixtures import eligible, fleets

from fulcrum.core.vision.base import place_many
from fulcrum.core.vision.fleet import (
    NoCapacity,
    VisionFleet,
    commit,
    release,
)
from fulcrum.core.vision.registry import make_policy, policy_names

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
policies = st.sampled_from(policy_names())
image = st.integers(1, 6_000)


@SETTINGS
@given(
    fleet=fleets(),
    images=st.lists(image, min_size=1, max_size=8),
    name=policies,
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_place_then_release_restores_exactly(
    fleet: VisionFleet, images: list[int], name: str, seed: int, data: st.DataObject
) -> None:
    before = fleet.patches_in_flight.copy()
    folded = place_many(make_policy(name), fleet, images, np.random.default_rng(seed))
    if isinstance(folded, NoCapacity):  # refusals are returned, never raised
        assert np.array_equal(fleet.patches_in_flight, before)
        return
    placed, after = folded
    order = data.draw(st.permutations(range(len(placed))))
    cur = after
    for k in order:
        cur = release(cur, placed[k].gpu, placed[k].patches)
    assert np.array_equal(cur.patches_in_flight, before)
    assert cur.patches_in_flight.dtype == np.int64
    assert np.array_equal(fleet.patches_in_flight, before)  # input untouched


@SETTINGS
@given(
    fleet=fleets(),
    images=st.lists(image, min_size=1, max_size=12),
    name=policies,
    seed=st.integers(0, 2**32 - 1),
)
def test_same_seed_same_decisions(
    fleet: VisionFleet, images: list[int], name: str, seed: int
) -> None:
    def run() -> object:
        rng = np.random.default_rng(seed)
        out: list[object] = []
        cur = fleet
        for p in images:
            pl = make_policy(name).select(cur, p, rng)
            if isinstance(pl, NoCapacity):
                out.append(pl.reason)
                continue
            out.append(pl)
            cur = commit(cur, pl)
        return out

    assert run() == run()


@SETTINGS
@given(
    fleet=fleets(),
    images=st.lists(image, min_size=1, max_size=20),
    name=policies,
    seed=st.integers(0, 2**32 - 1),
)
def test_capacity_and_liveness_never_broken(
    fleet: VisionFleet, images: list[int], name: str, seed: int
) -> None:
    t = fleet.topology
    rng = np.random.default_rng(seed)
    pol = make_policy(name)
    cur = fleet
    for p in images:
        ok = eligible(cur, p)
        snapshot = cur.patches_in_flight.copy()
        pl = pol.select(cur, p, rng)
        if isinstance(pl, NoCapacity):
            assert not ok.any()
            continue
        assert np.array_equal(cur.patches_in_flight, snapshot)  # select is pure
        assert ok[pl.gpu]
        assert pl.patches == p
        assert int(t.gpu_machine[pl.gpu]) == pl.machine
        load = cur.patches_in_flight
        if name == "least_patches":
            assert load[pl.gpu] == load[ok].min()
            assert pl.gpu == int(np.flatnonzero(ok & (load == load[ok].min()))[0])
        else:
            mine = ok & (t.gpu_machine == pl.machine)
            assert load[pl.gpu] == load[mine].min()
            assert pl.gpu == int(np.flatnonzero(mine & (load == load[mine].min()))[0])
        cur = commit(cur, pl)
        limited = t.capacity > 0
        assert np.all(cur.patches_in_flight[limited] <= t.capacity[limited])
