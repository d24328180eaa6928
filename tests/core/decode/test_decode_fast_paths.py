"""The decode core's fast paths agree with their plain definitions.

``masked_argmin`` (one fused pass: sign bit of ``headroom - kv`` OR-ed into the key's
bits, one unsigned argmin) against ``np.where(mask, key, inf).argmin()``, for int64 and
float64 keys, ties, empty and out-of-range requests; ``pick_min``'s fast path against
its masked pass; ``write_gpu`` against a fresh ``FleetView.build``; round_robin's O(1)
cursor check against the scan.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.decode import Decision, FleetView, GpuWriter, make_policy, write_gpu
from fulcrum.core.decode.policy import masked_argmin, pick_min
from fulcrum.core.decode.view import INT64_MAX, MAX_KV_LIMIT


def reference(key: np.ndarray, headroom: np.ndarray, kv_tokens: int) -> int:
    mask = headroom >= kv_tokens
    if not mask.any():
        return -1
    sentinel = np.inf if key.dtype.kind == "f" else INT64_MAX
    return int(np.where(mask, key, sentinel).argmin())


@pytest.mark.parametrize(
    ("key", "headroom", "kv_tokens", "expect"),
    [
        ([5, 1, 3], [10, 0, 10], 5, 2),  # global argmin lacks room
        ([5, 1, 1], [10, 0, 10], 5, 2),  # tie: the lowest eligible index
        ([2, 2, 2], [9, 9, 9], 9, 0),  # all tie: index 0
        ([1, 2], [-1, -1], 1, -1),  # closed GPUs (headroom -1) never fit
        ([1, 2], [5, 5], 6, -1),  # none has room
        ([], [], 1, -1),  # empty fleet
        ([0, INT64_MAX], [5, 5], 5, 0),  # extreme keys
        ([3, 4], [MAX_KV_LIMIT - 1, 5], MAX_KV_LIMIT, -1),  # absurd request
    ],
)
def test_masked_argmin_table(
    key: list[int], headroom: list[int], kv_tokens: int, expect: int
) -> None:
    k = np.array(key, dtype=np.int64)
    h = np.array(headroom, dtype=np.int64)
    assert masked_argmin(k, h, kv_tokens) == expect
    assert masked_argmin(k.astype(np.float64), h, kv_tokens) == expect


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 60), st.integers(-1, 1 << 20)), min_size=1, max_size=40),
    st.integers(1, (1 << 20) + 1),
    st.booleans(),
)
def test_masked_argmin_matches_where(
    gpus: list[tuple[int, int]], kv_tokens: int, small_keys: bool
) -> None:
    key = np.array([k % 7 if small_keys else k for k, _ in gpus], dtype=np.int64)  # ties
    headroom = np.array([h for _, h in gpus], dtype=np.int64)
    assert masked_argmin(key, headroom, kv_tokens) == reference(key, headroom, kv_tokens)
    fkey = key.astype(np.float64) * 0.37 + 0.5  # non-negative floats, rounded ties included
    assert masked_argmin(fkey, headroom, kv_tokens) == reference(fkey, headroom, kv_tokens)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 900)), min_size=1, max_size=30),
    st.integers(1, 1000),
    st.integers(2, 6),
)
def test_pick_min_matches_masked_reference(
    loads: list[tuple[int, int]], kv_tokens: int, max_conc: int
) -> None:
    n = len(loads)
    v = FleetView.build([c for c, _ in loads], [k for _, k in loads], [max_conc] * n, [1000] * n)
    for key in (v.order_kv, v.order_conc, v.order_conc >> 40):
        assert pick_min(key, v, kv_tokens) == reference(key, v.headroom, kv_tokens)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 5_000), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.data(),
)
def test_write_gpu_matches_build(gpus: list[tuple[int, int, bool]], data: st.DataObject) -> None:
    n = len(gpus)
    mc = [8] * n
    mk = [4_000] * n
    v = FleetView.build(
        [c for c, _, _ in gpus], [k for _, k, _ in gpus], mc, mk, [live for _, _, live in gpus]
    )
    for _ in range(5):
        g = data.draw(st.integers(0, n - 1))
        conc = data.draw(st.integers(0, 9))
        kv = data.draw(st.integers(0, 5_000))
        live = data.draw(st.booleans())
        write_gpu(v, g, conc, kv, live)
        v.check()
    with pytest.raises(ValueError, match="out of range"):
        write_gpu(v, n, 0, 0, True)
    with pytest.raises(ValueError, match="out of range"):
        write_gpu(v, -1, 0, 0, True)
    with pytest.raises(ValueError, match="load out of range"):
        write_gpu(v, 0, -1, 0, True)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(-1, 50), min_size=1, max_size=20),
    st.integers(1, 50),
    st.integers(0, 100),
)
def test_round_robin_matches_scan(rooms: list[int], kv_tokens: int, cursor: int) -> None:
    n = len(rooms)
    # room r >= 0: open GPU with r free KV tokens; -1: closed (at max_concurrency)
    v = FleetView.build(
        [1 if r < 0 else 0 for r in rooms],
        [0 if r < 0 else 100 - r for r in rooms],
        [1] * n,
        [100] * n,
    )
    out = make_policy("round_robin").select(v, kv_tokens, np.random.default_rng(0), cursor)
    order = [(cursor % n + i) % n for i in range(n)]
    fits = [g for g in order if v.headroom[g] >= kv_tokens]
    if not fits:
        assert not isinstance(out, Decision)
    else:
        assert isinstance(out, Decision)
        assert out.gpu == fits[0]
        assert out.cursor == (fits[0] + 1) % n


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 5_000), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.data(),
)
def test_gpu_writer_matches_write_gpu(
    gpus: list[tuple[int, int, bool]], data: st.DataObject
) -> None:
    n = len(gpus)
    args = (
        [c for c, _, _ in gpus],
        [k for _, k, _ in gpus],
        [8] * n,
        [4_000] * n,
        [live for _, _, live in gpus],
    )
    a = FleetView.build(*args)
    b = FleetView.build(*args)
    writer = GpuWriter(a)
    for _ in range(5):
        g = data.draw(st.integers(0, n - 1))
        conc = data.draw(st.integers(0, 9))
        kv = data.draw(st.integers(0, 5_000))
        live = data.draw(st.booleans())
        writer.write(g, conc, kv, live)
        write_gpu(b, g, conc, kv, live)
        a.check()
        assert a.same_as(b)
        assert writer.load(g) == (conc, kv)
        assert writer.is_live(g) == live
    for bad in ((n, 0, 0), (-1, 0, 0), (0, -1, 0), (0, 0, MAX_KV_LIMIT)):
        with pytest.raises(ValueError, match="out of range"):
            writer.write(bad[0], bad[1], bad[2], True)
    assert a.same_as(b)  # a refused write changes nothing
