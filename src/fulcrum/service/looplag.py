"""Event-loop lag: how late the loop wakes a task up, as a histogram.

A small task sleeps ``server.loop_lag_probe_ms`` (default :data:`INTERVAL_S`) at a time
and observes, at every wake-up, the scheduled-vs-actual delay in
``fulcrum_event_loop_lag_seconds``. Anything that holds the loop (a long step of a handler,
a snapshot built on the loop, the GIL held by another thread) delays the wake-ups that fall
during it: a stall of ``S`` seconds longer than the period ``P`` shows as a lag of at least
``S - P``; a shorter one shows when a wake-up falls in it (with probability about
``S / P``).

Cost: one wake-up of the process per period, most of an idle daemon's CPU. Measured on the
2-core test machine (stop 38): an idle gateway daemon used 14.7 ms of CPU a second with a
10 ms period and 5.3 ms/s with 50 ms; behind Envoy, 0.68 against 0.59 ms per request. The
default, 50 ms, still samples the lateness ten times finer than the admission's shedding
bound (``server.admission.shed_wait_ms``, 500 ms); ``benchmarks/bench_scale.py``, whose aim
is about 20 ms stalls, runs the daemon with a 10 ms period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from prometheus_client import Histogram

from fulcrum.metrics import REGISTRY
from fulcrum.service.app import App

#: Default period of the probe, seconds (``server.loop_lag_probe_ms``).
INTERVAL_S: Final = 0.05

#: Lag buckets, seconds: 0.5 ms to 5 s, fine around the 20 ms budget per loop step.
LAG_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
)

LAG = Histogram(
    "fulcrum_event_loop_lag_seconds",
    "Delay of the event loop's wake-ups past their scheduled time (a probe task sleeping "
    "server.loop_lag_probe_ms at a time), seconds.",
    buckets=LAG_BUCKETS,
    registry=REGISTRY,
)


class LagMonitor:
    """The probe; :attr:`max_s` is the largest lag seen (for tests and benchmarks).
    :attr:`listeners` get every sample too (seconds): the admission's lateness estimate
    (:meth:`fulcrum.service.admission.Admission.watch`) rides on this probe instead of a
    second ticker measuring the same thing."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.max_s = 0.0
        self.samples = 0
        self.listeners: list[Callable[[float], None]] = []

    def observe(self, lag_s: float) -> None:
        """One sample (seconds): the histogram, the maximum, the listeners."""
        LAG.observe(lag_s)
        self.samples += 1
        if lag_s > self.max_s:
            self.max_s = lag_s
        for fn in self.listeners:
            fn(lag_s)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.observe(max(loop.time() - due, 0.0))


def start(app: App) -> LagMonitor:
    """Run the probe until the daemon stops (kept in ``app.components["loop_lag"]``)."""
    monitor = LagMonitor(app.settings.server.loop_lag_probe_ms / 1000)
    app.components["loop_lag"] = monitor
    app.spawn(monitor.run(), "loop-lag")
    return monitor
