"""Gate fulcrum.v1 calls on the leadership (installed only with an HA backend).

Off the leader (standby, fenced, etcd unreachable) a fulcrum.v1 call is answered at once
UNAVAILABLE with the ``x-fulcrum-leader: host:port`` trailer (when the leader is known),
without reading its request. On the leader each call's task is tracked: when the gate
closes, every call in flight (unary, long poll or stream) is cancelled and answered
UNAVAILABLE with the trailer; a unary reply computed while the gate closed is replaced by
that refusal, so a deposed leader never answers as leader. Health checks and reflection
are not gated here (health reports the gate itself).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from fulcrum.ha.gate import LEADER_KEY, Gate

GATED_PREFIX = "/fulcrum.v1."


class HaInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        if not method.startswith(GATED_PREFIX):
            return await continuation(details)
        if not self._gate.ok():
            handler = await continuation(details)
            return None if handler is None else self._refusal(handler)
        handler = await continuation(details)
        if handler is None:
            return None
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._wrap(handler.unary_stream), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._wrap(handler.stream_unary), **kw)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._wrap(handler.stream_stream), **kw)
        return handler

    def _trailer(self) -> tuple[tuple[str, str], ...]:
        leader = self._gate.leader
        return ((LEADER_KEY, leader),) if leader else ()

    async def _refuse(self, context: grpc.aio.ServicerContext) -> None:
        leader = self._gate.leader or "unknown"
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"ha: this daemon is not the leader (leader: {leader}); retry there",
            trailing_metadata=self._trailer(),
        )

    def _refusal(self, handler: Any) -> grpc.RpcMethodHandler:
        """A handler that refuses without reading the request (client-streaming)."""

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await self._refuse(context)

        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, **kw)
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)

    def _wrap(self, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        gate = self._gate

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            task = asyncio.current_task()
            if task is None or not gate.ok():
                await self._refuse(context)
            assert task is not None
            gate.calls.add(task)
            try:
                result = behavior(request, context)
                if inspect.isasyncgen(result):  # a streaming handler not wrapped by the shell
                    async for item in result:
                        await context.write(item)
                    result = None
                else:
                    result = await result
            except asyncio.CancelledError:
                if gate.ok():
                    raise  # the caller went away
                task.uncancel()
                result = None
            finally:
                gate.calls.discard(task)
            if not gate.ok():
                await self._refuse(context)
            return result

        return wrapped
