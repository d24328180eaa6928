"""structlog set-up: JSON lines when stdout is not a terminal, key=value in one.

Every log line of a gRPC call carries its ``request_id`` (bound through contextvars by the
service interceptor). Refused calls are summarised by :class:`RefusalSummary`: one info
line with counts by method and code at most once per interval, none while nothing is
refused (each refusal is still logged on its own at debug).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog globally. ``fmt`` is "auto", "json" or "console"."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )


class RefusalSummary:
    """Counts refused calls by (service, method, code) and logs them in one info line,
    ``calls_refused``, at most once per ``interval_s()`` seconds (read at each line, so a
    reload applies it). A line counts the refusals of one interval, which starts at the
    first refusal after the previous line: lines are at least an interval apart, and
    nothing is scheduled or logged while no call is refused. Runs on the event loop only.
    Keys are bounded: the daemon's methods times the gRPC status codes."""

    def __init__(self, interval_s: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._counts: dict[tuple[str, str, str], int] = {}
        self._timer: asyncio.TimerHandle | None = None
        #: Loop time at which the pending line is due (None: nothing pending).
        self.due_at: float | None = None
        self._log = structlog.get_logger("fulcrum.service.refusals")

    def record(self, service: str, method: str, code: str) -> None:
        """Count one refused call; schedules the summary line if none is pending."""
        key = (service, method, code)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._timer is None:
            loop = asyncio.get_running_loop()
            due = loop.time() + self._interval_s()
            self.due_at = due
            self._timer = loop.call_at(due, self.flush)

    def flush(self) -> None:
        """Log the counts gathered since the last line (nothing if there are none) and
        start a new interval. Called by the timer, and at drain so that none is lost."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.due_at = None
        if not self._counts:
            return
        counts = sorted(self._counts.items())
        self._counts = {}
        by_method: dict[str, dict[str, int]] = {}
        for (service, method, code), n in counts:
            by_method.setdefault(f"{service}/{method}", {})[code] = n
        self._log.info(
            "calls_refused",
            total=sum(n for _, n in counts),
            by_method=by_method,
            interval_s=self._interval_s(),
        )
