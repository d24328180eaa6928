"""The unary picker path: Envoy's ext_authz ``Check`` picks, its gRPC access log releases.

An ext_proc stream costs the picker a stream and two messages each way per HTTP request
even in the lean mode; most of the picker's CPU per request is grpc.aio's per-message
work, not the pick (BENCHMARKS.md, "Gateway CPU per request"). This mode asks Envoy for
exactly what the pick and the release need, in the cheapest shape Envoy offers:

- **the pick**: ``envoy.service.auth.v3.Authorization/Check``, one unary call per HTTP
  request. Envoy's ext_authz filter buffers the body (``with_request_body``,
  ``pack_as_bytes``) and sends it with ``:path`` and the allowed headers (the tenancy
  headers). The answer is an OK response that adds the destination header
  (``x-gateway-destination-endpoint``), the P/D prefiller header when there is one, and
  ``x-fulcrum-placement`` (the placement's token: its request id and 64 random bits,
  :func:`placement_token`); ``clear_route_cache`` re-routes the
  request to the header-matched route, as the ext_proc answer does. A refusal is a denied
  response with the same HTTP status, headers and JSON body as the ext_proc path's
  immediate response (429 with ``retry-after``, 413, 400, 503).
- **the release**: ``envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs``, one
  long-lived stream per Envoy worker on which Envoy batches an entry per finished HTTP
  request (``buffer_flush_interval``). Each entry's logged ``x-fulcrum-placement``
  request header releases that placement (reason ``access_log``); an entry without one
  (a request Envoy answered itself, or one the picker refused) releases nothing. The
  entry's :data:`TTFT_TAG` (Envoy's time from the request sent upstream to the first
  response body byte) is handed to the picker first: a streamed response's time to first
  token, the online cost refit's sample, as the full mode's first body chunk is.
- **what cannot be lost**: a ``Check`` cancelled after its pick (Envoy's timeout, the
  client gone) never put the token on the request, so no entry would release it: the
  call's done callback releases it (reason ``check_cancelled``). An entry Envoy drops
  (its access-log buffer full while the stream is down) would leave a placement held:
  every placement of this path is released at the latest ``gateway.max_hold_s`` after
  its pick (reason ``expired``, counted), swept on every call of either service, so the
  table of held placements stays bounded by ``gateway.max_in_flight`` and time.

Limits (docs/gateway-limits.md): the body is capped by ``with_request_body.
max_request_bytes`` (Envoy answers 413 above it); no response message reaches the picker,
so P/D marks its prefill done at the release, and the refit's sample arrives with the
release; the release comes up to one access-log flush interval after the response ended.

Event loop only: both servicers run on the daemon's loop and touch the picker there.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2 as ea
from envoy.service.auth.v3 import external_auth_pb2_grpc as ea_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from fulcrum.core.tenants import RequestClass
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.adapter import Placement
from fulcrum.gateway.body import BodyTooDeep
from fulcrum.gateway.extproc import (
    _STATUS,
    ANSWER_CACHE_MAX,
    DEST_HEADER,
    PREFILLER_HEADER,
    Picker,
    Refusal,
    count_refusal,
    destination_value,
    refusal_body,
    refusal_headers,
    subset_in,
)
from fulcrum.gateway.tenancy import classify

AUTHZ_SERVICE: str = ea.DESCRIPTOR.services_by_name["Authorization"].full_name
ACCESS_LOG_SERVICE: str = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"].full_name

#: The request header that carries a placement's token from the pick to the access log.
PLACEMENT_HEADER = "x-fulcrum-placement"
#: The access log's custom tag with the time from the first byte sent upstream to the
#: first response body byte, microseconds (Envoy's formatter, :data:`TTFT_FORMAT`): a
#: streamed response's time to first token, the sample of the online cost refit.
TTFT_TAG = "fulcrum_ttft_us"
TTFT_FORMAT = "%COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%"
#: Largest time to first body byte read from an entry, microseconds (an hour).
TTFT_MAX_US = 3_600_000_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_OK = status_pb2.Status(code=code_pb2.OK)
_DENIED = status_pb2.Status(code=code_pb2.PERMISSION_DENIED)


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # ext_authz reads ``value`` (a ``raw_value`` answer is taken as an empty value).
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE
    )


class Leases:
    """The placements picked over ``Check`` and not yet released, oldest first (event
    loop only). Each is released by its access-log entry, its cancelled call, or at the
    latest ``max_hold_ns`` after its pick by :meth:`sweep`."""

    __slots__ = ("_due", "_picker")

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        #: token -> (the time it expires, ns; its placement). Insertion order is pick
        #: order and every lease gets the same hold, so the first entry expires first.
        self._due: dict[str, tuple[int, Placement]] = {}

    def __len__(self) -> int:
        return len(self._due)

    def add(self, placement: Placement, now_ns: int, token: str) -> None:
        """Hold ``placement`` under ``token`` until its release or ``max_hold_s``."""
        hold_ns = int(self._picker.settings.max_hold_s * 1e9)
        self._due[token] = (now_ns + hold_ns, placement)

    def release(self, token: str, reason: str, ttft_ns: float | None = None) -> bool:
        """Release the placement of ``token`` (False when it is not held here), first
        handing the picker its observed time to first body byte (``ttft_ns``, ns) when
        the access log measured one."""
        got = self._due.pop(token, None)
        if got is None:
            return False
        if ttft_ns is not None:
            self._picker.first_chunk(got[1], ttft_ns)
        self._picker.release(got[1], reason)
        return True

    def holds(self, token: str) -> bool:
        """Whether ``token`` names a placement held here."""
        return token in self._due

    def sweep(self, now_ns: int) -> int:
        """Release every lease past its hold (reason ``expired``); returns how many."""
        due = self._due
        n = 0
        while due:
            token = next(iter(due))
            at, placement = due[token]
            if at > now_ns:
                break
            del due[token]
            self._picker.release(placement, "expired")
            n += 1
        return n


def wanted(headers: Any, names: frozenset[str]) -> list[base_pb2.HeaderValue]:
    """The tenancy headers among a request's headers (a mapping with lower-case keys:
    a CheckRequest's, or the HTTP mode's)."""
    if not names:
        return []
    return [base_pb2.HeaderValue(key=k, value=v) for k, v in headers.items() if k in names]


class AuthzServicer(ea_grpc.AuthorizationServicer):  # type: ignore[misc]
    """``Check``: one pick per HTTP request (see the module docstring)."""

    def __init__(self, picker: Picker, leases: Leases, clock: Callable[[], int]) -> None:
        self._picker = picker
        self._leases = leases
        self._clock = clock
        self._answers: dict[tuple[str, str], list[base_pb2.HeaderValueOption]] = {}

    async def Check(self, request: ea.CheckRequest, context: Any) -> ea.CheckResponse:
        picker, leases = self._picker, self._leases
        http = request.attributes.request.http
        body = http.raw_body or (http.body.encode() if http.body else b"")
        if len(body) > picker.settings.max_body_bytes:
            refusal = picker.too_large()
            count_refusal(refusal)
            return _denied(refusal)
        subset = subset_in(request.attributes.metadata_context, picker.settings.subset_namespace)
        got = await check(picker, leases, self._clock, body, http.path, subset, http.headers)
        if isinstance(got, Refusal):
            return _denied(got)
        out, token = got
        context.add_done_callback(
            lambda ctx: ctx.cancelled() and leases.release(token, "check_cancelled")
        )
        # No dynamic metadata: Envoy files a Check answer's under the ext_authz filter's
        # own namespace, where no load balancer reads it; the route reads the header.
        answer = ea.OkHttpResponse(headers=self._headers(out, token))
        return ea.CheckResponse(status=_OK, ok_response=answer)

    def _headers(self, placement: Placement, token: str) -> list[base_pb2.HeaderValueOption]:
        value = destination_value(placement)
        key = (value, placement.prefiller)
        base = self._answers.get(key)
        if base is None:
            base = [_header(k, v) for k, v in answer_headers(placement, value)]
            if len(self._answers) >= ANSWER_CACHE_MAX:
                self._answers.clear()
            self._answers[key] = base
        return [*base, _header(PLACEMENT_HEADER, token)]


def _admit(picker: Picker, leases: Leases, clock: Callable[[], int],
           headers: Any) -> RequestClass | Refusal:
    """The first part of every pick of the unary and HTTP modes: expired leases swept,
    the bound on picks under way, the request's class from its tenancy headers."""
    s = picker.settings
    leases.sweep(clock())
    if picker.streams >= s.max_streams:
        refusal = Refusal(429, "streams", f"gateway: {s.max_streams} picks under way "
                          "(gateway.max_streams)", s.retry_after_s)
        count_refusal(refusal, refused=True)
        return refusal
    return classify(picker.tenancy, s.tenancy, wanted(headers, picker.tenancy_headers))


def _leased(leases: Leases, clock: Callable[[], int],
            out: Placement | Refusal) -> tuple[Placement, str] | Refusal:
    """The last part: a refusal counted, or the placement leased under a new token."""
    if isinstance(out, Refusal):
        count_refusal(out)
        return out
    token = placement_token(out.request_id)
    leases.add(out, clock(), token)
    return out, token


def _too_deep(err: BodyTooDeep) -> Refusal:
    gm.REFUSED.labels("too_deep").inc()
    return Refusal(400, "too_deep", str(err))


async def check(
    picker: Picker, leases: Leases, clock: Callable[[], int], body: bytes, path: str,
    subset: list[str] | None, headers: Any,
) -> tuple[Placement, str] | Refusal:
    """One pick of the unary and HTTP modes: the bound on picks under way, the request's
    class from its tenancy headers (``headers``: a mapping with lower-case keys), the
    pick, and its lease under a new token. A refusal comes back counted."""
    cls = _admit(picker, leases, clock, headers)
    if isinstance(cls, Refusal):
        return cls
    picker.streams += 1
    try:
        out = await picker.pick_full(body, path, subset, cls)
    except BodyTooDeep as err:
        out = _too_deep(err)
    finally:
        picker.streams -= 1
    return _leased(leases, clock, out)


def check_now(
    picker: Picker, leases: Leases, clock: Callable[[], int], body: bytes, path: str,
    subset: list[str] | None, headers: Any,
) -> tuple[Placement, str] | Refusal | None:
    """:func:`check` without awaiting, on the caller's own callback: None (nothing
    done) when its pick would wait (:meth:`Picker.answers_at_once`: a worker thread's
    parse, a prefill placement), then :func:`check` it. Saves the HTTP mode a task and
    two turns of the event loop per request."""
    if not picker.answers_at_once(body):
        return None
    cls = _admit(picker, leases, clock, headers)
    if isinstance(cls, Refusal):
        return cls
    try:
        out = picker.pick(body, path, subset, None, cls)
    except BodyTooDeep as err:
        out = _too_deep(err)
    return _leased(leases, clock, out)


def answer_headers(placement: Placement, destination: str | None = None) -> list[tuple[str, str]]:
    """The headers an OK pick adds to the request, before its placement token (both the
    gRPC and the HTTP answer): the destination (``destination``: its value when the
    caller has it) and, under P/D, the prefiller."""
    value = destination_value(placement) if destination is None else destination
    out = [(DEST_HEADER, value)]
    if placement.prefiller:
        out.append((PREFILLER_HEADER, placement.prefiller))
    return out


def placement_token(request_id: str) -> str:
    """A placement's token: its request id and 64 random bits (``secrets``). Anyone who
    reaches the picker's port can send access-log entries; with a request id alone
    (``gw-N``, sequential) they could release other requests' placements, which an
    ext_proc stream, its own handle, does not allow."""
    return f"{request_id}.{secrets.token_hex(8)}"


def _denied(refusal: Refusal) -> ea.CheckResponse:
    """The HTTP answer of a refusal, counted already (the ext_proc path's status,
    headers and body)."""
    headers = [_header(k, v) for k, v in refusal_headers(refusal)]
    return ea.CheckResponse(
        status=_DENIED,
        denied_response=ea.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=_STATUS[refusal.code]),
            headers=headers,
            body=refusal_body(refusal),
        ),
    )


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """``StreamAccessLogs``: each finished HTTP request's entry releases its placement."""

    def __init__(self, leases: Leases, clock: Callable[[], int]) -> None:
        self.leases = leases
        self._clock = clock
        #: Set by :meth:`close`: every open stream answers and ends.
        self._closing = asyncio.Event()
        self.open_streams = 0

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        leases = self.leases
        it = aiter(request_iterator)
        closing = asyncio.ensure_future(self._closing.wait())
        read: asyncio.Future[Any] | None = None
        self.open_streams += 1
        try:
            while True:
                # A read races the daemon's stop (messages are batched by Envoy, a few
                # tens a second at most, so a task per read costs little).
                read = asyncio.ensure_future(anext(it))
                await asyncio.wait((read, closing), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    break  # closing: the read is dropped below
                try:
                    msg = read.result()
                except StopAsyncIteration:
                    break
                released = release_entries(leases, msg.http_logs.log_entry)
                if released:
                    gm.ACCESS_LOG_ENTRIES.labels("released").inc(released)
                leases.sweep(self._clock())
        finally:
            closing.cancel()
            if read is not None:
                # Dropped (closing, or this handler cancelled, maybe just as the stream
                # ended): take its outcome, now or when it ends, so that asyncio reports
                # no exception never retrieved.
                if not read.done():
                    read.cancel()
                read.add_done_callback(_retrieve)
            self.open_streams -= 1
        return als_pb2.StreamAccessLogsResponse()

    def close(self) -> None:
        """End the open access-log streams with an answer (the daemon stops: an Envoy
        stays connected for ever, so they would hold the server's grace period to its
        end). Idempotent."""
        self._closing.set()


def _retrieve(read: asyncio.Future[Any]) -> None:
    """Take a dropped read's outcome (the end of the stream, or its cancellation), so
    that asyncio does not report an exception never retrieved."""
    if not read.cancelled():
        read.exception()


def entry_ttft_ns(entry: Any) -> float | None:
    """The entry's time to first response body byte (ns) from its :data:`TTFT_TAG`, or
    None: absent or empty (counted ``missing``), or not whole microseconds up to
    :data:`TTFT_MAX_US` (counted ``malformed``)."""
    raw = entry.common_properties.custom_tags.get(TTFT_TAG, "")
    if not raw:
        gm.ACCESS_LOG_TTFT.labels("missing").inc()
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 10 or int(raw) > TTFT_MAX_US:
        gm.ACCESS_LOG_TTFT.labels("malformed").inc()
        return None
    gm.ACCESS_LOG_TTFT.labels("read").inc()
    return int(raw) * 1_000.0


def release_entries(leases: Leases, entries: Iterable[Any]) -> int:
    """Release the placement named by each entry's logged ``x-fulcrum-placement``
    header, handing the picker the entry's time to first body byte on the way
    (:func:`entry_ttft_ns`); returns how many were held. Entries without a held token
    are counted as ``unknown`` (Envoy's own answers, refusals, a token already
    released) and their times are not read."""
    n = unknown = 0
    for entry in entries:
        token = entry.request.request_headers.get(PLACEMENT_HEADER, "")
        if token and leases.holds(token):
            leases.release(token, "access_log", entry_ttft_ns(entry))
            n += 1
        else:
            unknown += 1
    if unknown:
        gm.ACCESS_LOG_ENTRIES.labels("unknown").inc(unknown)
    return n


def add_to_server(
    server: grpc.aio.Server, picker: Picker, clock: Callable[[], int]
) -> AccessLogServicer:
    """Add the ``Check`` and access-log servicers (sharing one lease table); returns the
    access-log servicer (its ``leases``, and ``close`` for the daemon's stop)."""
    leases = Leases(picker)
    access_log = AccessLogServicer(leases, clock)
    ea_grpc.add_AuthorizationServicer_to_server(AuthzServicer(picker, leases, clock), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    return access_log
