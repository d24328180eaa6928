"""``stable``: invariants (hypothesis), migration budget, repair, and the comparison."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fulcrum.core.eplb import (
    GIB,
    GroupLayout,
    PlacementMap,
    RebalanceParams,
    balance,
    identity_map,
    make_layout,
    rebalance,
)

FREE = RebalanceParams(min_gain_per_gib=0.0)


def _check_valid(m: PlacementMap, layout: GroupLayout) -> None:
    assert m.phy2log.shape == (layout.n_layers, layout.n_physical)
    assert (m.replica_counts >= 1).all(), "an expert lost its last replica"
    assert m.colocated() == 0, "two replicas of one expert on one GPU"
    assert (m.replica_counts.sum(axis=1) == layout.n_physical).all()


@st.composite
def cases(draw: st.DrawFn) -> tuple[GroupLayout, npt.NDArray[np.float64], int]:
    ep = draw(st.sampled_from([2, 3, 4, 8]))
    n_log = draw(st.integers(min_value=max(ep, 4), max_value=24))
    redundant = draw(st.integers(min_value=0, max_value=3))
    if n_log + ep * redundant > n_log * ep:
        redundant = 0
    layers = draw(st.integers(min_value=1, max_value=3))
    layout = make_layout(
        "prefill", ep, layers, n_log, redundant_per_gpu=redundant, expert_bytes=1 << 20
    )
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["lognormal", "integer", "sparse"]))
    if kind == "lognormal":
        loads = rng.lognormal(0.0, draw(st.floats(0.0, 2.0)), size=(layers, n_log))
    elif kind == "integer":
        loads = rng.integers(0, 5, size=(layers, n_log)).astype(np.float64)
    else:
        loads = np.where(
            rng.random((layers, n_log)) < 0.2, rng.exponential(50.0, (layers, n_log)), 0.0
        )
    return layout, loads, seed


def _random_valid_map(layout: GroupLayout, rng: np.random.Generator) -> PlacementMap:
    """A random map in force: a shuffled identity map (valid, no co-location)."""
    m = identity_map(layout).phy2log.copy()
    for layer in range(layout.n_layers):
        for _ in range(layout.n_physical):
            a, b = rng.integers(0, layout.n_physical, size=2)
            m[layer, a], m[layer, b] = m[layer, b], m[layer, a]
            if PlacementMap.from_phy2log(m, layout.ep_size, layout.n_logical).colocated():
                m[layer, a], m[layer, b] = m[layer, b], m[layer, a]
    return PlacementMap.from_phy2log(m, layout.ep_size, layout.n_logical)


#: CI found it (stop 43): the from-scratch map, polished and then relabelled to the map in
#: force, let a rerun find moves the first search's tie-breaks had missed.
_RELABELLED = (
    make_layout("prefill", 8, 3, 14, redundant_per_gpu=3, expert_bytes=1 << 20),
    np.array(
        [
            [4, 4, 1, 3, 0, 3, 2, 1, 0, 1, 0, 0, 3, 2],
            [2, 2, 3, 0, 3, 3, 1, 4, 3, 0, 4, 0, 0, 3],
            [4, 3, 1, 1, 2, 2, 0, 2, 0, 4, 0, 2, 4, 3],
        ],
        dtype=np.float64,
    ),
    1268,
)


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from([0.0, 0.002, 1.0]))
@example(_RELABELLED, 0.0)
def test_stable_invariants_and_fixed_point(
    case: tuple[GroupLayout, npt.NDArray[np.float64], int], weight: float
) -> None:
    layout, loads, seed = case
    params = RebalanceParams(min_gain_per_gib=weight)
    first = rebalance("stable", layout, loads, None, params)
    _check_valid(first.placement, layout)
    # from the map in force (a random valid one)
    prev = _random_valid_map(layout, np.random.default_rng(seed))
    moved = rebalance("stable", layout, loads, prev, params)
    _check_valid(moved.placement, layout)
    assert moved.after.overall <= moved.before.overall + 1e-12  # type: ignore[union-attr]
    # unchanged loads -> unchanged map
    for m in (first.placement, moved.placement):
        again = rebalance("stable", layout, loads, m, params)
        assert again.placement.same_as(m)
        assert again.migration.slots_changed == 0 and again.migration.bytes_moved == 0


@settings(max_examples=80, deadline=None)
@given(cases(), st.integers(min_value=0, max_value=8))
def test_byte_cap_is_respected(
    case: tuple[GroupLayout, npt.NDArray[np.float64], int], cap_copies: int
) -> None:
    layout, loads, seed = case
    prev = _random_valid_map(layout, np.random.default_rng(seed))
    cap = cap_copies * layout.expert_bytes
    res = rebalance("stable", layout, loads, prev, RebalanceParams(0.0, max_bytes=cap))
    _check_valid(res.placement, layout)
    assert res.migration.bytes_moved <= cap
    assert res.after.overall <= res.before.overall + 1e-12  # type: ignore[union-attr]


def test_repairs_colocated_and_missing_experts_from_the_map_in_force() -> None:
    layout = make_layout("prefill", 2, 1, 4, redundant_per_gpu=1, expert_bytes=1)
    bad = PlacementMap.from_phy2log([[0, 0, 1, 2, 3, 3]], 2, 4)  # 0 twice on GPU 0
    res = rebalance("stable", layout, [[5.0, 1.0, 1.0, 1.0]], bad)
    _check_valid(res.placement, layout)
    missing = PlacementMap.from_phy2log([[0, 1, 2, 0, 1, 2]], 2, 4)  # expert 3 missing
    res2 = rebalance("stable", layout, [[1.0, 1.0, 1.0, 4.0]], missing)
    _check_valid(res2.placement, layout)


def test_hot_expert_gets_replicas_on_distinct_gpus() -> None:
    layout = make_layout("prefill", 2, 1, 4, redundant_per_gpu=2, expert_bytes=1)
    res = rebalance("stable", layout, [[100.0, 1.0, 1.0, 1.0]], None)
    _check_valid(res.placement, layout)
    assert res.placement.replica_counts[0, 0] == 2  # at most one per GPU


def test_weight_trades_balance_for_bytes() -> None:
    # restart_gap=inf: only the migration weight decides (by default a map in force far
    # from balanced is replaced whatever the bytes, see test_eplb_scenarios.py)
    layout = make_layout("decode", 16, 4, 64, expert_bytes=44 << 20)
    rng = np.random.default_rng(3)
    loads = rng.lognormal(0.0, 0.8, size=(4, 64))
    prev = identity_map(layout)
    results = [
        rebalance(
            "stable",
            layout,
            loads,
            prev,
            RebalanceParams(min_gain_per_gib=w, restart_gap=float("inf")),
        )
        for w in (0.0, 0.01, 1e9)
    ]
    moved = [r.migration.bytes_moved for r in results]
    lb = [r.after.overall for r in results]
    assert moved[0] >= moved[1] >= moved[2] == 0
    assert lb[0] <= lb[1] <= lb[2] == pytest.approx(results[2].before.overall)  # type: ignore[union-attr]


def test_cap_spends_bytes_on_the_most_valuable_moves_first() -> None:
    layout = make_layout("decode", 16, 6, 64, expert_bytes=GIB // 16)
    rng = np.random.default_rng(4)
    loads = rng.lognormal(0.0, 0.8, size=(6, 64))
    prev = identity_map(layout)
    full = rebalance("stable", layout, loads, prev, RebalanceParams(0.0))
    half_cap = full.migration.bytes_moved // 2
    half = rebalance("stable", layout, loads, prev, RebalanceParams(0.0, max_bytes=half_cap))
    assert half.migration.bytes_moved <= half_cap
    before = full.before.overall  # type: ignore[union-attr]
    # the first half of the bytes buys at least half of the improvement
    assert before - half.after.overall >= 0.5 * (before - full.after.overall)
    # the next rebalance continues where the cap stopped
    nxt = rebalance("stable", layout, loads, half.placement, RebalanceParams(0.0))
    assert nxt.after.overall <= half.after.overall


def test_stable_moves_few_slots_where_reference_reshuffles() -> None:
    """Steady popularity, two windows of Poisson noise (the acceptance aim, EP64 decode)."""
    layout = make_layout("decode", 64, 58, 384, expert_bytes=3 * 7168 * 2048)
    rng = np.random.default_rng(5)
    pop = rng.lognormal(0.0, 0.9, size=(58, 384))
    pop /= pop.sum(axis=1, keepdims=True)
    tokens = 1000 * 64 * 32 * 8  # N = 1000 decode steps
    w0, w1, w2 = (rng.poisson(pop * tokens).astype(np.float64) for _ in range(3))
    ref1 = rebalance("reference", layout, w1, rebalance("reference", layout, w0, None).placement)
    st1 = rebalance("stable", layout, w1, rebalance("stable", layout, w0, None).placement)
    assert st1.migration.changed_fraction < 0.1 < 0.5 < ref1.migration.changed_fraction
    assert st1.placement.colocated() == 0
    # next-window balance within 1% of the published algorithm's
    assert balance(w2, st1.placement).overall <= 1.01 * balance(w2, ref1.placement).overall


def test_unknown_algorithm_and_bad_inputs() -> None:
    layout = make_layout("prefill", 2, 1, 4, redundant_per_gpu=1, expert_bytes=1)
    with pytest.raises(ValueError, match="unknown EPLB algorithm"):
        rebalance("nope", layout, np.ones((1, 4)), None)
    with pytest.raises(ValueError, match="shape"):
        rebalance("stable", layout, np.ones((2, 4)), None)
    with pytest.raises(ValueError, match=">= 0"):
        rebalance("stable", layout, -np.ones((1, 4)), None)
    with pytest.raises(ValueError, match="finite"):
        rebalance("stable", layout, np.full((1, 4), np.nan), None)
    other = make_layout("prefill", 4, 1, 4, redundant_per_gpu=0, expert_bytes=1)
    with pytest.raises(ValueError, match="previous_map"):
        rebalance("stable", layout, np.ones((1, 4)), identity_map(other))
    with pytest.raises(ValueError, match="min_gain_per_gib"):
        RebalanceParams(min_gain_per_gib=-1.0)
