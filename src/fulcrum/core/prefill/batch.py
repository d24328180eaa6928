"""Batch selection for an engine pull: FIFO prefix of a tier queue within quota.

Rule (SPEC section 3, level 2): an engine pulls with its remaining compute quota (ns).
The batch is the longest FIFO prefix of its tier's queue whose summed predicted cost (ns)
is within ``min(remaining quota, tier batch cap)`` and holds at most ``max_requests``
requests; no request jumps the queue. When not even the head fits and the engine is idle
(no outstanding load), the head is served alone: an oversize request -- larger than any
engine's quota or than the tier cap -- is never starved.

When several engines wait on the same tier, the puller rule picks the one that takes the
work (:mod:`fulcrum.core.prefill.rules.puller`; the published rule: the most remaining
quota, ties to the caller's deterministic order, engine id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

NAME: Final = "fifo_quota"


def select_batch(
    costs_ns: Iterable[int],
    remaining_ns: int,
    cap_ns: int,
    *,
    idle: bool,
    max_requests: int | None = None,
) -> int:
    """Number of requests to take from the head of a tier queue (a FIFO prefix length).

    ``costs_ns``: predicted cost (ns) of each queued request, head first (may be lazy;
    iteration stops as soon as the prefix is decided). ``remaining_ns``: the engine's
    remaining quota (ns). ``cap_ns``: the tier's per-batch quota cap (ns). ``idle``: the
    engine has no outstanding work. ``max_requests``: optional count cap (>= 1).
    """
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests: must be >= 1, got {max_requests}")
    limit = min(remaining_ns, cap_ns)
    used = 0
    n = 0
    for cost in costs_ns:
        if max_requests is not None and n >= max_requests:
            break
        if used + cost > limit:
            if n == 0 and idle:
                return 1  # oversize head on an idle engine: served alone
            break
        used += cost
        n += 1
    return n


def quota_ns(horizon_ns: int, rank_loads_ns: Sequence[int]) -> int:
    """The documented ``remaining_quota_ns`` of a pull (ns): over the DP ranks,
    ``sum(max(0, horizon_ns - load))`` with ``horizon_ns`` the tier's horizon from the
    daemon's ``PrefillAssignment`` and ``rank_loads_ns`` each rank's queued work (ns).
    Engines (:mod:`fulcrum.client.prefill`) and the simulator both call this."""
    return int(sum(max(0, int(horizon_ns) - int(x)) for x in rank_loads_ns))


class BatchFill:
    """:func:`select_batch` one request at a time: :meth:`offer` each cost (ns) head
    first and stop at the first refusal or once :attr:`closed` (an oversize head taken
    alone); :attr:`n` requests are taken, exactly as :func:`select_batch` would count."""

    __slots__ = ("_idle", "_limit", "_max", "closed", "n", "used")

    def __init__(self, remaining_ns: int, cap_ns: int, *, idle: bool,
                 max_requests: int | None = None) -> None:
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1, got {max_requests}")
        self._limit = min(remaining_ns, cap_ns)
        self._idle = idle
        self._max = max_requests
        self.used = 0
        self.n = 0
        self.closed = False

    def offer(self, cost_ns: int) -> bool:
        """True when the request of ``cost_ns`` is taken; False ends the batch."""
        if self.closed or (self._max is not None and self.n >= self._max):
            return False
        if self.used + cost_ns > self._limit:
            if self.n == 0 and self._idle:
                self.n, self.closed = 1, True  # oversize head on an idle engine: alone
                return True
            return False
        self.used += cost_ns
        self.n += 1
        return True
