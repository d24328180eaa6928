"""``stable``'s noise floor (rule 6), drift gate (rule 7) and the matching helpers:
unit and hypothesis property tests, seeded, no timings."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.eplb import identity_map, make_layout, rebalance
from fulcrum.core.eplb import stable as S
from fulcrum.core.eplb.layout import PlacementMap
from fulcrum.core.eplb.registry import check_map
from fulcrum.core.eplb.window import window_variance
from fulcrum.sim.experts import scenario_windows
from tests.core.eplb.test_eplb_validate import layouts


def _dense_overlap(base: np.ndarray, new: np.ndarray, n_gpus: int, n_log: int) -> np.ndarray:
    n_layers, n_phys = base.shape
    rows = np.arange(n_layers)[:, None]
    held = np.zeros((n_layers, n_log, n_gpus), dtype=np.int64)
    held[rows, base, (np.arange(n_phys) // (n_phys // n_gpus))[None, :]] = 1
    out: np.ndarray = held[rows, new].reshape(n_layers, n_gpus, -1, n_gpus).sum(axis=2)
    return out.astype(np.float64)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1))
def test_overlap_by_sort_join_equals_the_dense_count(layout, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.5, size=(layout.n_layers, layout.n_logical))
    base = np.asarray(identity_map(layout).phy2log)
    new = np.asarray(rebalance("stable", layout, w, None).placement.phy2log)
    for a, b in ((base, new), (new, base), (new, new)):
        got = S._overlap(a, b, layout.ep_size, layout.n_logical)
        np.testing.assert_array_equal(got, _dense_overlap(a, b, layout.ep_size, layout.n_logical))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**32 - 1), st.floats(0.0, 0.9))
def test_greedy_assignment_is_always_a_permutation(
    n_layers: int, n: int, seed: int, forbid: float
) -> None:
    rng = np.random.default_rng(seed)
    score = rng.integers(0, 4, size=(n_layers, n, n)).astype(np.float64)  # many ties
    score[rng.random(score.shape) < forbid] = -np.inf
    out = S._greedy_assignment(score)
    assert (np.sort(out, axis=1) == np.arange(n)).all()
    # without forbidden pairs it matches the one-pair-at-a-time greedy's total
    free = rng.integers(0, 4, size=(n_layers, n, n)).astype(np.float64)
    got = S._greedy_assignment(free)
    for layer in range(n_layers):
        s = free[layer].copy()
        total = 0.0
        for _ in range(n):
            i, j = np.unravel_index(np.argmax(s), s.shape)
            total += free[layer, i, j]
            s[i, :] = -np.inf
            s[:, j] = -np.inf
        assert free[layer, np.arange(n), got[layer]].sum() == total


def test_noise_floor_needs_a_noise_estimate_and_the_gate() -> None:
    w = np.array([[4.0, 2.0, 1.0, 1.0]])
    assert S.noise_floor(w, None, None, 2, 3.0) is None
    assert S.noise_floor(w, w, None, 2, 0.0) is None
    quiet = S.noise_floor(w, np.zeros_like(w), None, 2, 3.0)
    assert quiet is not None and quiet.tolist() == [4.0]
    floor = S.noise_floor(w, w, None, 2, 3.0)
    assert floor is not None and floor[0] > 4.0


def test_search_leaves_a_layer_at_its_noise_floor_alone() -> None:
    layout = make_layout("prefill", 4, 2, 8, redundant_per_gpu=0, expert_bytes=1 << 20)
    w = np.array([[4.0, 4, 1, 1, 1, 1, 1, 1], [4.0, 4, 1, 1, 1, 1, 1, 1]])
    phy = np.asarray(identity_map(layout).phy2log)
    stop = np.array([np.inf, 0.0])  # layer 0 already below its floor
    out, trace = S.search(w, phy, 4, layout.slots_per_gpu, 100, 0.0, None, stop)
    np.testing.assert_array_equal(out[0], phy[0])
    assert all((mv.layer != 0).all() for mv in trace.moves)
    assert not np.array_equal(out[1], phy[1])


def test_drift_is_none_after_a_change_and_zero_on_the_start_up_map() -> None:
    layout = make_layout("decode", 8, 3, 16, expert_bytes=1 << 20)
    ident = np.asarray(identity_map(layout).phy2log)
    mean = np.full(3, 1.0)
    floor = np.full(3, 1.01)
    assert S.drift_of(ident, layout, np.array([1.5, 1.6, 1.0]), mean, floor) is None
    fitted = ident.copy()
    fitted[1, [0, 1]] = fitted[1, [1, 0]]  # a different, fitted-looking layer
    got = S.drift_of(fitted, layout, np.array([1.2, 1.2, 1.0]), mean, floor)
    assert got is not None
    drift, is_fitted = got
    np.testing.assert_allclose(drift, [0.0, 0.19, 0.0])
    assert is_fitted.tolist() == [False, True, False]


def test_drift_gate_reverts_only_fitted_layers_whose_change_does_not_pay() -> None:
    base = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = np.array([[0, 2, 1, 3], [0, 2, 1, 3]])  # swap: 2 copies each
    w = np.array([[3.0, 3.0, 1.0, 1.0], [3.0, 3.0, 1.0, 1.0]])  # 6 vs 2 -> 4 and 4
    floor = np.full(2, 4.0)
    out = S.drift_gate(base, new, w, floor, np.array([0.0, 100.0]), 0.01, 2)
    np.testing.assert_array_equal(out[0], new[0])  # no drift: kept
    np.testing.assert_array_equal(out[1], base[1])  # gain valued at ~0.08/16: reverted
    out = S.drift_gate(base, new, w, floor, np.array([0.0, 0.5]), 0.01, 2)
    np.testing.assert_array_equal(out, new)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1), st.sampled_from([0.05, 0.3, 1.0]))
def test_fixed_point_under_drift_with_a_noise_estimate(layout, seed: int, step: float) -> None:  # type: ignore[no-untyped-def]
    """A map fitted to earlier loads, then drifted loads: the rebalanced map is valid
    and a second rebalance on the same loads changes nothing (rule 7 is all-or-nothing
    per layer over a candidate that is itself a fixed point)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((layout.n_layers, layout.n_logical))
    w0 = np.exp(z)
    w1 = np.exp(z + step * rng.standard_normal(z.shape))
    fitted = rebalance("stable", layout, w0, identity_map(layout), load_var=w0).placement
    first = rebalance("stable", layout, w1, fitted, load_var=w1)
    check_map("stable", layout, first.placement)
    again = rebalance("stable", layout, w1, first.placement, load_var=w1)
    assert again.placement.same_as(first.placement)


def test_fixed_point_on_the_drift_scenario() -> None:
    layout = make_layout("decode", 64, 8, 384, expert_bytes=3 * 7168 * 2048)
    ws = scenario_windows("drift", 8, 384, "decode", 4, seed=11, rho=0.98)
    cur: PlacementMap = identity_map(layout)
    for win in ws:
        var = window_variance(win.buckets, win.steps)
        first = rebalance("stable", layout, win.loads, cur, load_var=var)
        again = rebalance("stable", layout, win.loads, first.placement, load_var=var)
        assert again.migration.slots_changed == 0
        cur = first.placement
