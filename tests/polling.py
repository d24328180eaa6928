"""Bounded polls for tests: wait for a condition, fail with a message when the deadline
passes (never fall through silently, never a fixed sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

#: Default deadline of a poll, seconds: generous, the machine is shared and slow at times.
DEADLINE_S = 10.0


async def until(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S,
                period_s: float = 0.002) -> None:
    """Poll ``cond`` on the running loop until true; AssertionError naming ``what`` once
    ``timeout_s`` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"not reached in {timeout_s} s: {what}"
        await asyncio.sleep(period_s)


async def until_async(cond: Callable[[], Awaitable[bool]], what: str,
                      timeout_s: float = DEADLINE_S, period_s: float = 0.005) -> None:
    """:func:`until` for a condition that must await (a scrape, a call)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await cond():
        assert loop.time() < deadline, f"not reached in {timeout_s} s: {what}"
        await asyncio.sleep(period_s)


def until_sync(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S,
               period_s: float = 0.005) -> None:
    """:func:`until` for code outside an event loop."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(period_s)


class FakeClock:
    """A clock the test moves: call it for the time (s); :meth:`advance` moves it on."""

    def __init__(self, start_s: float = 1_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, s: float) -> float:
        self.now_s += s
        return self.now_s
