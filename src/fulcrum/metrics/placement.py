"""Helpers of the placement balancers' collectors (decode, vision), run in the scrape
thread on published snapshots only: bounded per-GPU rows and imbalance."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from fulcrum.state.placement import MemberFigures

I64 = npt.NDArray[np.int64]


def imbalance_of(parts: Sequence[I64]) -> float:
    """max/mean over the concatenation of ``parts``; 1.0 when empty or all zero."""
    if not parts:
        return 1.0
    values = np.concatenate(parts)
    if values.size == 0:
        return 1.0
    total = int(values.sum())
    if total <= 0:
        return 1.0
    return float(int(values.max()) * values.size / total)


def gpu_rows(
    members: Sequence[MemberFigures],
    limit: int,
    rank: Callable[[tuple[I64, ...]], I64],
) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """``(member_id, gpu_index, figures)`` of every GPU when there are at most ``limit``,
    else of ``limit`` GPUs with the largest ``rank(values)`` (ties: any),
    in member then GPU order. ``members`` sorted by id; O(G) vectorised plus O(limit)."""
    sizes = [int(m.values[0].shape[0]) for m in members]
    total = sum(sizes)
    if total <= limit:
        for m in members:
            cols = [v.tolist() for v in m.values]
            for gpu, row in enumerate(zip(*cols, strict=True)):
                yield m.member_id, gpu, row
        return
    if limit <= 0:
        return
    key = np.concatenate([rank(m.values) for m in members])
    top = np.sort(np.argpartition(-key, limit - 1)[:limit])
    offsets = np.cumsum([0, *sizes])
    owner = np.searchsorted(offsets, top, side="right") - 1
    for pos, i in zip(top.tolist(), owner.tolist(), strict=True):
        m = members[i]
        gpu = pos - int(offsets[i])
        yield m.member_id, gpu, tuple(int(v[gpu]) for v in m.values)


#: Samples added between two yields of the GIL (see :func:`yield_gil`).
YIELD_EVERY = 256


def yield_gil() -> None:
    """Let the event loop's thread take the GIL now (a scrape of a large fleet is CPU
    work in the scrape thread; without yielding, the loop waits for the interpreter's
    switch interval at each of its GIL acquisitions)."""
    time.sleep(0)


def member_sums(members: Sequence[MemberFigures], which: int) -> list[int]:
    """Sum over each member's GPUs of figure ``which`` (one vectorised pass)."""
    if not members:
        return []
    values = np.concatenate([m.values[which] for m in members])
    sizes = [int(m.values[which].shape[0]) for m in members]
    starts = np.cumsum([0, *sizes[:-1]])
    sums: list[int] = np.add.reduceat(values, starts).tolist()
    return sums
