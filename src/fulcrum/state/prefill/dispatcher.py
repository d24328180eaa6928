"""Long-polling prefill pulls and who is woken when work arrives.

A pull that finds nothing it may take parks (a :class:`Waiter`). When work is queued in a
tier, the dispatcher wakes the one parked pull that the balancer chooses for it; at most
one pull is woken per tier at a time. The woken pull takes its batch itself, then passes
the wake on if it could not take (or never ran). The pulls not woken are kept in a
:class:`~fulcrum.core.prefill.waiting.Waiting` (grouped across dispatches), so a dispatch
costs what it asks, not a pass over every parked pull; its choice is the simulator's
(:func:`fulcrum.core.prefill.dispatch.pick_puller`) over the same offers. Only the event
loop touches it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable

from fulcrum.core.prefill.balancer import PrefillBalancer
from fulcrum.core.prefill.waiting import Waiting
from fulcrum.errors import NotFound
from fulcrum.state.prefill.records import Batch, Engine, Waiter
from fulcrum.units import NS_PER_S


class Dispatcher:
    """See module docstring. ``live_head(tier)``: True when ``tier`` has a queued request
    whose caller still waits; ``draining()``: True once the daemon drains."""

    def __init__(self, balancer: PrefillBalancer, clock: Callable[[], int],
                 live_head: Callable[[int], bool], draining: Callable[[], bool]) -> None:
        self._bal = balancer
        self._clock = clock
        self._live_head = live_head
        self._draining = draining
        #: Parked pulls by engine id (then parking order): a dispatch's offer order.
        self.waiters: list[Waiter] = []
        self._offered = Waiting()  # those not woken, at (engine id, parking number)
        self._at: dict[tuple[str, int], Waiter] = {}
        self._parked = itertools.count()
        self.woken = [0] * balancer.n_tiers  # woken waiters not yet run, per tier

    def waiting(self, tier: int) -> int:
        """Pulls currently long-polling (not woken) by engines of ``tier``."""
        return sum(
            1 for w in self.waiters
            if not w.woken and self._bal.engine_tier(w.engine.member_id) == tier
        )

    def dispatch_all(self) -> None:
        """:meth:`dispatch` every tier."""
        for t in range(len(self.woken)):
            self.dispatch(t)

    def dispatch(self, tier: int) -> None:
        """Wake the waiting pull the balancer chooses for ``tier``'s work (one at a time)."""
        if self.woken[tier] > 0 or not self._offered or not self._live_head(tier):
            return
        place = self._offered.pick(self._bal, tier, self._clock())
        if place is not None:
            self._wake(self._at[place], tier)

    def end(self, eng: Engine) -> None:
        """End ``eng``'s parked pulls (it left, or a new incarnation replaced it)."""
        for waiter in list(eng.waiters):
            waiter.event.set()

    def end_all(self) -> None:
        """End every parked pull (drain)."""
        for waiter in self.waiters:
            waiter.event.set()

    async def park(self, waiter: Waiter, wait_ns: int, refresh_s: float,
                   take: Callable[[], Batch], keepalive: Callable[[], None]) -> Batch | None:
        """Long-poll ``waiter`` for up to ``wait_ns``: each time it is woken, ``take()``;
        the first batch with items is returned, None when the wait ends empty (time out,
        drain). ``keepalive()`` runs every ``refresh_s`` seconds parked; NOT_FOUND when
        the engine left meanwhile."""
        eng = waiter.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ns / NS_PER_S
        eng.waiters.append(waiter)
        bisect.insort(self.waiters, waiter, key=_engine_id)
        waiter.place = (eng.member_id, next(self._parked))
        self._at[waiter.place] = waiter
        self._offered.add(self._bal, waiter.place, waiter.offer)
        try:
            self.dispatch_all()
            while (timeout := deadline - loop.time()) > 0:
                if not await _woken_within(waiter, min(timeout, refresh_s)):
                    keepalive()
                    continue
                woken_for = self._unwake(waiter)
                if not eng.live:
                    raise NotFound(f"engine_id: {eng.member_id!r} left the fleet")
                if self._draining():
                    break
                batch = take()
                if batch.items:
                    return batch
                if woken_for >= 0:
                    self.dispatch(woken_for)  # could not take after all: pass the wake on
        finally:
            self.waiters.remove(waiter)
            self._offered.discard(waiter.place)
            del self._at[waiter.place]
            woken_for = self._unwake(waiter, parked=False)
            if woken_for >= 0:  # woken but never ran: pass the wake on
                self.dispatch(woken_for)
            eng.waiters.remove(waiter)
        return None

    def _wake(self, waiter: Waiter, tier: int) -> None:
        self._offered.discard(waiter.place)
        waiter.woken = True
        waiter.woken_tier = tier
        self.woken[tier] += 1
        waiter.event.set()

    def _unwake(self, waiter: Waiter, parked: bool = True) -> int:
        """Release a wake (``parked``: the pull waits on, and is offered again); returns
        the tier it was for (-1 when not woken)."""
        if not waiter.woken:
            return -1
        tier = waiter.woken_tier
        waiter.woken = False
        waiter.woken_tier = -1
        self.woken[tier] -= 1
        if parked:
            self._offered.add(self._bal, waiter.place, waiter.offer)
        return tier


def _engine_id(waiter: Waiter) -> str:
    return waiter.engine.member_id


async def _woken_within(waiter: Waiter, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``waiter``'s event; True (and cleared) when set."""
    try:
        async with asyncio.timeout(timeout_s):
            await waiter.event.wait()
    except TimeoutError:
        return False
    waiter.event.clear()
    return True
