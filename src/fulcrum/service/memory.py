"""Hand freed heap back to the operating system after a burst of streams closes.

A WatchMaps stream holds its serialised map replies in gRPC's buffers (hundreds of KiB
each for a full-size group); when 500 watchers close, the memory is freed but glibc's
allocator keeps it, so the daemon's RSS stays 140+ MiB up (issue 22 row 14).
:func:`request_trim` coalesces the closes of one burst and calls ``malloc_trim(0)`` once,
in a worker thread (it walks the heap; nothing on the loop waits for it). Without glibc it
does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

from fulcrum.metrics import eplb as m

__all__ = ["request_trim"]

#: Seconds a burst of closes is given before the heap is trimmed once for all of them.
COALESCE_S = 0.2


def _libc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


_TRIM = _libc_trim()
_pending: list[asyncio.Handle] = []


def _run() -> None:
    _pending.clear()
    if _TRIM is None:
        return
    fut = asyncio.get_running_loop().run_in_executor(None, _TRIM, 0)
    fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())
    m.MEMORY_TRIMS.inc()


def request_trim() -> None:
    """Trim the heap soon (once per burst of requests; on the event loop)."""
    if _pending or _TRIM is None:
        return
    _pending.append(asyncio.get_running_loop().call_later(COALESCE_S, _run))
