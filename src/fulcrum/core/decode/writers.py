"""In-place writers of a decode view, for the one owner of its arrays (the daemon's table).

Every writer keeps the derived fields (``headroom``, ``order_conc``, ``order_kv``,
``totals`` and the block minima) consistent with the loads; none may run while a
selection reads the view. :func:`write_gpu` and :class:`GpuWriter` cost O(1) per GPU,
the range writers O(the range), :func:`resized` O(capacity) (a new view).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from fulcrum.core.decode.blocks import BLOCK, BLOCKS_FROM, BlockMins
from fulcrum.core.decode.keys import (
    I64,
    INT64_MAX,
    MAX_CONCURRENCY_LIMIT,
    MAX_KV_LIMIT,
)
from fulcrum.core.decode.view import FleetView


def check_gpu(view: FleetView, gpu: int) -> None:
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
        check_gpu(view, gpu)
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
