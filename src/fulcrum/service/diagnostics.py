"""DiagnosticsService: no-op calls, the baseline every benchmark divides by."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from fulcrum.errors import InvalidArgument
from fulcrum.service.app import App
from fulcrum.v1 import diagnostics_pb2 as pb
from fulcrum.v1 import diagnostics_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["DiagnosticsService"].full_name


class DiagnosticsServicer(pb_grpc.DiagnosticsServiceServicer):
    """Echo, optionally after a delay (to test draining)."""

    async def Ping(
        self, request: pb.PingRequest, context: grpc.aio.ServicerContext
    ) -> pb.PingResponse:
        if request.delay_ms:
            if request.delay_ms > 60_000:
                raise InvalidArgument("delay_ms", "must be at most 60000")
            await asyncio.sleep(request.delay_ms / 1000)
        return pb.PingResponse(payload=request.payload)

    async def PingStream(
        self,
        request_iterator: AsyncIterator[pb.PingStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.PingStreamResponse]:
        async for request in request_iterator:
            yield pb.PingStreamResponse(payload=request.payload)


def register(server: grpc.aio.Server, app: App) -> list[str]:
    """Add the servicer; returns the full service names (for health and reflection)."""
    pb_grpc.add_DiagnosticsServiceServicer_to_server(DiagnosticsServicer(), server)
    return [SERVICE]
