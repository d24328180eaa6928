"""Issue 22 row 15: a streaming call refused by auth reaches the client with the code the
daemon counted (PERMISSION_DENIED), not INTERNAL "Internal error from Core", even while
the client is still writing its stream. Through a real mTLS channel."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from fulcrum.service.server import Daemon
from fulcrum.v1 import decode_pb2
from tests.service.test_security import (  # noqa: F401 - fixtures
    Pki,
    denials,
    mtls_client,
    mtls_daemon,
    pki,
)

CALLS = 40


async def test_refused_stream_gets_the_counted_code_while_the_client_writes(
    mtls_daemon: Daemon, pki: Pki  # noqa: F811
) -> None:
    before = denials("PERMISSION_DENIED", "role", "DecodeBalancerService/PlaceDecodeStream")
    codes: list[grpc.StatusCode] = []
    async with mtls_client(mtls_daemon, pki, "engine-a") as c:
        for _ in range(CALLS):

            async def many() -> AsyncIterator[decode_pb2.PlaceDecodeStreamRequest]:
                for i in range(50):  # a pipelining client: it writes without waiting
                    yield decode_pb2.PlaceDecodeStreamRequest(sequence=i + 1)

            call = c.decode.PlaceDecodeStream(many())
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in call:
                    pass
            codes.append(await call.code())
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * CALLS
    after = denials("PERMISSION_DENIED", "role", "DecodeBalancerService/PlaceDecodeStream")
    assert after == before + CALLS
