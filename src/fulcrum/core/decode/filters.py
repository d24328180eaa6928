"""Capacity filter of the decode balancer, applied before any policy scores.

A GPU is *eligible* for a request of ``kv_tokens`` tokens iff it is live, holds fewer
than ``max_concurrency`` requests, and ``kv_tokens + kv_tokens_held <= max_kv_tokens``.
With the view's derived ``headroom`` (tokens; -1 when dead or out of concurrency slots)
this is one vectorised comparison: ``headroom >= kv_tokens``. A GPU that would exceed a
limit is never eligible; when no GPU is, :func:`no_capacity` explains why.
"""

from __future__ import annotations

import numpy as np

from fulcrum.core.decode.view import FleetView, Mask, NoCapacity


def check_kv_tokens(kv_tokens: int) -> None:
    """Raise ValueError unless ``kv_tokens`` (tokens) is a positive integer."""
    if kv_tokens < 1:
        raise ValueError("kv_tokens: must be > 0")


def eligible(view: FleetView, kv_tokens: int) -> Mask:
    """Boolean mask, shape ``(n_gpus,)``: GPUs that can take ``kv_tokens`` more tokens."""
    return view.headroom >= kv_tokens


def no_capacity(view: FleetView, kv_tokens: int, kind: str = "") -> NoCapacity:
    """Explain why no GPU can take a request of ``kv_tokens`` tokens (slow path only);
    ``kind`` is the policy's branch label, carried into the result."""
    live = view.live
    n_live = int(np.count_nonzero(live))
    slot = live & (view.concurrency < view.max_concurrency)
    room = live & (view.kv_tokens + kv_tokens <= view.max_kv_tokens)
    n_slot = int(np.count_nonzero(slot))
    n_room = int(np.count_nonzero(room))
    largest = int(view.headroom.max()) if view.n_gpus else -1
    largest = max(largest, -1)
    if n_live == 0:
        reason = "no live decode GPU"
    elif n_slot == 0:
        reason = f"all {n_live} live decode GPUs are at max_concurrency"
    elif n_room == 0:
        reason = (
            f"kv_tokens: {kv_tokens} exceeds the free KV of every live decode GPU "
            f"(largest free: {max(int((view.max_kv_tokens - view.kv_tokens)[live].max()), 0)}"
            " tokens)"
        )
    else:
        reason = (
            f"kv_tokens: no live decode GPU has both a free concurrency slot and {kv_tokens}"
            f" free KV tokens (largest free on a GPU with a slot: {largest} tokens)"
        )
    return NoCapacity(
        reason=reason,
        live_gpus=n_live,
        with_slot=n_slot,
        with_kv_room=n_room,
        largest_room=largest,
        kind=kind,
    )
