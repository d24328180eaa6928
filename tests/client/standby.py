"""A tiny fake standby for client tests: a real grpc.aio server on loopback that refuses
every call (any service, unary or streaming) UNAVAILABLE with an ``x-fulcrum-leader``
trailer, as a ``ha.backend: etcd`` standby does, and counts what it refused."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401  (registers grpc.health.v1 in the pool)

from fulcrum.client.failover import LEADER_KEY
from fulcrum.v1 import descriptors  # noqa: F401  (registers every fulcrum.v1 file)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _streaming(method: str) -> tuple[bool, bool]:
    """(client_streaming, server_streaming) of ``/package.Service/Method``."""
    service, name = method.lstrip("/").split("/")
    desc = descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]
    return desc.client_streaming, desc.server_streaming


class FakeStandby(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Refuses every call; ``leader`` is the trailer's value (``None``: no trailer, as a
    daemon that is merely unavailable; ``""``: a standby that knows no leader)."""

    def __init__(self, leader: str | None, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.leader = leader
        self.extra = extra
        self.calls: Counter[str] = Counter()
        self.address = ""
        self._server: grpc.aio.Server | None = None

    @property
    def refused(self) -> int:
        return sum(self.calls.values())

    def _trailers(self) -> tuple[tuple[str, str], ...]:
        head = () if self.leader is None else ((LEADER_KEY, self.leader),)
        return head + self.extra

    async def _refuse(self, method: str, context: Any) -> None:
        self.calls[method] += 1
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "standby: not the leader",
            trailing_metadata=self._trailers(),
        )

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        try:
            client_streaming, server_streaming = _streaming(method)
        except (KeyError, ValueError):
            return None
        if not client_streaming and not server_streaming:

            async def unary(request: bytes, context: Any) -> bytes:
                await self._refuse(method, context)
                return b""

            return grpc.unary_unary_rpc_method_handler(unary)

        async def stream(request: Any, context: Any) -> AsyncIterator[bytes]:
            await self._refuse(method, context)
            yield b""

        if client_streaming:
            return grpc.stream_stream_rpc_method_handler(stream)
        return grpc.unary_stream_rpc_method_handler(stream)

    async def start(self, port: int = 0) -> str:
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((self,))
        bound = self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._server.start()
        self.address = f"127.0.0.1:{bound}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def __aenter__(self) -> FakeStandby:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
