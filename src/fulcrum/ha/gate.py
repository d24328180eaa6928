"""The serving gate: this daemon may answer fulcrum.v1 calls while ``time.monotonic()``
is below a deadline that only the elector moves forward (each successful renewal of the
leader's lease, measured from when the renewal was *sent*, plus ``ha.renew_deadline_s``).

The gate is checked on every call and again before a unary reply leaves; a timer closes
it when the deadline passes, so a leader that cannot renew (etcd lost, process frozen)
stops serving before its lease can expire: every call in flight is cancelled and answered
UNAVAILABLE by :mod:`fulcrum.ha.interceptor`. Event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: Trailer naming the leader's address (host:port) on a refusal.
LEADER_KEY = "x-fulcrum-leader"


class Gate:
    """See the module docstring. ``on_change(serving, reason)`` is called once per
    transition (health, metrics, the log line). ``clock``: monotonic seconds, the clock
    of the deadlines (``time.monotonic``; tests pass their own)."""

    def __init__(
        self, on_change: Callable[[bool, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._until = 0.0
        self._serving = False
        self._on_change = on_change
        self._timer: asyncio.TimerHandle | None = None
        #: Tasks of the fulcrum.v1 calls in flight (cancelled when the gate closes).
        self.calls: set[asyncio.Task[object]] = set()
        #: The leader's advertised address as last observed ("" = unknown).
        self.leader = ""

    def ok(self) -> bool:
        """Whether a call may be served now (one clock read)."""
        return self._clock() < self._until

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def until(self) -> float:
        """The deadline, ``time.monotonic()`` seconds (0 when closed)."""
        return self._until

    def extend(self, until: float, reason: str = "elected") -> None:
        """Serve until ``until`` (monotonic seconds); opens the gate if it was closed."""
        if until <= self._clock():
            self.close("renewal came too late")
            return
        self._until = until
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(until - self._clock(), self._expire)
        if not self._serving:
            self._serving = True
            self._on_change(True, reason)

    def close(self, reason: str) -> None:
        """Stop serving at once: refuse new calls and cancel every call in flight."""
        self._until = 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._serving:
            self._serving = False
            self._on_change(False, reason)
        for task in list(self.calls):
            task.cancel()

    def _expire(self) -> None:
        self._timer = None
        left = self._until - self._clock()
        if left <= 0:
            self.close("lease not renewed within ha.renew_deadline_s (fenced)")
            return
        # Early (a loop timer may fire up to a millisecond before its time) or moved on
        # meanwhile: wait for the rest. Not through extend(): by the time it reads the
        # clock the deadline may have passed, and that is a fencing, not a late renewal.
        self._timer = asyncio.get_running_loop().call_later(left, self._expire)
