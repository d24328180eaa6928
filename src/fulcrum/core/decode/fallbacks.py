"""Ranked fallback GPUs: the best few eligible slots by ``order_conc`` (pure).

The gateway offers, besides the chosen GPU, a few others that could take the request
(fewest requests, then most free KV first: the view's ``order_conc`` key; ties: the
lowest slot), so that a client can retry elsewhere without another decision.
"""

from __future__ import annotations

import numpy as np

from fulcrum.core.decode.blocks import BLOCK
from fulcrum.core.decode.filters import Allowed
from fulcrum.core.decode.keys import INT64_MAX
from fulcrum.core.decode.view import FleetView


def best_slots(
    view: FleetView, kv_tokens: int, m: int, allowed: Allowed | None = None
) -> list[int]:
    """Up to ``m`` slots with room for ``kv_tokens`` tokens (and in ``allowed``: a sorted
    int64 array of slots or a boolean mask of shape ``(n_gpus,)``), smallest
    ``order_conc`` first (ties: lowest slot).

    One vectorised pass over the allowed slots; with every slot allowed (or a mask) on a
    view with block minima (>= 32,768 slots), only the blocks that can hold the ``m``
    best are read (:func:`best_in_blocks`; ties between blocks then go to the block read
    first)."""
    is_mask = allowed is not None and allowed.dtype == np.bool_
    if view.blocks is not None and (allowed is None or is_mask):
        return best_in_blocks(view, kv_tokens, m, allowed)
    key, head = view.order_conc, view.headroom
    if allowed is not None and is_mask:
        head = np.where(allowed, head, -1)
        allowed = None  # same slots
    elif allowed is not None:
        key, head = key[allowed], head[allowed]
    pos = (head >= kv_tokens).nonzero()[0]  # ascending positions
    if pos.shape[0] > m:
        kp = key[pos]
        t = kp.min()
        if int(np.count_nonzero(kp == t)) < m:  # (np.partition is slow on ties)
            t = np.partition(kp, m - 1)[m - 1]  # the m-th smallest key
        less = pos[kp < t]
        pos = np.concatenate([less, pos[kp == t][: m - less.shape[0]]])
    ranked = sorted(zip(key[pos].tolist(), pos.tolist(), strict=True))
    slots = [p for _k, p in ranked]
    if allowed is not None:
        slots = allowed[slots].tolist()
    return slots


def best_in_blocks(
    view: FleetView, kv_tokens: int, m: int, mask: Allowed | None = None
) -> list[int]:
    """Up to ``m`` slots with room (and in ``mask`` when given), smallest ``order_conc``
    first, read through the view's block minima (lower bounds of any slot's key in the
    block, masked or not): the ``m`` blocks with the smallest minima first, then every
    block whose minimum beats the ``m``-th key found, until none does. O(blocks + read
    slots) instead of O(n). The view must have block minima."""
    blocks = view.blocks
    assert blocks is not None
    mins = blocks.conc
    nb = int(mins.shape[0])
    n = view.n_gpus
    key, head = view.order_conc, view.headroom
    lanes = np.arange(BLOCK, dtype=np.int64)
    take = min(m, nb)
    chosen = np.argpartition(mins, take - 1)[:take] if take < nb else np.arange(nb)
    seen = np.zeros(nb, dtype=np.bool_)
    best: list[tuple[int, int]] = []
    while chosen.shape[0]:
        seen[chosen] = True
        idx = (chosen[:, None] * BLOCK + lanes).ravel()
        idx = idx[idx < n]
        ok = head[idx] >= kv_tokens
        if mask is not None:
            ok &= mask[idx]
        idx = idx[ok]
        kp = key[idx]
        if idx.shape[0] > m:
            sel = np.argpartition(kp, m - 1)[:m]
            idx, kp = idx[sel], kp[sel]
        best = sorted([*best, *zip(kp.tolist(), idx.tolist(), strict=True)])[:m]
        bound = best[-1][0] if len(best) == m else INT64_MAX
        chosen = ((mins < bound) & ~seen).nonzero()[0]
    return [slot for _k, slot in best]
