"""Shared fixtures: a real daemon on loopback and a client connected to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, settings

from fulcrum.client import FulcrumClient
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server

settings.register_profile(
    "fulcrum",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("fulcrum")


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    """A daemon with the test settings (free ports, seed 1234)."""
    async with running_server() as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[FulcrumClient]:
    """A client on the ``daemon`` fixture."""
    async with FulcrumClient(daemon.address, timeout_s=10.0) as c:
        yield c
