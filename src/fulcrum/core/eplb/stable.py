"""``stable`` (the default): migration-aware placement that starts from the map in force.

Rule, per MoE layer (loads in tokens, the even-split load model of ``metrics``):

1. Start from the map in force. Repair it only if it is invalid for the new loads: a
   second replica of an expert on one GPU, or an expert with no replica, is replaced
   (missing experts first, then the hottest expert per replica not yet on that GPU).
   With no map in force, start from a greedy placement: replica counts by the published
   rule (highest load per replica first, at most one replica per GPU), heaviest replica
   first onto the least-loaded GPU that has room and does not hold that expert.
2. Local search that chooses replicas and packing jointly. Each iteration looks at the
   most loaded GPU and makes the one move that lowers that layer's maximum GPU load the
   most per expert copy it transfers:
   - swap: exchange an expert of the hottest GPU with one of a light GPU (2 copies);
   - re-replicate: overwrite a replica of an expert that has >= 2 replicas with a new
     replica of an expert of the hottest GPU, on a GPU that does not hold it (1 copy).
   A move must keep every expert at >= 1 replica and never put two replicas of one expert
   on one GPU. A layer's search stops when its best move lowers the maximum by no more
   than a quarter of the acceptance threshold per copy (rule 3; at least 1e-9 of the
   layer's mean GPU load). It depends only on the current map and loads. Candidates:
   every slot of the hottest GPU against the slots of the lightest GPUs (about 64 slots)
   for swaps; the 3 experts of the hottest GPU whose extra replica relieves it most,
   against every slot of an expert with >= 2 replicas, for re-replications. The effect of
   a re-replication on the other GPUs holding either expert is bounded from above, so a
   move is only made when it truly lowers the maximum.
3. Migration budget: each layer's moves form a sequence of (copies, predicted gain in
   overall moe_lb). Its upper concave hull groups them into segments of decreasing gain
   per copy. Segments are accepted, most valuable first over all layers, while their gain
   per GiB is >= ``params.min_gain_per_gib`` and the bytes fit under ``params.max_bytes``;
   a layer stops at its first rejected segment. The accepted prefix of each layer's moves
   is applied to the map in force.
4. Node-limited routing (``layout.node_limited``: expert groups divide evenly over the
   nodes, as in the published hierarchical policy): every expert group keeps all its
   replicas on one node, ``n_groups / n_nodes`` groups per node. The groups' nodes are read
   from the map in force (a map that breaks the rule is repaired: each group goes to the
   node holding most of its replicas, and replicas on another node are replaced as in
   rule 1, within the node); with no map in force the groups are packed onto nodes by the
   published balanced packing of group loads and each node is started like a group of its
   own. Swap partners are then the lightest GPUs of the hottest GPU's node and a new
   replica goes to a slot of that node, so no move ever leaves a node.

With no map in force, rule 2 runs from the greedy start (same stopping floor) and every
move is kept: nothing is loaded yet, so nothing migrates.

Consequences: no two replicas of one expert share a GPU, every expert keeps a replica,
and re-running on unchanged loads returns the unchanged map (the search from an accepted
prefix regenerates the rejected suffix, whose hull slopes are unchanged), unless
``max_bytes`` cut the previous run short, in which case the next run continues.

Cost: the search runs all layers at once in numpy, one move per layer per iteration; the
per-slot loads, GPU loads and re-replication targets are kept between iterations and
recomputed only for the layers a move changed (from the same expressions, so the result
equals a recomputation from scratch, bit for bit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb import reference
from fulcrum.core.eplb.layout import GroupLayout, PlacementMap
from fulcrum.core.eplb.params import GIB, RebalanceParams

__all__ = ["NAME", "place"]

NAME: Final = "stable"

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]

_SWAP_PARTNER_SLOTS: Final = 64  # swap partners: the lightest GPUs holding ~this many slots
_REPLICATE_SOURCES: Final = 3  # re-replicate: this many experts of the hottest GPU
_EPS: Final = 1e-9  # relative to the layer's mean GPU load
_FLOOR: Final = 0.25  # search floor, as a fraction of the acceptance threshold per copy
_TIE: Final = 1e-7  # tie-break weight, relative to the gain (tokens per token)


@dataclass(frozen=True, slots=True)
class _Trace:
    """Moves of the local search; iteration ``k`` holds the k-th move of each layer.

    Every array of ``moves[k]`` has one entry per layer that moved in iteration k:
    layer, slot_a, expert written to slot_a, slot_b (-1 for a re-replication), expert
    written to slot_b, copies (2 or 1), and the layer's max GPU load before the move.
    """

    moves: list[tuple[I64, I64, I64, I64, I64, I64, F64]]
    final_max: F64  # shape (n_layers,), max GPU load after all moves


def _counts(phy: I64, n_logical: int) -> I64:
    """Replicas of each expert, shape (n_layers, n_logical)."""
    n_layers = phy.shape[0]
    keys = (np.arange(n_layers)[:, None] * n_logical + phy).ravel()
    cnt: I64 = np.bincount(keys, minlength=n_layers * n_logical).reshape(n_layers, n_logical)
    return cnt.astype(np.int64, copy=False)


def _initial(w: F64, n_gpus: int, spg: int, n_logical: int) -> I64:
    """Greedy start (rule 1) when no map is in force; shape (n_layers, n_physical)."""
    n_layers = w.shape[0]
    n_phys = n_gpus * spg
    rows = np.arange(n_layers)
    cnt = np.ones((n_layers, n_logical), dtype=np.int64)
    for _ in range(n_phys - n_logical):
        score = np.where(cnt < n_gpus, w / cnt, -np.inf)
        best = np.argmax(score, axis=1)
        cnt[rows, best] += 1
    items = np.stack([np.repeat(np.arange(n_logical), cnt[i]) for i in range(n_layers)])
    item_load = np.take_along_axis(w / cnt, items, axis=1)
    order = np.argsort(-item_load, axis=1, kind="stable")
    items = np.take_along_axis(items, order, axis=1)
    item_load = np.take_along_axis(item_load, order, axis=1)
    phy = np.full((n_layers, n_phys), -1, dtype=np.int64)
    pack_w = np.zeros((n_layers, n_gpus))
    pack_n = np.zeros((n_layers, n_gpus), dtype=np.int64)
    on = np.zeros((n_layers, n_logical, n_gpus), dtype=np.bool_)
    for j in range(n_phys):
        e = items[:, j]
        room: B = pack_n < spg
        fits: B = np.logical_and(room, np.logical_not(on[rows, e, :]))
        ok = np.where(np.any(fits, axis=1, keepdims=True), fits, room)  # dead end: repaired later
        g = np.argmin(np.where(ok, pack_w, np.inf), axis=1)
        phy[rows, g * spg + pack_n[rows, g]] = e
        pack_w[rows, g] += item_load[:, j]
        pack_n[rows, g] += 1
        on[rows, e, g] = True
    return phy


def _expert_nodes(phy: I64, layout: GroupLayout) -> I64:
    """Node of each expert, shape (n_layers, n_logical), for a ``node_limited`` layout (rule 4).

    A layer whose every expert group sits on one node, ``n_groups / n_nodes`` groups per
    node, keeps that assignment. Otherwise whole groups are assigned greedily, the
    (group, node) pair holding the most replicas first (ties: lower group, then node).
    """
    n_layers, n_phys = phy.shape
    n_nodes, n_grp, size = layout.n_nodes, layout.n_groups, layout.group_size
    per_node = n_grp // n_nodes
    slot_node = np.arange(n_phys) // (n_phys // n_nodes)
    keys = ((np.arange(n_layers)[:, None] * n_grp + phy // size) * n_nodes + slot_node).ravel()
    held = np.bincount(keys, minlength=n_layers * n_grp * n_nodes).reshape(n_layers, n_grp, n_nodes)
    gnode = held.argmax(axis=2)
    per = np.bincount(
        (np.arange(n_layers)[:, None] * n_nodes + gnode).ravel(), minlength=n_layers * n_nodes
    ).reshape(n_layers, n_nodes)
    ok = ((held > 0).sum(axis=2) <= 1).all(axis=1) & (per == per_node).all(axis=1)
    for layer in np.flatnonzero(~ok).tolist():
        h = held[layer]
        pairs = sorted((-int(h[g, k]), g, k) for g in range(n_grp) for k in range(n_nodes))
        room = [per_node] * n_nodes
        assigned = [-1] * n_grp
        for _, g, k in pairs:
            if assigned[g] < 0 and room[k] > 0:
                assigned[g] = k
                room[k] -= 1
        gnode[layer] = assigned
    out: I64 = np.repeat(gnode, size, axis=1).astype(np.int64, copy=False)
    return out


def _initial_limited(w: F64, layout: GroupLayout) -> tuple[I64, I64]:
    """Greedy start for a ``node_limited`` layout (rules 1 and 4).

    Whole expert groups are packed onto nodes by the published balanced packing of group
    loads, then each node is placed like a group of its own (``_initial`` on the node's
    experts, GPUs and slots). Returns the map (n_layers, n_physical) and the node of each
    expert (n_layers, n_logical).
    """
    n_layers, n_logical = w.shape
    n_nodes, size = layout.n_nodes, layout.group_size
    per_node = n_logical // n_nodes
    group_w = w.reshape(n_layers, layout.n_groups, size).sum(axis=2).astype(np.float32)
    gpack, _ = reference.balanced_packing(group_w, n_nodes)
    enode: I64 = np.repeat(gpack, size, axis=1)
    perm = np.argsort(enode, axis=1, kind="stable")  # experts in node-major order
    w_local = np.take_along_axis(w, perm, axis=1).reshape(n_layers * n_nodes, per_node)
    local = _initial(w_local, layout.gpus_per_node, layout.slots_per_gpu, per_node)
    phy = np.take_along_axis(perm.reshape(n_layers * n_nodes, per_node), local, axis=1)
    return phy.reshape(n_layers, layout.n_physical), enode


def _repair(
    phy: I64,
    w: F64,
    n_gpus: int,
    spg: int,
    n_logical: int,
    enode: I64 | None = None,
    gpus_per_domain: int | None = None,
) -> I64:
    """Remove co-located replicas and restore missing experts (rule 1); returns a copy.

    With ``enode`` (node of each expert, (n_layers, n_logical)) and ``gpus_per_domain``
    (rule 4), a replica on another node than its expert's is removed as well, and every
    refill stays on the expert's node.
    """
    phy = phy.copy()
    n_layers, n_phys = phy.shape
    dom = n_gpus if gpus_per_domain is None else gpus_per_domain
    slot_node = np.arange(n_phys) // spg // dom
    grouped = np.sort(phy.reshape(n_layers, n_gpus, spg), axis=-1)
    dup = (grouped[..., 1:] == grouped[..., :-1]).any(axis=(1, 2))
    missing = (_counts(phy, n_logical) == 0).any(axis=1)
    if enode is None:
        enode = np.zeros((n_layers, n_logical), dtype=np.int64)
    rows = np.arange(n_layers)[:, None]
    foreign = (enode[rows, phy] != slot_node[None, :]).any(axis=1)
    for layer in np.flatnonzero(dup | missing | foreign):
        row = phy[layer]
        wl = w[layer]
        en = enode[layer]
        cnt = np.bincount(row, minlength=n_logical)
        on = np.zeros((n_logical, n_gpus), dtype=np.bool_)
        free: list[int] = []
        for s in range(n_phys):
            g, e = s // spg, int(row[s])
            if on[e, g] or en[e] != slot_node[s]:
                free.append(s)
                cnt[e] -= 1
            else:
                on[e, g] = True
        for e in sorted(np.flatnonzero(cnt == 0).tolist(), key=lambda x: (-wl[x], x)):
            k = en[e]
            here = [i for i, f in enumerate(free) if slot_node[f] == k]
            if here:
                s = free.pop(here[0])
            else:
                donors = np.flatnonzero((cnt[row] >= 2) & (slot_node == k))
                per_replica = wl[row[donors]] / cnt[row[donors]]
                s = int(donors[np.argmin(per_replica)])
                y = int(row[s])
                cnt[y] -= 1
                on[y, s // spg] = False
            row[s] = e
            cnt[e] += 1
            on[e, s // spg] = True
        for s in free:
            g = s // spg
            score = np.where(on[:, g] | (en != slot_node[s]), -np.inf, wl / np.maximum(cnt, 1))
            z = int(np.argmax(score))
            row[s] = z
            cnt[z] += 1
            on[z, g] = True
    return phy


def _search(
    w: F64,
    phy: I64,
    n_gpus: int,
    spg: int,
    max_iter: int,
    floor_per_copy: float,
    gpus_per_domain: int | None = None,
) -> tuple[I64, _Trace]:
    """Local search (rule 2) on all layers at once; returns the final map and its trace.

    A layer stops when its best move lowers the max GPU load by no more than
    ``floor_per_copy`` tokens per copy (or 1e-9 of its mean GPU load). With
    ``gpus_per_domain`` (node-limited routing, rule 4) every move stays inside the node of
    the hottest GPU: swap partners are the lightest GPUs of that node and a new replica
    goes to a slot of that node.

    Per-slot loads (n_layers, n_physical), GPU loads (n_layers, n_gpus) and the
    re-replication targets are kept across iterations and recomputed only for the layers
    a move changed, from the same expressions, so every value equals a recomputation from
    scratch and the search still depends only on the map and the loads.
    """
    phy = phy.copy()
    n_layers, n_logical = w.shape
    n_phys = n_gpus * spg
    dom = n_gpus if gpus_per_domain is None else gpus_per_domain
    n_dom = n_gpus // dom
    slot_gpu = np.arange(n_phys) // spg
    rows_all = np.arange(n_layers)[:, None]
    cnt = _counts(phy, n_logical)
    on = np.zeros((n_layers, n_logical, n_gpus), dtype=np.bool_)
    on[rows_all, phy, slot_gpu[None, :]] = True
    on_flat = on.reshape(-1)  # a view: index (layer * n_logical + expert) * n_gpus + gpu
    floor = np.maximum(_EPS * w.sum(axis=1) / n_gpus, floor_per_copy)
    active = (w.sum(axis=1) > 0) & (n_gpus > 1)
    k_partner = int(np.clip(_SWAP_PARTNER_SLOTS // spg, 1, max(dom - 1, 1)))
    k_src = min(spg, _REPLICATE_SOURCES)
    n_targets = max(1, min(n_phys, 2 * (n_phys - n_logical)))
    ar_s = np.arange(spg)

    def slot_loads(lay: I64) -> F64:
        r = np.arange(lay.size)[:, None]
        out: F64 = (w[lay] / cnt[lay])[r, phy[lay]]
        return out

    def singles(lay: I64) -> B:
        out: B = (cnt[lay] < 2)[np.arange(lay.size)[:, None], phy[lay]]
        return out

    def targets(single: B) -> I64:
        # slots whose expert has >= 2 replicas (at most 2 * redundant of them) come first;
        # a function of the row of ``single`` only
        if n_targets < n_phys:
            out: I64 = np.argpartition(single, n_targets - 1, axis=1)[:, :n_targets]
            return out
        return np.broadcast_to(np.arange(n_phys), (single.shape[0], n_phys)).copy()

    every = np.arange(n_layers)
    ar_layers = every
    sl = slot_loads(every)  # (L, P) tokens per slot
    sl3 = sl.reshape(n_layers, n_gpus, spg)  # a view
    gl = sl3.sum(axis=2)  # (L, G) tokens per GPU
    single_all = singles(every)  # (L, P) slot holds an expert with one replica
    tgt = targets(single_all)  # (L, n_targets) re-replication target slots
    host_buf = np.empty(n_layers * n_logical)
    moves: list[tuple[I64, I64, I64, I64, I64, I64, F64]] = []
    for _ in range(max_iter):
        act = np.flatnonzero(active)
        n = act.size
        if n == 0:
            break
        r0 = ar_layers[:n]
        r1 = r0[:, None]
        ra = act[:, None]  # rows of the full tables, no copies
        gla = gl[act]
        order = np.argsort(-gla, axis=1, kind="stable")
        g0 = order[:, 0]
        g1 = order[:, 1]
        lmax = gla[r0, g0]
        load1 = gla[r0, g1]
        load2 = gla[r0, order[:, 2]] if n_gpus >= 3 else np.full(n, -np.inf)
        if n_dom == 1:
            partners = order[:, n_gpus - k_partner :]  # (n, k) lightest GPUs
        else:
            d0 = g0 // dom
            in_dom = gla.reshape(n, n_dom, dom)[r0, d0]
            o_dom = np.argsort(-in_dom, axis=1, kind="stable")
            partners = d0[:, None] * dom + o_dom[:, dom - k_partner :]
        base_e = act * n_logical

        # swaps: slot a on the hottest GPU <-> slot b on one of the lightest GPUs
        a_slots = g0[:, None] * spg + ar_s  # (n, S)
        xa = phy[ra, a_slots]
        la = sl[ra, a_slots]
        b_slots = (partners[:, :, None] * spg + ar_s).reshape(n, -1)  # (n, kS)
        yb = phy[ra, b_slots]
        lb = sl[ra, b_slots]
        glp = gla[r1, partners]  # (n, k)
        d = (la[:, :, None] - lb[:, None, :]).reshape(n, spg, k_partner, spg)
        other = np.where(partners == g1[:, None], load2[:, None], load1[:, None])
        lm4 = lmax[:, None, None, None]
        pair_max = glp[:, None, :, None] + d
        swap_gain = lm4 - d
        np.maximum(pair_max, swap_gain, out=pair_max)
        np.maximum(pair_max, other[:, None, :, None], out=swap_gain)
        np.subtract(lm4, swap_gain, out=swap_gain)  # gain = lmax - new max
        x_free = on_flat[(base_e[:, None, None] + xa[:, :, None]) * n_gpus + partners[:, None, :]]
        y_free = on_flat[(base_e[:, None] + yb) * n_gpus + g0[:, None]]
        invalid = d <= 0
        invalid |= x_free[:, :, :, None]
        invalid |= y_free.reshape(n, 1, k_partner, spg)
        swap_gain[invalid] = -np.inf
        swap_gain = swap_gain.reshape(n, -1)
        # among equal gains prefer the swap that leaves the two GPUs most even
        pair_max *= _TIE
        np.subtract(swap_gain, pair_max.reshape(n, -1), out=pair_max.reshape(n, -1))
        swap_idx = np.argmax(pair_max.reshape(n, -1), axis=1)
        swap_best = swap_gain[r0, swap_idx]

        # re-replication: a new replica of a hot expert x over a replica of y (cnt >= 2)
        cx_all = cnt[ra, xa]
        wx_all = w[ra, xa]
        relief = wx_all / cx_all - wx_all / (cx_all + 1)
        src = np.argsort(-relief, axis=1, kind="stable")[:, :k_src]
        xs = xa[r1, src]  # (n, k)
        dx = relief[r1, src]
        new_x = wx_all[r1, src] / (cx_all[r1, src] + 1)
        t_slots = tgt[act]
        yt = phy[ra, t_slots]
        cy = cnt[ra, yt]
        wy = w[ra, yt]
        gt = slot_gpu[t_slots]
        multi = cy >= 2
        dy = np.where(multi, wy / np.maximum(cy - 1, 1) - wy / cy, 0.0)
        # bound on the load of y's other hosts: the hottest GPU holding y (conservative);
        # every slot of an expert with >= 2 replicas is a target
        ey = (r1 * n_logical + yt).ravel()
        glt = gla[r1, gt]
        host = host_buf[: n * n_logical]
        host[ey] = -np.inf
        np.maximum.at(host, ey, glt.ravel())
        y_other = host[ey].reshape(n, n_targets)
        other_t = np.where(gt == g1[:, None], load2[:, None], load1[:, None])
        pair_r = (glt - sl[ra, t_slots])[:, None, :] + new_x[:, :, None]
        np.maximum(pair_r, (lmax[:, None] - dx)[:, :, None], out=pair_r)
        np.maximum(pair_r, (y_other + dy)[:, None, :], out=pair_r)
        if n_dom > 1:
            multi = multi & (gt // dom == (g0 // dom)[:, None])
        x_held = on_flat[(base_e[:, None, None] + xs[:, :, None]) * n_gpus + gt[:, None, :]]
        x_held |= ~multi[:, None, :]
        rep_gain = np.maximum(pair_r, other_t[:, None, :])
        np.subtract(lmax[:, None, None], rep_gain, out=rep_gain)
        rep_gain[x_held] = -np.inf
        rep_gain = rep_gain.reshape(n, -1)
        pair_r *= _TIE
        np.subtract(rep_gain, pair_r.reshape(n, -1), out=pair_r.reshape(n, -1))
        rep_idx = np.argmax(pair_r.reshape(n, -1), axis=1)
        rep_best = rep_gain[r0, rep_idx]

        use_swap = swap_best / 2.0 >= rep_best
        per_copy = np.where(use_swap, swap_best / 2.0, rep_best)
        moving = per_copy > floor[act]
        active[act[~moving]] = False
        if not moving.any():
            break
        # apply swaps (slot loads are permuted with the experts: counts are unchanged)
        sw = np.flatnonzero(moving & use_swap)
        rp = np.flatnonzero(moving & ~use_swap)
        lay_s = act[sw]
        lay_r = act[rp]
        redo = lay_s[:0]
        if sw.size:
            ia, ib = np.divmod(swap_idx[sw], b_slots.shape[1])
            sa = a_slots[sw, ia]
            sb = b_slots[sw, ib]
            x_s = phy[lay_s, sa]
            y_s = phy[lay_s, sb]
            phy[lay_s, sa] = y_s
            phy[lay_s, sb] = x_s
            ga, gb_ = slot_gpu[sa], slot_gpu[sb]
            on[lay_s, x_s, ga] = False
            on[lay_s, y_s, gb_] = False
            on[lay_s, x_s, gb_] = True
            on[lay_s, y_s, ga] = True
            l_a = sl[lay_s, sa]
            sl[lay_s, sa] = sl[lay_s, sb]
            sl[lay_s, sb] = l_a
            gl[lay_s, ga] = sl3[lay_s, ga].sum(axis=1)
            gl[lay_s, gb_] = sl3[lay_s, gb_].sum(axis=1)
            s_a = single_all[lay_s, sa]
            s_b = single_all[lay_s, sb]
            single_all[lay_s, sa] = s_b
            single_all[lay_s, sb] = s_a
            redo = lay_s[s_a != s_b]
            swaps = (lay_s, sa, y_s, sb, x_s, np.full(sw.size, 2), lmax[sw])
        # apply re-replications
        if rp.size:
            ix, jt = np.divmod(rep_idx[rp], n_targets)
            it = t_slots[rp, jt]
            x_r = xs[rp, ix]
            y_r = phy[lay_r, it]
            phy[lay_r, it] = x_r
            cnt[lay_r, x_r] += 1
            cnt[lay_r, y_r] -= 1
            g_r = slot_gpu[it]
            on[lay_r, y_r, g_r] = False
            on[lay_r, x_r, g_r] = True
            sl[lay_r] = slot_loads(lay_r)
            gl[lay_r] = sl3[lay_r].sum(axis=2)
            s_new = singles(lay_r)
            differs = (s_new != single_all[lay_r]).any(axis=1)
            single_all[lay_r] = s_new
            redo = np.concatenate([redo, lay_r[differs]])
            none = np.full(rp.size, -1, dtype=np.int64)
            reps = (lay_r, it, x_r, none, none, np.ones(rp.size, dtype=np.int64), lmax[rp])
        if redo.size:
            tgt[redo] = targets(single_all[redo])
        if not rp.size:
            moves.append(swaps)
        elif not sw.size:
            moves.append(reps)
        else:
            moves.append(tuple(np.concatenate(pair) for pair in zip(swaps, reps, strict=True)))  # type: ignore[arg-type]
    return phy, _Trace(moves=moves, final_max=gl.max(axis=1))


def _hull_segments(copies: list[int], gains: list[float]) -> list[tuple[int, int, float]]:
    """Upper concave hull of the cumulative (copies, gain) curve from the origin.

    Returns (end step count, copies in the segment, gain per copy) per segment, with
    strictly decreasing gain per copy.
    """
    pts: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]
    c_sum = 0.0
    g_sum = 0.0
    for k, (c, g) in enumerate(zip(copies, gains, strict=True), start=1):
        c_sum += c
        g_sum += g
        p = (c_sum, g_sum, k)
        while len(pts) >= 2:
            (x1, y1, _), (x2, y2, _) = pts[-2], pts[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:
                pts.pop()
            else:
                break
        pts.append(p)
    segs: list[tuple[int, int, float]] = []
    for (x1, y1, _), (x2, y2, k2) in itertools.pairwise(pts):
        segs.append((k2, int(x2 - x1), (y2 - y1) / (x2 - x1)))
    return segs


def _select(
    trace: _Trace, n_layers: int, total_mean: float, layout: GroupLayout, params: RebalanceParams
) -> I64:
    """Accepted number of moves per layer (rule 3), shape (n_layers,)."""
    lay = np.concatenate([mv[0] for mv in trace.moves])
    copies_all = np.concatenate([mv[5] for mv in trace.moves])
    before_all = np.concatenate([mv[6] for mv in trace.moves])
    order = np.argsort(lay, kind="stable")  # by layer, then by iteration (= move order)
    lay, copies_all, before_all = lay[order], copies_all[order], before_all[order]
    bounds = np.searchsorted(lay, np.arange(n_layers + 1))
    segments: list[tuple[float, int, int, int, int]] = []
    for layer in range(n_layers):
        lo, hi = int(bounds[layer]), int(bounds[layer + 1])
        if lo == hi:
            continue
        before = before_all[lo:hi]
        after = np.append(before[1:], trace.final_max[layer])
        gains = ((before - after) / total_mean).tolist()
        copies = copies_all[lo:hi].tolist()
        for idx, (end, n_copies, slope) in enumerate(_hull_segments(copies, gains)):
            segments.append((-slope, layer, idx, end, n_copies))
    segments.sort()
    threshold = params.min_gain_per_gib * layout.expert_bytes / GIB  # gain per copy
    budget = (
        params.max_bytes // layout.expert_bytes
        if params.max_bytes is not None and layout.expert_bytes > 0
        else None
    )
    accepted = np.zeros(n_layers, dtype=np.int64)
    blocked = np.zeros(n_layers, dtype=np.bool_)
    for neg_slope, layer, _idx, end, copies in segments:
        if blocked[layer]:
            continue
        if -neg_slope < threshold or (budget is not None and copies > budget):
            blocked[layer] = True
            continue
        if budget is not None:
            budget -= copies
        accepted[layer] = end
    return accepted


def _replay(base: I64, trace: _Trace, accepted: I64) -> I64:
    phy = base.copy()
    for k, (lay, sa, ea, sb, eb, _cp, _before) in enumerate(trace.moves):
        keep = accepted[lay] > k
        if not keep.any():
            continue
        lay, sa, ea, sb, eb = lay[keep], sa[keep], ea[keep], sb[keep], eb[keep]
        phy[lay, sa] = ea
        two = sb >= 0
        phy[lay[two], sb[two]] = eb[two]
    return phy


def place(
    layout: GroupLayout,
    loads: F64,
    previous: PlacementMap | None,
    params: RebalanceParams,
) -> PlacementMap:
    """Place by the ``stable`` rule (module docstring).

    Args:
        layout: the group's shape.
        loads: shape (n_layers, n_logical), tokens per logical expert over the window.
        previous: the map in force, or None for a first placement (nothing to migrate).
        params: migration weight / cap.
    """
    w = np.asarray(loads, dtype=np.float64)
    n_gpus, spg, n_log = layout.ep_size, layout.slots_per_gpu, layout.n_logical
    total_mean = float(w.sum()) / n_gpus
    # moves worth under _FLOOR of the threshold per copy end the search (rule 3 would
    # almost never accept them); in tokens per copy. The first placement stops at the same
    # floor, so that re-running it as a rebalance on the same loads finds nothing to do.
    floor = _FLOOR * params.min_gain_per_gib * layout.expert_bytes / GIB * total_mean
    dom = layout.gpus_per_node if layout.node_limited else None
    enode: I64 | None = None
    if previous is None:
        if dom is None:
            start = _initial(w, n_gpus, spg, n_log)
        else:
            start, enode = _initial_limited(w, layout)
        start = _repair(start, w, n_gpus, spg, n_log, enode, dom)
        final, _ = _search(w, start, n_gpus, spg, params.max_iterations, floor, dom)
        return PlacementMap.from_phy2log(final, n_gpus, n_log)
    prev = np.asarray(previous.phy2log, dtype=np.int64)
    if dom is not None:
        enode = _expert_nodes(prev, layout)
    base = _repair(prev, w, n_gpus, spg, n_log, enode, dom)
    _, trace = _search(w, base, n_gpus, spg, params.max_iterations, floor, dom)
    if not trace.moves or total_mean <= 0:
        return PlacementMap.from_phy2log(base, n_gpus, n_log)
    accepted = _select(trace, w.shape[0], total_mean, layout, params)
    return PlacementMap.from_phy2log(_replay(base, trace, accepted), n_gpus, n_log)
