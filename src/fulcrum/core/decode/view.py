"""Fleet view of the decode balancer: per-GPU arrays, decisions, and pure updates.

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

Build views with :meth:`FleetView.build` (it derives and checks everything). Pure callers
change them with :func:`commit`, :func:`release`, :func:`grow`, :func:`observe` and
:func:`set_live`, which copy and return a new view and never touch the old one. The one
owner of a view's arrays (the daemon's state table) may instead update them in place
with :func:`write_gpu` (or a :class:`GpuWriter`, the same through memoryviews), an O(1)
write that keeps every derived field consistent; it must
not do so while a selection runs. Selection never mutates a view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]

KV_BITS: Final = 40
"""Bits of the KV part in ``order_conc`` (``order_conc >> KV_BITS`` is the concurrency)."""
MAX_CONCURRENCY_LIMIT: Final = 1 << 20
"""Upper bound (exclusive) on any ``max_concurrency`` (requests); keeps packed keys in int64."""
MAX_KV_LIMIT: Final = 1 << KV_BITS
"""Upper bound (exclusive) on any ``max_kv_tokens`` (tokens); keeps packed keys in int64."""
INT64_MAX: Final = int(np.iinfo(np.int64).max)
INT64_MIN: Final = int(np.iinfo(np.int64).min)


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

    def refresh(self, view: FleetView, start: int, end: int) -> None:
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


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement choice.

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


def _check_gpu(view: FleetView, gpu: int) -> None:
    if not 0 <= gpu < view.n_gpus:
        raise ValueError(f"gpu: index {gpu} out of range [0, {view.n_gpus})")


def write_gpu(view: FleetView, gpu: int, concurrency: int, kv_tokens: int, live: bool) -> None:
    """IN PLACE: set GPU ``gpu`` to ``concurrency`` requests, ``kv_tokens`` tokens, ``live``.

    O(1); keeps ``headroom``, ``order_conc``, ``order_kv`` and ``totals`` consistent. For
    the single owner of the view's arrays only (see the module docstring). Raises
    ValueError, changing nothing, on a bad index or an out-of-range load.

    This is the daemon's per-placement write, so it uses scalar ``item`` reads and plain
    Python arithmetic (no numpy scalars) and skips writes that would change nothing.
    """
    if not 0 <= gpu < view.concurrency.shape[0]:
        _check_gpu(view, gpu)
    if not (0 <= concurrency < MAX_CONCURRENCY_LIMIT and 0 <= kv_tokens < MAX_KV_LIMIT):
        raise ValueError(
            f"gpu {gpu}: load out of range ({concurrency} requests, {kv_tokens} KV tokens)"
        )
    was_live = bool(view.live.item(gpu))
    if was_live or live:
        totals = view.totals
        reqs, kv = totals.tolist()
        if was_live:
            reqs -= view.concurrency.item(gpu)
            kv -= view.kv_tokens.item(gpu)
        if live:
            reqs += concurrency
            kv += kv_tokens
        totals[0] = reqs
        totals[1] = kv
    view.concurrency[gpu] = concurrency
    view.kv_tokens[gpu] = kv_tokens
    if was_live != live:
        view.live[gpu] = live
    if live and concurrency < view.max_concurrency.item(gpu):
        view.headroom[gpu] = view.max_kv_tokens.item(gpu) - kv_tokens
        view.order_conc[gpu] = concurrency * MAX_KV_LIMIT + (MAX_KV_LIMIT - 1 - kv_tokens)
        view.order_kv[gpu] = kv_tokens * MAX_CONCURRENCY_LIMIT + concurrency
    else:
        view.headroom[gpu] = -1
        view.order_conc[gpu] = INT64_MAX
        view.order_kv[gpu] = INT64_MAX
    if view.blocks is not None:
        view.blocks.refresh(view, gpu, gpu + 1)


class GpuWriter:
    """The owner's O(1) in-place reader/writer of one view's per-GPU arrays.

    Same semantics as :func:`write_gpu` (it keeps ``headroom``, ``order_conc``,
    ``order_kv`` and ``totals`` consistent and raises ValueError, changing nothing, on a
    bad index or an out-of-range load), through ``memoryview``s of the view's arrays:
    Python ints in and out, without numpy's scalar machinery (the daemon's per-placement
    path). It writes the very memory of ``view``; build a new writer for a new view.
    """

    __slots__ = (
        "_bc", "_bk", "_blocks", "_conc", "_head", "_kv", "_live", "_mc", "_mk", "_n", "_oc",
        "_ok", "_tot", "view",
    )

    def __init__(self, view: FleetView) -> None:
        self.view = view
        self._n = view.n_gpus
        self._conc = view.concurrency.data
        self._kv = view.kv_tokens.data
        self._mc = view.max_concurrency.data
        self._mk = view.max_kv_tokens.data
        self._live = view.live.data
        self._head = view.headroom.data
        self._oc = view.order_conc.data
        self._ok = view.order_kv.data
        self._tot = view.totals.data
        self._blocks = view.blocks
        if view.blocks is not None:
            self._bc = view.blocks.conc.data
            self._bk = view.blocks.kv.data

    def _block(self, gpu: int, old_oc: int, old_ok: int) -> None:
        """Keep the block minima after slot ``gpu``'s keys changed from the old ones:
        O(1) when a key went down or was not its block's minimum, else O(BLOCK)."""
        b = gpu // BLOCK
        s = b * BLOCK
        new_oc, new_ok = self._oc[gpu], self._ok[gpu]
        bc, bk = self._bc, self._bk
        if new_oc <= bc[b]:
            bc[b] = new_oc
        elif old_oc == bc[b]:
            bc[b] = int(self.view.order_conc[s : s + BLOCK].min())
        if new_ok <= bk[b]:
            bk[b] = new_ok
        elif old_ok == bk[b]:
            bk[b] = int(self.view.order_kv[s : s + BLOCK].min())

    def load(self, gpu: int) -> tuple[int, int]:
        """(requests, KV tokens) on GPU ``gpu``."""
        return self._conc[gpu], self._kv[gpu]

    def is_live(self, gpu: int) -> bool:
        """Whether GPU ``gpu`` may receive placements."""
        return bool(self._live[gpu])

    def write(self, gpu: int, concurrency: int, kv_tokens: int, live: bool) -> None:
        """IN PLACE: as :func:`write_gpu` (requests, tokens)."""
        if not 0 <= gpu < self._n:
            raise ValueError(f"gpu: index {gpu} out of range [0, {self._n})")
        if not (0 <= concurrency < MAX_CONCURRENCY_LIMIT and 0 <= kv_tokens < MAX_KV_LIMIT):
            raise ValueError(
                f"gpu {gpu}: load out of range ({concurrency} requests, {kv_tokens} KV tokens)"
            )
        conc_arr, kv_arr, tot = self._conc, self._kv, self._tot
        old_oc, old_ok = self._oc[gpu], self._ok[gpu]
        was_live = bool(self._live[gpu])
        if was_live:
            tot[0] -= conc_arr[gpu]
            tot[1] -= kv_arr[gpu]
        if live:
            tot[0] += concurrency
            tot[1] += kv_tokens
        conc_arr[gpu] = concurrency
        kv_arr[gpu] = kv_tokens
        if was_live != live:
            self._live[gpu] = live
        if live and concurrency < self._mc[gpu]:
            self._head[gpu] = self._mk[gpu] - kv_tokens
            self._oc[gpu] = concurrency * MAX_KV_LIMIT + (MAX_KV_LIMIT - 1 - kv_tokens)
            self._ok[gpu] = kv_tokens * MAX_CONCURRENCY_LIMIT + concurrency
        else:
            self._head[gpu] = -1
            self._oc[gpu] = INT64_MAX
            self._ok[gpu] = INT64_MAX
        if self._blocks is not None:
            self._block(gpu, old_oc, old_ok)


def write_range(view: FleetView, start: int, concurrency: I64, kv_tokens: I64) -> None:
    """IN PLACE: set the loads of GPUs ``start .. start + len(concurrency) - 1`` (requests,
    tokens; arrays of equal shape ``(k,)``), keeping every derived field consistent.

    One vectorised pass over the range (a heartbeat of a whole instance); liveness is
    unchanged. For the single owner of the view's arrays only. Raises ValueError, changing
    nothing, on a bad range or an out-of-range load.
    """
    k = int(concurrency.shape[0])
    if kv_tokens.shape != (k,) or not 0 <= start <= start + k <= view.n_gpus:
        raise ValueError(f"range [{start}, {start + k}) or shapes do not fit the view")
    if k == 0:
        return
    if bool(((concurrency < 0) | (concurrency >= MAX_CONCURRENCY_LIMIT)).any()):
        raise ValueError(f"concurrency: must be in [0, {MAX_CONCURRENCY_LIMIT})")
    if bool(((kv_tokens < 0) | (kv_tokens >= MAX_KV_LIMIT)).any()):
        raise ValueError(f"kv_tokens: must be in [0, {MAX_KV_LIMIT})")
    end = start + k
    live = view.live[start:end]
    view.totals[0] += int(concurrency[live].sum()) - int(view.concurrency[start:end][live].sum())
    view.totals[1] += int(kv_tokens[live].sum()) - int(view.kv_tokens[start:end][live].sum())
    view.concurrency[start:end] = concurrency
    view.kv_tokens[start:end] = kv_tokens
    is_open = live & (concurrency < view.max_concurrency[start:end])
    view.headroom[start:end] = np.where(is_open, view.max_kv_tokens[start:end] - kv_tokens, -1)
    view.order_conc[start:end] = np.where(
        is_open, concurrency * MAX_KV_LIMIT + (MAX_KV_LIMIT - 1 - kv_tokens), INT64_MAX
    )
    view.order_kv[start:end] = np.where(
        is_open, kv_tokens * MAX_CONCURRENCY_LIMIT + concurrency, INT64_MAX
    )
    if view.blocks is not None:
        view.blocks.refresh(view, start, end)


def open_range(
    view: FleetView, start: int, max_concurrency: I64, max_kv_tokens: I64
) -> None:
    """IN PLACE: make GPUs ``start .. start + k - 1`` live and idle with the given
    capacities (requests, tokens; arrays of shape ``(k,)``). O(k). The slots must be
    closed (not live) before; for the single owner of the view's arrays only. Raises
    ValueError, changing nothing, on a bad range, a live slot or an out-of-range capacity.
    """
    k = int(max_concurrency.shape[0])
    if max_kv_tokens.shape != (k,) or not 0 <= start <= start + k <= view.n_gpus:
        raise ValueError(f"range [{start}, {start + k}) or shapes do not fit the view")
    end = start + k
    if bool(view.live[start:end].any()):
        raise ValueError(f"range [{start}, {end}): holds live GPUs")
    if bool(((max_concurrency < 1) | (max_concurrency >= MAX_CONCURRENCY_LIMIT)).any()):
        raise ValueError(f"max_concurrency: must be in [1, {MAX_CONCURRENCY_LIMIT})")
    if bool(((max_kv_tokens < 1) | (max_kv_tokens >= MAX_KV_LIMIT)).any()):
        raise ValueError(f"max_kv_tokens: must be in [1, {MAX_KV_LIMIT})")
    view.concurrency[start:end] = 0
    view.kv_tokens[start:end] = 0
    view.max_concurrency[start:end] = max_concurrency
    view.max_kv_tokens[start:end] = max_kv_tokens
    view.live[start:end] = True
    view.headroom[start:end] = max_kv_tokens
    view.order_conc[start:end] = MAX_KV_LIMIT - 1
    view.order_kv[start:end] = 0
    if view.blocks is not None:
        view.blocks.refresh(view, start, end)


def close_range(view: FleetView, start: int, k: int) -> None:
    """IN PLACE: take GPUs ``start .. start + k - 1`` out (not live, idle, capacity 1):
    the state of a free slot. O(k); keeps ``totals`` consistent. Owner only."""
    if not 0 <= start <= start + k <= view.n_gpus:
        raise ValueError(f"range [{start}, {start + k}) does not fit the view")
    end = start + k
    live = view.live[start:end]
    view.totals[0] -= int(view.concurrency[start:end][live].sum())
    view.totals[1] -= int(view.kv_tokens[start:end][live].sum())
    view.concurrency[start:end] = 0
    view.kv_tokens[start:end] = 0
    view.max_concurrency[start:end] = 1
    view.max_kv_tokens[start:end] = 1
    view.live[start:end] = False
    view.headroom[start:end] = -1
    view.order_conc[start:end] = INT64_MAX
    view.order_kv[start:end] = INT64_MAX
    if view.blocks is not None:
        view.blocks.refresh(view, start, end)


def resized(view: FleetView, capacity: int, index: I64 | None = None) -> FleetView:
    """A new view of ``capacity`` slots: slot ``i`` takes old slot ``index[i]`` for
    ``i < len(index)`` (default: the identity over the old slots), the rest are free
    slots (see :func:`close_range`). Copies; the old view is untouched. O(capacity).
    The new view has block minima (:class:`BlockMins`) from :data:`BLOCKS_FROM` slots:
    it is meant for an owner."""
    n = view.n_gpus if index is None else int(index.shape[0])
    if n > capacity:
        raise ValueError(f"capacity {capacity} < {n} slots kept")

    def take(arr: npt.NDArray[np.int64], fill: int) -> npt.NDArray[np.int64]:
        out = np.empty(capacity, dtype=np.int64)
        out[:n] = arr if index is None else arr[index]  # growth: a plain copy
        out[n:] = fill
        return out

    live = np.zeros(capacity, dtype=np.bool_)
    live[:n] = view.live if index is None else view.live[index]
    order_conc = take(view.order_conc, INT64_MAX)
    order_kv = take(view.order_kv, INT64_MAX)
    return FleetView(
        concurrency=take(view.concurrency, 0),
        kv_tokens=take(view.kv_tokens, 0),
        max_concurrency=take(view.max_concurrency, 1),
        max_kv_tokens=take(view.max_kv_tokens, 1),
        live=live,
        headroom=take(view.headroom, -1),
        order_conc=order_conc,
        order_kv=order_kv,
        totals=view.totals.copy(),
        blocks=BlockMins.of(order_conc, order_kv) if capacity >= BLOCKS_FROM else None,
    )


def copy_view(view: FleetView) -> FleetView:
    """A deep copy (every array copied)."""
    return FleetView(
        concurrency=view.concurrency.copy(),
        kv_tokens=view.kv_tokens.copy(),
        max_concurrency=view.max_concurrency,
        max_kv_tokens=view.max_kv_tokens,
        live=view.live.copy(),
        headroom=view.headroom.copy(),
        order_conc=view.order_conc.copy(),
        order_kv=view.order_kv.copy(),
        totals=view.totals.copy(),
    )


def _with_gpu(view: FleetView, gpu: int, conc: int, kv: int, live: bool) -> FleetView:
    """New view where GPU ``gpu`` holds ``conc`` requests and ``kv`` tokens and is ``live``."""
    _check_gpu(view, gpu)
    out = copy_view(view)
    write_gpu(out, gpu, conc, kv, live)
    return out


def commit(view: FleetView, gpu: int, kv_tokens: int) -> FleetView:
    """Place one request of ``kv_tokens`` tokens on ``gpu``: concurrency +1, KV +kv_tokens.

    Does not re-check capacity (selection does); raises ValueError on a bad index or
    ``kv_tokens < 1``.
    """
    _check_gpu(view, gpu)
    if kv_tokens < 1:
        raise ValueError("kv_tokens: must be > 0")
    return _with_gpu(
        view,
        gpu,
        int(view.concurrency[gpu]) + 1,
        int(view.kv_tokens[gpu]) + kv_tokens,
        bool(view.live[gpu]),
    )


def release(view: FleetView, gpu: int, kv_tokens: int) -> FleetView:
    """Remove one request holding ``kv_tokens`` tokens from ``gpu`` (inverse of commit).

    Raises ValueError when the GPU holds no request or fewer than ``kv_tokens`` tokens.
    """
    _check_gpu(view, gpu)
    conc = int(view.concurrency[gpu])
    kv = int(view.kv_tokens[gpu])
    if kv_tokens < 0:
        raise ValueError("kv_tokens: must be >= 0")
    if conc < 1:
        raise ValueError(f"gpu {gpu}: holds no request to release")
    if kv < kv_tokens:
        raise ValueError(f"gpu {gpu}: holds {kv} KV tokens, cannot release {kv_tokens}")
    return _with_gpu(view, gpu, conc - 1, kv - kv_tokens, bool(view.live[gpu]))


def grow(view: FleetView, gpu: int, delta_kv_tokens: int) -> FleetView:
    """Add ``delta_kv_tokens`` (>= 0) generated tokens to the KV held on ``gpu``."""
    _check_gpu(view, gpu)
    if delta_kv_tokens < 0:
        raise ValueError("delta_kv_tokens: must be >= 0")
    return _with_gpu(
        view,
        gpu,
        int(view.concurrency[gpu]),
        int(view.kv_tokens[gpu]) + delta_kv_tokens,
        bool(view.live[gpu]),
    )


def observe(view: FleetView, gpu: int, concurrency: int, kv_tokens: int) -> FleetView:
    """Set the load of ``gpu`` (requests, tokens), e.g. from a heartbeat plus placements since."""
    _check_gpu(view, gpu)
    if concurrency < 0 or concurrency >= MAX_CONCURRENCY_LIMIT:
        raise ValueError(f"concurrency: must be in [0, {MAX_CONCURRENCY_LIMIT})")
    if kv_tokens < 0 or kv_tokens >= MAX_KV_LIMIT:
        raise ValueError(f"kv_tokens: must be in [0, {MAX_KV_LIMIT})")
    return _with_gpu(view, gpu, concurrency, kv_tokens, bool(view.live[gpu]))


def set_live(view: FleetView, gpu: int, live: bool) -> FleetView:
    """Mark ``gpu`` live (placeable) or not; its load arrays are kept as they are."""
    _check_gpu(view, gpu)
    return _with_gpu(view, gpu, int(view.concurrency[gpu]), int(view.kv_tokens[gpu]), live)


def imbalance(values: npt.NDArray[np.int64], live: Mask) -> float:
    """max/mean of ``values`` over live GPUs; 1.0 is perfect (and when all are 0 or none live)."""
    sel = values[live]
    if sel.size == 0:
        return 1.0
    mean = float(sel.mean())
    if mean <= 0.0:
        return 1.0
    return float(sel.max()) / mean
