"""The place/release stream loop shared by the decode and vision placement streams.

Also the lease sweep both placement tables run.

One reply per message, in order, with the unary calls' semantics; a refused message gets
its status code and message in the reply and the stream stays open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from fulcrum.errors import FulcrumError, InvalidArgument
from fulcrum.service.app import App
from fulcrum.service.errors import status_of
from fulcrum.units import NS_PER_MS, NS_PER_S

log = structlog.get_logger(__name__)

R = TypeVar("R")


async def place_release_stream(
    messages: AsyncIterator[Any],
    reply_type: Callable[..., R],
    place_into: Callable[[Any, Any], object],
    release_into: Callable[[Any, Any], object],
) -> AsyncIterator[R]:
    """Answer each message of ``messages`` (each with ``sequence`` and a ``place`` /
    ``release`` oneof) with a ``reply_type`` echoing its sequence; ``place_into(request,
    reply.place)`` and ``release_into(request, reply.release)`` fill the result in place."""
    async for message in messages:
        reply: Any = reply_type(sequence=message.sequence)
        try:
            if message.HasField("place"):
                place_into(message.place, reply.place)
            elif message.HasField("release"):
                release_into(message.release, reply.release)
            else:
                raise InvalidArgument("op", "one of place, release must be set")
        except FulcrumError as err:
            reply.code = status_of(err).value[0]
            reply.message = err.message
        yield reply


async def sweep_leases(
    app: App, expire: Callable[[int], object], interval_ms: Callable[[], int]
) -> None:
    """Call ``expire(now_ns)`` every ``interval_ms()`` ms (read at every round, so that a
    reload of the sweep period applies) until the daemon stops."""
    while True:
        await asyncio.sleep(interval_ms() * NS_PER_MS / NS_PER_S)
        try:
            expire(app.clock())
        except Exception:
            log.exception("periodic_job_failed", job="lease-sweep")
