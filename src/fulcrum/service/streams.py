"""The place/release stream loop shared by the decode and vision placement streams.

Also the lease sweep both placement tables run.

One reply per message, in order, with the unary calls' semantics; a refused message gets
its status code and message in the reply and the stream stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
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


#: Before a streaming call is refused: the longest the server reads what the client still
#: sends (s), the longest quiet gap that ends the reading early (s), the most messages.
DRAIN_S = 1.0
DRAIN_IDLE_S = 0.25
DRAIN_MESSAGES = 10_000


async def drain(requests: AsyncIterator[Any]) -> None:
    """Read and drop what a client still sends before its stream is refused: until it
    half-closes, goes quiet for ``DRAIN_IDLE_S``, or ``DRAIN_S`` / ``DRAIN_MESSAGES``.

    A status sent while a grpc-python client is still writing reaches it as INTERNAL
    "Internal error from Core" (its failed write overrides the received status, see
    ``grpc.aio._call._write``), so the refusal the server counted is not the one the client
    sees. Reading first lets the status arrive while the client is not writing. The quiet
    gap is 250 ms: at 50 ms a pipelining client on a loaded 2-core CI machine paused
    longer than that mid-stream, once in 40 refused calls, and saw INTERNAL."""
    it = aiter(requests)
    loop = asyncio.get_running_loop()
    end = loop.time() + DRAIN_S
    with contextlib.suppress(Exception):
        for _ in range(DRAIN_MESSAGES):
            async with asyncio.timeout_at(min(end, loop.time() + DRAIN_IDLE_S)):
                await anext(it)


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
