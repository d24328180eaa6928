"""Checks a map must pass before it is put in force.

Rules, for a map of a group with layout ``layout``:

- shape: ``phy2log`` is (n_layers, n_physical) integers, ``ep_size`` matches;
- slot counts: every GPU holds ``slots_per_gpu`` slots and every slot an expert id in
  ``[0, n_logical)``; the replica counts sum to ``n_physical`` in every layer;
- coverage: every logical expert has at least one replica in every layer;
- co-location (only where the algorithm promises it, ``no_colocation``): no GPU holds two
  replicas of one expert;
- node-limited routing (only where promised, ``node_limited`` and the layout is
  node-limited): every expert group keeps all its replicas on one node.
"""

from __future__ import annotations

import numpy as np

from fulcrum.core.eplb.layout import GroupLayout, PlacementMap

__all__ = ["InvalidMap", "map_problems", "validate_map"]


class InvalidMap(ValueError):
    """A computed or supplied map breaks a rule (the message names it)."""


def map_problems(
    layout: GroupLayout,
    placement: PlacementMap,
    *,
    no_colocation: bool = True,
    node_limited: bool = False,
) -> list[str]:
    """Every rule ``placement`` breaks for ``layout`` (empty when valid)."""
    p = placement.phy2log
    want = (layout.n_layers, layout.n_physical)
    if p.ndim != 2 or p.shape != want:
        return [f"shape: must be {list(want)}, got {list(p.shape)}"]
    if placement.ep_size != layout.ep_size:
        return [f"ep_size: must be {layout.ep_size}, got {placement.ep_size}"]
    if not np.issubdtype(p.dtype, np.integer):
        return [f"dtype: must be integer, got {p.dtype}"]
    if p.size and (int(p.min()) < 0 or int(p.max()) >= layout.n_logical):
        return [f"expert ids: must lie in [0, {layout.n_logical})"]
    out: list[str] = []
    counts = placement.replica_counts
    if (
        counts.shape != (layout.n_layers, layout.n_logical)
        or not (counts.sum(axis=1) == layout.n_physical).all()
    ):
        out.append("slot counts: replica counts do not add up to the physical slots")
    missing = np.argwhere(counts == 0)
    if missing.size:
        layer, expert = (int(x) for x in missing[0])
        out.append(
            f"coverage: {len(missing)} (layer, expert) pairs have no replica "
            f"(first: layer {layer}, expert {expert})"
        )
    if no_colocation and placement.colocated():
        out.append(f"co-location: {placement.colocated()} replicas share a GPU with their twin")
    if node_limited and layout.node_limited:
        node = np.arange(layout.n_physical) // (layout.n_physical // layout.n_nodes)
        seen = np.zeros((layout.n_layers, layout.n_groups, layout.n_nodes), dtype=np.bool_)
        seen[np.arange(layout.n_layers)[:, None], p // layout.group_size, node[None, :]] = True
        split = int(np.count_nonzero(seen.sum(axis=2) > 1))
        if split:
            out.append(f"node-limited: {split} (layer, expert group) pairs span several nodes")
    return out


def validate_map(
    layout: GroupLayout,
    placement: PlacementMap,
    *,
    no_colocation: bool = True,
    node_limited: bool = False,
) -> None:
    """Raise :class:`InvalidMap` naming the first rule ``placement`` breaks."""
    problems = map_problems(
        layout, placement, no_colocation=no_colocation, node_limited=node_limited
    )
    if problems:
        raise InvalidMap("; ".join(problems))
