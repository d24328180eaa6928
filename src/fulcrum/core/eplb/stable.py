"""``stable`` (the default): migration-aware placement, never meaningfully worse than
``reference`` from any map in force.

Rule (loads in tokens, the even-split load model of ``metrics``); shapes: ``L`` layers,
``E`` logical experts, ``P`` physical slots, ``G`` GPUs, ``S = P / G`` slots per GPU.

1. **Base.** The map in force, repaired only where it is invalid for the group (a second
   replica of an expert on one GPU, an expert with no replica, or under node-limited
   routing a replica on another node than its expert group's): :func:`repair`.
2. **Local candidate.** A local search from the base (:func:`search`) that chooses
   replicas and packing jointly: each iteration looks at each layer's hottest GPU and
   makes the move that relieves it most per expert copy transferred, either a *swap*
   (an expert of the hottest GPU for one of a light GPU, 2 copies) or a *re-replication*
   (a replica of an expert with >= 2 replicas is overwritten by a new replica of an
   expert of the hottest GPU, 1 copy). A move must leave both GPUs it touches below the
   old maximum, so on a *plateau* of tied maxima it relieves one of them even though the
   layer's maximum drops only when all are relieved: a compound move. Its moves form a
   per-layer sequence of (copies, drop of the layer's maximum); the upper concave hull
   of that sequence groups them into segments of decreasing gain per copy, and segments
   are accepted over all layers, most valuable first, while their gain per GiB is >=
   ``params.min_gain_per_gib`` (and > 0) and the bytes fit under ``params.max_bytes``
   (:func:`accept_prefixes`). A plateau's zero-gain moves are thereby accepted only
   together with the move that lowers the maximum.
3. **From-scratch candidate**, for the layers where the local search stays above the
   mean GPU load by more than ``params.restart_gap`` (elsewhere it cannot beat the
   local one by more) and the layers whose map in force is so far from balanced (above
   ``1 + _FAR`` times the mean: first placement, a shift of the hot experts) that the
   local search is skipped: the published replica rule (capped at one replica per GPU)
   and greedy packing onto the least-loaded GPU without that expert
   (:func:`greedy_start`; under node-limited routing expert groups are first packed
   onto nodes by the published balanced packing, so groups change node), polished by
   the same search. It is then *matched* to the base (:func:`match_to`): its GPUs are
   relabelled to the base's GPUs (nodes first under node-limited routing) greedily by
   the number of experts they share, and within each GPU an expert already there keeps
   its slot, so it moves the fewest copies a relabelling allows. The search breaks ties
   by GPU and slot order, so the matched map is polished once more under its final
   labels. Each polish keeps the moves up to the last that lowers the max
   (:func:`polished`).
4. **Choice per layer** (:func:`choose`): the scratch layer replaces the local one when
   it beats what the local search reaches with every move kept by more than
   ``restart_gap`` x the layer's mean GPU load (moves from the map in force cannot get
   there), or beats the accepted local layer by a drop that pays for its extra copies
   at ``min_gain_per_gib`` (within ``max_bytes``, most valuable layers first).
5. **Noise gate** (``core.eplb.window``): a layer keeps its change only when the drop of
   its maximum exceeds ``noise_z`` standard errors of the window's sampling noise, and
   the map changes only when the overall gain exceeds the overall threshold. Without a
   noise estimate (``load_var`` None) the gate is open.

6. **Noise floor** (:func:`noise_floor`): with a noise estimate, a layer's search (local
   and scratch polish) stops once its max GPU load is at most the layer mean plus
   ``sqrt(2 ln G)`` standard deviations of a GPU's load (the excess of the hottest of
   ``G`` GPUs that sampling noise alone produces on a perfectly balanced map); further
   moves would chase noise that the gate rejects anyway. It depends on the loads only
   (each expert counted as one replica), so a rerun on the same window stops at the same
   place. It also bounds the CPU time: the search no longer polishes below the noise.
7. **Drift gate** (:func:`drift_of`, :func:`drift_gate`): a map in force fitted to an
   earlier window shows, on this window, how far one period of drift carried it above
   the noise floor (``drift``, per layer). A change of that layer only pays off on the
   next window to the extent it survives the next period's drift, so its gain is valued
   as the drop of ``hypot(max - floor, drift)`` (the layer's own excess and the drift
   combined as independent errors; the plain drop of the max without drift), and a
   fitted layer keeps its change only when that gain pays for its copies at
   ``min_gain_per_gib``, all or nothing per layer. Under drift a fitted layer also gets
   no forced restart (rule 4's "whatever the bytes") and no shortcut past the local
   search (rule 3): a restart must pay like any move. Exempt, with the plain rule: a
   change of the hot set (most layers' map in force beyond ``1 + _FAR`` times the mean:
   every layer moved at once, not by drift), and layers still on the start-up map
   (never fitted, their imbalance says nothing about drift). All or nothing keeps the
   fixed point: a rerun starts from the candidate (itself a fixed point of rules 1-6)
   or from the unchanged base.

With no map in force the from-scratch candidate is returned (nothing to migrate).

Guarantees: no two replicas of one expert share a GPU; every expert keeps a replica;
under node-limited routing each expert group sits whole on one node; unchanged loads give
the unchanged map (the local search regenerates the rejected suffix, the scratch
candidate matches onto itself with no gain, and a zero gain never passes the gate;
rules 6 and 7 keep it, see there), unless ``max_bytes`` cut the previous run short, in
which case the next run continues.

Loads are scaled by their largest value before anything is computed (float64), so huge
and tiny values behave like ordinary ones.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb import reference, window
from fulcrum.core.eplb.layout import GroupLayout, PlacementMap, identity_map
from fulcrum.core.eplb.params import GIB, RebalanceParams

__all__ = [
    "NAME",
    "Moves",
    "accept_prefixes",
    "choose",
    "copies_per_layer",
    "expert_nodes",
    "from_scratch",
    "greedy_start",
    "limited_start",
    "local_candidate",
    "match_to",
    "place",
    "polished",
    "repair",
    "replica_counts",
    "search",
]

NAME: Final = "stable"

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]

_SWAP_PARTNER_SLOTS: Final = 64  # swap partners: the lightest GPUs holding ~this many slots
_REPLICATE_SOURCES: Final = 3  # re-replicate: this many experts of the hottest GPU
_EPS: Final = 1e-9  # relative to the layer's mean GPU load
_FLOOR: Final = 0.25  # search floor, as a fraction of the acceptance threshold per copy
_TIE: Final = 1e-7  # tie-break weight, relative to the gain (tokens per token)
_SCRATCH_MARGIN: Final = 1e-9  # scratch must beat local by this fraction of the layer mean
_FAR: Final = 0.25  # map in force this far above the layer mean: no local search


class Moves(NamedTuple):
    """Moves of one search iteration, one entry per layer that moved; each shape (k,).

    ``slot_b`` is -1 for a re-replication (``expert_b`` then unused); ``max_before`` is
    the layer's max GPU load (tokens) before the move.
    """

    layer: I64
    slot_a: I64
    expert_a: I64
    slot_b: I64
    expert_b: I64
    copies: I64
    max_before: F64


class Trace(NamedTuple):
    """All moves of a search (``moves[k]`` = iteration k) and the final max GPU load (L,)."""

    moves: list[Moves]
    final_max: F64


def replica_counts(phy: I64, n_logical: int) -> I64:
    """Replicas of each expert, shape (L, E), from a map (L, P)."""
    n_layers = phy.shape[0]
    keys = (np.arange(n_layers)[:, None] * n_logical + phy).ravel()
    cnt: I64 = np.bincount(keys, minlength=n_layers * n_logical).reshape(n_layers, n_logical)
    return cnt.astype(np.int64, copy=False)


def _gpu_loads(w: F64, phy: I64, n_gpus: int) -> F64:
    """Tokens per GPU, shape (L, G), of map ``phy`` (L, P) under loads ``w`` (L, E)."""
    rows = np.arange(phy.shape[0])[:, None]
    per_slot = (w / np.maximum(replica_counts(phy, w.shape[1]), 1))[rows, phy]
    out: F64 = per_slot.reshape(phy.shape[0], n_gpus, -1).sum(axis=2)
    return out


def copies_per_layer(old: I64, new: I64, n_gpus: int, n_logical: int) -> I64:
    """(GPU, expert) pairs of ``new`` not held by ``old``, per layer, shape (L,)."""
    n_layers, n_phys = old.shape
    rows = np.arange(n_layers)[:, None]
    gpu = (np.arange(n_phys) // (n_phys // n_gpus))[None, :]
    held = np.zeros((n_layers, n_gpus, n_logical), dtype=np.bool_)
    held[rows, gpu, old] = True
    wanted = np.zeros_like(held)
    wanted[rows, gpu, new] = True
    out: I64 = (wanted & ~held).sum(axis=(1, 2)).astype(np.int64)
    return out


# -- starts and repair ---------------------------------------------------------------------


def greedy_start(w: F64, n_gpus: int, spg: int, n_logical: int) -> I64:
    """From-scratch map, shape (L, G * spg): replica counts by the published rule (at most
    one replica per GPU), heaviest replica first onto the least-loaded GPU with room that
    does not hold that expert. ``w``: (L, E) tokens."""
    n_layers = w.shape[0]
    n_phys = n_gpus * spg
    rows = np.arange(n_layers)
    cnt = np.ones((n_layers, n_logical), dtype=np.int64)
    score = np.where(cnt < n_gpus, w / cnt, -np.inf)  # updated where cnt changes
    for _ in range(n_phys - n_logical):
        best = np.argmax(score, axis=1)
        c = cnt[rows, best] + 1
        cnt[rows, best] = c
        score[rows, best] = np.where(c < n_gpus, w[rows, best] / c, -np.inf)
    items = np.stack([np.repeat(np.arange(n_logical), cnt[i]) for i in range(n_layers)])
    item_load = np.take_along_axis(w / cnt, items, axis=1)
    order = np.argsort(-item_load, axis=1, kind="stable")
    items = np.take_along_axis(items, order, axis=1)
    item_load = np.take_along_axis(item_load, order, axis=1)
    # an expert's replicas are adjacent in ``items`` (equal loads, stable sort), so the
    # GPUs holding the current expert are tracked for the current run only, and only up
    # to the last position where any layer continues a run; a GPU holding it costs
    # ``big`` (more than any pack load: taken only in a dead end, which repair fixes), a
    # full GPU costs inf. Flat indices: (layer, GPU) -> layer * G + GPU.
    key = np.zeros(n_layers * n_gpus)  # pack load, inf once full
    pack_n = np.zeros(n_layers * n_gpus, dtype=np.int64)
    phy = np.zeros(n_layers * n_phys, dtype=np.int64)
    key2 = key.reshape(n_layers, n_gpus)
    on_cur = np.zeros((n_layers, n_gpus), dtype=np.bool_)
    big = 4.0 * float(w.sum(axis=1).max(initial=0.0)) + 1.0
    cont = np.zeros((n_layers, n_phys), dtype=np.bool_)  # item j continues j - 1's run
    cont[:, 1:] = items[:, 1:] == items[:, :-1]
    runs = np.flatnonzero(cont.any(axis=0))
    last_run = int(runs[-1]) if runs.size else -1
    g_off, p_off = rows * n_gpus, rows * n_phys
    items_t, load_t, cont_t = items.T.copy(), item_load.T.copy(), cont.T.copy()  # by j
    for j in range(n_phys):
        if j <= last_run:
            on_cur &= cont_t[j][:, None]
            g = np.argmin(key2 + big * on_cur, axis=1)
            on_cur[rows, g] = True
        else:
            g = np.argmin(key2, axis=1)
        idx = g_off + g
        n_g = pack_n[idx]
        phy[p_off + g * spg + n_g] = items_t[j]
        n_g += 1
        pack_n[idx] = n_g
        key[idx] += load_t[j]
        key[idx[n_g == spg]] = np.inf
    return phy.reshape(n_layers, n_phys)


def limited_start(w: F64, layout: GroupLayout) -> tuple[I64, I64]:
    """From-scratch map (L, P) and node of each expert (L, E) under node-limited routing.

    Whole expert groups are packed onto nodes by the published balanced packing of group
    loads, then each node is started like a group of its own (:func:`greedy_start`)."""
    n_layers, n_logical = w.shape
    n_nodes, size = layout.n_nodes, layout.group_size
    per_node = n_logical // n_nodes
    group_w = w.reshape(n_layers, layout.n_groups, size).sum(axis=2)
    gpack, _ = reference.balanced_packing(group_w, n_nodes)
    enode: I64 = np.repeat(gpack, size, axis=1)
    perm = np.argsort(enode, axis=1, kind="stable")  # experts in node-major order
    w_local = np.take_along_axis(w, perm, axis=1).reshape(n_layers * n_nodes, per_node)
    local = greedy_start(w_local, layout.gpus_per_node, layout.slots_per_gpu, per_node)
    phy = np.take_along_axis(perm.reshape(n_layers * n_nodes, per_node), local, axis=1)
    return phy.reshape(n_layers, layout.n_physical), enode


def expert_nodes(phy: I64, layout: GroupLayout) -> I64:
    """Node of each expert, shape (L, E), read from a map (L, P) (node-limited layouts).

    A layer whose every expert group sits on one node, ``n_groups / n_nodes`` groups per
    node, keeps that assignment; otherwise whole groups are assigned greedily, the
    (group, node) pair holding the most replicas first (ties: lower group, then node)."""
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


def repair(phy: I64, w: F64, n_gpus: int, spg: int, enode: I64 | None, dom: int | None) -> I64:
    """A copy of ``phy`` (L, P) without co-located replicas, with every expert placed and,
    with ``enode`` (L, E) and ``dom`` GPUs per node, every replica on its expert's node.

    Freed slots go first to missing experts (hottest first; if no slot of the node is
    free, the lightest replica of an expert with >= 2 replicas there), then to the
    hottest expert per replica not yet on that GPU."""
    phy = phy.copy()
    n_layers, n_phys = phy.shape
    n_logical = w.shape[1]
    slot_node = np.arange(n_phys) // spg // (n_gpus if dom is None else dom)
    grouped = np.sort(phy.reshape(n_layers, n_gpus, spg), axis=-1)
    dup = (grouped[..., 1:] == grouped[..., :-1]).any(axis=(1, 2))
    missing = (replica_counts(phy, n_logical) == 0).any(axis=1)
    en_all = np.zeros((n_layers, n_logical), dtype=np.int64) if enode is None else enode
    foreign = (en_all[np.arange(n_layers)[:, None], phy] != slot_node[None, :]).any(axis=1)
    for layer in np.flatnonzero(dup | missing | foreign).tolist():
        _repair_row(phy[layer], w[layer], en_all[layer], slot_node, n_gpus, spg)
    return phy


def _repair_row(row: I64, wl: F64, en: I64, slot_node: I64, n_gpus: int, spg: int) -> None:
    """:func:`repair` of one layer, in place. ``row`` (P,), ``wl`` and ``en`` (E,)."""
    n_logical = wl.size
    cnt = np.bincount(row, minlength=n_logical)
    on = np.zeros((n_logical, n_gpus), dtype=np.bool_)
    free: list[int] = []
    for s in range(row.size):
        g, e = s // spg, int(row[s])
        if on[e, g] or en[e] != slot_node[s]:
            free.append(s)
            cnt[e] -= 1
        else:
            on[e, g] = True
    for e in sorted(np.flatnonzero(cnt == 0).tolist(), key=lambda x: (-wl[x], x)):
        here = [i for i, f in enumerate(free) if slot_node[f] == en[e]]
        if here:
            s = free.pop(here[0])
        else:
            donors = np.flatnonzero((cnt[row] >= 2) & (slot_node == en[e]))
            s = int(donors[np.argmin(wl[row[donors]] / cnt[row[donors]])])
            cnt[row[s]] -= 1
            on[row[s], s // spg] = False
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


# -- local search --------------------------------------------------------------------------


class _Geometry(NamedTuple):
    """Fixed sizes of a search: GPUs, slots per GPU, GPUs per move domain (node)."""

    n_gpus: int
    spg: int
    dom: int
    n_dom: int
    n_logical: int
    k_partner: int  # swap partners per move
    k_src: int  # re-replication sources per move
    n_targets: int  # re-replication target slots per layer
    slot_gpu: I64  # (P,) GPU of each slot


@dataclass
class _State:
    """Working arrays of a search, all layers; rows are recomputed only where a move
    changed them, from the same expressions, so they equal a recomputation from scratch."""

    w: F64  # (L, E) tokens
    phy: I64  # (L, P) map
    cnt: I64  # (L, E) replicas
    on: B  # (L, E, G) expert held by GPU
    sl: F64  # (L, P) tokens per slot
    gl: F64  # (L, G) tokens per GPU
    single: B  # (L, P) slot holds an expert with one replica
    tgt: I64  # (L, n_targets) re-replication target slots


class _Hot(NamedTuple):
    """The active layers' hottest GPU and their swap partners; each shape (n,) or (n, k)."""

    act: I64
    gla: F64
    g0: I64
    lmax: F64
    partners: I64


class _Best(NamedTuple):
    """Best move of one kind per active layer: gain (tokens, -inf none) and its index."""

    gain: F64
    idx: I64


def _slot_loads(st: _State, lay: I64) -> F64:
    out: F64 = (st.w[lay] / st.cnt[lay])[np.arange(lay.size)[:, None], st.phy[lay]]
    return out


def _singles(st: _State, lay: I64) -> B:
    out: B = (st.cnt[lay] < 2)[np.arange(lay.size)[:, None], st.phy[lay]]
    return out


def _targets(geo: _Geometry, single: B) -> I64:
    """Re-replication targets: slots whose expert has >= 2 replicas come first (L', T)."""
    n_phys = single.shape[1]
    if geo.n_targets < n_phys:
        out: I64 = np.argpartition(single, geo.n_targets - 1, axis=1)[:, : geo.n_targets]
        return out
    return np.broadcast_to(np.arange(n_phys), (single.shape[0], n_phys)).copy()


def _new_state(w: F64, phy: I64, geo: _Geometry) -> _State:
    n_layers = w.shape[0]
    every = np.arange(n_layers)
    cnt = replica_counts(phy, geo.n_logical)
    on = np.zeros((n_layers, geo.n_logical, geo.n_gpus), dtype=np.bool_)
    on[every[:, None], phy, geo.slot_gpu[None, :]] = True
    st = _State(w, phy, cnt, on, np.zeros(0), np.zeros(0), np.zeros(0, bool), np.zeros(0, int))
    st.sl = _slot_loads(st, every)
    st.gl = st.sl.reshape(n_layers, geo.n_gpus, geo.spg).sum(axis=2)
    st.single = _singles(st, every)
    st.tgt = _targets(geo, st.single)
    return st


def _hottest(geo: _Geometry, st: _State, act: I64) -> _Hot:
    """Hottest GPU of each active layer and the lightest GPUs of its domain."""
    n = act.size
    r0 = np.arange(n)
    gla = st.gl[act]
    order = np.argsort(-gla, axis=1, kind="stable")
    g0 = order[:, 0]
    k = geo.k_partner
    if geo.n_dom == 1:
        partners = order[:, geo.n_gpus - k :]
    else:
        d0 = g0 // geo.dom
        in_dom = gla.reshape(n, geo.n_dom, geo.dom)[r0, d0]
        o_dom = np.argsort(-in_dom, axis=1, kind="stable")
        partners = d0[:, None] * geo.dom + o_dom[:, geo.dom - k :]
    return _Hot(act, gla, g0, gla[r0, g0], partners)


def _best_swaps(geo: _Geometry, st: _State, hot: _Hot) -> tuple[_Best, I64, I64]:
    """Swaps of a slot of the hottest GPU with a slot of a partner GPU.

    Gain = old max - max of the two GPUs' new loads (both must end below the old max).
    Returns the best per layer, and the candidate slots a (n, S) and b (n, kS)."""
    act, n, spg = hot.act, hot.act.size, geo.spg
    ra, r0 = act[:, None], np.arange(n)
    a_slots = hot.g0[:, None] * spg + np.arange(spg)
    b_slots = (hot.partners[:, :, None] * spg + np.arange(spg)).reshape(n, -1)
    la, lb = st.sl[ra, a_slots], st.sl[ra, b_slots]
    d = (la[:, :, None] - lb[:, None, :]).reshape(n, spg, geo.k_partner, spg)
    glp = hot.gla[r0[:, None], hot.partners]
    lm4 = hot.lmax[:, None, None, None]
    pair_max = np.maximum(glp[:, None, :, None] + d, lm4 - d)
    gain = lm4 - pair_max
    on_flat = st.on.reshape(-1)
    base_e = act * geo.n_logical
    xa, yb = st.phy[ra, a_slots], st.phy[ra, b_slots]
    x_key = (base_e[:, None, None] + xa[:, :, None]) * geo.n_gpus
    x_there = on_flat[x_key + hot.partners[:, None, :]]
    y_there = on_flat[(base_e[:, None] + yb) * geo.n_gpus + hot.g0[:, None]]
    invalid = (d <= 0) | x_there[:, :, :, None] | y_there.reshape(n, 1, geo.k_partner, spg)
    gain[invalid] = -np.inf
    flat = gain.reshape(n, -1)
    idx = np.argmax(flat - _TIE * pair_max.reshape(n, -1), axis=1)  # ties: most even pair
    return _Best(flat[r0, idx], idx), a_slots, b_slots


def _best_replications(geo: _Geometry, st: _State, hot: _Hot) -> tuple[_Best, I64, I64]:
    """New replicas of a hot expert over a replica of an expert with >= 2 replicas.

    The load of the other GPUs holding the overwritten expert is bounded from above by
    its hottest host. Returns the best per layer, the source experts (n, k) and the
    target slots (n, T)."""
    act, n = hot.act, hot.act.size
    ra, r0, r1 = act[:, None], np.arange(n), np.arange(n)[:, None]
    xa = st.phy[ra, hot.g0[:, None] * geo.spg + np.arange(geo.spg)]
    cx, wx = st.cnt[ra, xa], st.w[ra, xa]
    relief = wx / cx - wx / (cx + 1)
    src = np.argsort(-relief, axis=1, kind="stable")[:, : geo.k_src]
    xs, dx = xa[r1, src], relief[r1, src]
    new_x = wx[r1, src] / (cx[r1, src] + 1)
    t_slots = st.tgt[act]
    yt = st.phy[ra, t_slots]
    cy, wy = st.cnt[ra, yt], st.w[ra, yt]
    gt = geo.slot_gpu[t_slots]
    multi = cy >= 2
    dy = np.where(multi, wy / np.maximum(cy - 1, 1) - wy / cy, 0.0)
    ey = (r1 * geo.n_logical + yt).ravel()
    glt = hot.gla[r1, gt]
    host = np.full(n * geo.n_logical, -np.inf)
    np.maximum.at(host, ey, glt.ravel())
    y_other = host[ey].reshape(n, -1)
    pair = (glt - st.sl[ra, t_slots])[:, None, :] + new_x[:, :, None]
    pair = np.maximum(pair, (hot.lmax[:, None] - dx)[:, :, None])
    pair = np.maximum(pair, (y_other + dy)[:, None, :])
    if geo.n_dom > 1:
        multi &= gt // geo.dom == (hot.g0 // geo.dom)[:, None]
    on_flat = st.on.reshape(-1)
    base_e = act * geo.n_logical
    x_held = on_flat[(base_e[:, None, None] + xs[:, :, None]) * geo.n_gpus + gt[:, None, :]]
    gain = hot.lmax[:, None, None] - pair
    gain[x_held | ~multi[:, None, :]] = -np.inf
    flat = gain.reshape(n, -1)
    idx = np.argmax(flat - _TIE * pair.reshape(n, -1), axis=1)
    return _Best(flat[r0, idx], idx), xs, t_slots


def _apply_swaps(
    geo: _Geometry, st: _State, lay: I64, sa: I64, sb: I64, lmax: F64
) -> tuple[Moves, I64]:
    """Swap the experts of slots ``sa`` and ``sb`` in layers ``lay``; returns the moves and
    the layers whose re-replication targets must be recomputed."""
    x, y = st.phy[lay, sa], st.phy[lay, sb]
    st.phy[lay, sa], st.phy[lay, sb] = y, x
    ga, gb = geo.slot_gpu[sa], geo.slot_gpu[sb]
    st.on[lay, x, ga] = False
    st.on[lay, y, gb] = False
    st.on[lay, x, gb] = True
    st.on[lay, y, ga] = True
    st.sl[lay, sa], st.sl[lay, sb] = st.sl[lay, sb], st.sl[lay, sa].copy()
    sl3 = st.sl.reshape(st.sl.shape[0], geo.n_gpus, geo.spg)
    st.gl[lay, ga] = sl3[lay, ga].sum(axis=1)
    st.gl[lay, gb] = sl3[lay, gb].sum(axis=1)
    s_a, s_b = st.single[lay, sa], st.single[lay, sb]
    st.single[lay, sa], st.single[lay, sb] = s_b, s_a
    return Moves(lay, sa, y, sb, x, np.full(lay.size, 2), lmax), lay[s_a != s_b]


def _apply_replications(
    geo: _Geometry, st: _State, lay: I64, slot: I64, x: I64, lmax: F64
) -> tuple[Moves, I64]:
    """Overwrite ``slot`` with a replica of ``x`` in layers ``lay``."""
    y = st.phy[lay, slot]
    st.phy[lay, slot] = x
    st.cnt[lay, x] += 1
    st.cnt[lay, y] -= 1
    g = geo.slot_gpu[slot]
    st.on[lay, y, g] = False
    st.on[lay, x, g] = True
    st.sl[lay] = _slot_loads(st, lay)
    st.gl[lay] = st.sl[lay].reshape(lay.size, geo.n_gpus, geo.spg).sum(axis=2)
    s_new = _singles(st, lay)
    differs = (s_new != st.single[lay]).any(axis=1)
    st.single[lay] = s_new
    none = np.full(lay.size, -1, dtype=np.int64)
    return Moves(lay, slot, x, none, none, np.ones(lay.size, dtype=np.int64), lmax), lay[differs]


def _geometry(n_gpus: int, spg: int, n_logical: int, dom: int | None) -> _Geometry:
    d = n_gpus if dom is None else dom
    n_phys = n_gpus * spg
    return _Geometry(
        n_gpus=n_gpus,
        spg=spg,
        dom=d,
        n_dom=n_gpus // d,
        n_logical=n_logical,
        k_partner=int(np.clip(_SWAP_PARTNER_SLOTS // spg, 1, max(d - 1, 1))),
        k_src=min(spg, _REPLICATE_SOURCES),
        n_targets=max(1, min(n_phys, 2 * (n_phys - n_logical))),
        slot_gpu=np.arange(n_phys) // spg,
    )


def search(
    w: F64,
    phy: I64,
    n_gpus: int,
    spg: int,
    max_iter: int,
    floor: float,
    dom: int | None,
    stop: F64 | None = None,
) -> tuple[I64, Trace]:
    """Local search (rule 2) on all layers at once from map ``phy`` (L, P), loads ``w``
    (L, E) tokens; returns the final map and the trace of moves.

    A layer stops when its best move relieves the hottest GPU by no more than ``floor``
    tokens per copy (at least 1e-9 of its mean GPU load), or after ``G`` moves in a row
    that did not lower its maximum, or once its max GPU load is at most ``stop`` (L,)
    tokens (the noise floor, rule 6). With ``dom`` GPUs per node every move stays inside
    the node of the hottest GPU."""
    geo = _geometry(n_gpus, spg, w.shape[1], dom)
    st = _new_state(w, phy.copy(), geo)
    n_layers = w.shape[0]
    floors = np.maximum(_EPS * w.sum(axis=1) / n_gpus, floor)
    active = (w.sum(axis=1) > 0) & (n_gpus > 1)
    if stop is not None:
        active &= st.gl.max(axis=1) > stop
    best_max = st.gl.max(axis=1)
    stall = np.zeros(n_layers, dtype=np.int64)
    moves: list[Moves] = []
    for _ in range(max_iter):
        act = np.flatnonzero(active)
        if act.size == 0:
            break
        hot = _hottest(geo, st, act)
        lowered = hot.lmax < best_max[act]
        best_max[act] = np.minimum(best_max[act], hot.lmax)
        stall[act] = np.where(lowered, 0, stall[act] + 1)
        swap, a_slots, b_slots = _best_swaps(geo, st, hot)
        rep, xs, t_slots = _best_replications(geo, st, hot)
        use_swap = swap.gain / 2.0 >= rep.gain
        per_copy = np.where(use_swap, swap.gain / 2.0, rep.gain)
        moving = (per_copy > floors[act]) & (stall[act] <= n_gpus)
        if stop is not None:
            moving &= hot.lmax > stop[act]
        active[act[~moving]] = False
        if not moving.any():
            break
        sw = np.flatnonzero(moving & use_swap)
        rp = np.flatnonzero(moving & ~use_swap)
        swaps, reps = (sw, swap, a_slots, b_slots), (rp, rep, xs, t_slots)
        moves.append(_apply(geo, st, act, hot, swaps, reps))
    return st.phy, Trace(moves=moves, final_max=st.gl.max(axis=1))


def _apply(
    geo: _Geometry, st: _State, act: I64, hot: _Hot, swaps: tuple[Any, ...], reps: tuple[Any, ...]
) -> Moves:
    """Apply one iteration's chosen swaps (layers ``sw`` of ``act``) and replications
    (layers ``rp``) in place on ``st``; returns the moves made."""
    sw, swap, a_slots, b_slots = swaps
    rp, rep, xs, t_slots = reps
    parts: list[Moves] = []
    redo: list[I64] = []
    if sw.size:
        ia, ib = np.divmod(swap.idx[sw], b_slots.shape[1])
        mv, r = _apply_swaps(geo, st, act[sw], a_slots[sw, ia], b_slots[sw, ib], hot.lmax[sw])
        parts.append(mv)
        redo.append(r)
    if rp.size:
        ix, jt = np.divmod(rep.idx[rp], t_slots.shape[1])
        mv, r = _apply_replications(geo, st, act[rp], t_slots[rp, jt], xs[rp, ix], hot.lmax[rp])
        parts.append(mv)
        redo.append(r)
    return _joined(geo, st, parts, redo)


def _joined(geo: _Geometry, st: _State, parts: list[Moves], redo: list[I64]) -> Moves:
    """One iteration's moves as one :class:`Moves`; the layers in ``redo`` get fresh
    targets (in place on ``st``)."""
    again = np.concatenate(redo)
    if again.size:
        st.tgt[again] = _targets(geo, st.single[again])
    if len(parts) == 1:
        return parts[0]
    return Moves(*map(np.concatenate, zip(*parts, strict=True)))


# -- migration budget ----------------------------------------------------------------------


def _hull_segments(copies: list[int], gains: list[float]) -> list[tuple[int, int, float]]:
    """Upper concave hull of the cumulative (copies, gain) curve from the origin:
    (end move count, copies in the segment, gain per copy) per segment, gain per copy
    strictly decreasing."""
    pts: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]
    c_sum = g_sum = 0.0
    for k, (c, g) in enumerate(zip(copies, gains, strict=True), start=1):
        c_sum += c
        g_sum += g
        while len(pts) >= 2:
            (x1, y1, _), (x2, y2, _) = pts[-2], pts[-1]
            if (x2 - x1) * (g_sum - y1) - (y2 - y1) * (c_sum - x1) >= 0:
                pts.pop()
            else:
                break
        pts.append((c_sum, g_sum, k))
    return [
        (k2, int(x2 - x1), (y2 - y1) / (x2 - x1))
        for (x1, y1, _), (x2, y2, k2) in itertools.pairwise(pts)
    ]


class _Segment(NamedTuple):
    neg_slope: float
    layer: int
    end: int
    copies: int


def accept_prefixes(
    trace: Trace, n_layers: int, total_mean: float, per_copy: float, budget: int | None
) -> I64:
    """Accepted number of moves per layer (rule 2), shape (L,).

    Args:
        per_copy: least overall moe_lb gain per copy accepted.
        budget: most copies accepted over all layers (None = no cap).
    """
    lay = np.concatenate([mv.layer for mv in trace.moves])
    copies_all = np.concatenate([mv.copies for mv in trace.moves])
    before_all = np.concatenate([mv.max_before for mv in trace.moves])
    order = np.argsort(lay, kind="stable")  # by layer, then by iteration (= move order)
    lay, copies_all, before_all = lay[order], copies_all[order], before_all[order]
    bounds = np.searchsorted(lay, np.arange(n_layers + 1))
    segments: list[_Segment] = []
    for layer in range(n_layers):
        lo, hi = int(bounds[layer]), int(bounds[layer + 1])
        if lo == hi:
            continue
        before = before_all[lo:hi]
        gains = ((before - np.append(before[1:], trace.final_max[layer])) / total_mean).tolist()
        for end, n_copies, slope in _hull_segments(copies_all[lo:hi].tolist(), gains):
            segments.append(_Segment(-slope, layer, end, n_copies))
    segments.sort()
    accepted = np.zeros(n_layers, dtype=np.int64)
    blocked = np.zeros(n_layers, dtype=np.bool_)
    for seg in segments:
        if blocked[seg.layer]:
            continue
        slope = -seg.neg_slope
        # A gain within float rounding of zero is no gain (a tie between two hottest
        # GPUs leaves the max where it was, up to an ulp): under min_gain_per_gib = 0 it
        # would move experts for nothing, and a rerun on unchanged loads would move again.
        if slope <= _EPS or slope < per_copy or (budget is not None and seg.copies > budget):
            blocked[seg.layer] = True
            continue
        if budget is not None:
            budget -= seg.copies
        accepted[seg.layer] = seg.end
    return accepted


def _replay(base: I64, trace: Trace, accepted: I64) -> I64:
    """``base`` (L, P) with the first ``accepted[l]`` moves of each layer applied."""
    phy = base.copy()
    for k, mv in enumerate(trace.moves):
        keep = accepted[mv.layer] > k
        if not keep.any():
            continue
        lay, sb = mv.layer[keep], mv.slot_b[keep]
        phy[lay, mv.slot_a[keep]] = mv.expert_a[keep]
        two = sb >= 0
        phy[lay[two], sb[two]] = mv.expert_b[keep][two]
    return phy


# -- matching a from-scratch map to the map in force ---------------------------------------


def _greedy_assignment(score: F64) -> I64:
    """A permutation per layer maximising ``score`` greedily, shape (L, n).

    ``score`` (L, n, n): value of sending new item i to old position j (-inf forbidden).
    Each round takes, in every layer, every remaining pair that is the best of both its
    row and its column (ties: lowest index), which the one-pair-at-a-time greedy would
    also take (the best remaining pair is always among them, so a round never stalls
    while an allowed pair is left), and strikes out their rows and columns; pairs left
    when only forbidden ones remain are matched first free i to first free j. The result
    is always a permutation (a 1/2-approximation of the best total)."""
    n_layers, n, _ = score.shape
    s = score.astype(np.float64, copy=True)
    s_t = s.transpose(0, 2, 1).copy()  # s_t[l, j, i] = s[l, i, j]: contiguous column scans
    out = np.full((n_layers, n), -1, dtype=np.int64)
    free_i = np.ones((n_layers, n), dtype=np.bool_)
    free_j = np.ones((n_layers, n), dtype=np.bool_)
    ident = np.arange(n)
    for _ in range(n):
        row_best = np.argmax(s, axis=2)  # (L, n): best j of each i
        col_best = np.argmax(s_t, axis=2)  # (L, n): best i of each j
        best_val = np.take_along_axis(s, row_best[..., None], axis=2)[..., 0]
        mutual = free_i & (best_val > -np.inf)
        mutual &= np.take_along_axis(col_best, row_best, axis=1) == ident
        if not mutual.any():
            break
        lay, i = np.nonzero(mutual)
        j = row_best[lay, i]
        out[lay, i] = j
        free_i[lay, i] = False
        free_j[lay, j] = False
        s[lay, i, :] = -np.inf
        s[lay, :, j] = -np.inf
        s_t[lay, :, i] = -np.inf
        s_t[lay, j, :] = -np.inf
    for layer in np.flatnonzero(free_i.any(axis=1)).tolist():
        out[layer, free_i[layer]] = np.flatnonzero(free_j[layer])
    return out


def _overlap(base: I64, new: I64, n_gpus: int, n_logical: int) -> F64:
    """overlap[l, g_new, g_old] (L, G, G): experts of ``new``'s GPU g_new that ``base``'s
    GPU g_old holds (maps (L, P) without co-located replicas). Every (new slot, old slot)
    pair holding the same expert is listed by a sort join and counted once."""
    n_layers, n_phys = base.shape
    spg = n_phys // n_gpus
    lay_off = (np.arange(n_layers) * n_logical)[:, None]
    k_old = (lay_off + base).ravel()
    k_new = (lay_off + new).ravel()
    o = np.argsort(k_old, kind="stable")
    lo = np.searchsorted(k_old[o], k_new, side="left")
    hi = np.searchsorted(k_old[o], k_new, side="right")
    reps = hi - lo
    s_new = np.repeat(np.arange(k_new.size), reps)
    starts = np.repeat(lo - np.concatenate(([0], np.cumsum(reps)[:-1])), reps)
    s_old = o[np.arange(s_new.size) + starts]
    layer = s_new // n_phys
    key = (layer * n_gpus + (s_new % n_phys) // spg) * n_gpus + (s_old % n_phys) // spg
    cnt = np.bincount(key, minlength=n_layers * n_gpus * n_gpus)
    out: F64 = cnt.reshape(n_layers, n_gpus, n_gpus).astype(np.float64)
    return out


def match_to(base: I64, new: I64, n_gpus: int, n_logical: int, dom: int | None) -> I64:
    """``new`` (L, P) with its GPUs relabelled to ``base``'s and slots aligned.

    GPUs (whole nodes first when ``dom`` GPUs per node are given, then GPUs within
    matched nodes) are assigned greedily by the number of experts they share with the
    base's; inside a GPU, an expert the base GPU already holds keeps its slot. Loads per
    GPU, replica counts and validity are those of ``new``; only labels change."""
    n_layers, n_phys = new.shape
    spg = n_phys // n_gpus
    d = n_gpus if dom is None else dom
    n_nodes = n_gpus // d
    rows = np.arange(n_layers)[:, None]
    overlap = _overlap(base, new, n_gpus, n_logical)
    allowed = np.ones((n_layers, n_gpus, n_gpus), dtype=np.bool_)
    if n_nodes > 1:
        node_ov = overlap.reshape(n_layers, n_nodes, d, n_nodes, d).sum(axis=(2, 4))
        node_map = _greedy_assignment(node_ov)  # (L, nodes new) -> node old
        gnode = np.arange(n_gpus) // d
        allowed = node_map[:, gnode][:, :, None] == gnode[None, None, :]
    perm = _greedy_assignment(np.where(allowed, overlap, -np.inf))  # new GPU -> old GPU
    out3 = np.zeros((n_layers, n_gpus, spg), dtype=np.int64)  # perm writes every row
    out3[rows, perm] = new.reshape(n_layers, n_gpus, spg)
    return _align_slots(base.reshape(n_layers, n_gpus, spg), out3).reshape(n_layers, n_phys)


def _align_slots(old3: I64, new3: I64) -> I64:
    """Per GPU (L, G, S): experts of ``new3`` already at the old GPU keep their old slot;
    the others fill the remaining slots in order."""
    match = new3[..., :, None] == old3[..., None, :]  # (L, G, S new, S old)
    kept_pos = match.any(axis=-2)  # old slot keeps its expert
    new_kept = match.any(axis=-1)  # new expert was already there
    pos_order = np.argsort(kept_pos, axis=-1, kind="stable")  # free slots first
    new_order = np.argsort(new_kept, axis=-1, kind="stable")  # newcomers first
    n_free = (~kept_pos).sum(axis=-1, keepdims=True)
    rank = np.arange(old3.shape[-1])
    vals = np.where(
        rank < n_free,
        np.take_along_axis(new3, new_order, axis=-1),
        np.take_along_axis(old3, pos_order, axis=-1),
    )
    out = old3.copy()
    np.put_along_axis(out, pos_order, vals, axis=-1)
    return out


# -- choice and entry point ----------------------------------------------------------------


def _copies_where_changed(old: I64, new: I64, n_gpus: int, n_logical: int) -> I64:
    """:func:`copies_per_layer`, computed only for the layers that differ (others 0)."""
    out = np.zeros(old.shape[0], dtype=np.int64)
    diff = np.flatnonzero((old != new).any(axis=1))
    if diff.size:
        out[diff] = copies_per_layer(old[diff], new[diff], n_gpus, n_logical)
    return out


def choose(
    base: I64,
    local: I64,
    reach: F64,
    scratch: I64,
    w: F64,
    n_gpus: int,
    per_copy: float,
    gap: float,
    budget: int | None,
    forced: B | None = None,
) -> I64:
    """Per layer, the local map or the scratch map (rule 4), shape (L, P).

    ``forced`` (L,): layers that may take the scratch whatever the bytes (None: all).

    ``reach`` (L,) is the max GPU load the local search reaches when every move is
    kept. The scratch layer is taken when its max GPU load is lower than ``reach`` by
    more than ``gap`` x the layer's mean GPU load (the map in force is far from what a
    fresh placement achieves and moves from it cannot get there), or lower than the
    accepted local map's by an amount whose drop in overall moe_lb pays for its extra
    copies at ``per_copy``; under a ``budget`` (copies) the most valuable layers go
    first."""
    n_log = w.shape[1]
    mean = w.sum(axis=1) / n_gpus
    total_mean = max(float(mean.sum()), float(np.finfo(np.float64).tiny))
    m_loc = _gpu_loads(w, local, n_gpus).max(axis=1)
    m_scr = _gpu_loads(w, scratch, n_gpus).max(axis=1)
    c_loc = _copies_where_changed(base, local, n_gpus, n_log)
    c_scr = _copies_where_changed(base, scratch, n_gpus, n_log)
    drop = m_loc - m_scr
    extra = c_scr - c_loc
    far = reach - m_scr > gap * mean
    if forced is not None:
        far &= forced
    pays = (drop > _SCRATCH_MARGIN * mean) & (drop / total_mean >= per_copy * np.maximum(extra, 0))
    better = far | pays
    take = np.zeros(w.shape[0], dtype=np.bool_)
    spent = int(c_loc.sum())
    for layer in np.argsort(-drop / np.maximum(extra, 1), kind="stable").tolist():
        if not better[layer]:
            continue
        if budget is not None and spent + int(extra[layer]) > budget:
            continue
        take[layer] = True
        spent += int(extra[layer])
    out: I64 = np.where(take[:, None], scratch, local)
    return out


def drift_of(
    prev: I64, layout: GroupLayout, m_base: F64, mean: F64, floor: F64
) -> tuple[F64, B] | None:
    """How far one period of drift carried each layer's map in force above the noise
    floor, tokens, shape (L,) (rule 7); None after a change of the hot set.

    The map in force was fitted to an earlier window, so its excess over the noise floor
    ``floor`` (L,) on this window is what the loads' change since did to it. A change of
    the hot set moves every layer: when most layers' map in force is beyond ``1 + _FAR``
    times the mean, the loads changed rather than drifted and None is returned. A layer
    still on the start-up map (:func:`~fulcrum.core.eplb.layout.identity_map`) was never
    fitted to any loads: its drift is 0. Returns the drift and the fitted layers (L,)."""
    ratio = m_base / np.maximum(mean, np.finfo(np.float64).tiny)  # empty layers: 0
    if float(np.median(ratio)) > 1.0 + _FAR:
        return None
    fitted = (prev != np.asarray(identity_map(layout).phy2log)).any(axis=1)
    out: F64 = np.where(fitted, np.maximum(m_base - floor, 0.0), 0.0)
    return out, fitted


def drift_gate(
    base: I64,
    new: I64,
    w: F64,
    floor: F64,
    drift: F64,
    per_copy: float,
    n_gpus: int,
) -> I64:
    """``new`` (L, P) with every layer reverted to ``base`` whose change does not pay for
    its copies at ``per_copy`` once its gain is valued on the next window (rule 7).

    A layer's next-window excess over the noise floor ``floor`` (L,) is modelled as its
    own excess and the drift ``drift`` (L,) (:func:`drift_of`) combined as independent
    errors, ``hypot(max - floor, drift)``; the gain is the drop of that from ``base`` to
    ``new``, in overall moe_lb. Layers without drift are left as they are."""
    total_mean = float(w.sum()) / n_gpus
    if total_mean <= 0:
        return new
    m_old = _gpu_loads(w, base, n_gpus).max(axis=1)
    m_new = _gpu_loads(w, new, n_gpus).max(axis=1)

    def excess(m: F64) -> F64:
        out: F64 = np.hypot(np.maximum(m - floor, 0.0), drift)
        return out

    gain = (excess(m_old) - excess(m_new)) / total_mean
    copies = copies_per_layer(base, new, n_gpus, w.shape[1])
    revert = (drift > 0) & (copies > 0) & (gain < per_copy * copies)
    out: I64 = np.where(revert[:, None], base, new)
    return out


def _noise_gate(base: I64, new: I64, w: F64, load_var: F64 | None, n_gpus: int, z: float) -> I64:
    """``new`` with every layer whose gain the window's noise explains reverted to
    ``base``, or ``base`` itself when the overall gain is within the noise (rule 5)."""
    if load_var is None or z <= 0:
        return new
    gl_old, gl_new = _gpu_loads(w, base, n_gpus), _gpu_loads(w, new, n_gpus)
    noise = window.layer_noise(load_var, base, new, gl_old, gl_new, n_gpus)
    drop = gl_old.max(axis=1) - gl_new.max(axis=1)
    keep = (base != new).any(axis=1) & (drop > noise.threshold(z))
    total_mean = float(w.sum()) / n_gpus
    if not keep.any() or total_mean <= 0:
        return base
    if float(drop[keep].sum()) / total_mean <= window.noise_threshold(noise, keep, total_mean, z):
        return base
    out: I64 = np.where(keep[:, None], new, base)
    return out


def _scaled(loads: F64, load_var: F64 | None) -> tuple[F64, F64 | None]:
    """Loads and variances divided by the largest load (and its square)."""
    w = np.asarray(loads, dtype=np.float64)
    top = float(w.max()) if w.size else 0.0
    if not top > 0.0:
        return np.zeros_like(w), None if load_var is None else np.zeros_like(w)
    var = None
    if load_var is not None:
        sd = np.sqrt(np.asarray(load_var, dtype=np.float64)) / top
        var = np.where(np.isfinite(sd), sd * sd, np.finfo(np.float64).max)
    return w / top, var


class _Setup(NamedTuple):
    """Sizes and thresholds of one placement."""

    n_gpus: int
    spg: int
    n_logical: int
    dom: int | None  # GPUs per node under node-limited routing
    per_copy: float  # least overall moe_lb gain per copy
    floor: float  # search floor, tokens per copy
    budget: int | None  # copies
    max_iter: int


def _setup(layout: GroupLayout, w: F64, params: RebalanceParams) -> _Setup:
    per_copy = params.min_gain_per_gib * layout.expert_bytes / GIB
    total_mean = float(w.sum()) / layout.ep_size
    return _Setup(
        n_gpus=layout.ep_size,
        spg=layout.slots_per_gpu,
        n_logical=layout.n_logical,
        dom=layout.gpus_per_node if layout.node_limited else None,
        per_copy=per_copy,
        floor=_FLOOR * per_copy * total_mean,
        budget=(
            params.max_bytes // layout.expert_bytes
            if params.max_bytes is not None and layout.expert_bytes > 0
            else None
        ),
        max_iter=params.max_iterations,
    )


def noise_floor(w: F64, load_var: F64 | None, cnt: I64 | None, n_gpus: int, z: float) -> F64 | None:
    """Max GPU load (tokens, shape (L,)) at or below which a layer's search stops (rule 6):
    the layer mean plus ``sqrt(2 ln G)`` standard deviations of a GPU's load, the excess
    of the hottest of ``G`` GPUs over the mean that sampling noise alone produces on a
    perfectly balanced map. ``cnt`` (L, E) replicas (None: one each); the GPU variance is
    the average over GPUs, ``sum_e Var(S_e) / c_e / G``. None without a noise estimate
    or with the gate off (``z`` = 0)."""
    if load_var is None or z <= 0:
        return None
    c = np.ones_like(w) if cnt is None else np.maximum(cnt, 1)
    gpu_var = (load_var / c).sum(axis=1) / n_gpus
    out: F64 = w.sum(axis=1) / n_gpus + math.sqrt(2.0 * math.log(max(n_gpus, 2))) * np.sqrt(gpu_var)
    return out


def polished(w: F64, start: I64, su: _Setup, total_mean: float, stop: F64 | None) -> I64:
    """``start`` (L', P) after the local search, cut after each layer's last move that
    lowers its max (by more than float rounding; ``total_mean`` tokens, all layers').

    A rerun from the result starts where the cut moves started, with the same state, so
    it makes them again and rejects them again: unchanged loads give the unchanged map.
    The moves the search made after its last drop (a plateau it gave up on) are not
    kept: kept, a rerun would begin a fresh plateau walk from their end."""
    _, trace = search(w, start, su.n_gpus, su.spg, su.max_iter, su.floor, su.dom, stop)
    if not trace.moves:
        return start
    return _replay(start, trace, accept_prefixes(trace, w.shape[0], total_mean, 0.0, None))


def from_scratch(
    w: F64, layout: GroupLayout, su: _Setup, total_mean: float, stop: F64 | None = None
) -> I64:
    """The from-scratch candidate (rule 3) for loads ``w`` (L', E), shape (L', P);
    ``total_mean`` tokens (all layers'); ``stop`` (L',) the search's noise floor (tokens)
    or None."""
    if su.dom is None:
        start, nodes = greedy_start(w, su.n_gpus, su.spg, su.n_logical), None
    else:
        start, nodes = limited_start(w, layout)
    start = repair(start, w, su.n_gpus, su.spg, nodes, su.dom)
    return polished(w, start, su, total_mean, stop)


def local_candidate(
    w: F64, base: I64, su: _Setup, total_mean: float, stop: F64 | None = None
) -> tuple[I64, F64]:
    """The local candidate (rule 2) from ``base`` (L', P): the accepted search prefixes,
    and the max GPU load (L',) the search reached with every move kept; ``stop`` (L',)
    the search's noise floor (tokens) or None."""
    _, trace = search(w, base, su.n_gpus, su.spg, su.max_iter, su.floor, su.dom, stop)
    if not trace.moves:
        return base, trace.final_max
    accepted = accept_prefixes(trace, w.shape[0], total_mean, su.per_copy, su.budget)
    return _replay(base, trace, accepted), trace.final_max


def _scratch(
    w: F64,
    layout: GroupLayout,
    su: _Setup,
    base: I64,
    local: I64,
    need: I64,
    stop: F64 | None,
    total_mean: float,
) -> I64:
    """``local`` with the layers ``need`` replaced by a from-scratch placement matched to
    ``base`` (fewest moves), then polished again under its final labels: the search
    breaks ties by GPU and slot order, so from the relabelled map it can find moves it
    did not find before, and a rerun on unchanged loads would make them."""
    scratch = local.copy()
    if need.size:
        cut = None if stop is None else stop[need]
        fresh = from_scratch(w[need], layout, su, total_mean, cut)
        matched = match_to(base[need], fresh, su.n_gpus, su.n_logical, su.dom)
        scratch[need] = polished(w[need], matched, su, total_mean, cut)
    return scratch


def place(
    layout: GroupLayout,
    loads: F64,
    previous: PlacementMap | None,
    params: RebalanceParams,
    load_var: F64 | None = None,
) -> PlacementMap:
    """Place by the ``stable`` rule (module docstring). Layers whose map in force is
    above ``1 + _FAR`` times the mean GPU load skip the local search (the matched
    scratch layer is their candidate); layers whose local search reaches within
    ``params.restart_gap`` of the mean skip the from-scratch candidate.

    Args:
        layout: the group's shape.
        loads: shape (L, E), tokens per logical expert over the window.
        previous: the map in force, or None for a first placement (nothing to migrate).
        params: migration weight / cap / noise z / restart gap.
        load_var: shape (L, E), variance of ``loads`` (``window.window_variance``), or None.
    """
    w, var = _scaled(loads, load_var)
    su = _setup(layout, w, params)
    total_mean = float(w.sum()) / su.n_gpus
    if previous is None:
        stop = noise_floor(w, var, None, su.n_gpus, params.noise_z)
        fresh = from_scratch(w, layout, su, max(total_mean, np.finfo(np.float64).tiny), stop)
        return PlacementMap.from_phy2log(fresh, su.n_gpus, su.n_logical)
    prev = np.asarray(previous.phy2log, dtype=np.int64)
    b_nodes = expert_nodes(prev, layout) if su.dom is not None else None
    base = repair(prev, w, su.n_gpus, su.spg, b_nodes, su.dom)
    if total_mean <= 0:
        return PlacementMap.from_phy2log(base, su.n_gpus, su.n_logical)
    mean = w.sum(axis=1) / su.n_gpus
    m_base = _gpu_loads(w, base, su.n_gpus).max(axis=1)
    stop = noise_floor(w, var, None, su.n_gpus, params.noise_z)
    lim = mean if stop is None else np.maximum(mean, stop)
    # far from balanced: no local search, the scratch layer is the candidate (unless a
    # byte cap applies, when the scratch may not fit, or restarts are off)
    restarts = su.budget is None and np.isfinite(params.restart_gap)
    # rule 7: under drift, a fitted layer gets no forced restart and no shortcut
    drift = None if stop is None else drift_of(prev, layout, m_base, mean, lim)
    forced = np.ones(w.shape[0], dtype=np.bool_) if drift is None else ~drift[1]
    very_far = (m_base > (1.0 + _FAR) * mean) & restarts & forced
    local, reach = base.copy(), m_base.copy()
    near = np.flatnonzero(~very_far)
    if near.size:
        local[near], reach[near] = local_candidate(
            w[near], base[near], su, total_mean, None if stop is None else stop[near]
        )
    # a fresh placement cannot beat the mean: only where local moves stay above it by
    # more than the restart gap is it worth computing
    need = np.flatnonzero(very_far | (reach > lim + params.restart_gap * mean))
    scratch = _scratch(w, layout, su, base, local, need, stop, total_mean)
    chosen = choose(
        base, local, reach, scratch, w, su.n_gpus, su.per_copy, params.restart_gap,
        su.budget, forced,
    )  # fmt: skip
    if drift is not None:
        chosen = drift_gate(base, chosen, w, lim, drift[0], su.per_copy, su.n_gpus)
    final = _noise_gate(base, chosen, w, var, su.n_gpus, params.noise_z)
    return PlacementMap.from_phy2log(final, su.n_gpus, su.n_logical)
