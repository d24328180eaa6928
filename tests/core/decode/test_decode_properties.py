"""Hypothesis properties of the decode core.

- every deterministic policy matches a brute-force reference of its rule;
- no placement ever breaks a capacity; NoCapacity exactly when nothing fits;
- place then release (in any order) restores the view exactly;
- the same seed gives the same decisions;
- derived fields stay consistent through any sequence of pure updates, and the in-place
  ``write_gpu`` gives the same view as the pure updates.
"""

from __future__ import annotations

import numpy as np
from decode_reference import eligible_list, expected
from decode_strategies import fleet_views
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.decode import (
    POLICY_NAMES,
    Decision,
    FleetView,
    NoCapacity,
    make_policy,
    params_for,
    write_gpu,
    write_range,
)
from fulcrum.core.decode.copies import commit, copy_view, grow, observe, release, set_live

DETERMINISTIC = [n for n in POLICY_NAMES if n != "power_of_two"]
kv_sizes = st.integers(min_value=1, max_value=2_500)


@settings(max_examples=150, deadline=None)
@given(
    view=fleet_views(),
    kv_tokens=kv_sizes,
    name=st.sampled_from(DETERMINISTIC),
    slack=st.integers(0, 3),
    factor=st.floats(0.1, 5.0),
    long_tokens=st.integers(1, 3_000),
    cursor=st.integers(0, 30),
)
def test_matches_reference(
    view: FleetView,
    kv_tokens: int,
    name: str,
    slack: int,
    factor: float,
    long_tokens: int,
    cursor: int,
) -> None:
    params = dict(
        long_factor=factor, long_tokens=long_tokens, short_slack=slack, d1_ns=3.0, d2_ns=0.25
    )
    out = make_policy(name, params_for(name, params)).select(
        view, kv_tokens, np.random.default_rng(0), cursor
    )
    want = expected(
        name,
        view,
        kv_tokens,
        long_factor=factor,
        long_tokens=long_tokens,
        short_slack=slack,
        d1=3.0,
        d2=0.25,
        cursor=cursor % view.n_gpus,
    )
    if want is None:
        assert isinstance(out, NoCapacity)
    else:
        assert isinstance(out, Decision) and out.gpu == want


@settings(max_examples=100, deadline=None)
@given(
    view=fleet_views(),
    kv_tokens=kv_sizes,
    name=st.sampled_from(POLICY_NAMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_never_breaks_capacity(view: FleetView, kv_tokens: int, name: str, seed: int) -> None:
    out = make_policy(name).select(view, kv_tokens, np.random.default_rng(seed))
    fits = eligible_list(view, kv_tokens)
    if isinstance(out, NoCapacity):
        assert fits == []
        assert out.reason
        return
    assert out.gpu in fits
    after = commit(view, out.gpu, kv_tokens)
    g = out.gpu
    assert int(after.concurrency[g]) <= int(after.max_concurrency[g])
    assert int(after.kv_tokens[g]) <= int(after.max_kv_tokens[g])
    after.check()


@settings(max_examples=60, deadline=None)
@given(
    view=fleet_views(),
    sizes=st.lists(kv_sizes, min_size=1, max_size=25),
    name=st.sampled_from(POLICY_NAMES),
    seed=st.integers(0, 2**32 - 1),
    order_seed=st.integers(0, 1_000),
)
def test_place_then_release_restores_exactly(
    view: FleetView, sizes: list[int], name: str, seed: int, order_seed: int
) -> None:
    policy = make_policy(name)
    rng = np.random.default_rng(seed)
    state = view
    held: list[tuple[int, int]] = []
    cursor = 0
    for kv in sizes:
        out = policy.select(state, kv, rng, cursor)
        if isinstance(out, Decision):
            cursor = out.cursor
            state = commit(state, out.gpu, kv)
            held.append((out.gpu, kv))
            assert int(state.kv_tokens[out.gpu]) <= int(state.max_kv_tokens[out.gpu])
            assert int(state.concurrency[out.gpu]) <= int(state.max_concurrency[out.gpu])
    state.check()
    for i in np.random.default_rng(order_seed).permutation(len(held)):
        gpu, kv = held[int(i)]
        state = release(state, gpu, kv)
    assert state.same_as(view)


@settings(max_examples=40, deadline=None)
@given(
    view=fleet_views(),
    sizes=st.lists(kv_sizes, min_size=1, max_size=20),
    name=st.sampled_from(POLICY_NAMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_same_seed_same_decisions(view: FleetView, sizes: list[int], name: str, seed: int) -> None:
    def run() -> list[tuple[int, str] | str]:
        policy = make_policy(name)
        rng = np.random.default_rng(seed)
        state, cursor = view, 0
        log: list[tuple[int, str] | str] = []
        for kv in sizes:
            out = policy.select(state, kv, rng, cursor)
            if isinstance(out, NoCapacity):
                log.append(out.reason)
            else:
                log.append((out.gpu, out.kind))
                cursor = out.cursor
                state = commit(state, out.gpu, kv)
        return log

    assert run() == run()


ops = st.lists(
    st.tuples(
        st.sampled_from(["commit", "release", "grow", "observe", "live"]),
        st.integers(0, 11),
        st.integers(0, 500),
        st.booleans(),
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(view=fleet_views(), ops=ops)
def test_derived_fields_stay_consistent(
    view: FleetView, ops: list[tuple[str, int, int, bool]]
) -> None:
    state = view
    owned = copy_view(view)  # updated in place with write_gpu, as the state table does
    snapshot = copy_view(view)
    for op, gpu_raw, amount, flag in ops:
        gpu = gpu_raw % state.n_gpus
        if op == "commit" and amount > 0:
            state = commit(state, gpu, amount)
        elif op == "release":
            if int(state.concurrency[gpu]) > 0:
                state = release(state, gpu, min(amount, int(state.kv_tokens[gpu])))
        elif op == "grow":
            state = grow(state, gpu, amount)
        elif op == "observe":
            state = observe(state, gpu, amount % 7, amount * 3)
        elif op == "live":
            state = set_live(state, gpu, flag)
        state.check()
        write_gpu(
            owned,
            gpu,
            int(state.concurrency[gpu]),
            int(state.kv_tokens[gpu]),
            bool(state.live[gpu]),
        )
        assert owned.same_as(state)
    assert view.same_as(snapshot)  # the pure updates never touched the original


@settings(max_examples=80, deadline=None)
@given(view=fleet_views(), data=st.data())
def test_write_range_matches_per_gpu_writes(view: FleetView, data: st.DataObject) -> None:
    n = view.n_gpus
    start = data.draw(st.integers(0, n))
    k = data.draw(st.integers(0, n - start))
    conc = np.array(data.draw(st.lists(st.integers(0, 8), min_size=k, max_size=k)), np.int64)
    kv = np.array(data.draw(st.lists(st.integers(0, 3_000), min_size=k, max_size=k)), np.int64)
    ranged = copy_view(view)
    write_range(ranged, start, conc, kv)
    single = copy_view(view)
    for i in range(k):
        write_gpu(single, start + i, int(conc[i]), int(kv[i]), bool(single.live[start + i]))
    ranged.check()
    assert ranged.same_as(single)
