"""Helpers of the prefill service tests: a daemon with long rounds, engines, polling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fulcrum.client import FulcrumClient
from fulcrum.service.server import Daemon
from fulcrum.state.prefill import PrefillState
from fulcrum.testing import running_server
from fulcrum.v1 import fleet_pb2, prefill_pb2

#: Rounds, refits and lapses never fire on their own during a test: the test drives them.
BASE: dict[str, Any] = {
    "fleet": {"heartbeat_timeout_ms": 3_600_000},
    "prefill": {"round_period_ms": 3_600_000, "refit": {"period_s": 3600.0}},
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Nested dict merge (``over`` wins)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@contextlib.asynccontextmanager
async def prefill_daemon(
    overrides: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Daemon, FulcrumClient, PrefillState]]:
    """A daemon, a client on it and its prefill state."""
    async with (
        running_server(merge(BASE, overrides or {})) as d,
        FulcrumClient(d.address, timeout_s=30.0) as c,
    ):
        yield d, c, d.app.components["prefill"]


async def register(c: FulcrumClient, engine_id: str, dp_ranks: int = 4) -> int:
    """Register a prefill engine; returns its incarnation."""
    reply = await c.fleet.Register(
        fleet_pb2.RegisterRequest(
            member_id=engine_id,
            prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=dp_ranks),
        )
    )
    return int(reply.incarnation)


def pull_request(
    engine_id: str,
    incarnation: int,
    remaining_ns: int,
    loads: list[int] | None = None,
    wait_ms: int = 5_000,
    max_requests: int = 0,
    ack_on_reply: bool = True,
    ack: list[str] | None = None,
) -> prefill_pb2.PullRequest:
    """A pull; ``ack_on_reply`` (the default of these balancing tests) skips the lease:
    the lease tests (test_prefill_leases.py) set it False and acknowledge."""
    return prefill_pb2.PullRequest(
        ack_on_reply=ack_on_reply,
        ack_request_ids=ack or [],
        engine_id=engine_id,
        incarnation=incarnation,
        remaining_quota_ns=remaining_ns,
        rank_loads_ns=loads or [],
        max_wait_ms=wait_ms,
        max_requests=max_requests,
    )


def submit_request(
    request_id: str, total: int, cached: int = 0, wait_ms: int = 20_000
) -> prefill_pb2.SubmitRequest:
    return prefill_pb2.SubmitRequest(
        request_id=request_id, total_tokens=total, cached_tokens=cached, max_wait_ms=wait_ms
    )


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``cond`` until true; fail after a bounded deadline (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)
