"""structlog set-up: JSON lines when stdout is not a terminal, key=value in one.

Every log line of a gRPC call carries its ``request_id`` (bound through contextvars by the
service interceptor).
"""

from __future__ import annotations

import logging
import sys
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
