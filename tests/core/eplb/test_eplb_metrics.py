"""moe_lb and migration accounting on hand cases."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.core.eplb import PlacementMap, balance, gpu_loads, migration


def test_gpu_loads_split_evenly_over_replicas() -> None:
    # 2 GPUs x 2 slots; expert 0 has 2 replicas
    m = PlacementMap.from_phy2log([[0, 1, 0, 2]], ep_size=2, n_logical=3)
    gl = gpu_loads([[10.0, 4.0, 2.0]], m.phy2log, 2)
    assert gl.tolist() == [[9.0, 7.0]]
    b = balance([[10.0, 4.0, 2.0]], m)
    assert b.per_layer.tolist() == pytest.approx([9.0 / 8.0])
    assert b.overall == pytest.approx(9.0 / 8.0)


def test_overall_is_sum_of_max_over_sum_of_mean() -> None:
    m = PlacementMap.from_phy2log([[0, 1], [0, 1]], ep_size=2, n_logical=2)
    b = balance([[3.0, 1.0], [1.0, 1.0]], m)
    assert b.per_layer.tolist() == pytest.approx([1.5, 1.0])
    assert b.overall == pytest.approx((3.0 + 1.0) / (2.0 + 1.0))


def test_zero_load_is_perfect_balance() -> None:
    m = PlacementMap.from_phy2log([[0, 1]], ep_size=2, n_logical=2)
    b = balance(np.zeros((1, 2)), m)
    assert b.overall == 1.0 and b.per_layer.tolist() == [1.0]


@pytest.mark.parametrize(
    ("old", "new", "changed", "copies"),
    [
        ([[0, 1, 2, 3]], [[0, 1, 2, 3]], 0, 0),
        ([[0, 1, 2, 3]], [[1, 0, 2, 3]], 2, 0),  # swap inside GPU 0: nothing to receive
        ([[0, 1, 2, 3]], [[2, 1, 0, 3]], 2, 2),  # swap across GPUs: each receives one
        ([[0, 1, 2, 3]], [[0, 1, 2, 0]], 1, 1),  # new replica of 0 on GPU 1
    ],
)
def test_migration_counts(
    old: list[list[int]], new: list[list[int]], changed: int, copies: int
) -> None:
    a = PlacementMap.from_phy2log(old, 2, 4)
    b = PlacementMap.from_phy2log(new, 2, 4)
    mig = migration(a, b, expert_bytes=100)
    assert (mig.slots_changed, mig.copies_received, mig.bytes_moved) == (
        changed,
        copies,
        copies * 100,
    )
    assert mig.slots_total == 4
    assert migration(None, b, 100).bytes_moved == 0
