"""The daemon's context handed to every service module: settings, the fleet table, the
clock, the random source, the drain signal and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from fulcrum.config import Settings
from fulcrum.state.fleet import Fleet

log = structlog.get_logger(__name__)


@dataclass
class App:
    """Shared context of one daemon. Service modules keep their state objects in
    ``components`` under their balancer's name (for tests and admin introspection)."""

    settings: Settings
    fleet: Fleet
    clock: Callable[[], int] = time.monotonic_ns
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    components: dict[str, Any] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: Called with the effective settings on a configuration reload (SIGHUP): the file's
    #: settings with every restart-only key at its running value (see server.Daemon.reload).
    reload_hooks: list[Callable[[Settings], None]] = field(default_factory=list)
    #: Called once when the daemon starts to drain (before in-flight calls finish).
    drain_hooks: list[Callable[[], None]] = field(default_factory=list)
    #: Set (and cleared) when periods may have changed: wakes every :meth:`every` loop.
    _rearm: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @classmethod
    def create(cls, settings: Settings) -> App:
        seed = settings.server.seed
        fleet = Fleet(settings.fleet, incarnation_base=time.time_ns() // 1000)
        return cls(settings=settings, fleet=fleet, rng=np.random.default_rng(seed))

    # -- calls in flight (the drain waits for them) ---------------------------------------

    def call_started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def call_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight <= 0:
            self._in_flight = 0
            self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait_idle(self) -> None:
        """Return when no (non-health) call is in flight."""
        await self._idle.wait()

    # -- background work -----------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run a background task until the daemon stops; a crash is logged, not lost."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(_report_crash)
        self._tasks.append(task)

    def every(
        self, interval_s: float | Callable[[], float], fn: Callable[[int], None], name: str
    ) -> None:
        """Call ``fn(now_ns)`` every ``interval_s`` seconds until the daemon stops.
        ``interval_s`` may be a function (a reloadable period): it is read again whenever
        :meth:`periods_changed` is called, so a shorter period applies at once, not after
        the wait already under way."""
        period = interval_s if callable(interval_s) else (lambda: interval_s)

        async def loop() -> None:
            now = asyncio.get_running_loop().time
            last = now()
            while True:
                remaining = last + period() - now()
                if remaining > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._rearm.wait(), remaining)
                    continue
                last = now()
                try:
                    fn(self.clock())
                except Exception:
                    log.exception("periodic_job_failed", job=name)

        self.spawn(loop(), name)

    def periods_changed(self) -> None:
        """Wake every :meth:`every` loop to read its period again (after a reload)."""
        self._rearm.set()
        self._rearm.clear()

    def start_draining(self) -> None:
        if self.draining.is_set():
            return
        self.draining.set()
        for hook in self.drain_hooks:
            try:
                hook()
            except Exception:
                log.exception("drain_hook_failed")

    async def stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()


def _report_crash(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background_task_crashed", task=task.get_name(), exc_info=exc)
