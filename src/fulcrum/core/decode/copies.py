"""Copy-on-write updates of a decode view, for tests, benchmarks and models.

Each function returns a new view and never touches the old one (O(n) per call). The
daemon never uses them: its table updates its own view in place through
:mod:`fulcrum.core.decode.writers`.
"""

from __future__ import annotations

from fulcrum.core.decode.keys import MAX_CONCURRENCY_LIMIT, MAX_KV_LIMIT
from fulcrum.core.decode.view import FleetView
from fulcrum.core.decode.writers import check_gpu, write_gpu


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
    check_gpu(view, gpu)
    out = copy_view(view)
    write_gpu(out, gpu, conc, kv, live)
    return out


def commit(view: FleetView, gpu: int, kv_tokens: int) -> FleetView:
    """Place one request of ``kv_tokens`` tokens on ``gpu``: concurrency +1, KV +kv_tokens.

    Does not re-check capacity (selection does); raises ValueError on a bad index or
    ``kv_tokens < 1``.
    """
    check_gpu(view, gpu)
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
    check_gpu(view, gpu)
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
    check_gpu(view, gpu)
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
    check_gpu(view, gpu)
    if concurrency < 0 or concurrency >= MAX_CONCURRENCY_LIMIT:
        raise ValueError(f"concurrency: must be in [0, {MAX_CONCURRENCY_LIMIT})")
    if kv_tokens < 0 or kv_tokens >= MAX_KV_LIMIT:
        raise ValueError(f"kv_tokens: must be in [0, {MAX_KV_LIMIT})")
    return _with_gpu(view, gpu, concurrency, kv_tokens, bool(view.live[gpu]))


def set_live(view: FleetView, gpu: int, live: bool) -> FleetView:
    """Mark ``gpu`` live (placeable) or not; its load arrays are kept as they are."""
    check_gpu(view, gpu)
    return _with_gpu(view, gpu, int(view.concurrency[gpu]), int(view.kv_tokens[gpu]), live)
