"""Map validation, and a property test: arbitrary finite, huge, tiny and degenerate loads
through both algorithms never give an invalid map (issue 10)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.eplb import (
    GroupLayout,
    PlacementMap,
    identity_map,
    make_layout,
    rebalance,
)
from fulcrum.core.eplb.reference import rebalance_experts
from fulcrum.core.eplb.registry import check_map
from fulcrum.core.eplb.validate import InvalidMap, map_problems, validate_map


@st.composite
def layouts(draw: st.DrawFn) -> GroupLayout:
    ep = draw(st.sampled_from([2, 4, 8, 16]))
    gpn = draw(st.sampled_from([4, 8]))
    if ep > gpn and ep % gpn:
        gpn = ep
    n_groups = draw(st.sampled_from([1, 2, 4, 8]))
    lo = max(1, -(-ep // n_groups))
    n_log = n_groups * draw(st.integers(min_value=lo, max_value=lo + 6))
    redundant = draw(st.integers(min_value=0, max_value=3))
    if n_log + ep * redundant > n_log * ep:
        redundant = 0
    layers = draw(st.integers(min_value=1, max_value=3))
    return make_layout(
        "prefill",
        ep,
        layers,
        n_log,
        gpus_per_node=gpn,
        n_groups=n_groups,
        redundant_per_gpu=redundant,
        expert_bytes=1 << 20,
    )


_VALUES = st.sampled_from(
    [0.0, 5e-324, 1e-300, 1e-30, 1.0, 3.0, 1e15, 2.0**53, 1e39, 1e300, 1.7e308]
)


@st.composite
def loads(draw: st.DrawFn, layout: GroupLayout) -> npt.NDArray[np.float64]:
    kind = draw(st.sampled_from(["mixed", "constant", "one-hot", "random"]))
    shape = (layout.n_layers, layout.n_logical)
    if kind == "constant":
        return np.full(shape, draw(_VALUES))
    if kind == "one-hot":
        w = np.zeros(shape)
        w[:, draw(st.integers(0, layout.n_logical - 1))] = draw(_VALUES)
        return w
    if kind == "mixed":
        flat = draw(st.lists(_VALUES, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
        return np.array(flat, dtype=np.float64).reshape(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    r = rng.lognormal(0.0, 2.0, size=shape)
    out: npt.NDArray[np.float64] = r / r.max() * draw(_VALUES)  # at most the drawn value
    return out


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_no_algorithm_returns_an_invalid_map(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    w = data.draw(loads(layout))
    prev = identity_map(layout)
    for name in ("reference", "stable"):
        for previous in (None, prev):
            res = rebalance(name, layout, w, previous)  # validates internally
            check_map(name, layout, res.placement)
            assert (res.placement.replica_counts >= 1).all()
            assert np.isfinite(res.after.overall) and res.after.overall >= 1.0 - 1e-9
            prev2 = res.placement
        again = rebalance(name, layout, data.draw(loads(layout)), prev2)
        check_map(name, layout, again.placement)


def test_huge_values_do_not_overflow_the_reference() -> None:
    """1e39 overflowed the published float32 computation and left experts unplaced."""
    w = np.full((2, 16), 1e39)
    w[:, 0] = 1e300
    phy, _, cnt = rebalance_experts(w, 24, 1, 1, 4)
    assert (cnt >= 1).all()
    for row in phy:
        assert (np.bincount(row, minlength=16) >= 1).all()


def test_validation_names_each_rule() -> None:
    layout = make_layout("prefill", 2, 1, 4, redundant_per_gpu=1, expert_bytes=1)
    ok = identity_map(layout)
    assert map_problems(layout, ok) == []
    missing = PlacementMap.from_phy2log([[0, 1, 2, 0, 1, 2]], 2, 4)
    assert any("coverage" in p for p in map_problems(layout, missing))
    coloc = PlacementMap.from_phy2log([[0, 0, 1, 2, 3, 3]], 2, 4)
    assert any("co-location" in p for p in map_problems(layout, coloc))
    assert map_problems(layout, coloc, no_colocation=False) == []
    other = PlacementMap.from_phy2log([[0, 1, 2, 3]], 2, 4)
    with pytest.raises(InvalidMap, match="shape"):
        validate_map(layout, other)


def test_node_limited_promise_is_checked() -> None:
    layout = make_layout("decode", 16, 1, 64, n_groups=8, gpus_per_node=8, expert_bytes=1)
    assert layout.node_limited
    good = identity_map(layout)
    assert map_problems(layout, good, node_limited=True) == []
    phy = good.phy2log.copy()
    half = layout.n_physical // 2
    phy[0, 0], phy[0, half] = phy[0, half], phy[0, 0]  # one expert of each node swapped
    split = PlacementMap.from_phy2log(phy, 16, 64)
    assert any("node-limited" in p for p in map_problems(layout, split, node_limited=True))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_stable_fixed_point_with_a_noise_estimate(data: st.DataObject) -> None:
    """Unchanged loads (and noise estimate) give an unchanged map, node-limited or not."""
    layout = data.draw(layouts())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    w = rng.lognormal(0.0, data.draw(st.floats(0.0, 2.0)), size=(layout.n_layers, layout.n_logical))
    var = w * data.draw(st.sampled_from([0.0, 0.01, 1.0, 100.0]))
    first = rebalance("stable", layout, w, identity_map(layout), load_var=var)
    check_map("stable", layout, first.placement)
    again = rebalance("stable", layout, w, first.placement, load_var=var)
    assert again.placement.same_as(first.placement)
    assert again.after.overall <= again.before.overall + 1e-12  # type: ignore[union-attr]
