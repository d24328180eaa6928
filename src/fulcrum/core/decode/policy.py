"""Common interface of decode placement policies and the helpers they share.

A policy is an immutable object with ``name`` and a pure
``select(view, kv_tokens, rng, cursor) -> Decision | NoCapacity``: it filters by
capacity (:mod:`fulcrum.core.decode.filters`), scores eligible GPUs, and returns the
chosen GPU index. It never mutates the view, the rng is the only source of randomness,
and any policy state (round_robin's cursor) is passed in and returned in the Decision.

Each policy module owns its parameter dataclass (validated in its own ``__post_init__``)
and registers itself in :mod:`fulcrum.core.decode.registry` with the branch labels its
decisions carry (``Decision.kind``; ``("",)`` for a policy without branches).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.core.decode.filters import check_kv_tokens, no_capacity
from fulcrum.core.decode.view import (
    I64,
    INT64_MAX,
    INT64_MIN,
    MAX_KV_LIMIT,
    Decision,
    FleetView,
    Mask,
    NoCapacity,
)

F64 = npt.NDArray[np.float64]


class DecodePolicy(Protocol):
    """A decode placement policy (see module docstring)."""

    @property
    def name(self) -> str: ...

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        """Choose a GPU for one request of ``kv_tokens`` tokens (pure)."""
        ...


def decided(
    view: FleetView, kv_tokens: int, gpu: int, cursor: int, kind: str = ""
) -> Decision | NoCapacity:
    """The Decision for ``gpu`` (a slot index), or the NoCapacity explanation when
    ``gpu < 0`` (the common tail of every policy's ``select``)."""
    if gpu < 0:
        return no_capacity(view, kv_tokens, kind)
    return Decision(gpu=gpu, kind=kind, cursor=cursor)


class Checked:
    """Base of a policy whose :meth:`choose` runs after the common ``kv_tokens`` check.
    Subclasses set ``name``."""

    __slots__ = ()
    name: ClassVar[str] = ""

    def choose(
        self, view: FleetView, kv_tokens: int, rng: np.random.Generator, cursor: int
    ) -> Decision | NoCapacity:
        raise NotImplementedError

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        check_kv_tokens(kv_tokens)
        return self.choose(view, kv_tokens, rng, cursor)


class ByKey:
    """Base of a policy that takes the eligible GPU with the smallest :meth:`key`
    (non-negative, shape ``(n_gpus,)``; see :func:`pick_min`). Subclasses set ``name``."""

    __slots__ = ()
    name: ClassVar[str] = ""

    def key(self, view: FleetView) -> I64 | F64:
        raise NotImplementedError

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        check_kv_tokens(kv_tokens)
        return decided(view, kv_tokens, pick_min(self.key(view), view, kv_tokens), cursor)


def argmin_where(key: I64 | F64, mask: Mask) -> int:
    """Index of the smallest ``key`` (shape ``(n_gpus,)``) among ``mask``; -1 when none.

    Ties go to the lowest index. One vectorised pass.
    """
    if mask.shape[0] == 0:
        return -1
    sentinel: float | int = np.inf if key.dtype.kind == "f" else INT64_MAX
    i = int(np.where(mask, key, sentinel).argmin())
    return i if bool(mask[i]) else -1


def argmax_where(key: I64, mask: Mask) -> int:
    """Index of the largest int64 ``key`` among ``mask`` (ties: lowest index); -1 when none."""
    if mask.shape[0] == 0:
        return -1
    i = int(np.where(mask, key, INT64_MIN).argmax())
    return i if bool(mask[i]) else -1


def masked_argmin(key: I64 | F64, headroom: I64, kv_tokens: int) -> int:
    """Index of the smallest ``key`` among GPUs with ``headroom >= kv_tokens`` (ties: lowest
    index); -1 when none. ``key`` (shape ``(n_gpus,)``) must be non-negative: int64, or
    float64 finite or +inf.

    One fused pass with a single temporary: ``d = headroom - kv_tokens`` is negative
    exactly for the GPUs that lack room; ``d >> 63`` turns that into all-ones (-1) and
    the rest into 0; OR-ing it into the key's bits makes an ineligible GPU's key the
    largest unsigned 64-bit value, while an eligible GPU keeps its key. The bits of a
    non-negative float64 compare like the float (IEEE 754), so one unsigned argmin over
    those bits is the masked argmin for both key types, without a boolean mask, a branchy
    ``np.where`` or a second full-size temporary.
    """
    n = key.shape[0]
    if n == 0 or kv_tokens >= MAX_KV_LIMIT:  # nothing holds that much room
        return -1
    d = np.subtract(headroom, kv_tokens)
    np.right_shift(d, 63, out=d)
    np.bitwise_or(d, key.view(np.int64), out=d)
    i = int(d.view(np.uint64).argmin())
    return i if int(headroom[i]) >= kv_tokens else -1


def pick_min(key: I64 | F64, view: FleetView, kv_tokens: int) -> int:
    """Index of the smallest ``key`` (shape ``(n_gpus,)``, non-negative: see
    :func:`masked_argmin`) among GPUs eligible for ``kv_tokens`` tokens (ties: lowest
    index); -1 when none.

    Fast path: the global argmin, accepted when its headroom fits (then it is also the
    eligible argmin); through the view's block minima when it has them and ``key`` is
    one of its packed orderings (O(n / BLOCK + BLOCK)). Otherwise one fused masked pass
    (:func:`masked_argmin`).
    """
    if key.shape[0] == 0:
        return -1
    blocks = view.blocks
    if blocks is not None and key is view.order_conc:
        i = blocks.argmin(view.order_conc, blocks.conc)
    elif blocks is not None and key is view.order_kv:
        i = blocks.argmin(view.order_kv, blocks.kv)
    else:
        i = int(key.argmin())
    headroom = view.headroom
    if headroom.item(i) >= kv_tokens:
        return i
    return masked_argmin(key, headroom, kv_tokens)
