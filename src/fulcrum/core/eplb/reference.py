"""``reference``: a re-implementation of the published EPLB algorithm (deepseek-ai/EPLB).

Rule, per MoE layer, loads in tokens (computed in float64 after dividing by the largest
load, so huge and tiny values cannot overflow or underflow; the published code uses
float32, which overflows at 3.4e38):

1. Replication: starting from one replica per logical expert, give each redundant slot in
   turn to the expert with the highest load per replica (ties: lowest expert id).
2. Packing ("balanced greedy"): sort items by load, heaviest first (ties: lowest id), and
   put each on the least-loaded pack that still has room (ties: lowest pack id); every
   pack ends with the same number of items.
3. Hierarchy: when the expert groups divide evenly over the nodes, first pack whole expert
   groups onto nodes (step 2 with group loads), then replicate within each node (step 1
   with ``n_physical / n_nodes`` slots) and pack the node's replicas onto its GPUs
   (step 2); otherwise do steps 1 and 2 over the whole group as if it were one node.

It ignores the map in force (``previous`` and ``params`` are accepted and unused), so a
rebalance typically moves most slots, and it may put two replicas of one hot expert on one
GPU. It is the baseline that ``stable`` is measured against.

Differences from the published code, none of which changes the rule: numpy instead of
torch, the sort is stable (torch's descending sort leaves tie order unspecified), and
``log2phy`` of the returned map lists an expert's slots in ascending slot order rather than
by replica rank.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb.layout import GroupLayout, PlacementMap
from fulcrum.core.eplb.params import RebalanceParams

__all__ = ["NAME", "balanced_packing", "place", "rebalance_experts", "replicate_experts"]

NAME: Final = "reference"

F32 = npt.NDArray[np.float64]  # historical name: every load array is float64
I64 = npt.NDArray[np.int64]


def balanced_packing(weight: F32, num_packs: int) -> tuple[I64, I64]:
    """Pack the items of each row into ``num_packs`` packs of equal item count.

    Args:
        weight: shape (X, n), load of each item; ``n`` must be a multiple of ``num_packs``.
        num_packs: packs per row.

    Returns:
        pack_index: shape (X, n), pack of each item.
        rank_in_pack: shape (X, n), position of the item inside its pack.
    """
    rows_n, n = weight.shape
    if n % num_packs != 0:
        raise ValueError(f"num_packs: {num_packs} does not divide {n} items")
    per_pack = n // num_packs
    if per_pack == 1:
        return (
            np.broadcast_to(np.arange(n, dtype=np.int64), (rows_n, n)).copy(),
            np.zeros((rows_n, n), dtype=np.int64),
        )
    order = np.argsort(-weight, axis=-1, kind="stable")
    pack_index = np.full((rows_n, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows_n, n), -1, dtype=np.int64)
    pack_w = np.zeros((rows_n, num_packs), dtype=np.float64)
    pack_n = np.zeros((rows_n, num_packs), dtype=np.int64)
    rows = np.arange(rows_n)
    inf = np.float64(np.inf)
    for j in range(n):
        item = order[:, j]
        pack = np.argmin(np.where(pack_n < per_pack, pack_w, inf), axis=-1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_n[rows, pack]
        pack_w[rows, pack] += weight[rows, item]
        pack_n[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: F32, num_phy: int) -> tuple[I64, I64, I64]:
    """Replicate ``n_log`` experts into ``num_phy`` replicas minimising the max replica load.

    Args:
        weight: shape (X, n_log), load of each logical expert.
        num_phy: replicas per row (>= n_log).

    Returns:
        phy2log: shape (X, num_phy), logical expert of each replica.
        rank: shape (X, num_phy), replica rank of each replica.
        logcnt: shape (X, n_log), replicas of each logical expert.
    """
    rows_n, n_log = weight.shape
    if num_phy < n_log:
        raise ValueError(f"num_phy: {num_phy} < {n_log} logical experts")
    phy2log = np.zeros((rows_n, num_phy), dtype=np.int64)
    phy2log[:, :n_log] = np.arange(n_log)
    rank = np.zeros((rows_n, num_phy), dtype=np.int64)
    logcnt = np.ones((rows_n, n_log), dtype=np.int64)
    rows = np.arange(rows_n)
    for i in range(n_log, num_phy):
        best = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: I64) -> I64:
    """Inverse of each row's permutation (argsort: every entry is written)."""
    inv: I64 = np.argsort(perm, axis=1, kind="stable")
    return inv


def _hierarchical(
    weight: F32, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[I64, I64, I64]:
    n_layers, n_log = weight.shape
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    log_per_node = n_log // num_nodes

    # 1. pack expert groups onto nodes
    tokens_per_group = weight.reshape(n_layers, num_groups, group_size).sum(axis=-1)
    gpack, grank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((gpack * groups_per_node + grank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(n_layers, n_log)
    mlog2log = _inverse(log2mlog)

    # 2. replicate within each node
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_phy // num_nodes)

    # 3. pack each node's replicas onto its GPUs
    per_replica: F32 = tokens_per_mlog / mlogcnt
    tokens_per_phy = np.take_along_axis(per_replica, phy2mlog, axis=1)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (
        pphy2mlog.reshape(n_layers, num_nodes, -1)
        + np.arange(0, n_log, log_per_node)[None, :, None]
    ).reshape(n_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(n_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(n_layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: npt.ArrayLike, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[I64, I64, I64]:
    """The published entry point.

    Args:
        weight: shape (n_layers, n_logical), load of every logical expert (tokens).
        num_replicas: physical slots per layer, a multiple of ``num_gpus``.
        num_groups: expert groups.
        num_nodes: server nodes.
        num_gpus: GPUs, a multiple of ``num_nodes``.

    Returns:
        phy2log: shape (n_layers, num_replicas), logical expert of each slot.
        phyrank: shape (n_layers, num_replicas), replica rank of each slot.
        logcnt: shape (n_layers, n_logical), replicas of each logical expert.
    """
    w = np.asarray(weight, dtype=np.float64)
    top = float(w.max()) if w.size else 0.0
    w = w / top if top > 0.0 and np.isfinite(top) else np.zeros_like(w)
    if num_replicas % num_gpus != 0 or num_gpus % num_nodes != 0:
        raise ValueError("num_replicas must divide over num_gpus, num_gpus over num_nodes")
    if num_groups % num_nodes == 0:
        return _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    return _hierarchical(w, num_replicas, 1, 1, num_gpus)


def place(
    layout: GroupLayout,
    loads: npt.NDArray[np.float64],
    previous: PlacementMap | None,
    params: RebalanceParams,
    load_var: npt.NDArray[np.float64] | None = None,
) -> PlacementMap:
    """Place from scratch by the published rule; ``previous``, ``params`` and
    ``load_var`` are ignored.

    Args:
        layout: the group's shape.
        loads: shape (n_layers, n_logical), tokens per logical expert over the window.
    """
    del previous, params, load_var
    nodes = layout.n_nodes if layout.hierarchical else 1
    groups = layout.n_groups if layout.hierarchical else 1
    phy2log, _, _ = rebalance_experts(loads, layout.n_physical, groups, nodes, layout.ep_size)
    return PlacementMap.from_phy2log(phy2log, layout.ep_size, layout.n_logical)
