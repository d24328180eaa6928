"""``reference`` holds to the published algorithm's behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.core.eplb import make_layout, rebalance
from fulcrum.core.eplb.reference import balanced_packing, rebalance_experts, replicate_experts

# The example published with deepseek-ai/EPLB: 2 layers, 12 experts, 4 groups, 2 nodes,
# 8 GPUs, 16 physical slots; its documented output.
PUBLISHED_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
PUBLISHED_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_published_example_hierarchical() -> None:
    phy2log, rank, logcnt = rebalance_experts(PUBLISHED_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == PUBLISHED_PHY2LOG
    assert logcnt.sum(axis=1).tolist() == [16, 16]
    # replica ranks number each expert's replicas 0..count-1
    for layer in range(2):
        for e in range(12):
            ranks = sorted(rank[layer][phy2log[layer] == e].tolist())
            assert ranks == list(range(int(logcnt[layer, e])))


def test_replication_gives_slots_to_highest_load_per_replica() -> None:
    phy2log, rank, cnt = replicate_experts(np.array([[10.0, 3.0, 6.0]], dtype=np.float32), 6)
    # 10 -> 2 copies (5 each); then 6 > 5 -> 2 copies (3); then 5 > 3 -> 3 copies of 0
    assert phy2log.tolist() == [[0, 1, 2, 0, 2, 0]]
    assert rank.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert cnt.tolist() == [[3, 1, 2]]


def test_balanced_packing_greedy_heaviest_first() -> None:
    pack, rank = balanced_packing(np.array([[5.0, 1.0, 4.0, 2.0]], dtype=np.float32), 2)
    # order 5,4,2,1: 5->p0, 4->p1, 2->p1 (lighter), 1->p0 (p1 full)
    assert pack.tolist() == [[0, 0, 1, 1]]
    assert rank.tolist() == [[0, 1, 0, 1]]


def test_one_item_per_pack_is_identity() -> None:
    pack, rank = balanced_packing(np.array([[1.0, 9.0, 3.0]], dtype=np.float32), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]


def test_global_policy_when_groups_do_not_divide_over_nodes() -> None:
    # 1 group over 2 nodes -> published code falls back to the global policy (1 node)
    w = np.array([[8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]])
    a, _, _ = rebalance_experts(w, 12, 1, 2, 4)
    b, _, _ = rebalance_experts(w, 12, 1, 1, 4)
    assert a.tolist() == b.tolist()


def test_reference_ignores_the_map_in_force_and_may_colocate() -> None:
    # a very hot expert gets more replicas than fit on distinct GPUs of a small group
    layout = make_layout("prefill", 2, 1, 4, redundant_per_gpu=2, expert_bytes=1)
    loads = np.array([[100.0, 1.0, 1.0, 1.0]])
    first = rebalance("reference", layout, loads, None)
    again = rebalance("reference", layout, loads, first.placement)
    assert again.placement.same_as(first.placement)  # deterministic
    assert first.placement.replica_counts.tolist() == [[5, 1, 1, 1]]
    assert first.placement.colocated() > 0


@pytest.mark.parametrize("ep", [4, 8, 64])
def test_reference_balances_skewed_loads(ep: int) -> None:
    role = "decode" if ep == 64 else "prefill"
    layout = make_layout(role, ep, 4, 384)  # type: ignore[arg-type]
    loads = np.random.default_rng(1).lognormal(0.0, 0.8, size=(4, 384))
    res = rebalance("reference", layout, loads, None)
    assert res.after.overall < 1.05
    assert (res.placement.replica_counts >= 1).all()
