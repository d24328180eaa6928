"""Fleet view of the decode balancer: per-GPU arrays and decisions.

Every decode GPU of every live instance has one slot (index ``0..n-1``) in the arrays
below, all of shape ``(n_gpus,)``:

- ``concurrency``      requests on the GPU (int64, requests);
- ``kv_tokens``        total KV length held on the GPU (int64, tokens);
- ``max_concurrency``  capacity: most requests the GPU may hold (int64, requests);
- ``max_kv_tokens``    capacity: most KV tokens the GPU may hold (int64, tokens);
- ``live``             the GPU may receive placements (bool);
- ``headroom``         derived: the largest KV length (tokens) a new request may have to
  fit on the GPU now: ``max_kv_tokens - kv_tokens`` when the GPU is live and has a free
  concurrency slot, else ``-1``. It makes the capacity filter a single comparison.
- ``order_conc``       derived packed key of *open* GPUs (live with a free slot): fewer
  requests first, then more KV: ``concurrency * 2**40 + (2**40 - 1 - kv_tokens)``;
  ``INT64_MAX`` for closed GPUs. ``order_conc >> 40`` is the concurrency.
- ``order_kv``         derived packed key of open GPUs: less KV first, then fewer requests:
  ``kv_tokens * 2**20 + concurrency``; ``INT64_MAX`` for closed GPUs.

The two packed orderings are the decode balancer's two dimensions (SPEC section 4); with
them a policy's common case is one ``argmin`` plus an O(1) check of the winner's headroom,
and only when the winner lacks KV room does it fall back to a masked pass.

``blocks`` (optional, :class:`BlockMins`): per-block minima of ``order_conc`` and
``order_kv`` over blocks of :data:`BLOCK` slots, kept by the owner's in-place writers,
so that the argmin of a packed key costs O(n / BLOCK + BLOCK) instead of O(n) on a large
fleet. Pure views built by :meth:`FleetView.build` have none (policies then take the
plain argmin; both give the same index: the lowest among the minima).

``totals`` (int64, shape ``(2,)``) holds the sums of ``concurrency`` and ``kv_tokens``
over live GPUs (requests, tokens), kept in O(1) by the updates so that policies reading
the fleet's mean KV per request need no extra pass.

Build views with :meth:`FleetView.build` (it derives and checks everything). The one
owner of a view's arrays (the daemon's state table) updates them in place with the
writers of :mod:`fulcrum.core.decode.writers` (:func:`~fulcrum.core.decode.writers.write_gpu`,
a :class:`~fulcrum.core.decode.writers.GpuWriter`, the range writers and
:func:`~fulcrum.core.decode.writers.resized`): O(1) per GPU, keeping every derived field
consistent; it must not do so while a selection runs. Selection never mutates a view.
Tests, benchmarks and models that want a changed copy instead use
:mod:`fulcrum.core.decode.copies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fulcrum.core.decode.blocks import BLOCK, BLOCKS_FROM, BlockMins
from fulcrum.core.decode.keys import (
    I64,
    INT64_MAX,
    INT64_MIN,
    KV_BITS,
    MAX_CONCURRENCY_LIMIT,
    MAX_KV_LIMIT,
    Mask,
)

__all__ = [
    "BLOCK",
    "BLOCKS_FROM",
    "I64",
    "INT64_MAX",
    "INT64_MIN",
    "KV_BITS",
    "MAX_CONCURRENCY_LIMIT",
    "MAX_KV_LIMIT",
    "BlockMins",
    "Decision",
    "FleetView",
    "Mask",
    "NoCapacity",
    "imbalance",
]


@dataclass(frozen=True, slots=True)
class FleetView:
    """Per-GPU load and capacity of the decode fleet; all arrays have shape ``(n_gpus,)``.

    Construct with :meth:`build`; the plain constructor trusts its arguments (derived
    fields must be consistent, see :meth:`check`).
    """

    concurrency: I64
    kv_tokens: I64
    max_concurrency: I64
    max_kv_tokens: I64
    live: Mask
    headroom: I64
    order_conc: I64
    order_kv: I64
    totals: I64
    blocks: BlockMins | None = None

    @property
    def total_concurrency(self) -> int:
        """Requests held on live GPUs."""
        return int(self.totals[0])

    @property
    def total_kv_tokens(self) -> int:
        """KV tokens held on live GPUs."""
        return int(self.totals[1])

    @staticmethod
    def build(
        concurrency: npt.ArrayLike,
        kv_tokens: npt.ArrayLike,
        max_concurrency: npt.ArrayLike,
        max_kv_tokens: npt.ArrayLike,
        live: npt.ArrayLike | None = None,
    ) -> FleetView:
        """Copy, validate and derive a view. Raises ValueError on bad shapes or values.

        ``live`` defaults to all GPUs live. Loads may exceed capacity (an engine report
        is the truth); such a GPU simply receives nothing until it drains.
        """
        conc = np.array(concurrency, dtype=np.int64, copy=True).reshape(-1)
        kv = np.array(kv_tokens, dtype=np.int64, copy=True).reshape(-1)
        mc = np.array(max_concurrency, dtype=np.int64, copy=True).reshape(-1)
        mk = np.array(max_kv_tokens, dtype=np.int64, copy=True).reshape(-1)
        n = conc.shape[0]
        lv = (
            np.ones(n, dtype=np.bool_)
            if live is None
            else np.array(live, dtype=np.bool_, copy=True).reshape(-1)
        )
        for name, arr in (
            ("kv_tokens", kv),
            ("max_concurrency", mc),
            ("max_kv_tokens", mk),
            ("live", lv),
        ):
            if arr.shape != (n,):
                raise ValueError(f"{name}: shape {arr.shape} != ({n},)")
        if (conc < 0).any():
            raise ValueError("concurrency: must be >= 0")
        if (kv < 0).any():
            raise ValueError("kv_tokens: must be >= 0")
        if ((mc < 1) | (mc >= MAX_CONCURRENCY_LIMIT)).any():
            raise ValueError(f"max_concurrency: must be in [1, {MAX_CONCURRENCY_LIMIT})")
        if ((mk < 1) | (mk >= MAX_KV_LIMIT)).any():
            raise ValueError(f"max_kv_tokens: must be in [1, {MAX_KV_LIMIT})")
        if (conc >= MAX_CONCURRENCY_LIMIT).any() or (kv >= MAX_KV_LIMIT).any():
            raise ValueError("concurrency/kv_tokens: absurdly large")
        is_open = lv & (conc < mc)
        headroom = np.where(is_open, mk - kv, -1).astype(np.int64)
        order_conc = np.where(
            is_open, conc * MAX_KV_LIMIT + (MAX_KV_LIMIT - 1 - kv), INT64_MAX
        ).astype(np.int64)
        order_kv = np.where(is_open, kv * MAX_CONCURRENCY_LIMIT + conc, INT64_MAX).astype(np.int64)
        return FleetView(
            concurrency=conc,
            kv_tokens=kv,
            max_concurrency=mc,
            max_kv_tokens=mk,
            live=lv,
            headroom=headroom,
            order_conc=order_conc,
            order_kv=order_kv,
            totals=np.array([int(conc[lv].sum()), int(kv[lv].sum())], dtype=np.int64),
        )

    @staticmethod
    def empty_like(max_concurrency: npt.ArrayLike, max_kv_tokens: npt.ArrayLike) -> FleetView:
        """An idle, all-live fleet with the given capacities."""
        mc = np.asarray(max_concurrency, dtype=np.int64).reshape(-1)
        zeros = np.zeros(mc.shape[0], dtype=np.int64)
        return FleetView.build(zeros, zeros, mc, max_kv_tokens)

    @property
    def n_gpus(self) -> int:
        """Number of GPU slots (live or not)."""
        return int(self.concurrency.shape[0])

    def mean_kv_per_request(self) -> float | None:
        """Mean KV length per request over live GPUs (tokens); None when no request is held."""
        reqs = int(self.totals[0])
        if reqs <= 0:
            return None
        return int(self.totals[1]) / reqs

    def check(self) -> None:
        """Raise AssertionError unless the derived fields match the arrays (for tests)."""
        expect = FleetView.build(
            self.concurrency, self.kv_tokens, self.max_concurrency, self.max_kv_tokens, self.live
        )
        assert np.array_equal(self.headroom, expect.headroom), "headroom out of date"
        assert np.array_equal(self.order_conc, expect.order_conc), "order_conc out of date"
        assert np.array_equal(self.order_kv, expect.order_kv), "order_kv out of date"
        assert self.total_concurrency == expect.total_concurrency, "total_concurrency"
        assert self.total_kv_tokens == expect.total_kv_tokens, "total_kv_tokens"
        if self.blocks is not None:
            want = BlockMins.of(self.order_conc, self.order_kv)
            assert np.array_equal(self.blocks.conc, want.conc), "blocks.conc out of date"
            assert np.array_equal(self.blocks.kv, want.kv), "blocks.kv out of date"

    def same_as(self, other: FleetView) -> bool:
        """Exact equality of every array and total (dataclass ``==`` is ambiguous on arrays)."""
        return (
            np.array_equal(self.concurrency, other.concurrency)
            and np.array_equal(self.kv_tokens, other.kv_tokens)
            and np.array_equal(self.max_concurrency, other.max_concurrency)
            and np.array_equal(self.max_kv_tokens, other.max_kv_tokens)
            and np.array_equal(self.live, other.live)
            and np.array_equal(self.headroom, other.headroom)
            and np.array_equal(self.order_conc, other.order_conc)
            and np.array_equal(self.order_kv, other.order_kv)
            and np.array_equal(self.totals, other.totals)
        )


class Decision(NamedTuple):
    """A placement choice (a NamedTuple: one is built per placement, and a tuple is
    several times cheaper to construct than a frozen dataclass).

    ``gpu``: index into the view's arrays. ``kind``: policy-specific branch label with a
    bounded set of values ("short"/"long" for dual, "" otherwise). ``cursor``: the policy
    state to pass to the next ``select`` (round_robin's next start index; other policies
    return the cursor they were given).
    """

    gpu: int
    kind: str = ""
    cursor: int = 0


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """No GPU can take the request; ``reason`` is a human-readable sentence.

    Counts are over the fleet at decision time: ``live_gpus`` live GPUs, of which
    ``with_slot`` have a free concurrency slot and ``with_kv_room`` have at least the
    request's KV length free (tokens); ``largest_room`` is the most free KV (tokens) on
    any live GPU with a free slot (-1 when none). ``kind``: the policy's branch label,
    as in Decision ("short"/"long" for dual, "" otherwise).
    """

    reason: str
    live_gpus: int
    with_slot: int
    with_kv_room: int
    largest_room: int
    kind: str = ""


def imbalance(values: npt.NDArray[np.int64], live: Mask) -> float:
    """max/mean of ``values`` over live GPUs; 1.0 is perfect (and when all are 0 or none live)."""
    sel = values[live]
    if sel.size == 0:
        return 1.0
    mean = float(sel.mean())
    if mean <= 0.0:
        return 1.0
    return float(sel.max()) / mean
