"""Per-block minima of a view's packed keys (:class:`BlockMins`).

An owner's view of at least :data:`BLOCKS_FROM` slots keeps, for each block of
:data:`BLOCK` slots, the minimum of ``order_conc`` and of ``order_kv``; the in-place
writers (:mod:`fulcrum.core.decode.writers`) keep them current, and the argmin of a
packed key then costs O(n / BLOCK + BLOCK) instead of O(n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np

from fulcrum.core.decode.keys import I64, INT64_MAX


class KeyedView(Protocol):
    """What :meth:`BlockMins.refresh` reads of a view (a
    :class:`fulcrum.core.decode.view.FleetView`): its slot count and packed keys."""

    @property
    def n_gpus(self) -> int: ...

    @property
    def order_conc(self) -> I64: ...

    @property
    def order_kv(self) -> I64: ...

BLOCK: Final = 256
"""Slots per block of :class:`BlockMins`."""
BLOCKS_FROM: Final = 128 * BLOCK
"""Views of at least this many slots (32,768) get block minima from :func:`resized`
(below it, a plain argmin costs less than keeping them; measured on this machine)."""


@dataclass(slots=True)
class BlockMins:
    """Minimum of ``order_conc`` and of ``order_kv`` over each block of :data:`BLOCK`
    slots (the last block may be shorter); arrays of shape ``(ceil(n / BLOCK),)``."""

    conc: I64
    kv: I64

    @staticmethod
    def of(order_conc: I64, order_kv: I64) -> BlockMins:
        """Computed from scratch: O(n)."""
        n = int(order_conc.shape[0])
        nb = -(-n // BLOCK)
        pad = nb * BLOCK - n

        def mins(key: I64) -> I64:
            full = np.concatenate([key, np.full(pad, INT64_MAX, dtype=np.int64)])
            return full.reshape(nb, BLOCK).min(axis=1) if nb else np.zeros(0, dtype=np.int64)

        return BlockMins(conc=mins(order_conc), kv=mins(order_kv))

    def refresh(self, view: KeyedView, start: int, end: int) -> None:
        """Recompute the blocks covering slots ``[start, end)``."""
        if end <= start:
            return
        b0, b1 = start // BLOCK, (end - 1) // BLOCK + 1
        s, e = b0 * BLOCK, min(b1 * BLOCK, view.n_gpus)
        for key, out in ((view.order_conc, self.conc), (view.order_kv, self.kv)):
            part = key[s:e]
            pad = (b1 - b0) * BLOCK - (e - s)
            if pad:
                part = np.concatenate([part, np.full(pad, INT64_MAX, dtype=np.int64)])
            out[b0:b1] = part.reshape(b1 - b0, BLOCK).min(axis=1)

    def argmin(self, key: I64, mins: I64) -> int:
        """Index of the smallest ``key`` (ties: lowest index), through ``mins``."""
        b = int(mins.argmin())
        s = b * BLOCK
        return s + int(key[s : s + BLOCK].argmin())
