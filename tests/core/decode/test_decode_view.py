"""FleetView construction, pure updates and derived fields."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.core.decode import (
    FleetView,
    imbalance,
)
from fulcrum.core.decode.copies import commit, grow, observe, release, set_live
from fulcrum.core.decode.view import INT64_MAX


def small() -> FleetView:
    return FleetView.build(
        concurrency=[0, 2, 4, 1],
        kv_tokens=[0, 5_000, 100, 900],
        max_concurrency=[4, 4, 4, 4],
        max_kv_tokens=[1_000, 10_000, 10_000, 1_000],
        live=[True, True, True, False],
    )


def test_build_derives_headroom_orders_and_totals() -> None:
    v = small()
    assert v.n_gpus == 4
    assert v.headroom.tolist() == [1_000, 5_000, -1, -1]  # gpu2 full, gpu3 dead
    assert v.order_conc[2] == INT64_MAX and v.order_kv[3] == INT64_MAX
    assert int(v.order_conc[1]) >> 40 == 2
    assert v.total_concurrency == 6 and v.total_kv_tokens == 5_100  # dead gpu3 excluded
    assert v.mean_kv_per_request() == pytest.approx(850.0)
    v.check()


def test_build_copies_inputs() -> None:
    conc = np.array([1, 2])
    v = FleetView.build(conc, [1, 1], [4, 4], [10, 10])
    conc[0] = 3
    assert int(v.concurrency[0]) == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"concurrency": [-1]}, "concurrency"),
        ({"kv_tokens": [-1]}, "kv_tokens"),
        ({"max_concurrency": [0]}, "max_concurrency"),
        ({"max_kv_tokens": [0]}, "max_kv_tokens"),
        ({"max_kv_tokens": [1 << 41]}, "max_kv_tokens"),
        ({"kv_tokens": [1, 2]}, "kv_tokens"),
        ({"live": [True, False]}, "live"),
    ],
)
def test_build_rejects(kwargs: dict[str, list[int]], field: str) -> None:
    args: dict[str, object] = {
        "concurrency": [0],
        "kv_tokens": [0],
        "max_concurrency": [1],
        "max_kv_tokens": [10],
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        FleetView.build(**args)  # type: ignore[arg-type]


def test_empty_fleet_has_no_mean() -> None:
    v = FleetView.empty_like([2, 2], [10, 10])
    assert v.mean_kv_per_request() is None
    assert FleetView.build([], [], [], []).n_gpus == 0


def test_commit_release_roundtrip_and_old_view_untouched() -> None:
    v = small()
    before = FleetView.build(v.concurrency, v.kv_tokens, v.max_concurrency, v.max_kv_tokens, v.live)
    w = commit(v, 1, 4_000)
    w.check()
    assert int(w.concurrency[1]) == 3 and int(w.kv_tokens[1]) == 9_000
    assert w.total_concurrency == 7 and w.total_kv_tokens == 9_100
    assert v.same_as(before)  # pure
    assert release(w, 1, 4_000).same_as(v)


def test_commit_to_last_slot_closes_gpu() -> None:
    v = commit(commit(small(), 1, 1), 1, 1)
    v.check()
    assert int(v.headroom[1]) == -1 and int(v.order_kv[1]) == INT64_MAX


def test_release_errors() -> None:
    v = small()
    with pytest.raises(ValueError, match="no request"):
        release(v, 0, 0)
    with pytest.raises(ValueError, match="cannot release"):
        release(v, 2, 101)
    with pytest.raises(ValueError, match="out of range"):
        release(v, 4, 1)
    with pytest.raises(ValueError, match="kv_tokens"):
        commit(v, 0, 0)


def test_grow_observe_set_live() -> None:
    v = small()
    g = grow(v, 1, 6_000)  # over capacity: allowed (engine truth), no room left
    g.check()
    assert int(g.kv_tokens[1]) == 11_000 and int(g.headroom[1]) == -1_000
    with pytest.raises(ValueError, match="delta"):
        grow(v, 1, -1)
    o = observe(v, 3, 0, 0)  # dead gpu: totals unchanged
    o.check()
    assert o.total_kv_tokens == v.total_kv_tokens
    r = set_live(o, 3, True)
    r.check()
    assert int(r.headroom[3]) == 1_000
    d = set_live(v, 1, False)
    d.check()
    assert d.total_concurrency == 4 and int(d.headroom[1]) == -1
    assert set_live(d, 1, True).same_as(v)
    with pytest.raises(ValueError, match="concurrency"):
        observe(v, 0, -1, 0)


@pytest.mark.parametrize(
    ("values", "live", "expect"),
    [
        ([1, 1, 1], [True, True, True], 1.0),
        ([3, 1, 2], [True, True, True], 1.5),
        ([9, 1, 1], [False, True, True], 1.0),
        ([0, 0], [True, True], 1.0),
        ([5], [False], 1.0),
    ],
)
def test_imbalance(values: list[int], live: list[bool], expect: float) -> None:
    assert imbalance(np.array(values, dtype=np.int64), np.array(live)) == pytest.approx(expect)
