"""The HTTP picker path: Envoy's ext_authz ``http_service`` picks over plain HTTP/1.1.

The unary mode (:mod:`fulcrum.gateway.authz`) asks for one gRPC ``Check`` per HTTP
request; grpc.aio's own per-call work is then most of the picker's CPU (BENCHMARKS.md,
"Real engines", stop 36). This mode is the same pick over Envoy's other ext_authz
transport: Envoy sends the request's method, path, allowed headers (the tenancy headers)
and buffered body to ``gateway.authz_http_port`` on a kept-alive HTTP/1.1 connection; the
answer is

- **a pick**: ``200`` with ``x-gateway-destination-endpoint``, the P/D prefiller header
  when there is one, and ``x-fulcrum-placement`` (the placement's token,
  :func:`fulcrum.gateway.authz.placement_token`); the ext_authz filter's
  ``allowed_upstream_headers`` copies them onto the request and ``clear_route_cache``
  re-routes it, as in the unary mode;
- **a refusal**: the same status, headers and JSON body as the other modes' (429 with
  ``retry-after``, 413, 400, 503); Envoy passes a denied answer to the client.

The release is the unary mode's: the gRPC access log (one batched stream per Envoy
worker) names each finished request's token, and every placement is released at the
latest ``gateway.max_hold_s`` after its pick. A pick whose connection closed before the
answer was written (Envoy's timeout, its restart) is released at once.

Bounds: a request head over :data:`MAX_HEAD_BYTES`, a malformed request line or
``content-length``, or a chunked body is answered 400 (431 for the head) and the
connection closed; a body over ``gateway.max_body_bytes`` is answered 413 and the
connection closed. Limits (docs/gateway-limits.md): no subset hint (ext_authz sends no
filter metadata over HTTP); plaintext, like the gRPC port.

Event loop only: the protocol objects run on the daemon's loop and touch the picker there.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable
from typing import Final, cast

import structlog

from fulcrum.gateway import authz
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.adapter import Placement
from fulcrum.gateway.extproc import (
    Picker,
    Refusal,
    count_refusal,
    refusal_body,
    refusal_headers,
)

log = structlog.get_logger(__name__)

#: Largest request line plus headers read, bytes (bigger: 431, connection closed).
MAX_HEAD_BYTES: Final = 65_536

_REASONS: Final = {
    200: "OK", 400: "Bad Request", 413: "Payload Too Large", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 503: "Service Unavailable",
}


class _BadRequest(Exception):
    """A request this server will not read (answered, then the connection closes)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_head(head: bytes) -> tuple[str, str, dict[str, str], int]:
    """(method, path, headers with lower-case names, content length) of a request head
    (request line and headers, without the blank line). Raises :class:`_BadRequest`."""
    try:
        text = head.decode("latin-1")
        line, *fields = text.split("\r\n")
        method, path, version = line.split(" ")
    except ValueError:
        raise _BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(400, f"unsupported version {version[:16]!r}")
    headers: dict[str, str] = {}
    for f in fields:
        name, sep, value = f.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _BadRequest(400, "transfer-encoding: not supported (a content-length body only)")
    raw = headers.get("content-length", "0")
    if not raw.isdigit() or len(raw) > 12:
        raise _BadRequest(400, f"content-length: {raw[:16]!r} is not a byte count")
    return method, path, headers, int(raw)


def response(code: int, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    """One HTTP/1.1 response (``content-length`` added)."""
    lines = [f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def refused(refusal: Refusal) -> bytes:
    """The HTTP answer of a refusal, counted already (the other modes' status, headers
    and JSON body)."""
    return response(refusal.code, refusal_headers(refusal), refusal_body(refusal))


class AuthzHttp:
    """The picks of every connection (shares the unary mode's lease table)."""

    def __init__(self, picker: Picker, leases: authz.Leases, clock: Callable[[], int]) -> None:
        self.picker = picker
        self.leases = leases
        self._clock = clock
        #: Open connections (closed by :meth:`close_all` when the daemon stops).
        self.connections: set[_Connection] = set()
        me = weakref.ref(self)  # read when scraped, not set per connection
        gm.HTTP_CONNECTIONS.set_function(lambda: _count(me))

    def protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (``loop.create_server``'s factory)."""
        return _Connection(self)

    def close_all(self) -> None:
        for c in list(self.connections):
            c.close()

    async def answer(self, path: str, headers: dict[str, str], body: bytes,
                     still_open: Callable[[], bool]) -> bytes:
        """The answer to one authorization request (:func:`fulcrum.gateway.authz.check`;
        ``still_open``: the connection can still carry it, a pick it cannot carry is
        released at once)."""
        got = await authz.check(self.picker, self.leases, self._clock, body, path, None,
                                headers)
        return self.rendered(got, still_open)

    def answer_now(self, path: str, headers: dict[str, str], body: bytes) -> bytes | None:
        """:meth:`answer` on the connection's own callback (the connection is open), or
        None when the pick has to wait (:func:`fulcrum.gateway.authz.check_now`)."""
        got = authz.check_now(self.picker, self.leases, self._clock, body, path, None,
                              headers)
        return None if got is None else self.rendered(got, lambda: True)

    def rendered(self, got: tuple[Placement, str] | Refusal,
                 still_open: Callable[[], bool]) -> bytes:
        """The HTTP answer of a pick (a pick the connection can no longer carry is
        released at once)."""
        if isinstance(got, Refusal):
            return refused(got)
        out, token = got
        if not still_open():
            self.leases.release(token, "check_cancelled")
        return response(200, [*authz.answer_headers(out), (authz.PLACEMENT_HEADER, token)])


def _count(ref: weakref.ReferenceType[AuthzHttp]) -> float:
    """Open connections of the HTTP picker ``ref`` points to (0 once it is gone)."""
    server = ref()
    return 0.0 if server is None else float(len(server.connections))


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: requests answered one at a time, in order."""

    def __init__(self, server: AuthzHttp) -> None:
        self._server = server
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is not an asyncio.Transport subclass: typed, not checked
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._next()

    def _next(self) -> None:
        """Answer the complete requests in the buffer, in order: at once while their
        picks need not wait, else the first that must in a task (the rest after it)."""
        while self._one():
            pass

    def _one(self) -> bool:
        """Answer the next complete request in the buffer; True when it was answered at
        once and the buffer may hold another."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                self._fail(_BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes"))
            return False
        if end > MAX_HEAD_BYTES:
            self._fail(_BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes"))
            return False
        try:
            _method, path, headers, length = parse_head(bytes(self._buf[:end]))
        except _BadRequest as err:
            self._fail(err)
            return False
        picker = self._server.picker
        if length > picker.settings.max_body_bytes:
            refusal = picker.too_large()
            count_refusal(refusal)
            self._write(refused(refusal))
            self.close()
            return False
        if len(self._buf) < end + 4 + length:
            return False  # the body is still coming
        body = bytes(self._buf[end + 4:end + 4 + length])
        del self._buf[:end + 4 + length]
        try:
            now = self._server.answer_now(path, headers, body)
        except Exception as err:  # a bug: logged, never a half answer
            log.error("gateway_authz_http_failed", error=repr(err))
            self.close()
            return False
        if now is not None:
            self._write(now)
            return self._open() and bool(self._buf)
        self._busy = True
        task = asyncio.ensure_future(self._server.answer(path, headers, body, self._open))
        task.add_done_callback(self._answered)
        return False

    def _answered(self, task: asyncio.Future[bytes]) -> None:
        self._busy = False
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():  # a bug: logged, never a half answer
                log.error("gateway_authz_http_failed", error=repr(task.exception()))
            self.close()
            return
        self._write(task.result())
        if self._open() and self._buf:
            self._next()

    def _write(self, data: bytes) -> None:
        if self._open():
            assert self._transport is not None
            self._transport.write(data)

    def _fail(self, err: _BadRequest) -> None:
        gm.IMMEDIATE.labels(str(err.code)).inc()
        body = json.dumps({"error": {"message": str(err), "code": err.code}}).encode()
        self._write(response(err.code, [("content-type", "application/json")], body))
        self.close()


async def serve(server: AuthzHttp, host: str, port: int) -> tuple[asyncio.Server, int]:
    """Listen on ``host:port`` (0 = any free port); returns the server and its port."""
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(server.protocol, host, port, reuse_address=True)
    return srv, srv.sockets[0].getsockname()[1]
