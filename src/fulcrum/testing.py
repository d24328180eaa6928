"""Test and benchmark helpers: run a real daemon in-process on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fulcrum import logs
from fulcrum.config import Settings, with_overrides
from fulcrum.service.server import Daemon, build


def test_settings(overrides: dict[str, Any] | None = None) -> Settings:
    """Default settings on loopback with free ports and a fixed seed, plus ``overrides``
    (nested dict, e.g. ``{"decode": {"policy": "least_kv"}}``)."""
    base = {
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "seed": 1234,
            "grace_period_s": 5.0,
            "drain_linger_s": 0.0,
        },
        "metrics": {"port": 0},
        "logging": {"level": "warning", "format": "json"},
    }
    settings = with_overrides(Settings(), base)
    return with_overrides(settings, overrides or {})


@contextlib.asynccontextmanager
async def running_server(
    overrides: dict[str, Any] | None = None, settings: Settings | None = None
) -> AsyncIterator[Daemon]:
    """Start a daemon on 127.0.0.1 (free ports), yield it, then drain and stop it.
    ``daemon.address`` is HOST:PORT; ``daemon.app.components`` holds the state tables."""
    settings = settings or test_settings(overrides)
    logs.configure(settings.logging.level, settings.logging.format)
    daemon = build(settings)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.drain_and_stop()
