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

With no map in force, rule 2 runs from the greedy start (same stopping floor) and every
move is kept: nothing is loaded yet, so nothing migrates.

Consequences: no two replicas of one expert share a GPU, every expert keeps a replica,
and re-running on unchanged loads returns the unchanged map (the search from an accepted
prefix regenerates the rejected suffix, whose hull slopes are unchanged), unless
``max_bytes`` cut the previous run short, in which case the next run continues.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

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
    n_layers = phy.shape[0]
    cnt = np.zeros((n_layers, n_logical), dtype=np.int64)
    np.add.at(cnt, (np.broadcast_to(np.arange(n_layers)[:, None], phy.shape), phy), 1)
    return cnt


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


def _repair(phy: I64, w: F64, n_gpus: int, spg: int, n_logical: int) -> I64:
    """Remove co-located replicas and restore missing experts (rule 1); returns a copy."""
    phy = phy.copy()
    n_layers, n_phys = phy.shape
    grouped = np.sort(phy.reshape(n_layers, n_gpus, spg), axis=-1)
    dup = (grouped[..., 1:] == grouped[..., :-1]).any(axis=(1, 2))
    missing = (_counts(phy, n_logical) == 0).any(axis=1)
    for layer in np.flatnonzero(dup | missing):
        row = phy[layer]
        wl = w[layer]
        cnt = np.bincount(row, minlength=n_logical)
        on = np.zeros((n_logical, n_gpus), dtype=np.bool_)
        free: list[int] = []
        for s in range(n_phys):
            g, e = s // spg, int(row[s])
            if on[e, g]:
                free.append(s)
                cnt[e] -= 1
            else:
                on[e, g] = True
        for e in sorted(np.flatnonzero(cnt == 0).tolist(), key=lambda x: (-wl[x], x)):
            if free:
                s = free.pop(0)
            else:
                donors = np.flatnonzero(cnt[row] >= 2)
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
            score = np.where(on[:, g], -np.inf, wl / np.maximum(cnt, 1))
            z = int(np.argmax(score))
            row[s] = z
            cnt[z] += 1
            on[z, g] = True
    return phy


def _search(
    w: F64, phy: I64, n_gpus: int, spg: int, max_iter: int, floor_per_copy: float
) -> tuple[I64, _Trace]:
    """Local search (rule 2) on all layers at once; returns the final map and its trace.

    A layer stops when its best move lowers the max GPU load by no more than
    ``floor_per_copy`` tokens per copy (or 1e-9 of its mean GPU load).
    """
    phy = phy.copy()
    n_layers, n_logical = w.shape
    n_phys = n_gpus * spg
    slot_gpu = np.arange(n_phys) // spg
    cnt = _counts(phy, n_logical)
    on = np.zeros((n_layers, n_logical, n_gpus), dtype=np.bool_)
    on[np.arange(n_layers)[:, None], phy, slot_gpu[None, :]] = True
    on_flat = on.reshape(-1)  # a view: index (layer * n_logical + expert) * n_gpus + gpu
    floor = np.maximum(_EPS * w.sum(axis=1) / n_gpus, floor_per_copy)
    active = (w.sum(axis=1) > 0) & (n_gpus > 1)
    k_partner = int(np.clip(_SWAP_PARTNER_SLOTS // spg, 1, max(n_gpus - 1, 1)))
    k_src = min(spg, _REPLICATE_SOURCES)
    n_targets = max(1, min(n_phys, 2 * (n_phys - n_logical)))
    ar_s = np.arange(spg)
    moves: list[tuple[I64, I64, I64, I64, I64, I64, F64]] = []
    for _ in range(max_iter):
        act = np.flatnonzero(active)
        if act.size == 0:
            break
        n = act.size
        r1 = np.arange(n)[:, None]
        ph = phy[act]
        wa = w[act]
        cn = cnt[act]
        sl = np.take_along_axis(wa / cn, ph, axis=1)  # (n, P) load per slot
        gl = sl.reshape(n, n_gpus, spg).sum(axis=2)  # (n, G)
        order = np.argsort(-gl, axis=1, kind="stable")
        g0 = order[:, 0]
        g1 = order[:, 1]
        lmax = gl[r1[:, 0], g0]
        load1 = gl[r1[:, 0], g1]
        load2 = gl[r1[:, 0], order[:, 2]] if n_gpus >= 3 else np.full(n, -np.inf)

        # swaps: slot a on the hottest GPU <-> slot b on one of the lightest GPUs
        a_slots = g0[:, None] * spg + ar_s  # (n, S)
        xa = ph[r1, a_slots]
        la = sl[r1, a_slots]
        partners = order[:, n_gpus - k_partner :]
        b_slots = (partners[:, :, None] * spg + ar_s).reshape(n, -1)  # (n, kS)
        yb = ph[r1, b_slots]
        lb = sl[r1, b_slots]
        gb = b_slots // spg
        d = la[:, :, None] - lb[:, None, :]
        other = np.where(gb == g1[:, None], load2[:, None], load1[:, None])[:, None, :]
        pair_max = np.maximum(lmax[:, None, None] - d, gl[r1, gb][:, None, :] + d)
        new_max = np.maximum(pair_max, other)
        base_e = (act * n_logical)[:, None, None]
        valid = (
            (d > 0)
            & ~on_flat[(base_e + xa[:, :, None]) * n_gpus + gb[:, None, :]]
            & ~on_flat[(base_e + yb[:, None, :]) * n_gpus + g0[:, None, None]]
        )
        swap_gain = np.where(valid, lmax[:, None, None] - new_max, -np.inf).reshape(n, -1)
        # among equal gains prefer the swap that leaves the two GPUs most even
        swap_idx = np.argmax(swap_gain - _TIE * pair_max.reshape(n, -1), axis=1)
        swap_best = swap_gain[r1[:, 0], swap_idx]

        # re-replication: a new replica of a hot expert x over a replica of y (cnt >= 2)
        cx_all = cn[r1, xa]
        wx_all = wa[r1, xa]
        relief = wx_all / cx_all - wx_all / (cx_all + 1)
        src = np.argsort(-relief, axis=1, kind="stable")[:, :k_src]
        xs = np.take_along_axis(xa, src, axis=1)  # (n, k)
        dx = np.take_along_axis(relief, src, axis=1)
        wx = np.take_along_axis(wx_all, src, axis=1)
        new_x = wx / (np.take_along_axis(cx_all, src, axis=1) + 1)
        # targets: slots whose expert has >= 2 replicas (at most 2 * redundant of them)
        single = np.take_along_axis(cn < 2, ph, axis=1)  # (n, P) slot of a 1-replica expert
        if n_targets < n_phys:  # every multi-replica slot, in a deterministic order
            t_slots = np.argpartition(single, n_targets - 1, axis=1)[:, :n_targets]
        else:
            t_slots = np.broadcast_to(np.arange(n_phys), (n, n_phys))
        yt = ph[r1, t_slots]
        cy = cn[r1, yt]
        wy = wa[r1, yt]
        gt = slot_gpu[t_slots]
        dy = np.where(cy >= 2, wy / np.maximum(cy - 1, 1) - wy / cy, 0.0)
        # bound on the load of y's other hosts: the hottest GPU holding y (conservative)
        host_max = np.full(n * n_logical, -np.inf)
        np.maximum.at(host_max, (r1 * n_logical + ph).ravel(), np.repeat(gl, spg, axis=1).ravel())
        y_other = host_max[r1 * n_logical + yt]
        other_t = np.where(gt == g1[:, None], load2[:, None], load1[:, None])
        pair_r = np.maximum(
            np.maximum(
                (lmax[:, None] - dx)[:, :, None],
                (gl[r1, gt] - sl[r1, t_slots])[:, None, :] + new_x[:, :, None],
            ),
            (y_other + dy)[:, None, :],
        )
        new_max_r = np.maximum(pair_r, other_t[:, None, :])
        valid_r = (cy >= 2)[:, None, :] & ~on_flat[
            (base_e + xs[:, :, None]) * n_gpus + gt[:, None, :]
        ]
        rep_gain = np.where(valid_r, lmax[:, None, None] - new_max_r, -np.inf).reshape(n, -1)
        rep_idx = np.argmax(rep_gain - _TIE * pair_r.reshape(n, -1), axis=1)
        rep_best = rep_gain[r1[:, 0], rep_idx]

        use_swap = swap_best / 2.0 >= rep_best
        per_copy = np.where(use_swap, swap_best / 2.0, rep_best)
        moving = per_copy > floor[act]
        active[act[~moving]] = False
        if not moving.any():
            break
        # apply swaps
        sw = np.flatnonzero(moving & use_swap)
        lay_s = act[sw]
        ia, ib = np.divmod(swap_idx[sw], b_slots.shape[1])
        sa = a_slots[sw, ia]
        sb = b_slots[sw, ib]
        x_s = phy[lay_s, sa]
        y_s = phy[lay_s, sb]
        phy[lay_s, sa] = y_s
        phy[lay_s, sb] = x_s
        on[lay_s, x_s, slot_gpu[sa]] = False
        on[lay_s, y_s, slot_gpu[sb]] = False
        on[lay_s, x_s, slot_gpu[sb]] = True
        on[lay_s, y_s, slot_gpu[sa]] = True
        # apply re-replications
        rp = np.flatnonzero(moving & ~use_swap)
        lay_r = act[rp]
        ix, jt = np.divmod(rep_idx[rp], n_targets)
        it = t_slots[rp, jt]
        x_r = xs[rp, ix]
        y_r = phy[lay_r, it]
        phy[lay_r, it] = x_r
        cnt[lay_r, x_r] += 1
        cnt[lay_r, y_r] -= 1
        on[lay_r, y_r, slot_gpu[it]] = False
        on[lay_r, x_r, slot_gpu[it]] = True
        moves.append(
            (
                np.concatenate([lay_s, lay_r]),
                np.concatenate([sa, it]),
                np.concatenate([y_s, x_r]),
                np.concatenate([sb, np.full(rp.size, -1, dtype=np.int64)]),
                np.concatenate([x_s, np.full(rp.size, -1, dtype=np.int64)]),
                np.concatenate([np.full(sw.size, 2), np.ones(rp.size, dtype=np.int64)]),
                np.concatenate([lmax[sw], lmax[rp]]),
            )
        )
    rows = np.arange(n_layers)[:, None]
    final_gl = (w[rows, phy] / cnt[rows, phy]).reshape(n_layers, n_gpus, spg).sum(axis=2)
    return phy, _Trace(moves=moves, final_max=final_gl.max(axis=1))


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
    if previous is None:
        start = _repair(_initial(w, n_gpus, spg, n_log), w, n_gpus, spg, n_log)
        final, _ = _search(w, start, n_gpus, spg, params.max_iterations, floor)
        return PlacementMap.from_phy2log(final, n_gpus, n_log)
    base = _repair(np.asarray(previous.phy2log, dtype=np.int64), w, n_gpus, spg, n_log)
    _, trace = _search(w, base, n_gpus, spg, params.max_iterations, floor)
    if not trace.moves or total_mean <= 0:
        return PlacementMap.from_phy2log(base, n_gpus, n_log)
    accepted = _select(trace, w.shape[0], total_mean, layout, params)
    return PlacementMap.from_phy2log(_replay(base, trace, accepted), n_gpus, n_log)
