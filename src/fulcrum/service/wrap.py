"""The one place that wraps gRPC method handlers, for both server interceptors.

The guard (:mod:`fulcrum.service.authz`: input guard and authorisation) and the shell
(:mod:`fulcrum.service.interceptors`: drain, admission, deadlines, status codes, metrics)
each replace a handler's behaviour by a wrapper of their own; :func:`rewrap` rebuilds the
handler of the same kind (unary or streaming request, unary or streaming response) around
it, and :func:`run_behavior` runs a behaviour the same way for every kind. The methods
neither interceptor admits, authorises or counts as calls are :data:`EXEMPT_PREFIXES`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Final

import grpc

#: Method prefixes exempt from authorisation and admission: health checking, reflection.
EXEMPT_PREFIXES: Final = ("/grpc.health.v1.Health/", "/grpc.reflection.")

#: A handler's behaviour: ``(request or request iterator, context) -> result``.
Behavior = Callable[..., Any]
#: ``wrap(behavior, request_streaming, response_streaming)`` -> the wrapped behaviour.
Wrap = Callable[[Behavior, bool, bool], Behavior]

# (attribute of the handler, request streaming, response streaming, factory)
_KINDS: Final = (
    ("unary_unary", False, False, grpc.unary_unary_rpc_method_handler),
    ("unary_stream", False, True, grpc.unary_stream_rpc_method_handler),
    ("stream_unary", True, False, grpc.stream_unary_rpc_method_handler),
    ("stream_stream", True, True, grpc.stream_stream_rpc_method_handler),
)


def is_exempt(method: str) -> bool:
    """True for a full method name under :data:`EXEMPT_PREFIXES`."""
    return method.startswith(EXEMPT_PREFIXES)


def method_labels(method: str) -> tuple[str, str]:
    """``("PrefillBalancerService", "Submit")`` of ``"/fulcrum.v1.PrefillBalancerService/Submit"``
    (the metrics' service and method labels)."""
    _, _, rest = method.partition("/")
    service, _, name = rest.partition("/")
    return service.rsplit(".", 1)[-1], name


def rewrap(handler: Any, wrap: Wrap,
           request_deserializer: Callable[[bytes], Any] | None = None) -> Any:
    """``handler`` with its behaviour replaced by ``wrap(behavior, request_streaming,
    response_streaming)``, of the same kind and serializers (and ``request_deserializer``
    instead of its own when given)."""
    deserializer = request_deserializer or handler.request_deserializer
    for attr, request_streaming, response_streaming, factory in _KINDS:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return factory(
                wrap(behavior, request_streaming, response_streaming),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def replacing(handler: Any, behavior: Behavior) -> Any:
    """A handler that runs ``behavior(requests, context)`` instead of ``handler``'s,
    registered as client-streaming so that gRPC does not wait for (and parse) the request
    message before running it; its response streams when ``handler``'s does."""
    factory = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
               else grpc.stream_unary_rpc_method_handler)
    return factory(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def run_behavior(behavior: Behavior, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """Run ``behavior(request, context)`` to its end: a coroutine's result is returned; an
    async generator's items are written to the stream (None is returned then)."""
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async for item in result:
            await context.write(item)
        return None
    return await result
