"""Capacity filter of the decode balancer, applied before any policy scores.

A GPU is *eligible* for a request of ``kv_tokens`` tokens iff it is live, holds fewer
than ``max_concurrency`` requests, and ``kv_tokens + kv_tokens_held <= max_kv_tokens``.
With the view's derived ``headroom`` (tokens; -1 when dead or out of concurrency slots)
this is one vectorised comparison: ``headroom >= kv_tokens``. A GPU that would exceed a
limit is never eligible; when no GPU is, :func:`no_capacity` explains why.

In front of the policies, an optional *allowed-slots filter* (:func:`select_allowed`)
narrows the candidates to a subset of the view's slots (a gateway's subset hint, the GPUs
that have a serving address): filters, then the policy's scorer and picker, as in the
Gateway API Inference Extension's endpoint picker.
"""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from fulcrum.core.decode.view import INT64_MAX, Decision, FleetView, Mask, NoCapacity


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


# -- the allowed-slots filter (a subset of the view's slots) ------------------------------

#: Allowed slots, either of two forms (the caller picks the cheaper one):
#: - a sorted, duplicate-free int64 array of slot indices, shape ``(k,)``: a restriction
#:   costs O(k) gathers (a gateway's subset hint: a few GPUs of a large fleet);
#: - a boolean mask over the view's slots, shape ``(n_gpus,)``: four O(n_gpus) passes and
#:   no gather (most of the fleet allowed, e.g. every GPU that has an address).
Allowed = npt.NDArray[np.int64] | npt.NDArray[np.bool_]


def check_allowed(view: FleetView, allowed: Allowed) -> None:
    """Raise ValueError unless ``allowed`` is a boolean mask of shape ``(n_gpus,)`` or a
    sorted, duplicate-free int64 array of slot indices in ``[0, n_gpus)``, shape ``(k,)``.
    O(k) (O(1) for a mask)."""
    if isinstance(allowed, np.ndarray) and allowed.dtype == np.bool_:
        if allowed.shape != (view.n_gpus,):
            raise ValueError(f"allowed: a mask must have shape ({view.n_gpus},)")
        return
    if not isinstance(allowed, np.ndarray) or allowed.dtype != np.int64 or allowed.ndim != 1:
        raise ValueError("allowed: must be a boolean mask or a 1-d int64 array of slot indices")
    k = int(allowed.shape[0])
    if k == 0:
        return
    if int(allowed[0]) < 0 or int(allowed[-1]) >= view.n_gpus:
        raise ValueError(f"allowed: slot indices must be in [0, {view.n_gpus})")
    if k > 1 and not bool((allowed[1:] > allowed[:-1]).all()):
        raise ValueError("allowed: slot indices must be strictly increasing")


def masked(view: FleetView, mask: Mask) -> FleetView:
    """``view`` with the GPUs outside ``mask`` (bool, shape ``(n_gpus,)``) closed: not
    live, no headroom, last in both orderings. Same slots; the load and capacity arrays
    and ``totals`` (the whole live fleet's, as in :func:`restrict`) are shared, not
    copied (a policy never writes them); four O(n_gpus) passes, no block minima."""
    return FleetView(
        concurrency=view.concurrency,
        kv_tokens=view.kv_tokens,
        max_concurrency=view.max_concurrency,
        max_kv_tokens=view.max_kv_tokens,
        live=view.live & mask,
        headroom=np.where(mask, view.headroom, -1),
        order_conc=np.where(mask, view.order_conc, INT64_MAX),
        order_kv=np.where(mask, view.order_kv, INT64_MAX),
        totals=view.totals,
    )


def restrict(view: FleetView, allowed: npt.NDArray[np.int64]) -> FleetView:
    """The view of the ``allowed`` slots only (arrays of shape ``(k,)``, position ``p`` is
    slot ``allowed[p]``; no block minima). ``totals`` stay those of the whole live fleet:
    the filter narrows the candidates, not the fleet a policy measures itself against
    (dual's mean KV per request). Copies (O(k)); ``view`` is untouched."""
    return FleetView(
        concurrency=view.concurrency[allowed],
        kv_tokens=view.kv_tokens[allowed],
        max_concurrency=view.max_concurrency[allowed],
        max_kv_tokens=view.max_kv_tokens[allowed],
        live=view.live[allowed],
        headroom=view.headroom[allowed],
        order_conc=view.order_conc[allowed],
        order_kv=view.order_kv[allowed],
        totals=view.totals.copy(),
    )


class _Policy(Protocol):
    @property
    def name(self) -> str: ...

    def select(
        self, view: FleetView, kv_tokens: int, rng: np.random.Generator, cursor: int = 0
    ) -> Decision | NoCapacity: ...


def select_allowed(
    policy: _Policy,
    view: FleetView,
    kv_tokens: int,
    rng: np.random.Generator,
    cursor: int,
    allowed: Allowed | None,
) -> Decision | NoCapacity:
    """The filter step in front of any policy: ``policy`` chooses among the ``allowed``
    slots only (every slot when None: exactly ``policy.select``, nothing added).

    The policy runs unchanged on :func:`masked`'s view (a mask: same slots) or on
    :func:`restrict`'s view (slot indices; its choice is mapped back to a slot of
    ``view``): a pick is always an allowed slot that passes the capacity filter
    (live, a free concurrency slot, ``headroom >= kv_tokens``). The cursor is a slot of
    ``view`` in and out: the policy starts at the first allowed slot at or after it, and
    a policy that advanced its cursor (round_robin) leaves it just past the chosen slot;
    a policy that did not leaves it as it was. ``NoCapacity`` counts are over the
    allowed slots. Pure: ``view`` is never changed. O(k) besides the policy's own cost
    on ``k`` slots. Raises ValueError on a malformed ``allowed``
    (:func:`check_allowed`).
    """
    if allowed is None:
        return policy.select(view, kv_tokens, rng, cursor)
    check_allowed(view, allowed)
    check_kv_tokens(kv_tokens)
    if allowed.dtype == np.bool_:  # same slots: nothing to map
        return policy.select(masked(view, cast(Mask, allowed)), kv_tokens, rng, cursor)
    index = cast("npt.NDArray[np.int64]", allowed)  # a string: no alias built per call
    sub = restrict(view, index)
    k = sub.n_gpus
    n = view.n_gpus
    pos = int(np.searchsorted(allowed, cursor % n)) if n else 0
    if pos >= k:
        pos = 0
    # The sub-view's cursor is ``pos + k`` (the same start modulo ``k``): a policy that
    # does not move its cursor returns it as given, one that does returns an index < k,
    # so the two never look alike (not even with one allowed slot).
    given = pos + k
    out = policy.select(sub, kv_tokens, rng, given)
    if isinstance(out, NoCapacity):
        if k == 0:
            return NoCapacity(
                reason="no decode GPU is allowed for this request",
                live_gpus=0,
                with_slot=0,
                with_kv_room=0,
                largest_room=-1,
                kind=out.kind,
            )
        return out
    gpu = int(index[out.gpu])
    moved = out.cursor != given
    return Decision(gpu=gpu, kind=out.kind, cursor=(gpu + 1) % n if moved else cursor)
