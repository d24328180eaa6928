"""The shell interceptor: one wrapper around every handler.

It binds a request id to the log context, refuses new calls while draining (UNAVAILABLE,
so that callers retry elsewhere), refuses calls beyond the admission bounds
(RESOURCE_EXHAUSTED with ``retry-after-ms``, see :mod:`fulcrum.service.admission`), caps
unary calls at ``server.max_call_s`` (read per call: reloadable), turns domain
errors into their status codes (never UNKNOWN), closes streams with UNAVAILABLE when the
daemon drains, and records per-method counts by code and a latency histogram. Every
call that ends with a code other than OK or CANCELLED is counted in the daemon's
:class:`~fulcrum.logs.RefusalSummary` (``app.components["refusals"]``): operators see one
info line per interval with counts by method and code (``logging.refusal_summary_interval_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from fulcrum.errors import FulcrumError, ResourceExhausted, Unavailable
from fulcrum.logs import RefusalSummary
from fulcrum.metrics import RPC_DURATION, RPC_IN_FLIGHT, RPC_REQUESTS, STREAM_MESSAGES
from fulcrum.service.admission import Admission, bind, class_of, handler_started
from fulcrum.service.app import App
from fulcrum.service.errors import RETRY_AFTER_KEY, status_of
from fulcrum.service.wrap import (
    Behavior,
    is_exempt,
    method_labels,
    replacing,
    rewrap,
    run_behavior,
)

log = structlog.get_logger(__name__)

_ids = itertools.count(1)
_prefix = f"{os.getpid():x}-"


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and 0 < len(value) <= 128:
            return value
    return _prefix + str(next(_ids))


class _Call:
    """Book-keeping of one call: labels, start time, final code."""

    __slots__ = ("admitted", "cls", "exempt", "labels", "method", "start", "token")

    def __init__(self, method: str, cls: str, arrived: float, token: int = 0) -> None:
        #: Admission token (0 = none).
        self.token = token
        self.method = method
        self.labels = method_labels(method)
        self.exempt = is_exempt(method)
        self.cls = cls
        self.admitted = False
        #: Arrival (first interceptor), ``time.perf_counter()`` seconds: durations include
        #: the wait for the request message and the event loop.
        self.start = arrived


class ShellInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, app: App, admission: Admission | None = None) -> None:
        self._app = app
        self._admission = admission
        summary = RefusalSummary(lambda: app.settings.logging.refusal_summary_interval_s)
        self._refusals = summary
        app.components["refusals"] = summary
        app.drain_hooks.append(summary.flush)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        arrived = time.perf_counter()
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method
        token = 0
        if self._admission is not None and not is_exempt(method):
            cls = class_of(method)
            token, retry_ms = self._admission.arrive(cls, arrived)
            if retry_ms is not None:
                return replacing(handler, self._refusal(method, cls, arrived, retry_ms))
            bind(self._admission, token)
            # the call's task ends however the call ends (a caller that gives up before
            # the handler runs cancels it): it then stops waiting in any case
            task = asyncio.current_task()
            if task is not None:
                admission = self._admission
                task.add_done_callback(lambda _t: admission.ended(token))

        def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool
                 ) -> Behavior:
            if response_streaming:
                return self._stream(method, behavior, arrived, token,
                                    client_streaming=request_streaming)
            if request_streaming:
                return behavior  # stream-unary: no such method; left as it is
            return self._unary(method, behavior, arrived, token)

        return rewrap(handler, wrap)

    def _refusal(self, method: str, cls: str, arrived: float, retry_ms: int) -> Behavior:
        """A behaviour that refuses the call at once, RESOURCE_EXHAUSTED with a retry hint,
        without reading its request (see :func:`fulcrum.service.wrap.replacing`)."""

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await self._shed(_Call(method, cls, arrived), context, retry_ms)

        return refuse

    async def _shed(self, call: _Call, context: grpc.aio.ServicerContext,
                    retry_ms: int) -> None:
        """End ``call`` RESOURCE_EXHAUSTED: its admission class is being shed."""
        await self._finish(call, grpc.StatusCode.RESOURCE_EXHAUSTED)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"server: busy, {call.cls} calls are being shed; retry after {retry_ms} ms",
            trailing_metadata=((RETRY_AFTER_KEY, str(retry_ms)),),
        )

    # -- helpers ------------------------------------------------------------------------

    async def _enter(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=_request_id(context))
        if not call.exempt:
            handler_started()
            if self._app.draining.is_set():
                await self._finish(call, grpc.StatusCode.UNAVAILABLE)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry")
            if self._admission is not None:
                self._admission.started(call.token)
                retry_ms = self._admission.admit(call.cls)
                if retry_ms is not None:
                    await self._shed(call, context, retry_ms)
                call.admitted = True
            self._app.call_started()
            RPC_IN_FLIGHT.inc()

    async def _finish(self, call: _Call, code: grpc.StatusCode) -> None:
        service, name = call.labels
        RPC_REQUESTS.labels(service, name, code.name).inc()
        if code is not grpc.StatusCode.OK and code is not grpc.StatusCode.CANCELLED:
            self._refusals.record(service, name, code.name)
        RPC_DURATION.labels(service, name).observe(time.perf_counter() - call.start)

    def _leave(self, call: _Call) -> None:
        if call.admitted and self._admission is not None:
            self._admission.release(call.cls)
            call.admitted = False
        if not call.exempt:
            RPC_IN_FLIGHT.dec()
            self._app.call_finished()

    async def _fail(
        self, call: _Call, context: grpc.aio.ServicerContext, err: BaseException
    ) -> None:
        """Turn an exception into a final status (aborts, which raises)."""
        if isinstance(err, FulcrumError):
            code = status_of(err)
            trailing: tuple[tuple[str, str], ...] = ()
            if isinstance(err, ResourceExhausted | Unavailable) and err.retry_after_ms:
                trailing = ((RETRY_AFTER_KEY, str(err.retry_after_ms)),)
            log.debug("call_refused", method=call.method, code=code.name, reason=err.message)
            await self._finish(call, code)
            await context.abort(code, err.message, trailing_metadata=trailing)
        if isinstance(err, TimeoutError):
            await self._finish(call, grpc.StatusCode.DEADLINE_EXCEEDED)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"call exceeded server.max_call_s={self._app.settings.server.max_call_s}",
            )
        log.error("call_failed", method=call.method, exc_info=err)
        await self._finish(call, grpc.StatusCode.INTERNAL)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the server)")

    def _unary(
        self,
        method: str,
        behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
        arrived: float,
        token: int,
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        cls = class_of(method)
        app = self._app

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(method, cls, arrived, token)
            await self._enter(call, context)
            try:
                async with asyncio.timeout(app.settings.server.max_call_s):
                    response = await behavior(request, context)
            except asyncio.CancelledError:
                await self._finish(call, grpc.StatusCode.CANCELLED)
                raise
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                await self._finish(call, code)
                raise
            except Exception as err:
                await self._fail(call, context, err)
            finally:
                self._leave(call)
            await self._finish(call, context.code() or grpc.StatusCode.OK)
            return response

        return wrapped

    def _stream(
        self,
        method: str,
        behavior: Callable[..., Any],
        arrived: float,
        token: int,
        *,
        client_streaming: bool,
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]:
        app = self._app
        cls = class_of(method)

        async def counted(requests: AsyncIterator[Any], labels: tuple[str, str]) -> Any:
            counter = STREAM_MESSAGES.labels(*labels)
            async for item in requests:
                counter.inc()
                yield item

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> None:
            call = _Call(method, cls, arrived, token)
            await self._enter(call, context)
            if client_streaming:
                request = counted(request, call.labels)

            task = asyncio.ensure_future(run_behavior(behavior, request, context))
            drain = asyncio.ensure_future(app.draining.wait())
            try:
                await asyncio.wait({task, drain}, return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    await self._finish(call, grpc.StatusCode.UNAVAILABLE)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry")
                task.result()
            except asyncio.CancelledError:
                task.cancel()
                await self._finish(call, grpc.StatusCode.CANCELLED)
                raise
            except grpc.aio.AbortError:
                if not drain.done() or context.code() != grpc.StatusCode.UNAVAILABLE:
                    await self._finish(call, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            except Exception as err:
                await self._fail(call, context, err)
            finally:
                drain.cancel()
                self._leave(call)
            await self._finish(call, context.code() or grpc.StatusCode.OK)

        return wrapped
